"""MLA: the kernels at real shapes and dtypes on the GPU (`pytest -m gpu`)."""

from __future__ import annotations

import pytest
import torch

from kimi_helix.kernels.mla import decode
from kimi_helix.kernels.mla.decode import mla_decode_triton
from kimi_helix.kernels.mla.naive import mla_decode_ref, mla_prefill_ref
from kimi_helix.kernels.mla.prefill import mla_prefill_triton, tile_config

from ..conftest import DEVICE, TOL, assert_rel_close
from .conftest import FP8, INTERPRET, assert_rel_close_inf, make_case, make_inputs, prefix_sweep


def _gpu():
    if not torch.cuda.is_available() or INTERPRET:
        pytest.skip("needs CUDA with the Triton compiler (run with TRITON_INTERPRET unset)")
    return "cuda"


# ~8k new tokens over prefixes: long prompt, chunked-prefill continuations, short turns, ragged tails.
GPU_PAIRS = [(3000, 3000), (2048, 4096), (1500, 1700), (777, 5000), (1, 1), (0, 300), (130, 130), (600, 900)]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_gpu_real_shape_fp32_fp16_fit(nan_empty, dtype):
    """fp32 and fp16 at the real latent width: their tiles must fit the GPU's shared memory too."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    args, _ = make_case([700, 1, 257], [2, 2, 2], 128, page_size=64, kv_lora=512, rope=64, dtype=dtype, seed=2)
    out, lse = mla_decode_triton(**args)
    want_out, want_lse = mla_decode_ref(**args)
    assert_rel_close_inf("out", out, want_out.float(), TOL[dtype])
    assert_rel_close_inf("lse", lse, want_lse, 1e-4)


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
    assert_rel_close_inf("out", out, want_out.float(), TOL[torch.bfloat16])
    assert_rel_close_inf("lse", lse, want_lse, 1e-3)
    split_out, split_lse = mla_decode_triton(**args, num_kv_splits=7)
    assert_rel_close_inf("split out", split_out, want_out.float(), TOL[torch.bfloat16])
    assert_rel_close_inf("split lse", split_lse, want_lse, 1e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("kv", [torch.bfloat16, FP8])
@pytest.mark.parametrize(("lens", "H"), [([4096], 32), ([4000, 1, 4100, 3900, 64, 4096, 2000, 4033], 32),
                                         ([32768], 16), ([4096], 96)])  # fmt: skip
def test_gpu_small_batch_many_splits(nan_empty, kv, lens, H):
    """Batch 1 and 8 at the kimi shapes take the small-launch splits (down to one 64-key tile a split, up to
    MAX_SMALL_SPLITS partials in the merge) and match the reference."""
    _gpu()
    args, _ = make_case(lens, [1] * len(lens), H, page_size=64, kv_lora=512, rope=64, dtype=torch.bfloat16,
                        kv_dtype=kv, seed=len(lens) + H)  # fmt: skip
    args["scale"] = 192**-0.5
    out, lse = mla_decode_triton(**args)
    want_out, want_lse = mla_decode_ref(**args)
    assert_rel_close_inf("out", out, want_out.float(), TOL[torch.bfloat16])
    assert_rel_close_inf("lse", lse, want_lse, 1e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("H", [16, 32])
def test_gpu_fp8_queries_beyond_fp16(nan_empty, H):
    """An fp8 cache computes with fp16 operands (decode_fp8.py): bf16 queries far beyond fp16's range (65504) are
    scaled per row first, and the result matches the reference."""
    _gpu()
    args, _ = make_case([3001, 64, 700], [1, 1, 1], H, page_size=64, kv_lora=512, rope=64, dtype=torch.bfloat16,
                        kv_dtype=FP8, seed=H)  # fmt: skip
    args["q"] = args["q"] * 1e5
    args["q"][:, 0] *= 1e-12  # and a head far below it
    args["scale"] = 192**-0.5 * 1e-5
    out, lse = mla_decode_triton(**args)
    want_out, want_lse = mla_decode_ref(**args)
    assert_rel_close_inf("out", out, want_out.float(), TOL[torch.bfloat16])
    assert_rel_close_inf("lse", lse, want_lse, 1e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("stages", [5, 8])
@pytest.mark.parametrize(("H", "s_q"), [(16, 1), (32, 1)])
def test_gpu_fp8_multi_buffered_tiles(nan_empty, monkeypatch, stages, H, s_q):
    """fp8 schedules at 5 and 8 pipeline stages (Triton then keeps 2 and 3 TMA buffers: the next tiles' copies
    overlap this tile's work) against the reference, with split-KV and without."""
    _gpu()
    monkeypatch.setattr(decode, "TMA_MIN_WORK", 0)
    for key in ((1, 16), (1, 32)):  # the Triton kernel's schedules, not the Gluon one's
        sched = decode.TRITON_FP8_SCHEDULES[key]._replace(num_stages=stages, tma=True)
        monkeypatch.setitem(decode.SCHEDULES, key, sched)
    lens = [3001, 1, 64, 65, 700, 4096]
    args, _ = make_case(lens, [s_q] * len(lens), H, page_size=64, kv_lora=512, rope=64, dtype=torch.bfloat16,
                        kv_dtype=FP8, seed=stages + H)  # fmt: skip
    args["scale"] = 192**-0.5
    want_out, want_lse = mla_decode_ref(**args)
    for splits in (None, 1):
        out, lse = mla_decode_triton(**args, num_kv_splits=splits)
        assert_rel_close_inf(f"out (splits {splits})", out, want_out.float(), TOL[torch.bfloat16])
        assert_rel_close_inf(f"lse (splits {splits})", lse, want_lse, 1e-3)


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
        assert_rel_close_inf(f"out (splits {splits})", out, want_out.float(), TOL[dtype])
        assert_rel_close_inf(f"lse (splits {splits})", lse, want_lse, 1e-3)
    assert chosen == [True, True, True]
    assert orders[1:] == [False, True]


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("H", "s_q", "page_size", "bounds", "dims", "q_dtype"),
    [
        (16, 1, 64, False, (512, 64), torch.bfloat16),
        (4, 4, 64, True, (512, 64), torch.bfloat16),  # verify: 4 heads x 4 tokens a tile
        (32, 1, 64, False, (512, 64), torch.bfloat16),  # 32 rows (a Triton schedule unless forced, as here)
        (8, 4, 128, False, (512, 64), torch.bfloat16),  # 32 rows of 8 heads x 4 tokens
        (16, 2, 16, True, (512, 64), torch.float16),  # pages smaller than a tile
        (8, 2, 32, False, (128, 32), torch.bfloat16),  # other latent and rope widths
    ],
)
def test_gpu_fp8_wgmma_kernel(nan_empty, monkeypatch, H, s_q, page_size, bounds, dims, q_dtype):
    """The fp8-cache Gluon swap-AB kernel (16 and 32 tile rows on sm_90) against the reference: sequences of 1 to
    4100 keys (partial first and last tiles, keys past a page), per-token bounds including zeros, split-KV, one
    split with the sequences taken longest first, key scales spread over 2^-3 .. 2^3, a NaN-poisoned cache."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("needs an sm_90 GPU")
    for key in ((1, 16), (1, 32)):
        monkeypatch.setitem(decode.SCHEDULES, key, decode.TRITON_FP8_SCHEDULES[key]._replace(wgmma=True))
    chosen = []
    fp8_ok = decode._fp8_wgmma_ok
    monkeypatch.setattr(decode, "_fp8_wgmma_ok", lambda *a: chosen.append(fp8_ok(*a)) or chosen[-1])
    lens = [max(s_q, n) for n in (1, 63, 64, 65, 130, 700, 4100, 64)]
    args, _ = make_case(lens, [s_q] * len(lens), H, page_size=page_size, kv_lora=dims[0], rope=dims[1],
                        dtype=q_dtype, kv_dtype=FP8, seed=H + s_q + page_size)  # fmt: skip
    args["scale"] = 192**-0.5
    gen = torch.Generator().manual_seed(s_q)
    args["kv_scale"] *= torch.exp2(torch.randint(-3, 4, args["kv_scale"].shape, generator=gen)).to(DEVICE)
    if bounds:
        limit = torch.tensor(lens).repeat_interleave(s_q) + 1
        args["kv_bounds"] = (torch.rand(len(limit), generator=gen) * limit).int().to(DEVICE)
        args["kv_bounds"][::5] = 0
    want_out, want_lse = mla_decode_ref(**args)
    for splits in (None, 3, 1):
        if splits == 1:  # one split, more programs than "SMs": the programs take sequences longest first
            monkeypatch.setattr(decode, "num_sms", lambda *_: 1)
        out, lse = mla_decode_triton(**args, num_kv_splits=splits)
        assert_rel_close_inf(f"out (splits {splits})", out, want_out.float(), TOL[torch.bfloat16])
        assert_rel_close_inf(f"lse (splits {splits})", lse, want_lse, 1e-3)
    assert chosen == [True, True, True]


@pytest.mark.gpu
@pytest.mark.parametrize("params", [(2, 1, 232), (2, 2, 128), (2, 2, 128, 2)])
@pytest.mark.parametrize(
    "H, s_q, page_size, bounds, dims, q_dtype",
    [
        (16, 1, 64, False, (512, 64), torch.bfloat16),
        (4, 4, 64, True, (512, 64), torch.bfloat16),
        (16, 2, 16, True, (512, 64), torch.float16),  # pages smaller than a tile: keys looked up one by one
        (8, 2, 32, False, (128, 32), torch.bfloat16),
    ],
)
def test_gpu_fp8_wgmma_dequant_variants(nan_empty, monkeypatch, params, H, s_q, page_size, bounds, dims, q_dtype):
    """`test_gpu_fp8_wgmma_kernel` at the dequant sides scripts/tune_mla_fp8_wgmma.py times besides the committed
    one (`decode.Fp8WgmmaParams`: two raw tiles in flight, in one dequant warpgroup or two, with and without L2
    prefetches further ahead)."""
    monkeypatch.setattr(decode, "FP8_WGMMA", decode.Fp8WgmmaParams(*params))
    test_gpu_fp8_wgmma_kernel(nan_empty, monkeypatch, H, s_q, page_size, bounds, dims, q_dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("H", [16, 32])
def test_gpu_fp8_wgmma_queries_beyond_fp16(nan_empty, monkeypatch, H):
    """The Gluon fp8 kernel scales q per row into fp16's range as the Triton one does: bf16 queries far beyond
    65504, and a head far below it, match the reference."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("needs an sm_90 GPU")
    for key in ((1, 16), (1, 32)):
        monkeypatch.setitem(decode.SCHEDULES, key, decode.TRITON_FP8_SCHEDULES[key]._replace(wgmma=True))
    args, _ = make_case([3001, 64, 700], [1, 1, 1], H, page_size=64, kv_lora=512, rope=64, dtype=torch.bfloat16,
                        kv_dtype=FP8, seed=H)  # fmt: skip
    args["q"] = args["q"] * 1e5
    args["q"][:, 0] *= 1e-12
    args["scale"] = 192**-0.5 * 1e-5
    out, lse = mla_decode_triton(**args)
    want_out, want_lse = mla_decode_ref(**args)
    assert_rel_close_inf("out", out, want_out.float(), TOL[torch.bfloat16])
    assert_rel_close_inf("lse", lse, want_lse, 1e-3)


