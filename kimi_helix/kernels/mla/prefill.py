"""MLA prefill in Triton: FlashAttention-2 style varlen causal attention in the expanded form, with LSE.

Each program owns BLOCK_M queries of one sequence and one head, and sweeps that sequence's keys up to its causal
limit with an online softmax in base 2. Keys that every query of the block sees are swept first without masks;
only the last few key blocks (the diagonal) pay for the causal mask and bounds checks.

Head dims that are not powers of two (Kimi's Dqk = 192 = 128 nope + 64 rope) are split into two power-of-two
slabs whose dots are summed, rather than padded to 256 (which would waste a quarter of the QK^T flops).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from kimi_helix.kernels.backends import FLOATS, KernelCaps
from kimi_helix.kernels.common import check_triton_device
from kimi_helix.kernels.device import interpreting, triton_devices
from kimi_helix.kernels.layouts import layout_cache
from kimi_helix.kernels.mla.naive import host_bounds

__all__ = ["CAPS", "mla_prefill_triton", "tile_config"]

# What this kernel serves, read by the backend switch. "pow2_pair": Dqk and Dv are each a power of two >= 16 or a
# sum of two such.
CAPS = KernelCaps(triton_devices(), FLOATS, FLOATS, dim_rule="pow2_pair", kv_bounds=False)

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_LOG2E = 1.0 / math.log(2.0)


@triton.jit
def mla_prefill_fwd_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    out_ptr,
    lse_ptr,
    cu_q_ptr,
    cu_k_ptr,
    block_seq_ptr,
    block_idx_ptr,
    num_seqs,
    qk_scale,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_ot,
    stride_oh,
    stride_lt,
    DQK_A: tl.constexpr,
    DQK_B: tl.constexpr,
    DV_A: tl.constexpr,
    DV_B: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """One (query block, head). qk_scale = softmax scale * log2(e). DQK_B / DV_B are 0 when the dim is a power
    of two; otherwise the dim is DQK_A + DQK_B (DV_A + DV_B) and each slab gets its own dot."""
    pid_m = tl.program_id(0)
    head = tl.program_id(1).to(tl.int64)
    seq = tl.load(block_seq_ptr + pid_m)
    if seq >= num_seqs:  # the grid is an upper bound on the block count; the spare programs have no work
        return
    m0 = tl.load(block_idx_ptr + pid_m) * BLOCK_M
    q_start = tl.load(cu_q_ptr + seq)
    q_len = tl.load(cu_q_ptr + seq + 1) - q_start
    k_start = tl.load(cu_k_ptr + seq)
    prefix = tl.load(cu_k_ptr + seq + 1) - k_start - q_len  # cached keys before this sequence's first query

    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_qa = tl.arange(0, DQK_A)
    offs_va = tl.arange(0, DV_A)
    row_ok = offs_m < q_len

    # int64 row offsets: tokens * stride exceeds 2^31 for long prefills with many heads.
    q_rows = q_ptr + (q_start + offs_m).to(tl.int64)[:, None] * stride_qt + head * stride_qh
    q_a = tl.load(q_rows + offs_qa[None, :], mask=row_ok[:, None], other=0.0)
    if DQK_B > 0:
        offs_qb = DQK_A + tl.arange(0, DQK_B)
        q_b = tl.load(q_rows + offs_qb[None, :], mask=row_ok[:, None], other=0.0)
    if DV_B > 0:
        offs_vb = DV_A + tl.arange(0, DV_B)
        acc_b = tl.zeros([BLOCK_M, DV_B], dtype=tl.float32)
    acc_a = tl.zeros([BLOCK_M, DV_A], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)

    # Key block [n, n + BLOCK_N) is fully visible to every query of the block iff n + BLOCK_N <= prefix + m0 + 1;
    # such blocks also lie inside the sequence (prefix + m0 < prefix + q_len = k_len), so they need no masks.
    n_full = (prefix + m0 + 1) // BLOCK_N * BLOCK_N
    n_end = prefix + tl.minimum(m0 + BLOCK_M, q_len)
    k_base = k_ptr + k_start.to(tl.int64) * stride_kt + head * stride_kh
    v_base = v_ptr + k_start.to(tl.int64) * stride_vt + head * stride_vh
    for stage in tl.static_range(2):
        if stage == 0:
            lo = 0
            hi = n_full
        else:
            lo = n_full
            hi = n_end
        for n in range(lo, hi, BLOCK_N):
            cols = n + offs_n
            k_rows = k_base + cols.to(tl.int64)[:, None] * stride_kt
            v_rows = v_base + cols.to(tl.int64)[:, None] * stride_vt
            if stage == 0:
                k_a = tl.load(k_rows + offs_qa[None, :])
                v_a = tl.load(v_rows + offs_va[None, :])
            else:
                # The diagonal can run past the sequence's last key for the block's padding rows.
                col_ok = (cols < prefix + q_len)[:, None]
                k_a = tl.load(k_rows + offs_qa[None, :], mask=col_ok, other=0.0)
                v_a = tl.load(v_rows + offs_va[None, :], mask=col_ok, other=0.0)
            s = tl.dot(q_a, tl.trans(k_a), input_precision=DOT_PRECISION)
            if DQK_B > 0:
                if stage == 0:
                    k_b = tl.load(k_rows + offs_qb[None, :])
                else:
                    k_b = tl.load(k_rows + offs_qb[None, :], mask=col_ok, other=0.0)
                s = tl.dot(q_b, tl.trans(k_b), s, input_precision=DOT_PRECISION)
            if stage == 1:
                # Only causality is masked: out-of-range keys load as zeros, and only padding rows (never
                # stored) can reach them, as a valid row's causal limit is at most the sequence's last key.
                s = tl.where(cols[None, :] <= prefix + offs_m[:, None], s, float("-inf"))
            # Every row sees at least one key of the first block it visits, so m_new is finite from then on and
            # fully masked rows of later diagonal blocks contribute exp2(-inf) = 0.
            m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
            p = tl.math.exp2(s * qk_scale - m_new[:, None])
            alpha = tl.math.exp2(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, 1)
            p = p.to(v_a.dtype)
            acc_a = tl.dot(p, v_a, acc_a * alpha[:, None], input_precision=DOT_PRECISION)
            if DV_B > 0:
                if stage == 0:
                    v_b = tl.load(v_rows + offs_vb[None, :])
                else:
                    v_b = tl.load(v_rows + offs_vb[None, :], mask=col_ok, other=0.0)
                acc_b = tl.dot(p, v_b, acc_b * alpha[:, None], input_precision=DOT_PRECISION)
            m_i = m_new

    inv_l = 1.0 / l_i
    o_rows = out_ptr + (q_start + offs_m).to(tl.int64)[:, None] * stride_ot + head * stride_oh
    tl.store(o_rows + offs_va[None, :], (acc_a * inv_l[:, None]).to(out_ptr.dtype.element_ty), mask=row_ok[:, None])
    if DV_B > 0:
        tl.store(o_rows + offs_vb[None, :], (acc_b * inv_l[:, None]).to(out_ptr.dtype.element_ty), mask=row_ok[:, None])
    lse = (m_i + tl.math.log2(l_i)) * 0.6931471805599453  # base-2 running max and sum -> natural log
    tl.store(lse_ptr + (q_start + offs_m).to(tl.int64) * stride_lt + head, lse, mask=row_ok)


def _split_pow2(name: str, d: int) -> tuple[int, int]:
    """d -> (a, b) with a a power of two >= 16 and b 0 or a smaller power of two >= 16; ValueError otherwise."""
    if d >= 16 and d & (d - 1) == 0:
        return d, 0
    a = 1 << (d.bit_length() - 1)
    b = d - a
    if b >= 16 and b & (b - 1) == 0:
        return a, b
    raise ValueError(f"{name}={d} must be a power of two >= 16 or a sum of two such (e.g. 192 = 128 + 64)")


# GPU tile configs (BLOCK_M, BLOCK_N, num_warps, num_stages), fastest first; the first whose shared memory fits
# is used. The estimate (q tile + num_stages K/V tiles) matches what Triton 3.6 allocates on Hopper.
_GPU_CONFIGS = ((128, 64, 8, 3), (128, 64, 8, 2), (64, 64, 4, 2), (64, 32, 4, 2), (64, 32, 8, 1), (32, 16, 4, 1))
_SMEM_BYTES = 200 * 1024  # Hopper allows 227 KB per block; leave room for layout-conversion scratch


def tile_config(dtype: torch.dtype, dqk: int, dv: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages). Small tiles under the CPU interpreter keep tests fast while
    still covering several query and key blocks per sequence (BLOCK_M > BLOCK_N, as on the GPU)."""
    if interpreting():
        return 32, 16, 4, 1
    for block_m, block_n, num_warps, num_stages in _GPU_CONFIGS:
        if dtype.itemsize * (block_m * dqk + num_stages * block_n * (dqk + dv)) <= _SMEM_BYTES:
            return block_m, block_n, num_warps, num_stages
    return _GPU_CONFIGS[-1]


