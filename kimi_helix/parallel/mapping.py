"""`Mapping`: which rank plays which part in tensor (tp) and Helix context (cp) parallelism.

The `tp * cp` ranks form a grid, `rank = tp_rank * cp + cp_rank`: the cp ranks of one tp group are adjacent. Only
MLA attention uses cp: the ranks of a cp group compute the same `H / tp` query heads and hold disjoint pages of the
latent cache. Everything else (the MLA output projection, KDA, MoE/MLP, embeddings, lm_head) runs as plain tensor
parallelism over all `tp * cp` ranks (`repurpose_cp_to_tp()`), where head slice `rank` is rank `rank`'s.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..modeling.config import KimiK3Config


class ParallelConfigError(ValueError):
    """A model, cache or engine setting that the requested tp x cp layout cannot serve."""


@dataclass(frozen=True)
class Mapping:
    """A rank's place in the `tp x cp` grid.

    Args:
        tp: tensor-parallel size of MLA attention (query heads split `tp` ways).
        cp: Helix context-parallel size (MLA latent pages split `cp` ways).
        rank: this rank's global rank, in [0, tp * cp).
    """

    tp: int = 1
    cp: int = 1
    rank: int = 0

    def __post_init__(self):
        for name in ("tp", "cp"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ParallelConfigError(f"Mapping.{name} must be a positive int, got {value!r}")
        if not isinstance(self.rank, int) or not 0 <= self.rank < self.world_size:
            raise ParallelConfigError(
                f"Mapping.rank must be an int in [0, tp * cp = {self.world_size}), got {self.rank!r}"
            )

    @property
    def world_size(self) -> int:
        return self.tp * self.cp

    @property
    def tp_rank(self) -> int:
        return self.rank // self.cp

    @property
    def cp_rank(self) -> int:
        return self.rank % self.cp

    def cp_group_ranks(self, tp_rank: int | None = None) -> list[int]:
        """Global ranks of the cp group of `tp_rank` (default: this rank's)."""
        t = self.tp_rank if tp_rank is None else tp_rank
        return [t * self.cp + c for c in range(self.cp)]

    def all_cp_groups(self) -> list[list[int]]:
        """Every cp group, in tp-rank order (process groups must be created by all ranks in the same order)."""
        return [self.cp_group_ranks(t) for t in range(self.tp)]

    def repurpose_cp_to_tp(self) -> Mapping:
        """The same ranks as plain tensor parallelism: `tp * cp` with `cp = 1` (rank r keeps slice r)."""
        return Mapping(tp=self.world_size, cp=1, rank=self.rank)

    def validate(self, config: KimiK3Config, page_size: int | None = None, engine_page_size: int | None = None):
        """Raise `ParallelConfigError` naming the first model size the layout cannot split evenly.

        `page_size` is the Helix ownership page (tokens per page); it must equal the engine's cache page.
        """
        world = self.world_size
        checks = [
            ("num_attention_heads (MLA heads)", config.num_attention_heads),
            ("linear_attn_config.num_heads (KDA heads)", config.kda_num_heads),
            ("vocab_size", config.vocab_size),
            ("intermediate_size", config.intermediate_size),
        ]
        if config.num_experts > 0:
            checks.append(("num_experts (expert parallelism)", config.num_experts))
            if config.num_shared_experts > 0:
                checks.append(
                    (
                        "moe_intermediate_size * num_shared_experts",
                        config.moe_intermediate_size * config.num_shared_experts,
                    )
                )
        for name, value in checks:
            if value % world:
                raise ParallelConfigError(
                    f"{name} = {value} is not divisible by tp * cp = {self.tp} * {self.cp} = {world}"
                )
        if page_size is not None and engine_page_size is not None and page_size != engine_page_size:
            raise ParallelConfigError(
                f"Helix page_size ({page_size}) must equal the engine's cache page_size ({engine_page_size})"
            )
