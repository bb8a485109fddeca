"""Triton short causal depthwise convolution with fused SiLU: prefill (packed varlen) and one-token decode update.

Layouts match :mod:`kimi_helix.kernels.conv.naive`: channels last (``x [B, T, D]``, cache ``[N, W - 1, D]`` holding
the previous ``W - 1`` raw inputs, oldest first), so every load and store runs along D and is coalesced. The cache
may be an engine pool ``[slots, W - 1, D]`` addressed by ``state_indices`` and is then read and updated in place.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from kimi_helix.kernels.backends import FLOATS, OpCaps
from kimi_helix.kernels.common import check_cu_seqlens, check_device, check_index, check_triton_device
from kimi_helix.kernels.conv.naive import channel_groups, check_record, check_weight
from kimi_helix.kernels.device import interpreting, triton_devices
from kimi_helix.kernels.launch import cdiv, next_pow2
from kimi_helix.kernels.sequences import sequence_span

__all__ = ["CAPS", "causal_conv1d_triton", "causal_conv1d_update_triton"]

# What both kernels serve, read by the backend switch.
CAPS = OpCaps(triton_devices(), FLOATS)

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@triton.jit
def _group(i_s, x0, x1, x2, w0, w1, w2, stride_x0, stride_x1, stride_x2):
    """Input, weight and input row stride of channel group i_s (up to three, e.g. q, k, v: each its own tensor, so
    no caller concatenates them); group i_s is channels [i_s * P, (i_s + 1) * P) of the state and of y."""
    if i_s == 0:
        return x0, w0, stride_x0
    elif i_s == 1:
        return x1, w1, stride_x1
    else:
        return x2, w2, stride_x2


@triton.jit
def causal_conv1d_fwd_kernel(
    x0,
    x1,
    x2,
    w0,
    w1,
    w2,
    y,
    h0,
    xr,
    cu_seqlens,
    state_indices,
    stride_x0,
    stride_x1,
    stride_x2,
    stride_y,
    stride_y_group,
    stride_h0_n,
    stride_h0_w,
    stride_xr,
    total_t,
    T,
    N,
    P,
    W: tl.constexpr,
    BT: tl.constexpr,
    BD: tl.constexpr,
    LOG_N: tl.constexpr,
    IS_VARLEN: tl.constexpr,
    USE_INITIAL_STATE: tl.constexpr,
    USE_STATE_INDICES: tl.constexpr,
    SILU: tl.constexpr,
    RECORD: tl.constexpr,
):
    # One [BT tokens, BD channels] tile of channel group i_s of the packed input. A tap that reaches before its
    # token's sequence start reads the sequence's cache instead (or zero), so sequences never see each other's inputs.
    i_t, i_s, i_d = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    x, w, stride_x_t = _group(i_s, x0, x1, x2, w0, w1, w2, stride_x0, stride_x1, stride_x2)
    o_t = (i_t * BT + tl.arange(0, BT)).to(tl.int64)
    o_d = i_d * BD + tl.arange(0, BD)
    o_c = i_s * P + o_d  # the channels in the cache and in y
    mask_t = o_t < total_t
    mask_d = o_d < P
    if IS_VARLEN:
        # each token's sequence: the number of sequence ends cu_seqlens[1:] at or before it, by a binary search
        # over them (LOG_N = N.bit_length() halvings; no host-side search, no extra kernel)
        i_n = tl.zeros([BT], dtype=tl.int64)
        for j in tl.static_range(LOG_N):
            cand = i_n + (1 << (LOG_N - 1 - j))
            end = tl.load(cu_seqlens + cand, mask=mask_t & (cand <= N), other=0).to(tl.int64)
            i_n = tl.where((cand <= N) & (end <= o_t), cand, i_n)
        bos = tl.load(cu_seqlens + i_n, mask=mask_t, other=0).to(tl.int64)
    else:
        i_n = o_t // T
        bos = i_n * T
    if USE_INITIAL_STATE:
        slot = tl.load(state_indices + i_n, mask=mask_t, other=0).to(tl.int64) if USE_STATE_INDICES else i_n

    acc = tl.zeros([BT, BD], dtype=tl.float32)
    for j in tl.static_range(W):
        src = o_t - (W - 1) + j
        in_seq = src >= bos
        m = mask_t[:, None] & mask_d[None, :]
        b_x = tl.load(x + src[:, None] * stride_x_t + o_d[None, :], mask=m & in_seq[:, None], other=0.0)
        if RECORD and j == W - 1:  # the last tap is the token's own input: record it from the load the conv needs
            tl.store(xr + o_t[:, None] * stride_xr + o_c[None, :], b_x.to(xr.dtype.element_ty), mask=m)
        b_x = b_x.to(tl.float32)
        if USE_INITIAL_STATE:
            p_h = h0 + slot[:, None] * stride_h0_n + (src - bos + W - 1)[:, None] * stride_h0_w + o_c[None, :]
            b_x += tl.load(p_h, mask=m & ~in_seq[:, None], other=0.0).to(tl.float32)
        b_w = tl.load(w + o_d * W + j, mask=mask_d, other=0.0).to(tl.float32)
        acc += b_x * b_w[None, :]
    if SILU:
        acc = acc * tl.sigmoid(acc)
    p_y = y + i_s * stride_y_group + o_t[:, None] * stride_y + o_d[None, :]
    tl.store(p_y, acc.to(y.dtype.element_ty), mask=mask_t[:, None] & mask_d[None, :])


@triton.jit
def causal_conv1d_final_state_kernel(
    x0,
    x1,
    x2,
    h0,
    ht,
    hb,
    cu_seqlens,
    state_indices,
    stride_x0,
    stride_x1,
    stride_x2,
    stride_h0_n,
    stride_h0_w,
    stride_ht_n,
    stride_ht_w,
    stride_hb_n,
    stride_hb_w,
    T,
    P,
    W: tl.constexpr,
    BW: tl.constexpr,
    BD: tl.constexpr,
    IS_VARLEN: tl.constexpr,
    USE_INITIAL_STATE: tl.constexpr,
    USE_STATE_INDICES: tl.constexpr,
    RECORD: tl.constexpr,
):
    # The last W - 1 inputs of each sequence, topped up from its old cache when the sequence is shorter. With a pool
    # the same program reads and then overwrites its slot's [W - 1, BD] slab; a sequence shorter than W - 1 moves
    # old row j + L to row j, loaded and stored by different warps, so a barrier parts the loads from the stores.
    # With RECORD it first copies the whole old slab to hb (the verify step's rollback record).
    i_n, i_s, i_d = tl.program_id(0).to(tl.int64), tl.program_id(1), tl.program_id(2)
    x, _, stride_x_t = _group(i_s, x0, x1, x2, x0, x1, x2, stride_x0, stride_x1, stride_x2)
    bos, eos, slot = sequence_span(cu_seqlens, state_indices, i_n, T, IS_VARLEN, USE_STATE_INDICES)
    o_w = tl.arange(0, BW)
    o_d = i_d * BD + tl.arange(0, BD)
    o_c = i_s * P + o_d  # the channels in the caches
    m = (o_w < W - 1)[:, None] & (o_d < P)[None, :]
    pos = eos - (W - 1) + o_w
    in_seq = pos >= bos
    b_s = tl.load(x + pos[:, None] * stride_x_t + o_d[None, :], mask=m & in_seq[:, None], other=0.0)
    if USE_INITIAL_STATE:
        p_h = h0 + slot * stride_h0_n + (pos - bos + W - 1)[:, None] * stride_h0_w + o_c[None, :]
        b_s = tl.where(in_seq[:, None], b_s, tl.load(p_h, mask=m & ~in_seq[:, None], other=0.0).to(b_s.dtype))
    if RECORD:
        # all W - 1 old rows, not only those the taps reach; each element is loaded by the thread that stores the
        # new one over it below (the same [BW, BD] tile), so the load precedes the overwrite
        b_old = tl.load(h0 + slot * stride_h0_n + o_w[:, None] * stride_h0_w + o_c[None, :], mask=m)
        tl.store(
            hb + i_n * stride_hb_n + o_w[:, None] * stride_hb_w + o_c[None, :], b_old.to(hb.dtype.element_ty), mask=m
        )
    if USE_STATE_INDICES:  # ht is h0: every warp's loads of the slab before any warp's stores
        tl.debug_barrier()
    tl.store(ht + slot * stride_ht_n + o_w[:, None] * stride_ht_w + o_c[None, :], b_s.to(ht.dtype.element_ty), mask=m)


@triton.jit
def causal_conv1d_update_kernel(x0, x1, x2, w0, w1, w2, y, state, state_indices, stride_x0, stride_x1, stride_x2,
                                stride_y, stride_s_n, stride_s_w, P, W: tl.constexpr, BD: tl.constexpr,
                                USE_STATE_INDICES: tl.constexpr, SILU: tl.constexpr):  # fmt: skip
    # Program (n, s, d): channels [d * BD, (d + 1) * BD) of channel group s (see `_group`) of sequence n.
    i_n, i_s, i_d = tl.program_id(0).to(tl.int64), tl.program_id(1), tl.program_id(2)
    slot = tl.load(state_indices + i_n).to(tl.int64) if USE_STATE_INDICES else i_n
    p_x, p_w, stride_x = _group(i_s, x0, x1, x2, w0, w1, w2, stride_x0, stride_x1, stride_x2)
    p_x += i_n * stride_x
    o_d = i_d * BD + tl.arange(0, BD)
    mask_d = o_d < P
    o_c = i_s * P + o_d  # the channels in the state and in y
    p_s = state + slot * stride_s_n + o_c
    b_x = tl.load(p_x + o_d, mask=mask_d, other=0.0)
    acc = b_x.to(tl.float32) * tl.load(p_w + o_d * W + W - 1, mask=mask_d, other=0.0).to(tl.float32)
    # Shift the window one step: each thread loads row j + 1 and stores it to row j of the same channels, and all
    # loads of a row precede its store in program order, so the in-place update needs no barrier.
    for j in tl.static_range(W - 1):
        b_s = tl.load(p_s + j * stride_s_w, mask=mask_d, other=0.0)
        acc += b_s.to(tl.float32) * tl.load(p_w + o_d * W + j, mask=mask_d, other=0.0).to(tl.float32)
        if j > 0:
            tl.store(p_s + (j - 1) * stride_s_w, b_s, mask=mask_d)
    if W > 1:
        tl.store(p_s + (W - 2) * stride_s_w, b_x.to(state.dtype.element_ty), mask=mask_d)
    if SILU:
        acc = acc * tl.sigmoid(acc)
    tl.store(y + i_n * stride_y + o_c, acc.to(y.dtype.element_ty), mask=mask_d)


def _silu(activation: str | None) -> bool:
    if activation is None:
        return False
    if activation in ("silu", "swish"):
        return True
    raise ValueError(f"activation must be 'silu' or None, got {activation!r}")


def _check_common(x: torch.Tensor, weight: torch.Tensor, D: int) -> int:
    if x.dtype not in _DTYPES:
        raise ValueError(f"x dtype must be fp32, fp16 or bf16, got {x.dtype}")
    check_triton_device("x", x)
    W = check_weight(weight, D)
    check_device("weight", weight, x.device, "x")
    return W


def _check_state(name: str, state: torch.Tensor, x: torch.Tensor, W: int, D: int, n: int | None) -> None:
    """n: the required leading size, or None for a pool (any number of slots, updated in place)."""
    lead = "slots" if n is None else n
    if state.dim() != 3 or tuple(state.shape[1:]) != (W - 1, D) or (n is not None and state.shape[0] != n):
        raise ValueError(f"{name} must have shape [{lead}, W-1, D]=[{lead}, {W - 1}, {D}], got {list(state.shape)}")
    check_device(name, state, x.device, "x")
    if state.stride(-1) != 1:
        raise ValueError(f"{name} must be contiguous along D (it is read and written in place)")


def _channel_groups(x, weight, shape: str) -> tuple[list[torch.Tensor], list[torch.Tensor], int]:
    """x's channel groups as token rows [tokens, P] (unit stride along P), their weights [P, W] (contiguous) and W;
    ``shape`` names x's layout (``"[N, D]"`` or ``"[B, T, D]"``)."""
    xs, ws = channel_groups(x, weight)
    if len(xs) > 3:
        raise ValueError(f"x may have at most 3 channel groups, got {len(xs)}")
    if xs[0].dim() != shape.count(",") + 1:
        raise ValueError(f"x must have shape {shape}, got {list(xs[0].shape)}")
    P = xs[0].shape[-1]
    for i, (xi, wi) in enumerate(zip(xs, ws)):
        if xi.dtype != xs[0].dtype:
            raise ValueError(f"the channel groups of x must share one dtype, got {xs[0].dtype} and {xi.dtype}")
        W = _check_common(xi, wi, P)
        if wi.shape[1] != ws[0].shape[1]:
            raise ValueError(f"the weights of all channel groups must have one width W, got {[w.shape for w in ws]}")
        check_device(f"x[{i}]", xi, xs[0].device, "x[0]")
    rows = [xi.flatten(0, -2) for xi in xs]
    return [r if r.stride(-1) == 1 else r.contiguous() for r in rows], [wi.contiguous() for wi in ws], W


