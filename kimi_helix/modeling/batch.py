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
        lens = torch.tensor(seq_lens, dtype=torch.int64)
        cu = torch.zeros(len(seq_lens) + 1, dtype=torch.int64)
        torch.cumsum(lens, 0, out=cu[1:])
        # position of token j of sequence i = context_lens[i] + j, built without a Python loop over tokens
        starts = torch.tensor(context_lens, dtype=torch.int64) - cu[:-1]
        positions = torch.arange(int(cu[-1])) + starts.repeat_interleave(lens)
        return cls(
            seq_lens=list(seq_lens),
            context_lens=list(context_lens),
            cu_seqlens=cu.to(device=device, dtype=torch.int32),
            positions=positions.to(device),
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