@pytest.mark.gpu
def test_gpu_fp8_wgmma_extreme_key_scales(nan_empty, monkeypatch):
    """Per-token scales from 1e-23 to 1, and zeros, through the Gluon fp8 kernel: its P @ c weights are normalised
    by their own running max as the Triton kernel's are (`decode_fp8.attend_tile_fp8`)."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("needs an sm_90 GPU")
    monkeypatch.setitem(decode.SCHEDULES, (1, 16), decode.TRITON_FP8_SCHEDULES[(1, 16)]._replace(wgmma=True))
    args, _ = make_case([1500, 400, 1], [1, 1, 1], 16, page_size=64, kv_lora=512, rope=64, dtype=torch.bfloat16,
                        kv_dtype=FP8, seed=5)  # fmt: skip
    gen = torch.Generator().manual_seed(5)
    scale = args["kv_scale"].cpu()
    exponents = torch.randint(-20, 3, scale.shape, generator=gen).double()
    scale = torch.where(torch.isnan(scale), scale, (10.0**exponents).float() * 1e-3)
    scale[torch.rand(scale.shape, generator=gen) < 0.1] = 0.0
    args["kv_scale"] = scale.to(DEVICE)
    args["q"] = args["q"] * 1e-3
    args["scale"] = 192**-0.5
    want_out, want_lse = mla_decode_ref(**args)
    for splits in (1, 4):
        out, lse = mla_decode_triton(**args, num_kv_splits=splits)
        assert_rel_close_inf(f"out (splits {splits})", out, want_out.float(), TOL[torch.bfloat16])
        assert_rel_close_inf(f"lse (splits {splits})", lse, want_lse, 1e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_gpu_kimi_dims(dtype):
    device = _gpu()
    q, k, v, cu_q, cu_k = make_inputs(GPU_PAIRS, 32, 192, 128, dtype, device=device)
    out, lse = mla_prefill_triton(q, k, v, cu_q, cu_k, 192**-0.5)
    r_out, r_lse = mla_prefill_ref(q, k, v, cu_q, cu_k, 192**-0.5)
    assert out.dtype == dtype
    assert_rel_close("out", out, r_out, TOL[dtype])
    assert_rel_close("lse", lse, r_lse, 1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("dims", [(48, 16), (32, 48), (64, 64), (576, 512)])
def test_gpu_other_dims(dims):
    device = _gpu()
    q, k, v, cu_q, cu_k = make_inputs([(70, 200), (129, 129), (0, 5), (1, 64)], 4, *dims, torch.bfloat16, device=device)
    out, lse = mla_prefill_triton(q, k, v, cu_q, cu_k, 0.1)
    r_out, r_lse = mla_prefill_ref(q, k, v, cu_q, cu_k, 0.1)
    assert_rel_close("out", out, r_out, TOL[torch.bfloat16])
    assert_rel_close("lse", lse, r_lse, 1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("tq", [1, 37, 130])
def test_gpu_every_prefix_remainder(tq):
    """The compiled kernel's own key block at Kimi's dims (bf16: BLOCK_N 64), every cached prefix 0 .. 2 * BLOCK_N."""
    device = _gpu()
    block_n = tile_config(torch.bfloat16, 192, 128)[1]
    q, k, v, cu_q, cu_k = make_inputs(prefix_sweep(block_n, tq), 4, 192, 128, torch.bfloat16, seed=tq, device=device)
    out, lse = mla_prefill_triton(q, k, v, cu_q, cu_k, 192**-0.5)
    r_out, r_lse = mla_prefill_ref(q, k, v, cu_q, cu_k, 192**-0.5)
    assert_rel_close("out", out, r_out, TOL[torch.bfloat16])
    assert_rel_close("lse", lse, r_lse, 1e-5)


@pytest.mark.gpu
def test_gpu_offsets_past_int32():
    """k and v beyond 2^31 elements: the kernel's row offsets must be 64-bit."""
    device = _gpu()
    H, tk, tq = 128, 90_000, 64  # k has 90000 * 128 * 192 = 2.2e9 elements
    gen = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(tq, H, 192, generator=gen, device=device, dtype=torch.bfloat16)
    k = torch.randn(tk, H, 192, generator=gen, device=device, dtype=torch.bfloat16)
    v = torch.randn(tk, H, 128, generator=gen, device=device, dtype=torch.bfloat16)
    cu_q = torch.tensor([0, tq], dtype=torch.int32, device=device)
    cu_k = torch.tensor([0, tk], dtype=torch.int32, device=device)
    out, lse = mla_prefill_triton(q, k, v, cu_q, cu_k, 192**-0.5)
    r_out, r_lse = mla_prefill_ref(q, k, v, cu_q, cu_k, 192**-0.5)
    assert_rel_close("out", out, r_out, TOL[torch.bfloat16])
    assert_rel_close("lse", lse, r_lse, 1e-5)
