"""KDA: the kernels at real shapes and dtypes on the GPU (`pytest -m gpu`)."""

from __future__ import annotations

import pytest
import torch

from kimi_helix.kernels.kda import kda_gate, naive_chunk_kda, naive_recurrent_kda
from kimi_helix.kernels.kda.chunk import chunk_kda_triton
from kimi_helix.kernels.kda.fused_recurrent import fused_recurrent_kda_triton

from ..conftest import DEVICE, TOL, assert_rel_close, cu_seqlens
from .conftest import make_recurrent_inputs

pytestmark = pytest.mark.usefixtures("nan_empty")


def _real_inputs(T, seed, lower_bound=None, n_states=1):
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=gen, device="cuda")

    Hr, D = 32, 128
    q, k, v, f = rnd(1, T, Hr, D), rnd(1, T, Hr, D), rnd(1, T, Hr, D), rnd(1, T, Hr, D)
    A_log, dt_bias = rnd(Hr) * 0.5, rnd(Hr * D) * 0.5 - 1.0
    beta = torch.sigmoid(rnd(1, T, Hr))
    s0 = rnd(n_states, Hr, D, D) * 0.1
    bf = [t.bfloat16() for t in (q, k, v, f, beta)]
    return bf, A_log, dt_bias, s0, kda_gate(bf[3], A_log, dt_bias, lower_bound)


@pytest.mark.gpu
@pytest.mark.parametrize("gate_in_kernel, lower_bound", [(False, None), (True, None), (True, -5.0)])
@pytest.mark.usefixtures("intra_path")
def test_gpu_bf16_real_shapes(gate_in_kernel, lower_bound):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    (q, k, v, f, beta), A_log, dt_bias, s0, g = _real_inputs(2048, seed=1, lower_bound=lower_bound)
    kw = dict(initial_state=s0, output_final_state=True, use_qk_l2norm_in_kernel=True)
    if gate_in_kernel:
        o, s = chunk_kda_triton(q, k, v, f, beta, A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound, **kw)
    else:
        o, s = chunk_kda_triton(q, k, v, g, beta, **kw)
    o_r, s_r = naive_chunk_kda(q.float(), k.float(), v.float(), g, beta.float(), **kw)
    assert o.dtype == torch.bfloat16
    assert_rel_close("o", o, o_r, TOL[torch.bfloat16])
    assert_rel_close("final_state", s, s_r, TOL[torch.bfloat16])


