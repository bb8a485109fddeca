"""Triton chunked KDA prefill: varlen, state pool, gate and L2 norm in the kernels.

Same contract and results as :func:`kimi_helix.kernels.kda.naive.naive_chunk_kda`, computed by five kernels over
packed tokens (a plain batch is packed as ``B`` equal sequences):

1. ``kda_chunk_gate_kernel``: optional gate activation, in-chunk cumulative log-decay ``G`` (fp32, log2 units),
   and each chunk's route to one of the intra kernels, by the decay spread their factorisations would meet;
2. ``kda_chunk_intra_kernel`` (chunk-wide factorisation of the decays) and, when enabled,
   ``kda_chunk_intra_halves_kernel`` (a pivot per half chunk): per chunk, ``A_qk``, ``(I + A_kk)^-1``, the L2
   norms' row factors and the decayed q and k;
3. ``kda_chunk_intra_blocks_kernel``: the same, exactly for any gate, for the chunks routed to neither, on a side
   stream so that its few long programs overlap the other intra kernels;
4. ``kda_chunk_wy_kernel``: per chunk, ``w`` and ``u``;
5. ``kda_chunk_state_kernel``: the sequential pass over chunks, ``v_new`` and ``o``.

Without ``STATE["output"]`` the state pass stores the per-chunk states and ``v_new`` instead, and a sixth,
``kda_chunk_output_kernel``, computes ``o`` for every chunk in parallel.

Intermediates are kept in the input dtype (fp32 for fp32 inputs), except ``G``, the ``(I + A)^-1`` scratch and the
carried state, which are fp32. Every decay factor is bounded: outside the intra stage they are exponentials of
non-positive numbers (the log-decay ``g`` is <= 0 for the KDA gate), and inside it factors stay within
``2^MAX_SPREAD`` or the chunk is routed to the exact path, so strong forget gates cannot overflow. ``cu_seqlens``
is read on the host: pass it on the CPU to avoid a device sync.
"""

from __future__ import annotations

from itertools import pairwise

import torch

from kimi_helix.kernels.backends import FLOATS, OpCaps
from kimi_helix.kernels.common import check_device, check_index, check_triton_device, segment_bounds
from kimi_helix.kernels.device import num_sms, side_stream, triton_devices
from kimi_helix.kernels.kda.chunk_h import kda_chunk_state_kernel
from kimi_helix.kernels.kda.chunk_intra import kda_chunk_gate_kernel, kda_chunk_intra_kernel
from kimi_helix.kernels.kda.chunk_intra_blocks import kda_chunk_intra_blocks_kernel
from kimi_helix.kernels.kda.chunk_intra_halves import kda_chunk_intra_halves_kernel
from kimi_helix.kernels.kda.chunk_o import kda_chunk_output_kernel
from kimi_helix.kernels.kda.chunk_wy import kda_chunk_wy_kernel
from kimi_helix.kernels.kda.common import check_gate_args, check_kda_inputs, check_state
from kimi_helix.kernels.launch import cdiv, next_pow2
from kimi_helix.kernels.layouts import layout_cache

__all__ = ["CAPS", "chunk_kda_triton"]

# What this kernel serves, read by the backend switch: the [K, V] state tile lives in registers, so K is a power of
# two in [16, 256].
CAPS = OpCaps(triton_devices(), FLOATS, head_dims=(16, 256))

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_BC = 16  # rows per sub-block of a chunk: the smallest tl.dot tile


def _chunk_layout(cu_seqlens: torch.Tensor | None, B: int, T: int, BT: int, device: torch.device):
    """(cu_seqlens int32 [N+1], chunk_indices int32 [NT, 2] of (sequence, chunk), chunk_offsets int32 [N+1]).

    Host ``cu_seqlens`` are read without a device sync. The layout of given bounds is built and uploaded once and
    then reused (every KDA layer of a prefill pass asks for the same one); the kernels only read it."""
    return _layout_of(tuple(segment_bounds(cu_seqlens, B, T)), BT, device)


@layout_cache(maxsize=16)
def _layout_of(bounds: tuple[int, ...], BT: int, device: torch.device):
    counts = [cdiv(e - b, BT) for b, e in pairwise(bounds)]
    pairs = [(n, t) for n, c in enumerate(counts) for t in range(c)]
    offsets = [0]
    for c in counts:
        offsets.append(offsets[-1] + c)

    host = torch.tensor([*bounds, *offsets, *(i for pair in pairs for i in pair)], dtype=torch.int32)
    packed = host.pin_memory() if device.type == "cuda" else host
    packed = packed.to(device, non_blocking=True)  # one copy for the three
    n = len(bounds)
    return packed[:n], packed[2 * n :].view(-1, 2), packed[n : 2 * n]


