"""Small shared building blocks: bias-free linear layers, RMS norms, the SwiGLU MLP and rotary embeddings."""

from __future__ import annotations

import torch
from torch import nn

from ..kernels.activation import silu_mul
from ..kernels.backends import BackendChoice
from ..kernels.linear import linear
from ..kernels.norm import add_rms_norm, gated_rms_norm
from ..kernels.rotary import rotary


class Linear(nn.Linear):
    """A bias-free `nn.Linear` (same parameter, same checkpoint name) whose forward is the `linear` op: the Triton
    GEMV for decode-sized calls on the GPU, the GEMM library otherwise. The choice is always automatic (a forced
    `kernel_backend` does not reach it): the GEMV serves at most 16 rows, and prefill GEMMs belong to the library."""

    def __init__(self, in_features: int, out_features: int):
        super().__init__(in_features, out_features, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., in_features] -> [..., out_features]."""
        return linear(x, self.weight)


def hooked(module: nn.Module) -> bool:
    """Whether `module` has forward (pre-)hooks, accelerate's included: what they see must stay as it is."""
    return bool(module._forward_hooks or module._forward_pre_hooks or hasattr(module, "_hf_hook"))


def plain_linear(lin: nn.Module, x: torch.Tensor) -> bool:
    """Whether reading `lin.weight` directly computes `lin(x)` (so several projections of x can share one launch):
    a bias-free `nn.Linear` or `Linear` (no other subclass, no wrapper), no forward hooks (accelerate's included),
    its weight on x's device."""
    return type(lin) in (nn.Linear, Linear) and lin.bias is None and not hooked(lin) and lin.weight.device == x.device


def fused_projections(x: torch.Tensor, linears: list[nn.Linear], pack=None) -> list[torch.Tensor]:
    """`[lin(x) for lin in linears]` for x [..., d], in one `linear` launch (automatic backend, as `Linear`) where
    every one is `plain_linear` (at most three). With `pack` (a `packing.WeightPack` of these linears) the weights
    become views of one packed weight where they can, so that prefill-sized calls are one GEMM too (the GEMM
    library takes one weight: separate weights would be a GEMM each and a concatenation)."""
    packed = None if pack is None else pack.weight(linears, x)
    if packed is not None:
        return list(linear(x, packed).split([lin.weight.shape[0] for lin in linears], dim=-1))
    if len(linears) > 3 or not all(plain_linear(lin, x) for lin in linears):
        return [lin(x) for lin in linears]
    y = linear(x, [lin.weight for lin in linears])
    return list(y.split([lin.weight.shape[0] for lin in linears], dim=-1))


class RMSNorm(nn.Module):
    """`weight * x / rms(x)`, normalised in fp32 and cast back before the weight, as Kimi-Linear does."""

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps
        self.backends = BackendChoice()  # the model's choice, set by `KimiK3Model.set_backends`

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., D] -> [..., D] (`kernels.norm.add_rms_norm`: one Triton kernel on the GPU)."""
        return add_rms_norm(x, None, self.weight, self.eps, backend=self.backends.kernels)[0]

    def forward_add(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual) for x, residual [..., D]: a pre-norm block's residual add and the
        next sublayer's norm in one kernel."""
        return add_rms_norm(x, residual, self.weight, self.eps, backend=self.backends.kernels)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


class GatedRMSNorm(nn.Module):
    """KDA output norm `rmsnorm(x) * weight * sigmoid(gate)` (`kernels.norm`); `o_norm` in Kimi checkpoints."""

    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps
        self.backends = BackendChoice()  # the model's choice, set by `KimiK3Model.set_backends`

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return gated_rms_norm(x, gate, self.weight, self.eps, backend=self.backends.kernels)


class SwiGLU(nn.Module):
    """`down(silu(gate(x)) * up(x))`: the dense MLP and the shared experts."""

    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_proj = Linear(hidden_size, intermediate_size)
        self.up_proj = Linear(hidden_size, intermediate_size)
        self.down_proj = Linear(intermediate_size, hidden_size)
        self.backends = BackendChoice()  # the model's choice, set by `KimiK3Model.set_backends`
        from .packing import WeightPack  # packing reads this module's `plain_linear`

        self._pack = WeightPack()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        m = self._modules
        gate, up = fused_projections(x, [m["gate_proj"], m["up_proj"]], self._pack)
        return self.down_proj(silu_mul(gate, up, backend=self.backends.kernels))


def apply_rotary(x: torch.Tensor, positions: torch.Tensor, theta: float, backend: str | None = None) -> torch.Tensor:
    """Rotate the last dim of `x` by position (rotate-half / GPT-NeoX layout), computed in fp32.

    Args:
        x: [N, ..., D] with D even; N tokens.
        positions: [N] absolute positions.
        backend: the kernel backend to force (None: automatic).

    Returns:
        [N, ..., D] in x.dtype (`kernels.rotary`: one Triton kernel on the GPU).
    """
    return rotary(x, positions, theta, backend=backend)
