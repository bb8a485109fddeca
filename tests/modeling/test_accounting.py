import pytest

from kimi_helix import KimiK3Config, KimiK3ForCausalLM
from kimi_helix.modeling.accounting import (
    count_parameters,
    kda_state_bytes_per_sequence,
    layer_pattern,
    mla_cache_bytes_per_token,
    n_kda_layers,
)
from kimi_helix.presets import PRESETS, get_preset

KIMI_48B_TOTAL = 49_122_681_728  # the sum over the real checkpoint's 20,493 tensors


@pytest.fixture(scope="module")
def kimi_48b() -> KimiK3Config:
    return get_preset("kimi-linear-48b-a3b")


def test_mla_cache_bytes(kimi_48b):
    assert mla_cache_bytes_per_token(kimi_48b) == 7 * 576 * 2 == 8064
    assert mla_cache_bytes_per_token(kimi_48b, dtype_bytes=1) == 4032


def test_kda_state_bytes(kimi_48b):
    assert n_kda_layers(kimi_48b) == 20
    assert kda_state_bytes_per_sequence(kimi_48b) == 20 * (32 * 128 * 128 * 4 + 3 * 4096 * 3 * 2) == 43_417_600
    assert kda_state_bytes_per_sequence(kimi_48b, conv_dtype_bytes=4) == 20 * (32 * 128 * 128 * 4 + 3 * 4096 * 3 * 4)


def test_kimi_linear_48b_parameters(kimi_48b):
    d, vocab = 2304, 163840
    expert = 3 * d * 1024
    # Per-module counts from the real checkpoint's inventory.
    kda, mla, router, shared = 39_514_272, 29_114_880, 590_080, 7_077_888
    by_hand = 2 * vocab * d + d + 27 * 2 * d + 20 * kda + 7 * mla + 3 * d * 9216 + 26 * (router + shared + 256 * expert)
    total, active = count_parameters(kimi_48b)
    assert total == by_hand == KIMI_48B_TOTAL
    assert active == total - 26 * (256 - 8) * expert - vocab * d
    assert 2.9e9 < active < 3.5e9  # "A3B"


@pytest.mark.parametrize("name", ["tiny", "tiny-k3"])
def test_meta_count_matches_a_real_model(name):
    config = get_preset(name)
    model = KimiK3ForCausalLM(config)
    total, active = count_parameters(config)
    assert total == sum(p.numel() for p in model.parameters())
    n_moe = config.num_hidden_layers - config.first_k_dense_replace
    idle = (config.num_experts - config.num_experts_per_token) * 3 * config.hidden_size * config.moe_intermediate_size
    assert active == total - n_moe * idle - config.vocab_size * config.hidden_size


def test_tied_embeddings_are_counted_once_and_stay_active():
    config = KimiK3Config(**{**PRESETS["tiny"], "tie_word_embeddings": True})
    untied_total, untied_active = count_parameters(get_preset("tiny"))
    total, active = count_parameters(config)
    table = config.vocab_size * config.hidden_size
    assert total == untied_total - table
    assert active == untied_active  # lm_head reads the whole shared table; the embedding row is no saving


def test_layer_pattern(kimi_48b):
    assert layer_pattern(kimi_48b) == (
        "attn KKKM KKKM KKKM KKKM KKKM KKKM KKM  (K = KDA, M = MLA)\n"
        "mlp  DEEE EEEE EEEE EEEE EEEE EEEE EEE  (D = dense, E = MoE)"
    )
    assert layer_pattern(get_preset("tiny")) == "attn KKM K  (K = KDA, M = MLA)\nmlp  DEE E  (D = dense, E = MoE)"
    every_other = KimiK3Config(**{**PRESETS["tiny"], "moe_layer_freq": 2, "first_k_dense_replace": 0})
    assert layer_pattern(every_other).splitlines()[1] == "mlp  EDE D  (D = dense, E = MoE)"