# Launch parameters of the chunk-parallel kernels, tuned on an H200 at T=8192, H=64 by scripts/tune_kda_prefill.py
# (the current times are in docs/benchmarks.md, what each alternative gave in docs/benchmark-history.md). BKS is
# the column slice of the intra kernels' dots, BS that of the WY kernel's chunk-wide dots, BV the value columns per
# program of the state and output kernels (OUTPUT only applies without STATE["output"]).
#
# INTRA["wide"] lets the gate kernel route every chunk whose decay spread fits to the chunk-wide factorisation, the
# rest to the per-half pass (INTRA["halves"], chunk_intra_halves.py) and the block kernel; without either the block
# kernel does every chunk. BLOCKS["side_stream"] runs the block kernel on a stream forked after the gate kernel, so
# its few long programs overlap the other intra kernels. The state pass is sequential over chunks, so narrow
# programs beat wide ones: STATE["BV"] is the widest, halved while the grid would fill at most half the SMs, and
# STATE["output"] computes o in the state pass (the output kernel then does not run). INTRA_BOUNDED replaces INTRA
# for the lower-bounded (K3) gate, whose per-token decay leaves almost no chunk narrow enough for the chunk-wide
# kernel. maxnreg caps the registers a thread (None: ptxas's choice). WY["split"] gives each WY column slice its
# own program (it lost where timed).
GATE = dict(BK=128, num_warps=4)
INTRA = dict(wide=True, halves=True, BKS=16, num_warps=4, num_stages=3, maxnreg=128)
INTRA_BOUNDED = dict(wide=False, halves=True, BKS=32, num_warps=4, num_stages=3, maxnreg=None)
HALVES = dict(BKS=32, num_warps=4, num_stages=3, maxnreg=None)
BLOCKS = dict(BKS=16, num_warps=2, num_stages=3, maxnreg=None, side_stream=True)
WY = dict(split=False, BS=64, num_warps=4, num_stages=3, maxnreg=None)
STATE = dict(output=True, BV=64, num_warps=4, num_stages=3)
OUTPUT = dict(BV=128, num_warps=4, num_stages=1)


def _fit(block: int, dim: int) -> int:
    """A launch block clamped to the power-of-two span of `dim` (and to 16, the smallest tl.dot tile)."""
    return max(16, min(block, next_pow2(dim)))


def _check_state_table() -> None:
    """The state pass computes o only at 4 warps: at 8 Triton miscompiled it on an H200 (a wrong o, or an illegal
    memory access; docs/benchmark-history.md), while 4 warps matched the reference in every case tried."""
    if STATE["output"] and STATE["num_warps"] != 4:
        raise ValueError(f"chunk.STATE with output=True needs num_warps=4 (the only count verified), got {STATE}")


def state_block(N: int, H: int, V: int, device_index: int | None) -> int:
    """Value columns per program of the state pass: STATE["BV"], halved while its N * H * cdiv(V, BV) programs
    would fill at most half the SMs (the pass is sequential over chunks, so an idle SM stays idle throughout)."""
    BV = _fit(STATE["BV"], V)
    while BV > 16 and 2 * N * H * cdiv(V, BV) <= num_sms(device_index):
        BV //= 2
    return BV


def _check_args(q, k, v, g, beta, chunk_size, A_log, dt_bias, lower_bound) -> tuple[int, int, int, int, int]:
    """The inputs `chunk_kda_triton` serves; returns (B, T, H, K, V)."""
    B, T, H, K, V = check_kda_inputs(q, k, v, g, beta)
    _check_state_table()
    if q.dtype not in _DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"q, k, v must share one dtype of {_DTYPES}, got {q.dtype}, {k.dtype}, {v.dtype}")
    for name, t in (("k", k), ("v", v), ("g", g), ("beta", beta)):
        check_device(name, t, q.device)
    check_triton_device("q", q)
    if chunk_size not in (16, 32, 64):
        raise ValueError(f"chunk_size must be 16, 32 or 64, got {chunk_size}")
    if K > 256 or V > 256:
        raise ValueError(f"head dims up to 256 are supported, got K={K}, V={V}")
    check_gate_args(A_log, dt_bias, lower_bound, H, K)
    return B, T, H, K, V


