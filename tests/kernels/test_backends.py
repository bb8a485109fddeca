"""The backend switch: declared capabilities match what the kernels really do, and refusals explain.

The attention truth table covers every phase x H in 1..128 x dtypes x (LSE needed, bounds needed) on this machine's
device; the op truth table every op x dtype x head dim x device. Every case is selected, and each backend that
declares it cannot serve it is shown to be refused. Each backend that declares it can (the chosen one among them)
runs it on small inputs, on the head counts of `RUN_HEADS` (no capability depends on H; these straddle every power
of two); Triton under the CPU interpreter, which is slow, on fewer (`runs_here`).
"""

import itertools
import os

import pytest
import torch

from kimi_helix.kernels.accept_stage import accept_and_stage
from kimi_helix.kernels.activation import silu_mul
from kimi_helix.kernels.backends import (
    OPS,
    PHASES,
    AttentionRequest,
    BackendChoice,
    BackendUnavailableError,
    OpRequest,
    reasons,
    registry,
    select,
)
from kimi_helix.kernels.conv import causal_conv1d, causal_conv1d_update
from kimi_helix.kernels.draft_attention import draft_attention
from kimi_helix.kernels.kda import chunk_kda, fused_recurrent_kda
from kimi_helix.kernels.linear import linear
from kimi_helix.kernels.markov import markov_chain_greedy
from kimi_helix.kernels.mla import mla_decode, mla_prefill
from kimi_helix.kernels.moe import fused_experts
from kimi_helix.kernels.norm import add_rms_norm, gated_rms_norm
from kimi_helix.kernels.norm_rotary import norm_rotary, norm_rotary_into_cache
from kimi_helix.kernels.rotary import rotary
from kimi_helix.kernels.router import moe_router
from kimi_helix.kernels.state_restore import restore_verified_states

KV_LORA, ROPE, NOPE, V_DIM = 32, 16, 32, 32  # latent 48 = 32 + 16; expanded q/k 48, v 32: Triton-tileable
RUN_HEADS = {1, 2, 3, 7, 8, 9, 15, 16, 17, 31, 32, 33, 63, 64, 65, 95, 96, 97, 127, 128}
# The interpreter: every dtype case at the small head counts (one head block, ragged blocks); the large ones, which
# cost it time in proportion, at the GPU's dtype and the kv dtypes that pick distinct tile schedules (decode: one
# full block of 64, two, a ragged second; prefill, whose heads are independent programs: the largest).
INTERPRETER_HEADS = {1, 3, 16, 17}
INTERPRETER_LARGE_HEADS = {"prefill": {128}, "decode": {64, 96, 128}, "verify": {64, 96, 128}}
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


@pytest.fixture(autouse=True)
def fresh_selection(monkeypatch):
    monkeypatch.delenv("KIMI_HELIX_ATTENTION_BACKEND", raising=False)
    monkeypatch.delenv("KIMI_HELIX_KERNEL_BACKEND", raising=False)
    select.cache_clear()
    yield
    select.cache_clear()


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
    # need_lse True first: `test_truth_table_every_choice_runs` runs each call once, and that one also checks the lse
    for phase, heads, need_lse, need_bounds in itertools.product(PHASES, range(1, 129), (True, False), (False, True)):
        dims = (NOPE + ROPE, V_DIM) if phase == "prefill" else (KV_LORA + ROPE, KV_LORA)
        kv_dtypes = ("same",) if phase == "prefill" else ("fp32", "fp16", "bf16", "fp8_e4m3")
        for q_dtype, kv in itertools.product(DTYPES, kv_dtypes):
            yield AttentionRequest(
                phase, heads, *dims, q_dtype, q_dtype if kv == "same" else kv, device, need_lse, need_bounds
            )


def runs_here(r: AttentionRequest, backend: str) -> bool:
    """Whether the truth table runs `backend` on case `r` (it checks the selection of every case)."""
    if backend != "triton" or r.device != "cpu":
        return r.num_heads in RUN_HEADS
    # The Triton interpreter computes bf16 wrongly (a known interpreter limit, not a capability): never run it.
    if "bf16" in (r.q_dtype, r.kv_dtype):
        return False
    large = r.q_dtype == "fp16" and r.kv_dtype in ("fp16", "fp8_e4m3") and not r.need_kv_bounds
    return r.num_heads in INTERPRETER_HEADS or (large and r.num_heads in INTERPRETER_LARGE_HEADS[r.phase])


