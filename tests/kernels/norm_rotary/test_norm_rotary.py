"""Per-head RMSNorm then RoPE: the Triton kernel against `norm_rotary_ref` (outputs and untouched cache rows poisoned
with NaN), and the reference against the unfused path it replaces and against RoPE written as a complex rotation
in fp64."""

from __future__ import annotations

import pytest
import torch

from kimi_helix.kernels.norm.naive import add_rms_norm_ref
from kimi_helix.kernels.norm_rotary import norm_rotary_into_cache_ref, norm_rotary_ref
from kimi_helix.kernels.norm_rotary.triton import norm_rotary_into_cache_triton, norm_rotary_triton
from kimi_helix.kernels.rotary.naive import rotary_ref

from ..conftest import DEVICE, TOL, assert_rel_close, rnd

DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])  # bf16: the GPU only
EPS, THETA = 1e-5, 10000.0
pytestmark = pytest.mark.usefixtures("nan_empty")


def _packed_qkv(t: int, h: int, d: int, seed: int, dtype) -> torch.Tensor:
    """A [T, 3 * H * D] projection whose q and k heads the drafter reads in place ([T, 2H, D] at row stride 3HD)."""
    return rnd(t, 3 * h * d, seed=seed, dtype=dtype) * 3


def _positions(t: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 4000, (t,), generator=torch.Generator().manual_seed(seed)).to(DEVICE)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("t,h,d", [(1, 4, 64), (7, 4, 64), (5, 3, 32), (9, 2, 128)], ids=str)
@pytest.mark.parametrize("two_weights", [False, True], ids=["one_weight", "q_and_k"])
def test_triton_matches_reference(dtype, t, h, d, two_weights):
    y = _packed_qkv(t, h, d, seed=t + h + d, dtype=dtype)
    x = y[:, : 2 * h * d].view(t, 2 * h, d) if two_weights else y[:, h * d : 2 * h * d].view(t, h, d)
    weights = (rnd(d, seed=1, dtype=dtype), rnd(d, seed=2, dtype=dtype)) if two_weights else rnd(d, seed=3, dtype=dtype)
    pos = _positions(t, seed=d)
    got, want = norm_rotary_triton(x, pos, weights, EPS, THETA), norm_rotary_ref(x, pos, weights, EPS, THETA)
    assert got.shape == want.shape == x.shape and got.dtype == dtype and got.is_contiguous()
    assert_rel_close("norm_rotary", got, want, TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_reference_is_the_unfused_path(dtype):
    """Each half of the heads: `RMSNorm` with its weight (rounded to the dtype), then `rotary_ref`, exactly."""
    t, h, d = 6, 4, 64
    qk = _packed_qkv(t, h, d, seed=4, dtype=dtype)[:, : 2 * h * d].view(t, 2 * h, d)
    wq, wk, pos = rnd(d, seed=5, dtype=dtype), rnd(d, seed=6, dtype=dtype), _positions(t, seed=7)
    out = norm_rotary_ref(qk, pos, (wq, wk), EPS, THETA)
    for half, w in ((slice(0, h), wq), (slice(h, 2 * h), wk)):
        assert torch.equal(out[:, half], rotary_ref(add_rms_norm_ref(qk[:, half], None, w, EPS)[0], pos, THETA))


def test_reference_against_a_complex_rotation():
    """RMSNorm and RoPE from their definitions in fp64: channel pairs (i, i + D/2) as one complex number, turned by
    pos * theta^(-2i/D)."""
    t, h, d = 5, 3, 32
    x, w, pos = rnd(t, h, d, seed=8), rnd(d, seed=9), _positions(t, seed=10)
    xd = x.double()
    normed = xd / (xd.pow(2).mean(-1, keepdim=True) + EPS).sqrt() * w.double()
    angle = pos.double()[:, None] * THETA ** (-torch.arange(0, d, 2, dtype=torch.float64, device=DEVICE) / d)
    turned = (
        torch.complex(normed[..., : d // 2], normed[..., d // 2 :])
        * torch.polar(torch.ones_like(angle), angle)[:, None]
    )
    want = torch.cat([turned.real, turned.imag], dim=-1)
    # the reference's angles are fp32 products (as the model's): at positions up to 4000 they carry ~1e-5 of error
    assert_rel_close("norm_rotary_ref", norm_rotary_ref(x, pos, w, EPS, THETA), want, 5e-5)


def _cache_case(dtype, seed: int):
    t, h, d, slots, capacity = 7, 4, 64, 3, 12
    y = _packed_qkv(t, h, d, seed=seed, dtype=dtype)
    k, v = y[:, h * d : 2 * h * d].view(t, h, d), y[:, 2 * h * d :].view(t, h, d)  # strided, as `_project_kv`'s
    where = torch.randperm(slots * capacity, generator=torch.Generator().manual_seed(seed))[:t].to(DEVICE)
    caches = [torch.full((slots, capacity, h, d), float("nan"), dtype=dtype, device=DEVICE) for _ in range(2)]
    return k, v, where % capacity, rnd(d, seed=seed + 1, dtype=dtype), caches, where // capacity


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_into_cache_triton_matches_reference(dtype):
    k, v, pos, w, caches, slots = _cache_case(dtype, seed=11)
    want = [c.clone() for c in caches]
    norm_rotary_into_cache_ref(k, v, pos, w, EPS, THETA, *want, slots)
    norm_rotary_into_cache_triton(k, v, pos, w, EPS, THETA, *caches, slots)
    for name, got, ref in zip(("k_cache", "v_cache"), caches, want):
        written = ~ref.isnan()
        assert torch.equal(~got.isnan(), written), f"{name}: rows written elsewhere or missing"
        assert_rel_close(name, got[written], ref[written], TOL[dtype])
    assert torch.equal(caches[1][slots, pos], v)  # values are copied unchanged


def test_into_cache_reference_writes_the_rows():
    k, v, pos, w, caches, slots = _cache_case(torch.float32, seed=12)
    norm_rotary_into_cache_ref(k, v, pos, w, EPS, THETA, *caches, slots)
    assert torch.equal(caches[0][slots, pos], norm_rotary_ref(k, pos, w, EPS, THETA))
    assert torch.equal(caches[1][slots, pos], v)
    assert int((~caches[0].isnan()).sum()) == k.numel()


@pytest.mark.parametrize("fn", [norm_rotary_ref, norm_rotary_triton], ids=["torch", "triton"])
def test_bad_arguments_name_the_field(fn):
    x, w, pos = rnd(3, 4, 16, seed=0), rnd(16, seed=1), _positions(3, seed=0)
    with pytest.raises(ValueError, match="x must be"):
        fn(x[..., :15], pos, w[:15], EPS, THETA)
    with pytest.raises(ValueError, match="weights must be 1..2 norm weights dividing H=4"):
        fn(x, pos, (w, w, w), EPS, THETA)
    with pytest.raises(ValueError, match=r"weights\[1\] must have x's dtype"):
        fn(x, pos, (w, w.half()), EPS, THETA)
    with pytest.raises(ValueError, match="positions must be an integer tensor"):
        fn(x, pos.float(), w, EPS, THETA)
    k, v, pos, w, caches, slots = _cache_case(torch.float32, seed=13)
    into = norm_rotary_into_cache_ref if fn is norm_rotary_ref else norm_rotary_into_cache_triton
    with pytest.raises(ValueError, match="v_cache must be"):
        into(k, v, pos, w, EPS, THETA, caches[0], caches[1][..., :32], slots)
    with pytest.raises(ValueError, match="slots must be"):
        into(k, v, pos, w, EPS, THETA, *caches, slots[:-1])
