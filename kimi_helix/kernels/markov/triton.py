"""Triton greedy DSpark Markov chain: every draft slot's bias, argmax and confidence in K + 1 launches.

`markov_chain_greedy_ref` spends about five kernels a slot (gather, GEMV, add, argmax) and five more for the
confidence head, which is what a batch-1 drafting round costs: launches, not FLOPs. Here slot k is one launch over
a grid of (rows, vocabulary splits). Each program first reduces slot k - 1's split winners to that slot's token
(every program redundantly: a few hundred bytes, so no grid-wide sync is needed), gathers W1[token] (r values),
streams its share of W2 in [BLOCK_V, r] tiles to form the bias, adds the slot's base logits and writes its split's
maximum and lowest winning id. Split 0 also writes the previous slot's token and this slot's confidence, which
needs only the token before it and the slot's hidden state. One last launch reduces the final slot.

Splitting the vocabulary spreads W2 over the SMs: one program per row would stream all of it through one SM
each slot (10 MB at Kimi's 163840 x 32 in bf16).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kimi_helix.kernels.backends import FLOATS, OpCaps
from kimi_helix.kernels.common import check_triton_device
from kimi_helix.kernels.device import triton_devices
from kimi_helix.kernels.launch import cdiv, next_pow2
from kimi_helix.kernels.markov.naive import check_markov_args

__all__ = ["CAPS", "markov_chain_greedy_triton"]

# What the kernel serves, read by the backend switch.
CAPS = OpCaps(triton_devices(), FLOATS)
TILE_ELEMENTS = 4096  # elements of one W2 tile [BLOCK_V, BLOCK_R]: 8 KB in 16 bits
# Vocabulary splits per row: enough programs to spread W2 over the SMs, few enough that every program of the
# next slot re-reduces the winners cheaply.
MAX_SPLITS = 128


@triton.jit
def markov_slot_kernel(
    base, anchors, w1, w2, hidden, wc, bc, tokens, conf, part_m, part_i, k, K, V, R, D, S, CHUNK, stride_a,
    stride_bn, stride_bk, stride_bv, stride_hn, stride_hk, stride_hd,
    BLOCK_V: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
    HAS_CONF: tl.constexpr, FINAL: tl.constexpr,
):  # fmt: skip
    n = tl.program_id(0).to(tl.int64)
    s = tl.program_id(1)
    # the token before slot k: the anchor, or the argmax over slot k - 1's split winners (lowest id on ties; 0
    # when no value beats -inf, as when every logit is -inf or NaN)
    if k == 0:
        prev = tl.load(anchors + n * stride_a).to(tl.int64)
    else:
        o_s = tl.arange(0, BLOCK_S)
        winners = (n * K + k - 1) * S + o_s
        pm = tl.load(part_m + winners, mask=o_s < S, other=float("-inf"))
        pi = tl.load(part_i + winners, mask=o_s < S, other=V)
        i = tl.min(tl.where(pm == tl.max(pm, axis=0), pi, V), axis=0)
        prev = tl.where(i < V, i, 0).to(tl.int64)
    if FINAL:
        tl.store(tokens + n * K + k - 1, prev)
    else:
        o_r = tl.arange(0, BLOCK_R)
        in_r = o_r < R
        e = tl.load(w1 + prev * R + o_r, mask=in_r, other=0.0).to(tl.float32)
        if s == 0:
            if k > 0:
                tl.store(tokens + n * K + k - 1, prev)
            if HAS_CONF:
                o_d = tl.arange(0, BLOCK_D)
                in_d = o_d < D
                h = tl.load(hidden + n * stride_hn + k * stride_hk + o_d * stride_hd, mask=in_d, other=0.0)
                wc_h = tl.load(wc + o_d, mask=in_d, other=0.0).to(tl.float32)
                wc_e = tl.load(wc + D + o_r, mask=in_r, other=0.0).to(tl.float32)
                logit = tl.sum(h.to(tl.float32) * wc_h, axis=0) + tl.sum(e * wc_e, axis=0) + tl.load(bc).to(tl.float32)
                # the head's Linear returns its weight's dtype; the sigmoid runs on that value in fp32
                logit = logit.to(wc.dtype.element_ty).to(tl.float32)
                tl.store(conf + n * K + k, tl.sigmoid(logit))
        o_v = tl.arange(0, BLOCK_V)
        best = tl.full([], float("-inf"), tl.float32)
        best_i = tl.full([], V, tl.int32)
        for v0 in range(0, CHUNK, BLOCK_V):
            v = s * CHUNK + v0 + o_v
            in_v = v < V
            w = tl.load(w2 + v[:, None] * R + o_r[None, :], mask=in_v[:, None] & in_r[None, :], other=0.0)
            # rounded to the weights' dtype as the reference's Linear output, then added in fp32
            bias = tl.sum(w.to(tl.float32) * e[None, :], axis=1).to(w2.dtype.element_ty).to(tl.float32)
            x = tl.load(base + n * stride_bn + k * stride_bk + v * stride_bv, mask=in_v, other=float("-inf"))
            x = x.to(tl.float32) + bias
            m = tl.max(x, axis=0)
            i = tl.min(tl.where(x == m, v, V), axis=0)
            # strictly greater: an equal maximum in a later tile loses to the earlier, lower id (torch.argmax)
            take = m > best
            best = tl.where(take, m, best)
            best_i = tl.where(take, i, best_i)
        tl.store(part_m + (n * K + k) * S + s, best)
        tl.store(part_i + (n * K + k) * S + s, best_i)


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
    results (tokens [N, K] int64, confidence [N, K] fp32 or None) in K + 1 launches, no host sync.

    Args:
        base: [N, K, V] fp32/fp16/bf16 logits (read as fp32); anchor_ids [N] int64; w1, w2 [V, r] the Markov
            weights (one dtype).
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
    block_v = min(next_pow2(v), max(TILE_ELEMENTS // block_r, 16))
    chunk = cdiv(cdiv(v, min(cdiv(v, block_v), MAX_SPLITS)), block_v) * block_v  # whole tiles a split
    splits = cdiv(v, chunk)
    part_m = torch.empty(n, k, splits, dtype=torch.float32, device=base.device)  # each split's maximum and id
    part_i = torch.empty(n, k, splits, dtype=torch.int32, device=base.device)
    d = hidden.shape[-1] if has_conf else 0
    w1, w2 = w1.contiguous(), w2.contiguous()
    conf_args = (hidden, conf_weight.contiguous(), conf_bias) if has_conf else (base, w1, w1)
    for slot in range(k + 1):
        final = slot == k
        markov_slot_kernel[(n, 1 if final else splits)](
            base, anchor_ids, w1, w2, *conf_args, tokens, conf if has_conf else base, part_m, part_i,
            slot, k, v, r, d, splits, chunk, anchor_ids.stride(0), *base.stride(),
            *(hidden.stride() if has_conf else (0, 0, 0)),
            BLOCK_V=block_v, BLOCK_R=block_r, BLOCK_D=next_pow2(d) if has_conf else 1,
            BLOCK_S=next_pow2(splits), HAS_CONF=has_conf, FINAL=final, num_warps=4,
        )  # fmt: skip
    return tokens, conf
