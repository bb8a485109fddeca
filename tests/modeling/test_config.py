"""KimiK3Config: Kimi-Linear's config.json fields load as they are; impossible values raise naming the field."""

import pytest

from kimi_helix import ConfigError, KimiK3Config

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


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(mla_use_nope="false"), r"mla_use_nope must be true or false \(a JSON bool\), got 'false'"),
        (dict(tie_word_embeddings="false"), r"tie_word_embeddings must be true or false .*got 'false'"),
        (dict(use_grouped_topk=1), r"use_grouped_topk must be true or false .*got 1"),
        (dict(rope_theta=0), r"rope_theta must be a number > 0, got 0"),
        (dict(rope_theta=-10000.0), r"rope_theta must be a number > 0"),
        (dict(rope_theta="10000"), r"rope_theta must be a number > 0, got '10000'"),
        (dict(routed_scaling_factor=-1.0), r"routed_scaling_factor must be a number >= 0, got -1\.0"),
        (dict(routed_scaling_factor="2.446"), r"routed_scaling_factor must be a number >= 0, got '2\.446'"),
        (dict(rms_norm_eps=float("nan")), r"rms_norm_eps must be a number > 0, got nan"),
        (dict(gate_lower_bound="-5"), r"gate_lower_bound must be None or a negative number, got '-5'"),
        (dict(hidden_size=64.0), r"hidden_size must be a positive int, got 64\.0"),
        (dict(num_hidden_layers=True), r"num_hidden_layers must be a positive int, got True"),
        (dict(eos_token_id=[2, "3"]), r"eos_token_id must be an int >= 0, got '3'"),
        (dict(num_nextn_predict_layers=1), r"num_nextn_predict_layers must be 0"),
        (dict(output_router_logits=True), r"output_router_logits must be False .*got True"),
        (dict(attention_bias=True), r"attention_bias must be False"),
        (dict(attention_dropout=0.1), r"attention_dropout must be 0 .*got 0\.1"),
        (dict(pretraining_tp=2), r"pretraining_tp must be 1"),
        (dict(qk_head_dim=100), r"qk_head_dim \(100\) must equal qk_nope_head_dim \+ qk_rope_head_dim \(24\)"),
        (dict(linear_num_heads=3), r"linear_num_heads \(3\) disagrees with linear_attn_config\.num_heads \(2\)"),
        (dict(layer_types=["linear_attention"] * 4), r"layer_types \[.*\] disagrees with linear_attn_config"),
        (dict(linear_attn_config={**LAC, "kda_layers": 3}), r"linear_attn_config\.kda_layers must be a list"),
    ],
)
def test_config_values_are_type_checked(overrides, message):
    with pytest.raises(ConfigError, match=message):
        KimiK3Config(**tiny_kwargs(**overrides))


def without_moe_pattern(**overrides):
    kw = tiny_kwargs(**overrides)
    kw.pop("first_k_dense_replace")
    return kw


@pytest.mark.parametrize(
    "pattern, first_k, freq",
    [
        (["dense", "sparse", "sparse", "sparse"], 1, 1),
        (["dense", "dense", "sparse", "sparse"], 2, 1),
        (["sparse", "dense", "sparse", "dense"], 0, 2),
        (["dense", "dense", "dense", "dense"], 4, 1),
    ],
)
def test_mlp_layer_types_set_the_moe_pattern(pattern, first_k, freq):
    config = KimiK3Config(**without_moe_pattern(mlp_layer_types=pattern))
    assert (config.first_k_dense_replace, config.moe_layer_freq, config.mlp_layer_types) == (first_k, freq, pattern)


def test_mlp_layer_types_that_the_pattern_cannot_express_are_refused():
    with pytest.raises(ConfigError, match=r"mlp_layer_types \['dense', 'sparse', 'dense', 'sparse'\] cannot be expr"):
        KimiK3Config(**without_moe_pattern(mlp_layer_types=["dense", "sparse", "dense", "sparse"]))
    with pytest.raises(ConfigError, match=r"disagrees with first_k_dense_replace=1, moe_layer_freq=None"):
        KimiK3Config(**tiny_kwargs(mlp_layer_types=["dense", "dense", "sparse", "sparse"]))
    with pytest.raises(ConfigError, match=r"mlp_layer_types must list 'dense' or 'sparse' for each of the 4 layers"):
        KimiK3Config(**without_moe_pattern(mlp_layer_types=["dense", "moe", "sparse", "sparse"]))


def test_transformers_saved_config_with_late_dense_layers_loads(tmp_path):
    """transformers' KimiLinearConfig writes `mlp_layer_types` but no first_k_dense_replace: read, not dropped."""
    from transformers import KimiLinearConfig

    native = KimiLinearConfig(
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
        num_local_experts=8,
        num_experts_per_tok=2,
        mlp_layer_types=["dense", "dense", "sparse", "sparse"],
        linear_attn_config={**LAC, "kda_layers": [1, 2, 4], "full_attn_layers": [3]},
    )
    raw = native.to_dict()
    raw.pop("model_type")
    assert "first_k_dense_replace" not in raw
    config = KimiK3Config.from_dict(raw)
    assert config.mlp_layer_types == ["dense", "dense", "sparse", "sparse"]
    assert config.first_k_dense_replace == 2


def test_every_field_transformers_writes_is_read_or_refused(caplog):
    """No field of transformers' KimiLinearConfig falls through to the 'no effect' warning."""
    from transformers import KimiLinearConfig

    raw = KimiLinearConfig(num_hidden_layers=4).to_dict()
    raw.pop("model_type")
    with caplog.at_level("WARNING"):
        KimiK3Config.from_dict(raw)
    assert "have no effect" not in caplog.text
    with caplog.at_level("WARNING"):
        KimiK3Config(**tiny_kwargs(mla_use_nope_typo=False))
    assert "['mla_use_nope_typo'] are not Kimi-K3 or Kimi-Linear fields" in caplog.text


def test_a_config_that_is_not_an_object_is_a_named_error():
    with pytest.raises(ConfigError, match=r"built from a JSON object of fields, got a list"):
        KimiK3Config.from_dict([1, 2])
