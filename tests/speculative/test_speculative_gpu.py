"""On the GPU (Triton kernels, the recurrent KDA kernel's per-token states): greedy speculative decoding with forced
partial acceptance, ngram and DSpark proposers equals plain greedy decoding, token for token.

Run on the H200: `python -m pytest -m gpu tests/speculative/test_speculative_gpu.py`."""

from __future__ import annotations

import pytest
import torch

from kimi_helix import KimiK3Config, KimiK3ForCausalLM
from kimi_helix.engine import LLM, SamplingParams
from kimi_helix.speculative.dspark import DSparkDrafter

from ..modeling.conftest import k3_kwargs, randomize_router_bias, tiny_kwargs
from .conftest import OracleProposer, tiny_drafter_config

pytestmark = pytest.mark.gpu

GREEDY = SamplingParams(max_tokens=28, temperature=0.0, ignore_eos=True)


@pytest.fixture(params=["kimi-linear", "k3-style"])
def model(request):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    torch.manual_seed(0)
    kwargs = tiny_kwargs() if request.param == "kimi-linear" else k3_kwargs()
    # Triton tiles need power-of-two widths: a latent of 64 + 16 and expanded heads of 32 + 16 / 32.
    kwargs = {**kwargs, "kv_lora_rank": 64, "qk_rope_head_dim": 16, "qk_nope_head_dim": 32, "v_head_dim": 32}
    m = KimiK3ForCausalLM(KimiK3Config(**kwargs)).eval()
    randomize_router_bias(m)
    return m.to("cuda")


def _prompts():
    g = torch.Generator().manual_seed(2)
    return [torch.randint(3, 128, (n,), generator=g).tolist() for n in (7, 100, 1, 65)]


@pytest.mark.parametrize("k", [1, 3, 5])
def test_forced_partial_acceptance_on_gpu_equals_plain_greedy(model, k):
    ps = _prompts()
    plain = [o.token_ids for o in LLM(model, page_size=16).generate(ps, GREEDY)]
    oracle = {i: {"prompt": p, "out": o} for i, (p, o) in enumerate(zip(ps, plain))}
    spec = {"method": "custom", "num_speculative_tokens": k}
    llm = LLM(
        model,
        page_size=16,
        speculative_config=spec,
        proposer=OracleProposer(oracle, plain_ids={1}, vocab=model.config.vocab_size),
    )
    assert [o.token_ids for o in llm.generate(ps, GREEDY)] == plain
    assert all(0 < a < 1 for a in llm.speculative.metrics.acceptance_by_position)


def test_ngram_and_dspark_on_gpu_equal_plain_greedy(model, tmp_path):
    ps = _prompts()
    plain = [o.token_ids for o in LLM(model, page_size=16).generate(ps, GREEDY)]
    cfg = model.config
    drafter_cfg = tiny_drafter_config(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, mask_token_id=cfg.vocab_size - 1, block_size=5
    )
    DSparkDrafter(drafter_cfg).save_pretrained(tmp_path)
    for spec in (
        {"method": "ngram", "num_speculative_tokens": 3},
        {"method": "dspark", "model": str(tmp_path), "num_speculative_tokens": 5},
    ):
        llm = LLM(model, page_size=16, speculative_config=spec)
        assert [o.token_ids for o in llm.generate(ps, GREEDY)] == plain, spec["method"]
