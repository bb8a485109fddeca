"""Lossless verification of a linear chain of drafts against the target's verify-phase logits.

The target runs `[anchor, x_1..x_k]` and returns k+1 logit rows (row i = its distribution after token i of the
group). Greedy requests accept the longest prefix of drafts equal to the row-wise argmax and then emit the argmax
of the first mismatching row (or of row k: the bonus token), which is exactly what plain greedy decoding emits.
Sampled requests use rejection sampling (Leviathan et al.; DeepSpec's `verify_draft_tokens`): draft x_i drawn
from q_i is accepted with probability min(1, p_i(x_i) / q_i(x_i)); at the first rejection the emitted token is
drawn from the residual `norm(max(p_i - q_i, 0))`; if every draft is accepted a bonus token is drawn from p_k.
Each emitted token is then distributed exactly as the target's own sampling would draw it. `p` is the request's
own distribution (temperature, top_k, top_p), and every draw uses the request's own generator.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..engine.sampling import SamplingParams, filter_top_k_top_p


@dataclass(frozen=True)
class VerifyResult:
    """`tokens`: the accepted drafts followed by one more token (the correction or the bonus), so
    `len(tokens) == num_accepted + 1`."""

    tokens: list[int]
    num_accepted: int


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distributions the request samples from: logits [R, V] -> probs [R, V] fp32 (temperature, then the
    request's top_k / top_p, as `engine.sampling.sample` does)."""
    scaled = logits.float() / params.temperature
    if params.top_k > 0 or params.top_p < 1:
        scaled = filter_top_k_top_p(scaled, [params] * scaled.shape[0])
    return torch.softmax(scaled, dim=-1)


def _check(draft_tokens: Sequence[int], target_logits: torch.Tensor) -> int:
    k = len(draft_tokens)
    if target_logits.dim() != 2 or target_logits.shape[0] != k + 1:
        raise ValueError(
            f"target_logits must be [k + 1, V] = [{k + 1}, V] for k={k} drafts, got {tuple(target_logits.shape)}"
        )
    return k


def verify_greedy(draft_tokens: Sequence[int], target_logits: torch.Tensor) -> VerifyResult:
    """Exact-match verification. draft_tokens: k ids; target_logits: [k + 1, V]."""
    _check(draft_tokens, target_logits)
    return accept_greedy(draft_tokens, target_logits.float().argmax(dim=-1).tolist())


def accept_greedy(draft_tokens: Sequence[int], best: Sequence[int]) -> VerifyResult:
    """`verify_greedy` from the argmax ids of the k + 1 rows (the same argmax, first index of ties, as `sample`),
    so a caller can take every group's argmaxes on the device and copy them to the host at once."""
    k = len(draft_tokens)
    if len(best) != k + 1:
        raise ValueError(f"best must hold k + 1 = {k + 1} argmax ids, got {len(best)}")
    n = 0
    while n < k and draft_tokens[n] == best[n]:
        n += 1
    return VerifyResult([*draft_tokens[:n], best[n]], n)


def verify(
    draft_tokens: Sequence[int],
    draft_probs: torch.Tensor | None,
    target_logits: torch.Tensor,
    params: SamplingParams,
    generator: torch.Generator | None,
) -> VerifyResult:
    """`verify_greedy` for greedy requests, rejection sampling otherwise.

    Args:
        draft_tokens: k draft ids.
        draft_probs: [k, V] the distributions the drafts were drawn from (DSpark: Markov-corrected, tempered);
            None for a deterministic proposer (q_i is then a point mass at x_i). Unused for greedy requests.
        target_logits: [k + 1, V] the verify rows.
        params: the request's sampling parameters.
        generator: the request's generator, on the logits' device.
    """
    if params.greedy:
        return verify_greedy(draft_tokens, target_logits)
    k = _check(draft_tokens, target_logits)
    p = target_probs(target_logits, params)
    device = p.device
    if k:
        idx = torch.tensor(list(draft_tokens), device=device)
        p_x = p[:k].gather(1, idx[:, None]).squeeze(1)
        q_x = (
            torch.ones_like(p_x)
            if draft_probs is None
            else draft_probs.to(device).float().gather(1, idx[:, None]).squeeze(1)
        )
        u = torch.rand(k, device=device, generator=generator)
        accepted = (u * q_x < p_x).long().cumprod(0)
        n = int(accepted.sum())
    else:
        n = 0
    if n == k:
        dist = p[k]
    else:
        q = (
            torch.nn.functional.one_hot(idx[n], p.shape[-1]).float()
            if draft_probs is None
            else draft_probs[n].to(device).float()
        )
        residual = (p[n] - q).clamp_min(0)
        total = residual.sum()
        # A zero residual means p_n <= q_n everywhere, i.e. p_n == q_n: the rejection had probability 0.
        dist = residual / total if total > 0 else p[n]
    last = int(torch.multinomial(dist, 1, generator=generator))
    return VerifyResult([*draft_tokens[:n], last], n)
