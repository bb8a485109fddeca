"""The greedy DSpark Markov chain (per slot: bias W2 @ W1[prev], argmax; the confidence head), dispatched by the
op switch."""

from __future__ import annotations

from kimi_helix.kernels.backends import op_backend
from kimi_helix.kernels.markov.naive import markov_chain_greedy_ref


def markov_chain_greedy(base, anchor_ids, w1, w2, hidden=None, conf_weight=None, conf_bias=None, *, backend=None):
    """base [N, K, V] (fp32, or the LM head's fp16/bf16), anchor_ids [N], w1/w2 [V, r] (+ the confidence head's
    hidden [N, K, d], weight [d + r], bias [1]) -> (tokens [N, K] int64, confidence [N, K] fp32 or None); see
    `markov_chain_greedy_ref`. The backend is chosen on the Markov weights' dtype."""
    if op_backend("markov_chain_greedy", w2, forced=backend) == "triton":
        from kimi_helix.kernels.markov.triton import markov_chain_greedy_triton as fn
    else:
        fn = markov_chain_greedy_ref
    return fn(base, anchor_ids, w1, w2, hidden, conf_weight, conf_bias)


__all__ = ["markov_chain_greedy", "markov_chain_greedy_ref"]
