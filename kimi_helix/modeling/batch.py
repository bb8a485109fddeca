"""`ForwardBatch`: how the tokens of one forward pass are laid out.

Every layer works on packed tokens `[T, d]`: the new tokens of N sequences placed end to end (no padding), with
`cu_seqlens` as in FlashAttention. Each sequence may continue a cached context of `context_lens[i]` tokens. The HF
`generate()` path and the engine build the same object, so both run the same layers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class ForwardBatch:
    """Layout of the new tokens of N sequences.

    Attributes:
        seq_lens: new tokens per sequence (host ints), length N.
        context_lens: tokens already cached per sequence before this pass (host ints), length N.
        cu_seqlens: [N+1] int32, prefix sums of `seq_lens`, on the device.
        positions: [T] int64 absolute positions (`context_lens[i] + j`), on the device.
    """

    seq_lens: list[int]
    context_lens: list[int]
    cu_seqlens: torch.Tensor
    positions: torch.Tensor

    @classmethod
    def build(cls, seq_lens: list[int], context_lens: list[int], device: torch.device | str) -> ForwardBatch:
        if len(seq_lens) != len(context_lens):
            raise ValueError(f"seq_lens ({len(seq_lens)}) and context_lens ({len(context_lens)}) differ in length")
        cu = [0]
        for n in seq_lens:
            cu.append(cu[-1] + n)
        positions = [c + j for c, n in zip(context_lens, seq_lens) for j in range(n)]
        return cls(
            seq_lens=list(seq_lens),
            context_lens=list(context_lens),
            cu_seqlens=torch.tensor(cu, dtype=torch.int32, device=device),
            positions=torch.tensor(positions, dtype=torch.int64, device=device),
        )

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)

    @property
    def num_tokens(self) -> int:
        return sum(self.seq_lens)

    @property
    def is_decode(self) -> bool:
        """One new token per sequence, each continuing a context: the recurrent/absorbed fast path."""
        return all(n == 1 for n in self.seq_lens) and all(c > 0 for c in self.context_lens)

    def total_lens(self) -> list[int]:
        return [c + n for c, n in zip(self.context_lens, self.seq_lens)]
