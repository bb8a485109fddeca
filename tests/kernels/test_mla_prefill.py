"""MLA prefill: the torch reference against a dense masked softmax, and the Triton kernel against the reference.

The small Triton tests run on the CPU under TRITON_INTERPRET=1 (fp32/fp16: the interpreter mishandles bf16), or
compiled on a GPU when the variable is unset; bf16 at the real Kimi dims runs on the GPU (`pytest -m gpu`).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kimi_helix.kernels.mla.naive import mla_prefill_ref
from kimi_helix.kernels.mla.prefill import mla_prefill_triton, tile_config

from .conftest import TOL, assert_rel_close

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cpu" if INTERPRET else "cuda"
needs_triton = pytest.mark.skipif(
    not INTERPRET and not torch.cuda.is_available(), reason="Triton needs TRITON_INTERPRET=1 (CPU) or a GPU"
)

# (Tq_i, Tk_i): single token, no prefix, short query after a long prefix (crosses key blocks), more than one
# query block, and a sequence with no new tokens.
PAIRS = [(1, 1), (5, 5), (7, 40), (33, 33), (0, 9)]


def make_inputs(pairs, H, dqk, dv, dtype, seed=0, device=DEVICE):
    gen = torch.Generator().manual_seed(seed)
    tq, tk = sum(p[0] for p in pairs), sum(p[1] for p in pairs)
    q = torch.randn(tq, H, dqk, generator=gen).to(device, dtype)
    k = torch.randn(tk, H, dqk, generator=gen).to(device, dtype)
    v = torch.randn(tk, H, dv, generator=gen).to(device, dtype)
    cu_q = torch.tensor([0] + [p[0] for p in pairs], dtype=torch.int32).cumsum(0).to(device, torch.int32)
    cu_k = torch.tensor([0] + [p[1] for p in pairs], dtype=torch.int32).cumsum(0).to(device, torch.int32)
    return q, k, v, cu_q, cu_k


def dense_attention(q, k, v, pairs, scale):
    """All sequences at once in fp64: one [Tq, Tk] mask that is block-diagonal over sequences and causal within."""
    q_seq = torch.cat([torch.full((tq,), i) for i, (tq, _) in enumerate(pairs)])
    q_pos = torch.cat([torch.arange(tk - tq, tk) for tq, tk in pairs])  # queries are the last Tq_i positions
    k_seq = torch.cat([torch.full((tk,), i) for i, (_, tk) in enumerate(pairs)])
    k_pos = torch.cat([torch.arange(tk) for _, tk in pairs])
    visible = (q_seq[:, None] == k_seq[None, :]) & (k_pos[None, :] <= q_pos[:, None])
    scores = torch.einsum("qhd,khd->hqk", q.double(), k.double()) * scale
    scores = scores.masked_fill(~visible, float("-inf"))
    out = torch.einsum("hqk,khd->qhd", torch.softmax(scores, dim=-1), v.double())
    return out, torch.logsumexp(scores, dim=-1).transpose(0, 1)


@pytest.mark.parametrize("H", [1, 3])
def test_reference_matches_dense(H):
    q, k, v, cu_q, cu_k = make_inputs(PAIRS, H, 48, 16, torch.float32, seed=H, device="cpu")
    out, lse = mla_prefill_ref(q, k, v, cu_q, cu_k, 0.3)
    d_out, d_lse = dense_attention(q, k, v, PAIRS, 0.3)
    assert out.dtype == torch.float32 and lse.dtype == torch.float32
    assert_rel_close("out", out, d_out, 1e-6)
    assert_rel_close("lse", lse, d_lse, 1e-6)


def test_reference_empty_rows():
    """A query that sees no key (more queries than keys: not a valid prefill) gets lse -inf and a zero output."""
    q, k, v, _, _ = make_inputs([(3, 2)], 2, 16, 16, torch.float32, device="cpu")
    cu_q, cu_k = torch.tensor([0, 3], dtype=torch.int32), torch.tensor([0, 2], dtype=torch.int32)
    out, lse = mla_prefill_ref(q, k, v, cu_q, cu_k, 0.3)
    assert torch.isneginf(lse[0]).all() and (out[0] == 0).all() and torch.isfinite(lse[1:]).all()


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("H", [1, 3])
@pytest.mark.parametrize("dims", [(48, 16), (32, 48)], ids=["qk_split", "v_split"])
def test_triton_matches_reference(dtype, H, dims, nan_empty):
    q, k, v, cu_q, cu_k = make_inputs(PAIRS, H, *dims, dtype, seed=H)
    out, lse = mla_prefill_triton(q, k, v, cu_q, cu_k, 0.25)
    r_out, r_lse = mla_prefill_ref(q, k, v, cu_q, cu_k, 0.25)
    assert out.dtype == dtype and lse.dtype == torch.float32
    assert_rel_close("out", out, r_out, TOL[dtype])
    assert_rel_close("lse", lse, r_lse, 1e-5)


@needs_triton
def test_triton_kimi_dims(nan_empty):
    """Dqk 192 = 128 + 64, Dv 128, with a cached prefix; Kimi's scale is (128 + 64) ** -0.5."""
    pairs = [(3, 20), (18, 18)]
    q, k, v, cu_q, cu_k = make_inputs(pairs, 2, 192, 128, torch.float32)
    out, lse = mla_prefill_triton(q, k, v, cu_q, cu_k, 192**-0.5)
    r_out, r_lse = mla_prefill_ref(q, k, v, cu_q, cu_k, 192**-0.5)
    assert_rel_close("out", out, r_out, 1e-5)
    assert_rel_close("lse", lse, r_lse, 1e-5)


