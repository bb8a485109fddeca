"""MLA: the Triton kernels against the torch references, on the CPU interpreter or a GPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from kimi_helix.kernels.mla import decode, decode_schedule
from kimi_helix.kernels.mla.combine_triton import combine_launch
from kimi_helix.kernels.mla.decode import mla_decode_triton
from kimi_helix.kernels.mla.naive import mla_decode_ref

from ..conftest import DEVICE, TOL
from .conftest import (
    FP8,
    INTERPRET,
    KV_LORA,
    assert_rel_close_inf,
    dense_decode_attention,
    make_case,
)

needs_triton = pytest.mark.skipif(
    not INTERPRET and not torch.cuda.is_available(), reason="Triton needs TRITON_INTERPRET=1 (CPU) or a GPU"
)


@pytest.fixture
def tma_calls(monkeypatch):
    """The arguments of every `_tma_descriptors` call: one per launch that takes the TMA path."""
    calls = []
    monkeypatch.setattr(decode, "_tma_descriptors", lambda *a, f=decode._tma_descriptors: calls.append(a) or f(*a))
    return calls


@pytest.fixture
def fwd_launches(monkeypatch):
    """The keyword arguments (constexprs and launch settings) of every launch of the forward kernel."""
    calls, kernel = [], decode.mla_decode_fwd_kernel

    class Spy:
        def __getitem__(self, grid):
            return lambda *a, **kw: calls.append(kw) or kernel[grid](*a, **kw)

    monkeypatch.setattr(decode, "mla_decode_fwd_kernel", Spy())
    return calls


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(("H", "s_q"), [(1, 1), (3, 2), (16, 1), (16, 2), (16, 4)])
def test_decode_triton_matches_reference(nan_empty, dtype, H, s_q):
    lens = [1, 40, 17, 64 + s_q]  # 1 token; not a page multiple; exactly 4 pages + s_q
    args, _ = make_case(lens, [s_q] * len(lens), H, dtype=dtype, seed=H * 10 + s_q)
    out, lse = mla_decode_triton(**args)
    want_out, want_lse = mla_decode_ref(**args)
    assert out.dtype == dtype and out.shape == (len(lens) * s_q, H, KV_LORA) and lse.dtype == torch.float32
    assert_rel_close_inf("out", out, want_out.float(), TOL[dtype])
    assert_rel_close_inf("lse", lse, want_lse, 1e-5)


def test_ragged_queries_page_sizes_and_mixed_dtypes(nan_empty):
    # s_q differs per sequence (one has no queries at all); 128-token pages hold several BLOCK_N tiles each.
    args, dense = make_case([9, 300, 3, 130], [3, 1, 0, 2], H=5, page_size=128, dtype=torch.float16, seed=7)
    args["kv_cache"] = args["kv_cache"].float()  # an fp32 cache under fp16 queries computes in fp32
    out, lse = mla_decode_triton(**args)
    want_out, want_lse = dense_decode_attention(args, dense)
    assert_rel_close_inf("out", out, want_out, TOL[torch.float16])
    assert_rel_close_inf("lse", lse, want_lse, 1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_fp8_cache(nan_empty, dtype):
    args, dense = make_case([23, 1, 50], [2, 2, 2], H=4, kv_dtype=FP8, dtype=dtype, seed=3)
    out, lse = mla_decode_triton(**args)
    want_out, want_lse = mla_decode_ref(**args)
    assert_rel_close_inf("out", out, want_out.float(), TOL[dtype])
    assert_rel_close_inf("lse", lse, want_lse, 1e-5)
    assert_rel_close_inf("ref vs dense", want_out.float(), dense_decode_attention(args, dense)[0], TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_fp8_extreme_key_scales(nan_empty, dtype):
    """Per-token scales from 1e-23 up to 1e17 (to 1e-1 for fp16 outputs, which cannot hold more), and zeros (an
    all-zero latent row), over several tiles: the P @ c weights p * scale are normalised by their own running max,
    so fp16 holds them whatever the scales."""
    args, _ = make_case([150, 40, 1], [1, 2, 1], H=4, kv_dtype=FP8, dtype=dtype, page_size=16, seed=4)
    gen = torch.Generator().manual_seed(4)
    scale = args["kv_scale"].cpu()
    exponents = torch.randint(-20, 21 if dtype == torch.float32 else 3, scale.shape, generator=gen).double()
    scale = torch.where(torch.isnan(scale), scale, (10.0**exponents).float() * 1e-3)
    scale[torch.rand(scale.shape, generator=gen) < 0.1] = 0.0
    args["kv_scale"] = scale.to(DEVICE)
    args["q"] = args["q"] * 1e-3  # scores stay finite in fp32: |q . c| * scale < 1e20
    want_out, want_lse = mla_decode_ref(**args)
    for splits in (1, 4):
        out, lse = mla_decode_triton(**args, num_kv_splits=splits)
        assert_rel_close_inf(f"out (splits {splits})", out, want_out.float(), TOL[dtype])
        assert_rel_close_inf(f"lse (splits {splits})", lse, want_lse, 1e-5)


@pytest.mark.parametrize("kv_dtype", [torch.float16, FP8])
@pytest.mark.parametrize("slack", [0.0, 8.0])
def test_rescale_schedules(nan_empty, monkeypatch, kv_dtype, slack):
    # Sharp scores (q x 16) over 16-key tiles: row maxima grow on later tiles by more than fp16 can hold unrescaled
    # (2^16), and by less than the slack on others.
    for key in decode.SCHEDULES:
        monkeypatch.setitem(decode.SCHEDULES, key, decode.Schedule(16, 4, 1, slack))
    args, _ = make_case([200, 7, 96], [1, 2, 3], H=8, dtype=torch.float16, kv_dtype=kv_dtype, seed=11)
    args["q"] = args["q"] * 16
    out, lse = mla_decode_triton(**args, num_kv_splits=2)
    want_out, want_lse = mla_decode_ref(**args)
    assert_rel_close_inf("out", out, want_out.float(), TOL[torch.float16])
    assert_rel_close_inf("lse", lse, want_lse, 1e-5)


@pytest.mark.parametrize("kv_dtype", [torch.float16, FP8])
@pytest.mark.parametrize("splits", [1, 3])
def test_tma_tiles(nan_empty, monkeypatch, tma_calls, kv_dtype, splits):
    # 16-key tiles by TMA inside 32-key pages. A sequence's partial last tile is read as the window ending at its
    # last key: the keys before it in the page, or zeros before the page's first row; never the poisoned rows past
    # the sequence's end.
    args, _ = make_case([200, 7, 96, 33], [1, 2, 3, 1], H=8, page_size=32, dtype=torch.float16, kv_dtype=kv_dtype,
                        seed=13)  # fmt: skip
    args["kv_bounds"] = torch.tensor([150, 0, 5, 40, 96, 96, 17], dtype=torch.int32, device=DEVICE)
    want_out, want_lse = mla_decode_ref(**args)
    monkeypatch.setattr(decode, "TMA_MIN_WORK", 0)
    for tma in (False, True):
        for key in decode.SCHEDULES:
            monkeypatch.setitem(decode.SCHEDULES, key, decode.Schedule(16, 4, 1, 0.0, tma=tma))
        out, lse = mla_decode_triton(**args, num_kv_splits=splits)
        assert len(tma_calls) == tma  # the descriptors are made (the TMA path taken) exactly when the schedule asks
        assert_rel_close_inf(f"out tma={tma}", out, want_out.float(), TOL[torch.float16])
        assert_rel_close_inf(f"lse tma={tma}", lse, want_lse, 1e-5)


@pytest.mark.parametrize("min_work", [7 * 8 * 128, 7 * 8 * 128 + 1])
def test_tma_only_for_large_launches(nan_empty, monkeypatch, tma_calls, min_work):
    # T * H * max_kv = 7 * 8 * 128 here (block-table rows of 4 pages of 32 keys): a launch below TMA_MIN_WORK
    # gathers its tiles even where the schedule asks for TMA, and gives the same result.
    args, _ = make_case([80, 7, 96], [1, 2, 4], H=8, page_size=32, dtype=torch.float16, seed=17)
    monkeypatch.setattr(decode, "TMA_MIN_WORK", min_work)
    for key in decode.SCHEDULES:
        monkeypatch.setitem(decode.SCHEDULES, key, decode.Schedule(16, 4, 1, 0.0, tma=True))
    out, lse = mla_decode_triton(**args)
    assert len(tma_calls) == (min_work == 7 * 8 * 128)
    want_out, want_lse = mla_decode_ref(**args)
    assert_rel_close_inf("out", out, want_out.float(), TOL[torch.float16])
    assert_rel_close_inf("lse", lse, want_lse, 1e-5)


def test_tma_needs_tiles_inside_pages():
    cache = torch.zeros(4, 64, 48, dtype=torch.float16)
    assert decode._tma_ok(cache, 32, 64) == (os.environ.get("TRITON_INTERPRET") == "1" or DEVICE == "cuda")
    assert not decode._tma_ok(cache, 32, 128)  # a 128-key tile would span two pages
    assert not decode._tma_ok(torch.zeros(4, 64, 44, dtype=torch.float16), 32, 64)  # 88-byte rows


@pytest.mark.parametrize("d_split", [1, 2, 4])
@pytest.mark.parametrize(
    ("kv_dtype", "slack", "tma", "splits"),
    [(torch.float16, 0.0, False, None), (FP8, 8.0, False, 3), (torch.float16, 8.0, True, 1), (FP8, 0.0, True, 3)],
)
def test_latent_column_groups(nan_empty, monkeypatch, tma_calls, fwd_launches, d_split, kv_dtype, slack, tma, splits):
    # kv_lora_rank 64 as 1, 2 or 4 groups of columns, each with its own dot and accumulator. Ragged s_q (one
    # sequence with none; tiles of 2 tokens x 8 heads) with per-token bounds, some 0; 16-key tiles gathered or by
    # TMA inside 32-key pages; sharp scores (q x 16) so that row maxima grow past the lazy-rescale slack.
    args, _ = make_case([200, 7, 96, 33], [1, 3, 0, 2], H=8, page_size=32, kv_lora=64, dtype=torch.float16,
                        kv_dtype=kv_dtype, seed=19 + d_split)  # fmt: skip
    args["q"] = args["q"] * 16
    bounds = torch.tensor([150, 0, 5, 7, 0, 33], dtype=torch.int32)
    args["kv_bounds"] = bounds.to(DEVICE)
    monkeypatch.setattr(decode, "TMA_MIN_WORK", 0)
    for key in decode.SCHEDULES:
        monkeypatch.setitem(decode.SCHEDULES, key, decode.Schedule(16, 4, 1, slack, tma=tma, d_split=d_split))
    out, lse = mla_decode_triton(**args, num_kv_splits=splits)
    assert [launch["DSPLIT"] for launch in fwd_launches] == [d_split]
    assert [call[3:] for call in tma_calls] == ([(d_split,)] if tma else [])  # descriptors one group wide
    empty = (bounds == 0).to(DEVICE)
    assert (out[empty] == 0).all() and (lse[empty] == float("-inf")).all()
    want_out, want_lse = mla_decode_ref(**args)
    assert_rel_close_inf("out", out[~empty], want_out[~empty].float(), TOL[torch.float16])
    assert_rel_close_inf("lse", lse[~empty], want_lse[~empty], 1e-5)


@pytest.mark.parametrize(("kv_lora", "d_split"), [(16, 1), (32, 2), (512, 4)])
def test_d_split_fits_the_latent(nan_empty, fwd_launches, kv_lora, d_split):
    # The committed 16-row bf16 schedule asks for 4 groups; a narrower latent takes the most groups of >= 16 columns.
    assert decode.SCHEDULES[(2, 16)].d_split == 4
    cfg, _ = decode.choose_tiles(16, 1, 1, torch.float16, 2, kv_lora)
    assert cfg["DSPLIT"] == d_split
    assert decode.choose_tiles(16, 1, 1, torch.float32, 2, kv_lora)[0]["DSPLIT"] == 1  # the fp32 path keeps one group
    if kv_lora == 512:
        return  # too wide for the interpreter
    args, _ = make_case([40, 9], [1, 1], H=16, kv_lora=kv_lora, dtype=torch.float16, seed=kv_lora)
    out, lse = mla_decode_triton(**args)
    assert [launch["DSPLIT"] for launch in fwd_launches] == [d_split]
    want_out, want_lse = mla_decode_ref(**args)
    assert_rel_close_inf("out", out, want_out.float(), TOL[torch.float16])
    assert_rel_close_inf("lse", lse, want_lse, 1e-5)


def test_rejects_unknown_d_split(monkeypatch):
    monkeypatch.setitem(decode.SCHEDULES, (2, 16), decode.SCHEDULES[(2, 16)]._replace(d_split=3))
    args, _ = make_case([5], [1], H=16, dtype=torch.float16, seed=1)
    with pytest.raises(ValueError, match=r"d_split must be one of \(1, 2, 4\), got 3"):
        mla_decode_triton(**args)


@pytest.mark.parametrize("splits", [None, 3])
def test_kv_bounds_with_empty_queries(nan_empty, splits):
    lens = [20, 45]
    args, dense = make_case(lens, [3, 3], H=3, seed=11)
    bounds = torch.tensor([0, 7, 20, 0, 45, 60], dtype=torch.int32)  # 60 > 45: clamped to the sequence length
    args["kv_bounds"] = bounds.to(DEVICE)
    out, lse = mla_decode_triton(**args, num_kv_splits=splits)
    want_out, want_lse = mla_decode_ref(**args)
    empty = (bounds == 0).to(DEVICE)
    assert (out[empty] == 0).all() and (lse[empty] == float("-inf")).all()
    assert torch.isfinite(out).all() and not lse.isnan().any()
    assert_rel_close_inf("out", out[~empty], want_out[~empty], 1e-5)
    assert_rel_close_inf("lse", lse[~empty], want_lse[~empty], 1e-5)
    assert_rel_close_inf(
        "ref vs dense", want_out[~empty].cpu(), dense_decode_attention(args, dense, bounds)[0][~empty.cpu()], 1e-6
    )


def test_split_kv_matches_unsplit(nan_empty):
    # 5 splits of a 1-token sequence leave four splits empty (lse -inf, weight 0) in the merge.
    args, _ = make_case([1, 33, 150], [2, 2, 2], H=16, seed=5)
    base_out, base_lse = mla_decode_triton(**args, num_kv_splits=1)
    for splits in (2, 5):
        out, lse = mla_decode_triton(**args, num_kv_splits=splits)
        assert_rel_close_inf(f"out splits={splits}", out, base_out, 1e-6)
        assert_rel_close_inf(f"lse splits={splits}", lse, base_lse, 1e-6)


def test_num_kv_splits_heuristic():
    # one program per SM: FlashAttention's wave rule
    assert decode.choose_num_kv_splits(256, 8192, 64, 132, min_waves=1) == 1  # more programs than SMs: no split
    assert decode.choose_num_kv_splits(32, 8192, 64, 132, min_waves=1) == 4  # 128 programs: one near-full wave
    # the default aims at several programs per SM, so unequal lengths balance out
    assert decode.MIN_WAVES > 1
    assert decode.choose_num_kv_splits(600, 8192, 64, 132) == 1
    assert 128 * decode.choose_num_kv_splits(128, 8192, 64, 132) >= decode.MIN_WAVES * 132
    assert decode.choose_num_kv_splits(1, 128, 64, 132) == 1  # too short to split
    # a split keeps at least min_split_tiles tiles: 8192 keys, 64-key tiles
    assert decode.choose_num_kv_splits(32, 8192, 64, 132, min_waves=8, min_split_tiles=4) == 32
    assert decode.choose_num_kv_splits(32, 8192, 64, 132, min_waves=8, min_split_tiles=8) == 16
    assert decode.choose_num_kv_splits(1, 1 << 20, 64, 132) == decode_schedule.MAX_SMALL_SPLITS  # capped


def committed_splits(b, H, s_k, kv_bytes=2):
    """(tile rows, programs, splits) that mla_decode_triton launches for b decode queries over s_k keys each at
    the kimi shapes (kv_lora_rank 512) on an H200's 132 SMs."""
    cfg, sched = decode.choose_tiles(H, b, b, torch.bfloat16, kv_bytes, 512)
    work = b * decode.cdiv(H, cfg["BLOCK_H"])
    splits = decode.choose_num_kv_splits(work, s_k, cfg["BLOCK_N"], 132, sched.min_waves, sched.min_split_tiles)
    return cfg["BLOCK_H"], work * splits, splits


