"""The attention backend switch: backends declare what their kernels can do, as data, and selection reads it.

A request describes one MLA attention call (phase, heads, dims, dtypes, device, whether LSE or per-token KV
bounds are needed). Each backend declares `KernelCaps` per phase. Selection checks the request against the
declared capabilities only (never a proxy such as "is this a context batch"); a forced backend that cannot serve
raises with its reasons, and when no backend can, the error lists every backend's reasons. The capabilities are
kept honest by `tests/kernels/test_backends.py`, which runs the chosen kernel on every case of the truth table.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

logger = logging.getLogger(__name__)

PHASES = ("prefill", "decode", "verify")
ENV_VAR = "KIMI_HELIX_ATTENTION_BACKEND"
DTYPE_NAMES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.float8_e4m3fn: "fp8_e4m3"}


def dtype_name(dtype: torch.dtype) -> str:
    if dtype not in DTYPE_NAMES:
        raise ValueError(f"unsupported dtype {dtype}; attention takes {sorted(DTYPE_NAMES.values())}")
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


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def split_into_two_pow2(d: int, minimum: int = 16) -> bool:
    """Whether `d` is a power of two (>= minimum) or the sum of two: Triton tiles need power-of-two widths."""
    if _pow2(d) and d >= minimum:
        return True
    return any(_pow2(a) and _pow2(d - a) and min(a, d - a) >= minimum for a in range(minimum, d))


@dataclass(frozen=True)
class KernelCaps:
    """What one backend's kernel for one phase can do."""

    devices: frozenset[str]
    q_dtypes: frozenset[str]
    kv_dtypes: frozenset[str]
    min_heads: int = 1
    max_heads: int | None = None
    # "any"; "pow2_pair": head_dim and v_head_dim each a power of two or a sum of two (>= 16); "mla_latent": the
    # latent's value part (v_head_dim = kv_lora_rank) a power of two in [16, 512] and its rope part 0 or a power of
    # two in [16, 128] (the Triton decode kernel tiles the two parts separately).
    dim_rule: str = "any"
    returns_lse: bool = True
    kv_bounds: bool = True
    paged: bool = True

    def reasons(self, r: AttentionRequest) -> list[str]:
        out = []
        if r.device not in self.devices:
            out.append(f"device {r.device!r} not in {sorted(self.devices)}")
        if r.num_heads < self.min_heads or (self.max_heads is not None and r.num_heads > self.max_heads):
            out.append(f"num_heads={r.num_heads} outside [{self.min_heads}, {self.max_heads or 'any'}]")
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
class Backend:
    name: str
    kernels: Mapping[str, KernelCaps] = field(default_factory=dict)

    def reasons(self, r: AttentionRequest) -> list[str]:
        caps = self.kernels.get(r.phase)
        return [f"no {r.phase} kernel"] if caps is None else caps.reasons(r)


class BackendUnavailableError(ValueError):
    """No backend (or not the forced one) can serve an attention request."""


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def build_registry() -> dict[str, Backend]:
    """The backends and their declared capabilities (Triton runs on the CPU only under its interpreter)."""
    floats = frozenset({"fp32", "fp16", "bf16"})
    both = frozenset({"cpu", "cuda"})
    triton_devices = frozenset({"cuda", "cpu"} if _interpreting() else {"cuda"})
    paged = KernelCaps(devices=both, q_dtypes=floats, kv_dtypes=floats | {"fp8_e4m3"})
    dense = KernelCaps(devices=both, q_dtypes=floats, kv_dtypes=floats, kv_bounds=False, paged=False)
    return {
        "torch": Backend("torch", {"decode": paged, "verify": paged, "prefill": dense}),
        "triton": Backend(
            "triton",
            {
                "decode": KernelCaps(triton_devices, floats, floats | {"fp8_e4m3"}, dim_rule="mla_latent"),
                "verify": KernelCaps(triton_devices, floats, floats | {"fp8_e4m3"}, dim_rule="mla_latent"),
                "prefill": KernelCaps(
                    triton_devices, floats, floats, dim_rule="pow2_pair", kv_bounds=False, paged=False
                ),
            },
        ),
        "sdpa": Backend(
            "sdpa",
            {"prefill": KernelCaps(both, floats, floats, returns_lse=False, kv_bounds=False, paged=False)},
        ),
    }


# Automatic choice: fastest first on the GPU; on the CPU the reference first (Triton there is the interpreter).
PRIORITY = {"cuda": ("triton", "sdpa", "torch"), "cpu": ("torch", "sdpa", "triton")}


