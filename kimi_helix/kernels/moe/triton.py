"""Fused routed experts in Triton: sort the (token, slot) pairs by expert, then two grouped GEMMs.

For x [T, d] and ids, weights [T, k] there are M = T*k pairs, pair p = t*k + j. Four launches (three when a
handful of pairs skip the sort), no host sync: the grids are sized by a bound, so the call can be captured in a
CUDA graph.

1. `moe_align_kernel`: a stable counting sort of the pairs by expert, each expert's segment padded to a multiple
   of BLOCK_M rows so that every block of BLOCK_M rows belongs to one expert. At most cdiv(M, BLOCK_M) + min(E, M)
   blocks exist; the GEMM programs of blocks past the real count exit at once.
2. `moe_gate_up_kernel`: per (block, tile of I): gather the block's rows of x, multiply by the gate and the up
   halves of the expert's `gate_up_proj` in the same program and write silu(gate) * up once, at width I.
3. `moe_down_kernel`: per (block, tile of d): intermediate @ down^T times the routing weight, written per pair.
4. A torch sum over the k pairs of each token, in fixed order: deterministic, where atomics would not be.

Decode (a few pairs per expert) is bound by reading the touched experts' weights: small BLOCK_M and narrow N tiles
give every weight tile its own program, read once. Prefill uses 64/128-row tensor-core tiles.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kimi_helix.kernels.backends import FLOATS, OpCaps
from kimi_helix.kernels.device import interpreting, triton_devices
from kimi_helix.kernels.launch import cdiv, next_pow2

__all__ = ["CAPS", "MoeConfig", "default_config", "fused_experts_triton"]

# What the kernels serve, read by the backend switch.
CAPS = OpCaps(triton_devices(), FLOATS)

# pairs per program of the align kernel (its rank step is quadratic in this), and per histogram step
ALIGN_BLOCK, HIST_BLOCK = 128, 1024
UNSORTED_MAX_PAIRS = 16  # up to here (two tokens at top-8) skipping the sort beats rare repeated expert reads
# fp32 must not round its inputs to tf32; the setting is moot for 16-bit inputs
DOT_PRECISIONS = {torch.float32: "ieee", torch.float16: "tf32", torch.bfloat16: "tf32"}


@dataclass(frozen=True)
class MoeConfig:
    """Tile sizes of the grouped GEMMs (powers of two, each >= 16), and whether to sort the pairs by expert.

    Unsorted, every pair is a block of its own (one valid row of `block_m`): no sort launch, but an expert chosen
    by several pairs is read once per pair, so it pays only for a handful of pairs.
    """

    block_m: int
    block_n_gate_up: int
    block_k_gate_up: int
    block_n_down: int
    block_k_down: int
    num_warps: int = 4
    num_stages: int = 3
    sort_pairs: bool = True


def default_config(num_pairs: int, num_experts: int) -> MoeConfig:
    """Tiles for `num_pairs` (token, slot) pairs spread over `num_experts` experts."""
    per_expert = num_pairs / num_experts
    if per_expert <= 16:
        return MoeConfig(16, 32, 128, 64, 128, num_warps=4, num_stages=4, sort_pairs=num_pairs > UNSORTED_MAX_PAIRS)
    if per_expert <= 96:
        return MoeConfig(64, 64, 64, 128, 64, num_warps=4, num_stages=3)
    # best of scripts/bench_moe.py --sweep at 4096 tokens on an H200
    return MoeConfig(128, 128, 64, 256, 64, num_warps=8, num_stages=3)


@triton.jit
def _histogram(ids_ptr, start, end, NUM_BINS: tl.constexpr, HIST_BLOCK: tl.constexpr):
    """Pairs per expert among ids[start:end]."""
    lanes = tl.arange(0, HIST_BLOCK)
    hist = tl.zeros([NUM_BINS], dtype=tl.int32)
    for s in range(start, end, HIST_BLOCK):
        p = s + lanes
        hist += tl.histogram(tl.load(ids_ptr + p, mask=p < end, other=0).to(tl.int32), NUM_BINS)
    # the masked lanes of the last step loaded 0, so bin 0 counted them
    masked = tl.cdiv(end - start, HIST_BLOCK) * HIST_BLOCK - (end - start)
    return hist - tl.where(tl.arange(0, NUM_BINS) == 0, masked, 0)


@triton.jit
def moe_align_kernel(
    ids_ptr,
    sorted_pairs_ptr,
    counts_ptr,
    block_cum_ptr,
    num_pairs,
    NUM_EXPERTS: tl.constexpr,
    NUM_BINS: tl.constexpr,
    BLOCK_PAIRS: tl.constexpr,
    HIST_BLOCK: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    pid = tl.program_id(0)
    first = pid * BLOCK_PAIRS
    # Every program histograms all the pairs, so the whole sort is one launch; wide histogram steps keep each
    # program's serial loop short when there are many pairs.
    before = _histogram(ids_ptr, 0, first, NUM_BINS, HIST_BLOCK)
    total = before + _histogram(ids_ptr, first, num_pairs, NUM_BINS, HIST_BLOCK)
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
    expert = tl.load(ids_ptr + p, mask=valid, other=0).to(tl.int32)
    earlier = (expert[:, None] == expert[None, :]) & (lanes[None, :] < lanes[:, None])
    rank = tl.sum(earlier.to(tl.int32), axis=1)
    tl.store(sorted_pairs_ptr + tl.gather(base, expert, 0) + rank, p, mask=valid)


@triton.jit
def _block_rows(
    pid_m,
    ids_ptr,
    sorted_pairs_ptr,
    counts_ptr,
    block_cum_ptr,
    NUM_EXPERTS: tl.constexpr,
    NUM_BINS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    SORTED: tl.constexpr,
):
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
        expert = tl.load(ids_ptr + pid_m)
        valid = offs == 0
        rows = tl.zeros([BLOCK_M], dtype=tl.int64) + pid_m
        pairs = rows
    return expert.to(tl.int64), rows, pairs, valid


# Twin of `moe_down_kernel` (the second GEMM): the same block skip and row gather open both; fix them together.
@triton.jit
def moe_gate_up_kernel(
    x_ptr,
    w_ptr,
    inter_ptr,
    ids_ptr,
    sorted_pairs_ptr,
    counts_ptr,
    block_cum_ptr,
    hidden,
    inter_size,
    stride_xt,
    stride_xd,
    stride_we,
    stride_wn,
    stride_wk,
    stride_it,
    NUM_EXPERTS: tl.constexpr,
    NUM_BINS: tl.constexpr,
    TOP_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    SORTED: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    # nested, not `and`: the load must not be emitted unsorted, where block_cum_ptr is a placeholder
    if SORTED:  # noqa: SIM102
        if pid_m >= tl.load(block_cum_ptr + NUM_EXPERTS - 1):
            return
    expert, rows, pairs, valid = _block_rows(
        pid_m, ids_ptr, sorted_pairs_ptr, counts_ptr, block_cum_ptr, NUM_EXPERTS, NUM_BINS, BLOCK_M, SORTED
    )
    tokens = pairs // TOP_K
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    # wrapped so the weight loads need no mask; the columns past I are computed but never stored
    offs_wn = offs_n % inter_size
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + tokens[:, None] * stride_xt + offs_k[None, :] * stride_xd
    gate_ptrs = w_ptr + expert * stride_we + offs_wn[None, :] * stride_wn + offs_k[:, None] * stride_wk
    up_ptrs = gate_ptrs + inter_size * stride_wn
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
        gate_ptrs += BLOCK_K * stride_wk
        up_ptrs += BLOCK_K * stride_wk
    h = acc_gate * tl.sigmoid(acc_gate) * acc_up
    inter_ptrs = inter_ptr + rows[:, None] * stride_it + offs_n[None, :]
    tl.store(inter_ptrs, h.to(inter_ptr.dtype.element_ty), mask=valid[:, None] & (offs_n[None, :] < inter_size))


# Twin of `moe_gate_up_kernel` (the first GEMM): see there.
@triton.jit
def moe_down_kernel(
    inter_ptr,
    w_ptr,
    routing_ptr,
    out_ptr,
    ids_ptr,
    sorted_pairs_ptr,
    counts_ptr,
    block_cum_ptr,
    hidden,
    inter_size,
    stride_it,
    stride_we,
    stride_wn,
    stride_wk,
    stride_ot,
    NUM_EXPERTS: tl.constexpr,
    NUM_BINS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    SORTED: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    # nested, not `and`: the load must not be emitted unsorted, where block_cum_ptr is a placeholder
    if SORTED:  # noqa: SIM102
        if pid_m >= tl.load(block_cum_ptr + NUM_EXPERTS - 1):
            return
    expert, rows, pairs, valid = _block_rows(
        pid_m, ids_ptr, sorted_pairs_ptr, counts_ptr, block_cum_ptr, NUM_EXPERTS, NUM_BINS, BLOCK_M, SORTED
    )
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_wn = offs_n % hidden  # see moe_gate_up_kernel
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = inter_ptr + rows[:, None] * stride_it + offs_k[None, :]
    w_ptrs = w_ptr + expert * stride_we + offs_wn[None, :] * stride_wn + offs_k[:, None] * stride_wk
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, inter_size, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs, mask=valid[:, None], other=0.0)
            w = tl.load(w_ptrs)
        else:
            k_in = offs_k < inter_size - k0
            a = tl.load(a_ptrs, mask=valid[:, None] & k_in[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=k_in[:, None], other=0.0)
        acc = tl.dot(a, w, acc, input_precision=DOT_PRECISION)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K * stride_wk
    acc *= tl.load(routing_ptr + pairs, mask=valid, other=0.0)[:, None]
    out_ptrs = out_ptr + pairs[:, None] * stride_ot + offs_n[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=valid[:, None] & (offs_n[None, :] < hidden))


def _check_inputs(x, gate_up_proj, down_proj, weights, ids) -> tuple[int, int, int, int, int]:
    if x.dim() != 2:
        raise ValueError(f"x must have shape [T, d], got {list(x.shape)}")
    T, d = x.shape
    if gate_up_proj.dim() != 3 or gate_up_proj.shape[1] % 2 or gate_up_proj.shape[2] != d:
        raise ValueError(f"gate_up_proj must have shape [E, 2I, d={d}], got {list(gate_up_proj.shape)}")
    E, I = gate_up_proj.shape[0], gate_up_proj.shape[1] // 2
    if tuple(down_proj.shape) != (E, d, I):
        raise ValueError(f"down_proj must have shape [E, d, I]=[{E}, {d}, {I}], got {list(down_proj.shape)}")
    if ids.dim() != 2 or ids.shape[0] != T or ids.shape[1] < 1 or tuple(weights.shape) != tuple(ids.shape):
        raise ValueError(f"weights and ids must both have shape [T={T}, k >= 1], got {weights.shape}, {ids.shape}")
    if ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"ids must be int32 or int64, got {ids.dtype}")
    if not (x.dtype == gate_up_proj.dtype == down_proj.dtype) or x.dtype not in DOT_PRECISIONS:
        raise ValueError(
            f"x, gate_up_proj and down_proj must share one of fp32/fp16/bf16, got "
            f"{x.dtype}, {gate_up_proj.dtype}, {down_proj.dtype}"
        )
    return T, d, E, I, ids.shape[1]


def fused_experts_triton(
    x: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
    config: MoeConfig | None = None,
) -> torch.Tensor:
    """Routed experts, the same maths as :func:`~kimi_helix.kernels.moe.naive.fused_experts_ref` (fp32 accumulation).

    `out[t] = sum_j weights[t, j] * down[e] @ (silu(gate[e] @ x[t]) * (up[e] @ x[t]))` with `e = ids[t, j]`. The
    intermediate silu(gate) * up is rounded to x.dtype, as is each (token, slot) contribution before the sum.

    Args:
        x: [T, d], fp32/fp16/bf16.
        gate_up_proj: [E, 2I, d] in x.dtype, gate rows over up rows.
        down_proj: [E, d, I] in x.dtype.
        weights: [T, k] routing weights (fp32).
        ids: [T, k] int32/int64 expert ids, each in [0, E) (not checked: that would sync with the host).
        out: optional [T, d] output in x.dtype, written fully.
        config: tile sizes; `default_config(T * k, E)` when None.

    Returns:
        [T, d] in x.dtype (`out` when given).
    """
    T, d, E, I, top_k = _check_inputs(x, gate_up_proj, down_proj, weights, ids)
    if x.device.type != "cuda" and not interpreting():
        raise ValueError(f"x is on {x.device}: the Triton kernels need CUDA (or TRITON_INTERPRET=1 on the CPU)")
    if out is None:
        out = torch.empty_like(x)
    elif out.shape != x.shape or out.dtype != x.dtype:
        raise ValueError(f"out must be {list(x.shape)} {x.dtype}, got {list(out.shape)} {out.dtype}")
    if T == 0:
        return out
    M = T * top_k
    cfg = config or default_config(M, E)
    bm = cfg.block_m
    num_bins = next_pow2(E)
    dev = x.device
    # reshape alone can return a strided view (ids[:, :1] of a wider tensor); the kernels index pairs densely
    flat_ids = ids.reshape(M).contiguous()
    routing = weights.reshape(M).float().contiguous()

    if cfg.sort_pairs:
        num_row_blocks = cdiv(M, bm) + min(E, M)
        inter_rows = num_row_blocks * bm
        sorted_pairs = torch.empty(inter_rows, dtype=torch.int32, device=dev)
        counts = torch.empty(E, dtype=torch.int32, device=dev)
        block_cum = torch.empty(E, dtype=torch.int32, device=dev)
        # few pairs: narrower blocks, so the fixed cost of the sort stays small
        pairs_pow2 = max(16, next_pow2(M))
        align_block = min(ALIGN_BLOCK, pairs_pow2)
        moe_align_kernel[(cdiv(M, align_block),)](
            flat_ids,
            sorted_pairs,
            counts,
            block_cum,
            M,
            NUM_EXPERTS=E,
            NUM_BINS=num_bins,
            BLOCK_PAIRS=align_block,
            HIST_BLOCK=min(HIST_BLOCK, pairs_pow2),
            BLOCK_M=bm,
            num_warps=4,
        )
    else:
        # one block per pair; the GEMMs read only flat_ids, so it also fills the unused sort arguments
        num_row_blocks, inter_rows = M, M
        sorted_pairs = counts = block_cum = flat_ids

    precision = DOT_PRECISIONS[x.dtype]
    inter = torch.empty(inter_rows, I, dtype=x.dtype, device=dev)
    moe_gate_up_kernel[(num_row_blocks, cdiv(I, cfg.block_n_gate_up))](
        x,
        gate_up_proj,
        inter,
        flat_ids,
        sorted_pairs,
        counts,
        block_cum,
        d,
        I,
        x.stride(0),
        x.stride(1),
        *gate_up_proj.stride(),
        inter.stride(0),
        NUM_EXPERTS=E,
        NUM_BINS=num_bins,
        TOP_K=top_k,
        BLOCK_M=bm,
        BLOCK_N=cfg.block_n_gate_up,
        BLOCK_K=cfg.block_k_gate_up,
        EVEN_K=d % cfg.block_k_gate_up == 0,
        DOT_PRECISION=precision,
        SORTED=cfg.sort_pairs,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )

    pair_out = torch.empty(M, d, dtype=x.dtype, device=dev)
    moe_down_kernel[(num_row_blocks, cdiv(d, cfg.block_n_down))](
        inter,
        down_proj,
        routing,
        pair_out,
        flat_ids,
        sorted_pairs,
        counts,
        block_cum,
        d,
        I,
        inter.stride(0),
        *down_proj.stride(),
        pair_out.stride(0),
        NUM_EXPERTS=E,
        NUM_BINS=num_bins,
        BLOCK_M=bm,
        BLOCK_N=cfg.block_n_down,
        BLOCK_K=cfg.block_k_down,
        EVEN_K=I % cfg.block_k_down == 0,
        DOT_PRECISION=precision,
        SORTED=cfg.sort_pairs,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    return torch.sum(pair_out.view(T, top_k, d), dim=1, out=out)