def _padded(xs: list[torch.Tensor], ws: list[torch.Tensor]) -> tuple[list, list, list[int]]:
    """The kernels' three group pointers (the unused repeat the first: the grid never reaches them) and strides."""
    pad = 3 - len(xs)
    return xs + xs[:1] * pad, ws + ws[:1] * pad, [xi.stride(0) for xi in xs] + [xs[0].stride(0)] * pad


# twin of conv/naive.py:causal_conv1d (same signature and contract) — a fix here belongs there too
def causal_conv1d_triton(
    x: torch.Tensor | Sequence[torch.Tensor],
    weight: torch.Tensor | Sequence[torch.Tensor],
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    activation: str | None = "silu",
    state_indices: torch.Tensor | None = None,
    *,
    record_into: tuple[torch.Tensor, torch.Tensor] | None = None,
    split_output: bool = False,
) -> tuple[torch.Tensor | tuple[torch.Tensor, ...], torch.Tensor | None]:
    """Causal depthwise conv (no bias) with an optional fused SiLU; the contract of ``conv.naive.causal_conv1d``.

    ``y[t] = act(sum_{j<W} weight[:, j] * x[t - (W - 1) + j])`` with inputs before a sequence start taken from its
    cache (zeros when absent). Maths in fp32. ``cu_seqlens`` is not validated on the host (that would sync): it
    must be non-decreasing from 0 to ``T``; ``state_indices`` must be distinct and in range.

    Args:
        x: ``[B, T, D]`` fp32/fp16/bf16, contiguous along D, or up to three channel groups ``[B, T, D / S]`` (e.g.
            the q, k and v projections), read in place as if concatenated along D.
        weight: ``[D, W]``, or one ``[D / S, W]`` per group of ``x``.
        initial_state: ``[N, W - 1, D]`` (N = B or the number of packed sequences), or with ``state_indices`` the
            pool ``[slots, W - 1, D]``.
        output_final_state: return the cache after each sequence's last token; with ``state_indices`` it is
            written IN PLACE into the listed pool slots and the pool is returned.
        cu_seqlens: ``[N + 1]`` int32/int64 boundaries of a packed ``B == 1`` input.
        activation: ``"silu"`` (alias ``"swish"``) or None.
        state_indices: ``[N]`` int32/int64 pool slot of each sequence.
        record_into: ``(conv_before [N, W - 1, D], inputs [B * T, D])``, contiguous along D, filled as well (a
            verify step's rollback records, no extra launch): ``conv_before[n]`` the state sequence n read as it
            was before the call (written by the final-state kernel before it overwrites the slot), ``inputs`` the
            raw inputs of every token, the groups concatenated (stored by the conv kernel from the load of each
            token's own tap). Needs ``initial_state`` and ``output_final_state``.
        split_output: return y as its channel groups, one contiguous ``[B, T, D / S]`` tensor per group (the
            kernel writes them as planes of one ``[S, B, T, D / S]`` buffer: no copy).

    Returns:
        ``(y [B, T, D] in x.dtype, or its groups with split_output, final_state)``: ``[N, W - 1, D]`` in x.dtype,
        the pool, or None.
    """
    xs, ws, W = _channel_groups(x, weight, "[B, T, D]")
    x = x if isinstance(x, torch.Tensor) else x[0]
    B, T, P = x.shape
    D = P * len(xs)
    silu = _silu(activation)
    N = B if cu_seqlens is None else check_cu_seqlens(cu_seqlens, B, "x [1, total_T, D]")
    if state_indices is not None:
        if initial_state is None:
            raise ValueError("state_indices addresses a state pool: pass the pool as initial_state")
        check_index("state_indices", state_indices, N, x.device, "x")
    if initial_state is not None:
        _check_state("initial_state", initial_state, x, W, D, None if state_indices is not None else N)
    conv_before = inputs = None
    if record_into is not None:
        conv_before, inputs = check_record(record_into, N, W, B * T, D, output_final_state, initial_state)
        _check_state("record_into's conv_before", conv_before, x, W, D, N)
        check_device("record_into's inputs", inputs, x.device, "x")
        if inputs.stride(-1) != 1:
            raise ValueError("record_into's inputs must be contiguous along D")

    x3, w3, strides = _padded(xs, ws)
    if split_output:  # plane g holds group g's channels, token-major
        planes = torch.empty(len(xs), B, T, P, dtype=x.dtype, device=x.device)
        y, y_strides = planes, (P, B * T * P)
    else:
        y = torch.empty(B, T, D, dtype=x.dtype, device=x.device)
        y_strides = (D, P)
    h0_strides = (initial_state.stride(0), initial_state.stride(1)) if initial_state is not None else (0, 0)
    bt, bd = (16, 32) if interpreting() else (32, 128)
    if B * T > 0:
        grid = (cdiv(B * T, bt), len(xs), cdiv(P, bd))
        causal_conv1d_fwd_kernel[grid](
            *x3, *w3, y, initial_state, inputs, cu_seqlens, state_indices, *strides, *y_strides, *h0_strides,
            0 if inputs is None else inputs.stride(0), B * T, T, N, P,
            W=W, BT=bt, BD=bd, LOG_N=N.bit_length() if cu_seqlens is not None else 0,
            IS_VARLEN=cu_seqlens is not None,
            USE_INITIAL_STATE=initial_state is not None,
            USE_STATE_INDICES=state_indices is not None,
            SILU=silu,
            RECORD=record_into is not None,
            num_warps=4,
        )  # fmt: skip
    if split_output:
        y = tuple(planes.unbind(0))
    if not output_final_state:
        return y, None
    final = initial_state if state_indices is not None else torch.empty(N, W - 1, D, dtype=x.dtype, device=x.device)
    if W > 1:
        causal_conv1d_final_state_kernel[(N, len(xs), cdiv(P, bd))](
            *x3, initial_state, final, conv_before, cu_seqlens, state_indices, *strides, *h0_strides,
            final.stride(0), final.stride(1), *((0, 0) if conv_before is None else conv_before.stride()[:2]), T, P,
            W=W, BW=next_pow2(W - 1), BD=bd,
            IS_VARLEN=cu_seqlens is not None,
            USE_INITIAL_STATE=initial_state is not None,
            USE_STATE_INDICES=state_indices is not None,
            RECORD=record_into is not None,
            num_warps=4,
        )  # fmt: skip
    return y, final


