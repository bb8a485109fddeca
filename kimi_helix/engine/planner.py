"""Memory planning: how many tokens and sequences fit on a GPU, before loading anything.

`plan_memory(config, "141GB", tp=2, cp=2)` splits one GPU's memory (every rank of the tp x cp group is one GPU of
that size) into weights, an activation reserve and the cache, and turns the cache budget into pages, tokens and
sequences. The sharding rules it assumes:

- **Weights**: every tensor, embeddings and `lm_head` included, is split evenly over all `tp * cp` ranks (Helix
  runs attention with CP but repurposes the same GPUs as a `tp * cp`-way TP group for KDA, the MLPs, the MoE
  and the embeddings; attention weights replicated over cp would add at most a few per cent). A draft model's
  weights are added to every rank unsharded.
- **MLA cache**: the 576-value latent of a token is not split over heads, so TP ranks each hold it whole; CP
  spreads the pages: page b of a sequence lives on rank b % cp (the ledger of `engine/cache.py`), so each rank
  holds 1/cp of the tokens, rounded up to whole pages for one sequence, and rank 0 is the fullest.
- **KDA state**: heads are split over all `tp * cp` ranks (`num_heads % (tp * cp) == 0` is required).
- **Verify scratch** (`max_draft_tokens > 0`): CUDA-graphed verify steps record every KDA layer's per-token state
  into a static scratch (`PagedCache.reserve_verify_scratch`) of `verify_graph_tokens` tokens, each
  `verify_scratch_bytes_per_token`. It is priced only when it can be used: a caller passes `max_draft_tokens=0`
  for an eager engine or one that never verifies, and `LLM` does the same (`LLM._default_num_pages`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation

import torch

from kimi_helix.kernels.launch import cdiv
from kimi_helix.modeling.accounting import count_parameters, mla_cache_bytes_per_token, n_kda_layers
from kimi_helix.modeling.config import KimiK3Config
from kimi_helix.parallel.ownership import Ownership

KV_CACHE_DTYPES = ("auto", "fp8_e4m3")
# fp8 pages keep one fp32 scale per token per MLA layer beside the e4m3 latent (as `engine/cache.py` stores them).
FP8_SCALE_BYTES = 4
# Activation reserve: this many buffers of the widest per-token activation are alive at once in a forward step
# (input, output and two temporaries of the widest projection).
ACTIVATION_BUFFERS = 4
# Sampler reserve per logit of each sequence: fp32 logits, scaled logits, probs and noise, plus a sort's fp32
# values and int64 indices = 28 B, rounded up.
SAMPLER_BYTES_PER_LOGIT = 32
# The most tokens a CUDA-graphed verify step takes (batch x (1 + k)). Its KDA scratch costs 42 MB a token at
# kimi-linear-48b-a3b shapes (20 layers of a 2 MiB fp32 state), so 512 tokens = 22 GB: batch 64 at k = 4 (320
# tokens) fits under the cap, larger verify steps run eagerly rather than take more of the cache's memory.
VERIFY_GRAPH_MAX_TOKENS = 512

_UNITS = {
    "b": 1,
    **{f"{p}b": 1000**i for i, p in enumerate("kmgt", 1)},  # KB, MB, GB, TB: powers of 1000
    **{f"{p}ib": 1024**i for i, p in enumerate("kmgt", 1)},  # KiB, MiB, GiB, TiB: powers of 1024
    # K, M, G, T and Ki, Mi, Gi, Ti: powers of 1024, as `free -h`, `ls -h` and nvidia-smi's MiB mean them.
    **{p: 1024**i for i, p in enumerate("kmgt", 1)},
    **{f"{p}i": 1024**i for i, p in enumerate("kmgt", 1)},
}


def parse_bytes(value: int | str, bare_unit: str = "B") -> int:
    """A byte count from an int or a string: `"141GB"` (GB = 1e9), `"141GiB"` or `"141G"` (2**30), `"80e9"`.

    Units are B, KB, MB, GB, TB (powers of 1000), KiB, MiB, GiB, TiB and K, M, G, T, Ki, Mi, Gi, Ti (powers of
    1024), in any case. A string without a unit is in `bare_unit` (bytes by default; the CLI's `--gpu-mem` passes
    "GiB"); an int is always bytes. Fractions round down to whole bytes. A bad string, or a count that is not
    positive, raises `ValueError` naming the value.
    """
    if bare_unit.lower() not in _UNITS:
        raise ValueError(f"bare_unit must be a unit such as 'B' or 'GiB', got {bare_unit!r}")
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ValueError(f"byte count must be an int or a string like '141GB', got {value!r}")
    if isinstance(value, int):
        if value <= 0:
            raise ValueError(f"byte count must be positive, got {value!r}")
        return value
    match = re.fullmatch(r"\s*([0-9.eE+-]+)\s*([a-zA-Z]*)\s*", value)
    if match is None or match.group(2).lower() not in {"", *_UNITS}:
        raise ValueError(f"cannot read {value!r} as a byte count; try '141GB', '141GiB' or '141G'")
    try:
        number = Decimal(match.group(1))  # exact, so '80e9' and '1.5GiB' lose nothing to float rounding
    except InvalidOperation:
        raise ValueError(f"cannot read {value!r} as a byte count; try '141GB', '141GiB' or '141G'") from None
    if not number.is_finite() or number <= 0:
        raise ValueError(f"byte count must be positive, got {value!r}")
    count = int(number * _UNITS[match.group(2).lower() or bare_unit.lower()])
    if count <= 0:
        raise ValueError(f"byte count must be at least 1 byte, got {value!r}")
    return count


@dataclass(frozen=True)
class MemoryPlan:
    """Where one rank's GPU memory goes (bytes, per rank unless named otherwise), and what the cache then holds.

    usable_bytes = floor(gpu_memory_bytes * gpu_memory_utilization)
                 = weight_bytes_per_rank + activation_reserve_bytes + verify_scratch_bytes + free_bytes_for_cache.

    Capacities, both with the fullest rank (rank 0) as the limit:

    - `max_concurrent_tokens`: cached tokens, summed over sequences and over the cp group, once the KDA state of
      `max_num_seqs` sequences is set aside: `num_pages_per_rank * page_size * cp`. 0 if that state alone does
      not fit; `max_num_seqs * max_model_len` for a model without MLA layers (its tokens cost no cache).
    - `max_concurrent_sequences`: sequences of `max_model_len` tokens each that fit at once, each costing its
      pages on rank 0 (`mla_cache_bytes_per_sequence_per_rank`) plus its KDA state; not capped by `max_num_seqs`.
    """

    gpu_memory_bytes: int
    gpu_memory_utilization: float
    tp: int
    cp: int
    dtype: torch.dtype
    kv_cache_dtype: str
    page_size: int
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    max_draft_tokens: int
    usable_bytes: int
    weight_bytes_per_rank: int  # the draft's included
    draft_weight_bytes: int
    activation_reserve_bytes: int
    verify_scratch_bytes: int  # the CUDA-graphed verify steps' KDA scratch (0 when max_draft_tokens = 0)
    free_bytes_for_cache: int
    mla_cache_bytes_per_token: int  # one token, all MLA layers, whole (before CP)
    mla_cache_bytes_per_token_per_rank: float  # the average over the cp ranks: mla_cache_bytes_per_token / cp
    page_bytes: int  # one page (page_size tokens, all MLA layers) on the rank that holds it
    mla_cache_bytes_per_sequence_per_rank: int  # a max_model_len sequence's pages on rank 0
    kda_state_bytes_per_sequence_per_rank: int
    num_pages_per_rank: int
    max_concurrent_tokens: int
    max_concurrent_sequences: int

    @property
    def world_size(self) -> int:
        return self.tp * self.cp


def plan_memory(
    config: KimiK3Config,
    gpu_memory_bytes: int | str,
    tp: int = 1,
    cp: int = 1,
    kv_cache_dtype: str = "auto",
    dtype: torch.dtype = torch.bfloat16,
    draft_config: KimiK3Config | None = None,
    page_size: int = 64,
    gpu_memory_utilization: float = 0.9,
    max_model_len: int | None = None,
    max_num_seqs: int = 256,
    max_num_batched_tokens: int = 2048,
    max_draft_tokens: int = 0,
) -> MemoryPlan:
    """Plan one rank's memory for `config` served on `tp * cp` GPUs of `gpu_memory_bytes` each (module docstring).

    Args:
        config: the served model.
        gpu_memory_bytes: one GPU's memory, an int or a `parse_bytes` string ("141GB").
        tp, cp: tensor- and context-parallel sizes.
        kv_cache_dtype: "auto" (MLA pages in `dtype`) or "fp8_e4m3" (1 B per value plus an fp32 scale per token
            per MLA layer).
        dtype: weights, activations and the KDA conv state; the KDA recurrent state is always fp32.
        draft_config: a speculative draft model; only its weights are counted (unsharded), not its cache.
        page_size: tokens per cache page.
        gpu_memory_utilization: share of the GPU the plan may use, in (0, 1].
        max_model_len: tokens per sequence for `max_concurrent_sequences`; default `config.model_max_length`.
        max_num_seqs: sequences whose KDA state is reserved for `max_concurrent_tokens`, and rows of the sampler
            reserve.
        max_num_batched_tokens: tokens per forward step, for the activation reserve.
        max_draft_tokens: drafts per verify group that CUDA-graphed verify steps take; > 0 reserves their KDA
            scratch (`verify_graph_tokens` x `verify_scratch_bytes_per_token`). 0 (default): no verify graphs
            (an eager engine, or one without speculative decoding).

    The activation reserve is `max_num_batched_tokens * ACTIVATION_BUFFERS * widest * dtype bytes` (widest: the
    widest per-token activation of any layer, unsharded - conservative under TP) plus `max_num_seqs * vocab_size *
    SAMPLER_BYTES_PER_LOGIT` for the sampler.

    Raises `ValueError` naming the argument: a bad argument, KDA heads not divisible by tp * cp, or a
    `gpu_memory_bytes` too small for the weights (or for the weights and the activation reserve).
    """
    try:
        gpu_memory_bytes = parse_bytes(gpu_memory_bytes)
    except ValueError as err:
        raise ValueError(f"gpu_memory_bytes: {err}") from None
    max_model_len = config.model_max_length if max_model_len is None else max_model_len
    counts = {"tp": tp, "cp": cp, "page_size": page_size, "max_model_len": max_model_len}
    counts |= {"max_num_seqs": max_num_seqs, "max_num_batched_tokens": max_num_batched_tokens}
    _check_plan_args(config, counts, kv_cache_dtype, gpu_memory_utilization, dtype)
    if not isinstance(max_draft_tokens, int) or isinstance(max_draft_tokens, bool) or max_draft_tokens < 0:
        raise ValueError(f"max_draft_tokens must be an int >= 0, got {max_draft_tokens!r}")
    world = tp * cp
    dtype_bytes = dtype.itemsize
    usable = int(gpu_memory_bytes * gpu_memory_utilization)

    draft = count_parameters(draft_config)[0] * dtype_bytes if draft_config is not None else 0
    weights = cdiv(count_parameters(config)[0] * dtype_bytes, world) + draft
    if weights > usable:
        raise ValueError(
            f"gpu_memory_bytes={gpu_memory_bytes:,} is too small: the weights alone need {weights:,} B per rank at "
            f"tp={tp}, cp={cp}, more than the {usable:,} B usable at gpu_memory_utilization={gpu_memory_utilization}"
        )
    activation = _activation_reserve(config, dtype_bytes, max_num_batched_tokens, max_num_seqs)
    verify_tokens = verify_graph_tokens(max_num_seqs, max_num_batched_tokens, max_draft_tokens)
    verify = verify_tokens * verify_scratch_bytes_per_token(config, world, dtype_bytes)
    free = usable - weights - activation - verify
    if free <= 0:
        raise ValueError(
            f"gpu_memory_bytes={gpu_memory_bytes:,} is too small: the weights ({weights:,} B per rank), the "
            f"activation reserve ({activation:,} B for max_num_batched_tokens={max_num_batched_tokens}, "
            f"max_num_seqs={max_num_seqs}) and the verify scratch ({verify:,} B for max_draft_tokens="
            f"{max_draft_tokens}) leave nothing for the cache"
        )

    cache = _cache_capacity(config, free, dtype_bytes, kv_cache_dtype, page_size, (tp, cp), max_num_seqs, max_model_len)
    return MemoryPlan(
        gpu_memory_bytes=gpu_memory_bytes,
        gpu_memory_utilization=gpu_memory_utilization,
        tp=tp,
        cp=cp,
        dtype=dtype,
        kv_cache_dtype=kv_cache_dtype,
        page_size=page_size,
        max_model_len=max_model_len,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_draft_tokens=max_draft_tokens,
        usable_bytes=usable,
        weight_bytes_per_rank=weights,
        draft_weight_bytes=draft,
        activation_reserve_bytes=activation,
        verify_scratch_bytes=verify,
        free_bytes_for_cache=free,
        **cache,
    )


def _cache_capacity(
    config: KimiK3Config,
    free: int,
    dtype_bytes: int,
    kv_cache_dtype: str,
    page_size: int,
    parallel_sizes: tuple[int, int],
    max_num_seqs: int,
    max_model_len: int,
) -> dict[str, int | float]:
    """`MemoryPlan`'s cache fields for `free` bytes per rank at (tp, cp) = `parallel_sizes`: the per-token, per-page
    and per-sequence sizes, and the pages, tokens and sequences that fit with rank 0 (the fullest) as the limit."""
    tp, cp = parallel_sizes
    token_bytes = cache_bytes_per_token(config, dtype_bytes, kv_cache_dtype)
    page_bytes = page_size * token_bytes
    # Helix's ownership rule places pages 0, cp, 2cp, ... of a sequence on cp rank 0, the fullest rank.
    seq_pages_rank0 = Ownership(page_size, cp, 0).local_pages(max_model_len)
    seq_cache = seq_pages_rank0 * page_bytes
    state = kda_state_bytes_per_rank(config, tp * cp, dtype_bytes)

    left = max(0, free - max_num_seqs * state)
    if page_bytes:
        pages_per_rank = left // page_bytes
        max_tokens = pages_per_rank * page_size * cp
    else:  # no MLA layer: tokens cost no cache, so only max_model_len bounds them
        pages_per_rank = 0
        max_tokens = max_num_seqs * max_model_len if free >= max_num_seqs * state else 0
    return {
        "mla_cache_bytes_per_token": token_bytes,
        "mla_cache_bytes_per_token_per_rank": token_bytes / cp,
        "page_bytes": page_bytes,
        "mla_cache_bytes_per_sequence_per_rank": seq_cache,
        "kda_state_bytes_per_sequence_per_rank": state,
        "num_pages_per_rank": pages_per_rank,
        "max_concurrent_tokens": max_tokens,
        "max_concurrent_sequences": free // (seq_cache + state),  # > 0: a model has MLA or KDA layers
    }


def _check_plan_args(
    config: KimiK3Config, counts: dict[str, int], kv_cache_dtype: str, utilization: float, dtype: torch.dtype
) -> None:
    """Each of `counts` (tp, cp, page_size, ...) an int >= 1, tp * cp dividing the KDA heads, a known cache dtype,
    a utilization in (0, 1] and a floating dtype."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {kv_cache_dtype!r}")
    if not isinstance(utilization, (int, float)) or not 0 < utilization <= 1:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {utilization!r}")
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"dtype must be a floating torch.dtype, got {dtype!r}")
    for name, value in counts.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    tp, cp, heads = counts["tp"], counts["cp"], config.kda_num_heads
    if n_kda_layers(config) and heads % (tp * cp):
        raise ValueError(
            f"tp * cp = {tp} * {cp} = {tp * cp} must divide the {heads} KDA heads (KDA layers run TP over tp * cp)"
        )