@pytest.mark.parametrize("kv_bytes", [2, 1])
@pytest.mark.parametrize("H", [16, 32, 96])
def test_small_batches_fill_the_sms(H, kv_bytes):
    """A launch that long splits cannot spread over the SMs (decode at batch 1 and 8) splits down to one tile a
    split: a program on every SM at 4k keys and batch 1 for H=96 (two head blocks), and as many programs as
    one-tile splits give otherwise."""
    for b, s_k in ((1, 4096), (8, 4096), (1, 32768)):
        rows, programs, splits = committed_splits(b, H, s_k, kv_bytes)
        tiles = s_k // 64
        assert splits <= decode_schedule.MAX_SMALL_SPLITS and s_k // splits >= 64  # at least one 64-key tile a split
        one_tile_splits = b * decode.cdiv(H, rows) * min(tiles, decode_schedule.MAX_SMALL_SPLITS)
        assert programs >= min(one_tile_splits, 132), (b, H, s_k, splits)
    assert committed_splits(1, 32, 4096, kv_bytes)[2] == 64  # was 8 (bf16) or 16 (fp8): 8 or 16 of 132 SMs busy


def test_large_batches_keep_their_splits():
    """Batch 128 at 8k keys keeps the splits the schedules were tuned with (scripts/tune_mla_decode.py)."""
    assert committed_splits(128, 16, 8192) == (16, 640, 5)
    assert committed_splits(128, 32, 8192) == (32, 1152, 9)
    assert committed_splits(128, 16, 8192, kv_bytes=1) == (16, 640, 5)
    # a launch that long splits fill keeps FlashAttention's rule, at most MAX_SPLITS
    assert committed_splits(8, 16, 32768, kv_bytes=1)[2] == decode_schedule.MAX_SPLITS


