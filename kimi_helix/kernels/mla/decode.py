"""Triton kernel for weight-absorbed MLA attention (decode and speculative verify) over the paged latent cache.

Absorbed MLA is MQA over one shared latent per token, so the kernel packs every (query token, head) pair of a
sequence into the rows of one tile (BLOCK_M = BLOCK_Q tokens x BLOCK_H heads) and streams that sequence's latent
pages through it once: scores = q_c @ c^T + q_pe @ k_pe^T (two dots, since kv_lora_rank + rope is not a power of
two), online softmax in fp32 with exp2, then acc += P @ c with the same tile. When sequences x head blocks cannot
fill the GPU, each sequence's keys are split over several programs ("flash decoding") whose partial (out, lse) a
second kernel merges by LSE.

Host code never reads device values (no synchronisation, CUDA-graph friendly): per-sequence query counts are found
in the kernel, and tile shapes and the split count come from tensor shapes only.
"""

from __future__ import annotations

import math
import os
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from kimi_helix.kernels.device import num_sms
from kimi_helix.kernels.launch import cdiv, next_pow2

__all__ = ["SCHEDULES", "SUPPORTED", "TMA_MIN_WORK", "Schedule", "mla_decode_triton"]

FP8 = torch.float8_e4m3fn
_FLOATS = (torch.float32, torch.float16, torch.bfloat16)
_TL_DTYPE = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}

# What mla_decode_triton accepts; it raises ValueError for anything else (kept honest by the tests).
SUPPORTED = {
    "devices": ("cuda", "cpu under TRITON_INTERPRET=1"),
    "q_dtypes": _FLOATS,
    # fp8 and a cache of q's dtype compute in q's dtype; any other float pairing computes in fp32 (slow, exact).
    "kv_dtypes": (*_FLOATS, FP8),
    "num_heads": "any >= 1",
    "kv_lora_rank": tuple(2**i for i in range(4, 10)),  # 16 .. 512
    "rope_dim": (0, 16, 32, 64, 128),
    "page_size": "any >= 1",
    "s_q": "any >= 0 per sequence",
}


@triton.jit
def _raise_max(acc, l_i, m_i, m_tile):
    """Move the running row max up to include m_tile, rescaling the accumulator and the sum of weights."""
    m_new = tl.maximum(m_i, m_tile)
    alpha = tl.exp2(m_i - tl.where(m_new == float("-inf"), 0.0, m_new))
    return acc * alpha[:, None], l_i * alpha, m_new


