"""Multi-head Latent Attention (MLA), with the compressed latent as its only cache.

Per token the cache holds `c = kv_a_layernorm(kv_a_proj(x)[:r])` (r = kv_lora_rank) and the shared rope key
`k_pe` (Kimi-Linear: never rotated), `r + rope` values (576) per MLA layer. Attention runs in one of two forms that
compute the same function:

- expanded: `kv_b_proj(c)` gives per-head `k_nope` and `v`; keys are `[k_nope, k_pe]`. Cheap per query when many
  queries share the keys (prefill).
- absorbed: `W_UK` is folded into the query (`q_lat = q_nope @ W_UK`), attention is MQA with one shared 576-d key
  `[c, k_pe]` and value `c`, and `W_UV` maps the latent output back. Reads only the latent (decode).

The softmax scale is `(qk_nope_head_dim + qk_rope_head_dim) ** -0.5` in both forms.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels.backends import BackendChoice
from .batch import ForwardBatch
from .config import KimiK3Config
from .layers import Linear, RMSNorm, apply_rotary, fused_projections
from .packing import WeightPack
from .paged_mla import absorb_query, paged_mla_attention, unabsorb_output


def softmax_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, q_offset: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal softmax attention of one sequence, in fp32; the reference for every MLA kernel.

    Args:
        q: [Tq, H, D] queries; query j sits at position `q_offset + j` and sees keys `0 .. q_offset + j`.
        k: [Tk, Hk, D] keys, Hk in {1, H} (1: shared across heads, as in absorbed MLA).
        v: [Tk, Hk, Dv] values.
    Returns:
        out [Tq, H, Dv] in q's dtype and lse [Tq, H] (fp32, natural log; -inf where no key is visible).
    """
    tq, tk = q.shape[0], k.shape[0]
    scores = torch.einsum("qhd,khd->hqk", q.float(), k.float().expand(tk, q.shape[1], -1)) * scale
    visible = torch.arange(tk, device=q.device)[None, :] <= (q_offset + torch.arange(tq, device=q.device))[:, None]
    scores = scores.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [H, Tq]
    probs = torch.exp(scores - lse[..., None]).nan_to_num(0.0)
    out = torch.einsum("hqk,khd->qhd", probs, v.float().expand(tk, q.shape[1], -1))
    return out.to(q.dtype), lse.transpose(0, 1)


def mla_expanded(
    q: torch.Tensor, latent: torch.Tensor, kv_b_weight: torch.Tensor, nope: int, v_dim: int, scale: float, q_offset: int
) -> torch.Tensor:
    """Expanded-form MLA of one sequence.

    Args:
        q: [Tq, H, nope + rope] queries (rope part already rotated if RoPE is on).
        latent: [Tk, r + rope] cached latents `[c, k_pe]`.
        kv_b_weight: [H * (nope + v_dim), r].
    Returns:
        [Tq, H, v_dim].
    """
    h = q.shape[1]
    r = kv_b_weight.shape[1]
    c, k_pe = latent[:, :r], latent[:, r:]
    kv = F.linear(c, kv_b_weight).view(-1, h, nope + v_dim)
    k_nope, v = kv[..., :nope], kv[..., nope:]
    k = torch.cat([k_nope, k_pe[:, None, :].expand(-1, h, -1)], dim=-1)
    return softmax_attention(q, k, v, scale, q_offset)[0]


def mla_absorbed(
    q: torch.Tensor, latent: torch.Tensor, kv_b_weight: torch.Tensor, nope: int, v_dim: int, scale: float, q_offset: int
) -> torch.Tensor:
    """Weight-absorbed MLA of one sequence: MQA over the latent. Same arguments and result as `mla_expanded`."""
    r = kv_b_weight.shape[1]
    q_lat = torch.cat([absorb_query(q[..., :nope], kv_b_weight, nope, v_dim), q[..., nope:]], dim=-1)
    o_lat, _ = softmax_attention(q_lat, latent[:, None, :], latent[:, None, :r], scale, q_offset)
    return unabsorb_output(o_lat, kv_b_weight, nope, v_dim)