@pytest.mark.parametrize(("rows", "splits", "dc"), [(1, 64, 512), (3, 100, 64), (2048, 5, 512), (37, 1, 16)])
def test_combine_launch_covers_every_row_and_column(rows, splits, dc):
    grid, meta = combine_launch(rows, splits, dc, 132)
    assert grid[0] * meta["BLOCK_R"] >= rows > (grid[0] - 1) * meta["BLOCK_R"]
    assert grid[1] * meta["BLOCK_D"] == dc and meta["SPLITS_POW2"] >= splits


def test_combine_launch_spreads_batch_one_over_the_sms():
    """Batch 1, H=32, 64 splits: a program per (row, 128 columns), where 16-row blocks gave 2 programs."""
    grid, meta = combine_launch(32, 64, 512, 132)
    assert grid == (32, 4) and meta["BLOCK_R"] == 1


@needs_triton
def test_many_splits_match_unsplit(nan_empty, fwd_launches):
    """Batch 1 over 1000 keys takes the small-launch schedule (many one-tile splits, several of them empty for the
    shorter sequence of a batch of 2), and the merge of up to MAX_SMALL_SPLITS partials equals one pass."""
    args, dense = make_case([1000, 300], [1, 1], H=16, page_size=32, dtype=torch.float16, seed=7)
    out, lse = mla_decode_triton(**args)
    assert fwd_launches[-1]["SPLIT"]
    sched = decode.SCHEDULES[(2, 16)]
    max_kv = args["block_table"].shape[1] * 32
    assert decode.choose_num_kv_splits(2, max_kv, 64, 132, sched.min_waves, sched.min_split_tiles) >= 16
    base_out, base_lse = mla_decode_triton(**args, num_kv_splits=1)
    assert_rel_close_inf("out", out, base_out, TOL[torch.float16])
    assert_rel_close_inf("lse", lse, base_lse, 1e-5)
    want_out, want_lse = dense_decode_attention(args, dense)
    assert_rel_close_inf("out vs dense", out.float().cpu(), want_out.float(), TOL[torch.float16])
    out, lse = mla_decode_triton(**args, num_kv_splits=decode_schedule.MAX_SMALL_SPLITS)
    assert_rel_close_inf("out, MAX_SMALL_SPLITS", out, base_out, TOL[torch.float16])
    assert_rel_close_inf("lse, MAX_SMALL_SPLITS", lse, base_lse, 1e-5)


