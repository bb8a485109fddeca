"""A tiny random target (the `tiny` preset) and a drafter fitted to it, shared by the speculative tests."""

from __future__ import annotations

import pytest
import torch

from kimi_helix.modeling import KimiK3ForCausalLM
from kimi_helix.presets import get_preset
from kimi_helix.speculative.dspark import DSparkConfig, DSparkDrafter


def tiny_drafter_config(**kw) -> DSparkConfig:
    base = dict(
        vocab_size=320,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        head_dim=16,
        intermediate_size=128,
        target_layer_ids=[0, 2],
        target_num_hidden_layers=4,
        block_size=4,
        mask_token_id=258,
        markov_rank=8,
    )
    return DSparkConfig(**{**base, **kw})


@pytest.fixture
def target():
    torch.manual_seed(0)
    return KimiK3ForCausalLM(get_preset("tiny")).eval()


@pytest.fixture
def drafter(target):
    torch.manual_seed(1)
    d = DSparkDrafter(tiny_drafter_config()).eval()
    d.bind_target(target)
    return d
