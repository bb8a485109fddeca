"""Triton kernel for weight-absorbed MLA attention (decode and speculative verify) over the paged latent cache.

Absorbed MLA is MQA over one shared latent per token, so the kernel packs every (query token, head) pair of a
sequence into the rows of one tile (BLOCK_M = BLOCK_Q tokens x BLOCK_H heads) and streams that sequence's latent
pages through it once: scores = q_c @ c^T + q_pe @ k_pe^T, online softmax in fp32 with exp2, then acc += P @ c with
the same tile. The latent's kv_lora_rank columns run as DSPLIT groups (the schedule's d_split), each with its own
score dot and accumulator, and the rope as one more dot (kv_lora_rank + rope is not a power of two): independent
MMA chains rather than one long dependent one. When sequences x head blocks cannot fill the GPU, each sequence's
keys are split over several programs ("flash decoding") whose partial (out, lse) a second kernel merges by LSE.

Host code never reads device values (no synchronisation, CUDA-graph friendly): per-sequence query counts are found
in the kernel, and tile shapes and the split count come from tensor shapes only. At 64 tile rows on sm_90 the
launcher runs the warp-specialised Gluon kernel of `decode_wgmma` instead, where `_wgmma_ok` says it can serve the
call (same outputs, same combine kernel).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from kimi_helix.kernels.backends import FLOATS, KernelCaps
from kimi_helix.kernels.common import check_triton_device
from kimi_helix.kernels.device import capability, interpreting, num_sms, triton_devices
from kimi_helix.kernels.launch import cdiv, next_pow2
from kimi_helix.kernels.mla.combine_triton import launch_combine, mla_decode_combine_kernel
from kimi_helix.kernels.mla.decode_fp8 import accumulate, attend_tile_fp8, scaled_rows
from kimi_helix.kernels.mla.decode_schedule import (
    D_SPLITS,
    FP8_WGMMA,
    MIN_WAVES,
    SCHEDULES,
    TRITON_FP8_SCHEDULES,
    Fp8WgmmaParams,
    Schedule,
    choose_num_kv_splits,
    choose_tiles,
)

try:  # Gluon (Triton's explicit-layout dialect) and its Hopper ops; older or newer Tritons may lack them
    from kimi_helix.kernels.mla import decode_fp8_wgmma, decode_wgmma
except ImportError:
    decode_wgmma = decode_fp8_wgmma = None

__all__ = [
    "CAPS", "D_SPLITS", "FP8_WGMMA", "MIN_WAVES", "SCHEDULES", "TMA_MIN_WORK", "TRITON_FP8_SCHEDULES",
    "Fp8WgmmaParams", "Schedule", "mla_decode_combine_kernel", "mla_decode_triton",
]  # fmt: skip

FP8 = torch.float8_e4m3fn
_FLOATS = (torch.float32, torch.float16, torch.bfloat16)
_TL_DTYPE = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}

# What mla_decode_triton accepts (decode and verify), read by the backend switch; it raises ValueError for anything
# else. Any head count, page size and per-sequence s_q >= 0. fp8 and a cache of q's dtype compute in q's dtype; any
# other float pairing computes in fp32 (slow, exact).
CAPS = KernelCaps(triton_devices(), FLOATS, FLOATS | {"fp8_e4m3"}, dim_rule="mla_latent")
_KV_DTYPES = (*_FLOATS, FP8)
_KV_LORA_RANKS = tuple(2**i for i in range(4, 10))  # 16 .. 512, the "mla_latent" rule of CAPS
_ROPE_DIMS = (0, 16, 32, 64, 128)


@triton.jit
def _load_cols(ptr, ok, W: tl.constexpr, DTYPE: tl.constexpr):
    """W columns from each row start in ptr ([R]) as [R, W] in DTYPE; rows not ok load as 0, not as whatever stale
    bytes a page holds (0 * NaN in P @ V would poison rows)."""
    w = tl.arange(0, W)
    return tl.load(ptr[:, None] + w[None, :], mask=ok[:, None], other=0.0).to(DTYPE)


@triton.jit
def _load_groups(ptr, ok, DW: tl.constexpr, DSPLIT: tl.constexpr, DTYPE: tl.constexpr):
    """The DSPLIT column groups [j * DW, (j + 1) * DW) of the rows at ptr ([R]) as `_load_cols` loads them: four
    [R, DW] tiles, of which those from DSPLIT on repeat the first and go unused (Triton has no lists of tensors)."""
    x0 = _load_cols(ptr, ok, DW, DTYPE)
    x1 = x0
    x2 = x0
    x3 = x0
    if DSPLIT > 1:
        x1 = _load_cols(ptr + DW, ok, DW, DTYPE)
    if DSPLIT > 2:
        x2 = _load_cols(ptr + 2 * DW, ok, DW, DTYPE)
        x3 = _load_cols(ptr + 3 * DW, ok, DW, DTYPE)
    return x0, x1, x2, x3


@triton.jit
def _load_tile_gather(kv_ptr, pages_ptr, stride_kvp, stride_kvs, n, hi, PAGE_SIZE: tl.constexpr, DC: tl.constexpr,
                      DR: tl.constexpr, DSPLIT: tl.constexpr, COMPUTE_DTYPE: tl.constexpr):  # fmt: skip
    """Keys n ([BLOCK_N]) of the sequence whose block-table row is pages_ptr, by a page lookup per key: (their cache
    slots page * PAGE_SIZE + offset, the latent's column groups c0..c3 [BLOCK_N, DC / DSPLIT], pe [BLOCK_N, DR])."""
    n_ok = n < hi
    # Per-key page lookup: a tile may span several small pages or sit inside one large page.
    page = tl.load(pages_ptr + n // PAGE_SIZE, mask=n_ok, other=0).to(tl.int64)
    kv_row = kv_ptr + page * stride_kvp + (n % PAGE_SIZE) * stride_kvs
    c0, c1, c2, c3 = _load_groups(kv_row, n_ok, DC // DSPLIT, DSPLIT, COMPUTE_DTYPE)
    pe = c0  # unused when DR == 0
    if DR > 0:
        pe = _load_cols(kv_row + DC, n_ok, DR, COMPUTE_DTYPE)
    return page * PAGE_SIZE + n % PAGE_SIZE, c0, c1, c2, c3, pe


@triton.jit
def _tma_tile(desc, page, row, col, BLOCK_N: tl.constexpr, W: tl.constexpr):
    """desc's [1, BLOCK_N, W] tile at (page, row, col) as [BLOCK_N, W]."""
    return desc.load([page, row, col]).reshape(BLOCK_N, W)


@triton.jit
def _load_tile_tma(kv_c_desc, kv_pe_desc, page, row, BLOCK_N: tl.constexpr, DW: tl.constexpr, DR: tl.constexpr,
                   DSPLIT: tl.constexpr, COMPUTE_DTYPE: tl.constexpr):  # fmt: skip
    """Rows [row, row + BLOCK_N) of one page by TMA, zeros where row < 0: (the column groups c0..c3 [BLOCK_N, DW],
    one kv_c_desc tile each, as `_load_groups` returns them; pe [BLOCK_N, DR])."""
    # Every copy before any conversion from fp8: converting each tile as it lands reorders the fp8 kernels and
    # makes them spill more registers (scripts/kernel_resources.py shows the spills).
    c0 = _tma_tile(kv_c_desc, page, row, 0, BLOCK_N, DW)
    c1 = c0
    c2 = c0
    c3 = c0
    if DSPLIT > 1:
        c1 = _tma_tile(kv_c_desc, page, row, DW, BLOCK_N, DW)
    if DSPLIT > 2:
        c2 = _tma_tile(kv_c_desc, page, row, 2 * DW, BLOCK_N, DW)
        c3 = _tma_tile(kv_c_desc, page, row, 3 * DW, BLOCK_N, DW)
    pe = c0  # unused when DR == 0
    if DR > 0:
        pe = _tma_tile(kv_pe_desc, page, row, 0, BLOCK_N, DR)
    return c0.to(COMPUTE_DTYPE), c1.to(COMPUTE_DTYPE), c2.to(COMPUTE_DTYPE), c3.to(COMPUTE_DTYPE), pe.to(COMPUTE_DTYPE)


@triton.jit
def _scores(q0, q1, q2, q3, q_pe, c0, c1, c2, c3, pe, DR: tl.constexpr, DSPLIT: tl.constexpr,
            DOT_PRECISION: tl.constexpr):  # fmt: skip
    """q_c @ c^T + q_pe @ pe^T ([rows, BLOCK_N] fp32) as one dot per column group and one for the rope, summed:
    independent MMA chains the tensor cores overlap, where a single dot over the whole width is one chain whose
    every step waits on the one before."""
    s = tl.dot(q0, tl.trans(c0), input_precision=DOT_PRECISION)
    if DSPLIT > 1:
        s += tl.dot(q1, tl.trans(c1), input_precision=DOT_PRECISION)
    if DSPLIT > 2:
        s += tl.dot(q2, tl.trans(c2), input_precision=DOT_PRECISION)
        s += tl.dot(q3, tl.trans(c3), input_precision=DOT_PRECISION)
    if DR > 0:
        s += tl.dot(q_pe, tl.trans(pe), input_precision=DOT_PRECISION)
    return s


@triton.jit
def _raise_max(acc0, acc1, acc2, acc3, l_i, m_i, m_tile, DSPLIT: tl.constexpr):
    """Move the running row max up to include m_tile, rescaling the DSPLIT accumulators and the sum of weights."""
    m_new = tl.maximum(m_i, m_tile)
    alpha = tl.exp2(m_i - tl.where(m_new == float("-inf"), 0.0, m_new))
    acc0 = acc0 * alpha[:, None]
    if DSPLIT > 1:
        acc1 = acc1 * alpha[:, None]
    if DSPLIT > 2:
        acc2 = acc2 * alpha[:, None]
        acc3 = acc3 * alpha[:, None]
    return acc0, acc1, acc2, acc3, l_i * alpha, m_new


@triton.jit
def _attend_tile(s, c0, c1, c2, c3, n, lo, bound, acc0, acc1, acc2, acc3, l_i, m_i, qk_scale, DSPLIT: tl.constexpr,
                 COMPUTE_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr, RESCALE_SLACK: tl.constexpr):  # fmt: skip
    """The scores s of the tile's keys n in [lo, hi) (hi folded into bound) into the online softmax: the running
    max and sum, and acc_j += P @ c_j for each column group j < DSPLIT."""
    visible = (n >= lo)[None, :] & (n[None, :] < bound[:, None])
    s = tl.where(visible, s * qk_scale, float("-inf"))
    m_tile = tl.max(s, axis=1)
    if RESCALE_SLACK > 0:
        # Lazy rescaling: keep the running max (and skip the [rows, DC] multiply of the accumulators) until some
        # row's max grows by more than the slack; p <= 2^slack meanwhile, far from overflowing bf16 or the fp32 sums.
        grow = tl.where(m_tile > m_i, m_tile - m_i, 0.0)
        if tl.max(grow, axis=0) > RESCALE_SLACK:
            acc0, acc1, acc2, acc3, l_i, m_i = _raise_max(acc0, acc1, acc2, acc3, l_i, m_i, m_tile, DSPLIT)
    else:
        acc0, acc1, acc2, acc3, l_i, m_i = _raise_max(acc0, acc1, acc2, acc3, l_i, m_i, m_tile, DSPLIT)
    # Rows with no visible key so far keep m = -inf; offsetting by 0 instead keeps exp2 away from -inf - -inf.
    p = tl.exp2(s - tl.where(m_i == float("-inf"), 0.0, m_i)[:, None])
    l_i += tl.sum(p, axis=1)
    p = p.to(COMPUTE_DTYPE)
    acc0, acc1, acc2, acc3 = accumulate(p, c0, c1, c2, c3, acc0, acc1, acc2, acc3, DSPLIT, DOT_PRECISION)
    return acc0, acc1, acc2, acc3, l_i, m_i


@triton.jit
def _store_out(ptr, ok, acc0, acc1, acc2, acc3, l_safe, DW: tl.constexpr, DSPLIT: tl.constexpr):
    """acc_j / l_safe (the first DSPLIT groups, [R, DW] each) into columns [j * DW, (j + 1) * DW) of the rows
    at ptr ([R]) that are ok."""
    dw = tl.arange(0, DW)[None, :]
    ty = ptr.dtype.element_ty
    tl.store(ptr[:, None] + dw, (acc0 / l_safe[:, None]).to(ty), mask=ok[:, None])
    if DSPLIT > 1:
        tl.store(ptr[:, None] + DW + dw, (acc1 / l_safe[:, None]).to(ty), mask=ok[:, None])
    if DSPLIT > 2:
        tl.store(ptr[:, None] + 2 * DW + dw, (acc2 / l_safe[:, None]).to(ty), mask=ok[:, None])
        tl.store(ptr[:, None] + 3 * DW + dw, (acc3 / l_safe[:, None]).to(ty), mask=ok[:, None])


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
    DSPLIT: tl.constexpr,
    SEQS_POW2: tl.constexpr,
    COMPUTE_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    IS_FP8: tl.constexpr,
    USE_KV_BOUNDS: tl.constexpr,
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

    # Rows are (query token, head) pairs, each with its own number of visible keys. From here to the split range:
    # twin of kernels/mla/decode_wgmma.py:split_range (same contract) — a fix here belongs there too.
    rows = tl.arange(0, BLOCK_Q * BLOCK_H)
    tok = tok0 + rows // BLOCK_H
    head = head_block * BLOCK_H + rows % BLOCK_H
    row_ok = (tok < q_hi) & (head < num_heads)
    kv_len = tl.load(cache_seqlens_ptr + seq)
    if USE_KV_BOUNDS:
        bound = tl.load(kv_bounds_ptr + tok, mask=row_ok, other=0)
    else:
        bound = kv_len - (q_hi - q_lo) + (tok - q_lo) + 1
    bound = tl.where(row_ok, tl.minimum(tl.maximum(bound, 0), kv_len), 0)

    # This split's key range; whole tiles so that no tile straddles two splits.
    split_len = tl.cdiv(tl.cdiv(kv_len, num_splits), BLOCK_N) * BLOCK_N
    lo = split * split_len
    hi = tl.minimum(lo + split_len, tl.max(bound, axis=0))
    bound = tl.minimum(bound, hi)

    # The latent's columns as DSPLIT groups of DW, each with its own operands and accumulator (see `_scores`).
    DW: tl.constexpr = DC // DSPLIT
    q_row = q_ptr + tok.to(tl.int64) * stride_qt + head * stride_qh
    row_scale = tl.full([BLOCK_Q * BLOCK_H], qk_scale, tl.float32)
    if IS_FP8:  # fp16 operands (see `decode_fp8.attend_tile_fp8`): q scaled per row into fp16's range
        q0, q1, q2, q3 = _load_groups(q_row, row_ok, DW, DSPLIT, tl.float32)
        q_pe = q0  # unused when DR == 0
        if DR > 0:
            q_pe = _load_cols(q_row + DC, row_ok, DR, tl.float32)
        q0, q1, q2, q3, q_pe, unscale = scaled_rows(q0, q1, q2, q3, q_pe, DR, DSPLIT, COMPUTE_DTYPE)
        row_scale = row_scale * unscale
    else:
        q0, q1, q2, q3 = _load_groups(q_row, row_ok, DW, DSPLIT, COMPUTE_DTYPE)
        q_pe = q0  # unused when DR == 0
        if DR > 0:
            q_pe = _load_cols(q_row + DC, row_ok, DR, COMPUTE_DTYPE)

    m_i = tl.full([BLOCK_Q * BLOCK_H], float("-inf"), tl.float32)
    d_i = m_i  # fp8 only: the running max of the P @ c weights' exponents (see `decode_fp8.attend_tile_fp8`)
    l_i = tl.zeros([BLOCK_Q * BLOCK_H], tl.float32)
    acc0 = tl.zeros([BLOCK_Q * BLOCK_H, DW], tl.float32)
    acc1 = acc0
    acc2 = acc0
    acc3 = acc0
    pages_ptr = block_table_ptr + seq * stride_bt
    for tile_lo in range(lo, hi, BLOCK_N):
        if USE_TMA:
            # A tile lies inside one page. A partial last tile is read as the window ending at the split's last key:
            # never the stale rows past a sequence's end (0 * NaN in P @ V would poison rows), but keys before the
            # tile (masked out) or, before the page's first row, TMA's zero fill.
            shift = BLOCK_N - tl.minimum(hi - tile_lo, BLOCK_N)
            page = tl.load(pages_ptr + tile_lo // PAGE_SIZE)
            c0, c1, c2, c3, pe = _load_tile_tma(kv_c_desc, kv_pe_desc, page, tile_lo % PAGE_SIZE - shift, BLOCK_N,
                                                DW, DR, DSPLIT, COMPUTE_DTYPE)  # fmt: skip
            n = tile_lo - shift + tl.arange(0, BLOCK_N)
            key_slot = page.to(tl.int64) * PAGE_SIZE + n % PAGE_SIZE
        else:
            n = tile_lo + tl.arange(0, BLOCK_N)
            key_slot, c0, c1, c2, c3, pe = _load_tile_gather(kv_ptr, pages_ptr, stride_kvp, stride_kvs, n, hi,
                                                             PAGE_SIZE, DC, DR, DSPLIT, COMPUTE_DTYPE)  # fmt: skip
        s = _scores(q0, q1, q2, q3, q_pe, c0, c1, c2, c3, pe, DR, DSPLIT, DOT_PRECISION)
        if IS_FP8:
            acc0, acc1, acc2, acc3, l_i, m_i, d_i = attend_tile_fp8(s, c0, c1, c2, c3, kv_scale_ptr, key_slot, n,
                                                                     tile_lo, hi, bound, acc0, acc1, acc2, acc3, l_i,
                                                                     m_i, d_i, row_scale, DSPLIT, COMPUTE_DTYPE,
                                                                     DOT_PRECISION)  # fmt: skip
        else:
            acc0, acc1, acc2, acc3, l_i, m_i = _attend_tile(s, c0, c1, c2, c3, n, tile_lo, bound, acc0, acc1, acc2,
                                                            acc3, l_i, m_i, qk_scale, DSPLIT, COMPUTE_DTYPE,
                                                            DOT_PRECISION, RESCALE_SLACK)  # fmt: skip

    has_keys = l_i > 0
    l_safe = tl.where(has_keys, l_i, 1.0)
    lse = tl.where(has_keys, (m_i + tl.log2(l_safe)) * 0.6931471805599453, float("-inf"))
    row = tok.to(tl.int64) * num_heads + head
    if SPLIT:
        row = row * num_splits + split
    l_out = l_safe
    if IS_FP8:  # out = acc * 2^d / l; acc is 0 where no key had weight (d = -inf)
        norm = tl.where(has_keys & (d_i > float("-inf")), tl.exp2(d_i), 0.0)
        l_out = tl.where(norm > 0, l_safe / norm, 1.0)
    _store_out(out_ptr + row * DC, row_ok, acc0, acc1, acc2, acc3, l_out, DW, DSPLIT)
    tl.store(lse_ptr + row, lse, mask=row_ok)


# TMA tiles only where the launch holds at least this much work (query rows x key capacity, T * H * max_kv): a TMA
# launch encodes two descriptors on the host per call, which costs more than the little GPU time TMA saves on a
# small launch called without CUDA graphs (docs/benchmark-history.md, "TMA for small launches").
TMA_MIN_WORK = 1 << 24


def _tma_ok(kv_cache: torch.Tensor, kv_lora_rank: int, block_n: int, d_split: int = 1) -> bool:
    """Whether TMA can copy this cache's tiles: each tile must lie inside one page (so block_n divides the page
    size), TMA needs Hopper or newer (or the interpreter), and 16-byte aligned pages, rows, the rope's first column
    and the width of a latent column group (kv_lora_rank / d_split)."""
    if kv_cache.device.type == "cuda":
        if capability(kv_cache.device.index)[0] < 9:
            return False
    elif not interpreting():
        return False
    elem = kv_cache.element_size()
    return (
        kv_cache.shape[1] % block_n == 0
        and kv_cache.data_ptr() % 16 == 0
        and kv_cache.shape[2] * elem % 16 == 0
        and kv_lora_rank * elem % 16 == 0
        and kv_lora_rank % d_split == 0
        and kv_lora_rank // d_split * elem % 16 == 0
    )


def _tma_descriptors(kv_cache: torch.Tensor, kv_lora_rank: int, block_n: int, d_split: int = 1):
    """Descriptors of the pages [num_pages, page_size, D]: [1, block_n, kv_lora_rank / d_split] tiles of c (one
    latent column group, loaded at column j * kv_lora_rank / d_split for group j) and [1, block_n, rope_dim] tiles
    of k_pe (None without rope). Rows outside a page read as zeros."""
    group = [1, block_n, kv_lora_rank // d_split]
    c = TensorDescriptor(kv_cache, list(kv_cache.shape), list(kv_cache.stride()), group)
    rope = kv_cache.shape[2] - kv_lora_rank
    if rope == 0:
        return c, None
    pe = kv_cache[..., kv_lora_rank:]
    return c, TensorDescriptor(pe, list(pe.shape), list(pe.stride()), [1, block_n, rope])


# Shared memory a Hopper block may use (227 KB), less room for the kernel's reduction scratch and barriers.
_WGMMA_SMEM = 227 * 1024 - 2048

# The wgmma kernel takes sequences longest first (`decode_wgmma._longest_first`) where each program carries a whole
# sequence's keys (no split-KV) and the programs fill more than one wave: the SMs that drew short sequences then take
# the long ones left. Each program ranks all N sequences (O(N^2) work), so only up to this many; with split-KV it did
# not pay (docs/benchmark-history.md), so split launches keep the sequences' order.
LONGEST_FIRST_MAX_SEQS = 255


def _longest_first(splits: int, num_seqs: int, programs: int, device_index: int | None) -> bool:
    """Whether the wgmma kernel's programs take sequences longest first (see LONGEST_FIRST_MAX_SEQS)."""
    return splits == 1 and num_seqs <= LONGEST_FIRST_MAX_SEQS and programs > num_sms(device_index)


def _wgmma_smem(rows: int, block_n: int, stages: int, width: int) -> int:
    """Bytes of shared memory the wgmma kernel allocates for its tiles: q [rows, width], the key tiles
    [stages, block_n, width] and P [rows, block_n], 16-bit."""
    return 2 * ((rows + stages * block_n) * width + rows * block_n)


def _wgmma_ok(q: torch.Tensor, kv_cache: torch.Tensor, kv_lora_rank: int, cfg: dict) -> bool:
    """Whether the Gluon warpgroup-MMA kernel can serve the call: sm_90 (its wgmma and TMA ops), 16-bit q and a
    cache of the same dtype, 64 tile rows, 16 to 64 keys a tile in two or more buffers, a rope part, kv_lora_rank
    <= 512 (each warpgroup's half of the output is one MMA), q, the tile buffers and P within shared memory. Asked
    only once the launcher has chosen TMA tiles (`_tma_ok`: pages TMA can copy), which it does not check again."""
    rope = kv_cache.shape[2] - kv_lora_rank
    rows, block_n, stages = cfg["BLOCK_Q"] * cfg["BLOCK_H"], cfg["BLOCK_N"], cfg["num_stages"]
    smem = _wgmma_smem(rows, block_n, stages, kv_cache.shape[2])
    return (
        decode_wgmma is not None
        and q.device.type == "cuda"
        and capability(q.device.index) == (9, 0)
        and q.dtype in (torch.float16, torch.bfloat16)
        and kv_cache.dtype == q.dtype
        and rows == 64
        and block_n in (16, 32, 64)
        and stages >= 2
        and 32 <= kv_lora_rank <= 512
        and rope >= 16
        and smem <= _WGMMA_SMEM
    )


def _fp8_wgmma_ok(q, kv_cache, kv_lora_rank: int, cfg: dict, sched: Schedule) -> bool:
    """Whether the fp8-cache Gluon kernel (`decode_fp8_wgmma`) can serve the call: sm_90, an fp8 cache with fp16 or
    bf16 q, 16 or 32 tile rows, the schedule's split arithmetic on the kernel's own 64-key tiles, an O^T of whole
    64-row MMAs (kv_lora_rank >= 64) and a rope part of at least one MMA step (>= 16), 16-byte aligned cache rows
    (its loads take 4 e4m3 a word), q, two fp16 tiles and P within shared memory. Any page size (keys are looked
    up one by one)."""
    rows, rope = cfg["BLOCK_Q"] * cfg["BLOCK_H"], kv_cache.shape[2] - kv_lora_rank
    return (
        decode_fp8_wgmma is not None
        and q.device.type == "cuda"
        and capability(q.device.index) == (9, 0)
        and kv_cache.dtype == FP8
        and q.dtype in (torch.float16, torch.bfloat16)
        and rows in (16, 32)
        and sched.block_n == decode_fp8_wgmma.BLOCK_N
        and 64 <= kv_lora_rank <= 512
        and rope >= 16
        and kv_cache.shape[2] % 16 == 0
        and kv_cache.data_ptr() % 16 == 0
        and decode_fp8_wgmma.fp8_wgmma_smem(rows, kv_cache.shape[2], 2) <= _WGMMA_SMEM
    )


def _validate(q, kv_cache, block_table, cache_seqlens, cu_seqlens_q, kv_lora_rank, kv_bounds, kv_scale):
    check_triton_device("q", q)
    if q.dim() != 3 or q.dtype not in _FLOATS or q.stride(-1) != 1:
        raise ValueError(
            f"q must be [T, H, D] fp32/fp16/bf16 with a contiguous last dim, got {list(q.shape)} {q.dtype}"
        )
    T, H, D = q.shape
    if H < 1:
        raise ValueError("q must have at least one head")
    if kv_cache.dim() != 3 or kv_cache.shape[2] != D or not kv_cache.is_contiguous():
        raise ValueError(f"kv_cache must be contiguous [P, page_size, D={D}], got {list(kv_cache.shape)}")
    if kv_cache.dtype not in _KV_DTYPES:
        raise ValueError(f"kv_cache dtype {kv_cache.dtype} not in {_KV_DTYPES}")
    rope = D - kv_lora_rank
    if kv_lora_rank not in _KV_LORA_RANKS or rope not in _ROPE_DIMS:
        raise ValueError(
            f"kv_lora_rank={kv_lora_rank} and rope_dim=D-kv_lora_rank={rope} must lie in "
            f"{_KV_LORA_RANKS} and {_ROPE_DIMS} (power-of-two tiles)"
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
        zeros and lse -inf. Raises ValueError for inputs outside `CAPS`.
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
    if kv_cache.dtype == FP8 and compute == torch.bfloat16:
        compute = torch.float16  # e4m3 -> fp16 is one exact conversion; see `decode_fp8.attend_tile_fp8`
    cfg, sched = choose_tiles(H, T, N, compute, kv_cache.element_size(), kv_lora_rank)
    max_kv = block_table.shape[1] * page_size
    tile = (kv_cache, kv_lora_rank, cfg["BLOCK_N"], cfg["DSPLIT"])
    use_tma = sched.tma and T * H * max_kv >= TMA_MIN_WORK and _tma_ok(*tile)
    use_fp8_wgmma = sched.wgmma and _fp8_wgmma_ok(q, kv_cache, kv_lora_rank, cfg, sched)
    use_wgmma = sched.wgmma and use_tma and not use_fp8_wgmma and _wgmma_ok(q, kv_cache, kv_lora_rank, cfg)
    use_tma = use_tma and not use_fp8_wgmma
    kv_c_desc, kv_pe_desc = _tma_descriptors(*tile) if use_tma and not use_wgmma else (None, None)
    num_head_blocks = cdiv(H, cfg["BLOCK_H"])
    slots = (T + N * (cfg["BLOCK_Q"] - 1)) // cfg["BLOCK_Q"]  # f(N) of the kernel's slot map
    splits = num_kv_splits or choose_num_kv_splits(
        slots * num_head_blocks, max_kv, cfg["BLOCK_N"], num_sms(q.device.index),
        sched.min_waves, sched.min_split_tiles,
    )  # fmt: skip
    if splits > 1:
        part_out = torch.empty(T, H, splits, kv_lora_rank, dtype=torch.float32, device=q.device)
        part_lse = torch.empty(T, H, splits, dtype=torch.float32, device=q.device)
    else:
        part_out, part_lse = out, lse
    qk_scale = float(scale) * math.log2(math.e)
    grid = (slots * num_head_blocks * splits,)
    longest_first = _longest_first(splits, N, grid[0], q.device.index)
    if use_fp8_wgmma:
        decode_fp8_wgmma.mla_decode_fp8_wgmma_kernel[grid](
            q, kv_cache, kv_scale, block_table, cache_seqlens, cu_seqlens_q, kv_bounds, part_out, part_lse, qk_scale,
            N, H, num_head_blocks, splits, q.stride(0), q.stride(1), kv_cache.stride(0), kv_cache.stride(1),
            block_table.stride(0), PAGE_SIZE=page_size, DC=kv_lora_rank, DR=D - kv_lora_rank, BLOCK_H=cfg["BLOCK_H"],
            BLOCK_Q=cfg["BLOCK_Q"], SEQS_POW2=next_pow2(N + 1), USE_KV_BOUNDS=kv_bounds is not None, SPLIT=splits > 1,
            LONGEST_FIRST=longest_first, BLOCK_N=decode_fp8_wgmma.BLOCK_N, NUM_STAGES=2,
            DEQUANT_REGS=FP8_WGMMA.dequant_regs, LOOKAHEAD=FP8_WGMMA.lookahead,
            DEQUANT_WGS=FP8_WGMMA.dequant_warpgroups, PREFETCH=FP8_WGMMA.l2_prefetch,
            num_warps=4,  # the MMA warpgroup; the kernel adds the others
        )  # fmt: skip
    elif use_wgmma:
        kv_c_desc, kv_pe_desc = decode_wgmma.wgmma_descriptors(kv_cache, kv_lora_rank, cfg["BLOCK_N"])
        decode_wgmma.mla_decode_wgmma_kernel[grid](
            q, kv_c_desc, kv_pe_desc, block_table, cache_seqlens, cu_seqlens_q, kv_bounds, part_out, part_lse,
            qk_scale, N, H, num_head_blocks, splits, q.stride(0), q.stride(1), block_table.stride(0),
            PAGE_SIZE=page_size, BLOCK_H=cfg["BLOCK_H"], BLOCK_Q=cfg["BLOCK_Q"], SEQS_POW2=next_pow2(N + 1),
            USE_KV_BOUNDS=kv_bounds is not None, SPLIT=splits > 1, NUM_STAGES=sched.num_stages,
            LONGEST_FIRST=longest_first,
            num_warps=4,  # the parent and scores warpgroup; the kernel adds its output warpgroup and loader warp
        )  # fmt: skip
    else:
        mla_decode_fwd_kernel[grid](
            q, kv_cache, kv_c_desc, kv_pe_desc, kv_scale, block_table, cache_seqlens, cu_seqlens_q, kv_bounds,
            part_out, part_lse, qk_scale, N, H, num_head_blocks, splits, q.stride(0), q.stride(1), kv_cache.stride(0),
            kv_cache.stride(1), block_table.stride(0), PAGE_SIZE=page_size, DC=kv_lora_rank, DR=D - kv_lora_rank,
            SEQS_POW2=next_pow2(N + 1), COMPUTE_DTYPE=_TL_DTYPE[compute],
            DOT_PRECISION="ieee" if compute == torch.float32 else "tf32", IS_FP8=kv_cache.dtype == FP8,
            USE_KV_BOUNDS=kv_bounds is not None, SPLIT=splits > 1, USE_TMA=use_tma, **cfg,
        )  # fmt: skip
    if splits > 1:
        launch_combine(part_out, part_lse, out, lse, num_sms(q.device.index))
    return out, lse