@functools.cache
def select_backend(request: AttentionRequest, forced: str | None = None) -> Backend:
    """The backend that serves `request`: `forced` (or $KIMI_HELIX_ATTENTION_BACKEND) if given, else the first in
    `PRIORITY` whose declared capabilities cover it. Raises `BackendUnavailableError` with the reasons."""
    registry = build_registry()
    forced = forced or os.environ.get(ENV_VAR) or None
    if forced is not None:
        if forced not in registry:
            raise ValueError(f"attention backend must be one of {sorted(registry)}, got {forced!r}")
        reasons = registry[forced].reasons(request)
        if reasons:
            raise BackendUnavailableError(f"attention backend {forced!r} cannot serve {request}: {'; '.join(reasons)}")
        chosen = registry[forced]
    else:
        order = PRIORITY.get(request.device, tuple(registry))
        verdicts = {name: registry[name].reasons(request) for name in order}
        serving = [name for name in order if not verdicts[name]]
        if not serving:
            detail = "; ".join(f"{name}: {', '.join(why)}" for name, why in verdicts.items())
            raise BackendUnavailableError(f"no attention backend can serve {request} ({detail})")
        chosen = registry[serving[0]]
    logger.info("attention backend %s for %s", chosen.name, request)  # once per distinct case (cached)
    return chosen


# ---------------------------------------------------------------- the other ops: KDA, short conv, norm, MoE

OPS = ("kda_chunk", "kda_recurrent", "conv", "conv_update", "gated_norm", "moe_experts")
OPS += ("add_rms_norm", "rotary", "moe_router", "silu_mul")  # the fused ops of the decode step
OP_ENV_VAR = "KIMI_HELIX_KERNEL_BACKEND"


@dataclass(frozen=True)
class OpRequest:
    """One call of a non-attention op. `head_dim` is the KDA head width (K = V); 0 where it does not apply."""

    op: str
    dtype: str
    device: str
    head_dim: int = 0

    def __post_init__(self):
        if self.op not in OPS:
            raise ValueError(f"OpRequest.op must be one of {OPS}, got {self.op!r}")


@dataclass(frozen=True)
class OpCaps:
    devices: frozenset[str]
    dtypes: frozenset[str]
    # Triton's KDA kernels keep a [K, V] state tile in registers: K must be a power of two within bounds.
    head_dims: tuple[int, int] | None = None

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
        return out


def build_op_registry() -> dict[str, dict[str, OpCaps]]:
    """Per backend, the ops it implements and what each can do."""
    floats = frozenset({"fp32", "fp16", "bf16"})
    both = frozenset({"cpu", "cuda"})
    triton_devices = frozenset({"cuda", "cpu"} if _interpreting() else {"cuda"})
    kda = OpCaps(triton_devices, floats, head_dims=(16, 256))
    plain = OpCaps(triton_devices, floats)
    return {
        "torch": {op: OpCaps(both, floats) for op in OPS},
        "triton": {
            "kda_chunk": kda,
            "kda_recurrent": kda,
            "conv": plain,
            "conv_update": plain,
            "gated_norm": plain,
            "moe_experts": plain,
            "add_rms_norm": plain,
            "rotary": plain,
            "moe_router": plain,
            "silu_mul": plain,
        },
    }


@functools.cache
def select_op_backend(request: OpRequest, forced: str | None = None) -> str:
    """Name of the backend for `request`: `forced` (or $KIMI_HELIX_KERNEL_BACKEND), else the first in `PRIORITY`
    that declares it can serve the request. Raises `BackendUnavailableError` with every reason."""
    registry = build_op_registry()
    forced = forced or os.environ.get(OP_ENV_VAR) or None
    if forced is not None:
        if forced not in registry:
            raise ValueError(f"kernel backend must be one of {sorted(registry)}, got {forced!r}")
        caps = registry[forced].get(request.op)
        reasons = [f"no {request.op} kernel"] if caps is None else caps.reasons(request)
        if reasons:
            raise BackendUnavailableError(f"kernel backend {forced!r} cannot serve {request}: {'; '.join(reasons)}")
        logger.info("kernel backend %s for %s (forced)", forced, request)
        return forced
    verdicts = {}
    for name in PRIORITY.get(request.device, tuple(registry)):
        caps = registry[name].get(request.op)
        verdicts[name] = [f"no {request.op} kernel"] if caps is None else caps.reasons(request)
        if not verdicts[name]:
            logger.info("kernel backend %s for %s", name, request)
            return name
    detail = "; ".join(f"{name}: {', '.join(why)}" for name, why in verdicts.items())
    raise BackendUnavailableError(f"no kernel backend can serve {request} ({detail})")


def op_backend(op: str, x: torch.Tensor, head_dim: int = 0, forced: str | None = None) -> str:
    """`select_op_backend` for a call whose main input is `x`."""
    return select_op_backend(OpRequest(op, dtype_name(x.dtype), x.device.type, head_dim), forced)