def test_rejects_unsupported_inputs():
    args, _ = make_case([5], [1], H=2, seed=1)
    bad = {
        "kv_lora_rank": dict(kv_lora_rank=24),  # 24 not a power of two, and rope 24 neither
        "rope_dim": dict(kv_lora_rank=KV_LORA, q=args["q"][..., :40], kv_cache=args["kv_cache"][..., :40].contiguous()),
        "block_table": dict(block_table=args["block_table"].long()),
        "cache_seqlens": dict(cache_seqlens=args["cache_seqlens"][:0]),
        "kv_scale": dict(kv_cache=args["kv_cache"].to(FP8)),
        "kv_bounds": dict(kv_bounds=torch.zeros(3, dtype=torch.int32, device=DEVICE)),
        "num_kv_splits": dict(num_kv_splits=0),
    }
    for name, change in bad.items():
        with pytest.raises(ValueError, match=name):
            mla_decode_triton(**{**args, **change})


def test_longest_first_only_for_whole_sequences_over_more_than_a_wave(monkeypatch):
    """The wgmma kernel takes sequences longest first only without split-KV, for up to LONGEST_FIRST_MAX_SEQS
    sequences, and when its programs outnumber the SMs."""
    monkeypatch.setattr(decode, "num_sms", lambda *_: 132)
    n = decode.LONGEST_FIRST_MAX_SEQS
    assert decode._longest_first(1, 128, 320, 0)
    assert not decode._longest_first(2, 128, 512, 0)  # split-KV keeps the sequences' order
    assert not decode._longest_first(1, 128, 132, 0)  # one wave: order does not matter
    assert decode._longest_first(1, n, 2 * n, 0) and not decode._longest_first(1, n + 1, 2 * n + 2, 0)


