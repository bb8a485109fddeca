"""`mla_prefill(host_offsets=)`: the host's copies of the offsets replace every read of the device ones.

With them the Triton kernel checks the offsets on the host and builds its block map there (no device sync), and
the references read them instead of `.tolist()`-ing the device tensors. The results are the same.
"""

from __future__ import annotations

import pytest
import torch

from kimi_helix.kernels.mla import mla_prefill
from kimi_helix.kernels.mla.naive import mla_prefill_ref
from kimi_helix.kernels.mla.prefill import mla_prefill_triton

from ..conftest import assert_rel_close
from .conftest import INTERPRET, PAIRS, make_inputs

needs_triton = pytest.mark.skipif(
    not INTERPRET and not torch.cuda.is_available(), reason="Triton needs TRITON_INTERPRET=1 (CPU) or a GPU"
)


def _host(cu: torch.Tensor) -> torch.Tensor:
    return cu.cpu().clone()  # its own memory, also on the CPU


@needs_triton
def test_triton_host_offsets_match_device_offsets(nan_empty):
    q, k, v, cu_q, cu_k = make_inputs(PAIRS, 2, 48, 16, torch.float32)
    out, lse = mla_prefill_triton(q, k, v, cu_q, cu_k, 0.25, host_offsets=(_host(cu_q), _host(cu_k).tolist()))
    r_out, r_lse = mla_prefill_ref(q, k, v, cu_q, cu_k, 0.25)
    assert_rel_close("out", out, r_out, 1e-5)
    assert_rel_close("lse", lse, r_lse, 1e-5)


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


@pytest.mark.parametrize("backend", ["torch", "sdpa"])
def test_references_take_host_offsets(backend):
    q, k, v, cu_q, cu_k = make_inputs(PAIRS, 2, 32, 16, torch.float32, device="cpu")
    expected, _ = mla_prefill(q, k, v, cu_q, cu_k, 0.25, backend=backend)
    # device offsets that disagree are not read when the host's are given
    wrong = torch.zeros_like(cu_q)
    out, _ = mla_prefill(q, k, v, wrong, wrong, 0.25, host_offsets=(cu_q, cu_k.tolist()), backend=backend)
    torch.testing.assert_close(out, expected)
