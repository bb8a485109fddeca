"""The one Helix ownership rule and everything derived from it.

Global position p of a sequence lives on cp rank `owner(p) = (p // page_size) % cp`: page b goes to rank b % cp.
Each rank stores its tokens in position order, so its k-th page holds global page `k * cp + cp_rank` and the
rank-local index of an owned position is `local_len(p)`. Write slots, per-token attention bounds, local lengths
and page accounting all call `owner` / `local_len`; nothing else re-derives the rule.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Ownership:
    """The page-ownership rule of one cp rank.

    Args:
        page_size: tokens per page (the engine's cache page).
        cp: context-parallel size.
        cp_rank: the rank whose view this is, in [0, cp).
    """

    page_size: int
    cp: int
    cp_rank: int

    def __post_init__(self):
        if self.page_size < 1 or self.cp < 1 or not 0 <= self.cp_rank < self.cp:
            raise ValueError(
                f"Ownership needs page_size >= 1, cp >= 1 and 0 <= cp_rank < cp; got page_size={self.page_size}, "
                f"cp={self.cp}, cp_rank={self.cp_rank}"
            )

    def owner(self, positions: torch.Tensor) -> torch.Tensor:
        """cp rank holding each global position: [*] int64 -> [*] int64."""
        return (positions // self.page_size) % self.cp

    def owns(self, positions: torch.Tensor) -> torch.Tensor:
        """Whether this rank holds each global position: [*] -> [*] bool."""
        return self.owner(positions) == self.cp_rank

    def local_len(self, lengths: torch.Tensor | int, cp_rank: int | None = None) -> torch.Tensor | int:
        """Tokens of the global prefix [0, L) that live on `cp_rank` (default this rank), in closed form.

        Full rounds of `cp` pages give each rank `page_size` tokens; the partial round gives the rest to ranks in
        order. Works on ints and on int tensors of any shape.
        """
        r = self.cp_rank if cp_rank is None else cp_rank
        ps, cp = self.page_size, self.cp
        rounds, rest = lengths // (ps * cp), lengths % (ps * cp)
        tail = rest - r * ps
        tail = tail.clamp(0, ps) if isinstance(tail, torch.Tensor) else min(max(tail, 0), ps)
        return rounds * ps + tail

    def kv_bounds(self, positions: torch.Tensor) -> torch.Tensor:
        """Per-token key bound on this rank: the query at global position p sees local keys [0, local_len(p + 1)).

        Not a causal slope from the rank's length: a rank that owns none (or a lower part) of a verify group's
        tokens still sees exactly its cached prefix below each token.
        """
        return self.local_len(positions + 1)

    def local_pages(self, lengths: int, cp_rank: int | None = None) -> int:
        """Pages `cp_rank` (default this rank) must hold for a sequence of `lengths` tokens."""
        return -(-self.local_len(lengths, cp_rank) // self.page_size)

    def owned_pages(self, num_pages: int, start: int = 0) -> list[int]:
        """Which of a sequence's global pages start .. num_pages - 1 this rank holds, in order."""
        return [b for b in range(start, num_pages) if b % self.cp == self.cp_rank]

    def local_block_table(self, block_table: torch.Tensor) -> torch.Tensor:
        """[N, G] page ids by global page -> [N, ceil(G / cp)] this rank's pages in local order (k-th local page =
        global page `k * cp + cp_rank`, what `owner` gives)."""
        return block_table[:, self.cp_rank :: self.cp]

    def write_slots(self, positions: torch.Tensor, slot_mapping: torch.Tensor) -> torch.Tensor:
        """Where each new token's latent goes on this rank: the engine's slot [T] (from a page list that holds this
        rank's page ids at its pages) where this rank owns the token, -1 elsewhere. positions [T] int64."""
        return torch.where(self.owns(positions), slot_mapping, -1)
