"""Triton MoE routing: the fp32 router logits, then one kernel for everything after them.

`moe_router_ref` spends about a dozen small kernels a call after its GEMM (sigmoid, bias add, group scores and
mask, top-k, gather, sum, divide, scale). Here one program per token does them on its [E] logits in registers:
the activation, the biased choice, group-limited masking, k rounds of argmax (highest value first, lowest id on
ties), the unbiased weights, renormalisation and scaling.

The logits: for a few tokens (decode, verify) `router_logits_kernel`, one program per expert that reads its weight
row once and x in its own dtype (no cast launch; cuBLAS's fp32 GEMV spreads 256 outputs over few blocks); for
more tokens an fp32 GEMM.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kimi_helix.kernels.backends import FLOATS, OpCaps
from kimi_helix.kernels.common import check_triton_device
from kimi_helix.kernels.device import triton_devices
from kimi_helix.kernels.launch import next_pow2

__all__ = ["CAPS", "moe_router_triton"]

# What the kernel serves, read by the backend switch.
CAPS = OpCaps(triton_devices(), FLOATS)
# up to this many tokens (and a hidden size whose power-of-two cover fits one program) the logits kernel runs
LOGITS_KERNEL_MAX_TOKENS, LOGITS_KERNEL_MAX_HIDDEN = 8, 8192
TILE_ELEMENTS = 2048  # x elements the logits kernel reduces at once: 16 fp32 registers a thread at 4 warps


@triton.jit
def router_logits_kernel(x_ptr, w_ptr, logits_ptr, T, d, stride_xt, stride_xd, stride_we, stride_wd, stride_lt,
                         BLOCK_T: tl.constexpr, ROWS: tl.constexpr, BLOCK_D: tl.constexpr):  # fmt: skip
    """logits[t, e] = x[t] . weight[e] in fp32 for t < T <= BLOCK_T: program e holds weight row e in registers and
    reduces ROWS tokens at once (one cross-warp reduction for all of them, where a row at a time waits on each)."""
    e = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_D)
    in_d = offs < d
    w = tl.load(w_ptr + e * stride_we + offs * stride_wd, mask=in_d, other=0.0).to(tl.float32)
    rows = tl.arange(0, ROWS)
    for i in tl.static_range(0, BLOCK_T, ROWS):
        # rows past T redo row T - 1 and store the same value again: no masks, no branches
        t = tl.minimum(i + rows, T - 1).to(tl.int64)
        x = tl.load(x_ptr + t[:, None] * stride_xt + offs[None, :] * stride_xd, mask=in_d[None, :], other=0.0)
        tl.store(logits_ptr + t * stride_lt + e, tl.sum(x.to(tl.float32) * w[None, :], axis=1))


def router_logits(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [T, d] (any float dtype) @ weight [E, d]^T in fp32 -> [T, E] fp32."""
    T, d = x.shape
    if T > LOGITS_KERNEL_MAX_TOKENS or next_pow2(d) > LOGITS_KERNEL_MAX_HIDDEN:
        return F.linear(x.float(), weight.float())
    logits = torch.empty(T, weight.shape[0], dtype=torch.float32, device=x.device)
    block_t, block_d = next_pow2(T), next_pow2(d)
    router_logits_kernel[(weight.shape[0],)](
        x, weight, logits, T, d, *x.stride(), *weight.stride(), logits.stride(0),
        BLOCK_T=block_t, ROWS=min(block_t, max(1, TILE_ELEMENTS // block_d)), BLOCK_D=block_d, num_warps=4,
    )  # fmt: skip
    return logits


@triton.jit
def _argmax_2d(v, e, BIG: tl.constexpr):
    """(max, lowest flat index e holding it) of a 2-D tile v."""
    m = tl.max(tl.max(v, axis=1), axis=0)
    return m, tl.min(tl.min(tl.where(v == m, e, BIG), axis=1), axis=0)


@triton.jit
def moe_topk_kernel(
    logits, bias, weights_out, ids_out, stride_l, E, scaling,
    TOP_K: tl.constexpr, BK: tl.constexpr, NUM_GROUPS: tl.constexpr, TOPK_GROUP: tl.constexpr,
    BG: tl.constexpr, BEG: tl.constexpr, HAS_BIAS: tl.constexpr, SIGMOID: tl.constexpr, RENORM: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    # experts as a [groups, experts per group] tile; one group of every expert without group-limited routing
    eg = E // NUM_GROUPS
    o_g = tl.arange(0, BG)[:, None]
    o_j = tl.arange(0, BEG)[None, :]
    e = o_g * eg + o_j
    valid = (o_g < NUM_GROUPS) & (o_j < eg)
    x = tl.load(logits + t * stride_l + e, mask=valid, other=float("-inf"))
    if SIGMOID:
        scores = tl.where(valid, tl.sigmoid(x), 0.0)
    else:
        ex = tl.where(valid, tl.exp(x - tl.max(tl.max(x, axis=1), axis=0)), 0.0)
        scores = ex / tl.sum(tl.sum(ex, axis=1), axis=0)
    choice = scores
    if HAS_BIAS:
        choice = choice + tl.load(bias + e, mask=valid, other=0.0)
    choice = tl.where(valid, choice, float("-inf"))
    if NUM_GROUPS > 1:
        # a group's score: the sum of its two best choices; only the TOPK_GROUP best groups stay eligible
        m1 = tl.max(choice, axis=1)
        i1 = tl.min(tl.where(choice == m1[:, None], o_j, BEG), axis=1)
        m2 = tl.max(tl.where(o_j == i1[:, None], float("-inf"), choice), axis=1)
        group_score = tl.where(tl.arange(0, BG) < NUM_GROUPS, m1 + m2, float("-inf"))
        keep = tl.zeros([BG], dtype=tl.int1)
        for _ in tl.static_range(TOPK_GROUP):
            gm = tl.max(group_score, axis=0)
            gi = tl.min(tl.where(group_score == gm, tl.arange(0, BG), BG), axis=0)
            keep = keep | (tl.arange(0, BG) == gi)
            group_score = tl.where(tl.arange(0, BG) == gi, float("-inf"), group_score)
        choice = tl.where(keep[:, None], choice, float("-inf"))
    o_k = tl.arange(0, BK)
    w = tl.zeros([BK], dtype=tl.float32)
    ids = tl.zeros([BK], dtype=tl.int64)
    for j in tl.static_range(TOP_K):
        _, idx = _argmax_2d(choice, e, BG * BEG)
        # NaN logits (a padded row of a CUDA graph) match no maximum: keep the id a valid expert all the same
        idx = tl.minimum(idx, E - 1)
        w = tl.where(o_k == j, tl.sum(tl.sum(tl.where(e == idx, scores, 0.0), axis=1), axis=0), w)
        ids = tl.where(o_k == j, idx.to(tl.int64), ids)
        choice = tl.where(e == idx, float("-inf"), choice)
    if RENORM:
        # the epsilon keeps an all-zero row finite, as in the reference
        w = w / (tl.sum(w, axis=0) + 1e-20)
    tl.store(weights_out + t * TOP_K + o_k, w * scaling, mask=o_k < TOP_K)
    tl.store(ids_out + t * TOP_K + o_k, ids, mask=o_k < TOP_K)


# Twin of kernels/moe/naive.py:moe_router_ref (same signature and results): a change to one belongs in both.
def moe_router_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    top_k: int,
    num_groups: int = 1,
    topk_group: int = 1,
    renormalize: bool = True,
    scaling: float = 1.0,
    activation: str = "sigmoid",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton form of :func:`kimi_helix.kernels.moe.naive.moe_router_ref`: the same arguments and results
    (weights [T, top_k] fp32, ids [T, top_k] int64), no host sync.

    Args:
        x: [T, d] any float dtype; the logits are `x.float() @ weight.float().T` (fp32, `router_logits`).
        weight: [E, d] router weight. bias: [E] `e_score_correction_bias` or None.
        top_k: experts per token (1 <= top_k <= E).
        num_groups, topk_group: group-limited routing (num_groups divides E, >= 2 experts a group, topk_group <=
            num_groups); num_groups == 1 disables it.
        renormalize, scaling, activation: as in the reference ("sigmoid" or "softmax").
    """
    if activation not in ("sigmoid", "softmax"):
        raise ValueError(f"activation must be 'sigmoid' or 'softmax', got {activation!r}")
    if x.dim() != 2 or weight.dim() != 2 or weight.shape[1] != x.shape[1]:
        raise ValueError(f"x must be [T, d] and weight [E, d], got {list(x.shape)} and {list(weight.shape)}")
    E = weight.shape[0]
    if num_groups < 1 or E % num_groups or (num_groups > 1 and E // num_groups < 2):
        raise ValueError(f"num_groups={num_groups} must divide the {E} experts into groups of >= 2")
    if not 1 <= topk_group <= num_groups:
        raise ValueError(f"topk_group={topk_group} must lie in [1, num_groups={num_groups}]")
    if not 1 <= top_k <= E:
        raise ValueError(f"top_k={top_k} must lie in [1, E={E}]")
    if bias is not None and bias.shape != (E,):
        raise ValueError(f"bias must have shape [E]=[{E}], got {list(bias.shape)}")
    check_triton_device("x", x)
    T = x.shape[0]
    weights = torch.empty(T, top_k, dtype=torch.float32, device=x.device)
    ids = torch.empty(T, top_k, dtype=torch.int64, device=x.device)
    if T > 0:
        logits = router_logits(x, weight)
        moe_topk_kernel[(T,)](
            logits,
            bias.float().contiguous() if bias is not None else logits,
            weights,
            ids,
            logits.stride(0),
            E,
            float(scaling),
            TOP_K=top_k,
            BK=next_pow2(top_k),
            NUM_GROUPS=num_groups,
            TOPK_GROUP=topk_group if num_groups > 1 else 1,
            BG=next_pow2(num_groups),
            BEG=next_pow2(E // num_groups),
            HAS_BIAS=bias is not None,
            SIGMOID=activation == "sigmoid",
            RENORM=renormalize,
            num_warps=4 if E >= 1024 else 1,
        )
    return weights, ids
