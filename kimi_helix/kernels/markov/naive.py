"""Pure-PyTorch reference of the greedy DSpark Markov chain: the drafter's per-slot loop and confidence head.

Slot k's logits are `base[:, k] + W2 @ W1[prev]`, where prev is the token drafted at slot k - 1 (the anchor for
k = 0); the bias is a Linear in the weights' dtype (rounded to it) added in fp32, and the token its argmax. The
confidence of slot k is `sigmoid(Linear(d + r, 1)([h_k; W1[prev_k]]))`, the Linear's output in its weight's dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["check_markov_args", "markov_chain_greedy_ref"]


def check_markov_args(base, anchor_ids, w1, w2, hidden, conf_weight, conf_bias) -> None:
    """Shape checks shared by the reference and the Triton kernel (no device reads)."""
    if base.dim() != 3 or base.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"base must be fp32/fp16/bf16 [N, K, V], got {base.dtype} {list(base.shape)}")
    n, k, v = base.shape
    if anchor_ids.shape != (n,) or anchor_ids.dtype != torch.int64:
        raise ValueError(f"anchor_ids must be int64 [N]=[{n}], got {anchor_ids.dtype} {list(anchor_ids.shape)}")
    if w1.dim() != 2 or w1.shape[0] != v or w1.shape[1] < 1 or w2.shape != w1.shape or w2.dtype != w1.dtype:
        shapes = f"{w1.dtype} {list(w1.shape)} and {w2.dtype} {list(w2.shape)}"
        raise ValueError(f"w1 and w2 must both be [V, r] with V={v} and r >= 1, of one dtype, got {shapes}")
    if (hidden is None) != (conf_weight is None) or (conf_weight is None) != (conf_bias is None):
        raise ValueError("hidden, conf_weight and conf_bias are given together (a confidence head) or not at all")
    if hidden is not None:
        d = hidden.shape[-1]
        if hidden.shape != (n, k, d) or conf_weight.shape != (d + w1.shape[1],) or conf_bias.numel() != 1:
            raise ValueError(
                f"hidden must be [N, K, d]=[{n}, {k}, d], conf_weight [d + r] and conf_bias one value, got "
                f"{list(hidden.shape)}, {list(conf_weight.shape)}, {list(conf_bias.shape)}"
            )


# Twin of kernels/markov/triton.py:markov_chain_greedy_triton (same signature and results): a change to one belongs
# in both.
def markov_chain_greedy_ref(
    base: torch.Tensor,
    anchor_ids: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    hidden: torch.Tensor | None = None,
    conf_weight: torch.Tensor | None = None,
    conf_bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Greedy drafts through the Markov head, and their confidences.

    Args:
        base: [N, K, V] the LM head's logits of the K draft slots, fp32 or the head's fp16/bf16 (read as fp32:
            the widening is exact, and the chain adds in fp32 either way).
        anchor_ids: [N] int64, the token before slot 0.
        w1: [V, r] the Markov embedding W1; w2: [V, r] the Markov projection W2 (`nn.Linear(r, V).weight`).
        hidden: [N, K, d] the slots' hidden states, conf_weight [d + r] and conf_bias [1] (or []) the confidence
            head `Linear(d + r, 1)`; all None without one.

    Returns:
        tokens [N, K] int64 (argmax, lowest id on ties), confidence [N, K] fp32 in [0, 1] or None.
    """
    check_markov_args(base, anchor_ids, w1, w2, hidden, conf_weight, conf_bias)
    n, k = base.shape[:2]
    base = base.float()
    tokens = torch.empty(n, k, dtype=torch.int64, device=base.device)
    prev = anchor_ids
    for i in range(k):
        bias = F.linear(F.embedding(prev, w1), w2)
        tokens[:, i] = torch.argmax(torch.add(base[:, i], bias), dim=-1)  # fp32 + weights' dtype -> fp32
        prev = tokens[:, i]
    if hidden is None:
        return tokens, None
    prevs = torch.cat([anchor_ids[:, None], tokens[:, :-1]], dim=1)
    feats = torch.cat([hidden, F.embedding(prevs, w1)], dim=-1)
    logits = F.linear(feats, conf_weight.view(1, -1), conf_bias.view(1)).squeeze(-1).float()
    return tokens, torch.sigmoid(logits)
