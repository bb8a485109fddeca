"""Small shared building blocks: RMS norms, the SwiGLU MLP and rotary embeddings."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels.backends import BackendChoice
from ..kernels.norm import gated_rms_norm


class RMSNorm(nn.Module):
    """`weight * x / rms(x)`, normalised in fp32 and cast back before the weight, as Kimi-Linear does."""

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)

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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def apply_rotary(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotate the last dim of `x` by position (rotate-half / GPT-NeoX layout), computed in fp32.

    Args:
        x: [N, ..., D] with D even; N tokens.
        positions: [N] absolute positions.
    """
    d = x.shape[-1]
    inv_freq = 1.0 / (theta ** (torch.arange(0, d, 2, device=x.device, dtype=torch.float32) / d))
    freqs = positions.to(torch.float32)[:, None] * inv_freq[None, :]  # [N, D/2]
    cos = freqs.cos().repeat(1, 2).view(x.shape[0], *([1] * (x.dim() - 2)), d)
    sin = freqs.sin().repeat(1, 2).view(x.shape[0], *([1] * (x.dim() - 2)), d)
    xf = x.float()
    x1, x2 = xf[..., : d // 2], xf[..., d // 2 :]
    rotated = torch.cat((-x2, x1), dim=-1)
    return (xf * cos + rotated * sin).to(x.dtype)
