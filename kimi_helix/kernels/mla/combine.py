"""Exact merge of partial attention results by log-sum-exp: split-KV decoding inside a GPU and Helix across ranks.

S partial results of the same query rows, each over a disjoint part of the keys, `(out_s [N, D], lse_s [N])`,
merge into `out = sum_s exp(lse_s - lse) * out_s` with `lse = log sum_s exp(lse_s)`. A part that saw no key is the
identity `(0, -inf)`; a row whose parts all saw none stays `(0, -inf)` (never `exp(-inf - -inf)` = NaN).
`sanitize_empty` imposes that identity on rows a kernel may have filled with garbage (normalised by a zero sum).
"""

from __future__ import annotations

import torch


def sanitize_empty(part_out: torch.Tensor, part_lse: torch.Tensor, has_keys: torch.Tensor):
    """Rows without keys become the combine identity: part_out [..., D] -> 0, part_lse [...] -> -inf.

    `has_keys` broadcasts against `part_lse` (e.g. [T, 1] against [T, H]).
    """
    out = torch.where(has_keys[..., None], part_out, torch.zeros((), dtype=part_out.dtype, device=part_out.device))
    lse = torch.where(has_keys, part_lse, torch.full((), float("-inf"), device=part_lse.device))
    return out, lse


def combine_partials_ref(part_out: torch.Tensor, part_lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge S partials: part_out [S, N, D], part_lse [S, N] fp32 -> out [N, D] (part_out's dtype), lse [N] fp32."""
    lse = part_lse.float()
    m = lse.amax(dim=0)
    m = torch.where(m == float("-inf"), 0.0, m)  # all parts empty: weights exp(-inf) = 0, not NaN
    w = torch.exp(lse - m)  # [S, N]
    denom = w.sum(dim=0)
    has_keys = denom > 0
    out = (w[..., None] * part_out.float()).sum(dim=0) / torch.where(has_keys, denom, 1.0)[:, None]
    return out.to(part_out.dtype), torch.where(has_keys, m + torch.log(denom), float("-inf"))


def combine_partials(
    part_out: torch.Tensor, part_lse: torch.Tensor, *, backend: str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """`combine_partials_ref` with the same signature; `backend` "triton" runs the split-KV decode's combine kernel
    (needs D a power of two; on the CPU only under the Triton interpreter), "torch" the reference; None picks Triton
    on CUDA when it applies."""
    s, n, d = part_out.shape
    if part_lse.shape != (s, n):
        raise ValueError(f"part_out [S, N, D] = {list(part_out.shape)} and part_lse {list(part_lse.shape)} disagree")
    pow2 = d > 0 and d & (d - 1) == 0
    if backend is None:
        backend = "triton" if part_out.is_cuda and pow2 else "torch"
    if backend not in ("torch", "triton"):
        raise ValueError(f"combine backend must be None, 'torch' or 'triton', got {backend!r}")
    if backend == "torch":
        return combine_partials_ref(part_out, part_lse)
    if not pow2:
        raise ValueError(f"the Triton combine needs D a power of two, got D={d}")
    from ..device import num_sms
    from .combine_triton import launch_combine

    rows_first = part_out.float().permute(1, 0, 2).contiguous()  # the kernel reads [N, S, D]
    lse_rows = part_lse.float().t().contiguous()
    out = torch.empty(n, d, dtype=part_out.dtype, device=part_out.device)
    lse = torch.empty(n, dtype=torch.float32, device=part_out.device)
    launch_combine(rows_first, lse_rows, out, lse, num_sms(part_out.device.index))
    return out, lse
