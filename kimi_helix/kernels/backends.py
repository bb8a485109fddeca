"""The backend switch: kernels declare what they can do, as data, and one selection function reads it.

A request describes one call: `AttentionRequest` an MLA attention call (phase, heads, dims, dtypes, device, whether
LSE or per-token KV bounds are needed), `OpRequest` a call of another op (KDA, short conv, gated norm, MoE). Each
kernel module declares its capabilities once (`CAPS` in `mla/decode.py`, `kda/chunk.py`, ...); `registry()` collects
them per backend, and `select` checks the request against them only (never a proxy such as "is this a context
batch"). A forced backend that cannot serve raises with its reasons; when no backend can, the error lists every
backend's reasons. The environment is read once, when a model or `LLM` is built (`BackendChoice.from_env`), and the
choice is passed to the ops explicitly. `tests/kernels/test_backends.py` keeps the declarations honest: it runs the
chosen kernel on every case of the attention and op truth tables.
"""

from __future__ import annotations

import functools
import logging
import os
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)

PHASES = ("prefill", "decode", "verify")
# The ops of the switch; the same names are the dispatching functions (`kernels.kda.chunk_kda`, ...).
OPS = ("chunk_kda", "fused_recurrent_kda", "causal_conv1d", "causal_conv1d_update", "gated_rms_norm", "fused_experts")
OPS += ("add_rms_norm", "rotary", "moe_router", "silu_mul", "linear")  # the fused ops of the decode step
OPS += ("markov_chain_greedy",)  # the DSpark drafter's greedy Markov chain
OPS += ("draft_attention",)  # the DSpark drafter's attention over its context cache and block
OPS += ("norm_rotary", "norm_rotary_into_cache")  # the drafter's per-head q/k norm and rotary, and its context write
OPS += ("accept_and_stage", "restore_verified_states")  # an asynchronous DSpark round's bookkeeping
ATTENTION_ENV_VAR = "KIMI_HELIX_ATTENTION_BACKEND"
KERNEL_ENV_VAR = "KIMI_HELIX_KERNEL_BACKEND"
DTYPE_NAMES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.float8_e4m3fn: "fp8_e4m3"}
DTYPE_NAMES[torch.int64] = "int64"  # ops on token ids and positions (`accept_and_stage`)
FLOATS = frozenset({"fp32", "fp16", "bf16"})
INDICES = frozenset({"int64"})
ANY_DEVICE = frozenset({"cpu", "cuda"})
# Automatic choice: fastest first on the GPU; on the CPU the reference first (Triton there is the interpreter).
PRIORITY = {"cuda": ("triton", "sdpa", "torch"), "cpu": ("torch", "sdpa", "triton")}


def dtype_name(dtype: torch.dtype) -> str:
    if dtype not in DTYPE_NAMES:
        raise ValueError(f"unsupported dtype {dtype}; the kernels take {sorted(DTYPE_NAMES.values())}")
    return DTYPE_NAMES[dtype]


@dataclass(frozen=True)
class AttentionRequest:
    """One MLA attention call, as the switch sees it.

    `head_dim` is the query/key width and `v_head_dim` the value width: the latent (kv_lora_rank + rope, and
    kv_lora_rank) for decode/verify, the expanded head (nope + rope, and v_head_dim) for prefill.
    """

    phase: str
    num_heads: int
    head_dim: int
    v_head_dim: int
    q_dtype: str
    kv_dtype: str
    device: str
    need_lse: bool = False
    need_kv_bounds: bool = False

    def __post_init__(self):
        if self.phase not in PHASES:
            raise ValueError(f"AttentionRequest.phase must be one of {PHASES}, got {self.phase!r}")

    @property
    def op(self) -> str:
        return f"mla_{self.phase}"


@dataclass(frozen=True)
class OpRequest:
    """One call of a non-attention op. `head_dim` is the KDA head width (K = V) and `rows` the rows of a `linear`
    call; 0 where they do not apply."""

    op: str
    dtype: str
    device: str
    head_dim: int = 0
    rows: int = 0

    def __post_init__(self):
        if self.op not in OPS:
            raise ValueError(f"OpRequest.op must be one of {OPS}, got {self.op!r}")


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def split_into_two_pow2(d: int, minimum: int = 16) -> bool:
    """Whether `d` is a power of two (>= minimum) or the sum of two: Triton tiles need power-of-two widths."""
    if _pow2(d) and d >= minimum:
        return True
    return any(_pow2(a) and _pow2(d - a) and min(a, d - a) >= minimum for a in range(minimum, d))