def test_truth_table_every_choice_runs():
    device = "cuda" if torch.cuda.is_available() else "cpu"
    names = sorted(registry())
    served = refused = 0
    ran = set()  # a call with need_lse computes the same output, so each kernel call runs once (with it if served)
    for r in requests(device):
        try:
            chosen = select(r)
        except BackendUnavailableError as err:
            # Nothing can serve it: only prefill with per-token bounds, which no prefill kernel takes.
            assert r.phase == "prefill" and r.need_kv_bounds, (r, err)
            assert all(name in str(err) for name in names)
            refused += 1
            continue
        served += 1
        assert not reasons(chosen, r), (r, chosen)
        for name in names:
            if reasons(name, r):
                with pytest.raises(BackendUnavailableError):
                    select(r, name)
                continue
            key = (name, r.phase, r.num_heads, r.q_dtype, r.kv_dtype, r.need_kv_bounds)
            if key in ran or not runs_here(r, name):
                continue
            ran.add(key)
            out, lse = run_case(r, name)
            assert torch.isfinite(out).all() and (lse is not None or not r.need_lse), (r, name)
    assert served > 0 and refused > 0
    assert {key[0] for key in ran} == set(names)  # every backend ran some case


@pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
    reason="Triton needs a GPU or TRITON_INTERPRET=1",
)
@pytest.mark.parametrize("need_lse", [False, True])
def test_h96_generation_only_verify_batches_get_a_legal_backend(need_lse):
    """Kimi K3's 96 heads with a speculative-verify batch (no context requests): TRT-LLM once routed this to a
    kernel that takes only H <= 64 or H >= 128. Here the GPU choice is Triton, and it really runs H=96 verify."""
    r = AttentionRequest("verify", 96, KV_LORA + ROPE, KV_LORA, "fp16", "fp16", "cuda", need_lse, True)
    assert select(r) == "triton"
    on_cpu = AttentionRequest("verify", 96, KV_LORA + ROPE, KV_LORA, "fp16", "fp16", "cpu", need_lse, True)
    out, lse = run_case(on_cpu, "triton")
    ref_out, ref_lse = run_case(on_cpu, "torch")
    assert torch.allclose(out.float(), ref_out.float(), atol=2e-2, rtol=2e-2)
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse))


def test_forced_backend_that_cannot_serve_raises_with_reasons(monkeypatch):
    r = AttentionRequest("prefill", 8, 48, 32, "fp16", "fp16", "cpu", need_lse=True)
    with pytest.raises(BackendUnavailableError, match="'sdpa' cannot serve .*does not return LSE"):
        select(r, "sdpa")
    monkeypatch.setenv("KIMI_HELIX_ATTENTION_BACKEND", "sdpa")
    assert select(r) == "torch"  # selection itself never reads the environment
    with pytest.raises(BackendUnavailableError, match="does not return LSE"):
        select(r, BackendChoice.from_env().attention)
    with pytest.raises(ValueError, match="must be one of"):
        select(r, "flashmla")


def test_no_backend_lists_every_reason():
    r = AttentionRequest("verify", 8, 48, 32, "fp16", "fp16", "tpu")
    with pytest.raises(BackendUnavailableError) as err:
        select(r)
    for name, why in [("torch", "device 'tpu'"), ("triton", "device 'tpu'"), ("sdpa", "no mla_verify kernel")]:
        assert f"{name}: " in str(err.value) and why in str(err.value)


def test_triton_refuses_untileable_dims_and_says_why():
    r = AttentionRequest("decode", 4, 47, 32, "fp16", "fp16", "cuda")
    with pytest.raises(BackendUnavailableError, match="rope dim 15 is not 0 or a power of two"):
        select(r, "triton")
    with pytest.raises(BackendUnavailableError, match="head_dim=47 is not a power of two or a sum of two"):
        select(AttentionRequest("prefill", 4, 47, 32, "fp16", "fp16", "cuda"), "triton")
    assert select(r) == "torch"  # the switch falls back instead of failing


# ---------------------------------------------------------------- the other ops