def cache_bytes_per_token(config: KimiK3Config, dtype_bytes: int, kv_cache_dtype: str = "auto") -> int:
    """MLA cache bytes one token adds, all layers: values of `dtype_bytes` ("auto"), or for "fp8_e4m3" one byte a
    value plus a per-token fp32 scale per MLA layer. The planner and `LLM` both size pages with it."""
    if kv_cache_dtype == "fp8_e4m3":
        n_mla = config.num_hidden_layers - n_kda_layers(config)
        return mla_cache_bytes_per_token(config, 1) + n_mla * FP8_SCALE_BYTES
    return mla_cache_bytes_per_token(config, dtype_bytes)


def kda_state_bytes_per_rank(config: KimiK3Config, world: int, conv_dtype_bytes: int) -> int:
    """`kda_state_bytes_per_sequence` with H / world heads: fp32 recurrent [H/world, K, K] + conv 3 x [H/world * K,
    W - 1] per KDA layer."""
    h, k, w = config.kda_num_heads // world, config.kda_head_dim, config.conv_kernel_size
    return n_kda_layers(config) * (h * k * k * 4 + 3 * h * k * (w - 1) * conv_dtype_bytes)


def verify_scratch_bytes_per_token(config: KimiK3Config, world: int, conv_dtype_bytes: int) -> int:
    """Bytes of verify scratch one token of a graphed verify step takes, all KDA layers (H / world heads each):
    the fp32 recurrent state after it [H/world, K, K], the conv state before it [W - 1, 3 H/world K] and its conv
    input [3 H/world K] (`engine.cache.VerifyScratch`): a KDA state plus one conv input per layer."""
    conv_input = 3 * (config.kda_num_heads // world) * config.kda_head_dim * conv_dtype_bytes
    return kda_state_bytes_per_rank(config, world, conv_dtype_bytes) + n_kda_layers(config) * conv_input


def verify_graph_tokens(
    max_num_seqs: int, max_num_batched_tokens: int, max_draft_tokens: int, cap: int = VERIFY_GRAPH_MAX_TOKENS
) -> int:
    """Tokens of verify scratch for CUDA-graphed verify steps of up to `max_draft_tokens` drafts a sequence: the
    largest verify step, `max_num_seqs` x (1 + max_draft_tokens), bounded by the step's token budget and `cap`;
    0 when `max_draft_tokens` is 0. `StepGraphs` takes the largest batch bucket whose step fits it."""
    if max_draft_tokens <= 0:
        return 0
    return min(max_num_seqs * (max_draft_tokens + 1), max_num_batched_tokens, cap)


def widest_activation(config: KimiK3Config) -> int:
    """Values per token of the widest activation any layer makes (unsharded): the dense MLP's or the MoE's gate+up
    output, KDA's q/k/v, or MLA's expanded q, k and v in prefill."""
    moe = 2 * (config.num_experts_per_token + config.num_shared_experts) * config.moe_intermediate_size
    return max(
        config.hidden_size,
        2 * config.intermediate_size,
        moe if config.num_experts else 0,
        3 * config.kda_num_heads * config.kda_head_dim,
        config.num_attention_heads * (2 * config.qk_head_dim + config.v_head_dim),
    )


def _activation_reserve(config: KimiK3Config, dtype_bytes: int, batched_tokens: int, num_seqs: int) -> int:
    forward = batched_tokens * ACTIVATION_BUFFERS * widest_activation(config) * dtype_bytes
    sampler = num_seqs * config.vocab_size * SAMPLER_BYTES_PER_LOGIT
    return forward + sampler