@dataclass(frozen=True)
class KernelCaps:
    """What one MLA attention kernel can do."""

    devices: frozenset[str]
    q_dtypes: frozenset[str]
    kv_dtypes: frozenset[str]
    # "any"; "pow2_pair": head_dim and v_head_dim each a power of two or a sum of two (>= 16); "mla_latent": the
    # latent's value part (v_head_dim = kv_lora_rank) a power of two in [16, 512] and its rope part 0 or a power of
    # two in [16, 128] (the Triton decode kernel tiles the two parts separately).
    dim_rule: str = "any"
    returns_lse: bool = True
    kv_bounds: bool = True

    def reasons(self, r: AttentionRequest) -> list[str]:
        out = []
        if r.device not in self.devices:
            out.append(f"device {r.device!r} not in {sorted(self.devices)}")
        if self.dim_rule == "mla_latent":
            rope = r.head_dim - r.v_head_dim
            if not (_pow2(r.v_head_dim) and 16 <= r.v_head_dim <= 512):
                out.append(f"kv_lora_rank={r.v_head_dim} is not a power of two in [16, 512]")
            if rope != 0 and not (_pow2(rope) and 16 <= rope <= 128):
                out.append(f"rope dim {rope} is not 0 or a power of two in [16, 128]")
        if self.dim_rule == "pow2_pair":
            for name in ("head_dim", "v_head_dim"):
                if not split_into_two_pow2(getattr(r, name)):
                    out.append(f"{name}={getattr(r, name)} is not a power of two or a sum of two (>= 16)")
        if r.q_dtype not in self.q_dtypes:
            out.append(f"q dtype {r.q_dtype} not in {sorted(self.q_dtypes)}")
        if r.kv_dtype not in self.kv_dtypes:
            out.append(f"kv dtype {r.kv_dtype} not in {sorted(self.kv_dtypes)}")
        if r.need_lse and not self.returns_lse:
            out.append("does not return LSE")
        if r.need_kv_bounds and not self.kv_bounds:
            out.append("does not take per-token KV bounds")
        return out


@dataclass(frozen=True)
class OpCaps:
    """What one kernel of a non-attention op can do."""

    devices: frozenset[str]
    dtypes: frozenset[str]
    # Triton's KDA kernels keep a [K, V] state tile in registers: K must be a power of two within bounds.
    head_dims: tuple[int, int] | None = None
    # The skinny `linear` kernel tiles all rows of a call in one block.
    max_rows: int | None = None

    def reasons(self, r: OpRequest) -> list[str]:
        out = []
        if r.device not in self.devices:
            out.append(f"device {r.device!r} not in {sorted(self.devices)}")
        if r.dtype not in self.dtypes:
            out.append(f"dtype {r.dtype} not in {sorted(self.dtypes)}")
        if self.head_dims is not None and r.head_dim:
            lo, hi = self.head_dims
            if not (_pow2(r.head_dim) and lo <= r.head_dim <= hi):
                out.append(f"head_dim={r.head_dim} is not a power of two in [{lo}, {hi}]")
        if self.max_rows is not None and r.rows > self.max_rows:
            out.append(f"rows={r.rows} > {self.max_rows}")
        return out


class BackendUnavailableError(ValueError):
    """No backend (or not the forced one) can serve a request."""


# The torch references serve every op on every device, in every float dtype (paged decode also from fp8 pages).
REFERENCE_OP_CAPS = OpCaps(ANY_DEVICE, FLOATS)
REFERENCE_INDEX_CAPS = OpCaps(ANY_DEVICE, INDICES)  # the ops on token ids and positions
REFERENCE_DECODE_CAPS = KernelCaps(ANY_DEVICE, FLOATS, FLOATS | {"fp8_e4m3"})
REFERENCE_PREFILL_CAPS = KernelCaps(ANY_DEVICE, FLOATS, FLOATS, kv_bounds=False)


@functools.cache
def registry() -> dict[str, dict[str, KernelCaps | OpCaps]]:
    """Per backend, the ops it implements (`mla_prefill`, `mla_decode`, `mla_verify` and `OPS`) and the
    capabilities their kernel modules declare. The Triton modules are imported here, on first use."""
    from .accept_stage import triton as accept_stage_triton
    from .activation import triton as activation_triton
    from .conv import triton as conv_triton
    from .draft_attention import triton as draft_attention_triton
    from .kda import chunk, fused_recurrent
    from .linear import triton as linear_triton
    from .markov import triton as markov_triton
    from .mla import decode, prefill, sdpa
    from .moe import triton as moe_triton
    from .norm import triton as norm_triton
    from .norm_rotary import triton as norm_rotary_triton
    from .rotary import triton as rotary_triton
    from .router import triton as router_triton
    from .state_restore import triton as state_restore_triton

    triton_ops = {
        "mla_prefill": prefill.CAPS,
        "mla_decode": decode.CAPS,
        "mla_verify": decode.CAPS,
        "chunk_kda": chunk.CAPS,
        "fused_recurrent_kda": fused_recurrent.CAPS,
        "causal_conv1d": conv_triton.CAPS,
        "causal_conv1d_update": conv_triton.CAPS,
        "gated_rms_norm": norm_triton.CAPS,
        "fused_experts": moe_triton.CAPS,
        "add_rms_norm": norm_triton.CAPS,
        "rotary": rotary_triton.CAPS,
        "moe_router": router_triton.CAPS,
        "silu_mul": activation_triton.CAPS,
        "linear": linear_triton.CAPS,
        "markov_chain_greedy": markov_triton.CAPS,
        "draft_attention": draft_attention_triton.CAPS,
        "norm_rotary": norm_rotary_triton.CAPS,
        "norm_rotary_into_cache": norm_rotary_triton.CAPS,
        "accept_and_stage": accept_stage_triton.CAPS,
        "restore_verified_states": state_restore_triton.CAPS,
    }
    torch_ops = {"mla_prefill": REFERENCE_PREFILL_CAPS, "mla_decode": REFERENCE_DECODE_CAPS}
    torch_ops |= {"mla_verify": REFERENCE_DECODE_CAPS} | {op: REFERENCE_OP_CAPS for op in OPS}
    torch_ops["accept_and_stage"] = REFERENCE_INDEX_CAPS
    return {"torch": torch_ops, "triton": triton_ops, "sdpa": {"mla_prefill": sdpa.CAPS}}


