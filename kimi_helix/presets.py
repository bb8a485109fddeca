"""Named model configurations: `PRESETS[name]` holds `KimiK3Config` keyword arguments, `get_preset(name)` builds one.

- `tiny`: a 4-layer model (KDA, KDA, MLA, KDA) for CPU tests, with the byte tokenizer's vocabulary and special ids.
- `tiny-k3`: `tiny` with every K3 switch on.
- `kimi-linear-48b-a3b`: the architecture fields of Kimi-Linear-48B-A3B's `config.json`, value for value. The
  checkpoint metadata (`architectures`, `auto_map`, `model_type`, `dtype`, `transformers_version`) is left out:
  `save_pretrained` writes its own.
- `kimi-k3-style`: Kimi-Linear-48B's shapes with Kimi K3's attention: 96 MLA heads, q-LoRA 1536, RoPE, the MLA
  output gate, the lower-bounded KDA forget gate and the full-rank KDA output gate. K3's own size, latent MoE,
  SiTU activation and attention residuals are not modelled.
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Any

from kimi_helix.tokenizer import BOS_TOKEN_ID, EOS_TOKEN_ID, PAD_TOKEN_ID

if TYPE_CHECKING:
    from kimi_helix.modeling.config import KimiK3Config

_TINY: dict[str, Any] = {
    # 256 byte tokens + 3 specials, padded so that ids the tokenizer lacks can still be sampled and skipped.
    "vocab_size": 320,
    "hidden_size": 64,
    "intermediate_size": 128,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "kv_lora_rank": 32,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8,
    "v_head_dim": 16,
    "linear_attn_config": {
        "kda_layers": [1, 2, 4],
        "full_attn_layers": [3],
        "num_heads": 2,
        "head_dim": 16,
        "short_conv_kernel_size": 4,
    },
    "num_experts": 8,
    "num_experts_per_token": 2,
    "num_shared_experts": 1,
    "first_k_dense_replace": 1,
    "bos_token_id": BOS_TOKEN_ID,
    "eos_token_id": EOS_TOKEN_ID,
    "pad_token_id": PAD_TOKEN_ID,
}

_KIMI_LINEAR_48B: dict[str, Any] = {
    "vocab_size": 163840,
    "hidden_size": 2304,
    "intermediate_size": 9216,
    "num_hidden_layers": 27,
    "num_attention_heads": 32,
    "num_key_value_heads": 32,
    "head_dim": 72,
    "hidden_act": "silu",
    "q_lora_rank": None,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "mla_use_nope": True,
    "rope_theta": 10000.0,
    "rope_scaling": None,
    "model_max_length": 1048576,
    "linear_attn_config": {
        "kda_layers": [1, 2, 3, 5, 6, 7, 9, 10, 11, 13, 14, 15, 17, 18, 19, 21, 22, 23, 25, 26],
        "full_attn_layers": [4, 8, 12, 16, 20, 24, 27],
        "num_heads": 32,
        "head_dim": 128,
        "short_conv_kernel_size": 4,
    },
    "num_experts": 256,
    "num_experts_per_token": 8,
    "num_shared_experts": 1,
    "moe_intermediate_size": 1024,
    "first_k_dense_replace": 1,
    "moe_layer_freq": 1,
    "moe_renormalize": True,
    "moe_router_activation_func": "sigmoid",
    "routed_scaling_factor": 2.446,
    "use_grouped_topk": True,
    "num_expert_group": 1,
    "topk_group": 1,
    "num_nextn_predict_layers": 0,
    "rms_norm_eps": 1e-05,
    "initializer_range": 0.02,
    "tie_word_embeddings": False,
    "use_cache": True,
    "bos_token_id": 163584,
    "eos_token_id": 163586,
    "pad_token_id": 163839,
}

_K3_SWITCHES: dict[str, Any] = {
    "mla_use_output_gate": True,
    "gate_lower_bound": -5.0,
    "use_full_rank_gate": True,
    "mla_use_nope": False,
}

PRESETS: dict[str, dict[str, Any]] = {
    "tiny": _TINY,
    "tiny-k3": {**_TINY, **_K3_SWITCHES, "num_attention_heads": 6, "num_key_value_heads": 6, "q_lora_rank": 16},
    "kimi-linear-48b-a3b": _KIMI_LINEAR_48B,
    # `num_key_value_heads` and `head_dim` (hidden / heads) are read by neither MLA nor KDA; they follow the head
    # count only to keep the config self-consistent.
    "kimi-k3-style": {
        **_KIMI_LINEAR_48B,
        **_K3_SWITCHES,
        "num_attention_heads": 96,
        "num_key_value_heads": 96,
        "head_dim": 2304 // 96,
        "q_lora_rank": 1536,
    },
}


def get_preset(name: str) -> KimiK3Config:
    """Build a fresh `KimiK3Config` from `PRESETS[name]`; an unknown name raises `ValueError` listing the known ones."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; known presets: {', '.join(PRESETS)}")
    from kimi_helix.modeling.config import KimiK3Config

    # A deep copy, so that editing the config's `linear_attn_config` cannot change the preset.
    return KimiK3Config(**copy.deepcopy(PRESETS[name]))


# `KimiK3Config`'s defaults of the fields some presets leave out (tests/test_presets.py holds them to the class).
_SIZE_DEFAULTS = {"q_lora_rank": None, "mla_use_output_gate": False, "use_full_rank_gate": False,
                  "tie_word_embeddings": False, "first_k_dense_replace": 1, "moe_layer_freq": 1}  # fmt: skip


def preset_parameters(name: str) -> tuple[int, int]:
    """`(total, active)` parameters of a preset by arithmetic on its fields alone, without torch, so that
    `kimi-helix presets` starts fast; equal to `modeling.accounting.count_parameters(get_preset(name))` (tested)."""
    f = {**_SIZE_DEFAULTS, **PRESETS[name]}
    d, layers, lin = f["hidden_size"], f["num_hidden_layers"], f["linear_attn_config"]
    h, nope, rope, v, r = (f[k] for k in ("num_attention_heads", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
                                          "kv_lora_rank"))  # fmt: skip
    q = d * h * (nope + rope) if f["q_lora_rank"] is None else (d + 1 + h * (nope + rope)) * f["q_lora_rank"]
    mla = q + d * (r + rope) + r + r * h * (nope + v) + h * v * d * (1 + f["mla_use_output_gate"])
    hk, k, w = lin["num_heads"], lin["head_dim"], lin["short_conv_kernel_size"]
    p = hk * k
    gate = d * p if f["use_full_rank_gate"] else d * k + k * p
    kda = 3 * d * p + 3 * p * w + hk + p + d * k + k * p + d * hk + gate + k + p * d
    e, top, inter, shared = (f[k] for k in ("num_experts", "num_experts_per_token", "moe_intermediate_size",
                                            "num_shared_experts"))  # fmt: skip
    expert = 3 * d * inter
    moe = e * d + e + e * expert + shared * expert
    dense = 3 * d * f["intermediate_size"]
    is_moe = [e > 0 and i >= f["first_k_dense_replace"] and i % f["moe_layer_freq"] == 0 for i in range(layers)]
    n_mla, n_moe = len(lin["full_attn_layers"]), sum(is_moe)
    total = layers * 2 * d + n_mla * mla + (layers - n_mla) * kda + n_moe * moe + (layers - n_moe) * dense
    total += d + f["vocab_size"] * d * (1 if f["tie_word_embeddings"] else 2)
    active = total - n_moe * (e - top) * expert - (0 if f["tie_word_embeddings"] else f["vocab_size"] * d)
    return total, active
