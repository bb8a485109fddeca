"""Exact parity with transformers' native KimiLinearForCausalLM (fp32, CPU).

The reference is built with random weights, saved with `save_pretrained` (Moonshot tensor names) and loaded with
our classes; logits must agree to 1e-4 relative and greedy generation must give the same 32 tokens.
"""

import pytest
import torch
from transformers import AutoModelForCausalLM

import kimi_helix
from kimi_helix import KimiK3ForCausalLM

from .conftest import randomize_router_bias, rel_err, tiny_kwargs

transformers_kimi = pytest.importorskip("transformers.models.kimi_linear.modeling_kimi_linear")

CASES = {
    "kda-kda-mla-kda": dict(),
    "mla-first-qlora": dict(
        num_hidden_layers=3,
        q_lora_rank=24,
        linear_attn_config={
            "kda_layers": [2, 3],
            "full_attn_layers": [1],
            "num_heads": 2,
            "head_dim": 16,
            "short_conv_kernel_size": 4,
        },
    ),
    "two-mla-dense2-grouped": dict(
        num_hidden_layers=5,
        first_k_dense_replace=2,
        num_expert_group=2,
        topk_group=1,
        num_experts_per_token=3,
        num_shared_experts=2,
        linear_attn_config={
            "kda_layers": [1, 3, 4],
            "full_attn_layers": [2, 5],
            "num_heads": 3,
            "head_dim": 8,
            "short_conv_kernel_size": 3,
        },
    ),
}


def reference_model(overrides: dict, seed: int):
    kw = tiny_kwargs(**overrides)
    lac = kw.pop("linear_attn_config")
    kw["num_local_experts"] = kw.pop("num_experts")
    kw["num_experts_per_tok"] = kw.pop("num_experts_per_token")
    kw["n_shared_experts"] = kw.pop("num_shared_experts")
    kw["n_group"] = kw.pop("num_expert_group", 1)
    torch.manual_seed(seed)
    config = transformers_kimi.KimiLinearConfig(linear_attn_config=lac, **kw)
    model = transformers_kimi.KimiLinearForCausalLM(config).eval()
    randomize_router_bias(model, seed)
    return model


@pytest.mark.parametrize("name", list(CASES))
def test_logits_and_greedy_generation_match_transformers(name, tmp_path):
    ref = reference_model(CASES[name], seed=len(name))
    ref.save_pretrained(tmp_path)
    ours = KimiK3ForCausalLM.from_pretrained(tmp_path)
    assert ours.config.layer_types == ref.config.layer_types

    g = torch.Generator().manual_seed(1)
    for batch, length in [(1, 1), (2, 70), (3, 130)]:
        ids = torch.randint(3, 128, (batch, length), generator=g)
        with torch.no_grad():
            expected, actual = ref(ids).logits, ours(ids).logits
        assert rel_err(actual, expected) < 1e-4, (name, batch, length, rel_err(actual, expected))

    prompt = torch.randint(3, 128, (2, 37), generator=g)
    kw = dict(max_new_tokens=32, min_new_tokens=32, do_sample=False)
    assert torch.equal(ours.generate(prompt, **kw), ref.generate(prompt, **kw))


def test_auto_model_loads_kimi_linear_checkpoint_into_kimi_helix(tmp_path):
    ref = reference_model({}, seed=3)
    ref.save_pretrained(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert isinstance(model, kimi_helix.KimiK3ForCausalLM)
    ids = torch.randint(3, 128, (2, 65), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert rel_err(model(ids).logits, ref(ids).logits) < 1e-4


def test_left_padded_batch_matches_transformers_on_real_tokens(tmp_path):
    ref = reference_model({}, seed=4)
    ref.save_pretrained(tmp_path)
    ours = KimiK3ForCausalLM.from_pretrained(tmp_path)
    ids = torch.randint(3, 128, (2, 40), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    mask[0, :11] = 0
    with torch.no_grad():
        expected, actual = ref(ids, attention_mask=mask).logits, ours(ids, attention_mask=mask).logits
    real = mask.bool()
    assert rel_err(actual[real], expected[real]) < 1e-4
