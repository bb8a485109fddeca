"""Warp-specialised Gluon kernel for absorbed-MLA decode and verify over the fp8 (e4m3, per-token scale) cache at
16 and 32 tile rows on Hopper (sm_90).

At 16 or 32 rows the Triton kernel (`decode.mla_decode_fwd_kernel` with `decode_fp8.attend_tile_fp8`) is bound by
latency, not bandwidth: each warp converts its e4m3 tiles to fp16 and then runs [rows, 512] dots that wait on the
conversion, and a 16-row dot cannot use a 64-row warpgroup MMA. This kernel splits the work by role instead:
- a dequant warpgroup (the worker partition) loads each tile's e4m3 rows and key scales by gathered 16-byte loads
  LOOKAHEAD tiles ahead, converts them to fp16 (exact) and writes them to one of NUM_STAGES shared buffers (or two
  dequant warpgroups, DEQUANT_WGS, each taking half of every tile's keys). LOOKAHEAD 1 copies the next tile's
  registers into the current one's every tile, and that copy waits for the load: each tile then pays the load's
  full latency. LOOKAHEAD 2 unrolls the loop so that each tile in flight keeps registers of its own
  (`_dequant_rotating`), and asks L2 for each tile's rows PREFETCH tiles before those loads (`_prefetch_l2`, no
  registers held); `decode.FP8_WGMMA` picks, scripts/tune_mla_fp8_wgmma.py times the choices;
- the MMA warpgroup (the default partition) computes the scores swapped, S^T = C Q^T, with the tile's 64 keys as
  the MMA's M dimension and the 16 or 32 query rows as its N (which wgmma allows down to 8), then the softmax, and
  O^T += C^T P^T likewise, so that no 64-row MMA is spent on 16 rows.
The numerics are those of `decode_fp8.attend_tile_fp8` (keep the two alike): q scaled per row into fp16's range
(`decode_fp8.scaled_rows`), each key's scale applied in fp32 to its score and its P @ c weight, the weights
normalised to <= 1. Transposed, the per-row reductions run over the keys, across the warpgroup's four warps; the
softmax's sum of weights is kept per key and row and reduced once at the end.

Twin of `decode_wgmma` (the 16-bit kernel at 64 rows): same contract and outputs (out, lse, split-KV partials
merged by `combine_triton.mla_decode_combine_kernel`), sharing its program map and split range (`program_slot`,
`split_range`); a fix to one belongs in the other. `decode._fp8_wgmma_ok` says when it serves a call. Gluon kernels
do not run under TRITON_INTERPRET: `tests/kernels/mla/test_gpu.py::test_gpu_fp8_wgmma_kernel` checks this one
against the torch reference on the GPU, and a CPU test compiles it for sm_90.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from kimi_helix.kernels.mla.decode_wgmma import _cta_barrier, program_slot, split_range

__all__ = ["BLOCK_N", "fp8_wgmma_smem", "mla_decode_fp8_wgmma_kernel"]

if hasattr(gl.shared_memory_descriptor, "reinterpret"):  # the name after Triton 3.6 (the GPU image's)

    @gluon.jit
    def _int32_view(smem, shape: gl.constexpr, layout: gl.constexpr):
        return smem.reinterpret(gl.int32, shape, layout)

else:

    @gluon.jit
    def _int32_view(smem, shape: gl.constexpr, layout: gl.constexpr):
        return smem._reinterpret(gl.int32, shape, layout)


# Keys a tile: the M of one warpgroup MMA (the swapped scores' rows).
BLOCK_N = 64


def fp8_wgmma_smem(rows: int, head_dim: int, stages: int) -> int:
    """Bytes of shared memory the kernel allocates for its tiles: q [rows, head_dim], the fp16 key tiles
    [stages, BLOCK_N, head_dim] and P^T [BLOCK_N, rows], 16-bit, and the key scales, fp32."""
    return 2 * (rows + stages * BLOCK_N) * head_dim + 2 * BLOCK_N * rows + 4 * stages * BLOCK_N


@gluon.jit
def _max2(a, b, c, d):
    return gl.maximum(a, c), gl.maximum(b, d)


@gluon.jit
def _store_fp16(words, smem):
    """Store e4m3 values, four to each int32 of words [R, W], as fp16 [R, 4 W] into smem, exactly: one cvt per pair,
    straight from each word, into f16x2 words stored through an int32 view of smem (the 128-byte swizzle places
    bytes alike for either element size). Triton's own conversion holds each byte in a register of its own, which
    spills the raw tiles this kernel keeps in flight."""
    lo, hi = gl.inline_asm_elementwise(
        "{ .reg .b16 l, h; mov.b32 {l, h}, $2; cvt.rn.f16x2.e4m3x2 $0, l; cvt.rn.f16x2.e4m3x2 $1, h; }",
        "=r,=r,r", [words], dtype=(gl.int32, gl.int32), is_pure=True, pack=1)  # fmt: skip
    R: gl.constexpr = words.shape[0]
    W: gl.constexpr = words.shape[1]
    halves = gl.reshape(gl.join(lo, hi), [R, 2 * W])
    _int32_view(smem, [R, 2 * W], gl.NVMMASharedLayout(smem.layout.swizzle_byte_width, 32, rank=2)).store(halves)


@gluon.jit
def _store_fp16_rows(words, smem, ROW0: gl.constexpr):
    """`_store_fp16` into rows [ROW0, ROW0 + R) of smem [BLOCK_N, 4 W] (R = words' rows; ROW0 a multiple of 8,
    the swizzle's period): the int32 view of the whole buffer, sliced."""
    lo, hi = gl.inline_asm_elementwise(
        "{ .reg .b16 l, h; mov.b32 {l, h}, $2; cvt.rn.f16x2.e4m3x2 $0, l; cvt.rn.f16x2.e4m3x2 $1, h; }",
        "=r,=r,r", [words], dtype=(gl.int32, gl.int32), is_pure=True, pack=1)  # fmt: skip
    R: gl.constexpr = words.shape[0]
    W: gl.constexpr = words.shape[1]
    N: gl.constexpr = smem.shape[0]
    halves = gl.reshape(gl.join(lo, hi), [R, 2 * W])
    view = _int32_view(smem, [N, 2 * W], gl.NVMMASharedLayout(smem.layout.swizzle_byte_width, 32, rank=2))
    if R == N:
        view.store(halves)
    else:
        view.slice(ROW0, R, dim=0).store(halves)


@gluon.jit
def _tile_rows(kv_ptr, kv_scale_ptr, pages_ptr, tile_lo, hi, stride_kvp, stride_kvs, PAGE_SIZE: gl.constexpr,
               BLOCK_N: gl.constexpr, key_layout: gl.constexpr):  # fmt: skip
    """The tile's keys [tile_lo, tile_lo + BLOCK_N) by a page lookup per key (a tile may span several small pages):
    (their latent rows' addresses, their scales' addresses, which are < hi)."""
    n = tile_lo + gl.arange(0, BLOCK_N, layout=key_layout)
    n_ok = n < hi
    page = gl.load(pages_ptr + n // PAGE_SIZE, mask=n_ok, other=0).to(gl.int64)
    slot = n % PAGE_SIZE
    return kv_ptr + page * stride_kvp + slot * stride_kvs, kv_scale_ptr + page * PAGE_SIZE + slot, n_ok


@gluon.jit
def _load_cols(row_ptr, ok, col0, W: gl.constexpr, layout: gl.constexpr):
    """W bytes from col0 of each row ([BLOCK_N] addresses in SliceLayout(1, layout)) as [BLOCK_N, W / 4] int32; keys
    not ok read as 0, not as whatever stale bytes a page holds (0 * NaN in P @ c would poison rows)."""
    words = row_ptr.to(gl.pointer_type(gl.int32), bitcast=True)
    w = col0 // 4 + gl.arange(0, W // 4, layout=gl.SliceLayout(0, layout))
    return gl.load(words[:, None] + w[None, :], mask=ok[:, None], other=0)


@gluon.jit
def _load_tile(kv_ptr, kv_scale_ptr, pages_ptr, tile_lo, hi, stride_kvp, stride_kvs, PAGE_SIZE: gl.constexpr,
               BLOCK_N: gl.constexpr, DC: gl.constexpr, DR: gl.constexpr, c_layout: gl.constexpr,
               pe_layout: gl.constexpr, ks_layout: gl.constexpr):  # fmt: skip
    """The raw tile at tile_lo: (c [BLOCK_N, DC] and pe [BLOCK_N, DR] e4m3, the key scales [BLOCK_N] fp32, 0 past
    hi). Each part looks its keys' pages up in its own layout (cached loads), which costs less than moving them
    between layouts through shared memory."""
    rows, _, ok = _tile_rows(kv_ptr, kv_scale_ptr, pages_ptr, tile_lo, hi, stride_kvp, stride_kvs, PAGE_SIZE, BLOCK_N,
                             gl.SliceLayout(1, c_layout))  # fmt: skip
    c = _load_cols(rows, ok, 0, DC, c_layout)
    rows, _, ok = _tile_rows(kv_ptr, kv_scale_ptr, pages_ptr, tile_lo, hi, stride_kvp, stride_kvs, PAGE_SIZE, BLOCK_N,
                             gl.SliceLayout(1, pe_layout))  # fmt: skip
    pe = _load_cols(rows, ok, DC, DR, pe_layout)
    _, scales, ok = _tile_rows(kv_ptr, kv_scale_ptr, pages_ptr, tile_lo, hi, stride_kvp, stride_kvs, PAGE_SIZE,
                               BLOCK_N, ks_layout)  # fmt: skip
    return c, pe, gl.load(scales, mask=ok, other=0.0)


@gluon.jit
def _dequant_partition(kv_ptr, kv_scale_ptr, pages_ptr, lo, hi, num_tiles, stride_kvp, stride_kvs, c_smem, pe_smem,
                       ks_smem, kv_ready, kv_free, PAGE_SIZE: gl.constexpr, BLOCK_N: gl.constexpr,
                       NUM_STAGES: gl.constexpr):  # fmt: skip
    """Fill the fp16 buffers tile by tile as the MMA warpgroup frees them. Each tile's e4m3 rows are loaded one tile
    ahead (in registers, while this tile converts), so the loads' latency is not added to the conversion's."""
    DC: gl.constexpr = c_smem.shape[2]
    DR: gl.constexpr = pe_smem.shape[2]
    # 16 bytes (four words) of one key row a thread: coalesced loads, and 32-byte fp16 rows to store.
    c_layout: gl.constexpr = gl.BlockedLayout([1, 4], [32 * 16 // DC, DC // 16], [4, 1], [1, 0])
    pe_layout: gl.constexpr = gl.BlockedLayout([1, 4], [32 * 16 // DR, DR // 16], [4, 1], [1, 0])
    ks_layout: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    c, pe, ks = _load_tile(kv_ptr, kv_scale_ptr, pages_ptr, lo, hi, stride_kvp, stride_kvs, PAGE_SIZE, BLOCK_N, DC,
                           DR, c_layout, pe_layout, ks_layout)  # fmt: skip
    for t in range(num_tiles):
        stage = t % NUM_STAGES
        # Past the last tile every key is masked: no memory is read.
        c_next, pe_next, ks_next = _load_tile(kv_ptr, kv_scale_ptr, pages_ptr, lo + (t + 1) * BLOCK_N, hi,
                                              stride_kvp, stride_kvs, PAGE_SIZE, BLOCK_N, DC, DR, c_layout,
                                              pe_layout, ks_layout)  # fmt: skip
        mbarrier.wait(kv_free.index(stage), ((t - NUM_STAGES) // NUM_STAGES) & 1, pred=t >= NUM_STAGES)
        _store_fp16(c, c_smem.index(stage))
        _store_fp16(pe, pe_smem.index(stage))
        ks_smem.index(stage).store(ks)
        # Written by ordinary stores, read by the tensor cores: fenced in every writing thread before the barrier.
        fence_async_shared()
        _cta_barrier()
        mbarrier.arrive(kv_ready.index(stage), count=1)
        c, pe, ks = c_next, pe_next, ks_next


@gluon.jit
def _fetch(kv_ptr, kv_scale_ptr, pages_ptr, tile_lo, key0, hi, stride_kvp, stride_kvs, PAGE_SIZE: gl.constexpr,
           TILE_N: gl.constexpr, ROWS: gl.constexpr, DC: gl.constexpr, DR: gl.constexpr, c_layout: gl.constexpr,
           pe_layout: gl.constexpr, ks_layout: gl.constexpr):  # fmt: skip
    """The raw rows [tile_lo + key0, + ROWS) of the TILE_N-key tile at tile_lo, as `_load_tile` returns them. Where
    pages hold whole tiles (PAGE_SIZE a multiple of TILE_N; tiles start at multiples of TILE_N) the tile's page is
    one scalar load shared by the three parts, else each part looks its keys' pages up one by one."""
    if PAGE_SIZE % TILE_N == 0:
        page = gl.load(pages_ptr + tile_lo // PAGE_SIZE, mask=tile_lo < hi, other=0).to(gl.int64)
        row0 = kv_ptr + page * stride_kvp
        n = tile_lo + key0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, c_layout))
        c = _load_cols(row0 + (n % PAGE_SIZE) * stride_kvs, n < hi, 0, DC, c_layout)
        n = tile_lo + key0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, pe_layout))
        pe = _load_cols(row0 + (n % PAGE_SIZE) * stride_kvs, n < hi, DC, DR, pe_layout)
        n = tile_lo + key0 + gl.arange(0, ROWS, layout=ks_layout)
        ks = gl.load(kv_scale_ptr + page * PAGE_SIZE + n % PAGE_SIZE, mask=n < hi, other=0.0)
    else:
        c, pe, ks = _load_tile(kv_ptr, kv_scale_ptr, pages_ptr, tile_lo + key0, hi, stride_kvp, stride_kvs, PAGE_SIZE,
                               ROWS, DC, DR, c_layout, pe_layout, ks_layout)  # fmt: skip
    return c, pe, ks


@gluon.jit
def _fill(
    c, pe, ks, t, num_tiles, c_smem, pe_smem, ks_smem, kv_ready, kv_free, KEY0: gl.constexpr, NUM_STAGES: gl.constexpr
):
    """Convert the raw rows of tile t (if it is one of the split's) into their rows of t's fp16 buffer once the
    MMA warpgroup has freed it, and signal the buffer's barrier (one arrival per dequant warpgroup)."""
    if t < num_tiles:
        stage = t % NUM_STAGES
        mbarrier.wait(kv_free.index(stage), ((t - NUM_STAGES) // NUM_STAGES) & 1, pred=t >= NUM_STAGES)
        _store_fp16_rows(c, c_smem.index(stage), KEY0)
        _store_fp16_rows(pe, pe_smem.index(stage), KEY0)
        if ks.shape[0] == ks_smem.shape[1]:
            ks_smem.index(stage).store(ks)
        else:
            ks_smem.index(stage).slice(KEY0, ks.shape[0]).store(ks)
        # Written by ordinary stores, read by the tensor cores: fenced in every writing thread before the barrier.
        fence_async_shared()
        _cta_barrier()
        mbarrier.arrive(kv_ready.index(stage), count=1)


@gluon.jit
def _prefetch_l2(kv_ptr, pages_ptr, tile_lo, hi, stride_kvp, stride_kvs, PAGE_SIZE: gl.constexpr, ROWS: gl.constexpr,
                 ROW_BYTES: gl.constexpr):  # fmt: skip
    """Ask L2 for the cache rows of keys [tile_lo, tile_lo + ROWS) below hi: every 128-byte line of each row (its
    line starts and its last byte, eight addresses a row), into no register. The register loads that follow hit L2
    and wait out its latency instead of the memory's."""
    gl.static_assert(ROW_BYTES <= 768, "eight addresses cover the lines of a row of at most 768 bytes")
    layout: gl.constexpr = gl.BlockedLayout([1, 2], [8, 4], [4, 1], [1, 0])
    n = tile_lo + gl.arange(0, ROWS, layout=gl.SliceLayout(1, layout))
    ok = n < hi
    page = gl.load(pages_ptr + n // PAGE_SIZE, mask=ok, other=0).to(gl.int64)
    row = kv_ptr + page * stride_kvp + (n % PAGE_SIZE) * stride_kvs
    line = gl.minimum(gl.arange(0, 8, layout=gl.SliceLayout(0, layout)) * 128, ROW_BYTES - 1)
    gl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.b32 p, $2, 0; @p prefetch.global.L2 [$1]; mov.u32 $0, 0; }", "=r,l,r",
        [row[:, None] + line[None, :], gl.where(ok, 1, 0)[:, None] + line[None, :] * 0], dtype=gl.int32,
        is_pure=False, pack=1)  # fmt: skip


@gluon.jit
def _dequant_rotating(kv_ptr, kv_scale_ptr, pages_ptr, lo, hi, num_tiles, stride_kvp, stride_kvs, c_smem, pe_smem,
                      ks_smem, kv_ready, kv_free, PAGE_SIZE: gl.constexpr, BLOCK_N: gl.constexpr,
                      NUM_STAGES: gl.constexpr, LOOKAHEAD: gl.constexpr, PART: gl.constexpr, PARTS: gl.constexpr,
                      PREFETCH: gl.constexpr):  # fmt: skip
    """`_dequant_partition` with LOOKAHEAD (2 or 3) tiles' loads in flight, for this warpgroup's BLOCK_N / PARTS
    keys of each tile (the PART-th share). The tile loop is unrolled LOOKAHEAD times so that each raw tile keeps
    its own registers: a tile's registers are reloaded (with the tile LOOKAHEAD further on) only once converted,
    so no load result is copied between registers, which would wait for the load (one tile ahead, a copy of the
    next tile into the current one's registers stalls every tile on the load's full latency). With PREFETCH > 0
    each tile's rows are also asked of L2 PREFETCH tiles before their register loads (`_prefetch_l2`)."""
    DC: gl.constexpr = c_smem.shape[2]
    DR: gl.constexpr = pe_smem.shape[2]
    ROWS: gl.constexpr = BLOCK_N // PARTS
    key0: gl.constexpr = PART * ROWS
    c_layout: gl.constexpr = gl.BlockedLayout([1, 4], [32 * 16 // DC, DC // 16], [4, 1], [1, 0])
    pe_layout: gl.constexpr = gl.BlockedLayout([1, 4], [32 * 16 // DR, DR // 16], [4, 1], [1, 0])
    ks_layout: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    c0, pe0, ks0 = _fetch(kv_ptr, kv_scale_ptr, pages_ptr, lo, key0, hi, stride_kvp, stride_kvs, PAGE_SIZE, BLOCK_N,
                          ROWS, DC, DR, c_layout, pe_layout, ks_layout)  # fmt: skip
    c1, pe1, ks1 = _fetch(kv_ptr, kv_scale_ptr, pages_ptr, lo + BLOCK_N, key0, hi, stride_kvp, stride_kvs, PAGE_SIZE,
                          BLOCK_N, ROWS, DC, DR, c_layout, pe_layout, ks_layout)  # fmt: skip
    if LOOKAHEAD == 3:
        c2, pe2, ks2 = _fetch(kv_ptr, kv_scale_ptr, pages_ptr, lo + 2 * BLOCK_N, key0, hi, stride_kvp, stride_kvs,
                              PAGE_SIZE, BLOCK_N, ROWS, DC, DR, c_layout, pe_layout, ks_layout)  # fmt: skip
    for u in gl.static_range(PREFETCH):  # then each fetch of tile u asks L2 for tile u + PREFETCH
        _prefetch_l2(kv_ptr, pages_ptr, lo + (LOOKAHEAD + u) * BLOCK_N + key0, hi, stride_kvp, stride_kvs,
                     PAGE_SIZE, ROWS, DC + DR)  # fmt: skip
    for t in range(0, num_tiles, LOOKAHEAD):
        _fill(c0, pe0, ks0, t, num_tiles, c_smem, pe_smem, ks_smem, kv_ready, kv_free, key0, NUM_STAGES)
        c0, pe0, ks0 = _fetch(kv_ptr, kv_scale_ptr, pages_ptr, lo + (t + LOOKAHEAD) * BLOCK_N, key0, hi, stride_kvp,
                              stride_kvs, PAGE_SIZE, BLOCK_N, ROWS, DC, DR, c_layout, pe_layout,
                              ks_layout)  # fmt: skip
        if PREFETCH > 0:
            _prefetch_l2(kv_ptr, pages_ptr, lo + (t + LOOKAHEAD + PREFETCH) * BLOCK_N + key0, hi, stride_kvp,
                         stride_kvs, PAGE_SIZE, ROWS, DC + DR)  # fmt: skip
        _fill(c1, pe1, ks1, t + 1, num_tiles, c_smem, pe_smem, ks_smem, kv_ready, kv_free, key0, NUM_STAGES)
        c1, pe1, ks1 = _fetch(kv_ptr, kv_scale_ptr, pages_ptr, lo + (t + 1 + LOOKAHEAD) * BLOCK_N, key0, hi,
                              stride_kvp, stride_kvs, PAGE_SIZE, BLOCK_N, ROWS, DC, DR, c_layout, pe_layout,
                              ks_layout)  # fmt: skip
        if PREFETCH > 0:
            _prefetch_l2(kv_ptr, pages_ptr, lo + (t + 1 + LOOKAHEAD + PREFETCH) * BLOCK_N + key0, hi, stride_kvp,
                         stride_kvs, PAGE_SIZE, ROWS, DC + DR)  # fmt: skip
        if LOOKAHEAD == 3:
            _fill(c2, pe2, ks2, t + 2, num_tiles, c_smem, pe_smem, ks_smem, kv_ready, kv_free, key0, NUM_STAGES)
            c2, pe2, ks2 = _fetch(kv_ptr, kv_scale_ptr, pages_ptr, lo + (t + 2 + LOOKAHEAD) * BLOCK_N, key0, hi,
                                  stride_kvp, stride_kvs, PAGE_SIZE, BLOCK_N, ROWS, DC, DR, c_layout, pe_layout,
                                  ks_layout)  # fmt: skip
            if PREFETCH > 0:
                _prefetch_l2(kv_ptr, pages_ptr, lo + (t + 2 + LOOKAHEAD + PREFETCH) * BLOCK_N + key0, hi, stride_kvp,
                             stride_kvs, PAGE_SIZE, ROWS, DC + DR)  # fmt: skip


# One wrapper per dequant warpgroup: warp_specialize takes a function per partition, each with its part of a
# tile's keys as a constant.
@gluon.jit
def _dequant_part0(kv_ptr, kv_scale_ptr, pages_ptr, lo, hi, num_tiles, stride_kvp, stride_kvs, c_smem, pe_smem,
                   ks_smem, kv_ready, kv_free, PAGE_SIZE: gl.constexpr, BLOCK_N: gl.constexpr,
                   NUM_STAGES: gl.constexpr, LOOKAHEAD: gl.constexpr, PARTS: gl.constexpr,
                   PREFETCH: gl.constexpr):  # fmt: skip
    _dequant_rotating(kv_ptr, kv_scale_ptr, pages_ptr, lo, hi, num_tiles, stride_kvp, stride_kvs, c_smem, pe_smem,
                      ks_smem, kv_ready, kv_free, PAGE_SIZE, BLOCK_N, NUM_STAGES, LOOKAHEAD, 0, PARTS,
                      PREFETCH)  # fmt: skip


@gluon.jit
def _dequant_part1(kv_ptr, kv_scale_ptr, pages_ptr, lo, hi, num_tiles, stride_kvp, stride_kvs, c_smem, pe_smem,
                   ks_smem, kv_ready, kv_free, PAGE_SIZE: gl.constexpr, BLOCK_N: gl.constexpr,
                   NUM_STAGES: gl.constexpr, LOOKAHEAD: gl.constexpr, PARTS: gl.constexpr,
                   PREFETCH: gl.constexpr):  # fmt: skip
    _dequant_rotating(kv_ptr, kv_scale_ptr, pages_ptr, lo, hi, num_tiles, stride_kvp, stride_kvs, c_smem, pe_smem,
                      ks_smem, kv_ready, kv_free, PAGE_SIZE, BLOCK_N, NUM_STAGES, LOOKAHEAD, 1, PARTS,
                      PREFETCH)  # fmt: skip


@gluon.jit
def _scores_async(q_smem, qpe_smem, c_smem, pe_smem, kv_ready, t, acc_layout: gl.constexpr, NUM_STAGES: gl.constexpr):
    """Issue S^T = pe qpe^T + c q^T for tile t ([BLOCK_N, rows] fp32, two MMA groups, not waited for) once the
    tile's fp16 buffer is filled."""
    BLOCK_N: gl.constexpr = c_smem.shape[1]
    BLOCK_M: gl.constexpr = q_smem.shape[1]
    stage = t % NUM_STAGES
    # q's buffers through an index the compiler cannot prove constant (0, as t < 2^30): else it hoists all of q's
    # MMA descriptors (one a K step, 64-bit) out of the tile loop and spills them.
    zero = t // 1073741824
    mbarrier.wait(kv_ready.index(stage), (t // NUM_STAGES) & 1)
    s = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, acc_layout)
    s = warpgroup_mma(pe_smem.index(stage), qpe_smem.index(zero).permute((1, 0)), s, use_acc=False, is_async=True)
    return warpgroup_mma(c_smem.index(stage), q_smem.index(zero).permute((1, 0)), s, is_async=True)


@gluon.jit
def _weights(s, ks, n, tile_lo, bound, bound_min, row_scale, m_i, d_i, l_keys):
    """`decode_fp8.attend_tile_fp8`'s softmax step, transposed: the scores S^T [keys, rows] of keys n with scales ks
    into the running row max m (log2 units), the per-key sums of weights l_keys [keys, rows] (summed over keys at
    the end) and d, the running row max of log2(p * ks) relative to m. Returns (the P @ c weights p * ks / 2^d
    [keys, rows] fp32, the factor beta [rows] that moves the accumulator to the new d, m, d, l_keys)."""
    s = s * ks[:, None] * row_scale[None, :]
    if tile_lo + s.shape[0] > bound_min:  # only tiles reaching past some row's bound need the mask
        s = gl.where(n[:, None] < bound[None, :], s, float("-inf"))
    u = s + gl.log2(ks)[:, None]  # log2(p * ks) + m; -inf where masked or ks = 0
    m_tile, u_tile = gl.reduce((s, u), 0, _max2)
    m_new = gl.maximum(m_i, m_tile)
    # Rows with no visible key so far keep m = -inf; offsetting by 0 keeps exp2 away from -inf - -inf.
    m_off = gl.where(m_new == float("-inf"), 0.0, m_new)
    l_keys = l_keys * gl.exp2(m_i - m_off)[None, :] + gl.exp2(s - m_off[None, :])
    d_prev = d_i + (m_i - m_off)  # the old offset, against the new max
    d_new = gl.maximum(d_prev, u_tile - m_off)
    d_off = gl.where(d_new == float("-inf"), 0.0, d_new)
    w = gl.exp2(u - (m_off + d_off)[None, :])
    return w, gl.exp2(d_prev - d_off), m_new, d_new, l_keys


@gluon.jit
def _mma_partition(q_smem, qpe_smem, c_smem, pe_smem, ks_smem, p_smem, kv_ready, kv_free, bound, bound_min, row_scale,
                   out_row, row_ok, lo, num_tiles, out_ptr, lse_ptr, acc_layout: gl.constexpr,
                   NUM_STAGES: gl.constexpr):  # fmt: skip
    """Scores, softmax and O^T for every tile of the split; writes out and lse."""
    BLOCK_N: gl.constexpr = c_smem.shape[1]
    BLOCK_M: gl.constexpr = q_smem.shape[1]
    DC: gl.constexpr = c_smem.shape[2]
    rows_layout: gl.constexpr = gl.SliceLayout(0, acc_layout)
    keys_layout: gl.constexpr = gl.SliceLayout(1, acc_layout)
    m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, rows_layout)
    d_i = m_i
    l_keys = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, acc_layout)
    acc = gl.zeros([DC, BLOCK_M], gl.float32, acc_layout)
    for i in range(num_tiles):
        stage = i % NUM_STAGES
        tile_lo = lo + i * BLOCK_N
        s = warpgroup_mma_wait(0, deps=(_scores_async(q_smem, qpe_smem, c_smem, pe_smem, kv_ready, i, acc_layout,
                                                      NUM_STAGES),))  # fmt: skip
        n = tile_lo + gl.arange(0, BLOCK_N, layout=keys_layout)
        ks = ks_smem.index(stage).load(keys_layout)
        w, beta, m_i, d_i, l_keys = _weights(s, ks, n, tile_lo, bound, bound_min, row_scale, m_i, d_i, l_keys)
        # The previous tile's O^T MMA is done (waited for below), so P^T's buffer is free.
        p_smem.store(w.to(gl.float16))
        fence_async_shared()
        _cta_barrier()
        acc = acc * beta[None, :]
        acc = warpgroup_mma_wait(0, deps=(warpgroup_mma(c_smem.index(stage).permute((1, 0)), p_smem, acc,
                                                        is_async=True),))  # fmt: skip
        # The buffer goes back as soon as O^T has read it, before the next tile is waited for: the dequant side is
        # the slower one and should not wait for a buffer already read (docs/benchmarks.md, fp8 MLA decode).
        _cta_barrier()
        mbarrier.arrive(kv_free.index(stage), count=1)

    # out = acc * 2^d / l; acc is 0 where no key had weight (d = -inf).
    l_i = gl.sum(l_keys, axis=0)
    has_keys = l_i > 0
    l_safe = gl.where(has_keys, l_i, 1.0)
    gl.store(lse_ptr + out_row, gl.where(has_keys, (m_i + gl.log2(l_safe)) * 0.6931471805599453, float("-inf")),
             mask=row_ok)  # fmt: skip
    norm = gl.where(has_keys & (d_i > float("-inf")), gl.exp2(d_i), 0.0)
    out = acc * gl.where(norm > 0, norm / l_safe, 0.0)[None, :]
    d = gl.arange(0, DC, layout=keys_layout)
    gl.store(out_ptr + out_row[None, :] * DC + d[:, None], out.to(out_ptr.dtype.element_ty), mask=row_ok[None, :])


@gluon.jit
def _scaled_q(q_ptr, tok0, q_hi, head_block, num_heads, stride_qt, stride_qh, q_smem, qpe_smem, BLOCK_H: gl.constexpr,
              BLOCK_M: gl.constexpr, rows_layout: gl.constexpr):  # fmt: skip
    """q's rows scaled into fp16's range as `decode_fp8.scaled_rows` does (largest magnitude near 2^14) and stored
    in q_smem (the latent's columns) and qpe_smem (the rope's); returns the factor that undoes the scaling, [rows]
    in rows_layout."""
    DC: gl.constexpr = q_smem.shape[1]
    DR: gl.constexpr = qpe_smem.shape[1]
    io: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    rows = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, io))
    tok = tok0 + rows // BLOCK_H
    head = head_block * BLOCK_H + rows % BLOCK_H
    ok = ((tok < q_hi) & (head < num_heads))[:, None]
    q_row = (q_ptr + tok.to(gl.int64) * stride_qt + head * stride_qh)[:, None]
    qc = gl.load(q_row + gl.arange(0, DC, layout=gl.SliceLayout(0, io))[None, :], mask=ok, other=0.0).to(gl.float32)
    qpe = gl.load(q_row + DC + gl.arange(0, DR, layout=gl.SliceLayout(0, io))[None, :], mask=ok, other=0.0)
    qpe = qpe.to(gl.float32)
    amax = gl.maximum(gl.max(gl.abs(qc), axis=1), gl.max(gl.abs(qpe), axis=1))
    f = gl.where(amax > 0, gl.exp2(14.0 - gl.ceil(gl.log2(gl.where(amax > 0, amax, 1.0)))), 1.0)
    q_smem.store((qc * f[:, None]).to(gl.float16))
    qpe_smem.store((qpe * f[:, None]).to(gl.float16))
    return gl.convert_layout(1.0 / f, rows_layout)


@gluon.jit
def mla_decode_fp8_wgmma_kernel(q_ptr, kv_ptr, kv_scale_ptr, block_table_ptr, cache_seqlens_ptr, cu_seqlens_q_ptr,
                                kv_bounds_ptr, out_ptr, lse_ptr, qk_scale, num_seqs, num_heads, num_head_blocks,
                                num_splits, stride_qt, stride_qh, stride_kvp, stride_kvs, stride_bt,
                                PAGE_SIZE: gl.constexpr, DC: gl.constexpr, DR: gl.constexpr, BLOCK_H: gl.constexpr,
                                BLOCK_Q: gl.constexpr, SEQS_POW2: gl.constexpr, USE_KV_BOUNDS: gl.constexpr,
                                SPLIT: gl.constexpr, LONGEST_FIRST: gl.constexpr, BLOCK_N: gl.constexpr,
                                NUM_STAGES: gl.constexpr, DEQUANT_REGS: gl.constexpr, LOOKAHEAD: gl.constexpr = 1,
                                DEQUANT_WGS: gl.constexpr = 1, PREFETCH: gl.constexpr = 0):  # fmt: skip
    BLOCK_M: gl.constexpr = BLOCK_Q * BLOCK_H
    gl.static_assert(gl.num_warps() == 4, "the parent and the MMA partition are one warpgroup")
    gl.static_assert((BLOCK_M == 16) | (BLOCK_M == 32), "16 or 32 rows: the N of the swapped MMAs")
    gl.static_assert(BLOCK_N == 64, "the keys are the M of one warpgroup MMA")
    gl.static_assert((LOOKAHEAD >= 1) & (LOOKAHEAD <= 3), "1 to 3 raw tiles in flight")
    gl.static_assert(
        (DEQUANT_WGS == 1) | ((DEQUANT_WGS == 2) & (LOOKAHEAD > 1)),
        "one dequant warpgroup, or two that rotate their tiles",
    )
    gl.static_assert((PREFETCH == 0) | (LOOKAHEAD > 1), "L2 prefetches ahead of the rotating register loads")
    # S^T [keys, rows], O^T [DC, rows] and the per-key sums share one layout, so row vectors need no conversion.
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, BLOCK_M, 16])  # fmt: skip
    rows_layout: gl.constexpr = gl.SliceLayout(0, acc_layout)

    head_block, split, seq, tok0, q_lo, q_hi = program_slot(cache_seqlens_ptr, cu_seqlens_q_ptr, num_seqs,
                                                            num_head_blocks, num_splits, BLOCK_Q, SEQS_POW2,
                                                            LONGEST_FIRST)  # fmt: skip
    if (seq < 0) | (tok0 >= q_hi):
        return
    row_ok, bound, bound_min, lo, hi, num_tiles, out_row = split_range(
        cache_seqlens_ptr, kv_bounds_ptr, seq, tok0, q_lo, q_hi, head_block, num_heads, num_splits, split,
        rows_layout, BLOCK_H, BLOCK_M, BLOCK_N, USE_KV_BOUNDS, SPLIT)  # fmt: skip

    # One buffer each, indexed (see `_scores_async`).
    q_smem = gl.allocate_shared_memory(gl.float16, [1, BLOCK_M, DC],
                                       gl.NVMMASharedLayout.get_default_for([BLOCK_M, DC], gl.float16))  # fmt: skip
    qpe_smem = gl.allocate_shared_memory(gl.float16, [1, BLOCK_M, DR],
                                         gl.NVMMASharedLayout.get_default_for([BLOCK_M, DR], gl.float16))  # fmt: skip
    row_scale = qk_scale * _scaled_q(q_ptr, tok0, q_hi, head_block, num_heads, stride_qt, stride_qh, q_smem.index(0),
                                     qpe_smem.index(0), BLOCK_H, BLOCK_M, rows_layout)  # fmt: skip

    c_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, DC], gl.float16)
    pe_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, DR], gl.float16)
    c_smem = gl.allocate_shared_memory(gl.float16, [NUM_STAGES, BLOCK_N, DC], c_layout)
    pe_smem = gl.allocate_shared_memory(gl.float16, [NUM_STAGES, BLOCK_N, DR], pe_layout)
    ks_smem = gl.allocate_shared_memory(gl.float32, [NUM_STAGES, BLOCK_N], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    p_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_M], gl.float16)
    p_smem = gl.allocate_shared_memory(gl.float16, [BLOCK_N, BLOCK_M], p_layout)
    # Per buffer: filled, and free again.
    kv_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    kv_free = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    for st in gl.static_range(NUM_STAGES):
        mbarrier.init(kv_ready.index(st), count=DEQUANT_WGS)
        mbarrier.init(kv_free.index(st), count=1)
    fence_async_shared()
    _cta_barrier()

    # (Written out per branch: a tuple holding layouts or functions cannot be bound to a name here.)
    pages_ptr = block_table_ptr + seq * stride_bt
    if LOOKAHEAD == 1:
        gl.warp_specialize(
            [(_mma_partition, (q_smem, qpe_smem, c_smem, pe_smem, ks_smem, p_smem, kv_ready, kv_free, bound, bound_min,
                               row_scale, out_row, row_ok, lo, num_tiles, out_ptr, lse_ptr, acc_layout, NUM_STAGES)),
             (_dequant_partition, (kv_ptr, kv_scale_ptr, pages_ptr, lo, hi, num_tiles, stride_kvp, stride_kvs, c_smem,
                                   pe_smem, ks_smem, kv_ready, kv_free, PAGE_SIZE, BLOCK_N, NUM_STAGES))],
            [4], [DEQUANT_REGS])  # fmt: skip
    elif DEQUANT_WGS == 1:
        gl.warp_specialize(
            [(_mma_partition, (q_smem, qpe_smem, c_smem, pe_smem, ks_smem, p_smem, kv_ready, kv_free, bound, bound_min,
                               row_scale, out_row, row_ok, lo, num_tiles, out_ptr, lse_ptr, acc_layout, NUM_STAGES)),
             (_dequant_part0, (kv_ptr, kv_scale_ptr, pages_ptr, lo, hi, num_tiles, stride_kvp, stride_kvs, c_smem,
                               pe_smem, ks_smem, kv_ready, kv_free, PAGE_SIZE, BLOCK_N, NUM_STAGES, LOOKAHEAD,
                               DEQUANT_WGS, PREFETCH))],
            [4], [DEQUANT_REGS])  # fmt: skip
    else:
        gl.warp_specialize(
            [(_mma_partition, (q_smem, qpe_smem, c_smem, pe_smem, ks_smem, p_smem, kv_ready, kv_free, bound, bound_min,
                               row_scale, out_row, row_ok, lo, num_tiles, out_ptr, lse_ptr, acc_layout, NUM_STAGES)),
             (_dequant_part0, (kv_ptr, kv_scale_ptr, pages_ptr, lo, hi, num_tiles, stride_kvp, stride_kvs, c_smem,
                               pe_smem, ks_smem, kv_ready, kv_free, PAGE_SIZE, BLOCK_N, NUM_STAGES, LOOKAHEAD,
                               DEQUANT_WGS, PREFETCH)),
             (_dequant_part1, (kv_ptr, kv_scale_ptr, pages_ptr, lo, hi, num_tiles, stride_kvp, stride_kvs, c_smem,
                               pe_smem, ks_smem, kv_ready, kv_free, PAGE_SIZE, BLOCK_N, NUM_STAGES, LOOKAHEAD,
                               DEQUANT_WGS, PREFETCH))],
            [4, 4], [DEQUANT_REGS, DEQUANT_REGS])  # fmt: skip
