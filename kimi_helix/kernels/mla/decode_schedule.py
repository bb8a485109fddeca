"""Launch schedules of the MLA decode kernel (`decode.mla_decode_fwd_kernel`): tile shapes, warps, pipeline stages,
the latent column split and the split-KV count, all from tensor shapes (no device reads)."""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from kimi_helix.kernels.launch import cdiv, next_pow2

__all__ = [
    "D_SPLITS", "MAX_SMALL_SPLITS", "MAX_SPLITS", "MIN_WAVES", "SCHEDULES", "SMALL_WAVES", "TRITON_FP8_SCHEDULES",
    "Schedule",
]  # fmt: skip

# Programs per SM that the split count aims for by default: sequences of unequal length leave SMs idle at the end
# of the last wave unless each SM gets several programs to balance over.
MIN_WAVES = 4
# Programs per SM of a launch too small for long splits (`choose_num_kv_splits`): one wave of the two programs an SM
# that the 16- and 32-row tiles' registers and shared memory allow.
SMALL_WAVES = 2
# The most splits of a sequence, by FlashAttention's rule and in a small launch: each adds a [rows, kv_lora_rank]
# fp32 partial that the combine kernel reads back.
MAX_SPLITS = 64
MAX_SMALL_SPLITS = 128

# Latent column groups a schedule may ask for; each group is a tl.dot operand and needs >= 16 columns.
D_SPLITS = (1, 2, 4)


class Schedule(NamedTuple):
    """How one tile class runs: keys per tile, warps, pipeline stages, the lazy-rescale slack (log2 units; 0
    rescales the accumulator whenever a row max grows), the programs per SM its split count aims for, the fewest
    tiles a split keeps, whether whole tiles are copied by TMA (where the cache allows, see `decode._tma_ok`, and
    the launch is large enough, see `decode.TMA_MIN_WORK`), and d_split: the latent's kv_lora_rank columns taken
    as that many groups (1, 2 or 4) of kv_lora_rank / d_split columns, each with its own score dot and its own
    [rows, kv_lora_rank / d_split] accumulator, so the tensor cores run independent MMA chains instead of one long
    dependent one (a kv_lora_rank too small for the groups to keep 16 columns each takes the largest split that
    does), and wgmma: run a Gluon warpgroup-MMA kernel where it can serve the call instead of the Triton one:
    `decode_wgmma` for a 16-bit cache (see `decode._wgmma_ok`: 64 tile rows, Hopper), `decode_fp8_wgmma` for an
    fp8 one (see `decode._fp8_wgmma_ok`: 16 or 32 tile rows, Hopper; its own 64-key tiles in two fp16 buffers, so
    of the rest only min_waves and min_split_tiles apply to it)."""

    block_n: int
    num_warps: int
    num_stages: int
    rescale_slack: float
    min_waves: int = MIN_WAVES
    min_split_tiles: int = 4
    tma: bool = False
    d_split: int = 1
    wgmma: bool = False


# By (KV element bytes, tile rows), the best of scripts/tune_mla_decode.py on an H200 (D=576, b=128, mean
# s_k=8192); docs/benchmark-history.md has what the alternatives gave. Lazy rescaling (rescale_slack) pays at 16 and
# 32 rows and costs at 64. Latent column groups (d_split) pay at 16 and 32 rows in bf16. TMA tiles win where the
# tile is compute-heavy or converted from fp8; gathered tiles stay ahead at bf16 16 and 32 rows. At 64 rows on
# sm_90 the Gluon warpgroup-MMA kernel (`decode_wgmma`, 64-key tiles in 2 buffers, 2 programs an SM) serves; where
# it cannot (other GPUs, launches below TMA_MIN_WORK) the Triton kernel runs the same schedule. BLOCK_N=256 (or 128
# at 64 rows) overflows shared memory. fp8 tiles take 5 pipeline stages at 16 rows: Triton then keeps two TMA
# buffers, so the next tile's copy overlaps this one's work (one program an SM). A cache whose pages are not a
# multiple of 64 keys runs these schedules with gathered tiles.
TRITON_FP8_SCHEDULES = {
    (1, 16): Schedule(64, 8, 5, 0.0, tma=True),
    (1, 32): Schedule(64, 8, 2, 0.0, tma=True),
    (1, 64): Schedule(64, 8, 2, 0.0, min_waves=8, tma=True),
}
# At 16 rows on sm_90 the fp8 cache runs the Gluon swap-AB kernel (`decode_fp8_wgmma`), falling back to the Triton
# schedule above. At 32 rows that kernel spills registers in its tile loop (O^T's [512, 32] accumulator and its MMA
# descriptors), so 32 rows keep the Triton kernel.
SCHEDULES = {
    (2, 16): Schedule(64, 4, 2, 0.0, d_split=4),
    (2, 32): Schedule(64, 4, 2, 8.0, min_waves=8, min_split_tiles=8, d_split=4),
    (2, 64): Schedule(64, 8, 2, 0.0, min_waves=2, tma=True, wgmma=True),
    (1, 16): TRITON_FP8_SCHEDULES[(1, 16)]._replace(wgmma=True),
    (1, 32): TRITON_FP8_SCHEDULES[(1, 32)],
    (1, 64): TRITON_FP8_SCHEDULES[(1, 64)],
}
_FP32_SCHEDULE = Schedule(32, 4, 1, 0.0)  # a correctness path: 4-byte tiles must fit in shared memory


