"""The attention backend switch: declared capabilities match what the kernels really do, and refusals explain.

The truth table covers every phase x H in 1..128 x dtypes x (LSE needed, bounds needed) on this machine's device.
For each case the automatically chosen backend's kernel is run on small inputs; each other backend that declares
it can serve the case is run too (Triton on a spread of head counts: the interpreter is slow), and each backend
that declares it cannot is shown to be refused.
"""

import itertools
import os

import pytest
import torch

from kimi_helix.kernels.backends import (
    PHASES,
    AttentionRequest,
    BackendUnavailableError,
    build_registry,
    select_backend,
)
from kimi_helix.kernels.mla import mla_decode, mla_prefill

KV_LORA, ROPE, NOPE, V_DIM = 32, 16, 32, 32  # latent 48 = 32 + 16; expanded q/k 48, v 32: Triton-tileable
TRITON_HEADS = {1, 3, 16, 17, 64, 96, 128}
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


@pytest.fixture(autouse=True)
def fresh_selection(monkeypatch):
    monkeypatch.delenv("KIMI_HELIX_ATTENTION_BACKEND", raising=False)
    select_backend.cache_clear()
    yield
    select_backend.cache_clear()


def run_case(r: AttentionRequest, backend: str):
    """Call the op the request describes on small random inputs with `backend` forced; return (out, lse)."""
    g = torch.Generator().manual_seed(r.num_heads)
    qdt = DTYPES[r.q_dtype]
    if r.phase == "prefill":
        tq, tk = [1, 3], [2, 5]
        q = torch.randn(sum(tq), r.num_heads, r.head_dim, generator=g).to(qdt)
        k = torch.randn(sum(tk), r.num_heads, r.head_dim, generator=g).to(qdt)
        v = torch.randn(sum(tk), r.num_heads, r.v_head_dim, generator=g).to(qdt)
        cu = lambda xs: torch.tensor([0, *itertools.accumulate(xs)], dtype=torch.int32)  # noqa: E731
        return mla_prefill(q, k, v, cu(tq), cu(tk), 0.2, need_lse=r.need_lse, backend=backend)
    s_q = 1 if r.phase == "decode" else 3
    lens = [5, 9]
    page_size, num_pages = 16, 4
    q = torch.randn(s_q * len(lens), r.num_heads, r.head_dim, generator=g).to(qdt)
    cache = torch.randn(num_pages, page_size, r.head_dim, generator=g)
    scale = None
    if r.kv_dtype == "fp8_e4m3":
        cache, scale = cache.to(torch.float8_e4m3fn), torch.rand(num_pages, page_size, generator=g) + 0.5
    else:
        cache = cache.to(DTYPES[r.kv_dtype])
    table = torch.tensor([[2], [0]], dtype=torch.int32)
    bounds = torch.tensor([0, 3, 5, 9, 1, 2][: q.shape[0]], dtype=torch.int32) if r.need_kv_bounds else None
    return mla_decode(
        q,
        cache,
        table,
        torch.tensor(lens, dtype=torch.int32),
        torch.arange(0, s_q * len(lens) + 1, s_q, dtype=torch.int32),
        0.2,
        KV_LORA,
        bounds,
        scale,
        phase=r.phase,
        need_lse=r.need_lse,
        backend=backend,
    )


def requests(device: str):
    for phase, heads, need_lse, need_bounds in itertools.product(PHASES, range(1, 129), (False, True), (False, True)):
        dims = (NOPE + ROPE, V_DIM) if phase == "prefill" else (KV_LORA + ROPE, KV_LORA)
        kv_dtypes = ("same",) if phase == "prefill" else ("fp32", "fp16", "bf16", "fp8_e4m3")
        for q_dtype, kv in itertools.product(DTYPES, kv_dtypes):
            yield AttentionRequest(
                phase, heads, *dims, q_dtype, q_dtype if kv == "same" else kv, device, need_lse, need_bounds
            )


def usable(r: AttentionRequest, backend: str) -> bool:
    # The Triton interpreter computes bf16 wrongly (a known interpreter limit, not a capability): skip running it.
    return not (backend == "triton" and r.device == "cpu" and "bf16" in (r.q_dtype, r.kv_dtype))


