"""`KimiK3Model` and `KimiK3ForCausalLM`: the hybrid decoder as Hugging Face models.

Inputs arrive as `[B, T]` (optionally left-padded, with a 2-D `attention_mask`); the model drops the padding and
runs every layer on packed tokens described by a `ForwardBatch`. The cache (`KimiK3Cache` here, the engine's paged
cache elsewhere) is passed to the layers explicitly; nothing is global.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers import initialization as init
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast

from ..kernels.backends import BackendChoice
from .batch import ForwardBatch
from .cache import KimiK3Cache
from .config import KimiK3Config
from .kda import KimiDeltaAttention
from .layers import GatedRMSNorm, RMSNorm, SwiGLU, hooked
from .mla import MLAttention
from .moe import RoutedExperts, SparseMoE, TopkRouter

# transformers 5.24 renamed the outputs' `past_key_values` to `cache` (and `generate()` reads that name).
_CACHE_FIELD = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"


class KimiK3DecoderLayer(nn.Module):
    """Pre-norm block: `x + attn(norm(x))`, then `x + mlp(norm(x))`; attn is MLA or KDA, mlp is dense or MoE."""

    def __init__(self, config: KimiK3Config, layer_idx: int):
        super().__init__()
        mla = config.is_mla_layer(layer_idx)
        self.self_attn = MLAttention(config, layer_idx) if mla else KimiDeltaAttention(config, layer_idx)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        # Checkpoint names: `block_sparse_moe` for MoE layers, `mlp` for the dense ones.
        self.is_moe = config.is_moe_layer(layer_idx)
        if self.is_moe:
            self.block_sparse_moe = SparseMoE(config)
        else:
            self.mlp = SwiGLU(config.hidden_size, config.intermediate_size)

    @property
    def ffn(self) -> nn.Module:
        return self.block_sparse_moe if self.is_moe else self.mlp

    def forward(self, x: torch.Tensor, batch: ForwardBatch, cache) -> torch.Tensor:
        """x [T, d] packed tokens -> [T, d]."""
        attn = self.self_attn(self.input_layernorm(x), batch, cache)
        # the residual add and the MLP's norm in one kernel: h = norm(x + attn), x = x + attn
        h, x = self.post_attention_layernorm.forward_add(attn, x)
        # the MoE adds the residual inside its kernels, unless a hook must see its own output (tensor
        # parallelism's all-reduce must not sum the residual once per rank)
        if self.is_moe and not hooked(self.block_sparse_moe):
            return self.block_sparse_moe(h, residual=x)
        return x + self.ffn(h)


class KimiK3PreTrainedModel(PreTrainedModel):
    config_class = KimiK3Config
    base_model_prefix = "model"
    _no_split_modules = ["KimiK3DecoderLayer"]
    # Recurrent state cannot be cropped, so HF must not build a DynamicCache or try assisted decoding.
    _is_stateful = True
    # Loaded in fp32 whatever the model dtype: routing and gate parameters are precision-sensitive.
    _keep_in_fp32_modules_strict = ["e_score_correction_bias", "gate.weight", "dt_bias", "A_log"]

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return False

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        std = self.config.initializer_range
        if isinstance(module, (nn.Linear, nn.Embedding)):
            init.normal_(module.weight, mean=0.0, std=std)
        elif isinstance(module, (RMSNorm, GatedRMSNorm)):
            init.ones_(module.weight)
        elif isinstance(module, nn.Conv1d):
            bound = 1.0 / math.sqrt(module.weight.shape[-1])
            init.uniform_(module.weight, -bound, bound)
        elif isinstance(module, KimiDeltaAttention):
            # fla's initialisation: decay rates in [1, 16], dt in [1e-3, 1e-1] stored as inverse softplus.
            init.copy_(module.A_log, torch.empty_like(module.A_log).uniform_(1.0, 16.0).log())
            dt = torch.empty_like(module.dt_bias).uniform_(math.log(1e-3), math.log(1e-1)).exp().clamp_min(1e-4)
            init.copy_(module.dt_bias, dt + torch.log(-torch.expm1(-dt)))
        elif isinstance(module, TopkRouter):
            init.normal_(module.weight, mean=0.0, std=std)
            init.zeros_(module.e_score_correction_bias)
        elif isinstance(module, RoutedExperts):
            init.normal_(module.gate_up_proj, mean=0.0, std=std)
            init.normal_(module.down_proj, mean=0.0, std=std)

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *model_args, **kwargs):
        """Load a local checkpoint directory (safetensors only; `kimi_k3` or Kimi-Linear's `kimi_linear`).

        Keyword args:
            config: a `KimiK3Config` to use instead of the folder's config.json.
            dtype: a torch dtype, its name, or "auto" (the default) for the checkpoint's; `torch_dtype` too.
            device: one device for every parameter (default cpu).
            device_map: a device, a dict of module name -> device, or "auto" / "balanced" / "balanced_low_0" /
                "sequential": accelerate places the layers across the GPUs and the CPU (`max_memory` caps each).
            check_finite: refuse tensors holding NaN or Inf (default True; one `isfinite` per tensor).
            progress_bar: a tqdm bar over the shards; None (default) shows it only on a terminal.

        The base model (`KimiK3Model`, what `AutoModel` gives) loads a causal-LM checkpoint and skips `lm_head`.
        Raises `CheckpointError` naming the file and tensor of anything the loader refuses (docs/reliability.md)
        and `ConfigError` naming a bad config field.
        """
        from .checkpoint import load_pretrained

        if model_args:
            raise TypeError(f"{cls.__name__}.from_pretrained takes no extra positional arguments, got {model_args}")
        return load_pretrained(cls, pretrained_model_name_or_path, **kwargs)

    def save_pretrained(
        self, save_directory, max_shard_size: int | str = "5GB", *, overwrite: bool = False, **kwargs
    ) -> None:
        """Write config.json, generation_config.json and sharded safetensors in the Kimi-Linear tensor layout.

        Deletes only stale weight files of its own naming pattern; a folder holding a different model's files is
        refused (`CheckpointError`) unless `overwrite=True`.
        """
        from .checkpoint import save_pretrained

        save_pretrained(self, save_directory, max_shard_size=max_shard_size, overwrite=overwrite, **kwargs)


class KimiK3Model(KimiK3PreTrainedModel):
    """Embeddings, decoder layers and the final norm; returns hidden states."""

    def __init__(self, config: KimiK3Config):
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(KimiK3DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_init()
        self.set_backends(BackendChoice.from_env())

    def set_backends(self, backends: BackendChoice) -> None:
        """Route the kernel calls of every layer through `backends` (read from the environment when the model is
        built; `LLM(attention_backend=, kernel_backend=)` sets its own)."""
        self.backends = backends
        for module in self.modules():
            if hasattr(module, "backends"):
                module.backends = backends

    def forward_packed(self, x: torch.Tensor, batch: ForwardBatch, cache) -> torch.Tensor:
        """Run all layers on packed embeddings x [T, d]; the entry point the engine shares."""
        for layer in self.layers:
            x = layer(x, batch, cache)
        return self.norm(x)

    # twin of KimiK3ForCausalLM.forward's signature (HF's argument names): an argument added here belongs there too
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: KimiK3Cache | None = None,
        past_key_values: KimiK3Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        return_dict: bool | None = None,
        **kwargs,
    ) -> BaseModelOutputWithPast:
        """input_ids [B, T] (or inputs_embeds [B, T, d]); attention_mask [B, past + T] with 0 on padding.

        transformers >= 5.24 passes the cache as `cache=`, older versions as `past_key_values=`; both work.
        `position_ids` are ignored: positions follow from the cache length and the mask.
        """
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of input_ids [B, T] and inputs_embeds [B, T, d]")
        cache = cache if cache is not None else past_key_values
        use_cache = self.config.use_cache if use_cache is None else use_cache
        embeds = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        bsz, t = embeds.shape[:2]
        if cache is None and use_cache:
            cache = KimiK3Cache(self.config, bsz)
        work_cache = cache if cache is not None else KimiK3Cache(self.config, bsz)

        if attention_mask is not None:
            if attention_mask.dim() != 2 or attention_mask.shape[0] != bsz or attention_mask.shape[1] < t:
                raise ValueError(
                    f"attention_mask must be [B, past + T] = [{bsz}, >= {t}] of 0/1, got {tuple(attention_mask.shape)}"
                )
            keep = attention_mask[:, -t:].bool()
        else:
            keep = torch.ones(bsz, t, dtype=torch.bool, device=embeds.device)
        seq_lens = keep.sum(dim=1).tolist()
        batch = ForwardBatch.build(seq_lens, list(work_cache.seq_lens), embeds.device)

        hidden = self.forward_packed(embeds[keep], batch, work_cache)
        work_cache.commit(batch)
        out = hidden.new_zeros(bsz, t, hidden.shape[-1])
        out[keep.to(out.device)] = hidden  # the final norm may sit on another device (device_map)
        return BaseModelOutputWithPast(last_hidden_state=out, **{_CACHE_FIELD: cache if use_cache else None})


class KimiK3ForCausalLM(KimiK3PreTrainedModel, GenerationMixin):
    """`KimiK3Model` plus the LM head; HF `generate()` works with the model's own `KimiK3Cache`."""

    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, config: KimiK3Config):
        super().__init__(config)
        self.model = KimiK3Model(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.model.embed_tokens

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head

    # twin of KimiK3Model.forward's signature (HF's argument names): an argument added here belongs there too
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: KimiK3Cache | None = None,
        past_key_values: KimiK3Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        return_dict: bool | None = None,
        **kwargs,
    ) -> CausalLMOutputWithPast:
        """Logits [B, T, V] (or of the last `logits_to_keep` positions); loss if `labels` [B, T] are given."""
        outputs = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            cache=cache if cache is not None else past_key_values,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
        )
        hidden = outputs.last_hidden_state
        if isinstance(logits_to_keep, int):
            hidden = hidden[:, -logits_to_keep:] if logits_to_keep > 0 else hidden
        else:
            hidden = hidden[:, logits_to_keep]
        logits = self.lm_head(hidden)
        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)
        return CausalLMOutputWithPast(loss=loss, logits=logits, **{_CACHE_FIELD: getattr(outputs, _CACHE_FIELD)})
