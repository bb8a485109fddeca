"""Checks a speculative-decoding configuration against its target before any weights load.

`validate_speculative_config` reads configs only (the target's `KimiK3Config`, the drafter's `DSparkConfig`, or
their dicts) and either returns the normalised `SpeculativeConfig` or raises `UnsupportedConfigError` listing
every reason at once, each with the values that would be allowed. The verify-phase attention backend is gated on
the attention switch's declared kernel capabilities (`kernels.backends.select_backend`) at the heads one rank
runs, never on a proxy.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..kernels import backends
from ..modeling.config import default_full_attn_layers

METHODS = ("dspark", "ngram")
DRAFTING = ("chain",)
MAX_SPECULATIVE_TOKENS = 8
# vLLM's spelling plus our own keys; anything else is a typo or a feature we do not have.
KNOWN_KEYS = frozenset(
    {
        "method",
        "model",
        "num_speculative_tokens",
        "drafting",
        "speculative_token_tree",
        "confidence_scheduling",
        "prompt_lookup_min",
        "prompt_lookup_max",
        "attention_backend",
        "step_rate_table",
    }
)


@dataclass(frozen=True)
class Reason:
    """One thing wrong with a configuration: the field, what is wrong, and what would be allowed."""

    field: str
    problem: str
    allowed: str

    def __str__(self) -> str:
        return f"{self.field}: {self.problem} (allowed: {self.allowed})"


class UnsupportedConfigError(ValueError):
    """A speculative configuration that cannot run; `reasons` lists every problem found."""

    def __init__(self, reasons: list[Reason]):
        self.reasons = list(reasons)
        super().__init__("unsupported speculative config:\n" + "\n".join(f"  - {r}" for r in self.reasons))


@dataclass(frozen=True)
class SpeculativeConfig:
    """A validated speculative configuration.

    `verify_backend` is the attention backend the switch picks for the verify phase (None: no MLA layer).
    `step_rate_table`: where confidence scheduling caches its profiled steps/s table (None: profile each start).
    """

    method: str
    num_speculative_tokens: int
    model: str | None = None
    confidence_scheduling: bool = False
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 4
    verify_backend: str | None = None
    step_rate_table: str | None = None


def _get(cfg: Any, name: str, default: Any = None) -> Any:
    if cfg is None:
        return default
    if isinstance(cfg, Mapping):
        return cfg.get(name, default)
    return getattr(cfg, name, default)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _target_layers(target: Any) -> tuple[int, list[int]]:
    """(num_hidden_layers, 1-based MLA layers) of a KimiK3Config or its dict."""
    n = _get(target, "num_hidden_layers")
    lac = _get(target, "linear_attn_config") or {}
    full = lac.get("full_attn_layers")
    if full is None:
        kda = set(lac.get("kda_layers") or [])
        full = [i for i in range(1, n + 1) if i not in kda] if kda else default_full_attn_layers(n)
    return n, list(full)


def _check_method(spec: Mapping, out: list[Reason], custom: bool) -> str | None:
    method = spec.get("method")
    allowed = (*METHODS, "custom") if custom else METHODS
    if method not in allowed:
        out.append(Reason("method", f"unknown or unsupported method {method!r}", " | ".join(allowed)))
        method = None
    drafting = spec.get("drafting", "chain")
    if drafting not in DRAFTING or spec.get("speculative_token_tree") is not None:
        out.append(Reason("drafting", f"tree drafting is not supported (got {drafting!r})", "'chain'"))
    for key in sorted(set(spec) - KNOWN_KEYS):
        out.append(Reason(key, "unknown key", ", ".join(sorted(KNOWN_KEYS))))
    return method


def _check_k(spec: Mapping, method: str | None, drafter: Any, out: list[Reason]) -> int | None:
    k = spec.get("num_speculative_tokens")
    block = _get(drafter, "block_size") if method == "dspark" else None
    limit = MAX_SPECULATIVE_TOKENS if not _is_int(block) else min(MAX_SPECULATIVE_TOKENS, block)
    if not _is_int(k) or not 1 <= k <= limit:
        why = "the drafter's block_size" if _is_int(block) and block < MAX_SPECULATIVE_TOKENS else "the engine"
        out.append(Reason("num_speculative_tokens", f"{k!r} is out of range (limit set by {why})", f"1..{limit}"))
        return None
    return k


def _check_ngram(spec: Mapping, out: list[Reason]) -> tuple[int, int]:
    lo, hi = spec.get("prompt_lookup_min", 1), spec.get("prompt_lookup_max", 4)
    if not (_is_int(lo) and _is_int(hi) and 1 <= lo <= hi):
        out.append(Reason("prompt_lookup_min/max", f"({lo!r}, {hi!r})", "ints with 1 <= min <= max"))
    return lo, hi


def _check_drafter(target: Any, drafter: Any, spec: Mapping, out: list[Reason]) -> None:
    """The drafter's vocab, width, captured layers, mask token and heads against the target."""
    if drafter is None:
        out.append(Reason("model", "dspark needs a drafter config", "a DSparkConfig, its dict, or a drafter folder"))
        return
    vocab, hidden = _get(target, "vocab_size"), _get(target, "hidden_size")
    if _get(drafter, "vocab_size") != vocab:
        out.append(Reason("drafter.vocab_size", f"{_get(drafter, 'vocab_size')!r} != target's", f"{vocab}"))
    if _get(drafter, "hidden_size") != hidden:
        out.append(Reason("drafter.hidden_size", f"{_get(drafter, 'hidden_size')!r} != target's", f"{hidden}"))
    n, _ = _target_layers(target)
    ids = _get(drafter, "target_layer_ids")
    if not isinstance(ids, (list, tuple)) or not ids or not all(_is_int(i) for i in ids):
        out.append(Reason("drafter.target_layer_ids", f"{ids!r} is not a non-empty list of ints", f"0..{n - 2}"))
    else:
        if n - 1 in ids:
            out.append(
                Reason(
                    "drafter.target_layer_ids",
                    f"holds the final layer {n - 1} (its output is the normed state the LM head reads)",
                    f"0..{n - 2}",
                )
            )
        bad = [i for i in ids if not 0 <= i < n]
        if bad:
            out.append(Reason("drafter.target_layer_ids", f"{bad} are not layers of the target", f"0..{n - 2}"))
    recorded = _get(drafter, "target_num_hidden_layers")
    if recorded is not None and recorded != n:
        out.append(Reason("drafter.target_num_hidden_layers", f"{recorded!r} != target's", f"{n}"))
    mask = _get(drafter, "mask_token_id")
    if not _is_int(mask) or not 0 <= mask < (vocab if _is_int(vocab) else 0):
        out.append(Reason("drafter.mask_token_id", f"{mask!r} is outside the vocab", f"0..{vocab - 1}"))
    if spec.get("confidence_scheduling"):
        if _get(drafter, "markov_rank", 0) == 0:
            out.append(
                Reason(
                    "confidence_scheduling",
                    "needs a Markov head (drafter.markov_rank is 0)",
                    "confidence_scheduling=False, or a drafter with markov_rank >= 1",
                )
            )
        if not _get(drafter, "enable_confidence_head", False):
            out.append(
                Reason(
                    "confidence_scheduling",
                    "the drafter has no confidence head",
                    "confidence_scheduling=False, or a drafter with enable_confidence_head=True",
                )
            )


