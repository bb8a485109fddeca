"""Helpers shared by the mla kernel tests (imported with `from .conftest import ...`)."""

from __future__ import annotations

import os

import torch

from ..conftest import DEVICE
from ..conftest import assert_rel_close as shared_assert_rel_close

KV_LORA, ROPE = 32, 16


FP8 = torch.float8_e4m3fn


def assert_rel_close_inf(name, actual, expected, tol):
    """The shared check, except that an lse may be -inf exactly where the expected one is (a query that sees no key)."""
    shared_assert_rel_close(name, actual, expected, tol, neg_inf_where_expected=True)


def make_case(lens, s_q, H, *, page_size=16, kv_lora=KV_LORA, rope=ROPE, dtype=torch.float32, kv_dtype=None, seed=0):
    """Random queries and per-sequence dense latents, scattered into shuffled pages of a NaN-poisoned paged cache.

    Returns (args for the kernels as a dict, dense latents per sequence in fp32 after any fp8 round trip).
    Unused page slots, spare pages and block-table padding (pointing at a spare page) are NaN, so any read past a
    sequence's length shows up as a non-finite output.
    """
    gen = torch.Generator().manual_seed(seed)
    kv_dtype = kv_dtype or dtype
    D, N = kv_lora + rope, len(lens)
    counts = [-(-n // page_size) for n in lens]
    num_pages = sum(counts) + 2
    perm = torch.randperm(num_pages, generator=gen)
    spare = perm[-1].item()
    max_pages = max(counts) + 1
    block_table = torch.full((N, max_pages), spare, dtype=torch.int32)
    cache = torch.full((num_pages, page_size, D), float("nan"))
    scales = torch.full((num_pages, page_size), float("nan"))
    dense, used = [], 0
    for i, n in enumerate(lens):
        pages = perm[used : used + counts[i]]
        used += counts[i]
        block_table[i, : counts[i]] = pages.int()
        lat = torch.randn(n, D, generator=gen)
        pos = torch.arange(n)
        if kv_dtype == FP8:
            s = lat.abs().amax(-1) / 448  # the engine's per-token scale: the largest value maps to e4m3's max
            lat = (lat / s[:, None]).to(FP8)
            scales[pages[pos // page_size], pos % page_size] = s
            dense.append(lat.float() * s[:, None])
        else:
            lat = lat.to(kv_dtype)
            dense.append(lat.float())
        cache[pages[pos // page_size], pos % page_size] = lat.float()
    cu = torch.tensor([0, *torch.tensor(s_q).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.randn(int(cu[-1]), H, D, generator=gen).to(dtype)
    args = dict(
        q=q,
        kv_cache=cache.to(kv_dtype),
        block_table=block_table,
        cache_seqlens=torch.tensor(lens, dtype=torch.int32),
        cu_seqlens_q=cu,
        scale=(kv_lora + rope) ** -0.5 * 1.3,  # deliberately not D ** -0.5
        kv_lora_rank=kv_lora,
        kv_scale=scales if kv_dtype == FP8 else None,
    )
    return {k: v.to(DEVICE) if isinstance(v, torch.Tensor) else v for k, v in args.items()}, dense


def dense_decode_attention(args, dense, kv_bounds=None):
    """Direct fp64 softmax attention per (sequence, query, head) on the dense latents: independent of the pages."""
    q, cu, lens = args["q"].cpu().double(), args["cu_seqlens_q"].tolist(), args["cache_seqlens"].tolist()
    outs, lses = [], []
    for i, L in enumerate(lens):
        kv = dense[i].double()
        s_q = cu[i + 1] - cu[i]
        for j in range(s_q):
            t = cu[i] + j
            n = L - s_q + j + 1 if kv_bounds is None else min(int(kv_bounds[t]), L)
            scores = q[t] @ kv[:n].T * args["scale"]  # [H, n]
            outs.append(torch.softmax(scores, -1) @ kv[:n, : args["kv_lora_rank"]])
            lses.append(torch.logsumexp(scores, -1))
    return torch.stack(outs), torch.stack(lses)


INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


TRITON_DEVICE = "cpu" if INTERPRET else "cuda"


# (Tq_i, Tk_i): single token, no prefix, short query after a long prefix (crosses key blocks), more than one
# query block, and a sequence with no new tokens.
PAIRS = [(1, 1), (5, 5), (7, 40), (33, 33), (0, 9)]


def make_inputs(pairs, H, dqk, dv, dtype, seed=0, device=TRITON_DEVICE):
    gen = torch.Generator().manual_seed(seed)
    tq, tk = sum(p[0] for p in pairs), sum(p[1] for p in pairs)
    q = torch.randn(tq, H, dqk, generator=gen).to(device, dtype)
    k = torch.randn(tk, H, dqk, generator=gen).to(device, dtype)
    v = torch.randn(tk, H, dv, generator=gen).to(device, dtype)
    cu_q = torch.tensor([0] + [p[0] for p in pairs], dtype=torch.int32).cumsum(0).to(device, torch.int32)
    cu_k = torch.tensor([0] + [p[1] for p in pairs], dtype=torch.int32).cumsum(0).to(device, torch.int32)
    return q, k, v, cu_q, cu_k


def prefix_sweep(block_n: int, tq: int) -> list[tuple[int, int]]:
    """One sequence per cached prefix 0 .. 2 * block_n, each with `tq` new tokens: chunked prefill leaves arbitrary
    prefixes, so the diagonal key block's limit must hold at every remainder modulo the key block."""
    return [(tq, prefix + tq) for prefix in range(2 * block_n + 1)]
