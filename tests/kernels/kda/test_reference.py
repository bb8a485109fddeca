"""KDA: the torch references against independent oracles (dense softmax, transformers, loops)."""

from __future__ import annotations

import inspect

import pytest
import torch
from transformers import KimiLinearConfig
from transformers.models.kimi_linear import modeling_kimi_linear as hf

from kimi_helix.kernels.kda import kda_gate, l2norm, naive_chunk_kda, naive_recurrent_kda

from ..conftest import assert_rel_close
from .conftest import kda_prefill_then_decode

# The decorated HF functions dispatch to fla when it is installed; unwrap to always compare against their torch code.
hf_recurrent = inspect.unwrap(hf.recurrent_kimi_delta_attention)


hf_chunk = inspect.unwrap(hf.chunk_kimi_delta_attention)


H, K, V = 2, 16, 8  # K != V so a transposed state cannot pass


def make_reference_inputs(B, T, seed=0, dtype=torch.float32, normalize_k=False, state=False, n_states=None):
    """Random KDA inputs with realistic gates (via kda_gate); k pre-normalised when the kernel will not do it."""
    gen = torch.Generator().manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=gen)

    q, k, v = rnd(B, T, H, K), rnd(B, T, H, K), rnd(B, T, H, V)
    if normalize_k:  # an unnormalised key makes the delta rule expansive (|1 - beta k.k| > 1) and it blows up
        k = l2norm(k)
    A_log = torch.empty(1, 1, H, 1).uniform_(-0.7, 0.7, generator=gen)
    dt_bias = rnd(H * K) * 0.5 - 2.0
    g = kda_gate(rnd(B, T, H, K), A_log, dt_bias)
    beta = torch.sigmoid(rnd(B, T, H))
    s0 = rnd(n_states or B, H, K, V) * 0.3 if state else None
    return q.to(dtype), k.to(dtype), v.to(dtype), g, beta.to(dtype), s0


@pytest.mark.parametrize("T", [1, 63, 64, 65, 130])
@pytest.mark.parametrize("with_state", [False, True])
@pytest.mark.parametrize("qk_l2norm", [False, True])
def test_chunk_matches_recurrent(T, with_state, qk_l2norm):
    q, k, v, g, beta, s0 = make_reference_inputs(2, T, seed=T, normalize_k=not qk_l2norm, state=with_state)
    kw = dict(initial_state=s0, output_final_state=True, use_qk_l2norm_in_kernel=qk_l2norm)
    o_r, s_r = naive_recurrent_kda(q, k, v, g, beta, **kw)
    o_c, s_c = naive_chunk_kda(q, k, v, g, beta, **kw)
    assert o_c.dtype == q.dtype and s_c.dtype == torch.float32 and s_c.shape == (2, H, K, V)
    assert_rel_close("o", o_c, o_r, 1e-5)
    assert_rel_close("final_state", s_c, s_r, 1e-5)


def test_custom_scale_and_small_chunks():
    q, k, v, g, beta, s0 = make_reference_inputs(1, 23, seed=3, state=True)
    kw = dict(scale=0.37, initial_state=s0, output_final_state=True, use_qk_l2norm_in_kernel=True)
    o_r, s_r = naive_recurrent_kda(q, k, v, g, beta, **kw)
    o_c, s_c = naive_chunk_kda(q, k, v, g, beta, chunk_size=8, **kw)
    assert_rel_close("o", o_c, o_r, 1e-5)
    assert_rel_close("final_state", s_c, s_r, 1e-5)
    o_d, _ = naive_recurrent_kda(q, k, v, g, beta, **{**kw, "scale": None})
    assert_rel_close("scale", o_r * (K**-0.5 / 0.37), o_d, 1e-5)  # the output is linear in the scale


@pytest.mark.parametrize("fn", [naive_recurrent_kda, naive_chunk_kda], ids=["recurrent", "chunk"])
@pytest.mark.parametrize("with_state", [False, True])
def test_varlen_equals_separate(fn, with_state):
    lens = [5, 70, 1]
    q, k, v, g, beta, s0 = make_reference_inputs(1, sum(lens), seed=11, state=with_state, n_states=len(lens))
    cu = torch.tensor([0, 5, 75, 76], dtype=torch.int32)
    kw = dict(output_final_state=True, use_qk_l2norm_in_kernel=True)
    o, s = fn(q, k, v, g, beta, initial_state=s0, cu_seqlens=cu, **kw)
    assert s.shape == (len(lens), H, K, V)
    for n, (a, b) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True)):
        sl = slice(a, b)
        init = None if s0 is None else s0[n : n + 1]
        o_n, s_n = fn(q[:, sl], k[:, sl], v[:, sl], g[:, sl], beta[:, sl], initial_state=init, **kw)
        assert_rel_close(f"o[seq {n}]", o[:, sl], o_n, 1e-6)
        assert_rel_close(f"state[seq {n}]", s[n : n + 1], s_n, 1e-6)