def _chunk_local_stages(q, k, v, g, beta, gate, buffers, cu, chunk_indices, scale, use_qk_l2norm, dot_prec,
                        beta_logits):  # fmt: skip
    """Stages 1-4 over every chunk (gate, intra, WY): fill `buffers`' G, route, Aqk, Ai, rnorm, qg, kd, kg, w, u.
    beta [B, T, H] may have strided tokens; with `beta_logits` the kernels take its sigmoid."""
    _, _, H, K = q.shape
    V, NT, chunk_size = v.shape[-1], chunk_indices.shape[0], buffers["Aqk"].shape[-1]
    A_log, dt_bias, lower_bound = gate
    G, route, Aqk, Ai, rnorm = (buffers[n] for n in ("G", "route", "Aqk", "Ai", "rnorm"))
    qg, kd, kg, w, u = (buffers[n] for n in ("qg", "kd", "kg", "w", "u"))
    intra = INTRA if lower_bound is None else INTRA_BOUNDED
    halves = intra["halves"] and chunk_size >= 32  # a half chunk must fill a 16-row dot
    gate_args = (A_log.reshape(H).float(), dt_bias.reshape(H * K).float()) if A_log is not None else (None, None)
    kda_chunk_gate_kernel[(NT, H)](
        g, G, route, *gate_args, cu, chunk_indices, lower_bound or 0.0,
        H=H, K=K, BT=chunk_size, BK=_fit(GATE["BK"], K), GATE_IN_KERNEL=A_log is not None,
        USE_LOWER_BOUND=lower_bound is not None, WIDE=intra["wide"], HALVES=halves, num_warps=GATE["num_warps"],
    )  # fmt: skip
    common = dict(H=H, K=K, BT=chunk_size, BC=_BC, USE_QK_L2NORM=use_qk_l2norm, DOT_PRECISION=dot_prec,
                  BETA_LOGITS=beta_logits)  # fmt: skip
    args = (q, k, G, beta, Aqk, Ai, rnorm, qg, kd, kg, route, cu, chunk_indices, scale, beta.stride(1))

    def launch(kernel, cfg):
        kernel[(NT, H)](*args, **common, BKS=_fit(cfg["BKS"], K), num_warps=cfg["num_warps"],
                        num_stages=cfg["num_stages"], maxnreg=cfg["maxnreg"])  # fmt: skip

    # Few chunks reach the block kernel, but each keeps one of its programs busy long; launched after the other
    # intra kernels, those programs add their latency to the prefill. On a stream of its own, launched first,
    # they overlap the others.
    side = side_stream(q.device.index or 0) if BLOCKS["side_stream"] and q.is_cuda else None
    if side is not None:
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            launch(kda_chunk_intra_blocks_kernel, BLOCKS)
    if intra["wide"]:
        launch(kda_chunk_intra_kernel, intra)
    if halves:
        launch(kda_chunk_intra_halves_kernel, HALVES)
    if side is None:
        launch(kda_chunk_intra_blocks_kernel, BLOCKS)
    else:
        torch.cuda.current_stream().wait_stream(side)
    BS = _fit(WY["BS"], max(K, V))
    slices = cdiv(K, BS) + cdiv(V, BS) if WY["split"] else 1
    kda_chunk_wy_kernel[(NT, H, slices)](
        kd, v, beta, Ai, rnorm, w, u, cu, chunk_indices, beta.stride(1),
        H=H, K=K, V=V, BT=chunk_size, BS=BS, DOT_PRECISION=dot_prec, BETA_LOGITS=beta_logits,
        SPLIT=WY["split"], num_warps=WY["num_warps"], num_stages=WY["num_stages"], maxnreg=WY["maxnreg"],
    )  # fmt: skip


