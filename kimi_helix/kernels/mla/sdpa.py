"""MLA prefill through torch's scaled_dot_product_attention: fast on any device, but no LSE and no KV bounds."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kimi_helix.kernels.backends import ANY_DEVICE, FLOATS, KernelCaps
from kimi_helix.kernels.mla.naive import host_bounds

# What mla_prefill_sdpa serves, read by the backend switch: SDPA returns no LSE, so Helix cannot merge its output.
CAPS = KernelCaps(ANY_DEVICE, FLOATS, FLOATS, returns_lse=False, kv_bounds=False)


def mla_prefill_sdpa(q, k, v, cu_seqlens_q, cu_seqlens_k, scale, host_offsets=None):
    """Same contract as `mla_prefill_ref` (q [Tq, H, Dqk], k [Tk, H, Dqk], v [Tk, H, Dv], packed by cu_seqlens;
    queries are the last Tq_i positions of each sequence) but returns (out [Tq, H, Dv], None): SDPA gives no LSE."""
    out = q.new_empty(q.shape[0], q.shape[1], v.shape[-1])
    cq, ck = host_bounds(cu_seqlens_q, cu_seqlens_k, host_offsets)
    for i in range(len(cq) - 1):
        tq, tk = cq[i + 1] - cq[i], ck[i + 1] - ck[i]
        if tq == 0:
            continue
        qs, ks, vs = (
            t.transpose(0, 1)[None] for t in (q[cq[i] : cq[i + 1]], k[ck[i] : ck[i + 1]], v[ck[i] : ck[i + 1]])
        )
        visible = torch.arange(tk, device=q.device)[None, :] <= (tk - tq + torch.arange(tq, device=q.device))[:, None]
        o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=visible, scale=scale)
        out[cq[i] : cq[i + 1]] = o[0].transpose(0, 1)
    return out, None
