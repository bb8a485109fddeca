"""MLA prefill: the Triton kernel against the torch reference, on the CPU interpreter or a GPU."""

from __future__ import annotations

import pytest
import torch

from kimi_helix.kernels.mla.naive import mla_prefill_ref
from kimi_helix.kernels.mla.prefill import mla_prefill_triton, tile_config

from ..conftest import TOL, assert_rel_close
from .conftest import INTERPRET, PAIRS, TRITON_DEVICE, make_inputs, prefix_sweep

needs_triton = pytest.mark.skipif(
    not INTERPRET and not torch.cuda.is_available(), reason="Triton needs TRITON_INTERPRET=1 (CPU) or a GPU"
)


def assert_matches_reference(got, inputs, scale, out_tol=1e-5):
    """(out, lse) of the kernel against `mla_prefill_ref(*inputs, scale)`: out to `out_tol`, lse to 1e-5."""
    r_out, r_lse = mla_prefill_ref(*inputs, scale)
    assert_rel_close("out", got[0], r_out, out_tol)
    assert_rel_close("lse", got[1], r_lse, 1e-5)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("H", [1, 3])
@pytest.mark.parametrize("dims", [(48, 16), (32, 48)], ids=["qk_split", "v_split"])
def test_prefill_triton_matches_reference(dtype, H, dims, nan_empty):
    q, k, v, cu_q, cu_k = make_inputs(PAIRS, H, *dims, dtype, seed=H)
    out, lse = mla_prefill_triton(q, k, v, cu_q, cu_k, 0.25)
    assert out.dtype == dtype and lse.dtype == torch.float32
    assert_matches_reference((out, lse), (q, k, v, cu_q, cu_k), 0.25, TOL[dtype])


@needs_triton
def test_triton_kimi_dims(nan_empty):
    """Dqk 192 = 128 + 64, Dv 128, with a cached prefix; Kimi's scale is (128 + 64) ** -0.5."""
    pairs = [(3, 20), (18, 18)]
    q, k, v, cu_q, cu_k = make_inputs(pairs, 2, 192, 128, torch.float32)
    got = mla_prefill_triton(q, k, v, cu_q, cu_k, 192**-0.5)
    assert_matches_reference(got, (q, k, v, cu_q, cu_k), 192**-0.5)


@needs_triton
@pytest.mark.parametrize("tq", [1, 7, 33])
def test_triton_every_prefix_remainder(tq, nan_empty):
    """Small head dims keep the interpreter fast; the tile is the one this device's launch uses."""
    block_n = tile_config(torch.float32, 32, 16)[1]
    pairs = prefix_sweep(block_n, tq)
    q, k, v, cu_q, cu_k = make_inputs(pairs, 1, 32, 16, torch.float32, seed=tq)
    got = mla_prefill_triton(q, k, v, cu_q, cu_k, 0.25)
    assert_matches_reference(got, (q, k, v, cu_q, cu_k), 0.25)


@needs_triton
def test_triton_strided_inputs():
    """Token/head strides are free (views of wider or head-major buffers); a non-unit last stride is copied."""
    q, k, v, cu_q, cu_k = make_inputs(PAIRS, 3, 48, 16, torch.float32)
    q_wide = torch.cat([q, torch.randn_like(q)], dim=-1)[..., :48]  # token and head strides of a 96-wide buffer
    k_head_major = k.transpose(0, 1).contiguous().transpose(0, 1)
    v_cols = v.transpose(-1, -2).contiguous().transpose(-1, -2)  # last-dim stride != 1
    got = mla_prefill_triton(q_wide, k_head_major, v_cols, cu_q, cu_k, 0.25)
    assert_matches_reference(got, (q, k, v, cu_q, cu_k), 0.25)


@needs_triton
def test_triton_no_queries():
    """Sequences with keys but no new tokens: nothing to compute, empty outputs of the right shapes."""
    q, k, v, cu_q, cu_k = make_inputs([(0, 4), (0, 9)], 2, 32, 16, torch.float32)
    out, lse = mla_prefill_triton(q, k, v, cu_q, cu_k, 0.25)
    assert out.shape == (0, 2, 16) and lse.shape == (0, 2)


