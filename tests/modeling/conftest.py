"""Tiny configs shared by the modelling tests."""

import pytest
import torch

from kimi_helix import KimiK3Config


def tiny_kwargs(**overrides) -> dict:
    """Kwargs of a small Kimi-Linear-shaped config: 4 layers (KDA, KDA, MLA, KDA), 8 experts top-2."""
    kw = dict(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_hidden_layers=4,
        num_attention_heads=4,
        kv_lora_rank=16,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        num_experts=8,
        num_experts_per_token=2,
        num_shared_experts=1,
        first_k_dense_replace=1,
        linear_attn_config={
            "kda_layers": [1, 2, 4],
            "full_attn_layers": [3],
            "num_heads": 2,
            "head_dim": 16,
            "short_conv_kernel_size": 4,
        },
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    kw.update(overrides)
    return kw


def k3_kwargs(**overrides) -> dict:
    """The tiny config with every K3-style switch on."""
    return tiny_kwargs(
        num_attention_heads=6,
        q_lora_rank=24,
        mla_use_output_gate=True,
        mla_use_nope=False,
        gate_lower_bound=-5.0,
        use_full_rank_gate=True,
        **overrides,
    )


@pytest.fixture
def tiny_config() -> KimiK3Config:
    return KimiK3Config(**tiny_kwargs())


def randomize_router_bias(model: torch.nn.Module, seed: int = 0) -> None:
    """Give every `e_score_correction_bias` random values so tests see it steer selection."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("e_score_correction_bias"):
                p.copy_(torch.rand(p.shape, generator=g) * 0.5)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()
