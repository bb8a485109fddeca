"""Warp-specialised Gluon kernel for absorbed-MLA decode and verify at 64 tile rows on Hopper (sm_90).

At 64 rows (H >= 64, or H x s_q = 64 in verify) the Triton kernel (`decode.mla_decode_fwd_kernel`) is bound by how
Triton lays out its score dot: with 8 warps and a dot chained into another, every warp goes along M, so both
warpgroups compute the whole [64, BLOCK_N] score tile (twice the tensor work) with 32-wide MMAs that each read
their q rows from shared memory again, and nothing overlaps the softmax. Gluon (Triton's explicit-layout dialect)
lets this kernel split the work by role instead. Three partitions share each tile of a sequence's latents:
- a loader warp copies tiles by TMA into NUM_STAGES buffers, each as two column halves of c and the rope part,
  each part refilled as soon as its last reader is done with it;
- the scores warpgroup (the default partition) computes a tile's whole [64, BLOCK_N] score block with 64-key MMAs
  (one A read of q per 64 keys instead of two), its softmax, and P @ c for the first half of the output columns;
- the output warpgroup computes P @ c for the second half, from P and the rescale factors the scores warpgroup
  leaves in shared memory, once the next tile's scores are done: so its MMAs run beside the next softmax.
This split beats both the Triton kernel and two warpgroups that split every tile's keys and columns alike; the
deferred second half, the part-by-part refills, a cheaper softmax and (without split-KV) sequences taken longest
first each gained on top (docs/benchmarks.md has the current times, docs/benchmark-history.md the steps).

Same contract as `decode.mla_decode_triton` (out, lse, split-KV partials merged by
`combine_triton.mla_decode_combine_kernel`) for 16-bit q with a cache of the same dtype whose pages TMA can copy;
`decode._wgmma_ok` says when it serves a call.
Gluon kernels do not run under TRITON_INTERPRET: `tests/kernels/mla/test_gpu.py::test_gpu_wgmma_kernel` checks
this one against the torch reference on the GPU, and a CPU test compiles it for sm_90.
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
# Names that changed after Triton 3.6 (the GPU image's): a barrier of a partition's threads, and a TMA tile load.
_cta_barrier = getattr(gl, "thread_barrier", None) or gl.barrier
_tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared


def wgmma_descriptors(kv_cache: torch.Tensor, kv_lora_rank: int, block_n: int):
    """TMA descriptors of the pages [num_pages, page_size, D]: [1, block_n, kv_lora_rank / 2] tiles of c (loaded
    at column 0 and kv_lora_rank / 2) and [1, block_n, rope_dim] tiles of k_pe. Rows outside a page read as
    zeros."""
    dtype = _GL_DTYPE[kv_cache.dtype]
    rope = kv_cache.shape[2] - kv_lora_rank
    c_block, pe_block = [1, block_n, kv_lora_rank // 2], [1, block_n, rope]
    c = TensorDescriptor(kv_cache, list(kv_cache.shape), list(kv_cache.stride()), c_block,
                         gl.NVMMASharedLayout.get_default_for(c_block, dtype))  # fmt: skip
    pe = kv_cache[..., kv_lora_rank:]
    pe = TensorDescriptor(pe, list(pe.shape), list(pe.stride()), pe_block,
                          gl.NVMMASharedLayout.get_default_for(pe_block, dtype))  # fmt: skip
    return c, pe


@gluon.jit
def _load_partition(kv_c_desc, kv_pe_desc, pages_ptr, lo, hi, num_tiles, clo_smem, chi_smem, pe_smem, kv_ready,
                    kv_free, PAGE_SIZE: gl.constexpr, BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr):  # fmt: skip
    """Copy the split's tiles into the buffers part by part (the rope, c's first half, c's second half: barrier
    stage * 3 + 2, 0, 1) as their readers free them: the rope once the tile's scores are done, each half of c once
    the warpgroup multiplying P by it is. A partial last tile is read as the window ending at hi, as in the Triton
    kernel: never the stale rows past a sequence's end (0 * NaN in P @ V would poison rows), but masked keys before
    it or TMA's zeros before the page."""
    DH: gl.constexpr = kv_c_desc.block_type.shape[2]
    # Each tile's page is read from the block table one tile ahead, so its latency is not added to the copy's.
    page = gl.load(pages_ptr + lo // PAGE_SIZE, mask=num_tiles > 0, other=0)
    for t in range(num_tiles):
        stage = t % NUM_STAGES
        tile_lo = lo + t * BLOCK_N
        shift = BLOCK_N - gl.minimum(hi - tile_lo, BLOCK_N)
        row = tile_lo % PAGE_SIZE - shift
        next_page = gl.load(pages_ptr + (tile_lo + BLOCK_N) // PAGE_SIZE, mask=t + 1 < num_tiles, other=0)
        phase = ((t - NUM_STAGES) // NUM_STAGES) & 1
        mbarrier.wait(kv_free.index(stage * 3 + 2), phase, pred=t >= NUM_STAGES)
        mbarrier.expect(kv_ready.index(stage * 3 + 2), kv_pe_desc.block_type.nbytes)
        _tma_load(kv_pe_desc, [page, row, 0], kv_ready.index(stage * 3 + 2), pe_smem.index(stage))
        for half in gl.static_range(2):
            mbarrier.wait(kv_free.index(stage * 3 + half), phase, pred=t >= NUM_STAGES)
            mbarrier.expect(kv_ready.index(stage * 3 + half), kv_c_desc.block_type.nbytes)
            dst = clo_smem.index(stage) if half == 0 else chi_smem.index(stage)
            _tma_load(kv_c_desc, [page, row, half * DH], kv_ready.index(stage * 3 + half), dst)
        page = next_page


@gluon.jit
def _scores_async(qlo_smem, qhi_smem, qpe_smem, clo_smem, chi_smem, pe_smem, kv_ready, t, s_layout: gl.constexpr,
                  BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr):  # fmt: skip
    """Issue q_pe @ pe^T + q_c @ c^T for tile t ([BLOCK_M, BLOCK_N] fp32, three MMA groups, not waited for), each
    part once it has landed, in the order the loader refills them."""
    DH: gl.constexpr = qlo_smem.shape[1]
    DR: gl.constexpr = qpe_smem.shape[1]
    stage = t % NUM_STAGES
    phase = (t // NUM_STAGES) & 1
    s = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout)
    mbarrier.wait(kv_ready.index(stage * 3 + 2), phase)
    pe = pe_smem.index(stage).reshape([BLOCK_N, DR]).permute((1, 0))
    s = warpgroup_mma(qpe_smem, pe, s, use_acc=False, is_async=True)
    mbarrier.wait(kv_ready.index(stage * 3), phase)
    s = warpgroup_mma(qlo_smem, clo_smem.index(stage).reshape([BLOCK_N, DH]).permute((1, 0)), s, is_async=True)
    mbarrier.wait(kv_ready.index(stage * 3 + 1), phase)
    return warpgroup_mma(qhi_smem, chi_smem.index(stage).reshape([BLOCK_N, DH]).permute((1, 0)), s, is_async=True)


@gluon.jit
def _scores_partition(qlo_smem, qhi_smem, qpe_smem, clo_smem, chi_smem, pe_smem, p_smem, alpha_smem, l_smem,
                      kv_ready, kv_free, p_ready, p_free, done, bound, bound_min, out_row, row_ok, lo, hi, num_tiles,
                      qk_scale, out_ptr, lse_ptr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                      NUM_STAGES: gl.constexpr):  # fmt: skip
    """Scores, softmax and the first half of the output columns; writes lse and its half of out. bound_min: the
    fewest keys a row sees; tiles below it need no mask."""
    DH: gl.constexpr = qlo_smem.shape[1]
    # One warpgroup's score tile and output half.
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 16])  # fmt: skip
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, DH, 16])  # fmt: skip
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
    key_layout: gl.constexpr = gl.SliceLayout(0, s_layout)
    m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, row_layout)
    l_i = gl.zeros([BLOCK_M], gl.float32, row_layout)
    acc = gl.zeros([BLOCK_M, DH], gl.float32, o_layout)
    s = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout)
    if num_tiles > 0:
        s = _scores_async(qlo_smem, qhi_smem, qpe_smem, clo_smem, chi_smem, pe_smem, kv_ready, 0, s_layout, BLOCK_M,
                          BLOCK_N, NUM_STAGES)  # fmt: skip
        s = warpgroup_mma_wait(0, deps=(s,))
        mbarrier.arrive(kv_free.index(2), count=1)  # the rope part, read only by the scores

    for i in range(num_tiles):
        stage = i % NUM_STAGES
        tile_lo = lo + i * BLOCK_N
        # Softmax of tile i's scores in fp32 with exp2, keys past the split or a row's bound masked (only tiles
        # reaching past some row's bound, or the split's partial last tile, need the mask). A warp holds whole
        # rows, so the row max and sum stay within it. m is kept unscaled, so the scale folds into exp2's FMA.
        if tile_lo + BLOCK_N > bound_min:
            shift = BLOCK_N - gl.minimum(hi - tile_lo, BLOCK_N)
            n = tile_lo - shift + gl.arange(0, BLOCK_N, layout=key_layout)
            visible = (n >= tile_lo)[None, :] & (n[None, :] < bound[:, None])
            s = gl.where(visible, s, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, axis=1))
        # Rows with no visible key so far keep m = -inf; offsetting by 0 keeps exp2 away from -inf - -inf.
        m_off = gl.where(m_new == float("-inf"), 0.0, m_new * qk_scale)
        alpha = gl.exp2(m_i * qk_scale - m_off)
        p = gl.exp2(s * qk_scale - m_off[:, None])
        l_i = l_i * alpha + gl.sum(p, axis=1)
        m_i = m_new

        # P and alpha for the output warpgroup, once it is done with tile i - 1's.
        mbarrier.wait(p_free, (i + 1) & 1, pred=i > 0)
        p_smem.store(p.to(p_smem.dtype))
        alpha_smem.store(alpha)
        fence_async_shared()
        _cta_barrier()

        # This half of P @ c, then tile i + 1's scores behind it; tile i's first half of c is released once that
        # is done (the output warpgroup releases the second half), tile i + 1's rope once its scores are. Only
        # then may the output warpgroup start on tile i: its MMAs run beside tile i + 1's softmax instead of
        # beside these (sharing the tensor cores with them left them idle through every softmax).
        acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
        o = warpgroup_mma(p_smem, clo_smem.index(stage).reshape([BLOCK_N, DH]), acc, is_async=True)
        if i + 1 < num_tiles:
            s_next = _scores_async(qlo_smem, qhi_smem, qpe_smem, clo_smem, chi_smem, pe_smem, kv_ready, i + 1,
                                   s_layout, BLOCK_M, BLOCK_N, NUM_STAGES)  # fmt: skip
            acc = warpgroup_mma_wait(3, deps=(o,))  # the three score groups may still run
            _cta_barrier()
            mbarrier.arrive(kv_free.index(stage * 3), count=1)
            s = warpgroup_mma_wait(0, deps=(s_next,))
            mbarrier.arrive(kv_free.index(((i + 1) % NUM_STAGES) * 3 + 2), count=1)
            mbarrier.arrive(p_ready, count=1)
        else:
            mbarrier.arrive(p_ready, count=1)
            acc = warpgroup_mma_wait(0, deps=(o,))

    has_keys = l_i > 0
    l_safe = gl.where(has_keys, l_i, 1.0)
    l_smem.store(l_safe)
    _cta_barrier()
    mbarrier.arrive(done, count=1)
    lse = gl.where(has_keys, (m_i * qk_scale + gl.log2(l_safe)) * 0.6931471805599453, float("-inf"))
    gl.store(lse_ptr + out_row, lse, mask=row_ok)
    o_rows: gl.constexpr = gl.SliceLayout(1, o_layout)
    out = acc / gl.convert_layout(l_safe, o_rows)[:, None]
    oc = gl.arange(0, DH, layout=gl.SliceLayout(0, o_layout))
    o_row = gl.convert_layout(out_row, o_rows)
    o_ok = gl.convert_layout(row_ok, o_rows)
    gl.store(out_ptr + o_row[:, None] * (2 * DH) + oc[None, :], out.to(out_ptr.dtype.element_ty), mask=o_ok[:, None])