def _check_cu_seqlens(cu_q: torch.Tensor, cu_k: torch.Tensor, total_q: int, total_k: int, host=None) -> None:
    """Content checks on the offsets: on the host's copies `host` (cu_q, cu_k) when given, else on the device ones,
    which costs one device sync (skipped under CUDA graph capture)."""
    if host is not None:
        cq, ck = host_bounds(cu_q, cu_k, host)
        if len(cq) != cu_q.numel() or len(ck) != cu_k.numel():
            raise ValueError(f"host_offsets hold {len(cq)} and {len(ck)} entries, cu_seqlens {cu_q.numel()}")
        dq, dk = [b - a for a, b in zip(cq, cq[1:])], [b - a for a, b in zip(ck, ck[1:])]
        checks = [cq[0] == 0, min(dq, default=0) >= 0, cq[-1] == total_q, ck[0] == 0, min(dk, default=0) >= 0,
                  ck[-1] == total_k, all(a <= b for a, b in zip(dq, dk))]  # fmt: skip
    elif cu_q.is_cuda and torch.cuda.is_current_stream_capturing():
        return
    else:
        checks = _device_checks(cu_q, cu_k, total_q, total_k)
    names = ["cu_seqlens_q"] * 3 + ["cu_seqlens_k"] * 3
    totals = [total_q] * 3 + [total_k] * 3
    for ok, name, total in zip(checks[:6], names, totals):
        if not ok:
            raise ValueError(f"{name} must start at 0, be non-decreasing and end at the token count {total}")
    if not checks[6]:
        raise ValueError("cu_seqlens_q: a sequence has more new tokens (queries) than tokens in all (keys)")


