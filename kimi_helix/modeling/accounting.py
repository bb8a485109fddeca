"""Sizes that follow from a `KimiK3Config` alone: parameter counts, cache and state bytes, the layer layout.

Nothing here allocates weights: `count_parameters` builds the model on the meta device.
"""

from __future__ import annotations

import torch

from kimi_helix.modeling.config import KimiK3Config
from kimi_helix.modeling.model import KimiK3ForCausalLM


def count_parameters(config: KimiK3Config) -> tuple[int, int]:
    """Return `(total, active)` parameter counts.

    `total` is exact: every tensor the checkpoint holds (parameters and persistent buffers such as the router's
    `e_score_correction_bias`), tied tensors once. `active` is what one token reads: `total` less the routed
    experts it is not sent to (`num_experts - num_experts_per_token` SwiGLU experts of `3 * hidden *
    moe_intermediate_size` weights in each MoE layer) and less the input embedding table, of which it reads one
    row (unless it is tied to `lm_head`, which reads all of it).
    """
    with torch.device("meta"):
        model = KimiK3ForCausalLM(config)
    tensors = {id(t): t for t in model.state_dict(keep_vars=True).values()}
    total = sum(t.numel() for t in tensors.values())

    n_moe = sum(config.is_moe_layer(i) for i in range(config.num_hidden_layers))
    idle_experts = config.num_experts - config.num_experts_per_token
    active = total - n_moe * idle_experts * 3 * config.hidden_size * config.moe_intermediate_size
    if not config.tie_word_embeddings:
        active -= config.vocab_size * config.hidden_size
    return total, active


def mla_cache_bytes_per_token(config: KimiK3Config, dtype_bytes: int = 2) -> int:
    """Bytes of MLA cache one token adds: every MLA layer keeps the latent `c` and the shared rope key.

    `n_mla * (kv_lora_rank + qk_rope_head_dim) * dtype_bytes`; 7 * 576 * 2 = 8064 for Kimi-Linear-48B in bf16.
    """
    n_mla = config.num_hidden_layers - n_kda_layers(config)
    return n_mla * config.mla_cache_dim * dtype_bytes


def kda_state_bytes_per_sequence(config: KimiK3Config, conv_dtype_bytes: int = 2) -> int:
    """Bytes of KDA state one sequence holds, whatever its length.

    Per KDA layer: the fp32 recurrent state `[H, K, V]` (K = V = head_dim) plus the short-convolution state, the
    last `W - 1` inputs of q, k and v (`3 * [H * K, W - 1]` in `conv_dtype_bytes`).
    """
    h, k, w = config.kda_num_heads, config.kda_head_dim, config.conv_kernel_size
    per_layer = h * k * k * 4 + 3 * h * k * (w - 1) * conv_dtype_bytes
    return n_kda_layers(config) * per_layer


def n_kda_layers(config: KimiK3Config) -> int:
    """Number of KDA layers; the other `num_hidden_layers - n_kda_layers` are MLA."""
    return sum(not config.is_mla_layer(i) for i in range(config.num_hidden_layers))


def layer_pattern(config: KimiK3Config) -> str:
    """Two aligned lines, one letter per layer, a space after each MLA layer; Kimi-Linear-48B gives::

    attn KKKM KKKM KKKM KKKM KKKM KKKM KKM  (K = KDA, M = MLA)
    mlp  DEEE EEEE EEEE EEEE EEEE EEEE EEE  (D = dense, E = MoE)
    """
    attn = ["M" if config.is_mla_layer(i) else "K" for i in range(config.num_hidden_layers)]
    mlp = ["E" if config.is_moe_layer(i) else "D" for i in range(config.num_hidden_layers)]

    breaks = {i for i, a in enumerate(attn[:-1]) if a == "M"}

    def grouped(letters: list[str]) -> str:
        return "".join(ch + " " * (i in breaks) for i, ch in enumerate(letters))

    return f"attn {grouped(attn)}  (K = KDA, M = MLA)\nmlp  {grouped(mlp)}  (D = dense, E = MoE)"