def test_varlen_empty_sequence_keeps_state():
    q, k, v, g, beta, s0 = make_reference_inputs(1, 9, seed=5, state=True, n_states=3)
    cu = torch.tensor([0, 4, 4, 9], dtype=torch.int64)
    for fn in (naive_recurrent_kda, naive_chunk_kda):
        o, s = fn(q, k, v, g, beta, initial_state=s0, output_final_state=True, cu_seqlens=cu)
        assert o.shape == (1, 9, H, V)
        assert torch.equal(s[1], s0[1])


@pytest.mark.parametrize("T", [1, 65, 130])
def test_matches_transformers(T):
    q, k, v, g, beta, s0 = make_reference_inputs(2, T, seed=100 + T, state=True)
    kw = dict(initial_state=s0, output_final_state=True, use_qk_l2norm_in_kernel=True)
    o_hr, s_hr = hf_recurrent(q, k, v, g, beta, **kw)
    o_hc, s_hc = hf_chunk(q, k, v, g, beta, **kw)
    o_r, s_r = naive_recurrent_kda(q, k, v, g, beta, **kw)
    o_c, s_c = naive_chunk_kda(q, k, v, g, beta, **kw)
    assert_rel_close("recurrent o vs hf", o_r, o_hr, 1e-5)
    assert_rel_close("recurrent state vs hf", s_r, s_hr, 1e-5)
    assert_rel_close("chunk o vs hf chunk", o_c, o_hc, 1e-5)
    assert_rel_close("chunk state vs hf chunk", s_c, s_hc, 1e-5)


def test_fp16_inputs():
    q, k, v, g, beta, s0 = make_reference_inputs(2, 70, seed=7, dtype=torch.float16, state=True)
    kw = dict(initial_state=s0, output_final_state=True, use_qk_l2norm_in_kernel=True)
    o_h, s_h = hf_recurrent(q, k, v, g, beta, **kw)
    o_c, s_c = naive_chunk_kda(q, k, v, g, beta, **kw)
    o_r, s_r = naive_recurrent_kda(q, k, v, g, beta, **kw)
    assert o_c.dtype == o_r.dtype == torch.float16 and s_c.dtype == s_r.dtype == torch.float32
    assert_rel_close("fp16 chunk o", o_c, o_h, 2e-3)
    assert_rel_close("fp16 chunk state", s_c, s_h, 2e-3)
    assert_rel_close("fp16 recurrent o", o_r, o_h, 2e-3)
    # the fp16 result is the fp32 computation on the same (fp16-representable) values, rounded once
    o_32, _ = naive_chunk_kda(q.float(), k.float(), v.float(), g, beta.float(), **kw)
    assert_rel_close("fp16 vs fp32", o_c, o_32, 2e-3)


