"""`KimiK3Config`: the configuration of a Kimi-K3-style hybrid model.

It reads every field of Kimi-Linear's `config.json` unchanged (1-based `linear_attn_config.kda_layers` /
`full_attn_layers`, Moonshot MoE names) and adds the K3-style switches: q-LoRA, an MLA output gate, RoPE on
MLA, a lower-bounded KDA forget gate and a full-rank KDA output gate. Every value is checked when the config is
built; a configuration that cannot work raises `ValueError` naming the field.
"""

from __future__ import annotations

from typing import Any

from transformers import PretrainedConfig

LINEAR_ATTENTION = "linear_attention"  # a KDA layer
FULL_ATTENTION = "full_attention"  # an MLA layer


def default_full_attn_layers(num_layers: int) -> list[int]:
    """Kimi-Linear's pattern, 1-based: every fourth layer is MLA, and so is the last one."""
    layers = list(range(4, num_layers + 1, 4))
    if num_layers not in layers:
        layers.append(num_layers)
    return layers


class KimiK3Config(PretrainedConfig):
    r"""Configuration of a Kimi-K3-style model (KDA + MLA + sigmoid-routed MoE).

    Field names follow Kimi-Linear's `config.json`; its defaults are Kimi-Linear-48B-A3B's.

    Args:
        vocab_size, hidden_size, num_hidden_layers, rms_norm_eps, initializer_range: as in every HF model.
        intermediate_size: width of the dense SwiGLU MLP of the first `first_k_dense_replace` layers.
        num_attention_heads: MLA heads (any count; K3 has 96).
        q_lora_rank: `None` for a single `q_proj`; else `q_a_proj -> q_a_layernorm -> q_b_proj` of that rank.
        kv_lora_rank: width of the compressed KV latent `c` (512).
        qk_nope_head_dim, qk_rope_head_dim, v_head_dim: MLA head dims. The cache holds `kv_lora_rank +
            qk_rope_head_dim` values per token per MLA layer; the softmax scale is `(nope + rope) ** -0.5`.
        mla_use_nope: `True` (Kimi-Linear): no rotary embedding anywhere. `False`: RoPE (`rope_theta`) on the
            `qk_rope_head_dim` slice of q and of the shared key.
        mla_use_output_gate: K3's MLA output gate, `o_proj(attn * sigmoid(g_proj(x)))`.
        linear_attn_config: `{"kda_layers": [...], "full_attn_layers": [...], "num_heads": H, "head_dim": K,
            "short_conv_kernel_size": W}`, layer lists 1-based. Missing lists default to Kimi-Linear's pattern.
        gate_lower_bound: `None` (Kimi-Linear): forget gate `g = -exp(A_log) * softplus(f + dt_bias)`. A negative
            number `lb` (K3 uses -5): `g = lb * sigmoid(exp(A_log) * (f + dt_bias))`.
        use_full_rank_gate: K3's KDA output gate, a single `g_proj` [H*K, d] instead of `g_a_proj`/`g_b_proj`.
        num_experts, num_experts_per_token, num_shared_experts, moe_intermediate_size: the routed MoE.
        first_k_dense_replace, moe_layer_freq: layer i is MoE iff `i >= first_k_dense_replace` and
            `i % moe_layer_freq == 0` (0-based).
        moe_router_activation_func: `"sigmoid"` (Kimi) or `"softmax"`.
        moe_renormalize, routed_scaling_factor: routed weights are the unbiased scores of the chosen experts,
            renormalised to sum to one, times `routed_scaling_factor`.
        use_grouped_topk, num_expert_group, topk_group: DeepSeek-V3 group-limited routing; the selection (not the
            weights) adds `e_score_correction_bias`.
    """

    model_type = "kimi_k3"
    keys_to_ignore_at_inference = ["past_key_values"]
    attribute_map = {
        "max_position_embeddings": "model_max_length",
        "num_local_experts": "num_experts",
        "num_experts_per_tok": "num_experts_per_token",
        "n_shared_experts": "num_shared_experts",
        "n_group": "num_expert_group",
        "norm_topk_prob": "moe_renormalize",
    }

    def __init__(
        self,
        vocab_size: int = 163840,
        hidden_size: int = 2304,
        intermediate_size: int = 9216,
        moe_intermediate_size: int = 1024,
        num_hidden_layers: int = 27,
        num_attention_heads: int = 32,
        num_key_value_heads: int | None = None,
        head_dim: int | None = None,
        hidden_act: str = "silu",
        q_lora_rank: int | None = None,
        kv_lora_rank: int = 512,
        qk_nope_head_dim: int = 128,
        qk_rope_head_dim: int = 64,
        v_head_dim: int = 128,
        mla_use_nope: bool = True,
        mla_use_output_gate: bool = False,
        rope_theta: float = 10000.0,
        rope_scaling: dict | None = None,
        model_max_length: int = 1048576,
        linear_attn_config: dict | None = None,
        gate_lower_bound: float | None = None,
        use_full_rank_gate: bool = False,
        num_experts: int = 256,
        num_experts_per_token: int = 8,
        num_shared_experts: int = 1,
        first_k_dense_replace: int = 1,
        moe_layer_freq: int = 1,
        moe_renormalize: bool = True,
        moe_router_activation_func: str = "sigmoid",
        routed_scaling_factor: float = 2.446,
        use_grouped_topk: bool = True,
        num_expert_group: int = 1,
        topk_group: int = 1,
        num_nextn_predict_layers: int = 0,
        rms_norm_eps: float = 1e-5,
        initializer_range: float = 0.02,
        use_cache: bool = True,
        tie_word_embeddings: bool = False,
        bos_token_id: int | None = 163584,
        eos_token_id: int | list[int] | None = 163586,
        pad_token_id: int | None = 163839,
        **kwargs: Any,
    ):
        # transformers' native KimiLinearConfig saves its derived fields flat; fold them back in.
        lac = dict(linear_attn_config or {})
        for flat, key in (
            ("linear_num_heads", "num_heads"),
            ("linear_head_dim", "head_dim"),
            ("linear_conv_kernel_dim", "short_conv_kernel_size"),
        ):
            if flat in kwargs:
                lac.setdefault(key, kwargs.pop(flat))
        layer_types = kwargs.pop("layer_types", None)
        if layer_types is not None and "full_attn_layers" not in lac and "kda_layers" not in lac:
            lac["full_attn_layers"] = [i + 1 for i, t in enumerate(layer_types) if t == FULL_ATTENTION]
        # Fields of the remote-code config that we read but never act on (`auto_map` would name remote code).
        for ignored in ("auto_map", "mlp_layer_types", "qk_head_dim"):
            kwargs.pop(ignored, None)
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.moe_intermediate_size = moe_intermediate_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_attention_heads if num_key_value_heads is None else num_key_value_heads
        self.head_dim = head_dim
        self.hidden_act = hidden_act
        self.q_lora_rank = q_lora_rank
        self.kv_lora_rank = kv_lora_rank
        self.qk_nope_head_dim = qk_nope_head_dim
        self.qk_rope_head_dim = qk_rope_head_dim
        self.v_head_dim = v_head_dim
        self.mla_use_nope = mla_use_nope
        self.mla_use_output_gate = mla_use_output_gate
        self.rope_theta = rope_theta
        self.model_max_length = model_max_length
        self.gate_lower_bound = gate_lower_bound
        self.use_full_rank_gate = use_full_rank_gate
        self.num_experts = num_experts
        self.num_experts_per_token = num_experts_per_token
        self.num_shared_experts = num_shared_experts
        self.first_k_dense_replace = first_k_dense_replace
        self.moe_layer_freq = moe_layer_freq
        self.moe_renormalize = moe_renormalize
        self.moe_router_activation_func = moe_router_activation_func
        self.routed_scaling_factor = routed_scaling_factor
        self.use_grouped_topk = use_grouped_topk
        self.num_expert_group = num_expert_group
        self.topk_group = topk_group
        self.num_nextn_predict_layers = num_nextn_predict_layers
        self.rms_norm_eps = rms_norm_eps
        self.initializer_range = initializer_range
        self.use_cache = use_cache

        lac.setdefault("num_heads", 32)
        lac.setdefault("head_dim", 128)
        lac.setdefault("short_conv_kernel_size", 4)
        if "full_attn_layers" not in lac:
            full = lac.get("kda_layers")
            lac["full_attn_layers"] = (
                default_full_attn_layers(num_hidden_layers)
                if full is None
                else [i for i in range(1, num_hidden_layers + 1) if i not in set(full)]
            )
        if "kda_layers" not in lac:
            full = set(lac["full_attn_layers"])
            lac["kda_layers"] = [i for i in range(1, num_hidden_layers + 1) if i not in full]
        self.linear_attn_config = lac

        super().__init__(
            tie_word_embeddings=tie_word_embeddings,
            bos_token_id=bos_token_id,
            eos_token_id=eos_token_id,
            pad_token_id=pad_token_id,
            **kwargs,
        )
        if rope_scaling is not None:
            raise ValueError(
                f"KimiK3Config.rope_scaling must be None (no scaled RoPE is implemented), got {rope_scaling!r}"
            )
        self.validate_fields()

    # ---------------------------------------------------------------- derived values
    @property
    def layer_types(self) -> list[str]:
        """Per 0-based layer: `"linear_attention"` (KDA) or `"full_attention"` (MLA)."""
        full = set(self.linear_attn_config["full_attn_layers"])
        return [FULL_ATTENTION if i + 1 in full else LINEAR_ATTENTION for i in range(self.num_hidden_layers)]

    @property
    def mlp_layer_types(self) -> list[str]:
        """Per 0-based layer: `"dense"` (SwiGLU MLP) or `"sparse"` (MoE); HF's names."""
        return ["sparse" if self.is_moe_layer(i) else "dense" for i in range(self.num_hidden_layers)]

    def is_moe_layer(self, idx: int) -> bool:
        return self.num_experts > 0 and idx >= self.first_k_dense_replace and idx % self.moe_layer_freq == 0

    def is_mla_layer(self, idx: int) -> bool:
        """Whether 0-based layer `idx` is MLA (full attention); every other layer is KDA (linear attention)."""
        return self.layer_types[idx] == FULL_ATTENTION

    @property
    def kda_num_heads(self) -> int:
        return self.linear_attn_config["num_heads"]

    @property
    def kda_head_dim(self) -> int:
        return self.linear_attn_config["head_dim"]

    @property
    def conv_kernel_size(self) -> int:
        return self.linear_attn_config["short_conv_kernel_size"]

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def mla_cache_dim(self) -> int:
        """Values cached per token per MLA layer: the latent `c` plus the shared rope key (576 for Kimi)."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    # ---------------------------------------------------------------- validation
    def validate_fields(self) -> None:
        """Raise `ValueError` naming the first field whose value cannot work."""

        def positive(name: str, value: Any) -> None:
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"KimiK3Config.{name} must be a positive int, got {value!r}")

        for name in (
            "vocab_size",
            "hidden_size",
            "num_hidden_layers",
            "num_attention_heads",
            "kv_lora_rank",
            "qk_nope_head_dim",
            "v_head_dim",
            "intermediate_size",
        ):
            positive(name, getattr(self, name))
        if not isinstance(self.qk_rope_head_dim, int) or self.qk_rope_head_dim < 0:
            raise ValueError(f"KimiK3Config.qk_rope_head_dim must be an int >= 0, got {self.qk_rope_head_dim!r}")
        if self.q_lora_rank is not None:
            positive("q_lora_rank", self.q_lora_rank)
        if not self.mla_use_nope and self.qk_rope_head_dim % 2:
            raise ValueError(
                f"KimiK3Config.qk_rope_head_dim must be even when mla_use_nope is False (RoPE rotates pairs), "
                f"got {self.qk_rope_head_dim}"
            )
        if self.hidden_act != "silu":
            raise ValueError(f"KimiK3Config.hidden_act must be 'silu', got {self.hidden_act!r}")
        if not self.rms_norm_eps > 0:
            raise ValueError(f"KimiK3Config.rms_norm_eps must be > 0, got {self.rms_norm_eps!r}")
        self._validate_layers()
        self._validate_moe()
        if self.gate_lower_bound is not None and not self.gate_lower_bound < 0:
            raise ValueError(
                f"KimiK3Config.gate_lower_bound must be None or a negative number (the log-decay floor), "
                f"got {self.gate_lower_bound!r}"
            )

    def _validate_layers(self) -> None:
        lac = self.linear_attn_config
        for key in ("num_heads", "head_dim", "short_conv_kernel_size"):
            v = lac[key]
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"KimiK3Config.linear_attn_config.{key} must be a positive int, got {v!r}")
        n = self.num_hidden_layers
        seen: dict[int, str] = {}
        for key in ("kda_layers", "full_attn_layers"):
            layers = lac[key]
            if not isinstance(layers, (list, tuple)):
                raise ValueError(f"KimiK3Config.linear_attn_config.{key} must be a list of 1-based layer numbers")
            for layer in layers:
                if not isinstance(layer, int) or not 1 <= layer <= n:
                    raise ValueError(
                        f"KimiK3Config.linear_attn_config.{key} holds {layer!r}; layers are 1-based, in 1..{n}"
                    )
                if layer in seen:
                    where = "twice" if seen[layer] == key else f"and in {seen[layer]}"
                    raise ValueError(
                        f"KimiK3Config.linear_attn_config.{key} lists layer {layer} {where}; each layer must appear "
                        f"exactly once across kda_layers and full_attn_layers"
                    )
                seen[layer] = key
        missing = [i for i in range(1, n + 1) if i not in seen]
        if missing:
            raise ValueError(
                f"KimiK3Config.linear_attn_config: layers {missing} are in neither kda_layers nor full_attn_layers "
                f"(num_hidden_layers={n}, 1-based)"
            )

    def _validate_moe(self) -> None:
        if self.num_experts == 0:
            return
        for name in (
            "num_experts",
            "num_experts_per_token",
            "moe_intermediate_size",
            "num_expert_group",
            "topk_group",
            "moe_layer_freq",
        ):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"KimiK3Config.{name} must be a positive int, got {v!r}")
        if not isinstance(self.num_shared_experts, int) or self.num_shared_experts < 0:
            raise ValueError(f"KimiK3Config.num_shared_experts must be an int >= 0, got {self.num_shared_experts!r}")
        if not isinstance(self.first_k_dense_replace, int) or self.first_k_dense_replace < 0:
            raise ValueError(
                f"KimiK3Config.first_k_dense_replace must be an int >= 0, got {self.first_k_dense_replace!r}"
            )
        if self.moe_router_activation_func not in ("sigmoid", "softmax"):
            raise ValueError(
                f"KimiK3Config.moe_router_activation_func must be 'sigmoid' or 'softmax', "
                f"got {self.moe_router_activation_func!r}"
            )
        if self.num_experts_per_token > self.num_experts:
            raise ValueError(
                f"KimiK3Config.num_experts_per_token ({self.num_experts_per_token}) must be <= num_experts "
                f"({self.num_experts})"
            )
        if self.num_experts % self.num_expert_group:
            raise ValueError(
                f"KimiK3Config.num_experts ({self.num_experts}) must be divisible by num_expert_group "
                f"({self.num_expert_group})"
            )
        if self.topk_group > self.num_expert_group:
            raise ValueError(
                f"KimiK3Config.topk_group ({self.topk_group}) must be <= num_expert_group ({self.num_expert_group})"
            )
        if self.use_grouped_topk:
            group_size = self.num_experts // self.num_expert_group
            # Groups are ranked by the sum of their two best scores, so each group needs two experts.
            if self.num_expert_group > 1 and group_size < 2:
                raise ValueError(
                    f"KimiK3Config.num_expert_group ({self.num_expert_group}) leaves fewer than 2 experts per group"
                )
            if self.num_experts_per_token > self.topk_group * group_size:
                raise ValueError(
                    f"KimiK3Config.num_experts_per_token ({self.num_experts_per_token}) exceeds the experts in the "
                    f"topk_group={self.topk_group} selected groups ({self.topk_group * group_size})"
                )
