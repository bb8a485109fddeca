"""KimiK3Config: Kimi-Linear's config.json fields load as they are; impossible values raise naming the field."""

import pytest

from kimi_helix import KimiK3Config

from .conftest import tiny_kwargs

LAC = {"num_heads": 2, "head_dim": 16, "short_conv_kernel_size": 4}


def test_one_based_layer_lists_map_to_layer_types():
    config = KimiK3Config(
        **tiny_kwargs(
            num_hidden_layers=5, linear_attn_config={**LAC, "kda_layers": [1, 2, 3, 5], "full_attn_layers": [4]}
        )
    )
    assert config.layer_types == ["linear_attention"] * 3 + ["full_attention", "linear_attention"]
    assert config.mlp_layer_types == ["dense", "sparse", "sparse", "sparse", "sparse"]


def test_kimi_linear_defaults_give_its_layer_pattern():
    config = KimiK3Config()
    assert [i for i, t in enumerate(config.layer_types) if t == "full_attention"] == [3, 7, 11, 15, 19, 23, 26]
    assert config.mla_cache_dim == 576 and config.qk_head_dim == 192


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            dict(linear_attn_config={**LAC, "kda_layers": [1, 2, 2], "full_attn_layers": [3, 4]}),
            r"kda_layers lists layer 2 twice",
        ),
        (
            dict(linear_attn_config={**LAC, "kda_layers": [1, 2, 3], "full_attn_layers": [3, 4]}),
            r"full_attn_layers lists layer 3 and in kda_layers",
        ),
        (
            dict(linear_attn_config={**LAC, "kda_layers": [1, 2], "full_attn_layers": [4]}),
            r"layers \[3\] are in neither",
        ),
        (
            dict(linear_attn_config={**LAC, "kda_layers": [0, 1, 2], "full_attn_layers": [4]}),
            r"kda_layers holds 0; layers are 1-based",
        ),
        (dict(linear_attn_config={**LAC, "head_dim": 0}), r"linear_attn_config.head_dim must be a positive int"),
        (dict(num_experts_per_token=9), r"num_experts_per_token \(9\) must be <= num_experts \(8\)"),
        (dict(num_expert_group=3), r"num_experts \(8\) must be divisible by num_expert_group \(3\)"),
        (dict(num_expert_group=2, topk_group=1, num_experts_per_token=5), r"exceeds the experts in the topk_group"),
        (dict(topk_group=2), r"topk_group \(2\) must be <= num_expert_group \(1\)"),
        (dict(mla_use_nope=False, qk_rope_head_dim=7), r"qk_rope_head_dim must be even"),
        (dict(kv_lora_rank=0), r"kv_lora_rank must be a positive int"),
        (dict(q_lora_rank=-1), r"q_lora_rank must be a positive int"),
        (dict(gate_lower_bound=1.0), r"gate_lower_bound must be None or a negative number"),
        (dict(moe_router_activation_func="relu"), r"moe_router_activation_func must be 'sigmoid' or 'softmax'"),
        (dict(hidden_act="gelu"), r"hidden_act must be 'silu'"),
        (dict(rope_scaling={"type": "yarn"}), r"rope_scaling must be None"),
    ],
)
def test_bad_configs_name_the_field(overrides, message):
    with pytest.raises(ValueError, match=message):
        KimiK3Config(**tiny_kwargs(**overrides))


def test_native_transformers_flat_fields_are_folded_back(tmp_path):
    config = KimiK3Config(**tiny_kwargs())
    raw = config.to_dict()
    raw.pop("linear_attn_config")
    raw.update(
        linear_num_heads=2, linear_head_dim=16, linear_conv_kernel_dim=4, layer_types=config.layer_types, qk_head_dim=24
    )
    again = KimiK3Config(**{k: v for k, v in raw.items() if k != "model_type"})
    assert again.layer_types == config.layer_types
    assert again.linear_attn_config == config.linear_attn_config