# twin of conv/naive.py:causal_conv1d_update (same signature and contract) — a fix here belongs there too
def causal_conv1d_update_triton(
    x: torch.Tensor | Sequence[torch.Tensor],
    conv_state: torch.Tensor,
    weight: torch.Tensor | Sequence[torch.Tensor],
    activation: str | None = "silu",
    state_indices: torch.Tensor | None = None,
) -> torch.Tensor:
    """One decode step of :func:`causal_conv1d_triton` for N sequences; the contract of
    ``conv.naive.causal_conv1d_update``.

    Args:
        x: ``[N, D]``, the new input of each sequence (contiguous along D), or up to three channel groups
            ``[N, D / S]`` (e.g. the q, k and v projections), read in place as if concatenated along D.
        conv_state: ``[N, W - 1, D]``, or with ``state_indices`` the pool ``[slots, W - 1, D]``; updated IN PLACE
            (only the listed slots): the oldest input is dropped and ``x`` appended.
        weight: ``[D, W]``, or one ``[D / S, W]`` per group of ``x``.
        activation: ``"silu"`` (alias ``"swish"``) or None.
        state_indices: ``[N]`` int32/int64 distinct pool slots.

    Returns:
        ``y [N, D]`` in x.dtype.
    """
    xs, ws, W = _channel_groups(x, weight, "[N, D]")
    N, P = xs[0].shape
    D = P * len(xs)
    silu = _silu(activation)
    x = xs[0]
    if state_indices is not None:
        check_index("state_indices", state_indices, N, x.device, "x")
    _check_state("conv_state", conv_state, x, W, D, None if state_indices is not None else N)
    y = torch.empty(N, D, dtype=x.dtype, device=x.device)
    if N == 0:
        return y
    bd = 32 if interpreting() else 256
    x3, w3, strides = _padded(xs, ws)
    causal_conv1d_update_kernel[(N, len(xs), cdiv(P, bd))](
        *x3, *w3, y, conv_state, state_indices, *strides, y.stride(0), conv_state.stride(0), conv_state.stride(1), P,
        W=W, BD=bd,
        USE_STATE_INDICES=state_indices is not None,
        SILU=silu,
        num_warps=4,
    )  # fmt: skip
    return y