def _check_parallel(target: Any, method: str | None, spec: Mapping, tp: int, cp: int, out: list[Reason]) -> bool:
    if not (_is_int(tp) and tp >= 1 and _is_int(cp) and cp >= 1):
        out.append(Reason("tp/cp", f"({tp!r}, {cp!r})", "ints >= 1"))
        return False
    if cp > 1 and (method != "dspark" or spec.get("drafting", "chain") != "chain" or "speculative_token_tree" in spec):
        out.append(
            Reason("method", f"under cp={cp} only a standalone DSpark linear chain runs", "method='dspark', chain")
        )
    lac = _get(target, "linear_attn_config") or {}
    for name, heads in (
        ("num_attention_heads", _get(target, "num_attention_heads")),
        ("kda num_heads", lac.get("num_heads")),
    ):
        if _is_int(heads) and heads % (tp * cp):
            divisors = [d for d in range(1, heads + 1) if heads % d == 0]
            out.append(
                Reason(f"target.{name}", f"{heads} heads do not split over tp*cp={tp * cp}", f"tp*cp in {divisors}")
            )
    return True


def _check_verify_backend(
    target: Any, tp: int, cp: int, spec: Mapping, device: str, dtype: str, kv_dtype: str, out: list[Reason]
) -> str | None:
    """The backend the attention switch picks for the verify phase at the heads one rank runs (H / tp: under
    Helix the query heads split over tp only; cp splits the keys), with LSE when cp > 1 and per-token key bounds."""
    _, full = _target_layers(target)
    heads = _get(target, "num_attention_heads")
    if not full or not _is_int(heads) or heads % tp:
        return None
    rank, rope = _get(target, "kv_lora_rank"), _get(target, "qk_rope_head_dim")
    request = backends.AttentionRequest(
        phase="verify",
        num_heads=heads // tp,
        head_dim=rank + rope,
        v_head_dim=rank,
        q_dtype=dtype,
        kv_dtype=kv_dtype,
        device=device,
        need_lse=cp > 1,
        need_kv_bounds=True,
    )
    forced = spec.get("attention_backend")
    try:
        return backends.select_backend(request, forced).name
    except (backends.BackendUnavailableError, ValueError) as err:
        names = sorted(backends.build_registry())
        out.append(Reason("attention_backend", f"cannot run the verify phase: {err}", f"one of {names} that can"))
        return None