@pytest.mark.skipif(decode.decode_wgmma is None, reason="this Triton has no Gluon Hopper ops")
def test_wgmma_kernel_compiles_for_sm90_within_shared_memory():
    """The Gluon kernel compiles for sm_90 (no GPU needed) at the committed schedule (split KV, and whole sequences
    taken longest first) and at 32-key tiles in 3 buffers; the host's shared-memory estimate (what `_wgmma_ok` gates
    on) stays within 2 KB of what the compiler allocates, so a schedule whose buffers overflow (64-key tiles in 3
    buffers) is refused before launch."""

    sched = decode.SCHEDULES[(2, 64)]
    assert sched.wgmma
    tiles = [
        (sched.block_n, sched.num_stages, False),
        (sched.block_n, sched.num_stages, True),
        (32, 3, False),
        (64, 3, False),
    ]  # (keys a tile, buffers, longest first)
    # Compiled in a fresh process without the interpreter (which this one runs under: kernels decorated in it
    # cannot compile for a GPU).
    code = (
        "import json, sys; import kernel_resources as kr; "
        f"print(json.dumps([kr.resources(*[kr.mla_wgmma_case(n, s, 64, f)[i] for i in (1, 2, 3, 4, 5)])['shared'] "
        f"for n, s, f in {tiles!r}]))"
    )
    scripts = os.path.join(os.path.dirname(__file__), "..", "..", "..", "scripts")
    env = dict(os.environ, TRITON_INTERPRET="0", PYTHONPATH=os.pathsep.join([scripts, *sys.path]))
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    for (block_n, stages, _), shared in zip(tiles, json.loads(run.stdout.strip().splitlines()[-1]), strict=True):
        estimate = decode._wgmma_smem(64, block_n, stages, 576)
        assert estimate <= shared <= estimate + 2048, (block_n, stages, shared)
        assert (estimate <= decode._WGMMA_SMEM) == (shared <= 227 * 1024), (block_n, stages, shared)
    assert decode._wgmma_smem(64, sched.block_n, sched.num_stages, 576) <= decode._WGMMA_SMEM