def _device_checks(cu_q: torch.Tensor, cu_k: torch.Tensor, total_q: int, total_k: int) -> list[bool]:
    dq, dk = cu_q[1:] - cu_q[:-1], cu_k[1:] - cu_k[:-1]
    return torch.stack(
        [
            cu_q[0] == 0,
            (dq >= 0).all(),
            cu_q[-1] == total_q,
            cu_k[0] == 0,
            (dk >= 0).all(),
            cu_k[-1] == total_k,
            (dq <= dk).all(),
        ]
    ).tolist()


def _validate(q, k, v, cu_seqlens_q, cu_seqlens_k, host_offsets=None) -> tuple[tuple[int, int], tuple[int, int]]:
    """Shape/dtype/device checks (ValueError naming the tensor); returns the (a, b) splits of Dqk and Dv."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 3:
            raise ValueError(f"{name} must be 3-d [T, H, D], got shape {list(t.shape)}")
        if t.dtype not in _DTYPES:
            raise ValueError(f"{name} dtype must be fp32, fp16 or bf16, got {t.dtype}")
        if t.dtype != q.dtype:
            raise ValueError(f"{name} dtype {t.dtype} differs from q dtype {q.dtype}")
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device}, q on {q.device}")
    check_triton_device("q", q)
    H, dqk = q.shape[1], q.shape[2]
    if tuple(k.shape[1:]) != (H, dqk):
        raise ValueError(f"k must have shape [Tk, H, Dqk] = [Tk, {H}, {dqk}], got {list(k.shape)}")
    if v.shape[0] != k.shape[0] or v.shape[1] != H:
        raise ValueError(f"v must have shape [Tk, H, Dv] = [{k.shape[0]}, {H}, Dv], got {list(v.shape)}")
    for name, t in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if t.dim() != 1 or t.numel() < 1 or t.dtype != torch.int32:
            raise ValueError(f"{name} must be a 1-d int32 tensor [N + 1], got {t.dtype} {list(t.shape)}")
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device}, q on {q.device}")
    if cu_seqlens_k.numel() != cu_seqlens_q.numel():
        raise ValueError(f"cu_seqlens_k has {cu_seqlens_k.numel()} entries, cu_seqlens_q {cu_seqlens_q.numel()}")
    _check_cu_seqlens(cu_seqlens_q, cu_seqlens_k, q.shape[0], k.shape[0], host_offsets)
    return _split_pow2("Dqk", dqk), _split_pow2("Dv", v.shape[2])


@layout_cache(maxsize=16)
def _host_block_map(cq: tuple[int, ...], block_m: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """`_block_map` of host offsets `cq`: built on the host and uploaded in one copy, once per offsets (the MLA
    layers of a prefill pass share it; the kernel only reads it). Real programs only, in the same reversed order."""
    counts = [-(-(b - a) // block_m) for a, b in zip(cq, cq[1:])]
    pairs = [(n, j) for n, c in enumerate(counts) for j in range(c)][::-1]
    host = torch.tensor([i for pair in pairs for i in pair], dtype=torch.int32).view(-1, 2).t().contiguous()
    dev = (host.pin_memory() if device.type == "cuda" else host).to(device, non_blocking=True)
    return dev[0], dev[1]


def _block_map(cu_seqlens_q: torch.Tensor, total_q: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Program -> (sequence, query block within it), built on the device without a host sync.

    The grid is sized by an upper bound on sum_i ceil(Tq_i / BLOCK_M) that needs only Tq and N; programs past the
    real count get sequence N and exit. Programs run roughly in id order, so the map is reversed: each
    sequence's last (longest-running) blocks start first, which evens out the tail of the launch.
    """
    n = cu_seqlens_q.numel() - 1
    grid_m = (total_q + n * (block_m - 1)) // block_m
    counts = (cu_seqlens_q[1:] - cu_seqlens_q[:-1] + block_m - 1).div(block_m, rounding_mode="floor").long()
    ends = torch.cumsum(counts, 0)
    pids = torch.arange(grid_m - 1, -1, -1, device=cu_seqlens_q.device)
    seq = torch.searchsorted(ends, pids, right=True)
    first = (ends - counts)[seq.clamp(max=n - 1)]
    return seq.to(torch.int32), (pids - first).to(torch.int32)


