"""Helpers shared by the kda kernel tests (imported with `from .conftest import ...`)."""

from __future__ import annotations

import functools

import pytest
import torch

from ..conftest import DEVICE

H, K, V = 2, 32, 16  # K != V so a transposed state cannot pass; K spans two 16-wide slices of the intra kernel


@pytest.fixture(
    params=[(True, False), (True, True), (False, True), (False, False)], ids=["wide", "halves", "halves-only", "blocks"]
)
def intra_path(request, monkeypatch):
    """Every intra path: the chunk-wide kernel first (falling back per chunk to the block kernel), with or without
    its per-half relaunch in between, the per-half pass alone before the block kernel, or the block kernel for every
    chunk (["wide"], ["halves"] of chunk.INTRA and, for the bounded gate, chunk.INTRA_BOUNDED)."""
    from kimi_helix.kernels.kda import chunk

    for table in (chunk.INTRA, chunk.INTRA_BOUNDED):
        monkeypatch.setitem(table, "wide", request.param[0])
        monkeypatch.setitem(table, "halves", request.param[1])


def make_kda_inputs(B, T, seed, dtype=torch.float32, *, h, k, v, n_states=None, raw_gate=False, lower_bound=None):
    """Random KDA inputs on DEVICE: q, k, v, g (log-decay, or the raw pre-activation when raw_gate), beta, s0, and the
    gate parameters (A_log, dt_bias)."""
    from kimi_helix.kernels.kda import kda_gate

    gen = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen)

    q, kk, vv = randn(B, T, h, k), randn(B, T, h, k), randn(B, T, h, v)
    A_log = randn(h) * 0.5
    dt_bias = randn(h * k) * 0.5 - 1.0
    f = randn(B, T, h, k) * 3.0
    g = f if raw_gate else kda_gate(f, A_log, dt_bias, lower_bound)
    beta = torch.sigmoid(randn(B, T, h))
    s0 = randn(n_states or B, h, k, v) * 0.3
    out = [x.to(dtype) for x in (q, kk, vv)] + [g.to(dtype) if raw_gate else g, beta.to(dtype), s0, A_log, dt_bias]
    return [x.to(DEVICE) for x in out]


def kda_prefill_then_decode(decode, q, k, v, g, beta, s0, prefill_len):
    """naive_chunk_kda over every token, and over the first prefill_len tokens followed by `decode` one token at a time
    from the state the previous step left. Returns (stepped o, stepped final state, full o, full final state)."""
    from kimi_helix.kernels.kda import naive_chunk_kda

    kw = dict(output_final_state=True, use_qk_l2norm_in_kernel=True)
    o_full, s_full = naive_chunk_kda(q, k, v, g, beta, initial_state=s0, **kw)
    P = prefill_len
    o_pre, s = naive_chunk_kda(q[:, :P], k[:, :P], v[:, :P], g[:, :P], beta[:, :P], initial_state=s0, **kw)
    outs = [o_pre]
    for t in range(P, q.shape[1]):
        step = [x[:, t : t + 1] for x in (q, k, v, g, beta)]
        o_t, s = decode(*step, initial_state=s, **kw)
        outs.append(o_t)
    return torch.cat(outs, dim=1), s, o_full, s_full


H_R, K_R, V_R = 2, 16, 40  # K_R != V_R, and V_R spans two masked V-blocks (the recurrent kernel's tests)


make_recurrent_inputs = functools.partial(
    make_kda_inputs, h=H_R, k=K_R, v=V_R
)  # B, T, seed, dtype; h, k, v overridable