@triton.jit
def _load_tile_gather(kv_ptr, pages_ptr, stride_kvp, stride_kvs, n, hi, PAGE_SIZE: tl.constexpr, DC: tl.constexpr,
                      DR: tl.constexpr, COMPUTE_DTYPE: tl.constexpr):  # fmt: skip
    """Keys n ([BLOCK_N]) of the sequence whose block-table row is pages_ptr, by a page lookup per key: (their cache
    slots page * PAGE_SIZE + offset, c, pe)."""
    n_ok = n < hi
    # Per-key page lookup: a tile may span several small pages or sit inside one large page.
    page = tl.load(pages_ptr + n // PAGE_SIZE, mask=n_ok, other=0).to(tl.int64)
    kv_row = kv_ptr + page * stride_kvp + (n % PAGE_SIZE) * stride_kvs
    # Masked-off keys load as 0, not as whatever stale bytes the page holds: 0 * NaN in P @ V would poison rows.
    dc = tl.arange(0, DC)
    c = tl.load(kv_row[:, None] + dc[None, :], mask=n_ok[:, None], other=0.0).to(COMPUTE_DTYPE)
    pe = c  # unused when DR == 0
    if DR > 0:
        dr = tl.arange(0, DR)
        pe = tl.load(kv_row[:, None] + DC + dr[None, :], mask=n_ok[:, None], other=0.0).to(COMPUTE_DTYPE)
    return page * PAGE_SIZE + n % PAGE_SIZE, c, pe


@triton.jit
def _load_tile_tma(kv_c_desc, kv_pe_desc, page, row, BLOCK_N: tl.constexpr, DC: tl.constexpr, DR: tl.constexpr):
    """Rows [row, row + BLOCK_N) of one page by TMA, zeros where row < 0: (c [BLOCK_N, DC], pe [BLOCK_N, DR])."""
    c = kv_c_desc.load([page, row, 0]).reshape(BLOCK_N, DC)
    pe = c  # unused when DR == 0
    if DR > 0:
        pe = kv_pe_desc.load([page, row, 0]).reshape(BLOCK_N, DR)
    return c, pe


@triton.jit
def _attend_tile(q_c, q_pe, c, pe, kv_scale_ptr, key_slot, n, lo, hi, bound, acc, l_i, m_i, qk_scale,
                 DR: tl.constexpr, COMPUTE_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr, IS_FP8: tl.constexpr,
                 RESCALE_SLACK: tl.constexpr):  # fmt: skip
    """The tile's keys n in [lo, hi) into the online softmax: scores, the running max and sum, acc += P @ c."""
    s = tl.dot(q_c, tl.trans(c), input_precision=DOT_PRECISION)
    if DR > 0:
        s = tl.dot(q_pe, tl.trans(pe), s, input_precision=DOT_PRECISION)
    visible = (n >= lo)[None, :] & (n[None, :] < bound[:, None])
    if IS_FP8:
        # Dequantise per key (column) in fp32 rather than per element of the tile: exact and cheaper.
        key_scale = tl.load(kv_scale_ptr + key_slot, mask=(n >= lo) & (n < hi), other=0.0)
        s = s * (key_scale * qk_scale)[None, :]
    else:
        s = s * qk_scale
    s = tl.where(visible, s, float("-inf"))
    m_tile = tl.max(s, axis=1)
    if RESCALE_SLACK > 0:
        # Lazy rescaling: keep the running max (and skip the [rows, DC] multiply of acc) until some row's max
        # grows by more than the slack; p <= 2^slack meanwhile, far from overflowing bf16 or the fp32 sums.
        grow = tl.where(m_tile > m_i, m_tile - m_i, 0.0)
        if tl.max(grow, axis=0) > RESCALE_SLACK:
            acc, l_i, m_i = _raise_max(acc, l_i, m_i, m_tile)
    else:
        acc, l_i, m_i = _raise_max(acc, l_i, m_i, m_tile)
    # Rows with no visible key so far keep m = -inf; offsetting by 0 instead keeps exp2 away from -inf - -inf.
    p = tl.exp2(s - tl.where(m_i == float("-inf"), 0.0, m_i)[:, None])
    l_i += tl.sum(p, axis=1)
    if IS_FP8:
        p = p * key_scale[None, :]
    acc = tl.dot(p.to(COMPUTE_DTYPE), c, acc, input_precision=DOT_PRECISION)
    return acc, l_i, m_i


@triton.jit
def mla_decode_fwd_kernel(
    q_ptr,
    kv_ptr,
    kv_c_desc,
    kv_pe_desc,
    kv_scale_ptr,
    block_table_ptr,
    cache_seqlens_ptr,
    cu_seqlens_q_ptr,
    kv_bounds_ptr,
    out_ptr,
    lse_ptr,
    qk_scale,
    num_seqs,
    num_heads,
    num_head_blocks,
    num_splits,
    stride_qt,
    stride_qh,
    stride_kvp,
    stride_kvs,
    stride_bt,
    PAGE_SIZE: tl.constexpr,
    DC: tl.constexpr,
    DR: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SEQS_POW2: tl.constexpr,
    COMPUTE_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    IS_FP8: tl.constexpr,
    HAS_BOUNDS: tl.constexpr,
    SPLIT: tl.constexpr,
    RESCALE_SLACK: tl.constexpr,
    USE_TMA: tl.constexpr,
):
    # Head blocks vary fastest so the programs sharing a sequence's latents run together and share them in L2.
    pid = tl.program_id(0)
    head_block = pid % num_head_blocks
    split = (pid // num_head_blocks) % num_splits
    slot = pid // (num_head_blocks * num_splits)

    # Sequence i owns query-chunk slots [f(i), f(i + 1)) with f(i) = (cu_q[i] + i * (BLOCK_Q - 1)) // BLOCK_Q: room
    # for its cdiv(s_q_i, BLOCK_Q) chunks, computable from cu_seqlens_q alone, so the host needs no max(s_q).
    idx = tl.arange(0, SEQS_POW2)
    cu = tl.load(cu_seqlens_q_ptr + idx, mask=idx <= num_seqs, other=0)
    first_slot = (cu + idx * (BLOCK_Q - 1)) // BLOCK_Q
    seq = tl.sum(((first_slot <= slot) & (idx <= num_seqs)).to(tl.int32), axis=0) - 1
    if seq >= num_seqs:
        return
    q_lo = tl.load(cu_seqlens_q_ptr + seq)
    q_hi = tl.load(cu_seqlens_q_ptr + seq + 1)
    tok0 = q_lo + (slot - (q_lo + seq * (BLOCK_Q - 1)) // BLOCK_Q) * BLOCK_Q
    if tok0 >= q_hi:
        return

    # Rows are (query token, head) pairs, each with its own number of visible keys.
    rows = tl.arange(0, BLOCK_Q * BLOCK_H)
    tok = tok0 + rows // BLOCK_H
    head = head_block * BLOCK_H + rows % BLOCK_H
    row_ok = (tok < q_hi) & (head < num_heads)
    kv_len = tl.load(cache_seqlens_ptr + seq)
    if HAS_BOUNDS:
        bound = tl.load(kv_bounds_ptr + tok, mask=row_ok, other=0)
    else:
        bound = kv_len - (q_hi - q_lo) + (tok - q_lo) + 1
    bound = tl.where(row_ok, tl.minimum(tl.maximum(bound, 0), kv_len), 0)

    # This split's key range; whole tiles so that no tile straddles two splits.
    split_len = tl.cdiv(tl.cdiv(kv_len, num_splits), BLOCK_N) * BLOCK_N
    lo = split * split_len
    hi = tl.minimum(lo + split_len, tl.max(bound, axis=0))
    bound = tl.minimum(bound, hi)

    dc = tl.arange(0, DC)
    q_row = q_ptr + tok.to(tl.int64) * stride_qt + head * stride_qh
    q_c = tl.load(q_row[:, None] + dc[None, :], mask=row_ok[:, None], other=0.0).to(COMPUTE_DTYPE)
    q_pe = q_c  # unused when DR == 0
    if DR > 0:
        dr = tl.arange(0, DR)
        q_pe = tl.load(q_row[:, None] + DC + dr[None, :], mask=row_ok[:, None], other=0.0).to(COMPUTE_DTYPE)

    m_i = tl.full([BLOCK_Q * BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_Q * BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_Q * BLOCK_H, DC], tl.float32)
    pages_ptr = block_table_ptr + seq * stride_bt
    for tile_lo in range(lo, hi, BLOCK_N):
        if USE_TMA:
            # A tile lies inside one page. A partial last tile is read as the window ending at the split's last key:
            # never the stale rows past a sequence's end (0 * NaN in P @ V would poison rows), but keys before the
            # tile (masked out) or, before the page's first row, TMA's zero fill.
            shift = BLOCK_N - tl.minimum(hi - tile_lo, BLOCK_N)
            page = tl.load(pages_ptr + tile_lo // PAGE_SIZE)
            c, pe = _load_tile_tma(kv_c_desc, kv_pe_desc, page, tile_lo % PAGE_SIZE - shift, BLOCK_N, DC, DR)
            c, pe = c.to(COMPUTE_DTYPE), pe.to(COMPUTE_DTYPE)
            n = tile_lo - shift + tl.arange(0, BLOCK_N)
            key_slot = page.to(tl.int64) * PAGE_SIZE + n % PAGE_SIZE
        else:
            n = tile_lo + tl.arange(0, BLOCK_N)
            key_slot, c, pe = _load_tile_gather(kv_ptr, pages_ptr, stride_kvp, stride_kvs, n, hi, PAGE_SIZE, DC, DR,
                                                COMPUTE_DTYPE)  # fmt: skip
        acc, l_i, m_i = _attend_tile(q_c, q_pe, c, pe, kv_scale_ptr, key_slot, n, tile_lo, hi, bound, acc, l_i, m_i,
                                     qk_scale, DR, COMPUTE_DTYPE, DOT_PRECISION, IS_FP8, RESCALE_SLACK)  # fmt: skip

    has_keys = l_i > 0
    l_safe = tl.where(has_keys, l_i, 1.0)
    out = acc / l_safe[:, None]
    lse = tl.where(has_keys, (m_i + tl.log2(l_safe)) * 0.6931471805599453, float("-inf"))
    row = tok.to(tl.int64) * num_heads + head
    if SPLIT:
        row = row * num_splits + split
    tl.store(out_ptr + row[:, None] * DC + dc[None, :], out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])
    tl.store(lse_ptr + row, lse, mask=row_ok)


@triton.jit
def mla_decode_combine_kernel(
    part_out_ptr,
    part_lse_ptr,
    out_ptr,
    lse_ptr,
    num_rows,
    num_splits,
    DC: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < num_rows
    rows = rows.to(tl.int64)
    dc = tl.arange(0, DC)
    m = tl.full([BLOCK_R], float("-inf"), tl.float32)
    for s in range(num_splits):
        m = tl.maximum(m, tl.load(part_lse_ptr + rows * num_splits + s, mask=row_ok, other=float("-inf")))
    # A split that saw no key has lse -inf and weight 0; a row whose splits all saw none stays zero with lse -inf.
    m_off = tl.where(m == float("-inf"), 0.0, m)
    denom = tl.zeros([BLOCK_R], tl.float32)
    acc = tl.zeros([BLOCK_R, DC], tl.float32)
    for s in range(num_splits):
        part = rows * num_splits + s
        w = tl.exp(tl.load(part_lse_ptr + part, mask=row_ok, other=float("-inf")) - m_off)
        denom += w
        acc += w[:, None] * tl.load(part_out_ptr + part[:, None] * DC + dc[None, :], mask=row_ok[:, None], other=0.0)
    has_keys = denom > 0
    denom = tl.where(has_keys, denom, 1.0)
    out = acc / denom[:, None]
    tl.store(out_ptr + rows[:, None] * DC + dc[None, :], out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])
    tl.store(lse_ptr + rows, tl.where(has_keys, m_off + tl.log(denom), float("-inf")), mask=row_ok)


# Programs per SM that the split count aims for by default: sequences of unequal length leave SMs idle at the end
# of the last wave unless each SM gets several programs to balance over.
MIN_WAVES = 4


class Schedule(NamedTuple):
    """How one tile class runs: keys per tile, warps, pipeline stages, the lazy-rescale slack (log2 units; 0
    rescales the accumulator whenever a row max grows), the programs per SM its split count aims for, the fewest
    tiles a split keeps, and whether whole tiles are copied by TMA (where the cache allows, see `_tma_ok`, and the
    launch is large enough, see `TMA_MIN_WORK`)."""

    block_n: int
    num_warps: int
    num_stages: int
    rescale_slack: float
    min_waves: int = MIN_WAVES
    min_split_tiles: int = 4
    tma: bool = False


# By (KV element bytes, tile rows) for 16-bit compute, the best of scripts/tune_mla_decode.py on an H200 (bf16,
# D=576, b=128, mean s_k=8192, commit a6cf40c): rows=16 (H=16) 0.43 ms, rows=32 (H=32) 0.54 ms, where lazy
# rescaling pays; rows=64 (H=128) 1.36 ms, where it costs 25%. The fp8 entries from the same sweep at e835326:
# rows=16 0.79 ms with BLOCK_N=64 (1.10 ms with 128), rows=64 2.09 ms; rows=32 was not swept and follows rows=16.
# BLOCK_N=256 (or 128 at 64 rows) overflows shared memory. Run 11 (commit b1c6eed) also swept one-stage schedules
# and 32-key tiles for 16 and 32 rows (all slower) and confirmed these. Splitting the 32-row class for 8 programs
# an SM instead of 4 (commit b3f3b3e, the whole bench_mla.py grid) gained 4-18% at b=128 and at b=32 with 32k keys
# but lost 5-20% at b=32 with 4k-8k keys, where a split kept only about 4 tiles. Keeping at least 8 tiles a split
# as well (run 11, timed in one call against 4 programs an SM and 4 tiles, 8 cases): b=128 12% faster to 1% slower,
# b=32 7-9% faster at 4k keys and 2-3% slower at 8k; at 32k keys the split counts are those of the b3f3b3e grid.
# TMA tiles (run 13, `tune_mla_decode.py --tma` at b53ddaa, every candidate beside the gathered schedules) win
# where the tile is compute-heavy or converted from fp8: rows=64 1.13 ms against 1.37 (H=128; H=16 at s_q=4 0.64
# against 0.73), fp8 rows=64 1.66 against 2.03 and fp8 rows=16 0.74 against 0.86; gathered 128-key tiles stay
# ahead at bf16 rows=16 (0.43 ms against 0.48) and rows=32 (0.54 against 0.61). fp8 rows=32 follows rows=16 (not
# swept). A cache whose pages are not a multiple of 64 keys runs these schedules with gathered tiles.
SCHEDULES = {
    (2, 16): Schedule(128, 8, 2, 0.0),
    (2, 32): Schedule(64, 4, 2, 8.0, min_waves=8, min_split_tiles=8),
    (2, 64): Schedule(64, 8, 2, 0.0, min_waves=8, tma=True),
    (1, 16): Schedule(64, 8, 2, 0.0, min_waves=8, tma=True),
    (1, 32): Schedule(64, 8, 2, 0.0, min_waves=8, tma=True),
    (1, 64): Schedule(64, 8, 2, 0.0, min_waves=8, tma=True),
}
_FP32_SCHEDULE = Schedule(32, 4, 1, 0.0)  # a correctness path: 4-byte tiles must fit in shared memory

# TMA tiles only where the launch holds at least this much work (query rows x key capacity, T * H * max_kv): a TMA
# launch spends more host time (two descriptors encoded per call; run 14 on the H200's host: 40-150 us more than a
# gathered launch) while saving little GPU time on small launches (CUDA-graph replays, run 14: at most 25 us below
# 2^24, up to 29% of the GPU time above it, one case 2% slower). Without CUDA graphs a small launch is bound by
# the host, so below this size the gathered kernel finishes first.
TMA_MIN_WORK = 1 << 24


def _num_kv_splits(
    work: int, max_kv: int, block_n: int, num_sms: int, min_waves: float | None = None, min_split_tiles: int = 4
) -> int:
    """Splits per sequence so that `work` programs x splits fill the SMs.

    At least `min_waves` programs per SM where the keys allow (each split keeps >= `min_split_tiles` tiles of the
    capacity `max_kv`, so its pipeline amortises its prologue and the merge stays small); beyond that
    FlashAttention's rule: wave efficiency eff(s) = w / ceil(w) with w = work * s / num_sms, the smallest s within
    85% of the best.
    """
    min_waves = MIN_WAVES if min_waves is None else min_waves
    max_splits = max(1, min(64, max_kv // (min_split_tiles * block_n)))
    if work >= min_waves * num_sms or max_splits == 1:
        return 1
    lo = 1 if min_waves <= 1 else min(max_splits, math.ceil(min_waves * num_sms / work))
    eff = {s: (work * s / num_sms) / math.ceil(work * s / num_sms) for s in range(lo, max_splits + 1)}
    best = max(eff.values())
    return next(s for s, e in eff.items() if e >= 0.85 * best)


def _tiles(num_heads: int, num_tokens: int, num_seqs: int, compute_dtype: torch.dtype, kv_bytes: int):
    """(Kernel launch parameters, the tile class's Schedule) from shapes alone (no device reads).

    Rows = BLOCK_Q tokens x BLOCK_H heads <= 64: the fp32 [64, kv_lora_rank=512] accumulator alone takes 128
    registers a thread at 8 warps. tl.dot needs >= 16 rows, so a small H takes more query tokens per tile. fp32
    compute (a correctness path) keeps 16 rows and one stage so its 4-byte tiles fit in shared memory.
    """
    max_rows = 16 if compute_dtype == torch.float32 else 64
    block_h = min(next_pow2(num_heads), max_rows)
    mean_sq = cdiv(num_tokens, max(num_seqs, 1))
    block_q = min(next_pow2(mean_sq), max(1, max_rows // block_h))
    block_q = max(block_q, 16 // block_h)
    sched = _FP32_SCHEDULE if max_rows == 16 else SCHEDULES[(min(kv_bytes, 2), block_q * block_h)]
    return dict(
        BLOCK_H=block_h, BLOCK_Q=block_q, BLOCK_N=sched.block_n, num_warps=sched.num_warps,
        num_stages=sched.num_stages, RESCALE_SLACK=sched.rescale_slack,
    ), sched  # fmt: skip


def _tma_ok(kv_cache: torch.Tensor, kv_lora_rank: int, block_n: int) -> bool:
    """Whether TMA can copy this cache's tiles: each tile must lie inside one page (so block_n divides the page
    size), TMA needs Hopper or newer (or the interpreter), and 16-byte aligned pages, rows and column blocks."""
    if kv_cache.device.type == "cuda":
        if torch.cuda.get_device_capability(kv_cache.device)[0] < 9:
            return False
    elif os.environ.get("TRITON_INTERPRET") != "1":
        return False
    elem = kv_cache.element_size()
    return (
        kv_cache.shape[1] % block_n == 0
        and kv_cache.data_ptr() % 16 == 0
        and kv_cache.shape[2] * elem % 16 == 0
        and kv_lora_rank * elem % 16 == 0
    )


def _tma_descriptors(kv_cache: torch.Tensor, kv_lora_rank: int, block_n: int):
    """Descriptors of the pages [num_pages, page_size, D]: [1, block_n, kv_lora_rank] tiles of c and
    [1, block_n, rope_dim] tiles of k_pe (None without rope). Rows outside a page read as zeros."""
    c = TensorDescriptor(kv_cache, list(kv_cache.shape), list(kv_cache.stride()), [1, block_n, kv_lora_rank])
    rope = kv_cache.shape[2] - kv_lora_rank
    if rope == 0:
        return c, None
    pe = kv_cache[..., kv_lora_rank:]
    return c, TensorDescriptor(pe, list(pe.shape), list(pe.stride()), [1, block_n, rope])


def _validate(q, kv_cache, block_table, cache_seqlens, cu_seqlens_q, kv_lora_rank, kv_bounds, kv_scale):
    if q.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(f"q is on {q.device}: the Triton MLA decode kernel needs CUDA (or TRITON_INTERPRET=1)")
    if q.dim() != 3 or q.dtype not in _FLOATS or q.stride(-1) != 1:
        raise ValueError(
            f"q must be [T, H, D] fp32/fp16/bf16 with a contiguous last dim, got {list(q.shape)} {q.dtype}"
        )
    T, H, D = q.shape
    if H < 1:
        raise ValueError("q must have at least one head")
    if kv_cache.dim() != 3 or kv_cache.shape[2] != D or not kv_cache.is_contiguous():
        raise ValueError(f"kv_cache must be contiguous [P, page_size, D={D}], got {list(kv_cache.shape)}")
    if kv_cache.dtype not in SUPPORTED["kv_dtypes"]:
        raise ValueError(f"kv_cache dtype {kv_cache.dtype} not in {SUPPORTED['kv_dtypes']}")
    rope = D - kv_lora_rank
    if kv_lora_rank not in SUPPORTED["kv_lora_rank"] or rope not in SUPPORTED["rope_dim"]:
        raise ValueError(
            f"kv_lora_rank={kv_lora_rank} and rope_dim=D-kv_lora_rank={rope} must lie in "
            f"{SUPPORTED['kv_lora_rank']} and {SUPPORTED['rope_dim']} (power-of-two tiles)"
        )
    N = block_table.shape[0] if block_table.dim() == 2 else -1
    if N < 0 or block_table.dtype != torch.int32 or block_table.stride(-1) != 1:
        raise ValueError(f"block_table must be [N, max_pages] int32, got {list(block_table.shape)} {block_table.dtype}")
    for name, t, shape in (("cache_seqlens", cache_seqlens, (N,)), ("cu_seqlens_q", cu_seqlens_q, (N + 1,))):
        if tuple(t.shape) != shape or t.dtype != torch.int32 or not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous int32 {list(shape)}, got {list(t.shape)} {t.dtype}")
    if kv_bounds is not None and (tuple(kv_bounds.shape) != (T,) or kv_bounds.dtype != torch.int32):
        raise ValueError(f"kv_bounds must be int32 [T={T}], got {list(kv_bounds.shape)} {kv_bounds.dtype}")
    if (kv_scale is not None) != (kv_cache.dtype == FP8):
        raise ValueError("kv_scale must be given exactly when kv_cache is float8_e4m3fn")
    if kv_scale is not None and (
        tuple(kv_scale.shape) != tuple(kv_cache.shape[:2])
        or kv_scale.dtype != torch.float32
        or not kv_scale.is_contiguous()
    ):
        raise ValueError(f"kv_scale must be contiguous fp32 {list(kv_cache.shape[:2])}, got {list(kv_scale.shape)}")
    for name, t in (("kv_cache", kv_cache), ("block_table", block_table), ("cache_seqlens", cache_seqlens),
                    ("cu_seqlens_q", cu_seqlens_q), ("kv_bounds", kv_bounds), ("kv_scale", kv_scale)):  # fmt: skip
        if t is not None and t.device != q.device:
            raise ValueError(f"{name} is on {t.device}, q on {q.device}")


def mla_decode_triton(
    q,
    kv_cache,
    block_table,
    cache_seqlens,
    cu_seqlens_q,
    scale,
    kv_lora_rank,
    kv_bounds=None,
    kv_scale=None,
    num_kv_splits=None,
):
    """Absorbed-MLA attention of T query tokens over a paged latent cache.

    Args:
        q: [T, H, D] fp32/fp16/bf16 (absorbed q_nope then q_pe), sequences packed end to end; last dim contiguous.
        kv_cache: [P, page_size, D] contiguous, D = kv_lora_rank + rope_dim; fp32/fp16/bf16 or float8_e4m3fn.
        block_table: [N, max_pages] int32; token p of sequence i lives in page block_table[i, p // page_size].
        cache_seqlens: [N] int32 KV tokens per sequence INCLUDING its new tokens (already written).
        cu_seqlens_q: [N + 1] int32 query offsets; s_q may differ per sequence (1: decode, k + 1: verify).
        scale: softmax scale ((qk_nope + qk_rope) ** -0.5 for Kimi, not D ** -0.5).
        kv_lora_rank: values are the first kv_lora_rank latent dims.
        kv_bounds: optional [T] int32 overriding the causal rule (query j of sequence i sees keys
            [0, cache_seqlens[i] - s_q_i + j]): query t sees keys [0, kv_bounds[t]) (clamped to the sequence length).
        kv_scale: [P, page_size] fp32 per-token scale, exactly when kv_cache is fp8 (value = fp8 * scale).
        num_kv_splits: keys of each sequence split over this many programs; None picks from shapes and SM count.

    Returns:
        out [T, H, kv_lora_rank] in q.dtype and lse [T, H] fp32 (natural log). A query that sees no key gets exact
        zeros and lse -inf. Raises ValueError for inputs outside `SUPPORTED`.
    """
    _validate(q, kv_cache, block_table, cache_seqlens, cu_seqlens_q, kv_lora_rank, kv_bounds, kv_scale)
    if num_kv_splits is not None and (not isinstance(num_kv_splits, int) or num_kv_splits < 1):
        raise ValueError(f"num_kv_splits must be a positive int or None, got {num_kv_splits!r}")
    T, H, D = q.shape
    N, page_size = block_table.shape[0], kv_cache.shape[1]
    out = torch.empty(T, H, kv_lora_rank, dtype=q.dtype, device=q.device)
    lse = torch.empty(T, H, dtype=torch.float32, device=q.device)
    if T == 0:
        return out, lse
    compute = q.dtype if kv_cache.dtype in (q.dtype, FP8) else torch.float32
    cfg, sched = _tiles(H, T, N, compute, kv_cache.element_size())
    max_kv = block_table.shape[1] * page_size
    use_tma = sched.tma and T * H * max_kv >= TMA_MIN_WORK and _tma_ok(kv_cache, kv_lora_rank, cfg["BLOCK_N"])
    kv_c_desc, kv_pe_desc = _tma_descriptors(kv_cache, kv_lora_rank, cfg["BLOCK_N"]) if use_tma else (None, None)
    num_head_blocks = cdiv(H, cfg["BLOCK_H"])
    slots = (T + N * (cfg["BLOCK_Q"] - 1)) // cfg["BLOCK_Q"]  # f(N) of the kernel's slot map
    splits = num_kv_splits or _num_kv_splits(
        slots * num_head_blocks, max_kv, cfg["BLOCK_N"], num_sms(q.device.index),
        sched.min_waves, sched.min_split_tiles,
    )  # fmt: skip
    if splits > 1:
        part_out = torch.empty(T, H, splits, kv_lora_rank, dtype=torch.float32, device=q.device)
        part_lse = torch.empty(T, H, splits, dtype=torch.float32, device=q.device)
    else:
        part_out, part_lse = out, lse
    mla_decode_fwd_kernel[(slots * num_head_blocks * splits,)](
        q,
        kv_cache,
        kv_c_desc,
        kv_pe_desc,
        kv_scale,
        block_table,
        cache_seqlens,
        cu_seqlens_q,
        kv_bounds,
        part_out,
        part_lse,
        float(scale) * math.log2(math.e),
        N,
        H,
        num_head_blocks,
        splits,
        q.stride(0),
        q.stride(1),
        kv_cache.stride(0),
        kv_cache.stride(1),
        block_table.stride(0),
        PAGE_SIZE=page_size,
        DC=kv_lora_rank,
        DR=D - kv_lora_rank,
        SEQS_POW2=next_pow2(N + 1),
        COMPUTE_DTYPE=_TL_DTYPE[compute],
        DOT_PRECISION="ieee" if compute == torch.float32 else "tf32",
        IS_FP8=kv_cache.dtype == FP8,
        HAS_BOUNDS=kv_bounds is not None,
        SPLIT=splits > 1,
        USE_TMA=use_tma,
        **cfg,
    )
    if splits > 1:
        block_r = 16
        mla_decode_combine_kernel[(cdiv(T * H, block_r),)](
            part_out, part_lse, out, lse, T * H, splits, DC=kv_lora_rank, BLOCK_R=block_r
        )
    return out, lse
