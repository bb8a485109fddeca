"""KDA: the Triton kernels against the torch references, on the CPU interpreter or a GPU."""

from __future__ import annotations

import functools

import pytest
import torch

from kimi_helix.kernels.kda import fused_recurrent, kda_gate, naive_chunk_kda, naive_recurrent_kda
from kimi_helix.kernels.kda.chunk import chunk_kda_triton
from kimi_helix.kernels.kda.fused_recurrent import fused_recurrent_kda_triton

from ..conftest import DEVICE, TOL, assert_rel_close, cu_seqlens
from .conftest import H_R, K_R, V_R, H, K, V, kda_prefill_then_decode, make_kda_inputs, make_recurrent_inputs

pytestmark = pytest.mark.usefixtures("nan_empty")


CHUNK_LENS = [17, 0, 5, 40]  # packed sequences: across a chunk boundary, empty, short, three chunks of 16


make_chunk_inputs = functools.partial(make_kda_inputs, h=H, k=K, v=V)  # B, T, seed, dtype; h, k, v overridable


def _steady_decay_inputs(T=136):
    """Log-decays near -4 per token on a quarter of the channels of every token, mild elsewhere."""
    q, k, v, _, beta, s0, _, _ = make_chunk_inputs(1, T, seed=29, h=1)
    gen = torch.Generator().manual_seed(1)
    g = -torch.rand(1, T, 1, K, generator=gen) * 0.1
    g[..., ::4] = -4.0 + torch.rand(1, T, 1, K // 4, generator=gen) * 0.5
    return q, k, v, g.to(DEVICE), beta, s0


@pytest.fixture
def routes_seen(monkeypatch):
    """The route [NT, H] of every chunk_kda call, recorded at the block kernel's launch (which always runs)."""
    from kimi_helix.kernels.kda import chunk

    blocks, seen = chunk.kda_chunk_intra_blocks_kernel, []
    at = blocks.arg_names.index("route")

    class Recorder:
        def __getitem__(self, grid):
            def launch(*args, **kw):
                seen.append(args[at].clone())
                return blocks[grid](*args, **kw)

            return launch

    monkeypatch.setattr(chunk, "kda_chunk_intra_blocks_kernel", Recorder())
    return seen


RECURRENT_LENS = [3, 1, 9, 0, 5]  # packed sequences, one of them empty


@pytest.mark.parametrize("T", [1, 15, 16, 17, 40])
@pytest.mark.usefixtures("intra_path")
def test_matches_references(T):
    q, k, v, g, beta, s0, _, _ = make_chunk_inputs(2, T, seed=T)
    kw = dict(initial_state=s0, output_final_state=True, use_qk_l2norm_in_kernel=True)
    o, s = chunk_kda_triton(q, k, v, g, beta, chunk_size=16, **kw)
    assert o.dtype == q.dtype and s.dtype == torch.float32 and s.shape == (2, H, K, V)
    o_c, s_c = naive_chunk_kda(q, k, v, g, beta, chunk_size=16, **kw)
    o_r, s_r = naive_recurrent_kda(q, k, v, g, beta, **kw)
    for ref, (o_ref, s_ref) in (("chunk", (o_c, s_c)), ("recurrent", (o_r, s_r))):
        assert_rel_close(f"o vs {ref}", o, o_ref, 1e-5)
        assert_rel_close(f"final_state vs {ref}", s, s_ref, 1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("chunk_size", [32, 64])
@pytest.mark.usefixtures("intra_path")
def test_large_chunks(chunk_size, dtype):
    """The production tiles: 2 and 4 sub-blocks per chunk, a partial last chunk."""
    q, k, v, g, beta, s0, _, _ = make_chunk_inputs(1, 70, seed=chunk_size, dtype=dtype, h=1)
    kw = dict(initial_state=s0, output_final_state=True, use_qk_l2norm_in_kernel=True)
    o, s = chunk_kda_triton(q, k, v, g, beta, chunk_size=chunk_size, **kw)
    o_r, s_r = naive_chunk_kda(q, k, v, g, beta, **kw)
    assert_rel_close("o", o, o_r, TOL[dtype])
    assert_rel_close("final_state", s, s_r, TOL[dtype])


def test_wy_split_equals_one_program(monkeypatch):
    """WY products with one program per column slice (chunk.WY["split"]; two K slices and one V slice here) give
    bit-identical results to one program per chunk, and both match the reference."""
    from kimi_helix.kernels.kda import chunk

    q, k, v, g, beta, s0, _, _ = make_chunk_inputs(1, 40, seed=23)
    kw = dict(initial_state=s0, output_final_state=True, use_qk_l2norm_in_kernel=True)
    monkeypatch.setitem(chunk.WY, "BS", 16)
    results = []
    for split in (False, True):
        monkeypatch.setitem(chunk.WY, "split", split)
        results.append(chunk_kda_triton(q, k, v, g, beta, chunk_size=16, **kw))
    (o, s), (o_split, s_split) = results
    assert torch.equal(o_split, o) and torch.equal(s_split, s)
    o_r, s_r = naive_recurrent_kda(q, k, v, g, beta, **kw)
    assert_rel_close("o", o_split, o_r, 1e-5)
    assert_rel_close("final_state", s_split, s_r, 1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_output_in_state_pass_equals_output_kernel(monkeypatch, dtype):
    """o computed by the state pass (chunk.STATE["output"]) equals o from the per-chunk states and v_new that the
    output kernel reads back, over packed sequences with a partial last chunk; both match the reference."""
    from kimi_helix.kernels.kda import chunk

    q, k, v, g, beta, s0, _, _ = make_chunk_inputs(1, sum(CHUNK_LENS), seed=29, dtype=dtype, n_states=len(CHUNK_LENS))
    cu = torch.tensor([0, *torch.tensor(CHUNK_LENS).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
    kw = dict(initial_state=s0, output_final_state=True, use_qk_l2norm_in_kernel=True, cu_seqlens=cu)
    results = {}
    for fused in (False, True):
        monkeypatch.setitem(chunk.STATE, "output", fused)
        results[fused] = chunk_kda_triton(q, k, v, g, beta, chunk_size=16, **kw)
    assert_rel_close("o", results[True][0], results[False][0], 1e-6 if dtype == torch.float32 else 1e-3)
    assert torch.equal(results[True][1], results[False][1])  # the state recurrence is the same arithmetic
    o_r, s_r = naive_recurrent_kda(q, k, v, g, beta, **kw)
    assert_rel_close("o vs recurrent", results[True][0], o_r, TOL[dtype])
    assert_rel_close("state vs recurrent", results[True][1], s_r, TOL[dtype])


def test_state_pass_output_needs_four_warps(monkeypatch):
    """Triton miscompiled the state pass with o at 8 warps (wrong o, illegal accesses on an H200): refused."""
    from kimi_helix.kernels.kda import chunk

    q, k, v, g, beta, _, _, _ = make_chunk_inputs(1, 20, seed=5, h=1)
    monkeypatch.setitem(chunk.STATE, "num_warps", 8)
    with pytest.raises(ValueError, match="num_warps=4"):
        chunk_kda_triton(q, k, v, g, beta, chunk_size=16)
    monkeypatch.setitem(chunk.STATE, "output", False)  # the pass without o is exact at 8 warps
    chunk_kda_triton(q, k, v, g, beta, chunk_size=16)


def test_no_l2norm_custom_scale_no_state():
    q, k, v, g, beta, _, _, _ = make_chunk_inputs(1, 20, seed=5, h=1)
    k = torch.nn.functional.normalize(k, dim=-1)  # an unnormalised key makes the delta rule blow up
    o, s = chunk_kda_triton(q, k, v, g, beta, scale=0.37, chunk_size=16)
    assert s is None
    assert_rel_close("o", o, naive_recurrent_kda(q, k, v, g, beta, scale=0.37)[0], 1e-5)


@pytest.mark.parametrize("dtype, chunk_size", [(torch.float32, 16), (torch.float16, 16), (torch.float32, 64)],
                         ids=["fp32", "fp16", "fp32-64"])  # fmt: skip
@pytest.mark.usefixtures("intra_path")
def test_chunk_varlen_equals_per_sequence(dtype, chunk_size):
    """At 64-token chunks every sequence is one partial chunk, shorter and longer than half of one."""
    q, k, v, g, beta, s0, _, _ = make_chunk_inputs(1, sum(CHUNK_LENS), seed=7, dtype=dtype, n_states=len(CHUNK_LENS))
    cu = torch.tensor([0, *torch.tensor(CHUNK_LENS).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
    kw = dict(output_final_state=True, use_qk_l2norm_in_kernel=True, chunk_size=chunk_size)
    o, s = chunk_kda_triton(q, k, v, g, beta, initial_state=s0, cu_seqlens=cu, **kw)
    for n, (b, e) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        if e == b:  # an empty sequence passes its state through
            assert torch.equal(s[n], s0[n])
            continue
        seq = (t[:, b:e] for t in (q, k, v, g, beta))
        o_n, s_n = chunk_kda_triton(*seq, initial_state=s0[n : n + 1], **kw)
        assert_rel_close(f"o[{n}]", o[:, b:e], o_n, 1e-6)
        assert_rel_close(f"state[{n}]", s[n : n + 1], s_n, 1e-6)
    o_r, s_r = naive_recurrent_kda(q, k, v, g, beta, initial_state=s0, cu_seqlens=cu, output_final_state=True,
                                   use_qk_l2norm_in_kernel=True)  # fmt: skip
    assert_rel_close("o vs recurrent", o, o_r, TOL[dtype])
    assert_rel_close("state vs recurrent", s, s_r, TOL[dtype])


@pytest.mark.parametrize("output_final_state", [True, False])
def test_chunk_state_pool_in_place(output_final_state):
    q, k, v, g, beta, _, _, _ = make_chunk_inputs(1, sum(CHUNK_LENS), seed=9)
    cu = torch.tensor([0, *torch.tensor(CHUNK_LENS).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
    pool = torch.randn(7, H, K, V, device=DEVICE) * 0.3
    slots = torch.tensor([5, 0, 3, 6], device=DEVICE)
    before = pool.clone()
    kw = dict(cu_seqlens=cu, use_qk_l2norm_in_kernel=True)
    o, ret = chunk_kda_triton(
        q, k, v, g, beta, initial_state=pool, state_indices=slots, output_final_state=output_final_state,
        chunk_size=16, **kw,
    )  # fmt: skip
    o_r, s_r = naive_chunk_kda(q, k, v, g, beta, initial_state=before[slots], output_final_state=True, **kw)
    assert_rel_close("o", o, o_r, 1e-5)
    others = [i for i in range(7) if i not in slots.tolist()]
    assert torch.equal(pool[others], before[others])
    if output_final_state:
        assert ret is pool
        assert_rel_close("pool slots", pool[slots], s_r, 1e-5)
    else:
        assert ret is None and torch.equal(pool, before)


@pytest.mark.parametrize(
    "lower_bound, chunk_size", [(None, 16), (None, 64), (-5.0, 64), (-20.0, 16)], ids=["16", "64", "lb5-64", "lb20-16"]
)
@pytest.mark.usefixtures("intra_path")
def test_chunk_gate_in_kernel(lower_bound, chunk_size):
    """Raw pre-activation in, log-decay computed in the kernel (lb=-20 sends most diagonal blocks to the exact loop)."""
    q, k, v, f, beta, s0, A_log, dt_bias = make_chunk_inputs(1, 40, seed=13, h=1, raw_gate=True)
    kw = dict(initial_state=s0, output_final_state=True, use_qk_l2norm_in_kernel=True)
    o, s = chunk_kda_triton(
        q, k, v, f, beta, A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound, chunk_size=chunk_size, **kw
    )
    o_r, s_r = naive_recurrent_kda(q, k, v, kda_gate(f, A_log, dt_bias, lower_bound), beta, **kw)
    assert_rel_close("o", o, o_r, 1e-5)
    assert_rel_close("final_state", s, s_r, 1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("fn", [chunk_kda_triton, fused_recurrent_kda_triton], ids=["chunk", "recurrent"])
def test_beta_logits(fn, dtype):
    """use_beta_sigmoid_in_kernel: beta's logits in (in the input dtype), the fp32 sigmoid taken by the kernels."""
    q, k, v, f, _, s0, A_log, dt_bias = make_recurrent_inputs(1, 20, seed=17, dtype=dtype, raw_gate=True)
    logits = (torch.randn(1, 20, H_R, generator=torch.Generator().manual_seed(18)) * 3.0).to(DEVICE, dtype)
    kw = dict(initial_state=s0, output_final_state=True, use_qk_l2norm_in_kernel=True, A_log=A_log, dt_bias=dt_bias)
    o, s = fn(q, k, v, f, logits, use_beta_sigmoid_in_kernel=True, **kw)
    o_ref, s_ref = naive_recurrent_kda(q, k, v, f, torch.sigmoid(logits.float()), **kw)
    assert_rel_close("o", o, o_ref, TOL[dtype])
    assert_rel_close("final_state", s, s_ref, 1e-5 if dtype == torch.float32 else TOL[dtype])


@pytest.mark.parametrize("varlen", [False, True], ids=["batch", "varlen"])
@pytest.mark.usefixtures("intra_path")
def test_strided_beta_logits(varlen):
    """beta's logits as a column slice of a wider projection (token stride 3H, as the model passes them), over
    several chunks and sequences and every intra path: read in place, the sigmoid taken by the intra and WY
    kernels, the same as the contiguous sigmoid of the same logits. Masked rows past a chunk's end stay zero."""
    B, T = (1, 150) if varlen else (2, 75)
    q, k, v, f, _, s0, A_log, dt_bias = make_chunk_inputs(B, T, seed=19, raw_gate=True)
    wide = torch.randn(B, T, 3 * H, generator=torch.Generator().manual_seed(20)) * 3.0
    logits = wide.to(DEVICE)[..., H : 2 * H]
    assert logits.stride(1) == 3 * H
    lens = [70, 1, 79]
    kw = dict(output_final_state=True, use_qk_l2norm_in_kernel=True, A_log=A_log, dt_bias=dt_bias,
              initial_state=s0[:1].expand(3, -1, -1, -1).contiguous() if varlen else s0,
              cu_seqlens=cu_seqlens(lens) if varlen else None)  # fmt: skip
    o, s = chunk_kda_triton(q, k, v, f, logits, use_beta_sigmoid_in_kernel=True, **kw)
    o_dense, s_dense = chunk_kda_triton(q, k, v, f, torch.sigmoid(logits.float()), **kw)
    assert_rel_close("o", o, o_dense, 1e-5)
    assert_rel_close("final_state", s, s_dense, 1e-5)
    o_ref, s_ref = naive_chunk_kda(q, k, v, f, torch.sigmoid(logits.float()), **kw)
    assert_rel_close("o against the reference", o, o_ref, 1e-4)


@pytest.mark.parametrize("chunk_size", [16, 64])
@pytest.mark.usefixtures("intra_path")
def test_strong_gates_stay_finite(chunk_size):
    """Log-decays down to -80 per token on half the channels of tokens 80..95: the chunk holding them is too steep
    for the chunk-wide factorisation and takes the block path, where that 16-row block takes the exact pairwise loop
    (its cumulative decays fall far below exp(-88)) and the others the factored dot; the chunks around it stay
    chunk-wide, in the same call."""
    T = 136
    q, k, v, _, beta, s0, _, _ = make_chunk_inputs(1, T, seed=17, h=1)
    gen = torch.Generator().manual_seed(0)
    g = -torch.rand(1, T, 1, K, generator=gen) * 0.05
    g[:, 80:96, :, 1::2] = -torch.rand(1, 16, 1, K // 2, generator=gen) * 80.0
    g = g.to(DEVICE)
    kw = dict(initial_state=s0, output_final_state=True, use_qk_l2norm_in_kernel=True)
    o, s = chunk_kda_triton(q, k, v, g, beta, chunk_size=chunk_size, **kw)
    o_r, s_r = naive_recurrent_kda(q, k, v, g, beta, **kw)
    # Decays are differences of in-chunk cumulative sums, which lose ulp(|G|) ~ 1e-4 of the exponent once |G| is
    # ~1000, as here after the strong block (the reference sums only the gates in between).
    tol = 1e-5 if chunk_size == 16 else 1e-4
    assert_rel_close("o", o, o_r, tol)
    assert_rel_close("final_state", s, s_r, tol)


@pytest.mark.parametrize("chunk_size", [32, 64])
@pytest.mark.usefixtures("intra_path")
def test_steady_strong_decay(chunk_size):
    """Log-decays near -4 per token on a quarter of the channels of every token: a whole chunk spans more than the
    chunk-wide factorisation allows, each half chunk does not (the regime of the per-half relaunch)."""
    q, k, v, g, beta, s0 = _steady_decay_inputs()
    kw = dict(initial_state=s0, output_final_state=True, use_qk_l2norm_in_kernel=True)
    o, s = chunk_kda_triton(q, k, v, g, beta, chunk_size=chunk_size, **kw)
    o_r, s_r = naive_recurrent_kda(q, k, v, g, beta, **kw)
    assert_rel_close("o", o, o_r, 1e-5)
    assert_rel_close("final_state", s, s_r, 1e-5)


def test_steady_strong_decay_fits_the_halves(monkeypatch, routes_seen):
    """On test_steady_strong_decay's gates the gate kernel routes every chunk to the per-half pass (none to the
    block kernel), while the chunk-wide pass can take none of the two full chunks (only the 8-row tail); both give
    the reference's results."""
    from kimi_helix.kernels.kda import chunk

    q, k, v, g, beta, s0 = _steady_decay_inputs()
    kw = dict(initial_state=s0, output_final_state=True, use_qk_l2norm_in_kernel=True, chunk_size=64)
    o_r, s_r = naive_recurrent_kda(q, k, v, g, beta, **{n: x for n, x in kw.items() if n != "chunk_size"})
    for wide, halves, routes in ((True, False, [2, 2, 0]), (False, True, [1, 1, 1])):
        monkeypatch.setitem(chunk.INTRA, "wide", wide)
        monkeypatch.setitem(chunk.INTRA, "halves", halves)
        o, s = chunk_kda_triton(q, k, v, g, beta, **kw)
        assert routes_seen[-1].flatten().tolist() == routes, (wide, halves, routes_seen[-1])
        assert_rel_close("o", o, o_r, 1e-5)
        assert_rel_close("final_state", s, s_r, 1e-5)


@pytest.mark.parametrize("lower_bound, routes", [(-4.0, {0, 1}), (-8.0, {0, 1, 2})])
def test_gate_in_kernel_routes_like_the_given_decay(monkeypatch, routes_seen, lower_bound, routes):
    """With the gate computed in the kernel, G is monotone and the route reads only the pivot rows; it must equal the
    element-by-element route of the same decay given as g, on gates that send chunks to every enabled path."""
    from kimi_helix.kernels.kda import chunk

    for table in (chunk.INTRA, chunk.INTRA_BOUNDED):
        monkeypatch.setitem(table, "wide", True)
        monkeypatch.setitem(table, "halves", True)
    q, k, v, f, beta, s0, A_log, dt_bias = make_chunk_inputs(1, 200, seed=13, raw_gate=True)
    kw = dict(initial_state=s0, output_final_state=True, use_qk_l2norm_in_kernel=True, chunk_size=64)
    o, s = chunk_kda_triton(q, k, v, f, beta, A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound, **kw)
    g = kda_gate(f, A_log, dt_bias, lower_bound)
    o_g, s_g = chunk_kda_triton(q, k, v, g, beta, **kw)
    assert torch.equal(routes_seen[0], routes_seen[1]) and set(routes_seen[0].flatten().tolist()) == routes, routes_seen
    assert_rel_close("o", o, o_g, 1e-5)
    assert_rel_close("final_state", s, s_g, 1e-5)


def test_chunk_bad_arguments_raise():
    q, k, v, g, beta, s0, A_log, dt_bias = make_chunk_inputs(1, 4, seed=0)
    with pytest.raises(ValueError, match="chunk_size"):
        chunk_kda_triton(q, k, v, g, beta, chunk_size=48)
    with pytest.raises(ValueError, match="together"):
        chunk_kda_triton(q, k, v, g, beta, A_log=A_log)
    with pytest.raises(ValueError, match="lower_bound"):
        chunk_kda_triton(q, k, v, g, beta, lower_bound=-5.0)
    with pytest.raises(ValueError, match="state_indices needs initial_state"):
        chunk_kda_triton(q, k, v, g, beta, state_indices=torch.zeros(1, dtype=torch.int32, device=DEVICE))
    with pytest.raises(ValueError, match="fp32"):
        chunk_kda_triton(q, k, v, g, beta, initial_state=s0.half(), state_indices=torch.zeros(1, device=DEVICE).int())
    with pytest.raises(ValueError, match="cu_seqlens"):
        chunk_kda_triton(q, k, v, g, beta, cu_seqlens=torch.tensor([0, 3], dtype=torch.int32, device=DEVICE))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("varlen", [False, True], ids=["batch", "varlen"])
@pytest.mark.parametrize("with_state", [False, True], ids=["zero_state", "state"])
def test_matches_naive(dtype, varlen, with_state):
    B, T = (1, sum(RECURRENT_LENS)) if varlen else (3, 4)
    q, k, v, g, beta, s0, _, _ = make_recurrent_inputs(
        B, T, seed=1, dtype=dtype, n_states=len(RECURRENT_LENS) if varlen else None
    )
    kw = dict(
        initial_state=s0 if with_state else None,
        output_final_state=True,
        use_qk_l2norm_in_kernel=True,
        cu_seqlens=cu_seqlens(RECURRENT_LENS) if varlen else None,
    )
    o, s = fused_recurrent_kda_triton(q, k, v, g, beta, **kw)
    o_ref, s_ref = naive_recurrent_kda(q, k, v, g, beta, **kw)
    assert o.dtype == dtype and s.dtype == torch.float32
    assert_rel_close("o", o, o_ref, TOL[dtype])
    assert_rel_close("final_state", s, s_ref, 1e-5)


def test_no_l2norm_custom_scale_no_final_state():
    q, k, v, g, beta, s0, _, _ = make_recurrent_inputs(2, 3, seed=2)
    k = k / k.norm(dim=-1, keepdim=True)  # an unnormalised key makes the delta rule expansive
    o, s = fused_recurrent_kda_triton(q, k, v, g, beta, scale=0.37, initial_state=s0)
    o_ref, _ = naive_recurrent_kda(q, k, v, g, beta, scale=0.37, initial_state=s0)
    assert s is None
    assert_rel_close("o", o, o_ref, 1e-5)


def test_recurrent_varlen_equals_per_sequence():
    q, k, v, g, beta, s0, _, _ = make_recurrent_inputs(1, sum(RECURRENT_LENS), seed=3, n_states=len(RECURRENT_LENS))
    kw = dict(output_final_state=True, use_qk_l2norm_in_kernel=True)
    bounds = cu_seqlens(RECURRENT_LENS).tolist()
    o, s = fused_recurrent_kda_triton(q, k, v, g, beta, initial_state=s0, cu_seqlens=cu_seqlens(RECURRENT_LENS), **kw)
    for n, (a, b) in enumerate(zip(bounds[:-1], bounds[1:])):
        x = [t[:, a:b] for t in (q, k, v, g, beta)]
        o_n, s_n = fused_recurrent_kda_triton(*x, initial_state=s0[n : n + 1], **kw)
        assert torch.equal(o[:, a:b], o_n), f"o[seq {n}]"
        assert torch.equal(s[n : n + 1], s_n), f"state[seq {n}]"
    assert torch.equal(s[3], s0[3])  # the empty sequence keeps its state


@pytest.mark.parametrize("output_final_state", [False, True])
def test_recurrent_state_pool_in_place(output_final_state):
    lens, slots = [2, 1, 4], torch.tensor([5, 0, 3], device=DEVICE)
    q, k, v, g, beta, pool, _, _ = make_recurrent_inputs(1, sum(lens), seed=4, n_states=7)
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


@pytest.mark.parametrize("buffer", [False, True], ids=["allocated", "into_buffer"])
@pytest.mark.parametrize("varlen", [False, True], ids=["batch", "varlen"])
def test_intermediate_states_equal_decode_steps(varlen, buffer):
    """Verify (T = k + 1 tokens at once) returns every per-token state, in a NaN-filled caller buffer when one is
    given (`intermediate_states`, for graph replay); decoding token by token reproduces them."""
    lens = [4, 2, 5] if varlen else [4, 4]
    B, T = (1, sum(lens)) if varlen else (2, 4)
    q, k, v, g, beta, pool, _, _ = make_recurrent_inputs(B, T, seed=5, n_states=6)
    slots = torch.tensor([4, 1, 2][: len(lens)], device=DEVICE)
    start = pool.clone()
    buf = torch.full((B * T, H_R, K_R, V_R), float("nan"), device=DEVICE) if buffer else None
    kw = dict(use_qk_l2norm_in_kernel=True, cu_seqlens=cu_seqlens(lens) if varlen else None)
    o, states = fused_recurrent_kda_triton(
        q, k, v, g, beta, initial_state=pool, state_indices=slots, output_final_state=True,
        return_intermediate_states=True, intermediate_states=buf, **kw,
    )  # fmt: skip
    assert states.shape == (B * T, H_R, K_R, V_R)
    if buffer:
        assert states is buf
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


def test_recurrent_block_sizes_agree(monkeypatch):
    """Tokens loaded one, two or eight at a time (BT; `_config` picks it from the launch's size) give the same
    outputs and per-token states (up to the row reductions' order): blocks that end inside a sequence, past its end,
    and an empty sequence. The gate is computed in the kernel, as the engine calls it."""
    q, k, v, f, beta, pool, A_log, dt_bias = make_recurrent_inputs(
        1, sum(RECURRENT_LENS), seed=7, n_states=len(RECURRENT_LENS), raw_gate=True
    )
    chosen = fused_recurrent._config
    results = []
    for bt in (1, 2, 8):
        monkeypatch.setattr(fused_recurrent, "_config", lambda N, H, K, V, _, bt=bt: (*chosen(N, H, K, V, 1)[:2], bt))
        results.append(fused_recurrent_kda_triton(
            q, k, v, f, beta, initial_state=pool.clone(), A_log=A_log, dt_bias=dt_bias, lower_bound=-5.0,
            use_qk_l2norm_in_kernel=True, cu_seqlens=cu_seqlens(RECURRENT_LENS), return_intermediate_states=True,
        ))  # fmt: skip
    o_ref, _ = naive_recurrent_kda(
        q, k, v, kda_gate(f, A_log, dt_bias, -5.0), beta, initial_state=pool, use_qk_l2norm_in_kernel=True,
        cu_seqlens=cu_seqlens(RECURRENT_LENS),
    )  # fmt: skip
    assert_rel_close("o (BT 1) vs naive", results[0][0], o_ref, 1e-5)
    for bt, (o, states) in zip((2, 8), results[1:]):
        assert_rel_close(f"o at BT {bt}", o, results[0][0], 1e-6)
        assert_rel_close(f"states at BT {bt}", states, results[0][1], 1e-6)


@pytest.mark.parametrize("lower_bound", [None, -5.0], ids=["softplus", "bounded"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_recurrent_gate_in_kernel(lower_bound, dtype):
    q, k, v, f, beta, s0, A_log, dt_bias = make_recurrent_inputs(2, 3, seed=6, dtype=dtype, raw_gate=True)
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
    q, k, v, g, beta, s0, _, _ = make_recurrent_inputs(2, T, seed=7)
    o, s, o_full, s_full = kda_prefill_then_decode(fused_recurrent_kda_triton, q, k, v, g, beta, s0, prefill_len=T - 5)
    assert_rel_close("o", o, o_full, 1e-5)
    assert_rel_close("final_state", s, s_full, 1e-5)


def test_strided_inputs():
    """q, k, v sliced from one fused projection (token stride 3HK) are read in place, without copies."""
    q, k, v, g, beta, s0, _, _ = make_recurrent_inputs(2, 3, seed=8, v=K_R)
    qkv = torch.cat([q, k, v], dim=-1).flatten(2).reshape(2, 3, 3, H_R, K_R)
    qs, ks, vs = qkv.unbind(2)
    assert not qs.is_contiguous()
    kw = dict(initial_state=s0, output_final_state=True, use_qk_l2norm_in_kernel=True)
    o, s = fused_recurrent_kda_triton(qs, ks, vs, g, beta, **kw)
    o_ref, s_ref = naive_recurrent_kda(qs, ks, vs, g, beta, **kw)
    assert_rel_close("o", o, o_ref, 1e-5)
    assert_rel_close("final_state", s, s_ref, 1e-5)


def test_recurrent_bad_arguments_raise():
    q, k, v, g, beta, s0, A_log, dt_bias = make_recurrent_inputs(2, 2, seed=9)
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
    buf = torch.zeros(4, H_R, K_R, V_R, device=DEVICE)
    with pytest.raises(ValueError, match="return_intermediate_states"):
        fused_recurrent_kda_triton(q, k, v, g, beta, intermediate_states=buf)
    with pytest.raises(ValueError, match="intermediate_states must have shape"):
        fused_recurrent_kda_triton(q, k, v, g, beta, return_intermediate_states=True, intermediate_states=buf[:3])
