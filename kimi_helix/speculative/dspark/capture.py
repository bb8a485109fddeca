"""Capture of target hidden states for the drafter, through forward hooks on the configured target layers."""

from __future__ import annotations

import torch
from torch import nn


class TargetFeatureCapture:
    """Forward hooks on `target.model.layers[i]` for i in `layer_ids` (0-based; never the final layer, whose
    output is the normed state the LM head reads).

    Use as a context manager around target forwards, or keep it attached (`attach` / `detach`).

    - Without `max_tokens` (training): after a forward, `pop()` returns the captured outputs concatenated in
      `layer_ids` order, [..., T, m*d] (the layers' own token layout), and clears them.
    - With `max_tokens` (the engine): the hooks hold their layers' packed outputs [T, d], and the last captured
      layer's hook concatenates them into a static feature buffer [max_tokens, m*d] that the capture owns (one
      launch a forward). A copy into a preallocated tensor is recorded by a CUDA graph and replayed with it, so
      the engine's graphed steps fill the buffer too (the hooks say so with
      `graph_safe`, which `engine.cuda_graph.StepGraphs` reads). `pop(num_tokens)` returns a view of the first
      `num_tokens` rows, valid until the next target forward.
    """

    def __init__(self, target: nn.Module, layer_ids: list[int], max_tokens: int | None = None):
        layers = target.model.layers
        final = len(layers) - 1
        bad = [i for i in layer_ids if not 0 <= i < final]
        if bad:
            raise ValueError(
                f"target_layer_ids {bad} cannot be captured: layers are 0-based in 0..{final - 1} "
                f"(the final layer {final} is never a feature)"
            )
        if max_tokens is not None and (not isinstance(max_tokens, int) or max_tokens < 1):
            raise ValueError(f"max_tokens must be None or an int >= 1, got {max_tokens!r}")
        self._layers = [layers[i] for i in layer_ids]
        self._last = max(range(len(layer_ids)), key=layer_ids.__getitem__)  # the captured layer that runs last
        self._outputs: list[torch.Tensor | None] = [None] * len(layer_ids)
        self._handles: list = []
        self.buffer: torch.Tensor | None = None  # [max_tokens, m*d] in static mode
        if max_tokens is not None:
            weight = target.get_input_embeddings().weight
            self._width = target.config.hidden_size
            self.buffer = torch.zeros(
                max_tokens, len(layer_ids) * self._width, dtype=weight.dtype, device=weight.device
            )

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
        if self.buffer is None:

            def store(module, args, output):
                self._outputs[slot] = output.detach()

            return store
        d, buffer, outputs = self._width, self.buffer, self._outputs
        last = slot == self._last

        def copy(module, args, output):
            rows = output.detach().reshape(-1, d)
            if rows.shape[0] > buffer.shape[0]:
                raise ValueError(f"a target forward of {rows.shape[0]} tokens exceeds max_tokens={buffer.shape[0]}")
            outputs[slot] = rows  # held (not freed, so not reused) until the last captured layer has run
            if last:  # every captured layer's rows into the buffer in one launch
                torch.cat(outputs, dim=-1, out=buffer[: rows.shape[0]])
                outputs[:] = [None] * len(outputs)

        copy.graph_safe = True  # its only effect is a device copy into a static buffer: a replay repeats it
        return copy

    def pop(self, num_tokens: int | None = None) -> torch.Tensor:
        """The captured features: [..., T, m*d] (hook mode), or rows 0..num_tokens-1 of the static buffer
        [num_tokens, m*d] (static mode, where `num_tokens` is required: a replayed step cannot report it)."""
        if self.buffer is not None:
            if num_tokens is None or not 0 <= num_tokens <= self.buffer.shape[0]:
                raise ValueError(f"pop(num_tokens) needs 0 <= num_tokens <= {self.buffer.shape[0]}, got {num_tokens}")
            return self.buffer[:num_tokens]
        if any(o is None for o in self._outputs):
            raise RuntimeError("no target forward ran since the last pop() with the capture attached")
        out = torch.cat(self._outputs, dim=-1)
        self._outputs = [None] * len(self._outputs)
        return out

    def __enter__(self) -> TargetFeatureCapture:
        return self.attach()

    def __exit__(self, *exc) -> None:
        self.detach()
