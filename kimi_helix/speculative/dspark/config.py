"""`DSparkConfig`: the configuration of a standalone DSpark drafter (DeepSpec's convention).

The drafter is a small non-causal transformer at the target's width. It reads the outputs of `target_layer_ids`
(0-based target layers, never the final one) and drafts `block_size` tokens per forward pass: slot k (0-based) of
the block `[anchor, MASK x (block_size - 1)]` predicts the token at `anchor_position + k + 1`.
"""

from __future__ import annotations

from typing import Any

from transformers import PretrainedConfig

MARKOV_HEAD_TYPES = ("vanilla",)


def default_target_layer_ids(num_target_layers: int, num_captured: int) -> list[int]:
    """Layers spread evenly over [1, L-3] (DFlash's rule; one mid layer when only one is captured), 0-based.

    The final layer (L-1) is never among them: its output is the normed state the LM head reads, not a feature.
    """
    if num_target_layers < 2:
        raise ValueError(f"the target needs >= 2 layers to capture a non-final one, got {num_target_layers}")
    if num_captured == 1:
        return [(num_target_layers - 1) // 2]
    if num_target_layers < 4 or num_captured >= num_target_layers - 2:
        return list(range(min(num_captured, num_target_layers - 1)))
    lo, hi = 1, num_target_layers - 3
    return sorted({round(lo + i * (hi - lo) / (num_captured - 1)) for i in range(num_captured)})


class DSparkConfig(PretrainedConfig):
    r"""Configuration of a DSpark drafter.

    Args:
        vocab_size, hidden_size: must equal the target's (embedding and LM head are the target's, shared).
        num_hidden_layers: drafter layers (pre-norm softmax attention + SwiGLU MLP).
        num_attention_heads, head_dim: drafter attention heads and their width.
        intermediate_size: drafter MLP width.
        target_layer_ids: 0-based target layers whose outputs are captured (never the target's final layer).
        target_num_hidden_layers: the target's layer count, recorded so configs can be checked without weights.
        block_size: gamma, slots per drafting pass (= the most drafts one pass yields).
        mask_token_id: the vocab row that fills slots 1..gamma-1.
        markov_rank: rank r of the vanilla Markov head (0: no head, DFlash's parallel drafts).
        markov_head_type: "vanilla" (`bias_k = W2(W1[x_{k-1}])`).
        enable_confidence_head: a `Linear(d + r, 1)` predicting each slot's acceptance given its prefix's.
        rope_theta, rms_norm_eps, initializer_range: as in every HF model.
    """

    model_type = "dspark"

    def __init__(
        self,
        vocab_size: int = 163840,
        hidden_size: int = 2304,
        num_hidden_layers: int = 3,
        num_attention_heads: int = 16,
        head_dim: int = 128,
        intermediate_size: int = 6144,
        target_layer_ids: list[int] | None = None,
        target_num_hidden_layers: int | None = None,
        block_size: int = 7,
        mask_token_id: int = 0,
        markov_rank: int = 256,
        markov_head_type: str = "vanilla",
        enable_confidence_head: bool = True,
        rope_theta: float = 10000.0,
        rms_norm_eps: float = 1e-5,
        initializer_range: float = 0.02,
        **kwargs: Any,
    ):
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.head_dim = head_dim
        self.intermediate_size = intermediate_size
        self.target_layer_ids = list(target_layer_ids) if target_layer_ids is not None else [0]
        self.target_num_hidden_layers = target_num_hidden_layers
        self.block_size = block_size
        self.mask_token_id = mask_token_id
        self.markov_rank = markov_rank
        self.markov_head_type = markov_head_type
        self.enable_confidence_head = enable_confidence_head
        self.rope_theta = rope_theta
        self.rms_norm_eps = rms_norm_eps
        self.initializer_range = initializer_range
        kwargs.setdefault("tie_word_embeddings", False)
        super().__init__(**kwargs)
        self.validate_fields()

    def validate_fields(self) -> None:
        """Raise `ValueError` naming the first field that cannot work on its own (fit to a target is checked by
        `kimi_helix.speculative.validator`)."""
        for name in (
            "vocab_size",
            "hidden_size",
            "num_hidden_layers",
            "num_attention_heads",
            "head_dim",
            "intermediate_size",
            "block_size",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"DSparkConfig.{name} must be a positive int, got {value!r}")
        if self.head_dim % 2:
            raise ValueError(f"DSparkConfig.head_dim must be even (RoPE rotates pairs), got {self.head_dim}")
        if not isinstance(self.markov_rank, int) or isinstance(self.markov_rank, bool) or self.markov_rank < 0:
            raise ValueError(f"DSparkConfig.markov_rank must be an int >= 0, got {self.markov_rank!r}")
        if self.markov_head_type not in MARKOV_HEAD_TYPES:
            raise ValueError(
                f"DSparkConfig.markov_head_type must be one of {MARKOV_HEAD_TYPES}, got {self.markov_head_type!r}"
            )
        ids = self.target_layer_ids
        if not ids or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
            raise ValueError(f"DSparkConfig.target_layer_ids must be a non-empty list of ints >= 0, got {ids!r}")
        if len(set(ids)) != len(ids):
            raise ValueError(f"DSparkConfig.target_layer_ids lists a layer twice: {ids!r}")
        if not isinstance(self.mask_token_id, int) or not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError(
                f"DSparkConfig.mask_token_id must be an int in [0, vocab_size={self.vocab_size}), "
                f"got {self.mask_token_id!r}"
            )

    @property
    def num_captured_layers(self) -> int:
        return len(self.target_layer_ids)