def prefix_sweep(block_n: int, tq: int) -> list[tuple[int, int]]:
    """One sequence per cached prefix 0 .. 2 * block_n, each with `tq` new tokens: chunked prefill leaves arbitrary
    prefixes, so the diagonal key block's limit must hold at every remainder modulo the key block."""
    return [(tq, prefix + tq) for prefix in range(2 * block_n + 1)]


@needs_triton
@pytest.mark.parametrize("tq", [1, 7, 33])
def test_triton_every_prefix_remainder(tq, nan_empty):
    """Small head dims keep the interpreter fast; the tile is the one this device's launch uses."""
    block_n = tile_config(torch.float32, 32, 16)[1]
    pairs = prefix_sweep(block_n, tq)
    q, k, v, cu_q, cu_k = make_inputs(pairs, 1, 32, 16, torch.float32, seed=tq)
    out, lse = mla_prefill_triton(q, k, v, cu_q, cu_k, 0.25)
    r_out, r_lse = mla_prefill_ref(q, k, v, cu_q, cu_k, 0.25)
    assert_rel_close("out", out, r_out, 1e-5)
    assert_rel_close("lse", lse, r_lse, 1e-5)


@needs_triton
def test_triton_strided_inputs():
    """Token/head strides are free (views of wider or head-major buffers); a non-unit last stride is copied."""
    q, k, v, cu_q, cu_k = make_inputs(PAIRS, 3, 48, 16, torch.float32)
    q_wide = torch.cat([q, torch.randn_like(q)], dim=-1)[..., :48]  # token and head strides of a 96-wide buffer
    k_head_major = k.transpose(0, 1).contiguous().transpose(0, 1)
    v_cols = v.transpose(-1, -2).contiguous().transpose(-1, -2)  # last-dim stride != 1
    out, lse = mla_prefill_triton(q_wide, k_head_major, v_cols, cu_q, cu_k, 0.25)
    r_out, r_lse = mla_prefill_ref(q, k, v, cu_q, cu_k, 0.25)
    assert_rel_close("out", out, r_out, 1e-5)
    assert_rel_close("lse", lse, r_lse, 1e-5)


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
        (lambda a: {**a, "v": torch.randn(a["v"].shape[0], 3, 24, device=DEVICE)}, "Dv=24"),
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
    cu_q, cu_k = (torch.tensor([0, n], dtype=torch.int32, device=DEVICE) for n in (3, 2))
    with pytest.raises(ValueError, match="more new tokens"):
        mla_prefill_triton(q, k, v, cu_q, cu_k, 0.25)


# ---------------------------------------------------------------------------------------------------------------
# GPU (H200): bf16 and the compiled kernel's real tile sizes


def _gpu():
    if not torch.cuda.is_available() or INTERPRET:
        pytest.skip("needs CUDA with the Triton compiler (run with TRITON_INTERPRET unset)")
    return "cuda"


# ~8k new tokens over prefixes: long prompt, chunked-prefill continuations, short turns, ragged tails.
GPU_PAIRS = [(3000, 3000), (2048, 4096), (1500, 1700), (777, 5000), (1, 1), (0, 300), (130, 130), (600, 900)]


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


@pytest.mark.skipif(
    torch.cuda.is_available(),
    reason="the CPU path; GPU boxes run the real benchmark (and triton 3.6's interpreter "
    "cannot take runtime loop bounds under numpy >= 2.3)",
)
def test_bench_script_smoke(tmp_path):
    """scripts/bench_mla_prefill.py --smoke runs the interpreter on a tiny case and writes well-formed JSONL."""
    script = Path(__file__).resolve().parents[2] / "scripts" / "bench_mla_prefill.py"
    out = tmp_path / "mla_prefill.jsonl"
    proc = subprocess.run([sys.executable, str(script), "--smoke", "--out", str(out)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(records) == 1
    rec = records[0]
    fields = {"gpu", "date", "commit", "case", "tq", "tk", "heads", "dqk", "dv", "dtype", "config", "kernel_ms", "ms"}
    assert fields | {"tflops"} <= set(rec)
    assert rec["rel_err"] < 1e-5 and rec["lse_rel_err"] < 1e-5