@pytest.mark.gpu
@pytest.mark.usefixtures("intra_path")
def test_gpu_bf16_strided_beta_logits():
    """The prefill as the KDA layer runs it: beta's bf16 logits a column slice of the projections (token stride
    3H), read in place with the sigmoid in the intra and WY kernels, the gate in the kernel, varlen."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    lens = [1000, 1, 64, 983]
    (q, k, v, f, _), A_log, dt_bias, s0, g = _real_inputs(sum(lens), seed=4)
    Hr = q.shape[2]
    gen = torch.Generator(device="cuda").manual_seed(5)
    wide = (torch.randn(1, sum(lens), 3 * Hr, generator=gen, device="cuda") * 3.0).bfloat16()
    logits = wide[..., Hr : 2 * Hr]
    cu = cu_seqlens(lens)
    kw = dict(initial_state=s0.expand(len(lens), -1, -1, -1).contiguous(), output_final_state=True,
              use_qk_l2norm_in_kernel=True, cu_seqlens=cu)  # fmt: skip
    o, s = chunk_kda_triton(q, k, v, f, logits, A_log=A_log, dt_bias=dt_bias, use_beta_sigmoid_in_kernel=True, **kw)
    beta = torch.sigmoid(logits.float())
    o_r, s_r = naive_chunk_kda(q.float(), k.float(), v.float(), g, beta, **kw)
    assert_rel_close("o", o, o_r, TOL[torch.bfloat16])
    assert_rel_close("final_state", s, s_r, TOL[torch.bfloat16])


@pytest.mark.gpu
@pytest.mark.usefixtures("intra_path")
def test_gpu_bf16_varlen_pool():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    lens = [1000, 1, 64, 0, 983]
    (q, k, v, _, beta), _, _, pool, g = _real_inputs(sum(lens), seed=2, n_states=8)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    slots = torch.tensor([6, 1, 4, 0, 2], device="cuda")
    before = pool.clone()
    o, _ = chunk_kda_triton(q, k, v, g, beta, initial_state=pool, state_indices=slots, output_final_state=True,
                     use_qk_l2norm_in_kernel=True, cu_seqlens=cu)  # fmt: skip
    o_r, s_r = naive_chunk_kda(q.float(), k.float(), v.float(), g, beta.float(), initial_state=before[slots],
                               output_final_state=True, use_qk_l2norm_in_kernel=True, cu_seqlens=cu)  # fmt: skip
    assert_rel_close("o", o, o_r, TOL[torch.bfloat16])
    assert_rel_close("pool slots", pool[slots], s_r, TOL[torch.bfloat16])
    assert torch.equal(pool[[3, 5, 7]], before[[3, 5, 7]])


@pytest.mark.gpu
@pytest.mark.usefixtures("intra_path")
def test_chunk_gpu_parity_with_fla():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    fla_kda = pytest.importorskip("fla.ops.kda")
    (q, k, v, _, beta), _, _, s0, g = _real_inputs(2048, seed=3)
    kw = dict(initial_state=s0, output_final_state=True, use_qk_l2norm_in_kernel=True)
    o, s = chunk_kda_triton(q, k, v, g, beta, **kw)
    o_f, s_f = fla_kda.chunk_kda(q, k, v, g, beta, **kw)
    assert_rel_close("o vs fla", o, o_f, TOL[torch.bfloat16])
    assert_rel_close("final_state vs fla", s, s_f.float(), TOL[torch.bfloat16])


@pytest.mark.gpu
@pytest.mark.parametrize("lower_bound", [None, -5.0], ids=["softplus", "bounded"])
def test_gpu_bf16_decode_and_verify(lower_bound):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    Hr, Kr = 32, 128
    N, slots = 64, 96
    # decode: one token per sequence, pool in place, gate computed in the kernel
    q, k, v, f, beta, pool, A_log, dt_bias = make_recurrent_inputs(
        N, 1, seed=10, dtype=torch.bfloat16, h=Hr, k=Kr, v=Kr, n_states=slots, raw_gate=True
    )
    idx = torch.randperm(slots, device=DEVICE)[:N]
    before = pool.clone()
    kw = dict(use_qk_l2norm_in_kernel=True)
    o, _ = fused_recurrent_kda_triton(
        q, k, v, f, beta, initial_state=pool, state_indices=idx, output_final_state=True,
        A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound, **kw,
    )  # fmt: skip
    g = kda_gate(f, A_log, dt_bias, lower_bound)
    o_ref, s_ref = naive_recurrent_kda(q, k, v, g, beta, initial_state=before[idx], output_final_state=True, **kw)
    assert_rel_close("decode o", o, o_ref, TOL[torch.bfloat16])
    assert_rel_close("decode state", pool[idx], s_ref, 1e-4)
    rest = torch.ones(slots, dtype=torch.bool, device=DEVICE)
    rest[idx] = False
    assert torch.equal(pool[rest], before[rest])
    # verify: k + 1 = 4 tokens per sequence, varlen, every intermediate state
    lens = [4] * 16
    q, k, v, g, beta, s0, _, _ = make_recurrent_inputs(
        1, 64, seed=11, dtype=torch.bfloat16, h=Hr, k=Kr, v=Kr, n_states=16
    )
    kw = dict(initial_state=s0, use_qk_l2norm_in_kernel=True, cu_seqlens=cu_seqlens(lens))
    o, states = fused_recurrent_kda_triton(q, k, v, g, beta, return_intermediate_states=True, **kw)
    o_ref, states_ref = naive_recurrent_kda(q, k, v, g, beta, return_intermediate_states=True, **kw)
    assert_rel_close("verify o", o, o_ref, TOL[torch.bfloat16])
    assert_rel_close("verify states", states, states_ref, 1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("lower_bound", [None, -5.0], ids=["softplus", "bounded"])
def test_recurrent_gpu_parity_with_fla(lower_bound):
    """Against fla's fused_recurrent_kda (test extra): 64 sequences of 4 tokens, gate computed in both kernels."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    fla_kda = pytest.importorskip("fla.ops.kda")
    Hr, Kr = 32, 128
    q, k, v, f, beta, s0, A_log, dt_bias = make_recurrent_inputs(
        64, 4, seed=12, dtype=torch.bfloat16, h=Hr, k=Kr, v=Kr, raw_gate=True
    )
    gate = dict(A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound)
    kw = dict(output_final_state=True, use_qk_l2norm_in_kernel=True)
    o, s = fused_recurrent_kda_triton(q, k, v, f, beta, initial_state=s0.clone(), **gate, **kw)
    # fla may update initial_state in place: hand it a copy
    o_f, s_f = fla_kda.fused_recurrent_kda(
        q, k, v, f, beta, initial_state=s0.clone(), use_gate_in_kernel=True, **gate, **kw
    )
    assert_rel_close("o vs fla", o, o_f, TOL[torch.bfloat16])
    assert_rel_close("final_state vs fla", s, s_f.float(), TOL[torch.bfloat16])


@pytest.mark.gpu
def test_gpu_verify_beta_logits_into_buffer():
    """A verify step as the model records it: beta's bf16 logits (sigmoid in the kernel), every per-token state
    written into a caller's NaN-filled buffer."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    Hr, Kr, lens = 32, 128, [4] * 16
    q, k, v, f, _, pool, A_log, dt_bias = make_recurrent_inputs(
        1, 64, seed=13, dtype=torch.bfloat16, h=Hr, k=Kr, v=Kr, n_states=20, raw_gate=True
    )
    logits = (torch.randn(1, 64, Hr, device=DEVICE) * 3.0).bfloat16()
    slots = torch.randperm(20, device=DEVICE)[:16]
    before = pool.clone()
    buf = torch.full((64, Hr, Kr, Kr), float("nan"), device=DEVICE)
    kw = dict(use_qk_l2norm_in_kernel=True, cu_seqlens=cu_seqlens(lens), A_log=A_log, dt_bias=dt_bias)
    o, states = fused_recurrent_kda_triton(
        q, k, v, f, logits, initial_state=pool, state_indices=slots, output_final_state=True,
        return_intermediate_states=True, intermediate_states=buf, use_beta_sigmoid_in_kernel=True, **kw,
    )  # fmt: skip
    o_ref, states_ref = naive_recurrent_kda(
        q, k, v, f, torch.sigmoid(logits.float()), initial_state=before[slots], return_intermediate_states=True, **kw
    )
    assert states is buf
    assert_rel_close("verify o", o, o_ref, TOL[torch.bfloat16])
    assert_rel_close("verify states", buf, states_ref, 1e-4)
    assert_rel_close("pool slots", pool[slots], states_ref[3::4], 1e-4)
