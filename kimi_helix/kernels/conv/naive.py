"""Pure-PyTorch references for the short causal depthwise convolution used by KDA (fla ``ShortConvolution``).

Layouts are token-major: inputs ``[B, T, D]``, weights ``[D, W]``, and the cache ``[N, W - 1, D]`` holds the
previous ``W - 1`` raw inputs, oldest first, in the input dtype. Packed variable-length input has ``B == 1`` and
``cu_seqlens`` ``[N + 1]``. Maths runs in fp32.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import pairwise

import torch
import torch.nn.functional as F

from kimi_helix.kernels.common import gather_states, scatter_states, segment_bounds

__all__ = ["causal_conv1d", "causal_conv1d_update", "channel_groups", "join_channels"]

_PACKED = "x [1, total_T, D]"  # the packed layout, for cu_seqlens messages


def _activate(y: torch.Tensor, activation: str | None) -> torch.Tensor:
    if activation is None:
        return y
    if activation in ("silu", "swish"):
        return F.silu(y)
    raise ValueError(f"activation must be 'silu' or None, got {activation!r}")


def channel_groups(x, weight) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """``x`` and ``weight`` as lists of channel groups. A tensor is one group; a sequence of inputs (e.g. the q, k
    and v projections, each ``[..., P]``) pairs with a sequence of as many weights ``[P, W]``, and stands for their
    concatenation along the channels (the conv is depthwise, so each group only meets its own weight)."""
    xs = [x] if isinstance(x, torch.Tensor) else list(x)
    ws = [weight] if isinstance(weight, torch.Tensor) else list(weight)
    if not xs or len(xs) != len(ws):
        raise ValueError(f"x and weight must have as many channel groups (at least one), got {len(xs)} and {len(ws)}")
    if any(xi.shape != xs[0].shape for xi in xs):
        raise ValueError(f"the channel groups of x must share one shape, got {[list(xi.shape) for xi in xs]}")
    return xs, ws


def join_channels(x, weight) -> tuple[torch.Tensor, torch.Tensor]:
    """(x, weight) with channel groups (see :func:`channel_groups`) concatenated: ``[..., D]`` and ``[D, W]``."""
    xs, ws = channel_groups(x, weight)
    if len(xs) == 1:
        return xs[0], ws[0]
    return torch.cat(xs, dim=-1), torch.cat(ws, dim=0)


def check_weight(weight: torch.Tensor, D: int) -> int:
    if weight.dim() != 2 or weight.shape[0] != D or weight.shape[1] < 1:
        raise ValueError(f"weight must have shape [D, W]=[{D}, W] with W >= 1, got {list(weight.shape)}")
    return weight.shape[1]


def _check_state(name: str, state: torch.Tensor, N: int, W: int, D: int) -> None:
    if tuple(state.shape) != (N, W - 1, D):
        raise ValueError(f"{name} must have shape [N, W-1, D]=[{N}, {W - 1}, {D}], got {list(state.shape)}")


def check_record(record_into, N: int, W: int, tokens: int, D: int, output_final_state: bool, initial_state):
    """The ``record_into`` buffers ``(conv_before [N, W-1, D], inputs [tokens, D])`` of a causal_conv1d call, checked.

    Recording needs the initial state (the rows it saves) and ``output_final_state``: the final-state pass is the
    one that reads every sequence's whole state (and, with a pool, overwrites it)."""
    conv_before, inputs = record_into
    if initial_state is None or not output_final_state:
        raise ValueError("record_into needs initial_state and output_final_state=True")
    _check_state("record_into's conv_before", conv_before, N, W, D)
    if tuple(inputs.shape) != (tokens, D):
        raise ValueError(f"record_into's inputs must have shape [B*T, D]=[{tokens}, {D}], got {list(inputs.shape)}")
    return conv_before, inputs


def _conv_batch(x: torch.Tensor, w: torch.Tensor, state: torch.Tensor | None):
    """x [n, L, D] fp32; w [D, W] fp32; state [n, W-1, D] or None -> (pre-activation y [n, L, D], xs [n, W-1+L, D])."""
    n, L, D = x.shape
    W = w.shape[1]
    if state is None:
        state = x.new_zeros(n, W - 1, D)
    xs = torch.cat([state.float(), x], dim=1)
    if L == 0:  # F.conv1d rejects an input shorter than the kernel
        return x.new_empty(n, 0, D), xs
    y = F.conv1d(xs.transpose(1, 2), w.unsqueeze(1), groups=D).transpose(1, 2)
    return y, xs