def test_strong_decay_stays_finite():
    q, k, v, g, beta, s0 = make_reference_inputs(1, 100, seed=9, state=True)
    g = g.clone()
    g[:, ::3, :, : K // 2] = -300.0  # cumulative decay far below exp's fp32 range
    kw = dict(initial_state=s0, output_final_state=True, use_qk_l2norm_in_kernel=True)
    o_r, s_r = naive_recurrent_kda(q, k, v, g, beta, **kw)
    o_c, s_c = naive_chunk_kda(q, k, v, g, beta, **kw)
    assert_rel_close("o", o_c, o_r, 1e-5)
    assert_rel_close("final_state", s_c, s_r, 1e-5)


@pytest.mark.parametrize("T", [6, 70])
def test_prefill_then_decode(T):
    q, k, v, g, beta, s0 = make_reference_inputs(2, T, seed=21, state=True)
    o, s, o_full, s_full = kda_prefill_then_decode(naive_recurrent_kda, q, k, v, g, beta, s0, prefill_len=T - 5)
    assert_rel_close("o", o, o_full, 1e-5)
    assert_rel_close("final_state", s, s_full, 1e-5)


@pytest.mark.parametrize("varlen", [False, True])
def test_intermediate_states(varlen):
    kw = dict(use_qk_l2norm_in_kernel=True)
    if varlen:
        q, k, v, g, beta, s0 = make_reference_inputs(1, 10, seed=31, state=True, n_states=2)
        cu = torch.tensor([0, 3, 10])
        # (state index, batch row, start, end, offset of the sequence in packed token order)
        seqs = [(0, 0, 0, 3, 0), (1, 0, 3, 10, 0)]
    else:
        q, k, v, g, beta, s0 = make_reference_inputs(2, 6, seed=32, state=True)
        cu = None
        seqs = [(0, 0, 0, 6, 0), (1, 1, 0, 6, 6)]  # plain batch: packed token index is b * T + t
    o, states = naive_recurrent_kda(
        q, k, v, g, beta, initial_state=s0, cu_seqlens=cu, return_intermediate_states=True, **kw
    )
    o_plain, s_final = naive_recurrent_kda(
        q, k, v, g, beta, initial_state=s0, cu_seqlens=cu, output_final_state=True, **kw
    )
    assert states.shape == (q.shape[0] * q.shape[1], H, K, V) and states.dtype == torch.float32
    assert torch.equal(o, o_plain)
    buf = torch.full_like(states, float("nan"))
    kw |= dict(initial_state=s0, cu_seqlens=cu, return_intermediate_states=True)
    _, into = naive_recurrent_kda(q, k, v, g, beta, intermediate_states=buf, **kw)
    assert into is buf and torch.equal(buf, states)
    for n, b, start, end, offset in seqs:
        assert_rel_close(f"last state[seq {n}]", states[offset + end - 1], s_final[n], 1e-6)
        for t in range(start, end):
            x = [a[b : b + 1, start : t + 1] for a in (q, k, v, g, beta)]
            _, s_t = naive_recurrent_kda(
                *x, initial_state=s0[n : n + 1], output_final_state=True, use_qk_l2norm_in_kernel=True
            )
            assert_rel_close(f"states[{offset + t}]", states[offset + t], s_t[0], 1e-6)


def test_gate_matches_transformers():
    cfg = KimiLinearConfig(
        hidden_size=32,
        num_hidden_layers=2,
        linear_attn_config={"head_dim": 8, "num_heads": 4, "kda_layers": [1], "full_attn_layers": [2]},
    )
    gate = hf.KimiLinearForgetGate(cfg)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in gate.parameters():
            p.copy_(torch.randn(p.shape, generator=gen))
        gate.dt_bias[:5] = 30.0  # exercise softplus' linear branch (threshold 20)
    h = torch.randn(2, 5, 32, generator=gen)
    with torch.no_grad():
        expected = gate(h)
        f = gate.f_b_proj(gate.f_a_proj(h)).view(2, 5, 4, 8)
        g = kda_gate(f, gate.A_log, gate.dt_bias)
    assert g.dtype == torch.float32 and g.shape == (2, 5, 4, 8)
    assert_rel_close("gate", g, expected, 1e-6)
    # A_log given flat, and bf16 inputs: still fp32 out
    g2 = kda_gate(f.bfloat16(), gate.A_log.detach().flatten(), gate.dt_bias.detach())
    assert g2.dtype == torch.float32
    assert_rel_close("gate bf16", g2, expected, 2e-2)


def test_gate_lower_bound():
    gen = torch.Generator().manual_seed(1)
    f = torch.randn(3, 7, 4, 8, generator=gen) * 30.0  # saturate the sigmoid at both ends
    A_log = torch.randn(4, generator=gen)
    dt_bias = torch.randn(32, generator=gen)
    lb = -5.0
    g = kda_gate(f, A_log, dt_bias, lower_bound=lb)
    assert g.dtype == torch.float32
    assert (g >= lb).all() and (g <= 0).all()
    x = f.double() + dt_bias.double().view(4, 8)
    expected = lb * torch.sigmoid(A_log.double().exp().view(4, 1) * x)
    assert_rel_close("bounded gate", g, expected, 1e-6)
    with pytest.raises(ValueError, match="lower_bound"):
        kda_gate(f, A_log, dt_bias, lower_bound=1.0)


def test_l2norm_matches_fla_style():
    x = torch.randn(3, 5, 16, generator=torch.Generator().manual_seed(2)).half()
    y = l2norm(x)
    assert y.dtype == torch.float32
    assert_rel_close("l2norm", y, hf.l2norm(x.float()), 1e-7)
    tiny = torch.full((4,), 1e-4)
    # eps sits inside the sqrt: a tiny vector is shrunk, not blown up to unit norm like F.normalize would
    assert l2norm(tiny).norm() < 0.2


def test_bad_shapes_raise():
    q, k, v, g, beta, s0 = make_reference_inputs(2, 4, seed=0, state=True)
    for fn in (naive_recurrent_kda, naive_chunk_kda):
        with pytest.raises(ValueError, match="k must"):
            fn(q, k[..., :-1], v, g, beta)
        with pytest.raises(ValueError, match="g must"):
            fn(q, k, v, g[:, :-1], beta)
        with pytest.raises(ValueError, match="beta must"):
            fn(q, k, v, g, beta.unsqueeze(-1))
        with pytest.raises(ValueError, match="v must"):
            fn(q, k, v[:, :, :1], g, beta)
        with pytest.raises(ValueError, match="initial_state must"):
            fn(q, k, v, g, beta, initial_state=s0.transpose(-1, -2))
        with pytest.raises(ValueError, match="cu_seqlens"):
            fn(q, k, v, g, beta, cu_seqlens=torch.tensor([0, 2, 4]))
        with pytest.raises(ValueError, match="cu_seqlens"):
            fn(q[:1], k[:1], v[:1], g[:1], beta[:1], cu_seqlens=torch.tensor([0, 2, 5]))
    with pytest.raises(ValueError, match="A_log"):
        kda_gate(g, torch.zeros(H + 1), torch.zeros(H * K))
    with pytest.raises(ValueError, match="dt_bias"):
        kda_gate(g, torch.zeros(H), torch.zeros(H * K - 1))


@pytest.mark.parametrize("fn", [naive_recurrent_kda, naive_chunk_kda], ids=["recurrent", "chunk"])
def test_state_pool_by_slot_index(fn):
    """With state_indices the references read and write a state pool in place, as the Triton kernels do."""
    q, k, v, g, beta, _ = make_reference_inputs(1, 9, seed=11)
    cu = torch.tensor([0, 4, 4, 9], dtype=torch.int32)  # three sequences, one of them empty
    gen = torch.Generator().manual_seed(12)
    pool = torch.randn(6, H, K, V, generator=gen)
    before = pool.clone()
    slots = torch.tensor([4, 0, 2])
    o_ref, final_ref = fn(
        q,
        k,
        v,
        g,
        beta,
        initial_state=pool[slots].clone(),
        output_final_state=True,
        use_qk_l2norm_in_kernel=True,
        cu_seqlens=cu,
    )
    o, returned = fn(
        q,
        k,
        v,
        g,
        beta,
        initial_state=pool,
        output_final_state=True,
        use_qk_l2norm_in_kernel=True,
        cu_seqlens=cu,
        state_indices=slots,
    )
    assert returned is pool
    assert torch.equal(o, o_ref) and torch.equal(pool[slots], final_ref)
    untouched = [1, 3, 5]
    assert torch.equal(pool[untouched], before[untouched])
    with pytest.raises(ValueError, match="state_indices needs the state pool"):
        fn(q, k, v, g, beta, cu_seqlens=cu, state_indices=slots)


@pytest.mark.parametrize("fn", [naive_recurrent_kda, naive_chunk_kda], ids=["recurrent", "chunk"])
@pytest.mark.parametrize("lower_bound", [None, -5.0])
def test_gate_computed_from_raw_preactivation(fn, lower_bound):
    q, k, v, _, beta, _ = make_reference_inputs(2, 7, seed=13)
    gen = torch.Generator().manual_seed(14)
    f = torch.randn(2, 7, H, K, generator=gen)
    A_log = torch.empty(1, 1, H, 1).uniform_(-0.7, 0.7, generator=gen)
    dt_bias = torch.randn(H * K, generator=gen) * 0.5 - 2.0
    expected = fn(q, k, v, kda_gate(f, A_log, dt_bias, lower_bound), beta, use_qk_l2norm_in_kernel=True)[0]
    actual = fn(q, k, v, f, beta, use_qk_l2norm_in_kernel=True, A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound)[
        0
    ]
    assert torch.equal(actual, expected)
    with pytest.raises(ValueError, match="A_log and dt_bias must be given together"):
        fn(q, k, v, f, beta, A_log=A_log)


@pytest.mark.parametrize("fn", [naive_recurrent_kda, naive_chunk_kda], ids=["recurrent", "chunk"])
def test_beta_logits(fn):
    """use_beta_sigmoid_in_kernel: beta's bf16 logits in, the sigmoid taken in fp32, as the model did on the host."""
    q, k, v, g, _, _ = make_reference_inputs(2, 7, seed=15)
    logits = torch.randn(2, 7, H, generator=torch.Generator().manual_seed(16)).mul(3.0).bfloat16()
    expected = fn(q, k, v, g, torch.sigmoid(logits.float()), use_qk_l2norm_in_kernel=True)[0]
    actual = fn(q, k, v, g, logits, use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True)[0]
    assert torch.equal(actual, expected)
