"""Triton greedy DSpark Markov chain: every draft slot's bias, argmax and confidence in one launch.

`markov_chain_greedy_ref` spends about five kernels a slot (gather, GEMV, add, argmax) and five more for the
confidence head, which is what a batch-1 drafting round costs: launches, not FLOPs. Here one program per row walks
the chain: for each slot it gathers W1[prev] (r values), streams W2 in [BLOCK_V, r] tiles to form the bias tile by
tile, adds it to the slot's base logits and keeps a running argmax, then feeds the winner to the next slot. The
confidence needs only prev and the slot's hidden state, so it is computed on the way.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kimi_helix.kernels.backends import FLOATS, OpCaps
from kimi_helix.kernels.common import check_triton_device
from kimi_helix.kernels.device import triton_devices
from kimi_helix.kernels.launch import next_pow2
from kimi_helix.kernels.markov.naive import check_markov_args

__all__ = ["CAPS", "markov_chain_greedy_triton"]

# What the kernel serves, read by the backend switch.
CAPS = OpCaps(triton_devices(), FLOATS)
# elements of one W2 tile [BLOCK_V, BLOCK_R]: a single program streams all of W2 per slot, so it keeps many loads
# in flight
TILE_ELEMENTS = 16384


@triton.jit
def markov_chain_kernel(
    base, anchors, w1, w2, hidden, wc, bc, tokens, conf, K, V, R, D, stride_a,
    stride_bn, stride_bk, stride_bv, stride_hn, stride_hk, stride_hd,
    BLOCK_V: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, HAS_CONF: tl.constexpr,
):  # fmt: skip
    n = tl.program_id(0).to(tl.int64)
    o_r = tl.arange(0, BLOCK_R)
    in_r = o_r < R
    o_v = tl.arange(0, BLOCK_V)
    o_d = tl.arange(0, BLOCK_D)
    in_d = o_d < D
    if HAS_CONF:
        wc_h = tl.load(wc + o_d, mask=in_d, other=0.0).to(tl.float32)
        wc_e = tl.load(wc + D + o_r, mask=in_r, other=0.0).to(tl.float32)
        bc_v = tl.load(bc).to(tl.float32)
    prev = tl.load(anchors + n * stride_a).to(tl.int64)
    for k in range(K):
        e = tl.load(w1 + prev * R + o_r, mask=in_r, other=0.0).to(tl.float32)
        if HAS_CONF:
            h = tl.load(hidden + n * stride_hn + k * stride_hk + o_d * stride_hd, mask=in_d, other=0.0)
            logit = tl.sum(h.to(tl.float32) * wc_h, axis=0) + tl.sum(e * wc_e, axis=0) + bc_v
            # the head's Linear returns its weight's dtype; the sigmoid runs on that value in fp32
            logit = logit.to(wc.dtype.element_ty).to(tl.float32)
            tl.store(conf + n * K + k, tl.sigmoid(logit))
        best = tl.full([], float("-inf"), tl.float32)
        best_i = tl.zeros([], tl.int64)  # stays a valid id when no value beats -inf (all -inf or NaN)
        for v0 in range(0, V, BLOCK_V):
            v = v0 + o_v
            in_v = v < V
            w = tl.load(w2 + v[:, None] * R + o_r[None, :], mask=in_v[:, None] & in_r[None, :], other=0.0)
            # rounded to the weights' dtype as the reference's Linear output, then added in fp32
            bias = tl.sum(w.to(tl.float32) * e[None, :], axis=1).to(w2.dtype.element_ty).to(tl.float32)
            x = tl.load(base + n * stride_bn + k * stride_bk + v * stride_bv, mask=in_v, other=float("-inf")) + bias
            m = tl.max(x, axis=0)
            i = tl.min(tl.where(x == m, v, V), axis=0)
            # strictly greater: an equal maximum in a later tile loses to the earlier, lower id (torch.argmax)
            take = m > best
            best = tl.where(take, m, best)
            best_i = tl.where(take, i.to(tl.int64), best_i)
        tl.store(tokens + n * K + k, best_i)
        prev = best_i


# Twin of kernels/markov/naive.py:markov_chain_greedy_ref (same signature and results): a change to one belongs in
# both.
def markov_chain_greedy_triton(
    base: torch.Tensor,
    anchor_ids: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    hidden: torch.Tensor | None = None,
    conf_weight: torch.Tensor | None = None,
    conf_bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Triton form of :func:`kimi_helix.kernels.markov.naive.markov_chain_greedy_ref`: the same arguments and
    results (tokens [N, K] int64, confidence [N, K] fp32 or None) in one launch, no host sync.

    Args:
        base: [N, K, V] fp32 logits; anchor_ids [N] int64; w1, w2 [V, r] the Markov weights (one dtype).
        hidden: [N, K, d], conf_weight [d + r], conf_bias [1] or []: the confidence head, or all None.
    """
    check_markov_args(base, anchor_ids, w1, w2, hidden, conf_weight, conf_bias)
    check_triton_device("base", base)
    n, k, v = base.shape
    r = w1.shape[1]
    has_conf = hidden is not None
    tokens = torch.empty(n, k, dtype=torch.int64, device=base.device)
    conf = torch.empty(n, k, dtype=torch.float32, device=base.device) if has_conf else None
    if n == 0 or k == 0:
        return tokens, conf
    block_r = next_pow2(r)
    d = hidden.shape[-1] if has_conf else 0
    hidden_strides = hidden.stride() if has_conf else (0, 0, 0)
    markov_chain_kernel[(n,)](
        base, anchor_ids, w1.contiguous(), w2.contiguous(),
        hidden if has_conf else base, conf_weight.contiguous() if has_conf else w1,
        conf_bias if has_conf else w1, tokens, conf if has_conf else base, k, v, r, d, anchor_ids.stride(0),
        *base.stride(), *hidden_strides,
        BLOCK_V=min(next_pow2(v), max(TILE_ELEMENTS // block_r, 16)), BLOCK_R=block_r,
        BLOCK_D=next_pow2(d) if has_conf else 1, HAS_CONF=has_conf, num_warps=8,
    )  # fmt: skip
    return tokens, conf