class MLAttention(nn.Module):
    """MLA layer (`self_attn` of a full-attention layer). Tensor names follow Kimi-Linear checkpoints."""

    def __init__(self, config: KimiK3Config, layer_idx: int):
        super().__init__()
        self.backends = BackendChoice()  # the model's choice, set by `KimiK3Model.set_backends`
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.nope = config.qk_nope_head_dim
        self.rope = config.qk_rope_head_dim
        self.v_dim = config.v_head_dim
        self.kv_lora_rank = config.kv_lora_rank
        self.use_rope = not config.mla_use_nope
        self.rope_theta = config.rope_theta
        self.scale = (self.nope + self.rope) ** -0.5
        d, h = config.hidden_size, self.num_heads
        self.q_lora = config.q_lora_rank is not None
        self.output_gate = config.mla_use_output_gate
        if not self.q_lora:
            self.q_proj = Linear(d, h * (self.nope + self.rope))
        else:
            self.q_a_proj = Linear(d, config.q_lora_rank)
            self.q_a_layernorm = RMSNorm(config.q_lora_rank)  # eps 1e-6, as in Kimi/DeepSeek
            self.q_b_proj = Linear(config.q_lora_rank, h * (self.nope + self.rope))
        self.kv_a_proj_with_mqa = Linear(d, self.kv_lora_rank + self.rope)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank)
        self.kv_b_proj = Linear(self.kv_lora_rank, h * (self.nope + self.v_dim))
        if config.mla_use_output_gate:
            self.g_proj = Linear(d, h * self.v_dim)
        self.o_proj = Linear(h * self.v_dim, d)
        self._x_pack = WeightPack()  # the x projections' rows

    def _x_linears(self) -> list[nn.Linear]:
        """The projections that read the layer input x, in their order in the packed weight (read from `_modules`
        directly: this runs every call, and a submodule attribute goes through `nn.Module.__getattr__`)."""
        m = self._modules
        first = [m["q_a_proj"] if self.q_lora else m["q_proj"], m["kv_a_proj_with_mqa"]]
        return first + [m["g_proj"]] if self.output_gate else first

    def project(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Queries [T, H, nope + rope], new cache latents [T, r + rope] and the output gate's pre-activation
        [T, H * v_dim] (None without one) for packed tokens x [T, d]: the projections of x in one launch
        (`fused_projections`)."""
        outs = fused_projections(x, self._x_linears(), self._x_pack)
        q, ckv, gate = outs[0], outs[1], (outs[2] if self.output_gate else None)
        q = self.q_b_proj(self.q_a_layernorm(q)) if self.q_lora else q
        q = q.view(x.shape[0], self.num_heads, self.nope + self.rope)
        c, k_pe = ckv.split([self.kv_lora_rank, self.rope], dim=-1)
        if self.use_rope:
            rotate = functools.partial(apply_rotary, theta=self.rope_theta, backend=self.backends.kernels)
            q = torch.cat([q[..., : self.nope], rotate(q[..., self.nope :], positions)], -1)
            k_pe = rotate(k_pe, positions)
        return q, torch.cat([self.kv_a_layernorm(c), k_pe], dim=-1), gate

    def forward(self, x: torch.Tensor, batch: ForwardBatch, cache) -> torch.Tensor:
        """x [T, d] packed tokens -> [T, d]. `cache.mla_latents` gives this layer's pages and this step's
        addressing (`PagedLatents`); the new latents are stored there and attended per declared phase."""
        q, latent, gate = self.project(x, batch.positions)
        kv = cache.mla_latents(self.layer_idx, batch, like=latent)
        o = paged_mla_attention(self, q, latent, batch, kv).reshape(x.shape[0], -1)
        if gate is not None:
            o = o * torch.sigmoid(gate)
        return self.o_proj(o)