@needs_triton
@pytest.mark.parametrize(
    ("change", "match"),
    [
        (lambda a: {**a, "q": a["q"][..., :24], "k": a["k"][..., :24]}, "Dqk=24"),
        (lambda a: {**a, "v": torch.randn(a["v"].shape[0], 3, 24, device=TRITON_DEVICE)}, "Dv=24"),
        (lambda a: {**a, "k": a["k"].half()}, "k dtype"),
        (lambda a: {**a, "v": a["v"][:, :2]}, "v must have shape"),
        (lambda a: {**a, "cu_seqlens_q": a["cu_seqlens_q"].long()}, "cu_seqlens_q"),
        (lambda a: {**a, "cu_seqlens_k": a["cu_seqlens_k"][:-1]}, "cu_seqlens_k"),
        (lambda a: {**a, "cu_seqlens_k": a["cu_seqlens_k"] - 1}, "cu_seqlens_k must start at 0"),
        (lambda a: {**a, "cu_seqlens_q": a["cu_seqlens_q"][[0, 2, 1, 3, 4, 5]]}, "cu_seqlens_q must"),  # decreasing
        (lambda a: {**a, "q": a["q"][:-1]}, "cu_seqlens_q must start at 0"),
        (lambda a: {**a, "q": a["q"][:0]}, "cu_seqlens_q must start at 0"),
    ],
)
def test_triton_validation(change, match):
    q, k, v, cu_q, cu_k = make_inputs(PAIRS, 3, 48, 16, torch.float32)
    args = change({"q": q, "k": k, "v": v, "cu_seqlens_q": cu_q, "cu_seqlens_k": cu_k})
    with pytest.raises(ValueError, match=match):
        mla_prefill_triton(**args, scale=0.25)


@needs_triton
def test_triton_rejects_bad_scale():
    q, k, v, cu_q, cu_k = make_inputs(PAIRS, 1, 16, 16, torch.float32)
    with pytest.raises(ValueError, match="scale"):
        mla_prefill_triton(q, k, v, cu_q, cu_k, -0.25)


@needs_triton
def test_triton_rejects_more_queries_than_keys():
    q, k, v, _, _ = make_inputs([(3, 2)], 1, 16, 16, torch.float32)
    cu_q, cu_k = (torch.tensor([0, n], dtype=torch.int32, device=TRITON_DEVICE) for n in (3, 2))
    with pytest.raises(ValueError, match="more new tokens"):
        mla_prefill_triton(q, k, v, cu_q, cu_k, 0.25)


# mla_prefill(host_offsets=): the host's copies of the offsets replace every read of the device ones; the kernel
# checks them on the host and builds its block map there (no device sync), with the same results.
def _host(cu: torch.Tensor) -> torch.Tensor:
    return cu.cpu().clone()  # its own memory, also on the CPU


@needs_triton
def test_triton_host_offsets_match_device_offsets(nan_empty):
    q, k, v, cu_q, cu_k = make_inputs(PAIRS, 2, 48, 16, torch.float32)
    got = mla_prefill_triton(q, k, v, cu_q, cu_k, 0.25, host_offsets=(_host(cu_q), _host(cu_k).tolist()))
    assert_matches_reference(got, (q, k, v, cu_q, cu_k), 0.25)


@needs_triton
def test_triton_host_offsets_never_read_the_device_ones(monkeypatch):
    """The device offsets are only handed to the kernel: reading them back on the host fails the test."""
    q, k, v, cu_q, cu_k = make_inputs(PAIRS, 1, 32, 16, torch.float32)
    host = (_host(cu_q), _host(cu_k))
    expected, _ = mla_prefill_ref(q, k, v, cu_q, cu_k, 0.25)
    real_tolist = torch.Tensor.tolist

    def tolist(t):
        if t.data_ptr() in (cu_q.data_ptr(), cu_k.data_ptr()):
            raise AssertionError("device offsets read back")
        return real_tolist(t)

    monkeypatch.setattr(torch.Tensor, "tolist", tolist)
    out, _ = mla_prefill_triton(q, k, v, cu_q, cu_k, 0.25, host_offsets=host)
    monkeypatch.undo()
    assert_rel_close("out", out, expected, 1e-5)


@needs_triton
@pytest.mark.parametrize(
    ("host_k", "match"),
    [
        (lambda cu: cu[:-1], "host_offsets hold"),
        (lambda cu: cu - 1, "cu_seqlens_k must start at 0"),
        (lambda cu: torch.cat([cu[:1], cu[1:] * 0]), "cu_seqlens_k must"),
    ],
    ids=["length", "start", "decreasing"],
)
def test_triton_checks_the_host_offsets(host_k, match):
    q, k, v, cu_q, cu_k = make_inputs(PAIRS, 1, 16, 16, torch.float32)
    with pytest.raises(ValueError, match=match):
        mla_prefill_triton(q, k, v, cu_q, cu_k, 0.25, host_offsets=(_host(cu_q), host_k(_host(cu_k))))