def choose_num_kv_splits(
    work: int, max_kv: int, block_n: int, num_sms: int, min_waves: float | None = None, min_split_tiles: int = 4
) -> int:
    """Splits per sequence so that `work` programs x splits fill the SMs.

    At least `min_waves` programs per SM where the keys allow (each split keeps >= `min_split_tiles` tiles of the
    capacity `max_kv`, so its pipeline amortises its prologue and the merge stays small); beyond that
    FlashAttention's rule: wave efficiency eff(s) = w / ceil(w) with w = work * s / num_sms, the smallest s within
    85% of the best. A launch that such splits leave short of one program per SM (a few sequences: decode at
    batch 1) is bound by the latency of each program's tiles, not by bandwidth, so it splits down to one tile a
    split, for SMALL_WAVES programs an SM (see `small_launch_splits`). At most MAX_SPLITS splits, or
    MAX_SMALL_SPLITS in a small launch.
    """
    min_waves = MIN_WAVES if min_waves is None else min_waves
    tiles = cdiv(max_kv, block_n)
    if work >= min_waves * num_sms or tiles < min_split_tiles:
        return 1
    max_splits = max(1, min(MAX_SPLITS, tiles // min_split_tiles))
    if work * max_splits < num_sms:
        return small_launch_splits(work, tiles, num_sms)
    lo = 1 if min_waves <= 1 else min(max_splits, math.ceil(min_waves * num_sms / work))
    eff = {s: (work * s / num_sms) / math.ceil(work * s / num_sms) for s in range(lo, max_splits + 1)}
    best = max(eff.values())
    return next(s for s, e in eff.items() if e >= 0.85 * best)


def small_launch_splits(work: int, tiles: int, num_sms: int) -> int:
    """Splits of a launch too small to fill the SMs with long splits: SMALL_WAVES programs an SM where the `tiles`
    tiles of a sequence allow (down to one tile a split), at most MAX_SMALL_SPLITS."""
    return max(1, min(tiles, MAX_SMALL_SPLITS, cdiv(SMALL_WAVES * num_sms, work)))


def choose_tiles(
    num_heads: int, num_tokens: int, num_seqs: int, compute_dtype: torch.dtype, kv_bytes: int, kv_lora_rank: int
):
    """(Kernel launch parameters, the tile class's Schedule) from shapes alone (no device reads).

    Rows = BLOCK_Q tokens x BLOCK_H heads <= 64: the fp32 [64, kv_lora_rank=512] accumulator alone takes 128
    registers a thread at 8 warps. tl.dot needs >= 16 rows, so a small H takes more query tokens per tile. fp32
    compute (a correctness path) keeps 16 rows and one stage so its 4-byte tiles fit in shared memory. DSPLIT is
    the schedule's d_split, lowered to kv_lora_rank / 16 where the groups would be narrower than 16 columns.
    """
    max_rows = 16 if compute_dtype == torch.float32 else 64
    block_h = min(next_pow2(num_heads), max_rows)
    mean_sq = cdiv(num_tokens, max(num_seqs, 1))
    block_q = min(next_pow2(mean_sq), max(1, max_rows // block_h))
    block_q = max(block_q, 16 // block_h)
    sched = _FP32_SCHEDULE if max_rows == 16 else SCHEDULES[(min(kv_bytes, 2), block_q * block_h)]
    if sched.d_split not in D_SPLITS:
        raise ValueError(f"Schedule.d_split must be one of {D_SPLITS}, got {sched.d_split!r}")
    # kv_lora_rank and d_split are powers of two, so the smaller of the two splits kv_lora_rank evenly
    d_split = min(sched.d_split, kv_lora_rank // 16)
    return dict(
        BLOCK_H=block_h, BLOCK_Q=block_q, BLOCK_N=sched.block_n, num_warps=sched.num_warps,
        num_stages=sched.num_stages, RESCALE_SLACK=sched.rescale_slack, DSPLIT=d_split,
    ), sched  # fmt: skip


class Fp8WgmmaParams(NamedTuple):
    """The dequant side of the fp8 Gluon kernel (`decode_fp8_wgmma`): raw tiles whose loads are in flight
    (lookahead: 1, the next tile's, copied between registers each tile; 2 or 3, each tile in registers of its
    own), dequant warpgroups (1, or 2 that each take half of every tile's keys; 2 needs lookahead >= 2) and the
    registers a thread of each (the MMA warpgroup gets the rest of the SM's 64K), and how many tiles before their
    register loads a tile's rows are asked of L2 (l2_prefetch, 0: not at all; needs lookahead >= 2)."""

    lookahead: int = 1
    dequant_warpgroups: int = 1
    dequant_regs: int = 232
    l2_prefetch: int = 0


# Two raw tiles in flight, so that a tile's loads overlap the previous tile's dequant (one tile in flight copied
# the next loads between registers and waited out their latency): the fastest variant of the sweep at b=128
# (`scripts/tune_mla_fp8_wgmma.py`, docs/benchmarks.md). 232 registers hold both tiles and the conversion; with
# the MMA warpgroup's 256 the CTA stays within the SM's 64K. Each tile's rows are asked of L2 two tiles before
# their register loads: the dequant warpgroup's stalls on those loads were its largest (ncu_profile.py mla_fp8).
FP8_WGMMA = Fp8WgmmaParams(lookahead=2, dequant_warpgroups=1, dequant_regs=232, l2_prefetch=2)
