"""Triton fused recurrent KDA (decode/verify) against the torch references: batch and varlen, state pool in place,
intermediate states, in-kernel gate, prefill then decode; plus the decode benchmark's smoke run."""

from __future__ import annotations

import functools
import importlib.util
import json
from pathlib import Path

import pytest
import torch

from kimi_helix.kernels.kda import kda_gate, naive_recurrent_kda
from kimi_helix.kernels.kda.fused_recurrent import fused_recurrent_kda_triton

from .conftest import DEVICE, TOL, assert_rel_close, cu_seqlens, kda_prefill_then_decode, make_kda_inputs

H, K, V = 2, 16, 40  # K != V, and V spans two masked V-blocks
LENS = [3, 1, 9, 0, 5]  # packed sequences, one of them empty
make_inputs = functools.partial(make_kda_inputs, h=H, k=K, v=V)  # B, T, seed, dtype; h, k, v overridable

pytestmark = pytest.mark.usefixtures("nan_empty")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("varlen", [False, True], ids=["batch", "varlen"])
@pytest.mark.parametrize("with_state", [False, True], ids=["zero_state", "state"])
def test_matches_naive(dtype, varlen, with_state):
    B, T = (1, sum(LENS)) if varlen else (3, 4)
    q, k, v, g, beta, s0, _, _ = make_inputs(B, T, seed=1, dtype=dtype, n_states=len(LENS) if varlen else None)
    kw = dict(
        initial_state=s0 if with_state else None,
        output_final_state=True,
        use_qk_l2norm_in_kernel=True,
        cu_seqlens=cu_seqlens(LENS) if varlen else None,
    )
    o, s = fused_recurrent_kda_triton(q, k, v, g, beta, **kw)
    o_ref, s_ref = naive_recurrent_kda(q, k, v, g, beta, **kw)
    assert o.dtype == dtype and s.dtype == torch.float32
    assert_rel_close("o", o, o_ref, TOL[dtype])
    assert_rel_close("final_state", s, s_ref, 1e-5)


def test_no_l2norm_custom_scale_no_final_state():
    q, k, v, g, beta, s0, _, _ = make_inputs(2, 3, seed=2)
    k = k / k.norm(dim=-1, keepdim=True)  # an unnormalised key makes the delta rule expansive
    o, s = fused_recurrent_kda_triton(q, k, v, g, beta, scale=0.37, initial_state=s0)
    o_ref, _ = naive_recurrent_kda(q, k, v, g, beta, scale=0.37, initial_state=s0)
    assert s is None
    assert_rel_close("o", o, o_ref, 1e-5)


def test_varlen_equals_per_sequence():
    q, k, v, g, beta, s0, _, _ = make_inputs(1, sum(LENS), seed=3, n_states=len(LENS))
    kw = dict(output_final_state=True, use_qk_l2norm_in_kernel=True)
    bounds = cu_seqlens(LENS).tolist()
    o, s = fused_recurrent_kda_triton(q, k, v, g, beta, initial_state=s0, cu_seqlens=cu_seqlens(LENS), **kw)
    for n, (a, b) in enumerate(zip(bounds[:-1], bounds[1:])):
        x = [t[:, a:b] for t in (q, k, v, g, beta)]
        o_n, s_n = fused_recurrent_kda_triton(*x, initial_state=s0[n : n + 1], **kw)
        assert torch.equal(o[:, a:b], o_n), f"o[seq {n}]"
        assert torch.equal(s[n : n + 1], s_n), f"state[seq {n}]"
    assert torch.equal(s[3], s0[3])  # the empty sequence keeps its state


@pytest.mark.parametrize("output_final_state", [False, True])
def test_state_pool_in_place(output_final_state):
    lens, slots = [2, 1, 4], torch.tensor([5, 0, 3], device=DEVICE)
    q, k, v, g, beta, pool, _, _ = make_inputs(1, sum(lens), seed=4, n_states=7)
    before = pool.clone()
    kw = dict(use_qk_l2norm_in_kernel=True, cu_seqlens=cu_seqlens(lens))
    o, ret = fused_recurrent_kda_triton(
        q, k, v, g, beta, initial_state=pool, state_indices=slots, output_final_state=output_final_state, **kw
    )
    o_ref, s_ref = naive_recurrent_kda(q, k, v, g, beta, initial_state=before[slots], output_final_state=True, **kw)
    assert_rel_close("o", o, o_ref, 1e-5)
    untouched = [i for i in range(7) if i not in slots.tolist()]
    assert torch.equal(pool[untouched], before[untouched])
    if output_final_state:
        assert ret is pool
        assert_rel_close("pool slots", pool[slots], s_ref, 1e-5)
    else:
        assert ret is None and torch.equal(pool, before)


