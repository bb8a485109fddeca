"""Capture of target hidden states for the drafter, through forward hooks on the configured target layers."""

from __future__ import annotations

import torch
from torch import nn


class TargetFeatureCapture:
    """Forward hooks on `target.model.layers[i]` for i in `layer_ids` (0-based; never the final layer, whose
    output is the normed state the LM head reads).

    Use as a context manager around target forwards, or keep it attached (`attach` / `detach`). After a forward,
    `pop()` returns the captured outputs concatenated in `layer_ids` order, [..., T, m*d] (the layers' own token
    layout: packed [T, d] on the engine path), and clears them.
    """

    def __init__(self, target: nn.Module, layer_ids: list[int]):
        layers = target.model.layers
        final = len(layers) - 1
        bad = [i for i in layer_ids if not 0 <= i < final]
        if bad:
            raise ValueError(
                f"target_layer_ids {bad} cannot be captured: layers are 0-based in 0..{final - 1} "
                f"(the final layer {final} is never a feature)"
            )
        self._layers = [layers[i] for i in layer_ids]
        self._outputs: list[torch.Tensor | None] = [None] * len(layer_ids)
        self._handles: list = []

    def attach(self) -> TargetFeatureCapture:
        if not self._handles:
            for slot, layer in enumerate(self._layers):
                self._handles.append(layer.register_forward_hook(self._hook(slot)))
        return self

    def detach(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _hook(self, slot: int):
        def store(module, args, output):
            self._outputs[slot] = output.detach()

        return store

    def pop(self) -> torch.Tensor:
        if any(o is None for o in self._outputs):
            raise RuntimeError("no target forward ran since the last pop() with the capture attached")
        out = torch.cat(self._outputs, dim=-1)
        self._outputs = [None] * len(self._outputs)
        return out

    def __enter__(self) -> TargetFeatureCapture:
        return self.attach()

    def __exit__(self, *exc) -> None:
        self.detach()
