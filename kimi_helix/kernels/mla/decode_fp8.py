"""The fp8 (e4m3, per-token scale) cache's part of the MLA decode kernel (`decode.mla_decode_fwd_kernel`), and the
P @ c step it shares with the 16-bit one.

e4m3 converts to fp16 in one exact instruction, where bf16 takes a further conversion per element (the most
frequent instruction of the bf16 form, see scripts/kernel_resources.py), so an fp8 cache computes with fp16
operands: q is scaled per row into fp16's range, and each key's scale goes into its score and its P @ c weight in
fp32, with the weights normalised to <= 1 so that they fit fp16 whatever the scales.
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["accumulate", "attend_tile_fp8", "scaled_rows"]


@triton.jit
def accumulate(p, c0, c1, c2, c3, acc0, acc1, acc2, acc3, DSPLIT: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """acc_j += p @ c_j for each column group j < DSPLIT."""
    acc0 = tl.dot(p, c0, acc0, input_precision=DOT_PRECISION)
    if DSPLIT > 1:
        acc1 = tl.dot(p, c1, acc1, input_precision=DOT_PRECISION)
    if DSPLIT > 2:
        acc2 = tl.dot(p, c2, acc2, input_precision=DOT_PRECISION)
        acc3 = tl.dot(p, c3, acc3, input_precision=DOT_PRECISION)
    return acc0, acc1, acc2, acc3


@triton.jit
def attend_tile_fp8(s, c0, c1, c2, c3, kv_scale_ptr, key_slot, n, lo, hi, bound, acc0, acc1, acc2, acc3, l_i, m_i,
                    d_i, row_scale, DSPLIT: tl.constexpr, COMPUTE_DTYPE: tl.constexpr,
                    DOT_PRECISION: tl.constexpr):  # fmt: skip
    """`decode._attend_tile` for an fp8 cache: c holds e4m3 values (in COMPUTE_DTYPE), a key's value is its scale
    ks times c. Scores take ks per key and row_scale per row (log2 units). P @ c weighs key n by w = p_n * ks_n / 2^d
    with d (d_i) the running row max of log2(p * ks), kept relative to the running max m of the scores (so no large
    numbers cancel), so w <= 1 fits fp16 whatever the scales; acc_j then holds sum_n w_n c_n, rescaled as d grows,
    and the output is acc * 2^d / l (the kernel's epilogue). No lazy rescaling (the fp8 schedules keep
    rescale_slack 0)."""
    key_ok = (n >= lo) & (n < hi)
    key_scale = tl.load(kv_scale_ptr + key_slot, mask=key_ok, other=0.0)
    visible = key_ok[None, :] & (n[None, :] < bound[:, None])
    s = tl.where(visible, s * row_scale[:, None] * key_scale[None, :], float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    # Rows with no visible key so far keep m = -inf; offsetting by 0 keeps exp2 away from -inf - -inf.
    m_off = tl.where(m_new == float("-inf"), 0.0, m_new)
    x = s - m_off[:, None]  # log2 p
    l_i = l_i * tl.exp2(m_i - m_off) + tl.sum(tl.exp2(x), axis=1)
    u = x + tl.log2(key_scale)[None, :]  # log2(p * ks); -inf where masked or ks = 0
    d_prev = d_i + (m_i - m_off)  # the old offset, against the new max
    d_new = tl.maximum(d_prev, tl.max(u, axis=1))
    d_off = tl.where(d_new == float("-inf"), 0.0, d_new)
    beta = tl.exp2(d_prev - d_off)[:, None]
    acc0 = acc0 * beta
    if DSPLIT > 1:
        acc1 = acc1 * beta
    if DSPLIT > 2:
        acc2 = acc2 * beta
        acc3 = acc3 * beta
    w = tl.exp2(u - d_off[:, None]).to(COMPUTE_DTYPE)
    acc0, acc1, acc2, acc3 = accumulate(w, c0, c1, c2, c3, acc0, acc1, acc2, acc3, DSPLIT, DOT_PRECISION)
    return acc0, acc1, acc2, acc3, l_i, m_new, d_new


@triton.jit
def scaled_rows(q0, q1, q2, q3, q_pe, DR: tl.constexpr, DSPLIT: tl.constexpr, DTYPE: tl.constexpr):
    """The query's fp32 column groups (and q_pe) scaled per row to a largest magnitude near 2^14 and cast to DTYPE:
    in fp16 they then neither overflow (65504) nor lose small entries. Also the factor that undoes the scaling
    ([rows] fp32)."""
    amax = tl.max(tl.abs(q0), axis=1)
    if DSPLIT > 1:
        amax = tl.maximum(amax, tl.max(tl.abs(q1), axis=1))
    if DSPLIT > 2:
        amax = tl.maximum(amax, tl.maximum(tl.max(tl.abs(q2), axis=1), tl.max(tl.abs(q3), axis=1)))
    if DR > 0:
        amax = tl.maximum(amax, tl.max(tl.abs(q_pe), axis=1))
    f = tl.where(amax > 0, tl.exp2(14.0 - tl.ceil(tl.log2(tl.where(amax > 0, amax, 1.0)))), 1.0)
    fc = f[:, None]
    q0, q1, q2, q3, q_pe = q0 * fc, q1 * fc, q2 * fc, q3 * fc, q_pe * fc
    return q0.to(DTYPE), q1.to(DTYPE), q2.to(DTYPE), q3.to(DTYPE), q_pe.to(DTYPE), 1.0 / f