def test_truth_table_every_choice_runs():
    device = "cuda" if torch.cuda.is_available() else "cpu"
    registry = build_registry()
    served = refused = 0
    ran = set()  # need_lse does not change the call, so each kernel call runs once
    for r in requests(device):
        try:
            chosen = select_backend(r).name
        except BackendUnavailableError as err:
            # Nothing can serve it: only prefill with per-token bounds, which no prefill kernel takes.
            assert r.phase == "prefill" and r.need_kv_bounds, (r, err)
            assert all(name in str(err) for name in registry)
            refused += 1
            continue
        served += 1
        out, lse = run_case(r, chosen)
        assert torch.isfinite(out).all(), (r, chosen)
        assert (lse is not None) or not r.need_lse, (r, chosen)
        for name, backend in registry.items():
            if name == chosen or not usable(r, name):
                continue
            if backend.reasons(r):
                with pytest.raises(BackendUnavailableError):
                    select_backend(r, name)
            elif name != "triton" or r.num_heads in TRITON_HEADS:
                key = (name, r.phase, r.num_heads, r.q_dtype, r.kv_dtype, r.need_kv_bounds)
                if key in ran:
                    continue
                ran.add(key)
                out2, lse2 = run_case(r, name)
                assert torch.isfinite(out2).all() and (lse2 is not None or not r.need_lse), (r, name)
    assert served > 0 and refused > 0


@pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
    reason="Triton needs a GPU or TRITON_INTERPRET=1",
)
@pytest.mark.parametrize("need_lse", [False, True])
def test_h96_generation_only_verify_batches_get_a_legal_backend(need_lse):
    """Kimi K3's 96 heads with a speculative-verify batch (no context requests): TRT-LLM once routed this to a
    kernel that takes only H <= 64 or H >= 128. Here the GPU choice is Triton, and it really runs H=96 verify."""
    r = AttentionRequest("verify", 96, KV_LORA + ROPE, KV_LORA, "fp16", "fp16", "cuda", need_lse, True)
    assert select_backend(r).name == "triton"
    on_cpu = AttentionRequest("verify", 96, KV_LORA + ROPE, KV_LORA, "fp16", "fp16", "cpu", need_lse, True)
    out, lse = run_case(on_cpu, "triton")
    ref_out, ref_lse = run_case(on_cpu, "torch")
    assert torch.allclose(out.float(), ref_out.float(), atol=2e-2, rtol=2e-2)
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse))


def test_forced_backend_that_cannot_serve_raises_with_reasons(monkeypatch):
    r = AttentionRequest("prefill", 8, 48, 32, "fp16", "fp16", "cpu", need_lse=True)
    with pytest.raises(BackendUnavailableError, match="'sdpa' cannot serve .*does not return LSE"):
        select_backend(r, "sdpa")
    monkeypatch.setenv("KIMI_HELIX_ATTENTION_BACKEND", "sdpa")
    with pytest.raises(BackendUnavailableError, match="does not return LSE"):
        select_backend(r)
    with pytest.raises(ValueError, match="must be one of"):
        select_backend(r, "flashmla")


def test_no_backend_lists_every_reason():
    r = AttentionRequest("verify", 8, 48, 32, "fp16", "fp16", "tpu")
    with pytest.raises(BackendUnavailableError) as err:
        select_backend(r)
    for name, why in [("torch", "device 'tpu'"), ("triton", "device 'tpu'"), ("sdpa", "no verify kernel")]:
        assert f"{name}: " in str(err.value) and why in str(err.value)


def test_triton_refuses_untileable_dims_and_says_why():
    r = AttentionRequest("decode", 4, 47, 32, "fp16", "fp16", "cuda")
    with pytest.raises(BackendUnavailableError, match="rope dim 15 is not 0 or a power of two"):
        select_backend(r, "triton")
    with pytest.raises(BackendUnavailableError, match="head_dim=47 is not a power of two or a sum of two"):
        select_backend(AttentionRequest("prefill", 4, 47, 32, "fp16", "fp16", "cuda"), "triton")
    assert select_backend(r).name == "torch"  # the switch falls back instead of failing
