"""CONV: the kernels at real shapes and dtypes on the GPU (`pytest -m gpu`)."""

from __future__ import annotations

import pytest
import torch

from kimi_helix.kernels.conv import causal_conv1d, causal_conv1d_update
from kimi_helix.kernels.conv.triton import causal_conv1d_triton, causal_conv1d_update_triton

from ..conftest import DEVICE, TOL, assert_rel_close, rnd
from .conftest import W, cu

pytestmark = pytest.mark.usefixtures("nan_empty")


@pytest.mark.gpu
def test_gpu_bf16_real_shapes():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    Dr, slots = 3 * 4096, 64  # q, k and v of Kimi-Linear stacked, as the model runs them
    lens = [1, 2, 3, 17, 300, 1000]
    idx = torch.randperm(slots, device=DEVICE)[: len(lens)]
    x, w = rnd(1, sum(lens), Dr, seed=23, dtype=torch.bfloat16), rnd(Dr, W, seed=24, dtype=torch.bfloat16)
    pool = rnd(slots, W - 1, Dr, seed=25, dtype=torch.bfloat16)
    before = pool.clone()
    y, _ = causal_conv1d_triton(
        x, w, initial_state=pool, output_final_state=True, cu_seqlens=cu(lens), state_indices=idx
    )
    y_ref, s_ref = causal_conv1d(x, w, initial_state=before[idx], output_final_state=True, cu_seqlens=cu(lens))
    assert_rel_close("prefill y", y, y_ref, TOL[torch.bfloat16])
    assert torch.equal(pool[idx], s_ref)
    x1 = rnd(len(lens), Dr, seed=26, dtype=torch.bfloat16)
    dense = pool[idx].clone()
    y1 = causal_conv1d_update_triton(x1, pool, w, state_indices=idx)
    assert_rel_close("update y", y1, causal_conv1d_update(x1, dense, w), TOL[torch.bfloat16])
    assert torch.equal(pool[idx], dense)


@pytest.mark.gpu
def test_gpu_update_channel_groups():
    """The decode step as the model runs it: q, k and v projections (slices of wider rows) and their three weights
    as channel groups, against the conv of their concatenation."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    P, slots, n = 4096, 64, 48
    idx = torch.randperm(slots, device=DEVICE)[:n]
    wide = rnd(n, 3, P + 64, seed=27, dtype=torch.bfloat16)
    xs = [wide[:, i, :P] for i in range(3)]
    ws = [rnd(P, W, seed=28 + i, dtype=torch.bfloat16) for i in range(3)]
    pool = rnd(slots, W - 1, 3 * P, seed=31, dtype=torch.bfloat16)
    dense = pool[idx].clone()
    y = causal_conv1d_update_triton(xs, pool, ws, state_indices=idx)
    y_ref = causal_conv1d_update(torch.cat(xs, -1), dense, torch.cat(ws))
    assert_rel_close("y", y, y_ref, TOL[torch.bfloat16])
    assert torch.equal(pool[idx], dense)


@pytest.mark.gpu
def test_gpu_verify_channel_groups():
    """A verify step's conv as the model runs it: 16 sequences of 4 tokens, q, k, v as strided channel groups."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    P, slots, lens = 4096, 32, [4] * 16
    idx = torch.randperm(slots, device=DEVICE)[: len(lens)]
    wide = rnd(1, sum(lens), 3, P + 64, seed=32, dtype=torch.bfloat16)
    xs = [wide[:, :, i, :P] for i in range(3)]
    ws = [rnd(P, W, seed=33 + i, dtype=torch.bfloat16) for i in range(3)]
    pool = rnd(slots, W - 1, 3 * P, seed=36, dtype=torch.bfloat16)
    before = pool.clone()
    y, _ = causal_conv1d_triton(
        xs, ws, initial_state=pool, output_final_state=True, cu_seqlens=cu(lens), state_indices=idx
    )
    y_ref, s_ref = causal_conv1d(
        torch.cat(xs, -1), torch.cat(ws), initial_state=before[idx], output_final_state=True, cu_seqlens=cu(lens)
    )
    assert_rel_close("y", y, y_ref, TOL[torch.bfloat16])
    assert torch.equal(pool[idx], s_ref)


@pytest.mark.gpu
def test_gpu_prefill_split_output():
    """A prefill's conv as the KDA layer runs it: q, k, v as strided channel groups in, each group's output as its
    own contiguous plane out (NaN-filled), equal to the concatenated output's channels bit for bit."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    P, slots, lens = 4096, 16, [1, 2, 300, 1000]
    idx = torch.randperm(slots, device=DEVICE)[: len(lens)]
    wide = rnd(1, sum(lens), 3, P + 64, seed=37, dtype=torch.bfloat16)
    xs = [wide[:, :, i, :P] for i in range(3)]
    ws = [rnd(P, W, seed=38 + i, dtype=torch.bfloat16) for i in range(3)]
    pool = rnd(slots, W - 1, 3 * P, seed=41, dtype=torch.bfloat16)
    kw = dict(output_final_state=True, cu_seqlens=cu(lens), state_indices=idx)
    parts, final = causal_conv1d_triton(xs, ws, initial_state=pool.clone(), split_output=True, **kw)
    y, final_cat = causal_conv1d_triton(xs, ws, initial_state=pool.clone(), **kw)
    y_ref, _ = causal_conv1d(torch.cat(xs, -1), torch.cat(ws), initial_state=pool[idx], **{**kw, "state_indices": None})
    for i, part in enumerate(parts):
        assert part.is_contiguous() and torch.equal(part, y[..., i * P : (i + 1) * P])
    assert torch.equal(final, final_cat)
    assert_rel_close("y", torch.cat(parts, -1), y_ref, TOL[torch.bfloat16])