# twin of kda/naive.py:naive_chunk_kda (same signature and contract; the arguments of fused_recurrent_kda_triton
# less the verify ones) — a fix here belongs there too
def chunk_kda_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    state_indices: torch.Tensor | None = None,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    lower_bound: float | None = None,
    chunk_size: int = 64,
    use_beta_sigmoid_in_kernel: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Chunked KDA forward in Triton (prefill); same results as :func:`naive_chunk_kda`.

    Args:
        q, k: ``[B, T, H, K]``, fp16/bf16/fp32 (one dtype for q, k, v).  v: ``[B, T, H, V]``.
        g: ``[B, T, H, K]``: the log-decay (<= 0), or, when ``A_log``/``dt_bias`` are given, the raw gate
            pre-activation ``f`` from which the kernel computes ``kda_gate(f, A_log, dt_bias, lower_bound)``.
        beta: ``[B, T, H]``.
        scale: multiplies q (after the optional L2 norm); defaults to ``K ** -0.5``.
        initial_state: ``[N, H, K, V]`` (N = B, or the number of packed sequences), or with ``state_indices``
            the fp32 state pool ``[slots, H, K, V]``; None for zero states.
        output_final_state: also return the state after the last token of each sequence. With
            ``state_indices`` it is written back into the pool in place and the pool is returned.
        use_qk_l2norm_in_kernel: L2-normalise q and k (eps 1e-6 inside the square root) before use.
        cu_seqlens: ``[N + 1]`` int32/int64 boundaries of a packed ``B == 1`` input (CPU or device).
        state_indices: ``[N]`` int pool slot of each sequence (distinct slots); needs ``initial_state``.
        A_log: ``H`` elements; dt_bias: ``H * K`` elements; lower_bound: negative float for the bounded gate.
        chunk_size: 64 (default), 32 or 16.
        use_beta_sigmoid_in_kernel: ``beta`` is the pre-activation (logits); the kernels that read it take its
            fp32 sigmoid. beta may be a strided view along T (a column slice of the projections): no copy.

    Returns:
        ``(o [B, T, H, V] in q.dtype, final_state)``: final_state is ``[N, H, K, V]`` fp32, the pool with
        ``state_indices``, or None without ``output_final_state``.
    """
    B, T, H, K, V = _check_args(q, k, v, g, beta, chunk_size, A_log, dt_bias, lower_bound)
    cu, chunk_indices, chunk_offsets = _chunk_layout(cu_seqlens, B, T, chunk_size, q.device)
    N, NT = cu.numel() - 1, chunk_indices.shape[0]
    initial_state = check_state(initial_state, state_indices, N, H, K, V, q.device)
    if state_indices is not None:  # int32 or int64, read in place (the kernel widens them): no conversion launch
        check_index("state_indices", state_indices, N, q.device)

    q, k, v, g = (t.contiguous() for t in (q, k, v, g))
    if beta.stride(2) != 1 or (B > 1 and beta.stride(0) != T * beta.stride(1)):  # tokens are beta.stride(1) apart
        beta = beta.contiguous()
    scale = K**-0.5 if scale is None else scale
    BK = max(16, next_pow2(K))
    dot_prec = "ieee" if q.dtype == torch.float32 else "tf32"

    G = torch.empty(B, T, H, K, dtype=torch.float32, device=q.device)
    w, qg, kd, kg = (torch.empty(B, T, H, K, dtype=q.dtype, device=q.device) for _ in range(4))
    u, o = (torch.empty(B, T, H, V, dtype=q.dtype, device=q.device) for _ in range(2))
    Aqk = torch.empty(B, T, H, chunk_size, dtype=q.dtype, device=q.device)
    Ai = torch.empty(B, T, H, chunk_size, dtype=torch.float32, device=q.device)  # (I + A)^-1 per chunk, scratch
    route = torch.empty(NT, H, dtype=torch.int32, device=q.device)  # the intra kernel of each chunk and head
    rnorm = torch.empty(B, T, H, 2, dtype=torch.float32, device=q.device)  # scale/|q|, 1/|k|; scale, 1 without the norm
    buffers = dict(G=G, route=route, Aqk=Aqk, Ai=Ai, rnorm=rnorm, qg=qg, kd=kd, kg=kg, w=w, u=u)
    fuse_output = STATE["output"]
    # without the output kernel, the per-chunk states and v_new never leave the state pass: o stands in for both
    h = o if fuse_output else torch.empty(NT, H, K, V, dtype=q.dtype, device=q.device)
    v_new = o if fuse_output else torch.empty_like(u)
    if not output_final_state:
        final_state = None
    elif state_indices is not None:
        final_state = initial_state
    else:
        final_state = torch.empty(N, H, K, V, dtype=torch.float32, device=q.device)

    if NT:
        gate = (A_log, dt_bias, lower_bound)
        _chunk_local_stages(
            q, k, v, g, beta, gate, buffers, cu, chunk_indices, scale, use_qk_l2norm_in_kernel, dot_prec,
            use_beta_sigmoid_in_kernel,
        )  # fmt: skip
    BV = state_block(N, H, V, q.device.index)
    kda_chunk_state_kernel[(cdiv(V, BV), N * H)](
        w, u, kg, G, qg, Aqk, rnorm, o, h, v_new, initial_state, final_state, state_indices, cu, chunk_offsets,
        H=H, K=K, V=V, BT=chunk_size, BK=BK, BV=BV,
        USE_INITIAL_STATE=initial_state is not None, STORE_FINAL_STATE=final_state is not None,
        USE_STATE_INDICES=state_indices is not None, FUSE_OUTPUT=fuse_output, DOT_PRECISION=dot_prec,
        num_warps=STATE["num_warps"], num_stages=STATE["num_stages"],
    )  # fmt: skip
    if NT and not fuse_output:
        BVo = _fit(OUTPUT["BV"], V)
        kda_chunk_output_kernel[(cdiv(V, BVo), NT, H)](
            qg, h, Aqk, rnorm, v_new, o, cu, chunk_indices,
            H=H, K=K, V=V, BT=chunk_size, BK=BK, BV=BVo, DOT_PRECISION=dot_prec, num_warps=OUTPUT["num_warps"],
            num_stages=OUTPUT["num_stages"],
        )  # fmt: skip
    return o, final_state