@gluon.jit
def _output_partition(p_smem, chi_smem, alpha_smem, l_smem, kv_free, p_ready, p_free, done, num_tiles, tok0, q_hi,
                      head_block, num_heads, num_splits, split, out_ptr, BLOCK_H: gl.constexpr, BLOCK_M: gl.constexpr,
                      BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr, SPLIT: gl.constexpr):  # fmt: skip
    """The second half of the output columns: P @ c from what the scores warpgroup leaves in shared memory, each
    tile's once the scores warpgroup has the next tile's scores."""
    DH: gl.constexpr = chi_smem.shape[3]
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, DH, 16])  # fmt: skip
    o_rows: gl.constexpr = gl.SliceLayout(1, o_layout)
    acc = gl.zeros([BLOCK_M, DH], gl.float32, o_layout)
    for i in range(num_tiles):
        stage = i % NUM_STAGES
        mbarrier.wait(p_ready, i & 1)
        acc = acc * alpha_smem.load(o_rows)[:, None]
        o = warpgroup_mma(p_smem, chi_smem.index(stage).reshape([BLOCK_N, DH]), acc, is_async=True)
        acc = warpgroup_mma_wait(0, deps=(o,))
        _cta_barrier()
        mbarrier.arrive(p_free, count=1)
        mbarrier.arrive(kv_free.index(stage * 3 + 1), count=1)

    mbarrier.wait(done, 0)
    rows = gl.arange(0, BLOCK_M, layout=o_rows)
    tok = tok0 + rows // BLOCK_H
    head = head_block * BLOCK_H + rows % BLOCK_H
    row_ok = (tok < q_hi) & (head < num_heads)
    row = tok.to(gl.int64) * num_heads + head
    if SPLIT:
        row = row * num_splits + split
    out = acc / l_smem.load(o_rows)[:, None]
    oc = DH + gl.arange(0, DH, layout=gl.SliceLayout(0, o_layout))
    gl.store(out_ptr + row[:, None] * (2 * DH) + oc[None, :], out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


@gluon.jit
def _in_order(cu_seqlens_q_ptr, num_seqs, slot, BLOCK_Q: gl.constexpr, SEQS_POW2: gl.constexpr):
    """(sequence, first query token) of the slot-th BLOCK_Q-token slot, sequences in order, as the Triton kernel
    maps them: sequence i owns slots [f(i), f(i + 1)) with f(i) = (cu_q[i] + i * (BLOCK_Q - 1)) // BLOCK_Q, room for
    its cdiv(s_q_i, BLOCK_Q) slots; (-1, 0) past the last sequence. A slot past a sequence's tokens (tok0 >= its
    end) is idle."""
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    idx = gl.arange(0, SEQS_POW2, layout=layout)
    cu = gl.load(cu_seqlens_q_ptr + idx, mask=idx <= num_seqs, other=0)
    first_slot = (cu + idx * (BLOCK_Q - 1)) // BLOCK_Q
    seq = gl.sum(((first_slot <= slot) & (idx <= num_seqs)).to(gl.int32), axis=0) - 1
    tok0 = gl.sum(gl.where(idx == seq, cu + (slot - first_slot) * BLOCK_Q, 0), axis=0)
    return gl.where(seq < num_seqs, seq, -1), tok0


@gluon.jit
def _longest_first(cache_seqlens_ptr, cu_seqlens_q_ptr, num_seqs, slot, BLOCK_Q: gl.constexpr,
                   SEQS_POW2: gl.constexpr):  # fmt: skip
    """(sequence, first query token) of the slot-th BLOCK_Q-token slot when sequences are taken longest first (by
    cache length, ties by index; each with cdiv(s_q, BLOCK_Q) slots), or (-1, 0) past the last slot. With two or
    so waves of programs, each carrying a whole sequence's keys, the SMs that drew the shortest sequences first then
    take the longest left, instead of the last wave's long sequences running alone (docs/benchmark-history.md).
    Every program ranks all sequences: O(num_seqs^2) work, in chunks of 32 rows."""
    pair: gl.constexpr = gl.BlockedLayout([1, 1], [1, 32], [4, 1], [1, 0])
    CHUNK: gl.constexpr = 32 if SEQS_POW2 > 32 else SEQS_POW2
    j = gl.arange(0, SEQS_POW2, layout=gl.SliceLayout(0, pair))
    j_ok = j < num_seqs
    len_j = gl.load(cache_seqlens_ptr + j, mask=j_ok, other=0)
    cu_j = gl.load(cu_seqlens_q_ptr + j, mask=j_ok, other=0)
    slots_j = gl.where(j_ok, gl.cdiv(gl.load(cu_seqlens_q_ptr + j + 1, mask=j_ok, other=0) - cu_j, BLOCK_Q), 0)
    # start_j: the slots of the sequences taken before j, first of this program's slot
    start_j = gl.zeros([SEQS_POW2], gl.int32, gl.SliceLayout(0, pair))
    for k0 in range(0, SEQS_POW2, CHUNK):
        k = k0 + gl.arange(0, CHUNK, layout=gl.SliceLayout(1, pair))
        k_ok = k < num_seqs
        len_k = gl.load(cache_seqlens_ptr + k, mask=k_ok, other=0)
        slots_k = gl.cdiv(gl.load(cu_seqlens_q_ptr + k + 1, mask=k_ok, other=0)
                          - gl.load(cu_seqlens_q_ptr + k, mask=k_ok, other=0), BLOCK_Q)  # fmt: skip
        first = (len_k[:, None] > len_j[None, :]) | ((len_k[:, None] == len_j[None, :]) & (k[:, None] < j[None, :]))
        start_j += gl.sum(gl.where(first & k_ok[:, None], slots_k[:, None], 0), axis=0)
    mine = j_ok & (start_j <= slot) & (slot < start_j + slots_j)
    seq = gl.max(gl.where(mine, j, -1), axis=0)
    tok0 = gl.sum(gl.where(mine, cu_j + (slot - start_j) * BLOCK_Q, 0), axis=0)
    return seq, tok0


@gluon.jit
def program_slot(cache_seqlens_ptr, cu_seqlens_q_ptr, num_seqs, num_head_blocks, num_splits, BLOCK_Q: gl.constexpr,
                 SEQS_POW2: gl.constexpr, LONGEST_FIRST: gl.constexpr):  # fmt: skip
    """(head block, split, sequence, first query token, the sequence's query range [q_lo, q_hi)) of this program:
    head blocks, then splits, vary fastest; sequence -1 (and an empty range) past the last slot. A program whose
    sequence is -1 or whose first token is past q_hi is idle."""
    pid = gl.program_id(0)
    head_block = pid % num_head_blocks
    split = (pid // num_head_blocks) % num_splits
    slot = pid // (num_head_blocks * num_splits)
    if LONGEST_FIRST:
        seq, tok0 = _longest_first(cache_seqlens_ptr, cu_seqlens_q_ptr, num_seqs, slot, BLOCK_Q, SEQS_POW2)
    else:
        seq, tok0 = _in_order(cu_seqlens_q_ptr, num_seqs, slot, BLOCK_Q, SEQS_POW2)
    q_lo = gl.load(cu_seqlens_q_ptr + seq, mask=seq >= 0, other=0)
    q_hi = gl.load(cu_seqlens_q_ptr + seq + 1, mask=seq >= 0, other=0)
    return head_block, split, seq, tok0, q_lo, q_hi


@gluon.jit
def split_range(cache_seqlens_ptr, kv_bounds_ptr, seq, tok0, q_lo, q_hi, head_block, num_heads, num_splits, split,
                row_layout: gl.constexpr, BLOCK_H: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                USE_KV_BOUNDS: gl.constexpr, SPLIT: gl.constexpr):  # fmt: skip
    """The program's BLOCK_M rows (query token, head) in row_layout and its split's keys [lo, hi): (row_ok, each
    row's bound on visible keys, the fewest keys a row sees, lo, hi, tiles, the rows of out and lse). Twin of
    kernels/mla/decode.py:mla_decode_fwd_kernel (same contract), and shared by both Gluon kernels (this file's
    and `decode_fp8_wgmma`'s): a fix here belongs there too."""
    rows = gl.arange(0, BLOCK_M, layout=row_layout)
    tok = tok0 + rows // BLOCK_H
    head = head_block * BLOCK_H + rows % BLOCK_H
    row_ok = (tok < q_hi) & (head < num_heads)
    kv_len = gl.load(cache_seqlens_ptr + seq)
    if USE_KV_BOUNDS:
        bound = gl.load(kv_bounds_ptr + tok, mask=row_ok, other=0)
    else:
        bound = kv_len - (q_hi - q_lo) + (tok - q_lo) + 1
    bound = gl.where(row_ok, gl.minimum(gl.maximum(bound, 0), kv_len), 0)
    # Whole tiles a split, so that no tile straddles two splits.
    split_len = gl.cdiv(gl.cdiv(kv_len, num_splits), BLOCK_N) * BLOCK_N
    lo = split * split_len
    hi = gl.minimum(lo + split_len, gl.max(bound, axis=0))
    bound = gl.minimum(bound, hi)
    bound_min = gl.min(gl.where(row_ok, bound, hi), axis=0)
    num_tiles = gl.cdiv(gl.maximum(hi - lo, 0), BLOCK_N)
    out_row = tok.to(gl.int64) * num_heads + head
    if SPLIT:
        out_row = out_row * num_splits + split
    return row_ok, bound, bound_min, lo, hi, num_tiles, out_row


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
    USE_KV_BOUNDS: gl.constexpr,
    SPLIT: gl.constexpr,
    NUM_STAGES: gl.constexpr,
    LONGEST_FIRST: gl.constexpr,
):
    BLOCK_M: gl.constexpr = BLOCK_Q * BLOCK_H
    BLOCK_N: gl.constexpr = kv_c_desc.block_type.shape[1]
    DH: gl.constexpr = kv_c_desc.block_type.shape[2]
    DR: gl.constexpr = kv_pe_desc.block_type.shape[2]
    dtype: gl.constexpr = kv_c_desc.dtype
    gl.static_assert(gl.num_warps() == 4, "the parent and the scores partition are one warpgroup")
    gl.static_assert(BLOCK_M == 64, "one wgmma row block")
    # The scores partition's score tile (its rows, the bounds and output rows below, are computed here).
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 16])  # fmt: skip
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
    io_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])

    head_block, split, seq, tok0, q_lo, q_hi = program_slot(cache_seqlens_ptr, cu_seqlens_q_ptr, num_seqs,
                                                            num_head_blocks, num_splits, BLOCK_Q, SEQS_POW2,
                                                            LONGEST_FIRST)  # fmt: skip
    if (seq < 0) | (tok0 >= q_hi):
        return
    row_ok, bound, bound_min, lo, hi, num_tiles, out_row = split_range(
        cache_seqlens_ptr, kv_bounds_ptr, seq, tok0, q_lo, q_hi, head_block, num_heads, num_splits, split, row_layout,
        BLOCK_H, BLOCK_M, BLOCK_N, USE_KV_BOUNDS, SPLIT)  # fmt: skip

    # q into shared memory once, as the A operands of the score MMAs: two column halves of q_c, then q_pe.
    q_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, DH], dtype)
    qlo_smem = gl.allocate_shared_memory(dtype, [BLOCK_M, DH], q_layout)
    qhi_smem = gl.allocate_shared_memory(dtype, [BLOCK_M, DH], q_layout)
    qpe_smem = gl.allocate_shared_memory(dtype, [BLOCK_M, DR],
                                         gl.NVMMASharedLayout.get_default_for([BLOCK_M, DR], dtype))  # fmt: skip
    io_rows = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, io_layout))
    io_tok = tok0 + io_rows // BLOCK_H
    io_head = head_block * BLOCK_H + io_rows % BLOCK_H
    io_ok = ((io_tok < q_hi) & (io_head < num_heads))[:, None]
    q_row = (q_ptr + io_tok.to(gl.int64) * stride_qt + io_head * stride_qh)[:, None]
    dh = gl.arange(0, DH, layout=gl.SliceLayout(0, io_layout))[None, :]
    dr = gl.arange(0, DR, layout=gl.SliceLayout(0, io_layout))[None, :]
    qlo_smem.store(gl.load(q_row + dh, mask=io_ok, other=0.0))
    qhi_smem.store(gl.load(q_row + DH + dh, mask=io_ok, other=0.0))
    qpe_smem.store(gl.load(q_row + 2 * DH + dr, mask=io_ok, other=0.0))

    clo_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES, 1, BLOCK_N, DH], kv_c_desc.layout)
    chi_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES, 1, BLOCK_N, DH], kv_c_desc.layout)
    pe_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES, 1, BLOCK_N, DR], kv_pe_desc.layout)
    p_smem = gl.allocate_shared_memory(dtype, [BLOCK_M, BLOCK_N],
                                       gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_N], dtype))  # fmt: skip
    vec_layout: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
    alpha_smem = gl.allocate_shared_memory(gl.float32, [BLOCK_M], vec_layout)
    l_smem = gl.allocate_shared_memory(gl.float32, [BLOCK_M], vec_layout)
    # Per buffer and part (c's halves, the rope): landed, and free again.
    kv_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES * 3, 1], mbarrier.MBarrierLayout())
    kv_free = gl.allocate_shared_memory(gl.int64, [NUM_STAGES * 3, 1], mbarrier.MBarrierLayout())
    p_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    p_free = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    done = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    for st in gl.static_range(NUM_STAGES):
        for part in gl.static_range(3):
            mbarrier.init(kv_ready.index(st * 3 + part), count=1)
            mbarrier.init(kv_free.index(st * 3 + part), count=1)
    mbarrier.init(p_ready, count=1)
    mbarrier.init(p_free, count=1)
    mbarrier.init(done, count=1)
    fence_async_shared()
    _cta_barrier()

    pages_ptr = block_table_ptr + seq * stride_bt
    gl.warp_specialize(
        [
            (_scores_partition, (qlo_smem, qhi_smem, qpe_smem, clo_smem, chi_smem, pe_smem, p_smem, alpha_smem, l_smem,
                                 kv_ready, kv_free, p_ready, p_free, done, bound, bound_min, out_row, row_ok, lo, hi,
                                 num_tiles, qk_scale, out_ptr, lse_ptr, BLOCK_M, BLOCK_N, NUM_STAGES)),
            (_output_partition, (p_smem, chi_smem, alpha_smem, l_smem, kv_free, p_ready, p_free, done, num_tiles, tok0,
                                 q_hi, head_block, num_heads, num_splits, split, out_ptr, BLOCK_H, BLOCK_M, BLOCK_N,
                                 NUM_STAGES, SPLIT)),
            (_load_partition, (kv_c_desc, kv_pe_desc, pages_ptr, lo, hi, num_tiles, clo_smem, chi_smem, pe_smem,
                               kv_ready, kv_free, PAGE_SIZE, BLOCK_N, NUM_STAGES)),
        ],
        [4, 1],
        [208, 40],
    )  # fmt: skip