def backend_names(kind: str) -> list[str]:
    """The backends that implement some op of `kind`: "attention" (MLA) or "kernels" (KDA, conv, norm, MoE)."""
    ops = [f"mla_{p}" for p in PHASES] if kind == "attention" else OPS
    return sorted(name for name, table in registry().items() if any(op in table for op in ops))


def reasons(backend: str, request: AttentionRequest | OpRequest) -> list[str]:
    """Why `backend` cannot serve `request` (empty: it can)."""
    caps = registry()[backend].get(request.op)
    return [f"no {request.op} kernel"] if caps is None else caps.reasons(request)


@functools.cache
def select(request: AttentionRequest | OpRequest, forced: str | None = None) -> str:
    """Name of the backend that serves `request`: `forced` if given, else the first in `PRIORITY` (for an unknown
    device, every backend) whose declared capabilities cover it. Raises `BackendUnavailableError` with the reasons.

    Cached on the (hashable) request, so each distinct case is checked and logged once.
    """
    kind = "attention" if isinstance(request, AttentionRequest) else "kernel"
    if forced is not None:
        if forced not in registry():
            raise ValueError(f"{kind} backend must be one of {sorted(registry())}, got {forced!r}")
        why = reasons(forced, request)
        if why:
            raise BackendUnavailableError(f"{kind} backend {forced!r} cannot serve {request}: {'; '.join(why)}")
        chosen = forced
    else:
        verdicts = {name: reasons(name, request) for name in PRIORITY.get(request.device, tuple(registry()))}
        serving = [name for name, why in verdicts.items() if not why]
        if not serving:
            detail = "; ".join(f"{name}: {', '.join(why)}" for name, why in verdicts.items())
            raise BackendUnavailableError(f"no {kind} backend can serve {request} ({detail})")
        chosen = serving[0]
    logger.info("%s backend %s for %s%s", kind, chosen, request, " (forced)" if forced else "")
    return chosen


def op_backend(op: str, x: torch.Tensor, head_dim: int = 0, forced: str | None = None, rows: int = 0) -> str:
    """`select` for a call of `op` whose main input is `x`."""
    return select(OpRequest(op, dtype_name(x.dtype), x.device.type, head_dim, rows), forced)


@dataclass(frozen=True)
class BackendChoice:
    """The backends one model is forced to, read once when the model or `LLM` is built and passed to its ops.

    `attention` forces MLA attention ("torch", "triton", "sdpa"); `kernels` forces KDA, the short conv, the norms,
    rotary, the router, the MoE experts, the DSpark drafter's Markov chain and its attention, and an asynchronous
    DSpark round's acceptance, staging and KDA rollback ("torch", "triton").
    None: automatic, per call, from the declared capabilities. The projections' `linear` is always automatic: its
    Triton GEMV serves decode sizes only.
    """

    attention: str | None = None
    kernels: str | None = None

    def __post_init__(self):
        for kind, name, field, var in (
            ("attention", self.attention, "attention_backend", ATTENTION_ENV_VAR),
            ("kernels", self.kernels, "kernel_backend", KERNEL_ENV_VAR),
        ):
            if name is not None and name not in backend_names(kind):
                allowed = backend_names(kind)
                raise ValueError(f"{field} (or ${var}) must be None (automatic) or one of {allowed}, got {name!r}")

    @classmethod
    def from_env(cls, attention: str | None = None, kernels: str | None = None) -> BackendChoice:
        """The given names, else $KIMI_HELIX_ATTENTION_BACKEND / $KIMI_HELIX_KERNEL_BACKEND, else automatic."""
        return cls(
            attention=attention or os.environ.get(ATTENTION_ENV_VAR) or None,
            kernels=kernels or os.environ.get(KERNEL_ENV_VAR) or None,
        )