def _fp8_call(device="cuda", q_dtype=torch.bfloat16, kv_dtype=FP8, kv_lora=512, rope=64, ptr=0):
    """Stand-ins for q and the cache as `decode._fp8_wgmma_ok` reads them (no GPU needed)."""
    from types import SimpleNamespace

    q = SimpleNamespace(device=torch.device(device, 0) if device == "cuda" else torch.device(device), dtype=q_dtype)
    cache = SimpleNamespace(dtype=kv_dtype, shape=(8, 64, kv_lora + rope), data_ptr=lambda: ptr)
    return q, cache, kv_lora


@pytest.mark.parametrize(
    ("change", "served"),
    [
        ({}, True),
        ({"rows": (32, 1)}, True),
        ({"rows": (4, 4)}, True),  # verify: 4 heads x 4 query tokens
        ({"rows": (64, 1)}, False),
        ({"capability": (8, 0)}, False),
        ({"capability": (10, 0)}, False),
        ({"device": "cpu"}, False),
        ({"kv_dtype": torch.bfloat16}, False),
        ({"q_dtype": torch.float32}, False),
        ({"kv_lora": 32, "rope": 16}, False),  # O^T of half a 64-row MMA
        ({"rope": 0}, False),
        ({"block_n": 32}, False),
        ({"ptr": 8}, False),
        ({"gluon": False}, False),
    ],
)
def test_fp8_wgmma_serves(monkeypatch, change, served):
    """The fp8 Gluon kernel's gate: sm_90, an fp8 cache with 16-bit q, 16 or 32 tile rows, its own 64-key tiles,
    kv_lora_rank >= 64 and a rope part, aligned rows."""
    monkeypatch.setattr(decode, "capability", lambda *_: change.get("capability", (9, 0)))
    if not change.get("gluon", True):
        monkeypatch.setattr(decode, "decode_fp8_wgmma", None)
    elif decode.decode_fp8_wgmma is None:
        pytest.skip("this Triton has no Gluon Hopper ops")
    keys = ("device", "q_dtype", "kv_dtype", "kv_lora", "rope", "ptr")
    q, cache, kv_lora = _fp8_call(**{k: v for k, v in change.items() if k in keys})
    block_h, block_q = change.get("rows", (16, 1))
    sched = decode.SCHEDULES[(1, 16)]._replace(block_n=change.get("block_n", 64))
    assert decode._fp8_wgmma_ok(q, cache, kv_lora, dict(BLOCK_H=block_h, BLOCK_Q=block_q), sched) == served