@pytest.mark.parametrize("varlen", [False, True], ids=["batch", "varlen"])
def test_intermediate_states_equal_decode_steps(varlen):
    """Verify (T = k + 1 tokens at once) returns every per-token state; decoding token by token reproduces them."""
    lens = [4, 2, 5] if varlen else [4, 4]
    B, T = (1, sum(lens)) if varlen else (2, 4)
    q, k, v, g, beta, pool, _, _ = make_inputs(B, T, seed=5, n_states=6)
    slots = torch.tensor([4, 1, 2][: len(lens)], device=DEVICE)
    start = pool.clone()
    kw = dict(use_qk_l2norm_in_kernel=True, cu_seqlens=cu_seqlens(lens) if varlen else None)
    o, states = fused_recurrent_kda_triton(
        q, k, v, g, beta, initial_state=pool, state_indices=slots, output_final_state=True,
        return_intermediate_states=True, **kw,
    )  # fmt: skip
    assert states.shape == (B * T, H, K, V)
    flat = [t.flatten(0, 1) for t in (q, k, v, g, beta)]
    offsets = torch.tensor([0, *lens]).cumsum(0).tolist()
    for n, (a, b) in enumerate(zip(offsets[:-1], offsets[1:])):
        s = start[slots[n]][None]
        for t in range(a, b):
            step = [x[t][None, None] for x in flat]
            o_t, s = fused_recurrent_kda_triton(
                *step, initial_state=s, output_final_state=True, use_qk_l2norm_in_kernel=True
            )
            assert_rel_close(f"o[{t}]", o.flatten(0, 1)[t], o_t[0, 0], 1e-6)
            assert_rel_close(f"states[{t}]", states[t], s[0], 1e-6)
        assert_rel_close(f"pool[{slots[n]}]", pool[slots[n]], s[0], 1e-6)


