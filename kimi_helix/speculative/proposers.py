"""Proposers: what drafts the tokens a verify step checks. All of them follow one protocol (`Proposer`).

Per step the engine hands each speculative request to `propose` as a `ProposalRequest` (its tokens so far, the
last one being the anchor, which the target has not run yet) and gets back a `Proposal` of at most
`num_tokens` drafts with the distributions they were drawn from. Proposers that read target hidden states name
their layers in `target_layer_ids`; the engine then calls `observe` with the captured features of every token the
target runs and `rollback` after verification with the number of tokens kept. `release` frees a finished request.
See docs/speculative.md for writing a custom proposer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .dspark.model import DSparkDrafter


@dataclass
class ProposalRequest:
    """One request to draft for: `token_ids` (prompt + generated, the last is the anchor at position
    `len(token_ids) - 1`), at most `num_tokens` drafts, the request's `temperature` and `generator`."""

    seq_id: int
    token_ids: Sequence[int]
    num_tokens: int
    temperature: float = 0.0
    generator: torch.Generator | None = None


@dataclass
class Proposal:
    """`token_ids`: the drafts (possibly fewer than asked, possibly none); `probs`: [len, V] the distributions
    they were drawn from, or None for a deterministic proposer (a point mass at each draft); `confidence`: per
    draft, its predicted acceptance given its prefix's (None if the proposer has no confidence head)."""

    token_ids: list[int]
    probs: torch.Tensor | None = None
    confidence: list[float] | None = None


class Proposer:
    """The protocol, with no-op defaults for proposers that keep no per-request state."""

    name = "proposer"
    target_layer_ids: list[int] = []

    def propose(self, requests: Sequence[ProposalRequest]) -> list[Proposal]:
        """One `Proposal` per request, in order."""
        raise NotImplementedError

    def observe(self, seq_id: int, start: int, features: torch.Tensor) -> None:
        """Captured target features [n, m*d] of the tokens at positions start..start+n-1 of `seq_id`."""

    def rollback(self, seq_id: int, num_keep: int) -> None:
        """Forget everything `seq_id` saw beyond its first `num_keep` tokens (after a partial acceptance)."""

    def release(self, seq_id: int) -> None:
        """`seq_id` is finished."""


class NgramProposer(Proposer):
    """Prompt lookup: the tokens that followed the most recent earlier occurrence of the last n tokens, trying
    n from `max_n` down to `min_n`. Deterministic (`probs` None)."""

    name = "ngram"

    def __init__(self, min_n: int = 1, max_n: int = 4):
        if not (isinstance(min_n, int) and isinstance(max_n, int) and 1 <= min_n <= max_n):
            raise ValueError(f"NgramProposer needs ints 1 <= min_n <= max_n, got ({min_n!r}, {max_n!r})")
        self.min_n, self.max_n = min_n, max_n

    def lookup(self, tokens: Sequence[int], k: int) -> list[int]:
        """At most k tokens continuing the longest suffix n-gram (min_n..max_n) that occurred before."""
        tokens = list(tokens)
        length = len(tokens)
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            suffix = tokens[length - n :]
            for start in range(length - n - 1, -1, -1):  # most recent earlier occurrence first
                if tokens[start : start + n] == suffix:
                    return tokens[start + n : start + n + k]
        return []

    def propose(self, requests: Sequence[ProposalRequest]) -> list[Proposal]:
        return [Proposal(self.lookup(r.token_ids, r.num_tokens)) for r in requests]


class DSparkProposer(Proposer):
    """Drafts with a `DSparkDrafter` bound to the target. Per request it caches the drafter's injected context
    keys/values of every token before the anchor (fed by `observe`, cropped by `rollback`)."""

    name = "dspark"

    def __init__(self, drafter: DSparkDrafter):
        self.drafter = drafter
        self.target_layer_ids = list(drafter.config.target_layer_ids)
        self._ctx: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}

    def context_len(self, seq_id: int) -> int:
        ctx = self._ctx.get(seq_id)
        return 0 if ctx is None else ctx[0][0].shape[0]

    @torch.no_grad()
    def observe(self, seq_id: int, start: int, features: torch.Tensor) -> None:
        have = self.context_len(seq_id)
        if start != have:
            raise ValueError(f"request {seq_id}: features start at {start} but the draft context holds {have} tokens")
        positions = torch.arange(start, start + features.shape[0], device=features.device)
        new = self.drafter.context_keys_values(features.to(self.drafter.dtype), positions)
        old = self._ctx.get(seq_id)
        self._ctx[seq_id] = (
            new if old is None else [(torch.cat([a, c]), torch.cat([b, d])) for (a, b), (c, d) in zip(old, new)]
        )

    def rollback(self, seq_id: int, num_keep: int) -> None:
        if seq_id in self._ctx:
            self._ctx[seq_id] = [(k[:num_keep], v[:num_keep]) for k, v in self._ctx[seq_id]]

    def release(self, seq_id: int) -> None:
        self._ctx.pop(seq_id, None)

    def propose(self, requests: Sequence[ProposalRequest]) -> list[Proposal]:
        if not requests:
            return []
        for r in requests:
            if self.context_len(r.seq_id) != len(r.token_ids) - 1:
                raise ValueError(
                    f"request {r.seq_id}: the draft context holds {self.context_len(r.seq_id)} tokens but the anchor "
                    f"sits at position {len(r.token_ids) - 1}; observe() every token the target runs"
                )
        k = min(max(r.num_tokens for r in requests), self.drafter.config.block_size)
        ctx, valid = self._padded([r.seq_id for r in requests])
        device = valid.device
        draft = self.drafter.draft(
            anchor_ids=torch.tensor([r.token_ids[-1] for r in requests], device=device),
            anchor_positions=torch.tensor([len(r.token_ids) - 1 for r in requests], device=device),
            ctx=ctx,
            ctx_valid=valid,
            num_tokens=k,
            temperatures=[r.temperature for r in requests],
            generators=[r.generator for r in requests],
        )
        out = []
        for i, r in enumerate(requests):
            n = min(r.num_tokens, k)
            conf = None if draft.confidence is None else draft.confidence[i, :n].tolist()
            out.append(Proposal(draft.tokens[i, :n].tolist(), draft.probs[i, :n], conf))
        return out

    def _padded(self, seq_ids: list[int]):
        """Per layer (k, v) [N, C_max, H, hd] and valid [N, C_max] for the requests' contexts."""
        lens = [self.context_len(s) for s in seq_ids]
        cmax = max(lens)
        cfg, weight = self.drafter.config, self.drafter.fc.weight
        device, dtype = weight.device, weight.dtype
        shape = (len(seq_ids), cmax, cfg.num_attention_heads, cfg.head_dim)
        layers = []
        for layer in range(len(self.drafter.layers)):
            k = torch.zeros(shape, device=device, dtype=dtype)
            v = torch.zeros_like(k)
            for i, s in enumerate(seq_ids):
                if lens[i]:
                    k[i, : lens[i]], v[i, : lens[i]] = self._ctx[s][layer]
            layers.append((k, v))
        valid = torch.arange(cmax, device=device)[None] < torch.tensor(lens, device=device)[:, None]
        return layers, valid
