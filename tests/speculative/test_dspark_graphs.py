"""DSpark's serving path: the static-buffer feature capture, the per-slot context cache and CUDA graphs.

CPU: the static capture gives the hook capture's features; graph-safe hooks keep target steps on the graph path
(static-buffer steps, `StepGraphs(use_graphs=False)`) with the eager output; the context cache drafts what the
drafter drafts from freshly computed contexts, also after it grows. GPU (`-m gpu`): graphed target steps capture
the eager steps' features, draft graphs give the eager drafts, and DSpark on the demo model in fp32 with every
graph on equals plain greedy decoding.
"""

from __future__ import annotations

import pytest
import torch

from kimi_helix import KimiK3Config, KimiK3ForCausalLM
from kimi_helix.engine import LLM, SamplingParams
from kimi_helix.engine.cuda_graph import StepGraphs
from kimi_helix.modeling.batch import Phase
from kimi_helix.speculative.dspark import DSparkDrafter, SlotContext, TargetFeatureCapture
from kimi_helix.speculative.proposers import DSparkProposer, ProposalRequest

from ..modeling.conftest import randomize_router_bias, tiny_kwargs
from .conftest import tiny_drafter_config

GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)


def _cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    return torch.device("cuda")


def _drafter_dir(model, path):
    cfg = model.config
    torch.manual_seed(3)
    config = tiny_drafter_config(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, mask_token_id=cfg.vocab_size - 1, block_size=5
    )
    DSparkDrafter(config).save_pretrained(path)
    return path


@pytest.mark.parametrize("layer_ids", [[0, 2], [2, 0, 1]], ids=str)
def test_static_capture_returns_the_hook_captures_features(target, layer_ids):
    """The static buffer's columns follow `layer_ids` order, whichever captured layer runs last."""
    ids = torch.randint(0, 256, (1, 11), generator=torch.Generator().manual_seed(0))
    static = TargetFeatureCapture(target, layer_ids, max_tokens=16)
    static.buffer.fill_(float("nan"))  # rows past the forward's tokens stay poisoned: pop never shows them
    with TargetFeatureCapture(target, layer_ids) as hooked, static:
        target(ids)
        want = hooked.pop()
    got = static.pop(11)
    torch.testing.assert_close(got, want.reshape(11, -1), rtol=0, atol=0)
    assert static.buffer[11:].isnan().all()
    with pytest.raises(ValueError, match="num_tokens"):
        static.pop(17)


def test_graph_safe_capture_keeps_target_steps_on_the_graph_path(target, tmp_path):
    """DSpark with every uniform step run from the graphs' static buffers (what a replay runs) equals the eager
    engine: the capture's hooks do not push steps off the graph path, and the features they copy are right."""
    spec = {"method": "dspark", "model": str(_drafter_dir(target, tmp_path)), "num_speculative_tokens": 3}
    prompts = [[5, 9, 11, 3, 7], [8, 8, 2]]
    outs = []
    for graphs in (False, True):
        llm = LLM(target, device="cpu", page_size=16, max_num_seqs=4, speculative_config=spec)
        if graphs:
            llm.runner.graphs = StepGraphs(llm.runner, use_graphs=False)
        outs.append([o.token_ids for o in llm.generate(prompts, GREEDY)])
    assert any(key.phase is Phase.VERIFY for key in llm.runner.graphs.graphs)
    assert outs[0] == outs[1]
    plain = LLM(target, device="cpu", page_size=16, max_num_seqs=4).generate(prompts, GREEDY)
    assert outs[0] == [o.token_ids for o in plain]


def _features(target, ids):
    with TargetFeatureCapture(target, [0, 2]) as cap:
        target(torch.tensor([ids]))
        return cap.pop()  # packed [T, m*d]: the HF forward runs the packed layers too


def test_context_cache_drafts_like_fresh_contexts_and_survives_growth(target, drafter):
    """Two requests in a proposer that starts with one slot (so the slots double), one of them longer than the
    initial 256 rows (so the capacity doubles), rolled back and re-observed: its drafts equal the drafter's own
    from contexts computed from scratch."""
    g = torch.Generator().manual_seed(1)
    a, b = torch.randint(0, 256, (300,), generator=g).tolist(), torch.randint(0, 256, (9,), generator=g).tolist()
    prop = DSparkProposer(drafter, max_seqs=1)
    prop.observe(1, 0, _features(target, b[:-1]))
    feats = _features(target, a[:-1])
    prop.observe_step([2], [0], [200], feats[:200])
    prop.rollback(2, 150)  # drop 50 rows, then write the rest again at their positions
    prop.observe_step([2], [150], [149], feats[150:])
    assert prop.cache.slots == 2 and prop.cache.capacity == 512 and prop.context_len(2) == 299
    got = prop.propose([ProposalRequest(2, a, 4), ProposalRequest(1, b, 4)])
    for ids, proposal in ((a, got[0]), (b, got[1])):
        p = len(ids) - 1
        ctx = drafter.context_keys_values(_features(target, ids[:-1]), torch.arange(p))
        ctx = [(k[None], v[None]) for k, v in ctx]
        context = SlotContext(ctx, torch.tensor([0]), torch.tensor([p]))
        want = drafter.draft(torch.tensor(ids[-1:]), torch.tensor([p]), context, 4, [0.0], [None])
        assert proposal.token_ids == want.tokens[0].tolist() and proposal.probs is None
        torch.testing.assert_close(torch.tensor(proposal.confidence), want.confidence[0])


