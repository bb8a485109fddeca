"""MLA decode/verify over the paged latent cache: the torch reference against a dense softmax, and the Triton kernel
against the reference (fp32, fp16, fp8 caches, per-token bounds, split-KV, latent column groups, poisoned
outputs, input validation)."""

from __future__ import annotations

import os

import pytest
import torch

from kimi_helix.kernels.mla import decode
from kimi_helix.kernels.mla.decode import mla_decode_triton
from kimi_helix.kernels.mla.naive import mla_decode_ref

from .conftest import DEVICE, TOL
from .conftest import assert_rel_close as shared_assert_rel_close

KV_LORA, ROPE = 32, 16
FP8 = torch.float8_e4m3fn


def assert_rel_close(name, actual, expected, tol):
    """The shared check, except that an lse may be -inf exactly where the expected one is (a query that sees no key)."""
    shared_assert_rel_close(name, actual, expected, tol, neg_inf_where_expected=True)


def make_case(lens, s_q, H, *, page_size=16, kv_lora=KV_LORA, rope=ROPE, dtype=torch.float32, kv_dtype=None, seed=0):
    """Random queries and per-sequence dense latents, scattered into shuffled pages of a NaN-poisoned paged cache.

    Returns (args for the kernels as a dict, dense latents per sequence in fp32 after any fp8 round trip).
    Unused page slots, spare pages and block-table padding (pointing at a spare page) are NaN, so any read past a
    sequence's length shows up as a non-finite output.
    """
    gen = torch.Generator().manual_seed(seed)
    kv_dtype = kv_dtype or dtype
    D, N = kv_lora + rope, len(lens)
    counts = [-(-n // page_size) for n in lens]
    num_pages = sum(counts) + 2
    perm = torch.randperm(num_pages, generator=gen)
    spare = perm[-1].item()
    max_pages = max(counts) + 1
    block_table = torch.full((N, max_pages), spare, dtype=torch.int32)
    cache = torch.full((num_pages, page_size, D), float("nan"))
    scales = torch.full((num_pages, page_size), float("nan"))
    dense, used = [], 0
    for i, n in enumerate(lens):
        pages = perm[used : used + counts[i]]
        used += counts[i]
        block_table[i, : counts[i]] = pages.int()
        lat = torch.randn(n, D, generator=gen)
        pos = torch.arange(n)
        if kv_dtype == FP8:
            s = lat.abs().amax(-1) / 448  # the engine's per-token scale: the largest value maps to e4m3's max
            lat = (lat / s[:, None]).to(FP8)
            scales[pages[pos // page_size], pos % page_size] = s
            dense.append(lat.float() * s[:, None])
        else:
            lat = lat.to(kv_dtype)
            dense.append(lat.float())
        cache[pages[pos // page_size], pos % page_size] = lat.float()
    cu = torch.tensor([0, *torch.tensor(s_q).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.randn(int(cu[-1]), H, D, generator=gen).to(dtype)
    args = dict(
        q=q,
        kv_cache=cache.to(kv_dtype),
        block_table=block_table,
        cache_seqlens=torch.tensor(lens, dtype=torch.int32),
        cu_seqlens_q=cu,
        scale=(kv_lora + rope) ** -0.5 * 1.3,  # deliberately not D ** -0.5
        kv_lora_rank=kv_lora,
        kv_scale=scales if kv_dtype == FP8 else None,
    )
    return {k: v.to(DEVICE) if isinstance(v, torch.Tensor) else v for k, v in args.items()}, dense


def dense_attention(args, dense, kv_bounds=None):
    """Direct fp64 softmax attention per (sequence, query, head) on the dense latents: independent of the pages."""
    q, cu, lens = args["q"].cpu().double(), args["cu_seqlens_q"].tolist(), args["cache_seqlens"].tolist()
    outs, lses = [], []
    for i, L in enumerate(lens):
        kv = dense[i].double()
        s_q = cu[i + 1] - cu[i]
        for j in range(s_q):
            t = cu[i] + j
            n = L - s_q + j + 1 if kv_bounds is None else min(int(kv_bounds[t]), L)
            scores = q[t] @ kv[:n].T * args["scale"]  # [H, n]
            outs.append(torch.softmax(scores, -1) @ kv[:n, : args["kv_lora_rank"]])
            lses.append(torch.logsumexp(scores, -1))
    return torch.stack(outs), torch.stack(lses)


@pytest.mark.parametrize("s_q", [[1, 1, 1], [2, 3, 1], [4, 4, 4]])
def test_reference_matches_dense_softmax(s_q):
    args, dense = make_case([37, 5, 70], s_q, H=3, seed=len(s_q) + s_q[0])
    out, lse = mla_decode_ref(**args)
    want_out, want_lse = dense_attention(args, dense)
    assert out.dtype == torch.float32 and lse.dtype == torch.float32
    assert_rel_close("out", out, want_out, 1e-6)
    assert_rel_close("lse", lse, want_lse, 1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(("H", "s_q"), [(1, 1), (3, 2), (16, 1), (16, 2), (16, 4)])
def test_triton_matches_reference(nan_empty, dtype, H, s_q):
    lens = [1, 40, 17, 64 + s_q]  # 1 token; not a page multiple; exactly 4 pages + s_q
    args, _ = make_case(lens, [s_q] * len(lens), H, dtype=dtype, seed=H * 10 + s_q)
    out, lse = mla_decode_triton(**args)
    want_out, want_lse = mla_decode_ref(**args)
    assert out.dtype == dtype and out.shape == (len(lens) * s_q, H, KV_LORA) and lse.dtype == torch.float32
    assert_rel_close("out", out, want_out.float(), TOL[dtype])
    assert_rel_close("lse", lse, want_lse, 1e-5)


def test_ragged_queries_page_sizes_and_mixed_dtypes(nan_empty):
    # s_q differs per sequence (one has no queries at all); 128-token pages hold several BLOCK_N tiles each.
    args, dense = make_case([9, 300, 3, 130], [3, 1, 0, 2], H=5, page_size=128, dtype=torch.float16, seed=7)
    args["kv_cache"] = args["kv_cache"].float()  # an fp32 cache under fp16 queries computes in fp32
    out, lse = mla_decode_triton(**args)
    want_out, want_lse = dense_attention(args, dense)
    assert_rel_close("out", out, want_out, TOL[torch.float16])
    assert_rel_close("lse", lse, want_lse, 1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_fp8_cache(nan_empty, dtype):
    args, dense = make_case([23, 1, 50], [2, 2, 2], H=4, kv_dtype=FP8, dtype=dtype, seed=3)
    out, lse = mla_decode_triton(**args)
    want_out, want_lse = mla_decode_ref(**args)
    assert_rel_close("out", out, want_out.float(), TOL[dtype])
    assert_rel_close("lse", lse, want_lse, 1e-5)
    assert_rel_close("ref vs dense", want_out.float(), dense_attention(args, dense)[0], TOL[dtype])


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
    assert_rel_close("out", out, want_out.float(), TOL[torch.float16])
    assert_rel_close("lse", lse, want_lse, 1e-5)


@pytest.fixture
def tma_calls(monkeypatch):
    """The arguments of every `_tma_descriptors` call: one per launch that takes the TMA path."""
    calls = []
    monkeypatch.setattr(decode, "_tma_descriptors", lambda *a, f=decode._tma_descriptors: calls.append(a) or f(*a))
    return calls


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
        assert_rel_close(f"out tma={tma}", out, want_out.float(), TOL[torch.float16])
        assert_rel_close(f"lse tma={tma}", lse, want_lse, 1e-5)


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
    assert_rel_close("out", out, want_out.float(), TOL[torch.float16])
    assert_rel_close("lse", lse, want_lse, 1e-5)


def test_tma_needs_tiles_inside_pages():
    cache = torch.zeros(4, 64, 48, dtype=torch.float16)
    assert decode._tma_ok(cache, 32, 64) == (os.environ.get("TRITON_INTERPRET") == "1" or DEVICE == "cuda")
    assert not decode._tma_ok(cache, 32, 128)  # a 128-key tile would span two pages
    assert not decode._tma_ok(torch.zeros(4, 64, 44, dtype=torch.float16), 32, 64)  # 88-byte rows


@pytest.fixture
def fwd_launches(monkeypatch):
    """The keyword arguments (constexprs and launch settings) of every launch of the forward kernel."""
    calls, kernel = [], decode.mla_decode_fwd_kernel

    class Spy:
        def __getitem__(self, grid):
            return lambda *a, **kw: calls.append(kw) or kernel[grid](*a, **kw)

    monkeypatch.setattr(decode, "mla_decode_fwd_kernel", Spy())
    return calls


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
    assert_rel_close("out", out[~empty], want_out[~empty].float(), TOL[torch.float16])
    assert_rel_close("lse", lse[~empty], want_lse[~empty], 1e-5)


@pytest.mark.parametrize(("kv_lora", "d_split"), [(16, 1), (32, 2), (512, 4)])
def test_d_split_fits_the_latent(nan_empty, fwd_launches, kv_lora, d_split):
    # The committed 16-row bf16 schedule asks for 4 groups; a narrower latent takes the most groups of >= 16 columns.
    assert decode.SCHEDULES[(2, 16)].d_split == 4
    cfg, _ = decode._tiles(16, 1, 1, torch.float16, 2, kv_lora)
    assert cfg["DSPLIT"] == d_split
    assert decode._tiles(16, 1, 1, torch.float32, 2, kv_lora)[0]["DSPLIT"] == 1  # the fp32 path keeps one group
    if kv_lora == 512:
        return  # too wide for the interpreter
    args, _ = make_case([40, 9], [1, 1], H=16, kv_lora=kv_lora, dtype=torch.float16, seed=kv_lora)
    out, lse = mla_decode_triton(**args)
    assert [launch["DSPLIT"] for launch in fwd_launches] == [d_split]
    want_out, want_lse = mla_decode_ref(**args)
    assert_rel_close("out", out, want_out.float(), TOL[torch.float16])
    assert_rel_close("lse", lse, want_lse, 1e-5)


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
    assert_rel_close("out", out[~empty], want_out[~empty], 1e-5)
    assert_rel_close("lse", lse[~empty], want_lse[~empty], 1e-5)
    assert_rel_close(
        "ref vs dense", want_out[~empty].cpu(), dense_attention(args, dense, bounds)[0][~empty.cpu()], 1e-6
    )


def test_split_kv_matches_unsplit(nan_empty):
    # 5 splits of a 1-token sequence leave four splits empty (lse -inf, weight 0) in the merge.
    args, _ = make_case([1, 33, 150], [2, 2, 2], H=16, seed=5)
    base_out, base_lse = mla_decode_triton(**args, num_kv_splits=1)
    for splits in (2, 5):
        out, lse = mla_decode_triton(**args, num_kv_splits=splits)
        assert_rel_close(f"out splits={splits}", out, base_out, 1e-6)
        assert_rel_close(f"lse splits={splits}", lse, base_lse, 1e-6)


def test_num_kv_splits_heuristic():
    # one program per SM: FlashAttention's wave rule
    assert decode._num_kv_splits(256, 8192, 64, 132, min_waves=1) == 1  # more programs than SMs: no split
    assert decode._num_kv_splits(32, 8192, 64, 132, min_waves=1) == 4  # 128 programs: one near-full wave
    # the default aims at several programs per SM, so unequal lengths balance out
    assert decode.MIN_WAVES > 1
    assert decode._num_kv_splits(600, 8192, 64, 132) == 1
    assert 128 * decode._num_kv_splits(128, 8192, 64, 132) >= decode.MIN_WAVES * 132
    assert decode._num_kv_splits(1, 128, 64, 132) == 1  # too short to split
    # a split keeps at least min_split_tiles tiles: 8192 keys, 64-key tiles
    assert decode._num_kv_splits(32, 8192, 64, 132, min_waves=8, min_split_tiles=4) == 32
    assert decode._num_kv_splits(32, 8192, 64, 132, min_waves=8, min_split_tiles=8) == 16
    assert 32 <= decode._num_kv_splits(1, 1 << 20, 64, 132) <= 64  # many splits, capped


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


def test_bench_smoke(tmp_path):
    import json
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "scripts"))
    try:
        import bench_mla
    finally:
        sys.path.pop(0)
    bench_mla.main(["--smoke", "--out", str(tmp_path)])
    rows = [json.loads(line) for line in (tmp_path / "mla_decode.jsonl").read_text().splitlines()]
    assert rows and all(r.get("error") is None for r in rows), rows
    fields = {"gpu", "date", "commit", "b", "h", "s_q", "s_k", "kv_dtype", "backend", "ms", "tbps", "tflops"}
    assert fields | {"graph_ms"} <= set(rows[0])


@pytest.mark.parametrize("tma", [False, True])
def test_tune_smoke(tmp_path, tma):
    import json
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "scripts"))
    try:
        import tune_mla_decode
    finally:
        sys.path.pop(0)
    committed = dict(decode.SCHEDULES), decode.MIN_WAVES
    tune_mla_decode.main(["--smoke", "--out", str(tmp_path), *(["--tma"] if tma else [])])
    rows = [json.loads(line) for line in (tmp_path / "tune_mla_decode.jsonl").read_text().splitlines()]
    assert rows and all(r["error"] is None and r["ms"] > 0 for r in rows), rows
    assert {r["min_waves"] for r in rows} == {1, 2, 4, 8}
    # the sweep times the committed schedule too, and leaves the module as it found it
    assert [*tune_mla_decode.DEFAULTS[tuple(rows[0]["key"])]] in [r["schedule"] for r in rows]
    assert any(decode.Schedule(*r["schedule"]).tma == tma for r in rows)  # TMA candidates exactly with --tma
    assert {decode.Schedule(*r["schedule"]).d_split for r in rows} == set(decode.D_SPLITS)
    assert (dict(decode.SCHEDULES), decode.MIN_WAVES) == committed


def test_tune_cases_are_checked():
    import argparse
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "scripts"))
    try:
        import tune_mla_decode
    finally:
        sys.path.pop(0)
    assert tune_mla_decode.parse_case("128,16,4,8192,fp8") == (128, 16, 4, 8192, "fp8")
    for bad in ("128,16", "128,16,1,8192,int8", "128,0,1,8192,bf16", "a,16,1,8192,bf16"):
        with pytest.raises(argparse.ArgumentTypeError, match="b,h,s_q,s_k,kv"):
            tune_mla_decode.parse_case(bad)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_gpu_real_shape_fp32_fp16_fit(nan_empty, dtype):
    """fp32 and fp16 at the real latent width: their tiles must fit the GPU's shared memory too."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    args, _ = make_case([700, 1, 257], [2, 2, 2], 128, page_size=64, kv_lora=512, rope=64, dtype=dtype, seed=2)
    out, lse = mla_decode_triton(**args)
    want_out, want_lse = mla_decode_ref(**args)
    assert_rel_close("out", out, want_out.float(), TOL[dtype])
    assert_rel_close("lse", lse, want_lse, 1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("tma", [False, True])
@pytest.mark.parametrize("kv", [torch.bfloat16, FP8])
@pytest.mark.parametrize(("H", "s_q"), [(16, 1), (16, 4), (32, 1), (96, 1), (96, 4), (128, 1), (128, 4)])
def test_gpu_bf16_real_shape(nan_empty, monkeypatch, tma, kv, H, s_q):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    monkeypatch.setattr(decode, "TMA_MIN_WORK", 0)  # these launches are small: TMA by the schedule alone
    for key, sched in decode.SCHEDULES.items():  # TMA tiles must lie inside the 64-key pages
        monkeypatch.setitem(decode.SCHEDULES, key, sched._replace(block_n=min(sched.block_n, 64), tma=tma))
    gen = torch.Generator().manual_seed(H + s_q)
    lens = (torch.randint(3000, 5000, (6,), generator=gen)).tolist() + [1, s_q]
    args, _ = make_case(lens, [s_q] * len(lens), H, page_size=64, kv_lora=512, rope=64, dtype=torch.bfloat16,
                        kv_dtype=kv, seed=H * s_q)  # fmt: skip
    args["scale"] = 192**-0.5
    out, lse = mla_decode_triton(**args)
    want_out, want_lse = mla_decode_ref(**args)
    assert_rel_close("out", out, want_out.float(), TOL[torch.bfloat16])
    assert_rel_close("lse", lse, want_lse, 1e-3)
    split_out, split_lse = mla_decode_triton(**args, num_kv_splits=7)
    assert_rel_close("split out", split_out, want_out.float(), TOL[torch.bfloat16])
    assert_rel_close("split lse", split_lse, want_lse, 1e-3)


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
    import json
    import subprocess
    import sys

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
    scripts = os.path.join(os.path.dirname(__file__), "..", "..", "scripts")
    env = dict(os.environ, TRITON_INTERPRET="0", PYTHONPATH=os.pathsep.join([scripts, *sys.path]))
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    for (block_n, stages, _), shared in zip(tiles, json.loads(run.stdout.strip().splitlines()[-1]), strict=True):
        estimate = decode._wgmma_smem(64, block_n, stages, 576)
        assert estimate <= shared <= estimate + 2048, (block_n, stages, shared)
        assert (estimate <= decode._WGMMA_SMEM) == (shared <= 227 * 1024), (block_n, stages, shared)
    assert decode._wgmma_smem(64, sched.block_n, sched.num_stages, 576) <= decode._WGMMA_SMEM


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("dtype", "page_size", "H", "s_q", "bounds", "tiles"),
    [
        (torch.bfloat16, 64, 128, 1, False, None),
        (torch.bfloat16, 64, 16, 4, True, None),
        (torch.bfloat16, 128, 32, 2, True, None),
        (torch.float16, 128, 64, 1, False, None),
        (torch.bfloat16, 64, 96, 4, False, None),
        (torch.bfloat16, 64, 128, 1, True, (32, 3)),
        (torch.float16, 128, 16, 4, False, (32, 4)),
    ],
)
def test_gpu_wgmma_kernel(nan_empty, monkeypatch, dtype, page_size, H, s_q, bounds, tiles):
    """The Gluon warpgroup-MMA kernel (64 tile rows on sm_90) against the reference: partial first and last tiles
    (sequences of 1 to 65 keys and past a page), per-token bounds including zeros, split-KV, one split with the
    sequences taken longest first (two of equal length), a NaN-poisoned cache; the committed schedule, or (keys a
    tile, buffers) = tiles."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("needs an sm_90 GPU")
    monkeypatch.setattr(decode, "TMA_MIN_WORK", 0)  # a small launch: the schedule alone picks the kernel
    sched = decode.SCHEDULES[(2, 64)]._replace(wgmma=True)
    if tiles is not None:
        sched = sched._replace(block_n=tiles[0], num_stages=tiles[1])
    monkeypatch.setitem(decode.SCHEDULES, (2, 64), sched)
    chosen = []
    wgmma_ok = decode._wgmma_ok
    monkeypatch.setattr(decode, "_wgmma_ok", lambda *a: chosen.append(wgmma_ok(*a)) or chosen[-1])
    lens = [max(s_q, n) for n in (1, 63, 64, 65, 130, 700, 3001, 64)]  # a tie: longest first keeps index order
    args, _ = make_case(lens, [s_q] * len(lens), H, page_size=page_size, kv_lora=512, rope=64, dtype=dtype,
                        seed=H + s_q)  # fmt: skip
    args["scale"] = 192**-0.5
    if bounds:
        gen = torch.Generator().manual_seed(s_q)
        limit = torch.tensor(lens).repeat_interleave(s_q) + 1
        args["kv_bounds"] = (torch.rand(len(limit), generator=gen) * limit).int().to(DEVICE)
        args["kv_bounds"][::5] = 0
    want_out, want_lse = mla_decode_ref(**args)
    orders = []
    longest_first = decode._longest_first
    monkeypatch.setattr(decode, "_longest_first", lambda *a: orders.append(longest_first(*a)) or orders[-1])
    for splits in (None, 3, 1):
        if splits == 1:  # one split, more programs than "SMs": the programs take sequences longest first
            monkeypatch.setattr(decode, "num_sms", lambda *_: 1)
        out, lse = mla_decode_triton(**args, num_kv_splits=splits)
        assert_rel_close(f"out (splits {splits})", out, want_out.float(), TOL[dtype])
        assert_rel_close(f"lse (splits {splits})", lse, want_lse, 1e-3)
    assert chosen == [True, True, True]
    assert orders[1:] == [False, True]
