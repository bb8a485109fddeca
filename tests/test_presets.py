import inspect

import pytest

from kimi_helix.modeling.accounting import count_parameters
from kimi_helix.modeling.config import KimiK3Config
from kimi_helix.presets import _SIZE_DEFAULTS, PRESETS, get_preset, preset_parameters
from kimi_helix.tokenizer import build_byte_tokenizer

K3_SWITCHES = {"mla_use_output_gate": True, "gate_lower_bound": -5.0, "use_full_rank_gate": True, "mla_use_nope": False}


@pytest.mark.parametrize("name", list(PRESETS))
def test_every_preset_builds(name):
    assert get_preset(name).to_dict()["model_type"] == "kimi_k3"


def test_unknown_preset_lists_the_known_ones():
    with pytest.raises(ValueError, match="unknown preset 'nope'") as err:
        get_preset("nope")
    for name in PRESETS:
        assert name in str(err.value)


def test_configs_do_not_share_state_with_the_preset():
    get_preset("tiny").linear_attn_config["kda_layers"].append(99)
    assert PRESETS["tiny"]["linear_attn_config"]["kda_layers"] == [1, 2, 4]


def test_kimi_linear_48b_layout():
    c = get_preset("kimi-linear-48b-a3b")
    assert [i for i, t in enumerate(c.layer_types) if t == "full_attention"] == [3, 7, 11, 15, 19, 23, 26]
    assert c.mlp_layer_types == ["dense"] + ["sparse"] * 26
    assert (c.q_lora_rank, c.mla_use_nope, c.gate_lower_bound, c.use_full_rank_gate) == (None, True, None, False)
    assert (c.bos_token_id, c.eos_token_id, c.pad_token_id) == (163584, 163586, 163839)


def test_k3_style_changes_only_the_attention_switches():
    base, k3 = PRESETS["kimi-linear-48b-a3b"], PRESETS["kimi-k3-style"]
    changed = {k: v for k, v in k3.items() if base.get(k) != v}
    derived = {"num_key_value_heads": 96, "head_dim": 24}  # unused by MLA and KDA; they track the head count
    assert changed == {**K3_SWITCHES, "num_attention_heads": 96, "q_lora_rank": 1536, **derived}


def test_tiny_k3_is_tiny_with_the_k3_switches():
    base, k3 = PRESETS["tiny"], PRESETS["tiny-k3"]
    changed = {k: v for k, v in k3.items() if base.get(k) != v}
    assert changed == {**K3_SWITCHES, "num_attention_heads": 6, "num_key_value_heads": 6, "q_lora_rank": 16}


@pytest.mark.parametrize("name", ["tiny", "tiny-k3"])
def test_tiny_presets_match_the_byte_tokenizer(name):
    c, tok = get_preset(name), build_byte_tokenizer()
    assert c.vocab_size >= len(tok)
    assert (c.bos_token_id, c.eos_token_id, c.pad_token_id) == (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id)
    assert [t == "full_attention" for t in c.layer_types] == [False, False, True, False]


@pytest.mark.parametrize("name", list(PRESETS))
def test_preset_parameters_equal_the_models_count(name):
    """`kimi-helix presets` counts by arithmetic (no torch); the model built on the meta device must agree."""
    assert preset_parameters(name) == count_parameters(get_preset(name))


def test_size_defaults_are_the_config_classes():
    defaults = {k: p.default for k, p in inspect.signature(KimiK3Config.__init__).parameters.items()}
    resolved = get_preset("tiny")  # first_k_dense_replace / moe_layer_freq resolve from None
    for field, value in _SIZE_DEFAULTS.items():
        assert (defaults[field] if defaults[field] is not None else getattr(resolved, field)) == value, field