# ---------------------------------------------------------------- GPU


def _gpu_target():
    """A tiny random target with the power-of-two widths the Triton kernels tile (as tests/engine/test_cuda_graph),
    on the CPU: move it once its CPU features are taken."""
    _cuda()
    torch.manual_seed(0)
    kwargs = tiny_kwargs(kv_lora_rank=64, qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=32)
    model = KimiK3ForCausalLM(KimiK3Config(**kwargs)).eval()
    randomize_router_bias(model)
    return model


@pytest.mark.gpu
def test_draft_graphs_give_the_eager_drafts(tmp_path):
    """The same contexts in a graphed and an eager proposer (3 requests: bucket 4 pads one row): identical draft
    tokens, confidences equal to fp32 rounding."""
    target = _gpu_target()
    g = torch.Generator().manual_seed(2)
    seqs = [torch.randint(3, 120, (n,), generator=g).tolist() for n in (7, 20, 2)]
    feats = [_features(target, ids[:-1]) for ids in seqs]  # on the CPU (torch references)
    target.to("cuda")
    drafter = DSparkDrafter.from_pretrained(_drafter_dir(target, tmp_path), device="cuda")
    drafter.bind_target(target)
    props = [DSparkProposer(drafter, max_seqs=4, use_graphs=use) for use in (False, True)]
    for prop in props:
        for i, f in enumerate(feats):
            prop.observe(i, 0, f.to("cuda"))
    asks = [ProposalRequest(i, ids, 4) for i, ids in enumerate(seqs)]
    eager, graphed = (p.propose(asks) for p in props)
    assert props[1].graphs.graphs and props[1].graphs.writes, "no draft or context-write graph was captured"
    for e, r in zip(eager, graphed):
        assert e.token_ids == r.token_ids and len(e.token_ids) == 4
        torch.testing.assert_close(torch.tensor(r.confidence), torch.tensor(e.confidence), rtol=1e-5, atol=1e-6)


@pytest.mark.gpu
def test_graphed_target_steps_capture_the_eager_features(tmp_path):
    """One request of a 16-token prompt (prefill bucket 16 and decode bucket 1: the graphed steps have the eager
    steps' shapes), DSpark k=3: every feature the proposer observes is bit-identical between CUDA-graphed and eager
    target steps (synchronous rounds: the overlapped ones hand features to the drafter on the device,
    `test_async_rounds.py`)."""
    model = _gpu_target().to("cuda")
    spec = {"method": "dspark", "model": str(_drafter_dir(model, tmp_path)), "num_speculative_tokens": 3}
    seen = {}
    for eager in (True, False):
        llm = LLM(model, page_size=16, max_num_seqs=2, enforce_eager=eager, speculative_config=spec,
                  async_scheduling=False)  # fmt: skip
        proposer, record = llm.speculative.proposer, seen.setdefault(eager, [])
        observe = proposer.observe_step

        def observe_step(ids, starts, counts, features, observe=observe, record=record):
            record.append((list(starts), features.clone()))
            observe(ids, starts, counts, features)

        proposer.observe_step = observe_step
        llm.generate([[5, 9, 11, 3, 7, 4, 4, 9] * 2], GREEDY)
    assert {key.phase for key in llm.runner.graphs.graphs} >= {Phase.PREFILL, Phase.VERIFY}
    assert len(seen[True]) > 2 and [s for s, _ in seen[True]] == [s for s, _ in seen[False]]
    for (_, e), (_, r) in zip(seen[True], seen[False]):
        torch.testing.assert_close(r, e, rtol=0, atol=0)


@pytest.mark.gpu
def test_dspark_on_the_demo_model_with_graphs_equals_plain_greedy_fp32():
    """The demo model and its shipped drafter in fp32 on the GPU, target and draft graphs on, k=5, two prompts
    at once: DSpark's greedy output equals plain greedy decoding's token for token, with the next round's drafts
    replayed from the device's acceptance (`draft_ahead`, with the verify step's context write) and served
    (synchronous rounds; `test_async_rounds.py` covers the overlapped ones)."""
    _cuda()
    prompts = [[5, 17, 99, 240, 31, 8], [77, 1000, 12, 5]]
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    plain = [o.token_ids for o in LLM(dtype=torch.float32, page_size=16, max_num_seqs=4).generate(prompts, params)]
    spec = {"method": "dspark", "num_speculative_tokens": 5}
    llm = LLM(dtype=torch.float32, page_size=16, max_num_seqs=4, speculative_config=spec, async_scheduling=False)
    assert [o.token_ids for o in llm.generate(prompts, params)] == plain
    assert any(key.phase is Phase.VERIFY for key in llm.runner.graphs.graphs)
    graphs = llm.speculative.proposer.graphs
    assert graphs.graphs and graphs.writes and not graphs.failed and llm.speculative.metrics.rounds > 0
    assert llm.speculative.proposer.served_ahead > 0
    # each round's acceptance, its verify step's context write and the next draft ran as one replay
    assert any(key[-1] is not None for key in graphs.advances)
