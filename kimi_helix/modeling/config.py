"""`KimiK3Config`: the configuration of a Kimi-K3-style hybrid model.

It reads every field of Kimi-Linear's `config.json` unchanged (1-based `linear_attn_config.kda_layers` /
`full_attn_layers`, Moonshot MoE names) and adds the K3-style switches: q-LoRA, an MLA output gate, RoPE on
MLA, a lower-bounded KDA forget gate and a full-rank KDA output gate. It also reads every field transformers'
own `KimiLinearConfig` writes (`mlp_layer_types`, `layer_types`, the flat `linear_*` fields, ...), checking each
against the fields it duplicates. Every value is type-checked when the config is built (a bool must be a bool, not
the string "false"; a float a number in range); a configuration that cannot work raises `ConfigError` (a
`ValueError`) naming the field and what is allowed.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from transformers import PretrainedConfig
from transformers.utils import logging

logger = logging.get_logger(__name__)

LINEAR_ATTENTION = "linear_attention"  # a KDA layer
FULL_ATTENTION = "full_attention"  # an MLA layer


DENSE, SPARSE = "dense", "sparse"  # transformers' `mlp_layer_types` names: a SwiGLU MLP, a MoE

# Fields transformers' KimiLinearConfig writes that name options kimi_helix does not implement: each is accepted
# only at the value that means "off", so a checkpoint asking for more is refused by name, never silently ignored.
_ONLY_DEFAULT = {"output_router_logits": False, "pretraining_tp": 1, "attention_bias": False, "attention_dropout": 0}

# Metadata every transformers config writes (read by PretrainedConfig itself), and `auto_map`: the remote-code
# classes of Moonshot's config.json, which kimi_helix never imports, so it is dropped on read and never re-saved.
_METADATA = frozenset(PretrainedConfig.__dataclass_fields__) | {
    "_name_or_path",
    "name_or_path",
    "output_attentions",
    "torch_dtype",
    "_commit_hash",
    "_attn_implementation",
    "attn_implementation",
    "auto_map",
}

# The fields `validate_fields` checks by type alone (the others have their own rules there).
_POSITIVE_INT_FIELDS = (
    *("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads"),
    *("kv_lora_rank", "qk_nope_head_dim", "v_head_dim", "intermediate_size", "model_max_length"),
)
_BOOL_FIELDS = ("mla_use_nope", "mla_use_output_gate", "use_full_rank_gate", "moe_renormalize", "use_grouped_topk")
_BOOL_FIELDS += ("use_cache", "tie_word_embeddings")


class ConfigError(ValueError):
    """A configuration value that cannot work; the message names the field and what is allowed."""


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
            `i % moe_layer_freq == 0` (0-based). Unset (None), they come from transformers' `mlp_layer_types`
            when the config has one, else 1 and 1; set, they must agree with it.
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
        first_k_dense_replace: int | None = None,
        moe_layer_freq: int | None = None,
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
        lac, layer_types, mlp_layer_types, qk_head_dim = self._read_extra_fields(
            rope_scaling, linear_attn_config, kwargs
        )
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

        self._resolve_layers(lac, layer_types, mlp_layer_types)  # before PretrainedConfig's validators read them

        super().__init__(
            tie_word_embeddings=tie_word_embeddings,
            bos_token_id=bos_token_id,
            eos_token_id=eos_token_id,
            pad_token_id=pad_token_id,
            **kwargs,
        )
        self.validate_fields()
        self._check_derived_fields(layer_types, qk_head_dim)

    @classmethod
    def _read_extra_fields(cls, rope_scaling: Any, linear_attn_config: Any, kwargs: dict) -> tuple[dict, Any, Any, Any]:
        """Check the arguments that have no attribute of their own and pop transformers' extra fields from `kwargs`:
        (`linear_attn_config` with the flat `linear_*` fields folded in, `layer_types`, `mlp_layer_types`,
        `qk_head_dim`), the last three checked once the config is built."""
        if rope_scaling is not None:
            raise ConfigError(
                f"KimiK3Config.rope_scaling must be None (no scaled RoPE is implemented), got {rope_scaling!r}"
            )
        if linear_attn_config is not None and not isinstance(linear_attn_config, dict):
            raise ConfigError(f"KimiK3Config.linear_attn_config must be an object, got {linear_attn_config!r}")
        lac = cls._fold_transformers_fields(dict(linear_attn_config or {}), kwargs)
        return (lac, *_pop_derived_fields(kwargs))

    def _resolve_layers(self, lac: dict, layer_types: Any, mlp_layer_types: Any) -> None:
        """Set `linear_attn_config` (its layer lists completed) and the MoE layer pattern, checking both."""
        self.linear_attn_config = _complete_layer_lists(lac, self.num_hidden_layers, layer_types)
        _check_int("num_hidden_layers", self.num_hidden_layers)
        _check_int("num_experts", self.num_experts, minimum=0)
        self._validate_layers()
        self._resolve_mlp_layer_types(mlp_layer_types)

    @staticmethod
    def _fold_transformers_fields(lac: dict, kwargs: dict) -> dict:
        """Fold the flat fields transformers' native KimiLinearConfig saves back into `linear_attn_config`.

        Each is checked against what it duplicates (`linear_*` against `linear_attn_config`; `qk_head_dim`, nope +
        rope, in `__init__`), a `dtype` must name a torch dtype, and the options kimi_helix lacks (`_ONLY_DEFAULT`)
        must be off.
        """
        for flat, key in (
            ("linear_num_heads", "num_heads"),
            ("linear_head_dim", "head_dim"),
            ("linear_conv_kernel_dim", "short_conv_kernel_size"),
        ):
            if flat not in kwargs:
                continue
            value = kwargs.pop(flat)
            if key in lac and lac[key] != value:
                raise ConfigError(
                    f"KimiK3Config.{flat} ({value!r}) disagrees with linear_attn_config.{key} ({lac[key]!r})"
                )
            lac[key] = value
        for name in ("dtype", "torch_dtype"):
            value = kwargs.get(name)
            if isinstance(value, str) and not isinstance(getattr(torch, value, None), torch.dtype):
                raise ConfigError(f"KimiK3Config.{name} must name a torch dtype (e.g. 'bfloat16'), got {value!r}")
        for name, off in _ONLY_DEFAULT.items():
            value = kwargs.pop(name, off)
            if value is not None and (isinstance(value, bool) != isinstance(off, bool) or value != off):
                raise ConfigError(
                    f"KimiK3Config.{name} must be {off!r} (kimi_helix does not implement it), got {value!r}"
                )
        return lac

    @classmethod
    def from_dict(cls, config_dict, **kwargs):
        """Build a config from a dict of fields; anything else (a JSON list, say) raises `ConfigError`."""
        if not isinstance(config_dict, dict):
            raise ConfigError(f"KimiK3Config is built from a JSON object of fields, got a {type(config_dict).__name__}")
        return super().from_dict(config_dict, **kwargs)

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
        """Raise `ConfigError` naming the first field whose value has the wrong type or cannot work."""
        for name in _POSITIVE_INT_FIELDS:
            _check_int(name, getattr(self, name))
        _check_int("qk_rope_head_dim", self.qk_rope_head_dim, minimum=0)
        for name in ("q_lora_rank", "head_dim"):
            if getattr(self, name) is not None:
                _check_int(name, getattr(self, name))
        if self.num_nextn_predict_layers != 0:
            raise ConfigError(
                f"KimiK3Config.num_nextn_predict_layers must be 0 (multi-token-prediction layers are not "
                f"implemented), got {self.num_nextn_predict_layers!r}"
            )
        for name in _BOOL_FIELDS:
            _check_bool(name, getattr(self, name))
        _check_float("rope_theta", self.rope_theta, above=0)
        _check_float("rms_norm_eps", self.rms_norm_eps, above=0)
        _check_float("initializer_range", self.initializer_range, at_least=0)
        _check_float("routed_scaling_factor", self.routed_scaling_factor, at_least=0)
        if self.gate_lower_bound is not None:
            _check_float("gate_lower_bound", self.gate_lower_bound, below=0, what="None or a negative number")
        for name in ("bos_token_id", "pad_token_id"):
            if getattr(self, name) is not None:
                _check_int(name, getattr(self, name), minimum=0)
        eos = self.eos_token_id
        for value in eos if isinstance(eos, list) else [] if eos is None else [eos]:
            _check_int("eos_token_id", value, minimum=0)
        if not self.mla_use_nope and self.qk_rope_head_dim % 2:
            raise ConfigError(
                f"KimiK3Config.qk_rope_head_dim must be even when mla_use_nope is False (RoPE rotates pairs), "
                f"got {self.qk_rope_head_dim}"
            )
        if self.hidden_act != "silu":
            raise ConfigError(f"KimiK3Config.hidden_act must be 'silu', got {self.hidden_act!r}")
        self._validate_layers()
        self._validate_moe()

    def _validate_layers(self) -> None:
        lac = self.linear_attn_config
        for key in ("num_heads", "head_dim", "short_conv_kernel_size"):
            _check_int(f"linear_attn_config.{key}", lac[key])
        n = self.num_hidden_layers
        seen: dict[int, str] = {}
        for key in ("kda_layers", "full_attn_layers"):
            layers = _list_field(f"linear_attn_config.{key}", lac[key])
            for layer in layers:
                if not isinstance(layer, int) or isinstance(layer, bool) or not 1 <= layer <= n:
                    raise ConfigError(
                        f"KimiK3Config.linear_attn_config.{key} holds {layer!r}; layers are 1-based, in 1..{n}"
                    )
                if layer in seen:
                    where = "twice" if seen[layer] == key else f"and in {seen[layer]}"
                    raise ConfigError(
                        f"KimiK3Config.linear_attn_config.{key} lists layer {layer} {where}; each layer must appear "
                        f"exactly once across kda_layers and full_attn_layers"
                    )
                seen[layer] = key
        missing = [i for i in range(1, n + 1) if i not in seen]
        if missing:
            raise ConfigError(
                f"KimiK3Config.linear_attn_config: layers {missing} are in neither kda_layers nor full_attn_layers "
                f"(num_hidden_layers={n}, 1-based)"
            )

    def _check_derived_fields(self, layer_types: Any, qk_head_dim: Any) -> None:
        """transformers' `layer_types` (0-based) must describe the same layers as `linear_attn_config`, and its
        `qk_head_dim` must be nope + rope."""
        if qk_head_dim is not None and qk_head_dim != self.qk_head_dim:
            raise ConfigError(
                f"KimiK3Config.qk_head_dim ({qk_head_dim!r}) must equal qk_nope_head_dim + qk_rope_head_dim "
                f"({self.qk_head_dim})"
            )
        if layer_types is None:
            return
        layer_types = _list_field("layer_types", layer_types)
        if list(layer_types) != self.layer_types:
            raise ConfigError(
                f"KimiK3Config.layer_types {list(layer_types)} disagrees with linear_attn_config, which gives "
                f"{self.layer_types} (each entry {LINEAR_ATTENTION!r} or {FULL_ATTENTION!r})"
            )

    def _resolve_mlp_layer_types(self, mlp_layer_types: Any) -> None:
        """Set `first_k_dense_replace`/`moe_layer_freq` from transformers' `mlp_layer_types`, or check them against it.

        Layer i is MoE iff `i >= first_k_dense_replace and i % moe_layer_freq == 0`; a pattern no such pair
        gives (say dense, sparse, dense, sparse) cannot be built and is refused.
        """
        if mlp_layer_types is None:
            self.first_k_dense_replace = 1 if self.first_k_dense_replace is None else self.first_k_dense_replace
            self.moe_layer_freq = 1 if self.moe_layer_freq is None else self.moe_layer_freq
            return
        n = self.num_hidden_layers
        pattern = list(_list_field("mlp_layer_types", mlp_layer_types))
        if len(pattern) != n or any(t not in (DENSE, SPARSE) for t in pattern):
            raise ConfigError(
                f"KimiK3Config.mlp_layer_types must list {DENSE!r} or {SPARSE!r} for each of the {n} layers, "
                f"got {pattern}"
            )
        given = self.first_k_dense_replace, self.moe_layer_freq
        sparse = [i for i, t in enumerate(pattern) if t == SPARSE]
        first = sparse[0] if sparse else n
        fits = [f for f in range(1, n + 1) if self._pattern(first, f) == pattern] if self.num_experts else []
        if SPARSE not in pattern:
            fits = [1]
        if not fits:
            raise ConfigError(
                f"KimiK3Config.mlp_layer_types {pattern} cannot be expressed as first_k_dense_replace / "
                f"moe_layer_freq (layer i is sparse iff i >= first_k_dense_replace and i % moe_layer_freq == 0, "
                f"with num_experts={self.num_experts})"
            )
        self.first_k_dense_replace = first if given[0] is None else given[0]
        self.moe_layer_freq = fits[0] if given[1] is None else given[1]
        self._validate_moe()
        if self.mlp_layer_types != pattern:
            raise ConfigError(
                f"KimiK3Config.mlp_layer_types {pattern} disagrees with first_k_dense_replace={given[0]!r}, "
                f"moe_layer_freq={given[1]!r}, which give {self.mlp_layer_types}"
            )

    def _pattern(self, first: int, freq: int) -> list[str]:
        return [SPARSE if i >= first and i % freq == 0 else DENSE for i in range(self.num_hidden_layers)]

    def _validate_moe(self) -> None:
        _check_int("first_k_dense_replace", self.first_k_dense_replace, minimum=0)
        _check_int("moe_layer_freq", self.moe_layer_freq)
        _check_int("num_experts", self.num_experts, minimum=0)
        if self.num_experts == 0:
            return
        for name in ("num_experts_per_token", "moe_intermediate_size", "num_expert_group", "topk_group"):
            _check_int(name, getattr(self, name))
        _check_int("num_shared_experts", self.num_shared_experts, minimum=0)
        if self.moe_router_activation_func not in ("sigmoid", "softmax"):
            raise ConfigError(
                f"KimiK3Config.moe_router_activation_func must be 'sigmoid' or 'softmax', "
                f"got {self.moe_router_activation_func!r}"
            )
        if self.num_experts_per_token > self.num_experts:
            raise ConfigError(
                f"KimiK3Config.num_experts_per_token ({self.num_experts_per_token}) must be <= num_experts "
                f"({self.num_experts})"
            )
        if self.num_experts % self.num_expert_group:
            raise ConfigError(
                f"KimiK3Config.num_experts ({self.num_experts}) must be divisible by num_expert_group "
                f"({self.num_expert_group})"
            )
        if self.topk_group > self.num_expert_group:
            raise ConfigError(
                f"KimiK3Config.topk_group ({self.topk_group}) must be <= num_expert_group ({self.num_expert_group})"
            )
        if self.use_grouped_topk:
            group_size = self.num_experts // self.num_expert_group
            # Groups are ranked by the sum of their two best scores, so each group needs two experts.
            if self.num_expert_group > 1 and group_size < 2:
                raise ConfigError(
                    f"KimiK3Config.num_expert_group ({self.num_expert_group}) leaves fewer than 2 experts per group"
                )
            if self.num_experts_per_token > self.topk_group * group_size:
                raise ConfigError(
                    f"KimiK3Config.num_experts_per_token ({self.num_experts_per_token}) exceeds the experts in the "
                    f"topk_group={self.topk_group} selected groups ({self.topk_group * group_size})"
                )


def _pop_derived_fields(kwargs: dict) -> tuple[Any, Any, Any]:
    """Pop the fields transformers writes that follow from others (`layer_types`, `mlp_layer_types`, `qk_head_dim`:
    checked against them once the config is built) and `auto_map`; warn about any field no config of ours has."""
    derived = tuple(kwargs.pop(name, None) for name in ("layer_types", "mlp_layer_types", "qk_head_dim"))
    unknown = sorted(k for k in kwargs if k not in _METADATA)
    if unknown:
        logger.warning(f"KimiK3Config: fields {unknown} are not Kimi-K3 or Kimi-Linear fields; they have no effect")
    kwargs.pop("auto_map", None)
    return derived


def _complete_layer_lists(lac: dict, num_layers: int, layer_types: Any) -> dict:
    """`linear_attn_config` with its defaults filled in: the KDA head shape, and whichever of `kda_layers` /
    `full_attn_layers` is missing (the complement of the other; from transformers' `layer_types` when both are;
    else Kimi-Linear's pattern). The lists are checked later, by `_validate_layers`."""
    lac.setdefault("num_heads", 32)
    lac.setdefault("head_dim", 128)
    lac.setdefault("short_conv_kernel_size", 4)
    if "full_attn_layers" not in lac and "kda_layers" not in lac and layer_types is not None:
        lac["full_attn_layers"] = [
            i + 1 for i, t in enumerate(_list_field("layer_types", layer_types)) if t == FULL_ATTENTION
        ]
    if "full_attn_layers" not in lac:
        kda = lac.get("kda_layers")
        lac["full_attn_layers"] = (
            default_full_attn_layers(num_layers)
            if not isinstance(kda, (list, tuple))
            else [i for i in range(1, num_layers + 1) if i not in set(kda)]
        )
    if "kda_layers" not in lac:
        full = lac["full_attn_layers"]
        full = set(full) if isinstance(full, (list, tuple)) else ()
        lac["kda_layers"] = [i for i in range(1, num_layers + 1) if i not in full]
    return lac


def _check_int(name: str, value: Any, minimum: int = 1) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        what = "a positive int" if minimum == 1 else f"an int >= {minimum}"
        raise ConfigError(f"KimiK3Config.{name} must be {what}, got {value!r}")


def _check_bool(name: str, value: Any) -> None:
    # A JSON "false" string is truthy: taking it as a bool would turn the switch on.
    if not isinstance(value, bool):
        raise ConfigError(f"KimiK3Config.{name} must be true or false (a JSON bool), got {value!r}")


def _check_float(name: str, value: Any, *, above=None, at_least=None, below=None, what: str | None = None) -> None:
    bounds = {"> ": above, ">= ": at_least, "< ": below}
    allowed = what or "a number " + " and ".join(f"{op}{v}" for op, v in bounds.items() if v is not None)
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    ok = ok and (above is None or value > above) and (at_least is None or value >= at_least)
    if not ok or (below is not None and not value < below):
        raise ConfigError(f"KimiK3Config.{name} must be {allowed}, got {value!r}")


def _list_field(name: str, value: Any) -> list | tuple:
    if not isinstance(value, (list, tuple)):
        raise ConfigError(f"KimiK3Config.{name} must be a list, got {value!r}")
    return value