def validate_speculative_config(
    spec: Mapping[str, Any],
    target: Any,
    drafter: Any = None,
    *,
    tp: int = 1,
    cp: int = 1,
    device: str = "cuda",
    dtype: str = "bf16",
    kv_dtype: str | None = None,
    custom_proposer: bool = False,
) -> SpeculativeConfig:
    """Check `spec` (vLLM spelling: method, model, num_speculative_tokens, ...) against the target and drafter
    configs (objects or dicts) for a `tp` x `cp` run on `device` in `dtype`; raise `UnsupportedConfigError` with
    every reason, or return the normalised `SpeculativeConfig`. Reads configs only, never weights.
    `custom_proposer`: the caller brings its own `Proposer`, so method "custom" is allowed too."""
    if not isinstance(spec, Mapping):
        raise UnsupportedConfigError([Reason("speculative_config", f"{type(spec).__name__}", "a dict")])
    out: list[Reason] = []
    method = _check_method(spec, out, custom_proposer)
    k = _check_k(spec, method, drafter, out)
    lo, hi = _check_ngram(spec, out) if method == "ngram" else (1, 4)
    if method == "dspark":
        _check_drafter(target, drafter, spec, out)
    elif method == "ngram" and spec.get("confidence_scheduling"):
        out.append(Reason("confidence_scheduling", "ngram proposes no confidences", "method='dspark'"))
    backend = None
    if _check_parallel(target, method, spec, tp, cp, out):
        backend = _check_verify_backend(target, tp, cp, spec, device, dtype, kv_dtype or dtype, out)
    if out:
        raise UnsupportedConfigError(out)
    return SpeculativeConfig(
        method=method,
        num_speculative_tokens=k,
        model=spec.get("model"),
        confidence_scheduling=bool(spec.get("confidence_scheduling", False)),
        prompt_lookup_min=lo,
        prompt_lookup_max=hi,
        verify_backend=backend,
        step_rate_table=spec.get("step_rate_table"),
    )
