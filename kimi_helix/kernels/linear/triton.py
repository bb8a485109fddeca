"""Triton `linear` for few rows: decode steps multiply one to sixteen tokens by each projection, where the GEMM
libraries pick tiles that leave most SMs idle (their M=1 kernels reached 0.35-3.4 TB/s in docs/benchmarks.md's
decode profile). Each program owns BLOCK_N output columns of every row and streams its weight rows once; several
weights that read the same x share one launch and write their outputs side by side (no concatenation).

Outputs too narrow to give every SM work (an o_proj's 2304 columns are 72 tiles of 32 on 132 SMs) are split along
K as well: each (column tile, K split) program writes its fp32 partial to a per-device workspace and takes a
ticket from its tile's int32 counter; the program that takes the last ticket sums the partials in split order
(the same bits every run, whichever program finishes last), writes the output and puts the counter back to 0, so
the next call, or a CUDA-graph replay, finds it zeroed without a memset launch."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kimi_helix.kernels.backends import FLOATS, OpCaps
from kimi_helix.kernels.common import check_triton_device
from kimi_helix.kernels.device import num_sms, triton_devices
from kimi_helix.kernels.launch import cdiv

__all__ = [
    "CAPS",
    "MAX_ROWS",
    "MAX_WEIGHTS",
    "Tile",
    "default_tile",
    "linear_triton",
    "split_count",
    "split_plan",
    "workspace",
]

# One BLOCK_M tile of rows per program: the kernel serves at most MAX_ROWS rows (larger batches go to the GEMM
# library, whose tiles fit them); up to MAX_WEIGHTS weights per launch.
MAX_ROWS = 16
MAX_WEIGHTS = 3
CAPS = OpCaps(triton_devices(), FLOATS, max_rows=MAX_ROWS)
# Split-K (`split_count`): a launch of fewer column tiles than SMs is bound by the bytes its busiest SM streams;
# splitting K cuts them and costs a fixed SPLIT_BYTES plus PARTIAL_BYTES a split, in bytes that SM could have
# streamed meanwhile (fitted to the H200 sweep of scripts/bench_linear.py: ~0.75 us and ~0.25 us at ~30 GB/s an SM).
# Splits are at least MIN_SPLIT_K deep.
SPLIT_BYTES = 24 << 10
PARTIAL_BYTES = 7 << 10
MIN_SPLIT_K = 512
# The workspace holds WORKSPACE_WAVES waves of programs' partials of up to WORKSPACE_COLS columns, and a counter
# for each; split_count stays within it.
WORKSPACE_WAVES = 8
WORKSPACE_COLS = 64


@dataclass(frozen=True)
class Tile:
    """Launch shape: the column tile, the K step, warps and pipeline stages."""

    block_n: int = 32
    block_k: int = 256
    num_warps: int = 4
    num_stages: int = 4


@triton.jit
def linear_kernel(
    x, w0, w1, w2, out, part, ticket, M, K, N0, N1, N2, S0, S1, S2, TILES0, TILES1, stride_xm, stride_om, SPLIT_K,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLITS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    pid, split = tl.program_id(0), tl.program_id(1)
    # the program's weight, its column tile in that weight, and where that weight's outputs start in `out`
    if pid < TILES0:
        w, n_w, stride_w, tile, col0 = w0, N0, S0, pid, 0
    elif pid < TILES0 + TILES1:
        w, n_w, stride_w, tile, col0 = w1, N1, S1, pid - TILES0, N0
    else:
        w, n_w, stride_w, tile, col0 = w2, N2, S2, pid - TILES0 - TILES1, N0 + N1
    rows = tl.arange(0, BLOCK_M)
    cols = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok, col_ok = rows < M, cols < n_w
    k_lo = split * SPLIT_K
    k_hi = tl.minimum(K, k_lo + SPLIT_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < k_hi
        xt = tl.load(x + rows[:, None] * stride_xm + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w_rows = w + cols[:, None].to(tl.int64) * stride_w
        wt = tl.load(w_rows + ks[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0)
        acc = tl.dot(xt, tl.trans(wt), acc, input_precision=DOT_PRECISION)
    dst = out + rows[:, None] * stride_om + col0 + cols[None, :]
    if SPLITS == 1:
        tl.store(dst, acc.to(out.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])
    else:
        slot = rows[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
        tl.store(part + (pid * SPLITS + split) * (BLOCK_M * BLOCK_N) + slot, acc, mask=row_ok[:, None])
        # every thread's partial is stored before the ticket (release) and read after it (acquire)
        tl.debug_barrier()
        if tl.atomic_add(ticket + pid, 1, sem="acq_rel") == SPLITS - 1:
            total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for s in range(SPLITS):  # in split order, so the sum does not depend on which program came last
                src = part + (pid * SPLITS + s) * (BLOCK_M * BLOCK_N) + slot
                total += tl.load(src, mask=row_ok[:, None], other=0.0, cache_modifier=".cg")
            tl.store(dst, total.to(out.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])
            tl.atomic_xchg(ticket + pid, 0)


def default_tile(total_cols: int, device_index: int | None) -> Tile:
    """Wide tiles with short K steps where the columns give every SM more than one program, else 32 columns with
    long K steps: a decode GEMV is bound by the bytes in flight, and idle SMs cost more than narrow tiles
    (the H200 comparison with cuBLAS is in docs/benchmarks.md)."""
    if cdiv(total_cols, 64) >= 1.4 * num_sms(device_index):
        return Tile(block_n=64, block_k=128)
    return Tile(block_n=32, block_k=256)


def split_count(tiles: int, k: int, tile: Tile, itemsize: int, device_index: int | None) -> int:
    """K splits for a launch of `tiles` column tiles of `tile` over depth k and weights of `itemsize` bytes: 1
    where the tiles fill the SMs, else the count of least cost, the weight bytes of the busiest SM (its programs
    times their depth) plus the split's overheads (SPLIT_BYTES, PARTIAL_BYTES a split). At H200 shapes: KDA o_proj
    (72 tiles, K=4096) 3, f_a + g_a (8 tiles, K=2304) and MLA kv_a (18) 5, the shared experts' down (72, K=1024) 1."""
    sms = num_sms(device_index)
    if tiles >= sms or tile.block_n > WORKSPACE_COLS:
        return 1
    col_bytes = tile.block_n * itemsize
    best, best_cost = 1, k * col_bytes
    for want in range(2, min(cdiv(k, MIN_SPLIT_K), WORKSPACE_WAVES * sms // tiles) + 1):
        depth, splits = split_plan(k, want, tile.block_k)
        cost = cdiv(tiles * splits, sms) * depth * col_bytes + SPLIT_BYTES + splits * PARTIAL_BYTES
        if splits == want and depth >= MIN_SPLIT_K and cost < best_cost:
            best, best_cost = splits, cost
    return best


def split_plan(k: int, splits: int, block_k: int) -> tuple[int, int]:
    """(depth of a split, splits) for at most `splits` splits of depth k: BLOCK_K-aligned depths, so only the last
    split is ragged, and no split is empty (K=300, 5 splits of BLOCK_K=128 are 3: 128, 128 and 44)."""
    depth = cdiv(cdiv(k, splits), block_k) * block_k
    return depth, cdiv(k, depth)


_WORKSPACES: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}


def workspace(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The split-K scratch of a device: fp32 partials [WORKSPACE_WAVES * SMs * MAX_ROWS * WORKSPACE_COLS] and int32
    counters [WORKSPACE_WAVES * SMs], zero between calls. Made once and never replaced, so CUDA graphs captured
    over it stay valid; the first call must be eager (graph capture runs its warm-up eagerly first). One workspace
    a device: split launches on one device must not run concurrently on different streams."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if device not in _WORKSPACES:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                "linear_triton: the split-K workspace is made on the first split call, which must not be captured "
                "into a CUDA graph; run the step eagerly once before capturing it"
            )
        programs = WORKSPACE_WAVES * num_sms(device.index)
        part = torch.empty(programs * MAX_ROWS * WORKSPACE_COLS, dtype=torch.float32, device=device)
        _WORKSPACES[device] = (part, torch.zeros(programs, dtype=torch.int32, device=device))
    return _WORKSPACES[device]


def linear_triton(
    x: torch.Tensor,
    weights: torch.Tensor | Sequence[torch.Tensor],
    tile: Tile | None = None,
    splits: int | None = None,
) -> torch.Tensor:
    """Triton form of :func:`kimi_helix.kernels.linear.naive.linear_ref` (same arguments and result).

    Args:
        x: [..., K] fp32/fp16/bf16 with at most MAX_ROWS rows (the product of the leading dims); the last dim
            contiguous.
        weights: one [N, K] weight or up to MAX_WEIGHTS [N_i, K] weights of x's dtype and device, columns contiguous
            (rows may be strided: column shards of a larger weight).
        tile: the launch shape (None: `default_tile`; scripts/bench_linear.py compares them).
        splits: K splits (None: `split_count`; 1: no split). Fewer are used where K is too short for that many
            BLOCK_K-aligned splits.

    Returns:
        [..., sum N_i] contiguous, in x's dtype (fp32 accumulation; split-K sums the splits' partials in order).
    """
    ws = [weights] if isinstance(weights, torch.Tensor) else list(weights)
    if not 1 <= len(ws) <= MAX_WEIGHTS:
        raise ValueError(f"weights must be 1 to {MAX_WEIGHTS} tensors, got {len(ws)}")
    k = x.shape[-1]
    for i, w in enumerate(ws):
        if w.dim() != 2 or w.shape[1] != k or w.dtype != x.dtype or w.device != x.device or w.stride(-1) != 1:
            raise ValueError(
                f"weights[{i}] must be an [N, {k}] {x.dtype} tensor on {x.device} with unit column stride, got "
                f"{w.dtype} {list(w.shape)} strides {w.stride()} on {w.device}"
            )
    if splits is not None and splits < 1:
        raise ValueError(f"splits must be >= 1, got {splits}")
    check_triton_device("x", x)
    x2 = x.reshape(-1, k)
    if x2.shape[0] > MAX_ROWS:
        raise ValueError(f"x has {x2.shape[0]} rows; the Triton linear serves at most {MAX_ROWS}")
    x2 = x2 if x2.stride(-1) == 1 else x2.contiguous()
    ns, strides = [w.shape[0] for w in ws], [w.stride(0) for w in ws]
    out = torch.empty(*x.shape[:-1], sum(ns), dtype=x.dtype, device=x.device)
    if x2.shape[0] == 0 or sum(ns) == 0:
        return out
    if k == 0:
        return out.zero_()
    tile = tile or default_tile(sum(ns), x.device.index)
    tiles = [cdiv(n, tile.block_n) for n in ns]
    splits = splits or split_count(sum(tiles), k, tile, x.element_size(), x.device.index)
    split_k, splits = split_plan(k, splits, tile.block_k)
    part, ticket = workspace(x.device) if splits > 1 else (out, out)  # unread without splits
    if splits > 1 and (sum(tiles) > ticket.numel() or sum(tiles) * splits * tile.block_n > part.numel() // MAX_ROWS):
        raise ValueError(
            f"splits={splits} of {sum(tiles)} column tiles of {tile.block_n} exceed the split-K workspace "
            f"({ticket.numel()} tiles, {part.numel() // MAX_ROWS} columns in all)"
        )
    ws += [ws[0]] * (MAX_WEIGHTS - len(ws))
    ns += [0] * (MAX_WEIGHTS - len(ns))
    strides += [0] * (MAX_WEIGHTS - len(strides))
    tiles += [0] * (MAX_WEIGHTS - len(tiles))
    linear_kernel[(sum(tiles), splits)](
        x2, *ws, out, part, ticket, x2.shape[0], k, *ns, *strides, tiles[0], tiles[1], x2.stride(0), sum(ns), split_k,
        BLOCK_M=MAX_ROWS, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k, SPLITS=splits,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        num_warps=tile.num_warps, num_stages=tile.num_stages,
    )  # fmt: skip
    return out
