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
from typing import Any

from kimi_helix.modeling.config import KimiK3Config
from kimi_helix.tokenizer import BOS_TOKEN_ID, EOS_TOKEN_ID, PAD_TOKEN_ID

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
    # A deep copy, so that editing the config's `linear_attn_config` cannot change the preset.
    return KimiK3Config(**copy.deepcopy(PRESETS[name]))