OP_DTYPES = ("fp32", "fp16", "bf16")
INDEX_OPS = ("accept_and_stage",)  # ops on token ids and positions: int64 only


def run_op(r: OpRequest, backend: str) -> torch.Tensor:
    """Call the op the request describes (head dim `r.head_dim` for KDA, else 16) on small inputs; return its
    first output."""
    g = torch.Generator().manual_seed(0)
    dt = DTYPES.get(r.dtype)  # None for the ops on token ids

    def rand(*shape):
        return torch.randn(*shape, generator=g).to(dt)

    if r.op in ("chunk_kda", "fused_recurrent_kda"):
        k_dim = r.head_dim
        q, k, v = rand(1, 5, 2, k_dim), rand(1, 5, 2, k_dim), rand(1, 5, 2, k_dim)
        gate = -torch.rand(1, 5, 2, k_dim, generator=g).to(dt)
        beta = torch.rand(1, 5, 2, generator=g).to(dt)
        fn = chunk_kda if r.op == "chunk_kda" else fused_recurrent_kda
        return fn(q, k, v, gate, beta, use_qk_l2norm_in_kernel=True, backend=backend)[0]
    if r.op == "causal_conv1d":
        return causal_conv1d(rand(1, 6, 16), rand(16, 4), backend=backend)[0]
    if r.op == "causal_conv1d_update":
        return causal_conv1d_update(rand(2, 16), rand(2, 3, 16), rand(16, 4), backend=backend)
    if r.op == "gated_rms_norm":
        return gated_rms_norm(rand(3, 16), rand(3, 16), torch.ones(16, dtype=dt), 1e-6, backend=backend)
    if r.op == "add_rms_norm":
        return add_rms_norm(rand(3, 16), rand(3, 16), torch.ones(16, dtype=dt), 1e-6, backend=backend)[0]
    if r.op == "rotary":
        return rotary(rand(3, 2, 16), torch.tensor([0, 5, 9]), 10000.0, backend=backend)
    if r.op == "moe_router":
        x, w = rand(3, 16).float(), torch.randn(8, 16, generator=g)
        return moe_router(x, w, torch.zeros(8), 2, backend=backend)[0]
    if r.op == "silu_mul":
        return silu_mul(rand(3, 16), rand(3, 16), backend=backend)
    if r.op == "linear":
        return linear(rand(r.rows, 16), [rand(24, 16), rand(8, 16)], backend=backend)
    if r.op == "markov_chain_greedy":
        base, anchors = torch.randn(2, 3, 40, generator=g), torch.tensor([5, 39])
        conf = (rand(2, 3, 16), rand(16 + 8), rand(1))
        return markov_chain_greedy(base, anchors, rand(40, 8), rand(40, 8), *conf, backend=backend)[1]
    if r.op == "draft_attention":
        block, ctx = [rand(2, 3, 2, 16) for _ in range(3)], [rand(3, 5, 2, 16) for _ in range(2)]
        return draft_attention(*block, *ctx, torch.tensor([2, 0]), torch.tensor([4, 0]), backend=backend)
    if r.op == "norm_rotary":
        return norm_rotary(rand(3, 4, 16), torch.tensor([0, 5, 9]), (rand(16), rand(16)), 1e-6, 1e4, backend=backend)
    if r.op == "norm_rotary_into_cache":
        caches = [rand(2, 4, 2, 16) for _ in range(2)]
        slots, positions = torch.tensor([1, 0, 1]), torch.tensor([0, 3, 2])
        norm_rotary_into_cache(rand(3, 2, 16), rand(3, 2, 16), positions, rand(16), 1e-6, 1e4, *caches, slots,
                               backend=backend)  # fmt: skip
        return caches[0]
    if r.op == "accept_and_stage":
        argmax, ids = torch.tensor([[4, 7, 9], [5, 6, 8]]), torch.tensor([3, 4, 1, 2, 5, 6])
        out = [torch.zeros(6, dtype=torch.int64) for _ in range(3)]
        result, where = torch.zeros(2, 4, dtype=torch.int64), torch.zeros(2, 6, dtype=torch.int64)
        inputs, table = torch.tensor([[3, 2], [0, 9], [1, 0]]), torch.arange(8, dtype=torch.int32).view(2, 4)
        seqlens = torch.zeros(2, dtype=torch.int32)
        accept_and_stage(argmax, inputs, ids, *out[:2], seqlens, table, result, where, 4, backend=backend)
        return result
    if r.op == "restore_verified_states":
        pools, conv = rand(2, 3, 2, 4, 4).float(), rand(2, 3, 3, 16)
        states, inputs, before = rand(2, 6, 2, 4, 4).float(), rand(2, 6, 16), rand(2, 2, 3, 16)
        slots, accepted = torch.tensor([2, 0]), torch.tensor([1, 2])
        restore_verified_states(pools, conv, states, inputs, before, slots, accepted, 3, backend=backend)
        return conv
    assert r.op == "fused_experts", r.op
    ids = torch.tensor([[0, 1], [2, 0], [1, 3]])
    weights = torch.rand(3, 2, generator=g)
    return fused_experts(rand(3, 16), rand(4, 32, 16), rand(4, 16, 16), weights, ids, backend=backend)


