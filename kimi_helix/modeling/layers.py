"""Small shared building blocks: RMS norms, the SwiGLU MLP and rotary embeddings."""

from __future__ import annotations

import torch
from torch import nn

from ..kernels.activation import silu_mul
from ..kernels.backends import BackendChoice
from ..kernels.norm import add_rms_norm, gated_rms_norm
from ..kernels.rotary import rotary


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
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)
        self.backends = BackendChoice()  # the model's choice, set by `KimiK3Model.set_backends`

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_mul(self.gate_proj(x), self.up_proj(x), backend=self.backends.kernels))


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
