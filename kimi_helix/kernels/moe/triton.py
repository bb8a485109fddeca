"""Fused MoE experts in Triton: the routed experts and the shared experts in two grouped GEMMs, no host sync.

For x [T, d], ids and weights [T, k] and S shared slices, each token has SLOTS = k + S (token, slot) pairs, pair
p = t * SLOTS + j. Slot j < k is routed expert ids[t, j] at weight weights[t, j]; slot k + s is slice s of the
shared experts at weight 1: rows [s*I, (s+1)*I) of their gate and up weights and those columns of their down
weight, read in place (`SharedExperts`). A SwiGLU of intermediate S*I is exactly the sum of its S slices' SwiGLUs,
so the shared experts join the routed combine and need no GEMMs, no silu_mul and no add of their own. The kernels
number slice s as expert E + s and pick its weight pointers per tile. S = cdiv(I_s, I); a last slice narrower than
I (a tensor-parallel shard can leave one) has the missing intermediate columns written as zeros.

Decode (a handful of pairs, `MoeConfig.sort_pairs` False): two launches. `moe_gate_up_kernel` gives every pair a
block of its own and writes silu(gate) * up; `moe_combine_down_kernel` runs one program per (token, tile of d)
that walks the token's slots in order and sums their weighted products in fp32 registers: no per-pair output, no
separate sum, no atomics, so the result does not depend on scheduling.

Otherwise four launches; the grids are sized by a bound, so the call can be captured in a CUDA graph:
1. `moe_align_kernel`: a stable counting sort of the pairs by expert, each expert's segment padded to a multiple
   of BLOCK_M rows so that every block of BLOCK_M rows belongs to one expert. At most cdiv(M, BLOCK_M) + min(E, M)
   blocks exist; the GEMM programs of blocks past the real count exit at once.
2. `moe_gate_up_kernel`: per (block, tile of I): gather the block's rows of x, multiply by the gate and the up
   weights of the block's expert in the same program and write silu(gate) * up once, at width I.
3. `moe_down_kernel`: per (block, tile of d): intermediate @ down^T times the routing weight, written per pair.
4. `moe_sum_slots_kernel`: per (token, tile of d), the sum of the token's SLOTS pair outputs and the residual
   in fp32, in fixed order: deterministic, where atomics would not be.

Decode is bound by reading the touched experts' weights: small BLOCK_M and narrow N tiles give every weight tile
its own program, read once. Prefill uses 64/128-row tensor-core tiles.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kimi_helix.kernels.backends import FLOATS, OpCaps
from kimi_helix.kernels.common import check_triton_device
from kimi_helix.kernels.device import triton_devices
from kimi_helix.kernels.launch import cdiv, next_pow2
from kimi_helix.kernels.moe.naive import SharedExperts

__all__ = ["CAPS", "MoeConfig", "default_config", "fused_experts_triton"]

# What the kernels serve, read by the backend switch.
CAPS = OpCaps(triton_devices(), FLOATS)

# pairs per program of the align kernel (its rank step is quadratic in this), and per histogram step
ALIGN_BLOCK, HIST_BLOCK = 128, 1024
# up to here (two tokens at top-8 and a shared slice) skipping the sort beats rare repeated expert reads
UNSORTED_MAX_PAIRS = 18
# fp32 must not round its inputs to tf32; the setting is moot for 16-bit inputs
DOT_PRECISIONS = {torch.float32: "ieee", torch.float16: "tf32", torch.bfloat16: "tf32"}


@dataclass(frozen=True)
class MoeConfig:
    """Tile sizes of the grouped GEMMs (powers of two, each >= 16), and whether to sort the pairs by expert.

    Unsorted, every pair is a block of its own (one valid row of `block_m`): no sort launch, but an expert chosen
    by several pairs is read once per pair, so it pays only for a handful of pairs. The down tiles then belong to
    `moe_combine_down_kernel`, a GEMV with one program per (token, `block_n_down` outputs: any power of two), which
    wants narrow, deep tiles: there are only T * d / block_n_down programs to fill the SMs, and each must keep
    enough weight bytes in flight; with
    `combine_in_down` False they go to the per-pair `moe_down_kernel` and a torch sum instead (one launch more).
    """

    block_m: int
    block_n_gate_up: int
    block_k_gate_up: int
    block_n_down: int
    block_k_down: int
    num_warps: int = 4
    num_stages: int = 3
    sort_pairs: bool = True
    combine_in_down: bool = True


# The sorted path's slot sum loads [slots, tile of d] per program: at most this many elements (registers).
SUM_TILE_ELEMENTS = 4096


def default_config(num_pairs: int, num_experts: int) -> MoeConfig:
    """Tiles for `num_pairs` (token, slot) pairs spread over `num_experts` experts."""
    per_expert = num_pairs / num_experts
    if per_expert <= 16:
        if num_pairs <= UNSORTED_MAX_PAIRS:
            return MoeConfig(16, 32, 128, 4, 1024, num_warps=4, num_stages=4, sort_pairs=False)
        return MoeConfig(16, 32, 128, 64, 128, num_warps=4, num_stages=4)
    if per_expert <= 96:
        return MoeConfig(64, 64, 64, 128, 64, num_warps=4, num_stages=3)
    # best of scripts/bench_moe.py --sweep at 4096 tokens on an H200
    return MoeConfig(128, 128, 64, 256, 64, num_warps=8, num_stages=3)


@triton.jit
def _pair_expert(ids_ptr, p, mask, TOP_K: tl.constexpr, SLOTS: tl.constexpr, NUM_ROUTED: tl.constexpr):
    """Expert of pairs p = t * SLOTS + j: ids[t, j] for a routed slot, E + j - k for a shared slice (0 where masked)."""
    j = p % SLOTS
    routed = j < TOP_K
    e = tl.load(ids_ptr + (p // SLOTS) * TOP_K + j, mask=mask & routed, other=0).to(tl.int32)
    return tl.where(mask, tl.where(routed, e, NUM_ROUTED + j - TOP_K), 0)


@triton.jit
def _pair_weight(routing_ptr, p, mask, TOP_K: tl.constexpr, SLOTS: tl.constexpr):
    """Routing weight of pairs p: weights[t, j] for a routed slot, 1 for a shared slice."""
    j = p % SLOTS
    return tl.load(routing_ptr + (p // SLOTS) * TOP_K + j, mask=mask & (j < TOP_K), other=1.0)


@triton.jit
def _histogram(ids_ptr, start, end, TOP_K: tl.constexpr, SLOTS: tl.constexpr, NUM_ROUTED: tl.constexpr,
               NUM_BINS: tl.constexpr, HIST_BLOCK: tl.constexpr):  # fmt: skip
    """Pairs per expert among pairs [start, end)."""
    lanes = tl.arange(0, HIST_BLOCK)
    hist = tl.zeros([NUM_BINS], dtype=tl.int32)
    for s in range(start, end, HIST_BLOCK):
        p = s + lanes
        hist += tl.histogram(_pair_expert(ids_ptr, p, p < end, TOP_K, SLOTS, NUM_ROUTED), NUM_BINS)
    # the masked lanes of the last step counted as expert 0
    masked = tl.cdiv(end - start, HIST_BLOCK) * HIST_BLOCK - (end - start)
    return hist - tl.where(tl.arange(0, NUM_BINS) == 0, masked, 0)


@triton.jit
def moe_align_kernel(
    ids_ptr, sorted_pairs_ptr, counts_ptr, block_cum_ptr, num_pairs,
    TOP_K: tl.constexpr, SLOTS: tl.constexpr, NUM_ROUTED: tl.constexpr, NUM_EXPERTS: tl.constexpr,
    NUM_BINS: tl.constexpr, BLOCK_PAIRS: tl.constexpr, HIST_BLOCK: tl.constexpr, BLOCK_M: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    first = pid * BLOCK_PAIRS
    # Every program histograms all the pairs, so the whole sort is one launch; wide histogram steps keep each
    # program's serial loop short when there are many pairs.
    before = _histogram(ids_ptr, 0, first, TOP_K, SLOTS, NUM_ROUTED, NUM_BINS, HIST_BLOCK)
    total = before + _histogram(ids_ptr, first, num_pairs, TOP_K, SLOTS, NUM_ROUTED, NUM_BINS, HIST_BLOCK)
    bins = tl.arange(0, NUM_BINS)
    blocks = tl.cdiv(total, BLOCK_M)
    block_cum = tl.cumsum(blocks, axis=0)
    if pid == 0:
        tl.store(counts_ptr + bins, total, mask=bins < NUM_EXPERTS)
        tl.store(block_cum_ptr + bins, block_cum, mask=bins < NUM_EXPERTS)
    # A pair's row: its expert's segment start, plus that expert's pairs in earlier programs and earlier lanes.
    base = (block_cum - blocks) * BLOCK_M + before
    lanes = tl.arange(0, BLOCK_PAIRS)
    p = first + lanes
    valid = p < num_pairs
    expert = _pair_expert(ids_ptr, p, valid, TOP_K, SLOTS, NUM_ROUTED)
    earlier = (expert[:, None] == expert[None, :]) & (lanes[None, :] < lanes[:, None])
    rank = tl.sum(earlier.to(tl.int32), axis=1)
    tl.store(sorted_pairs_ptr + tl.gather(base, expert, 0) + rank, p, mask=valid)


@triton.jit
def _block_rows(pid_m, ids_ptr, sorted_pairs_ptr, counts_ptr, block_cum_ptr, TOP_K: tl.constexpr,
                SLOTS: tl.constexpr, NUM_ROUTED: tl.constexpr, NUM_EXPERTS: tl.constexpr, NUM_BINS: tl.constexpr,
                BLOCK_M: tl.constexpr, SORTED: tl.constexpr):  # fmt: skip
    """Expert of row block `pid_m`, its rows, their pair indices, and which rows hold a pair (not padding).

    Unsorted, block `pid_m` is pair `pid_m` alone, in row `pid_m` of the intermediate.
    """
    offs = tl.arange(0, BLOCK_M)
    if SORTED:
        bins = tl.arange(0, NUM_BINS)
        block_cum = tl.load(block_cum_ptr + bins, mask=bins < NUM_EXPERTS, other=2147483647)
        expert = tl.sum((block_cum <= pid_m).to(tl.int32), axis=0)
        count = tl.load(counts_ptr + expert)
        first_block = tl.load(block_cum_ptr + expert) - tl.cdiv(count, BLOCK_M)
        valid = (pid_m - first_block) * BLOCK_M + offs < count
        rows = (pid_m * BLOCK_M + offs).to(tl.int64)
        pairs = tl.load(sorted_pairs_ptr + rows, mask=valid, other=0).to(tl.int64)
    else:
        expert = _pair_expert(ids_ptr, pid_m, True, TOP_K, SLOTS, NUM_ROUTED)
        valid = offs == 0
        rows = tl.zeros([BLOCK_M], dtype=tl.int64) + pid_m
        pairs = rows
    return expert.to(tl.int64), rows, pairs, valid


@triton.jit
def _gate_up_tiles(w_ptr, sg_ptr, su_ptr, expert, offs_n, offs_k, inter_size, shared_size, stride_we, stride_wn,
                   stride_wk, stride_sgn, stride_sgk, stride_sun, stride_suk, NUM_ROUTED: tl.constexpr,
                   HAS_SHARED: tl.constexpr):  # fmt: skip
    """[BLOCK_K, BLOCK_N] pointers to the gate and up tiles of `expert` at k = 0, their steps along k, and how
    many of the I intermediate columns are real (fewer in the last slice of shared experts not a multiple of I)."""
    offs_wn = offs_n % inter_size  # wrapped so the loads need no mask; the columns past I are never stored
    gate = w_ptr + expert * stride_we + offs_wn[None, :] * stride_wn + offs_k[:, None] * stride_wk
    up = gate + inter_size * stride_wn
    gate_step, up_step, width = stride_wk, stride_wk, inter_size
    if HAS_SHARED:
        is_shared = expert >= NUM_ROUTED
        first = (expert - NUM_ROUTED) * inter_size
        rows = tl.minimum(first + offs_wn, shared_size - 1)  # a ragged slice repeats a row; its columns are zeroed
        gate = tl.where(is_shared, sg_ptr + rows[None, :] * stride_sgn + offs_k[:, None] * stride_sgk, gate)
        up = tl.where(is_shared, su_ptr + rows[None, :] * stride_sun + offs_k[:, None] * stride_suk, up)
        gate_step = tl.where(is_shared, stride_sgk, stride_wk)
        up_step = tl.where(is_shared, stride_suk, stride_wk)
        width = tl.where(is_shared, shared_size - first, inter_size)
    return gate, up, gate_step, up_step, width


@triton.jit
def _down_tile(w_ptr, sd_ptr, expert, offs_wn, cols, inter_size, shared_size, stride_we, stride_wn, stride_wk,
               stride_sdn, stride_sdk, NUM_ROUTED: tl.constexpr, HAS_SHARED: tl.constexpr,
               SHARED_EVEN: tl.constexpr):  # fmt: skip
    """[BLOCK_K, BLOCK_N] pointers to the down weight of `expert` at intermediate columns `cols` [BLOCK_K]."""
    ptrs = w_ptr + expert * stride_we + offs_wn[None, :] * stride_wn + cols[:, None] * stride_wk
    if HAS_SHARED:
        c = (expert - NUM_ROUTED) * inter_size + cols
        if not SHARED_EVEN:
            c = tl.minimum(c, shared_size - 1)  # past a ragged slice's width the intermediate holds zeros
        ptrs = tl.where(expert >= NUM_ROUTED, sd_ptr + offs_wn[None, :] * stride_sdn + c[:, None] * stride_sdk, ptrs)
    return ptrs


# Opens like `moe_down_kernel` (the block skip and `_block_rows`); a fix to one belongs in the other.
@triton.jit
def moe_gate_up_kernel(
    x_ptr, w_ptr, sg_ptr, su_ptr, inter_ptr, ids_ptr, sorted_pairs_ptr, counts_ptr, block_cum_ptr,
    hidden, inter_size, shared_size, stride_xt, stride_xd, stride_we, stride_wn, stride_wk,
    stride_sgn, stride_sgk, stride_sun, stride_suk, stride_it,
    TOP_K: tl.constexpr, SLOTS: tl.constexpr, NUM_ROUTED: tl.constexpr, NUM_EXPERTS: tl.constexpr,
    NUM_BINS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr, DOT_PRECISION: tl.constexpr, SORTED: tl.constexpr, HAS_SHARED: tl.constexpr,
):  # fmt: skip
    pid_m = tl.program_id(0)
    # nested, not `and`: the load must not be emitted unsorted, where block_cum_ptr is a placeholder
    if SORTED:  # noqa: SIM102
        if pid_m >= tl.load(block_cum_ptr + NUM_EXPERTS - 1):
            return
    expert, rows, pairs, valid = _block_rows(pid_m, ids_ptr, sorted_pairs_ptr, counts_ptr, block_cum_ptr, TOP_K,
                                             SLOTS, NUM_ROUTED, NUM_EXPERTS, NUM_BINS, BLOCK_M, SORTED)  # fmt: skip
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    gate_ptrs, up_ptrs, gate_step, up_step, width = _gate_up_tiles(
        w_ptr, sg_ptr, su_ptr, expert, offs_n, offs_k, inter_size, shared_size, stride_we, stride_wn, stride_wk,
        stride_sgn, stride_sgk, stride_sun, stride_suk, NUM_ROUTED, HAS_SHARED,
    )  # fmt: skip
    x_ptrs = x_ptr + (pairs // SLOTS)[:, None] * stride_xt + offs_k[None, :] * stride_xd
    acc_gate = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        if EVEN_K:
            a = tl.load(x_ptrs, mask=valid[:, None], other=0.0)
            gate = tl.load(gate_ptrs)
            up = tl.load(up_ptrs)
        else:
            k_in = offs_k < hidden - k0
            a = tl.load(x_ptrs, mask=valid[:, None] & k_in[None, :], other=0.0)
            gate = tl.load(gate_ptrs, mask=k_in[:, None], other=0.0)
            up = tl.load(up_ptrs, mask=k_in[:, None], other=0.0)
        acc_gate = tl.dot(a, gate, acc_gate, input_precision=DOT_PRECISION)
        acc_up = tl.dot(a, up, acc_up, input_precision=DOT_PRECISION)
        x_ptrs += BLOCK_K * stride_xd
        gate_ptrs += BLOCK_K * gate_step
        up_ptrs += BLOCK_K * up_step
    h = tl.where(offs_n[None, :] < width, acc_gate * tl.sigmoid(acc_gate) * acc_up, 0.0)
    inter_ptrs = inter_ptr + rows[:, None] * stride_it + offs_n[None, :]
    tl.store(inter_ptrs, h.to(inter_ptr.dtype.element_ty), mask=valid[:, None] & (offs_n[None, :] < inter_size))


# Opens like `moe_gate_up_kernel`: see there.
@triton.jit
def moe_down_kernel(
    inter_ptr, w_ptr, sd_ptr, routing_ptr, out_ptr, ids_ptr, sorted_pairs_ptr, counts_ptr, block_cum_ptr,
    hidden, inter_size, shared_size, stride_it, stride_we, stride_wn, stride_wk, stride_sdn, stride_sdk, stride_ot,
    TOP_K: tl.constexpr, SLOTS: tl.constexpr, NUM_ROUTED: tl.constexpr, NUM_EXPERTS: tl.constexpr,
    NUM_BINS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr, DOT_PRECISION: tl.constexpr, HAS_SHARED: tl.constexpr, SHARED_EVEN: tl.constexpr,
    SORTED: tl.constexpr,
):  # fmt: skip
    pid_m = tl.program_id(0)
    if SORTED:  # noqa: SIM102 (see moe_gate_up_kernel)
        if pid_m >= tl.load(block_cum_ptr + NUM_EXPERTS - 1):
            return
    expert, rows, pairs, valid = _block_rows(pid_m, ids_ptr, sorted_pairs_ptr, counts_ptr, block_cum_ptr, TOP_K,
                                             SLOTS, NUM_ROUTED, NUM_EXPERTS, NUM_BINS, BLOCK_M, SORTED)  # fmt: skip
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_wn = offs_n % hidden  # see _gate_up_tiles
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, inter_size, BLOCK_K):
        a_ptrs = inter_ptr + rows[:, None] * stride_it + (k0 + offs_k)[None, :]
        w_ptrs = _down_tile(w_ptr, sd_ptr, expert, offs_wn, k0 + offs_k, inter_size, shared_size, stride_we, stride_wn,
                            stride_wk, stride_sdn, stride_sdk, NUM_ROUTED, HAS_SHARED, SHARED_EVEN)  # fmt: skip
        if EVEN_K:
            a = tl.load(a_ptrs, mask=valid[:, None], other=0.0)
            w = tl.load(w_ptrs)
        else:
            k_in = offs_k < inter_size - k0
            a = tl.load(a_ptrs, mask=valid[:, None] & k_in[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=k_in[:, None], other=0.0)
        acc = tl.dot(a, w, acc, input_precision=DOT_PRECISION)
    acc *= _pair_weight(routing_ptr, pairs, valid, TOP_K, SLOTS)[:, None]
    out_ptrs = out_ptr + pairs[:, None] * stride_ot + offs_n[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=valid[:, None] & (offs_n[None, :] < hidden))


@triton.jit
def moe_sum_slots_kernel(pair_ptr, residual_ptr, out_ptr, hidden, stride_rt, stride_ot, SLOTS: tl.constexpr,
                         BLOCK_SLOTS: tl.constexpr, BLOCK_N: tl.constexpr, HAS_RESIDUAL: tl.constexpr):  # fmt: skip
    """out[t] = sum over token t's SLOTS rows of the sorted path's pair outputs [T * SLOTS, hidden] (+ residual[t]),
    in fp32 with one rounding: the combine that the unsorted path does inside its down kernel."""
    t = tl.program_id(0).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    slots = tl.arange(0, BLOCK_SLOTS)
    mask = (slots[:, None] < SLOTS) & (offs_n[None, :] < hidden)
    tile = tl.load(pair_ptr + (t * SLOTS + slots)[:, None] * hidden + offs_n[None, :], mask=mask, other=0.0)
    acc = tl.sum(tile.to(tl.float32), axis=0)
    if HAS_RESIDUAL:
        acc += tl.load(residual_ptr + t * stride_rt + offs_n, mask=offs_n < hidden, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * stride_ot + offs_n, acc.to(out_ptr.dtype.element_ty), mask=offs_n < hidden)


@triton.jit
def moe_combine_down_kernel(
    inter_ptr, w_ptr, sd_ptr, routing_ptr, residual_ptr, out_ptr, ids_ptr,
    hidden, inter_size, shared_size, stride_it, stride_we, stride_wn, stride_wk, stride_sdn, stride_sdk, stride_ot,
    stride_rt, TOP_K: tl.constexpr, SLOTS: tl.constexpr, NUM_ROUTED: tl.constexpr, BLOCK_SLOTS: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, HAS_SHARED: tl.constexpr,
    SHARED_EVEN: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
):  # fmt: skip
    """Unsorted: out[t, tile] = sum over slots j (in order) of weight_j * down[e_j][tile] @ inter[t * SLOTS + j]
    (+ residual[t, tile], in fp32 before the one rounding).

    A GEMV, not tl.dot (which wants 16 rows and 16 columns for one): narrow column tiles give the few decode
    tokens enough programs to fill every SM, and the unrolled slots keep all their weight loads in flight."""
    t = tl.program_id(0).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_wn = offs_n % hidden  # see _gate_up_tiles
    offs_k = tl.arange(0, BLOCK_K)
    slots = tl.arange(0, BLOCK_SLOTS)
    experts = _pair_expert(ids_ptr, t * SLOTS + slots, slots < SLOTS, TOP_K, SLOTS, NUM_ROUTED).to(tl.int64)
    scales = _pair_weight(routing_ptr, t * SLOTS + slots, slots < SLOTS, TOP_K, SLOTS)
    total = tl.zeros([BLOCK_N], dtype=tl.float32)
    for slot in tl.static_range(SLOTS):
        pick = slots == slot
        expert = tl.sum(tl.where(pick, experts, 0), axis=0)
        acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        for k0 in range(0, inter_size, BLOCK_K):
            cols = k0 + offs_k
            a_ptrs = inter_ptr + (t * SLOTS + slot) * stride_it + cols
            # _down_tile gives [BLOCK_K, BLOCK_N] pointers; the GEMV reduces over its first axis
            w_ptrs = _down_tile(w_ptr, sd_ptr, expert, offs_wn, cols, inter_size, shared_size, stride_we, stride_wn,
                                stride_wk, stride_sdn, stride_sdk, NUM_ROUTED, HAS_SHARED, SHARED_EVEN)  # fmt: skip
            if EVEN_K:
                a = tl.load(a_ptrs)
                w = tl.load(w_ptrs)
            else:
                k_in = cols < inter_size
                a = tl.load(a_ptrs, mask=k_in, other=0.0)
                w = tl.load(w_ptrs, mask=k_in[:, None], other=0.0)
            acc += tl.sum(w.to(tl.float32) * a.to(tl.float32)[:, None], axis=0)
        total += tl.sum(tl.where(pick, scales, 0.0), axis=0) * acc
    if HAS_RESIDUAL:
        total += tl.load(residual_ptr + t * stride_rt + offs_n, mask=offs_n < hidden, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * stride_ot + offs_n, total.to(out_ptr.dtype.element_ty), mask=offs_n < hidden)


def _check_inputs(x, gate_up_proj, down_proj, weights, ids, shared, residual) -> tuple[int, int, int, int, int]:
    if x.dim() != 2:
        raise ValueError(f"x must have shape [T, d], got {list(x.shape)}")
    T, d = x.shape
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype or residual.stride(-1) != 1):
        raise ValueError(
            f"residual must be a {list(x.shape)} {x.dtype} tensor with unit last stride, got "
            f"{list(residual.shape)} {residual.dtype} strides {residual.stride()}"
        )
    if gate_up_proj.dim() != 3 or gate_up_proj.shape[1] % 2 or gate_up_proj.shape[2] != d:
        raise ValueError(f"gate_up_proj must have shape [E, 2I, d={d}], got {list(gate_up_proj.shape)}")
    E, I = gate_up_proj.shape[0], gate_up_proj.shape[1] // 2
    if tuple(down_proj.shape) != (E, d, I):
        raise ValueError(f"down_proj must have shape [E, d, I]=[{E}, {d}, {I}], got {list(down_proj.shape)}")
    if ids.dim() != 2 or ids.shape[0] != T or ids.shape[1] < 1 or tuple(weights.shape) != tuple(ids.shape):
        raise ValueError(f"weights and ids must both have shape [T={T}, k >= 1], got {weights.shape}, {ids.shape}")
    if ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"ids must be int32 or int64, got {ids.dtype}")
    tensors = [x, gate_up_proj, down_proj]
    if shared is not None:
        gate, up, down = shared
        i_s = gate.shape[0] if gate.dim() == 2 else -1
        if i_s < 1 or gate.shape != (i_s, d) or up.shape != (i_s, d) or down.shape != (d, i_s):
            raise ValueError(
                f"shared must be gate [I_s, d={d}], up [I_s, d], down [d, I_s], got "
                f"{list(gate.shape)}, {list(up.shape)}, {list(down.shape)}"
            )
        tensors += [gate, up, down]
    if len({t.dtype for t in tensors}) != 1 or x.dtype not in DOT_PRECISIONS:
        raise ValueError(
            "x, gate_up_proj, down_proj (and the shared weights) must share one of fp32/fp16/bf16, got "
            + ", ".join(str(t.dtype) for t in tensors)
        )
    return T, d, E, I, ids.shape[1]


def _sort_pairs(flat_ids, num_pairs: int, top_k: int, slots: int, num_routed: int, block_m: int):
    """Launch the counting sort: (sorted_pairs, counts, block_cum, number of row blocks bound)."""
    num_experts = num_routed + slots - top_k
    num_row_blocks = cdiv(num_pairs, block_m) + min(num_experts, num_pairs)
    dev = flat_ids.device
    sorted_pairs = torch.empty(num_row_blocks * block_m, dtype=torch.int32, device=dev)
    counts = torch.empty(num_experts, dtype=torch.int32, device=dev)
    block_cum = torch.empty(num_experts, dtype=torch.int32, device=dev)
    # few pairs: narrower blocks, so the fixed cost of the sort stays small
    pairs_pow2 = max(16, next_pow2(num_pairs))
    align_block = min(ALIGN_BLOCK, pairs_pow2)
    moe_align_kernel[(cdiv(num_pairs, align_block),)](
        flat_ids, sorted_pairs, counts, block_cum, num_pairs, TOP_K=top_k, SLOTS=slots, NUM_ROUTED=num_routed,
        NUM_EXPERTS=num_experts, NUM_BINS=next_pow2(num_experts), BLOCK_PAIRS=align_block,
        HIST_BLOCK=min(HIST_BLOCK, pairs_pow2), BLOCK_M=block_m, num_warps=4,
    )  # fmt: skip
    return sorted_pairs, counts, block_cum, num_row_blocks


# Twin of naive.py:fused_experts_ref (same signature and maths): a change to one belongs in both.
def fused_experts_triton(
    x: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    shared: SharedExperts | None = None,
    residual: torch.Tensor | None = None,
    *,
    out: torch.Tensor | None = None,
    config: MoeConfig | None = None,
) -> torch.Tensor:
    """Routed (and shared) experts, the maths of :func:`~kimi_helix.kernels.moe.naive.fused_experts_ref`.

    `out[t] = sum_j weights[t, j] * down[e] @ (silu(gate[e] @ x[t]) * (up[e] @ x[t])) + shared(x[t])` with
    `e = ids[t, j]`, plus `residual[t]` when given; fp32 accumulation. The intermediate silu(gate) * up is rounded
    to x.dtype; the weighted sum over slots and the residual are added in fp32 and rounded once, after each
    (token, slot) contribution is rounded to x.dtype when sorted (prefill: `moe_sum_slots_kernel` sums them).

    Args:
        x: [T, d], fp32/fp16/bf16.
        gate_up_proj: [E, 2I, d] in x.dtype, gate rows over up rows.
        down_proj: [E, d, I] in x.dtype.
        weights: [T, k] routing weights (fp32).
        ids: [T, k] int32/int64 expert ids, each in [0, E) (not checked: that would sync with the host).
        shared: the shared experts (gate, up [I_s, d], down [d, I_s] in x.dtype), read in place as cdiv(I_s, I)
            slices of width I at weight 1; None for none.
        residual: [T, d] in x.dtype (rows may be strided), added to the result (inside the combine when
            unsorted: one rounding), or None.
        out: optional [T, d] output in x.dtype, written fully.
        config: tile sizes; `default_config(T * (k + slices), E + slices)` when None.

    Returns:
        [T, d] in x.dtype (`out` when given).
    """
    T, d, E, I, top_k = _check_inputs(x, gate_up_proj, down_proj, weights, ids, shared, residual)
    check_triton_device("x", x)
    if out is None:
        out = torch.empty_like(x)
    elif out.shape != x.shape or out.dtype != x.dtype:
        raise ValueError(f"out must be {list(x.shape)} {x.dtype}, got {list(out.shape)} {out.dtype}")
    if T == 0:
        return out
    shared_size = shared[0].shape[0] if shared is not None else I
    slots = top_k + (cdiv(shared_size, I) if shared is not None else 0)
    M = T * slots
    cfg = config or default_config(M, E + slots - top_k)
    # reshape alone can return a strided view (ids[:, :1] of a wider tensor); the kernels index pairs densely
    flat_ids = ids.reshape(T * top_k).contiguous()
    routing = weights.reshape(T * top_k).float().contiguous()
    if cfg.sort_pairs:
        sorted_pairs, counts, block_cum, num_row_blocks = _sort_pairs(flat_ids, M, top_k, slots, E, cfg.block_m)
    else:
        # one block per pair; the GEMMs read only flat_ids, so it also fills the unused sort arguments
        sorted_pairs = counts = block_cum = flat_ids
        num_row_blocks = M
    gate, up, down = shared if shared is not None else (gate_up_proj[0], gate_up_proj[0], down_proj[0])  # unread
    common = dict(TOP_K=top_k, SLOTS=slots, NUM_ROUTED=E, DOT_PRECISION=DOT_PRECISIONS[x.dtype],
                  HAS_SHARED=shared is not None, num_warps=cfg.num_warps, num_stages=cfg.num_stages)  # fmt: skip
    sort_args = dict(NUM_EXPERTS=E + slots - top_k, NUM_BINS=next_pow2(E + slots - top_k), BLOCK_M=cfg.block_m)
    inter = torch.empty(num_row_blocks * cfg.block_m if cfg.sort_pairs else M, I, dtype=x.dtype, device=x.device)
    moe_gate_up_kernel[(num_row_blocks, cdiv(I, cfg.block_n_gate_up))](
        x, gate_up_proj, gate, up, inter, flat_ids, sorted_pairs, counts, block_cum, d, I, shared_size,
        *x.stride(), *gate_up_proj.stride(), *gate.stride(), *up.stride(), inter.stride(0),
        BLOCK_N=cfg.block_n_gate_up, BLOCK_K=cfg.block_k_gate_up, EVEN_K=d % cfg.block_k_gate_up == 0,
        SORTED=cfg.sort_pairs, **sort_args, **common,
    )  # fmt: skip
    down_args = dict(BLOCK_N=cfg.block_n_down, BLOCK_K=cfg.block_k_down, EVEN_K=I % cfg.block_k_down == 0,
                     SHARED_EVEN=shared_size % I == 0, **common)  # fmt: skip
    if not cfg.sort_pairs and cfg.combine_in_down:
        moe_combine_down_kernel[(T, cdiv(d, cfg.block_n_down))](
            inter, down_proj, down, routing, out if residual is None else residual, out, flat_ids, d, I, shared_size,
            inter.stride(0), *down_proj.stride(), *down.stride(), out.stride(0),
            out.stride(0) if residual is None else residual.stride(0), BLOCK_SLOTS=next_pow2(slots),
            HAS_RESIDUAL=residual is not None, **{k: v for k, v in down_args.items() if k != "DOT_PRECISION"},
        )  # fmt: skip
        return out
    pair_out = torch.empty(M, d, dtype=x.dtype, device=x.device)
    moe_down_kernel[(num_row_blocks, cdiv(d, cfg.block_n_down))](
        inter, down_proj, down, routing, pair_out, flat_ids, sorted_pairs, counts, block_cum, d, I, shared_size,
        inter.stride(0), *down_proj.stride(), *down.stride(), pair_out.stride(0), SORTED=cfg.sort_pairs, **sort_args,
        **down_args,
    )  # fmt: skip
    block_n = min(next_pow2(d), max(16, SUM_TILE_ELEMENTS // next_pow2(slots)))
    moe_sum_slots_kernel[(T, cdiv(d, block_n))](
        pair_out, out if residual is None else residual, out, d, 0 if residual is None else residual.stride(0),
        out.stride(0), SLOTS=slots, BLOCK_SLOTS=next_pow2(slots), BLOCK_N=block_n, HAS_RESIDUAL=residual is not None,
    )  # fmt: skip
    return out