def test_fp8_schedules_committed_and_triton():
    """16 fp8 rows take the Gluon kernel (Schedule.wgmma) with the Triton schedule kept as its fallback; 32 and 64
    rows keep the Triton schedules (TRITON_FP8_SCHEDULES, which bench_mla.py --fp8-schedules triton compares)."""
    committed, triton_only = decode_schedule.SCHEDULES, decode_schedule.TRITON_FP8_SCHEDULES
    assert committed[(1, 16)] == triton_only[(1, 16)]._replace(wgmma=True)
    assert committed[(1, 32)] == triton_only[(1, 32)] and committed[(1, 64)] == triton_only[(1, 64)]
    assert not any(s.wgmma for s in triton_only.values())
    cfg, sched = decode_schedule.choose_tiles(16, 128, 128, torch.float16, 1, 512)
    assert (cfg["BLOCK_H"], cfg["BLOCK_Q"], sched.wgmma) == (16, 1, True)


@pytest.mark.skipif(decode.decode_fp8_wgmma is None, reason="this Triton has no Gluon Hopper ops")
@pytest.mark.parametrize("params", [None, (2, 1, 232), (2, 2, 128), (2, 2, 128, 2)])
def test_fp8_wgmma_kernel_compiles_for_sm90_without_spills(params):
    """The fp8 Gluon kernel compiles for sm_90 (no GPU needed) at 16 rows, decode (16 heads, split KV) and verify
    (4 heads x 4 tokens, one split, longest first), without register spills, at the committed dequant side
    (`decode.FP8_WGMMA`) and the alternatives scripts/tune_mla_fp8_wgmma.py times (two tiles in flight, in one
    or two dequant warpgroups, with and without L2 prefetches); the host's shared-memory estimate (what
    `_fp8_wgmma_ok` gates on) stays within 2 KB of what the compiler allocates."""
    cases = [(16, 16, True, False), (16, 4, False, True)]  # (rows, heads a tile, split KV, longest first)
    p = "None" if params is None else f"decode.Fp8WgmmaParams(*{params!r})"
    code = (
        "import json; import kernel_resources as kr; from kimi_helix.kernels.mla import decode; "
        f"print(json.dumps([kr.resources(*kr.mla_fp8_wgmma_case(r, h, split=s, longest_first=f, params={p})[1:6]) "
        f"for r, h, s, f in {cases!r}]))"
    )
    scripts = os.path.join(os.path.dirname(__file__), "..", "..", "..", "scripts")
    env = dict(os.environ, TRITON_INTERPRET="0", PYTHONPATH=os.pathsep.join([scripts, *sys.path]))
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    estimate = decode.decode_fp8_wgmma.fp8_wgmma_smem(16, 576, 2)
    assert estimate <= decode._WGMMA_SMEM
    for case, usage in zip(cases, json.loads(run.stdout.strip().splitlines()[-1]), strict=True):
        assert usage["stack"] == 0 and usage["LDL"] == 0, (case, usage)
        assert usage["HGMMA"] > 0, (case, usage)
        assert estimate <= usage["shared"] <= estimate + 2048, (case, usage)
