"""`ForwardBatch`: how the tokens of one forward pass are laid out, and each sequence's declared phase.

Every layer works on packed tokens `[T, d]`: the new tokens of N sequences placed end to end (no padding), with
`cu_seqlens` as in FlashAttention. Each sequence may continue a cached context of `context_lens[i]` tokens. The HF
`generate()` path and the engine build the same object, so both run the same layers.

The phase of each sequence is declared by whoever builds the batch (the engine's scheduler), never inferred from
shapes by the layers, so one step may mix decodes, verify groups and prefill chunks: the layers read `runs()` and
send the decode and verify sequences to the decode kernels and only the prefill chunks to the prefill kernels.
"""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass

import torch


class Phase(enum.Enum):
    """What the new tokens of one sequence are.

    DECODE: one new token continuing a context. VERIFY: 1 + k new tokens (the last sampled token and k drafts),
    causal inside the group, each token seeing the keys up to itself. PREFILL: a chunk of the prompt.
    """

    DECODE = "decode"
    VERIFY = "verify"
    PREFILL = "prefill"

    @property
    def on_decode_path(self) -> bool:
        """Decodes and verify groups take the decode kernels (absorbed MLA over the pages, recurrent KDA)."""
        return self is not Phase.PREFILL


@dataclass
class PhaseRun:
    """Consecutive sequences of a batch that take the same kernel path.

    Attributes:
        decode_path: True for decodes and verify groups, False for prefill chunks.
        seqs: the run's sequences in the parent batch. tokens: their new tokens in the packed layout.
        batch: the run as a batch of its own (the parent itself when the run covers it all).
    """

    decode_path: bool
    seqs: slice
    tokens: slice
    batch: ForwardBatch

    @property
    def attention_phase(self) -> str:
        """The phase name the attention backend switch expects: "prefill", "decode" or "verify"."""
        if not self.decode_path:
            return "prefill"
        return "verify" if Phase.VERIFY in self.batch.phases else "decode"


@dataclass(frozen=True)
class TailPadding:
    """Padding rows at the end of a one-sequence prefill, so that a captured prefill serves every prompt length up
    to its size (`engine.cuda_graph`). The batch is one sequence of all T rows: attention is causal, so the live
    rows never see the padding, and the padding rows' outputs are never read. Only the KDA layers' states would see
    them, so those layers take the live length from here:

    Attributes:
        conv_cu_seqlens: [3] int32 on the device, [0, live rows, T]: the short conv runs the padding as a second
            sequence, which leaves the live sequence's conv state at its own last rows.
        conv_state_indices: [2] int64 on the device: the live sequence's state slot, then a scratch slot for the
            padding sequence's conv state.

    The delta rule runs over all T rows with the padding rows' beta and decay set to 0 and 1 (their logits to
    -inf), so that they leave the recurrent state as the last live row left it.
    """

    conv_cu_seqlens: torch.Tensor
    conv_state_indices: torch.Tensor

    def padding_rows(self, num_rows: int) -> torch.Tensor:
        """[num_rows] bool on the device: True at the padding rows (no host read of the live length)."""
        rows = torch.arange(num_rows, device=self.conv_cu_seqlens.device)
        return rows >= self.conv_cu_seqlens[1]