# twin of conv/triton.py:causal_conv1d_triton (same signature and contract) — a fix here belongs there too
def causal_conv1d(
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
    """Causal depthwise conv (no bias) followed by an optional SiLU.

    ``y[t] = act(sum_{j<W} weight[:, j] * x[t - (W - 1) + j])``, with inputs before a sequence start taken from
    its initial state (zeros when absent).

    Args:
        x: ``[B, T, D]``, or channel groups ``[B, T, D / S]`` standing for their concatenation (see
            :func:`channel_groups`).
        weight: ``[D, W]`` (an ``nn.Conv1d(groups=D)`` weight ``[D, 1, W]`` squeezed), or one ``[D / S, W]`` per
            group of ``x``.
        initial_state: ``[N, W - 1, D]``, the previous ``W - 1`` inputs of each sequence, oldest first; N = B, or
            the number of packed sequences.
        output_final_state: also return the cache after the last token.
        cu_seqlens: ``[N + 1]`` int32/int64 boundaries of a packed ``B == 1`` input; each sequence is convolved on
            its own.
        activation: ``"silu"`` (alias ``"swish"``) or None.
        state_indices: ``[N]``: ``initial_state`` is then a pool ``[slots, W - 1, D]``; sequence i reads slot
            ``state_indices[i]`` and, with ``output_final_state``, its final state is written back in place (the
            pool is returned).
        record_into: ``(conv_before [N, W - 1, D], inputs [B * T, D])``, filled as well (what a speculative verify
            step keeps to roll its state back): ``conv_before[n]`` the state sequence n read (its pool slot's rows)
            as it was before the call, ``inputs`` the raw inputs of every token (the channel groups concatenated),
            each cast to its buffer's dtype. Needs ``initial_state`` and ``output_final_state``.
        split_output: return y as its channel groups, one contiguous ``[B, T, D / S]`` tensor per group of ``x``
            (for consumers that need each group contiguous, e.g. the chunked KDA kernels' q, k and v).

    Returns:
        ``(y [B, T, D] in x.dtype, final_state [N, W - 1, D] in x.dtype or None)``; with ``split_output`` y is the
        tuple of its channel groups. The final state holds the last ``W - 1`` inputs of each sequence, topped up
        from the initial state (or zeros) for short sequences.
    """
    groups = 1 if isinstance(x, torch.Tensor) else len(x)  # join_channels checks them
    x, weight = join_channels(x, weight)
    if x.dim() != 3:
        raise ValueError(f"x must have shape [B, T, D], got {list(x.shape)}")
    B, T, D = x.shape
    W = check_weight(weight, D)
    _activate(x.new_zeros(()), activation)  # reject a bad activation before doing any work
    segs = None if cu_seqlens is None else list(pairwise(segment_bounds(cu_seqlens, B, T, _PACKED)))
    N = B if segs is None else len(segs)
    pool, initial_state = initial_state, gather_states(initial_state, state_indices)
    if initial_state is not None:
        _check_state("initial_state", initial_state, N, W, D)
    if record_into is not None:
        conv_before, inputs = check_record(record_into, N, W, B * T, D, output_final_state, initial_state)
        conv_before.copy_(initial_state)  # gathered from the pool (a copy) before the final states overwrite it
        inputs.copy_(x.reshape(B * T, D))

    xf, wf = x.float(), weight.float()
    if segs is None:
        y, xs = _conv_batch(xf, wf, initial_state)
        finals = xs[:, xs.shape[1] - (W - 1) :]
    else:
        ys, final_list = [], []
        for n, (s, e) in enumerate(segs):
            st = None if initial_state is None else initial_state[n : n + 1]
            y_n, xs = _conv_batch(xf[:, s:e], wf, st)
            ys.append(y_n)
            # slice from the start index, because xs[:, -0:] would be the whole tensor when W == 1
            final_list.append(xs[:, xs.shape[1] - (W - 1) :])
        y, finals = torch.cat(ys, dim=1), torch.cat(final_list, dim=0)
    y = _activate(y, activation).to(x.dtype)
    if split_output:
        y = tuple(part.contiguous() for part in y.chunk(groups, dim=-1))
    if not output_final_state:
        return y, None
    if state_indices is not None and pool is not None:
        return y, scatter_states(pool, state_indices, finals)
    return y, finals.to(x.dtype)


# twin of conv/triton.py:causal_conv1d_update_triton (same signature and contract) — a fix here belongs there too
def causal_conv1d_update(
    x: torch.Tensor | Sequence[torch.Tensor],
    conv_state: torch.Tensor,
    weight: torch.Tensor | Sequence[torch.Tensor],
    activation: str | None = "silu",
    state_indices: torch.Tensor | None = None,
) -> torch.Tensor:
    """One decode step of :func:`causal_conv1d` for N sequences.

    Args:
        x: ``[N, D]``, the new input of each sequence, or channel groups ``[N, D / S]`` standing for their
            concatenation (see :func:`channel_groups`).
        conv_state: ``[N, W - 1, D]``, updated IN PLACE: the oldest input is dropped and ``x`` appended.
        weight: ``[D, W]``, or one ``[D / S, W]`` per group of ``x``.
        activation: ``"silu"`` (alias ``"swish"``) or None.
        state_indices: ``[N]``: ``conv_state`` is then a pool ``[slots, W - 1, D]`` and sequence i uses (and
            updates in place) slot ``state_indices[i]``.

    Returns:
        ``y [N, D]`` in x.dtype.
    """
    x, weight = join_channels(x, weight)
    if x.dim() != 2:
        raise ValueError(f"x must have shape [N, D], got {list(x.shape)}")
    N, D = x.shape
    W = check_weight(weight, D)
    state = gather_states(conv_state, state_indices)
    _check_state("conv_state", state, N, W, D)
    window = torch.cat([state.float(), x.float().unsqueeze(1)], dim=1)  # [N, W, D], oldest first
    y = torch.einsum("nwd,dw->nd", window, weight.float())
    y = _activate(y, activation).to(x.dtype)
    if state_indices is None:
        conv_state.copy_(window[:, 1:])
    else:
        scatter_states(conv_state, state_indices, window[:, 1:])
    return y
