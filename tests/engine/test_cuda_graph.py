"""On the GPU: CUDA-graph steps (`engine.cuda_graph`) give the tokens and logits of eager steps, for decode and
verify, padded rows leave every live sequence's state alone, and the kernels per replayed decode step are recorded.
"""

from __future__ import annotations

import pytest
import torch

from kimi_helix import KimiK3Config, KimiK3ForCausalLM
from kimi_helix.engine import LLM, SamplingParams
from kimi_helix.engine.cuda_graph import SCRATCH_SEQ_ID, GraphKey, default_buckets
from kimi_helix.modeling.batch import Phase

from ..modeling.conftest import randomize_router_bias, tiny_kwargs

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


def test_default_buckets_cover_every_batch_size():
    for max_seqs in (1, 3, 64, 100, 256):
        buckets = default_buckets(max_seqs)
        assert buckets == tuple(sorted(set(buckets))) and buckets[-1] == max_seqs and buckets[0] == 1


def _model() -> KimiK3ForCausalLM:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    torch.manual_seed(0)
    # Triton tiles need power-of-two widths (latent 64 + 16): every op of the step then has a capture-safe kernel.
    kwargs = tiny_kwargs(kv_lora_rank=64, qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=32)
    model = KimiK3ForCausalLM(KimiK3Config(**kwargs)).eval()
    randomize_router_bias(model)
    return model.to("cuda")


def _prompts(n: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(n)
    return [torch.randint(3, 128, (int(torch.randint(1, 40, (1,), generator=g)),), generator=g).tolist() for _ in
            range(n)]  # fmt: skip


def _llm(model, eager: bool) -> LLM:
    return LLM(model, max_num_seqs=16, max_model_len=128, enforce_eager=eager, page_size=16)


@pytest.mark.gpu
@pytest.mark.parametrize("num_prompts", [1, 3, 5, 16], ids=lambda n: f"b{n}")
def test_graph_decode_gives_the_eager_tokens(num_prompts):
    """Greedy generation with graphs (batch sizes that pad to a bucket, and one that fills it) equals eager."""
    model = _model()
    prompts = _prompts(num_prompts)
    eager = [o.token_ids for o in _llm(model, eager=True).generate(prompts, GREEDY)]
    llm = _llm(model, eager=False)
    graphed = [o.token_ids for o in llm.generate(prompts, GREEDY)]
    assert graphed == eager
    assert any(k.phase is Phase.DECODE for k in llm.runner.graphs.graphs), llm.runner.graphs.uncapturable


def _prefilled(llm: LLM, prompts: list[list[int]]):
    """Requests whose prompts are prefilled and first tokens sampled (eager steps): ready to decode or verify."""
    requests = [llm._make_request(p, GREEDY) for p in prompts]
    for r in requests:
        llm.scheduler.add(r)
    while any(r.prefilling or not r.output_ids for r in requests):
        llm.step()
    return requests


@pytest.mark.gpu
@pytest.mark.parametrize("k", [1, 4], ids=lambda k: f"k{k}")
def test_graph_verify_gives_the_eager_logits(k):
    """A verify step of 1 + k tokens for 3 sequences (padded to bucket 4): graph logits equal eager ones."""
    model = _model()
    prompts = _prompts(3)
    outs = []
    for eager in (True, False):
        llm = _llm(model, eager)
        for i, r in enumerate(_prefilled(llm, prompts)):
            r.draft_token_ids = [(7 * i + j) % 100 + 3 for j in range(k)]
        step = llm.scheduler.schedule()
        assert step.phases == [Phase.VERIFY] * 3
        out = llm.runner.run(step)
        outs.append((out.logits.clone(), out.rows))
        if not eager:
            assert GraphKey(Phase.VERIFY, 4, 1 + k) in llm.runner.graphs.graphs, llm.runner.graphs.uncapturable
    (eager_logits, eager_rows), (graph_logits, graph_rows) = outs
    assert eager_rows == graph_rows
    torch.testing.assert_close(graph_logits, eager_logits, rtol=1e-4, atol=1e-4)
    assert torch.equal(graph_logits.argmax(-1), eager_logits.argmax(-1))


@pytest.mark.gpu
def test_padded_rows_touch_only_the_scratch_sequence():
    """3 live sequences replay bucket 4: no state slot or page but theirs and the scratch sequence's changes."""
    model = _model()
    llm = _llm(model, eager=False)
    requests = _prefilled(llm, _prompts(3))
    ledger = llm.cache.ledger
    live = {ledger.seqs[r.request_id].slot for r in requests} | {ledger.seqs[SCRATCH_SEQ_ID].slot}
    live_pages = {p for s in [*(r.request_id for r in requests), SCRATCH_SEQ_ID] for p in ledger.seqs[s].pages}
    for t in (*llm.cache.conv.values(), *llm.cache.recurrent.values(), *llm.cache.pages.values()):
        t.normal_()  # every slot and page holds a value padding could overwrite
    before = {name: t.clone() for name, t in _pools(llm).items()}
    step = llm.scheduler.schedule()
    llm.runner.run(step)
    assert GraphKey(Phase.DECODE, 4, 1) in llm.runner.graphs.graphs
    for name, t in _pools(llm).items():
        kind = name.split(":")[0]
        others = [i for i in range(t.shape[0]) if i not in (live_pages if kind == "pages" else live)]
        assert torch.equal(t[others], before[name][others]), f"{name}: a padded row wrote outside the scratch"


def _pools(llm: LLM) -> dict[str, torch.Tensor]:
    pools = {f"pages:{i}": t for i, t in llm.cache.pages.items()}
    pools.update({f"conv:{i}": t for i, t in llm.cache.conv.items()})
    pools.update({f"recurrent:{i}": t for i, t in llm.cache.recurrent.items()})
    return pools


@pytest.mark.gpu
@pytest.mark.parametrize("batch", [1, 8])
def test_kernels_per_replayed_decode_step_are_recorded(batch, record_property):
    """Counts the CUDA kernels of one replayed decode step (recorded, not asserted against a budget)."""
    from torch.profiler import ProfilerActivity, profile

    model = _model()
    llm = _llm(model, eager=False)
    _prefilled(llm, _prompts(batch))
    llm.step()  # captures the decode graph of this bucket
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        llm.step()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type.name == "CUDA" and "memcpy" not in e.name.lower()]
    kernels = [e for e in kernels if "memset" not in e.name.lower()]
    layers = model.config.num_hidden_layers
    print(f"decode step, batch {batch}: {len(kernels)} kernels, {len(kernels) / layers:.1f} a layer")
    record_property("kernels_per_step", len(kernels))
    assert kernels, "the profiler saw no kernel of the replayed graph"