@pytest.mark.parametrize("lower_bound", [None, -5.0], ids=["softplus", "bounded"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_gate_in_kernel(lower_bound, dtype):
    q, k, v, f, beta, s0, A_log, dt_bias = make_inputs(2, 3, seed=6, dtype=dtype, raw_gate=True)
    f[0, 0, 0, :4] = torch.tensor([30.0, 25.0, -30.0, 0.0], dtype=dtype)  # softplus' linear branch and its tail
    kw = dict(initial_state=s0, output_final_state=True, use_qk_l2norm_in_kernel=True)
    o, s = fused_recurrent_kda_triton(q, k, v, f, beta, A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound, **kw)
    g = kda_gate(f, A_log, dt_bias, lower_bound)
    o_ref, s_ref = fused_recurrent_kda_triton(q, k, v, g, beta, **kw)
    assert_rel_close("o", o, o_ref, TOL[dtype])
    assert_rel_close("final_state", s, s_ref, 1e-5)
    o_naive, _ = naive_recurrent_kda(q, k, v, g, beta, **kw)
    assert_rel_close("o vs naive", o, o_naive, TOL[dtype])


def test_prefill_then_decode():
    T = 9
    q, k, v, g, beta, s0, _, _ = make_inputs(2, T, seed=7)
    o, s, o_full, s_full = kda_prefill_then_decode(fused_recurrent_kda_triton, q, k, v, g, beta, s0, prefill_len=T - 5)
    assert_rel_close("o", o, o_full, 1e-5)
    assert_rel_close("final_state", s, s_full, 1e-5)


def test_strided_inputs():
    """q, k, v sliced from one fused projection (token stride 3HK) are read in place, without copies."""
    q, k, v, g, beta, s0, _, _ = make_inputs(2, 3, seed=8, v=K)
    qkv = torch.cat([q, k, v], dim=-1).flatten(2).reshape(2, 3, 3, H, K)
    qs, ks, vs = qkv.unbind(2)
    assert not qs.is_contiguous()
    kw = dict(initial_state=s0, output_final_state=True, use_qk_l2norm_in_kernel=True)
    o, s = fused_recurrent_kda_triton(qs, ks, vs, g, beta, **kw)
    o_ref, s_ref = naive_recurrent_kda(qs, ks, vs, g, beta, **kw)
    assert_rel_close("o", o, o_ref, 1e-5)
    assert_rel_close("final_state", s, s_ref, 1e-5)


def test_bad_arguments_raise():
    q, k, v, g, beta, s0, A_log, dt_bias = make_inputs(2, 2, seed=9)
    with pytest.raises(ValueError, match="k must"):
        fused_recurrent_kda_triton(q, k[..., :-1], v, g, beta)
    with pytest.raises(ValueError, match="beta must"):
        fused_recurrent_kda_triton(q, k, v, g, beta[..., None])
    with pytest.raises(ValueError, match="cu_seqlens requires"):
        fused_recurrent_kda_triton(q, k, v, g, beta, cu_seqlens=cu_seqlens([1, 1]))
    with pytest.raises(ValueError, match="initial_state"):
        fused_recurrent_kda_triton(q, k, v, g, beta, initial_state=s0[:1])
    with pytest.raises(ValueError, match="pool"):
        fused_recurrent_kda_triton(q, k, v, g, beta, state_indices=torch.tensor([0, 1], device=DEVICE))
    with pytest.raises(ValueError, match="fp32"):
        slots = torch.tensor([0, 1]).to(DEVICE)
        fused_recurrent_kda_triton(q, k, v, g, beta, initial_state=s0.half(), state_indices=slots)
    with pytest.raises(ValueError, match="together"):
        fused_recurrent_kda_triton(q, k, v, g, beta, A_log=A_log)
    with pytest.raises(ValueError, match="lower_bound"):
        fused_recurrent_kda_triton(q, k, v, g, beta, A_log=A_log, dt_bias=dt_bias, lower_bound=1.0)


def test_bench_smoke(tmp_path):
    path = Path(__file__).resolve().parents[2] / "scripts" / "bench_kda.py"
    spec = importlib.util.spec_from_file_location("bench_kda", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    bench.main(["--phase", "decode", "--smoke", "--sweep", "--out", str(tmp_path)])
    rows = [json.loads(line) for line in (tmp_path / "kda_decode.jsonl").read_text().splitlines()]
    assert rows and {"gpu", "date", "commit", "n", "ms", "tbps", "copy_tbps"} <= rows[0].keys()
    assert all(r["ms"] > 0 and r["tbps"] > 0 for r in rows)
    forced = {(r["bv"], r["num_warps"]) for r in rows if r["config"] == "forced"}
    assert forced == set(bench.SWEEP)


# ------------------------------------------------------------------------------------- GPU, bf16, real shapes


@pytest.mark.gpu
@pytest.mark.parametrize("lower_bound", [None, -5.0], ids=["softplus", "bounded"])
def test_gpu_bf16_decode_and_verify(lower_bound):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    Hr, Kr = 32, 128
    N, slots = 64, 96
    # decode: one token per sequence, pool in place, gate computed in the kernel
    q, k, v, f, beta, pool, A_log, dt_bias = make_inputs(
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
    q, k, v, g, beta, s0, _, _ = make_inputs(1, 64, seed=11, dtype=torch.bfloat16, h=Hr, k=Kr, v=Kr, n_states=16)
    kw = dict(initial_state=s0, use_qk_l2norm_in_kernel=True, cu_seqlens=cu_seqlens(lens))
    o, states = fused_recurrent_kda_triton(q, k, v, g, beta, return_intermediate_states=True, **kw)
    o_ref, states_ref = naive_recurrent_kda(q, k, v, g, beta, return_intermediate_states=True, **kw)
    assert_rel_close("verify o", o, o_ref, TOL[torch.bfloat16])
    assert_rel_close("verify states", states, states_ref, 1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("lower_bound", [None, -5.0], ids=["softplus", "bounded"])
def test_gpu_parity_with_fla(lower_bound):
    """Against fla's fused_recurrent_kda (test extra): 64 sequences of 4 tokens, gate computed in both kernels."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    fla_kda = pytest.importorskip("fla.ops.kda")
    Hr, Kr = 32, 128
    q, k, v, f, beta, s0, A_log, dt_bias = make_inputs(
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