def _launch(q, k, v, cu_seqlens_q, cu_seqlens_k, scale, splits, config, host_cu_q=None):
    """Allocate the outputs and run the kernel on validated inputs with config (BLOCK_M, BLOCK_N, warps, stages);
    `host_cu_q`, the host's query offsets, builds the block map on the host."""
    (dqk_a, dqk_b), (dv_a, dv_b) = splits
    block_m, block_n, num_warps, num_stages = config
    total_q, H = q.shape[0], q.shape[1]
    out = torch.empty(total_q, H, v.shape[2], dtype=q.dtype, device=q.device)
    lse = torch.empty(total_q, H, dtype=torch.float32, device=q.device)
    if host_cu_q is None:
        block_seq, block_idx = _block_map(cu_seqlens_q, total_q, block_m)
    else:
        block_seq, block_idx = _host_block_map(tuple(host_cu_q), block_m, q.device)
    if block_seq.numel() == 0:
        return out, lse
    mla_prefill_fwd_kernel[(block_seq.numel(), H)](
        q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, block_seq, block_idx, cu_seqlens_q.numel() - 1,
        float(scale) * _LOG2E, q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        out.stride(0), out.stride(1), lse.stride(0), DQK_A=dqk_a, DQK_B=dqk_b, DV_A=dv_a, DV_B=dv_b, BLOCK_M=block_m,
        BLOCK_N=block_n, DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32", num_warps=num_warps,
        num_stages=num_stages,
    )  # fmt: skip
    return out, lse


def mla_prefill_triton(q, k, v, cu_seqlens_q, cu_seqlens_k, scale, host_offsets=None):
    """Varlen causal attention of new tokens over their sequence's cached prefix plus themselves (expanded MLA).

    Args:
        q: [Tq, H, Dqk] queries, all sequences packed end to end (fp32/fp16/bf16).
        k: [Tk, H, Dqk] keys, packed likewise, same dtype.
        v: [Tk, H, Dv] values, same dtype.
        cu_seqlens_q: [N + 1] int32 query offsets; cu_seqlens_k: [N + 1] int32 key offsets.
            Sequence i's queries are the LAST Tq_i of its Tk_i positions: query j sees keys [0, Tk_i - Tq_i + j].
        scale: softmax scale ((qk_nope + qk_rope) ** -0.5 for MLA).
        host_offsets: (cu_seqlens_q, cu_seqlens_k) as the host knows them: checked and planned on instead of the
            device offsets, which are then never read back (no device sync). They must agree with them.

    Dqk and Dv must each be a power of two >= 16 or a sum of two (Kimi: Dqk 192 = 128 + 64, Dv 128).
    fp32 inputs use exact fp32 dots (no TF32).

    Returns:
        out [Tq, H, Dv] in q.dtype and lse [Tq, H] fp32 natural-log logsumexp of the scaled scores. (Every query
        sees at least itself, as Tq_i <= Tk_i is enforced, so no row is empty.)
    """
    splits = _validate(q, k, v, cu_seqlens_q, cu_seqlens_k, host_offsets)
    if not scale > 0:  # the kernel scales the running max by it, which is only right for a positive scale
        raise ValueError(f"scale must be positive, got {scale}")
    # The kernel assumes unit stride along the head dim (vector loads); token/head strides are free.
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    config = tile_config(q.dtype, q.shape[2], v.shape[2])
    host_cu_q = None if host_offsets is None else host_bounds(cu_seqlens_q, cu_seqlens_k, host_offsets)[0]
    return _launch(q, k, v, cu_seqlens_q, cu_seqlens_k, scale, splits, config, host_cu_q)
