"""On the GPU (Triton kernels): verify-phase logits in a mixed step equal the torch backend's, and greedy decoding
with verify groups gives the same tokens as plain greedy decoding."""

import pytest
import torch

from kimi_helix import KimiK3Config, KimiK3ForCausalLM
from kimi_helix.engine import LLM, SamplingParams
from kimi_helix.engine.scheduler import Request, ScheduledStep
from kimi_helix.modeling.batch import Phase

from ..modeling.conftest import k3_kwargs, randomize_router_bias, rel_err, tiny_kwargs
from .test_phases import with_drafts

pytestmark = pytest.mark.gpu

MODELS = pytest.mark.parametrize("kwargs", [tiny_kwargs(), k3_kwargs()], ids=["kimi-linear", "k3-style"])


def _model(kwargs):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    torch.manual_seed(0)
    # Triton tiles need power-of-two widths: a latent of 64 + 16 and expanded heads of 32 + 16 / 32.
    kwargs = {**kwargs, "kv_lora_rank": 64, "qk_rope_head_dim": 16, "qk_nope_head_dim": 32, "v_head_dim": 32}
    model = KimiK3ForCausalLM(KimiK3Config(**kwargs)).eval()
    randomize_router_bias(model)
    return model.to("cuda")


def _prompts(lengths, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 128, (n,), generator=g).tolist() for n in lengths]


def _mixed_step_logits(model, backend):
    """Prefill two prompts, then one step of a verify group (1 + 5 tokens), a decode and a prefill chunk."""
    llm = LLM(model, page_size=16, attention_backend=backend, kernel_backend=backend)
    a, b, c, extra = _prompts([37, 20, 50, 6])
    ra, rb, rc = (
        Request(i, None, p, SamplingParams(max_tokens=16, prompt_logprobs=0), None) for i, p in enumerate((a, b, c))
    )
    for r in (ra, rb, rc):
        llm.cache.ledger.admit(r.request_id, r.reserve_tokens)

    def run(step):
        out = llm.runner.run(step)
        for r, t in zip(step.requests, step.token_ids):
            r.num_computed += len(t)
        return out

    run(ScheduledStep([ra, rb], [Phase.PREFILL] * 2, [a, b]))
    return run(ScheduledStep([ra, rb, rc], [Phase.VERIFY, Phase.DECODE, Phase.PREFILL], [extra, [7], c[:33]])).logits


@MODELS
def test_mixed_verify_step_on_gpu_matches_torch_backend(kwargs):
    model = _model(kwargs)
    reference = _mixed_step_logits(model, "torch")
    fast = _mixed_step_logits(model, None)
    err = rel_err(fast, reference)
    print(f"mixed verify/decode/prefill step, Triton vs torch backend: relative logit error {err:.2e}")
    assert fast.shape == reference.shape == (6 + 1 + 33, model.config.vocab_size)
    assert err < 1e-3


@MODELS
def test_greedy_with_verify_groups_on_gpu_equals_plain_greedy(kwargs):
    model = _model(kwargs)
    ps = _prompts([7, 100, 1, 65], seed=2)
    greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    plain = [o.token_ids for o in LLM(model, page_size=16).generate(ps, greedy)]
    llm = LLM(model, page_size=16, max_num_batched_tokens=48)
    seen = with_drafts(llm, dict(enumerate(plain)), k=3)
    assert [o.token_ids for o in llm.generate(ps, greedy)] == plain
    assert any({Phase.VERIFY, Phase.PREFILL} <= phases for phases in seen)  # verify groups beside prefill chunks
