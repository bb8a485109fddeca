"""Gluon kernel for absorbed-MLA decode and verify at 64 tile rows on Hopper (sm_90): explicit warpgroup MMAs.

At 64 rows (H >= 64, or H x s_q = 64 in verify) the Triton kernel (`decode.mla_decode_fwd_kernel`) is bound by how
Triton lays out its score dot: with 8 warps and a dot chained into another, every warp goes along M, so both
warpgroups compute the whole [64, BLOCK_N] score tile (twice the tensor work) with 32-wide MMAs that each read their
q rows from shared memory again. Gluon (Triton's explicit-layout dialect) lets this kernel choose instead: each
warpgroup computes the scores of half of a tile's keys, the probabilities go through shared memory to both, and
each warpgroup accumulates half of the kv_lora_rank output columns. MMAs are asynchronous with explicit waits:
tile i + 1's scores queue behind tile i's P @ c, and tile i's buffer takes the copy of tile i + NUM_STAGES as soon
as its P @ c is done (run 18, b=128, s_k=8192: H=128 1.12 ms -> 0.80, H=16 s_q=4 0.64 -> 0.44).

Same contract as `decode.mla_decode_triton` (out, lse, split-KV partials merged by `decode.mla_decode_combine_kernel`)
for 16-bit q with a cache of the same dtype whose pages TMA can copy; `decode._wgmma_ok` says when it serves a call.
Gluon kernels do not run under TRITON_INTERPRET: `tests/kernels/test_mla_decode.py::test_gpu_wgmma_kernel` checks
this one against the torch reference on the GPU.
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

__all__ = ["mla_decode_wgmma_kernel", "wgmma_descriptors"]

_GL_DTYPE = {torch.float16: gl.float16, torch.bfloat16: gl.bfloat16}
# Names that changed after Triton 3.6 (the GPU image's): a barrier of every thread of the CTA, and a TMA tile load.
_cta_barrier = getattr(gl, "thread_barrier", None) or gl.barrier
_tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared


def wgmma_descriptors(kv_cache: torch.Tensor, kv_lora_rank: int, block_n: int):
    """TMA descriptors of the pages [num_pages, page_size, D]: [1, block_n, kv_lora_rank] tiles of c and
    [1, block_n, rope_dim] tiles of k_pe, in the shared-memory layouts the kernel's MMAs read. Rows outside a page
    read as zeros."""
    dtype = _GL_DTYPE[kv_cache.dtype]
    rope = kv_cache.shape[2] - kv_lora_rank
    c_block, pe_block = [1, block_n, kv_lora_rank], [1, block_n, rope]
    c = TensorDescriptor(kv_cache, list(kv_cache.shape), list(kv_cache.stride()), c_block,
                         gl.NVMMASharedLayout.get_default_for(c_block, dtype))  # fmt: skip
    pe = kv_cache[..., kv_lora_rank:]
    pe = TensorDescriptor(pe, list(pe.shape), list(pe.stride()), pe_block,
                          gl.NVMMASharedLayout.get_default_for(pe_block, dtype))  # fmt: skip
    return c, pe


@gluon.jit
def _issue_tile(kv_c_desc, kv_pe_desc, pages_ptr, tile_lo, hi, bar, c_buf, pe_buf, PAGE_SIZE: gl.constexpr,
                BLOCK_N: gl.constexpr):  # fmt: skip
    """Start the TMA copy of the tile of keys [tile_lo, tile_lo + BLOCK_N) into (c_buf, pe_buf), arriving on bar.
    A partial last tile is read as the window ending at hi, as in the Triton kernel: never the stale rows past a
    sequence's end (0 * NaN in P @ V would poison rows), but masked keys before it or TMA's zeros before the page."""
    shift = BLOCK_N - gl.minimum(hi - tile_lo, BLOCK_N)
    page = gl.load(pages_ptr + tile_lo // PAGE_SIZE)
    row = tile_lo % PAGE_SIZE - shift
    mbarrier.expect(bar, kv_c_desc.block_type.nbytes + kv_pe_desc.block_type.nbytes)
    _tma_load(kv_c_desc, [page, row, 0], bar, c_buf)
    _tma_load(kv_pe_desc, [page, row, 0], bar, pe_buf)


@gluon.jit
def _scores_async(q_smem, qpe_smem, c_buf, pe_buf, s_layout: gl.constexpr, BLOCK_M: gl.constexpr,
                  BLOCK_N: gl.constexpr, DC: gl.constexpr, DR: gl.constexpr):  # fmt: skip
    """Issue q_c @ c^T + q_pe @ pe^T for one tile ([BLOCK_M, BLOCK_N] fp32, not yet waited for)."""
    s = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout)
    s = warpgroup_mma(q_smem, c_buf.reshape([BLOCK_N, DC]).permute((1, 0)), s, use_acc=False, is_async=True)
    return warpgroup_mma(qpe_smem, pe_buf.reshape([BLOCK_N, DR]).permute((1, 0)), s, is_async=True)


@gluon.jit
def mla_decode_wgmma_kernel(
    q_ptr,
    kv_c_desc,
    kv_pe_desc,
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
    stride_bt,
    PAGE_SIZE: gl.constexpr,
    BLOCK_H: gl.constexpr,
    BLOCK_Q: gl.constexpr,
    SEQS_POW2: gl.constexpr,
    HAS_BOUNDS: gl.constexpr,
    SPLIT: gl.constexpr,
    NUM_STAGES: gl.constexpr,
):
    BLOCK_M: gl.constexpr = BLOCK_Q * BLOCK_H
    BLOCK_N: gl.constexpr = kv_c_desc.block_type.shape[1]
    DC: gl.constexpr = kv_c_desc.block_type.shape[2]
    DR: gl.constexpr = kv_pe_desc.block_type.shape[2]
    dtype: gl.constexpr = kv_c_desc.dtype
    NW: gl.constexpr = gl.num_warps()
    gl.static_assert(NW == 8, "two warpgroups: one per half of the keys (scores) and of the columns (output)")
    gl.static_assert(BLOCK_M == 64, "one wgmma row block")

    # Scores: the warpgroups split the tile's keys. Output: they split the latent's columns.
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                       instr_shape=[16, BLOCK_N // 2, 16])  # fmt: skip
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                       instr_shape=[16, DC // 2, 16])  # fmt: skip
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
    key_layout: gl.constexpr = gl.SliceLayout(0, s_layout)
    io_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [NW, 1], [1, 0])
    seq_layout: gl.constexpr = gl.BlockedLayout([1], [32], [NW], [0])

    # Which sequence, query tokens, heads and split this program owns: as in the Triton kernel.
    pid = gl.program_id(0)
    head_block = pid % num_head_blocks
    split = (pid // num_head_blocks) % num_splits
    slot = pid // (num_head_blocks * num_splits)
    idx = gl.arange(0, SEQS_POW2, layout=seq_layout)
    cu = gl.load(cu_seqlens_q_ptr + idx, mask=idx <= num_seqs, other=0)
    first_slot = (cu + idx * (BLOCK_Q - 1)) // BLOCK_Q
    seq = gl.sum(((first_slot <= slot) & (idx <= num_seqs)).to(gl.int32), axis=0) - 1
    if seq >= num_seqs:
        return
    q_lo = gl.load(cu_seqlens_q_ptr + seq)
    q_hi = gl.load(cu_seqlens_q_ptr + seq + 1)
    tok0 = q_lo + (slot - (q_lo + seq * (BLOCK_Q - 1)) // BLOCK_Q) * BLOCK_Q
    if tok0 >= q_hi:
        return

    rows = gl.arange(0, BLOCK_M, layout=row_layout)
    tok = tok0 + rows // BLOCK_H
    head = head_block * BLOCK_H + rows % BLOCK_H
    row_ok = (tok < q_hi) & (head < num_heads)
    kv_len = gl.load(cache_seqlens_ptr + seq)
    if HAS_BOUNDS:
        bound = gl.load(kv_bounds_ptr + tok, mask=row_ok, other=0)
    else:
        bound = kv_len - (q_hi - q_lo) + (tok - q_lo) + 1
    bound = gl.where(row_ok, gl.minimum(gl.maximum(bound, 0), kv_len), 0)
    split_len = gl.cdiv(gl.cdiv(kv_len, num_splits), BLOCK_N) * BLOCK_N
    lo = split * split_len
    hi = gl.minimum(lo + split_len, gl.max(bound, axis=0))
    bound = gl.minimum(bound, hi)

    # q into shared memory once: the A operand of every score MMA.
    q_smem = gl.allocate_shared_memory(dtype, [BLOCK_M, DC], gl.NVMMASharedLayout.get_default_for([BLOCK_M, DC], dtype))
    qpe_smem = gl.allocate_shared_memory(dtype, [BLOCK_M, DR],
                                         gl.NVMMASharedLayout.get_default_for([BLOCK_M, DR], dtype))  # fmt: skip
    io_rows = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, io_layout))
    io_tok = tok0 + io_rows // BLOCK_H
    io_head = head_block * BLOCK_H + io_rows % BLOCK_H
    io_ok = ((io_tok < q_hi) & (io_head < num_heads))[:, None]
    q_row = q_ptr + io_tok.to(gl.int64) * stride_qt + io_head * stride_qh
    dc = gl.arange(0, DC, layout=gl.SliceLayout(0, io_layout))
    dr = gl.arange(0, DR, layout=gl.SliceLayout(0, io_layout))
    q_smem.store(gl.load(q_row[:, None] + dc[None, :], mask=io_ok, other=0.0))
    qpe_smem.store(gl.load(q_row[:, None] + DC + dr[None, :], mask=io_ok, other=0.0))

    c_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES, 1, BLOCK_N, DC], kv_c_desc.layout)
    pe_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES, 1, BLOCK_N, DR], kv_pe_desc.layout)
    p_smem = gl.allocate_shared_memory(dtype, [BLOCK_M, BLOCK_N],
                                       gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_N], dtype))  # fmt: skip
    bars = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    for st in gl.static_range(NUM_STAGES):
        mbarrier.init(bars.index(st), count=1)
    fence_async_shared()
    _cta_barrier()

    pages_ptr = block_table_ptr + seq * stride_bt
    num_tiles = gl.cdiv(gl.maximum(hi - lo, 0), BLOCK_N)
    m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, row_layout)
    l_i = gl.zeros([BLOCK_M], gl.float32, row_layout)
    # The first NUM_STAGES tiles in flight, then the first scores.
    for t in gl.static_range(NUM_STAGES):
        if t < num_tiles:
            _issue_tile(kv_c_desc, kv_pe_desc, pages_ptr, lo + t * BLOCK_N, hi, bars.index(t), c_smem.index(t),
                        pe_smem.index(t), PAGE_SIZE, BLOCK_N)  # fmt: skip
    s = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout)
    if num_tiles > 0:
        mbarrier.wait(bars.index(0), 0)
        s = _scores_async(q_smem, qpe_smem, c_smem.index(0), pe_smem.index(0), s_layout, BLOCK_M, BLOCK_N, DC, DR)
        s = warpgroup_mma_wait(0, deps=(s,))

    acc = gl.zeros([BLOCK_M, DC], gl.float32, o_layout)
    for i in range(num_tiles):
        stage = i % NUM_STAGES
        tile_lo = lo + i * BLOCK_N
        # Softmax of tile i's scores in fp32 with exp2, keys past the split or a row's bound masked.
        shift = BLOCK_N - gl.minimum(hi - tile_lo, BLOCK_N)
        n = tile_lo - shift + gl.arange(0, BLOCK_N, layout=key_layout)
        visible = (n >= tile_lo)[None, :] & (n[None, :] < bound[:, None])
        s = gl.where(visible, s * qk_scale, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, axis=1))
        # Rows with no visible key so far keep m = -inf; offsetting by 0 keeps exp2 away from -inf - -inf.
        m_off = gl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = gl.exp2(m_i - m_off)
        p = gl.exp2(s - m_off[:, None])
        l_i = l_i * alpha + gl.sum(p, axis=1)
        m_i = m_new
        acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
        p_smem.store(p.to(dtype))
        fence_async_shared()
        _cta_barrier()

        # P @ c of tile i, then tile i + 1's scores behind it on the tensor cores. As soon as P @ c is done in
        # both warpgroups (each waits for its own, the barrier joins them), tile i's buffer takes tile
        # i + NUM_STAGES: its copy then has the next scores, softmax and P @ c to land in. (Run 18: copying after
        # the softmax took H=128 0.95 ms, before it 0.81, here 0.80.)
        o = warpgroup_mma(p_smem, c_smem.index(stage).reshape([BLOCK_N, DC]), acc, is_async=True)
        if i + 1 < num_tiles:
            nxt = (i + 1) % NUM_STAGES
            mbarrier.wait(bars.index(nxt), ((i + 1) // NUM_STAGES) & 1)
            s_next = _scores_async(q_smem, qpe_smem, c_smem.index(nxt), pe_smem.index(nxt), s_layout, BLOCK_M,
                                   BLOCK_N, DC, DR)  # fmt: skip
            acc = warpgroup_mma_wait(2, deps=(o,))  # the score MMAs (two groups) may still run
            _cta_barrier()
            ahead = i + NUM_STAGES
            if ahead < num_tiles:
                _issue_tile(kv_c_desc, kv_pe_desc, pages_ptr, lo + ahead * BLOCK_N, hi, bars.index(stage),
                            c_smem.index(stage), pe_smem.index(stage), PAGE_SIZE, BLOCK_N)  # fmt: skip
            s = warpgroup_mma_wait(0, deps=(s_next,))
        else:
            acc = warpgroup_mma_wait(0, deps=(o,))

    for st in gl.static_range(NUM_STAGES):
        mbarrier.invalidate(bars.index(st))
    has_keys = l_i > 0
    l_safe = gl.where(has_keys, l_i, 1.0)
    lse = gl.where(has_keys, (m_i + gl.log2(l_safe)) * 0.6931471805599453, float("-inf"))
    row = tok.to(gl.int64) * num_heads + head
    if SPLIT:
        row = row * num_splits + split
    gl.store(lse_ptr + row, lse, mask=row_ok)

    o_rows: gl.constexpr = gl.SliceLayout(1, o_layout)
    out = acc / gl.convert_layout(l_safe, o_rows)[:, None]
    o_row = gl.convert_layout(row, o_rows)
    o_ok = gl.convert_layout(row_ok, o_rows)
    oc = gl.arange(0, DC, layout=gl.SliceLayout(0, o_layout))
    gl.store(out_ptr + o_row[:, None] * DC + oc[None, :], out.to(out_ptr.dtype.element_ty), mask=o_ok[:, None])