@dataclass
class ForwardBatch:
    """Layout and phases of the new tokens of N sequences.

    Attributes:
        seq_lens: new tokens per sequence (host ints), length N.
        context_lens: tokens already cached per sequence before this pass (host ints), length N.
        cu_seqlens: [N+1] int32, prefix sums of `seq_lens`, on the device.
        positions: [T] int64 absolute positions (`context_lens[i] + j`), on the device.
        phases: the declared `Phase` of each sequence, length N.
        tail_padding: set when the batch is one padded prefill sequence (`TailPadding`), else None.

    `host_cu_seqlens` and `host_cu_totals` are the host-side offsets the kernels take instead of reading the
    device ones back (a read is a device sync, and prefill would pay it in every layer).
    """

    seq_lens: list[int]
    context_lens: list[int]
    cu_seqlens: torch.Tensor
    positions: torch.Tensor
    phases: list[Phase]
    tail_padding: TailPadding | None = None

    def __post_init__(self) -> None:
        padding, one = self.tail_padding, len(self.seq_lens) == 1
        if padding is not None and not (one and self.phases[0] is Phase.PREFILL and self.context_lens[0] == 0):
            raise ValueError(
                "tail_padding applies to one prefill sequence without a cached context, got "
                f"seq_lens={self.seq_lens}, context_lens={self.context_lens}, phases={self.phases}"
            )
        self._runs: list[PhaseRun] | None = None
        self._host_cu: dict[str, torch.Tensor] = {}

    def _prefix_sums(self, name: str, lens: list[int]) -> torch.Tensor:
        cu = self._host_cu.get(name)
        if cu is None:
            cu = self._host_cu[name] = torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32)
        return cu

    @property
    def host_cu_seqlens(self) -> torch.Tensor:
        """[N+1] int32 on the host: `cu_seqlens` as the host knows it (computed once)."""
        return self._prefix_sums("seq", self.seq_lens)

    @property
    def host_cu_totals(self) -> torch.Tensor:
        """[N+1] int32 on the host: prefix sums of `total_lens()` (cached plus new tokens; computed once)."""
        return self._prefix_sums("total", self.total_lens())

    @classmethod
    def build(
        cls,
        seq_lens: list[int],
        context_lens: list[int],
        device: torch.device | str,
        phases: list[Phase] | None = None,
    ) -> ForwardBatch:
        """Build the device tensors from host lengths.

        `phases=None` is for the HF path only: a sequence is DECODE when it has exactly one new token and a
        context, PREFILL otherwise. The engine always passes the phases it scheduled.
        """
        if len(seq_lens) != len(context_lens):
            raise ValueError(f"seq_lens ({len(seq_lens)}) and context_lens ({len(context_lens)}) differ in length")
        if phases is None:
            phases = [Phase.DECODE if n == 1 and c > 0 else Phase.PREFILL for n, c in zip(seq_lens, context_lens)]
        check_phases(seq_lens, phases)
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
            phases=list(phases),
        )

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)

    @property
    def num_tokens(self) -> int:
        return sum(self.seq_lens)

    def total_lens(self) -> list[int]:
        return [c + n for c, n in zip(self.context_lens, self.seq_lens)]

    def runs(self) -> list[PhaseRun]:
        """Maximal runs of consecutive sequences on the same kernel path, in batch order (computed once).

        The engine puts decodes and verifies before prefill chunks, so a mixed step has at most two runs.
        """
        if self._runs is None:
            self._runs = []
            start, tok = 0, 0
            for i in range(1, self.num_seqs + 1):
                if i < self.num_seqs and self.phases[i].on_decode_path == self.phases[start].on_decode_path:
                    continue
                n_tok = sum(self.seq_lens[start:i])
                sub = self if (start, i) == (0, self.num_seqs) else self._slice(start, i, tok, tok + n_tok)
                run = PhaseRun(self.phases[start].on_decode_path, slice(start, i), slice(tok, tok + n_tok), sub)
                self._runs.append(run)
                start, tok = i, tok + n_tok
        return self._runs

    def _slice(self, s0: int, s1: int, t0: int, t1: int) -> ForwardBatch:
        return ForwardBatch(
            seq_lens=self.seq_lens[s0:s1],
            context_lens=self.context_lens[s0:s1],
            cu_seqlens=self.cu_seqlens[s0 : s1 + 1] - self.cu_seqlens[s0],
            positions=self.positions[t0:t1],
            phases=self.phases[s0:s1],
        )


def check_phases(seq_lens: list[int], phases: list[Phase]) -> None:
    """Raise ValueError unless `phases` has one `Phase` per sequence and every DECODE has exactly one token."""
    if len(phases) != len(seq_lens):
        raise ValueError(f"phases ({len(phases)}) and seq_lens ({len(seq_lens)}) differ in length")
    for i, (phase, n) in enumerate(zip(phases, seq_lens)):
        if not isinstance(phase, Phase):
            raise ValueError(f"phases[{i}] must be a Phase ({', '.join(p.name for p in Phase)}), got {phase!r}")
        if phase is Phase.DECODE and n != 1:
            raise ValueError(f"phases[{i}] is DECODE, which has exactly 1 new token, but seq_lens[{i}] = {n}")