def op_requests(device: str):
    for op in OPS:
        for dtype in ("int64",) if op in INDEX_OPS else OP_DTYPES:
            for head_dim in (16, 72) if "kda" in op else (0,):
                for rows in (1, 16, 17) if op == "linear" else (0,):
                    yield OpRequest(op, dtype, device, head_dim, rows)


def test_op_truth_table_every_choice_runs():
    """Every op x dtype x KDA head dim on this machine's device: the chosen backend runs and gives finite output;
    every other backend that declares it can serve the case runs too, and one that declares it cannot is refused.
    The same cases on a (simulated) CUDA request choose Triton where it declares support and torch elsewhere."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    for r in op_requests(device):
        chosen = select(r)
        assert torch.isfinite(run_op(r, chosen).float()).all(), (r, chosen)
        for name in sorted(registry()):
            if name == chosen or (name == "triton" and device == "cpu" and r.dtype == "bf16"):
                continue
            if reasons(name, r):
                with pytest.raises(BackendUnavailableError):
                    select(r, name)
            else:
                assert torch.isfinite(run_op(r, name).float()).all(), (r, name)
    for r in op_requests("cuda"):
        assert select(r) == ("torch" if r.head_dim == 72 or r.rows > 16 else "triton"), r


def test_op_that_triton_declines_on_cuda_falls_back_to_torch():
    """KDA head_dim 72 on CUDA: Triton declines, "sdpa" (in the priority, no such op) is skipped with its reason,
    and the torch reference serves, instead of a KeyError."""
    for op in ("chunk_kda", "fused_recurrent_kda"):
        r = OpRequest(op, "bf16", "cuda", head_dim=72)
        assert select(r) == "torch"
        with pytest.raises(BackendUnavailableError, match="head_dim=72 is not a power of two in \\[16, 256\\]"):
            select(r, "triton")
        with pytest.raises(BackendUnavailableError, match=f"'sdpa' cannot serve .*no {op} kernel"):
            select(r, "sdpa")
    with pytest.raises(BackendUnavailableError) as err:
        select(OpRequest("gated_rms_norm", "fp16", "tpu"))
    assert "sdpa: no gated_rms_norm kernel" in str(err.value) and "torch: device 'tpu'" in str(err.value)


def test_environment_is_read_when_the_choice_is_built(monkeypatch):
    """The variables count when a model or LLM is built (`BackendChoice.from_env`), not at the first call; an
    argument wins over the variable, and a bad name is refused with the allowed ones."""
    assert BackendChoice.from_env() == BackendChoice(None, None)
    monkeypatch.setenv("KIMI_HELIX_KERNEL_BACKEND", "torch")
    monkeypatch.setenv("KIMI_HELIX_ATTENTION_BACKEND", "sdpa")
    assert BackendChoice.from_env() == BackendChoice("sdpa", "torch")
    assert BackendChoice.from_env(attention="triton", kernels="triton") == BackendChoice("triton", "triton")
    with pytest.raises(
        ValueError, match=r"kernel_backend \(or \$KIMI_HELIX_KERNEL_BACKEND\) must be None .* \['torch', 'triton'\]"
    ):
        BackendChoice(kernels="sdpa")
    with pytest.raises(ValueError, match=r"attention_backend \(or \$KIMI_HELIX_ATTENTION_BACKEND\) must be None"):
        BackendChoice(attention="flashmla")
