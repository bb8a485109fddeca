"""How many drafts each request verifies: a fixed k, or DSpark's confidence scheduling (Algorithm 1).

Confidence scheduling weighs the expected accepted tokens against the cost of a bigger verify batch. For request
r the survival of its j-th draft is `a_{r,j} = prod_{i<=j} c_{r,i}`; a step verifying `B = sum_r (1 + l_r)`
tokens emits `tau = R + sum_r sum_{j<=l_r} a_{r,j}` tokens in expectation at `SPS(B)` steps per second. Drafts
are admitted in descending survival while the throughput `tau * SPS(B)` improves, and the scan **stops at the
first candidate that does not improve it**. The early stop is what keeps sampling lossless: `c_{r,j+1}` depends on
the sampled draft `x_{r,j}`, so a search that looks past a non-improving candidate lets the drafts decide whether
their own prefix is verified, which biases the output (DSpark paper, Appendix A). A global search over the budget
is only safe on confidences from an earlier step (`plan_budget`, then `admit_top`).

`SPS` is a `StepRateTable`, profiled once at startup from the runner's own step (`profile_step_rate`) and cached
on disk (`cached_step_rate`).
"""

from __future__ import annotations

import bisect
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path


@dataclass(frozen=True)
class StepRateTable:
    """Steps per second of the verify step at each profiled batch size (in tokens), increasing sizes.

    Between points it interpolates linearly; below the first it takes the first; beyond the last it assumes the
    cost grows in proportion to the tokens.
    """

    batch_tokens: list[int]
    steps_per_s: list[float]

    def __post_init__(self):
        if not self.batch_tokens or len(self.batch_tokens) != len(self.steps_per_s):
            raise ValueError("StepRateTable needs equally long, non-empty batch_tokens and steps_per_s")
        if any(b <= a for a, b in zip(self.batch_tokens, self.batch_tokens[1:])) or self.batch_tokens[0] < 1:
            raise ValueError(f"StepRateTable.batch_tokens must increase from >= 1, got {self.batch_tokens}")
        if not all(s > 0 for s in self.steps_per_s):
            raise ValueError(f"StepRateTable.steps_per_s must be > 0, got {self.steps_per_s}")

    def __call__(self, tokens: float) -> float:
        xs, ys = self.batch_tokens, self.steps_per_s
        if tokens <= xs[0]:
            return ys[0]
        if tokens >= xs[-1]:
            return ys[-1] * xs[-1] / tokens
        i = bisect.bisect_right(xs, tokens)
        t = (tokens - xs[i - 1]) / (xs[i] - xs[i - 1])
        return ys[i - 1] + t * (ys[i] - ys[i - 1])

    def save(self, path: str | Path, key: str) -> None:
        Path(path).write_text(json.dumps({"key": key, **asdict(self)}, indent=1))

    @classmethod
    def load(cls, path: str | Path, key: str) -> StepRateTable | None:
        """The table cached at `path` for `key` (the model, device and settings it was profiled for), else None."""
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, ValueError):
            return None
        if not isinstance(data, dict) or data.get("key") != key:
            return None
        return cls(list(data["batch_tokens"]), list(data["steps_per_s"]))


def profile_step_rate(
    step: Callable[[int], object],
    batch_tokens: Sequence[int],
    *,
    warmup: int = 1,
    repeats: int = 3,
    synchronize: Callable[[], object] = lambda: None,
    clock: Callable[[], float] = time.perf_counter,
) -> StepRateTable:
    """Time `step(tokens)` (one verify step over a batch of that many tokens) at each size; the median of
    `repeats` runs after `warmup`. `synchronize` waits for the device (e.g. `torch.cuda.synchronize`)."""
    rates = []
    for tokens in batch_tokens:
        for _ in range(warmup):
            step(tokens)
        synchronize()
        times = []
        for _ in range(repeats):
            start = clock()
            step(tokens)
            synchronize()
            times.append(clock() - start)
        median = sorted(times)[len(times) // 2]
        rates.append(1.0 / max(median, 1e-9))
    return StepRateTable(list(batch_tokens), rates)


def cached_step_rate(
    path: str | Path, key: str, step: Callable[[int], object], batch_tokens: Sequence[int], *, save=True, **kw
):
    """The table cached at `path` for `key`, or a fresh `profile_step_rate(step, batch_tokens, **kw)`, saved there
    if `save` (under tp * cp > 1 only rank 0 writes the file; every rank profiles, the step being collective)."""
    table = StepRateTable.load(path, key)
    if table is None:
        table = profile_step_rate(step, batch_tokens, **kw)
        if save:
            table.save(path, key)
    return table


def fixed_schedule(num_drafts: Sequence[int], k: int) -> list[int]:
    """Every request verifies min(k, its drafts)."""
    return [min(k, n) for n in num_drafts]


def _survivals(confidences: Sequence[Sequence[float]]) -> list[tuple[float, int, int]]:
    """(survival, position, request) for every draft, best first; ties keep positions in order, so every
    admitted set is a per-request prefix."""
    out = []
    for r, conf in enumerate(confidences):
        a = 1.0
        for j, c in enumerate(conf):
            a *= c
            out.append((a, j, r))
    out.sort(key=lambda t: (-t[0], t[1], t[2]))
    return out


def confidence_schedule(
    confidences: Sequence[Sequence[float]], rate: StepRateTable, token_weight: float = 1.0
) -> list[int]:
    """Algorithm 1 with its early stop: per request, how many of its drafts to verify.

    Args:
        confidences: per request, c_{r,1..n_r} (each draft's acceptance given its prefix's), in [0, 1].
        rate: steps/s versus verify-batch tokens.
        token_weight: the batch-token price of one draft token. Under Helix (cp ranks) a draft token costs cp:
            every rank attends it, while the per-request intercept (the anchor row) stays 1.
    """
    r = len(confidences)
    if r == 0:
        return []
    lengths = [0] * r
    batch, tau = float(r), float(r)
    best = tau * rate(batch)
    for a, j, req in _survivals(confidences):
        throughput = (tau + a) * rate(batch + token_weight)
        if throughput <= best:
            break  # the early stop: never look past a non-improving candidate
        batch, tau, best = batch + token_weight, tau + a, throughput
        lengths[req] = j + 1
    return lengths


def plan_budget(confidences: Sequence[Sequence[float]], rate: StepRateTable, token_weight: float = 1.0) -> int:
    """The number of drafts maximising expected throughput, by a global search over every budget.

    Only lossless when `confidences` do not depend on the drafts being verified (confidences from an earlier
    step, as in DSpark's production planner); pair it with `admit_top` on the current confidences.
    """
    r = len(confidences)
    batch, tau = float(r), float(r)
    best, best_n = tau * rate(batch), 0
    for n, (a, _, _) in enumerate(_survivals(confidences), start=1):
        batch, tau = batch + token_weight, tau + a
        if tau * rate(batch) > best:
            best, best_n = tau * rate(batch), n
    return best_n


def admit_top(confidences: Sequence[Sequence[float]], budget: int) -> list[int]:
    """The `budget` drafts of highest survival, as per-request lengths (prefixes)."""
    lengths = [0] * len(confidences)
    for _, j, req in _survivals(confidences)[:budget]:
        lengths[req] = max(lengths[req], j + 1)
    return lengths
