"""Per-request sampling: `SamplingParams`, `make_generator`, the batched `sample` and `logprobs_of`.

Every request carries its own `torch.Generator`, and `sample` draws each row with that row's generator only, so a
seeded request produces the same tokens whatever else shares its batch (and wherever it sits in it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

# Temperatures below this are decoded greedily: `logits / T` would overflow fp32 to inf (and softmax to NaN) long
# before the distribution stops being a point mass at the argmax anyway. vLLM uses the same threshold.
GREEDY_TEMPERATURE = 1e-5


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass
class SamplingParams:
    """How one request is decoded.

    Args:
        max_tokens: tokens to generate at most, >= 1.
        temperature: >= 0; 0 (anything below `GREEDY_TEMPERATURE`) decodes greedily, ignoring top_k and top_p.
        top_k: keep the k most likely tokens, an int >= -1; 0 or -1 turns it off.
        top_p: nucleus sampling, in (0, 1]: keep the fewest most likely tokens whose probability (after top_k)
            reaches top_p; the most likely token is always kept. 1 turns it off.
        seed: None or an int in [0, 2**64) (torch's seed range) seeding the request's own generator (see
            `make_generator`).
        stop: strings that end generation when the text produces them; a single str is accepted.
        stop_token_ids: token ids (ints >= 0) that end generation.
        ignore_eos: keep generating past the model's EOS token.
        logprobs: None, or n >= 0: return, per generated token, the log-probabilities of the n most likely tokens
            plus the chosen one (vLLM's meaning; 0 = only the chosen token).
        prompt_logprobs: None, or n >= 0: the same for every prompt token after the first (given the ones before).

    Log-probabilities are the model's own: log-softmax of the fp32 logits before temperature, top-k and top-p (as
    vLLM returns them), so they do not depend on how the token was drawn.

    Every field is checked on construction; a bad value raises `ValueError` naming the field and its range.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None

    def __post_init__(self) -> None:
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"SamplingParams.max_tokens must be an int >= 1, got {self.max_tokens!r}")
        if (
            isinstance(self.temperature, bool)
            or not isinstance(self.temperature, (int, float))
            or not math.isfinite(self.temperature)
            or self.temperature < 0
        ):
            raise ValueError(
                f"SamplingParams.temperature must be a finite number >= 0 (0 = greedy), got {self.temperature!r}"
            )
        if not _is_int(self.top_k) or self.top_k < -1:
            raise ValueError(f"SamplingParams.top_k must be an int >= -1 (0 or -1 = off), got {self.top_k!r}")
        if (
            isinstance(self.top_p, bool)
            or not isinstance(self.top_p, (int, float))
            or not 0 < self.top_p <= 1  # also rejects NaN
        ):
            raise ValueError(f"SamplingParams.top_p must be in (0, 1] (1 = off), got {self.top_p!r}")
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed < 2**64):
            raise ValueError(f"SamplingParams.seed must be None or an int in [0, 2**64), got {self.seed!r}")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if not isinstance(self.stop, (list, tuple)) or not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError(f"SamplingParams.stop must be a str or a list of non-empty str, got {self.stop!r}")
        self.stop = list(self.stop)
        if not isinstance(self.stop_token_ids, (list, tuple)) or not all(
            _is_int(t) and t >= 0 for t in self.stop_token_ids
        ):
            raise ValueError(f"SamplingParams.stop_token_ids must be a list of ints >= 0, got {self.stop_token_ids!r}")
        self.stop_token_ids = list(self.stop_token_ids)
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"SamplingParams.ignore_eos must be a bool, got {self.ignore_eos!r}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or value < 0):
                raise ValueError(f"SamplingParams.{name} must be None or an int >= 0, got {value!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE


@dataclass
class Logprob:
    """One token's log-probability under the model, its rank (1 = the argmax) and its text (None without a
    tokenizer)."""

    logprob: float
    rank: int
    decoded_token: str | None = None


def logprobs_of(
    logits: torch.Tensor, token_ids: list[int], num_top: list[int], decode=None
) -> list[dict[int, Logprob]]:
    """Per row, the log-probabilities of `token_ids[i]` and of the row's `num_top[i]` most likely tokens.

    Args:
        logits: [R, V] model logits (computed in fp32; no temperature or filtering applied).
        token_ids: R actual tokens (the sampled or the prompt token), always in the row's dict.
        num_top: R counts n >= 0 of top tokens to add.
        decode: optional callable token id -> text for `Logprob.decoded_token`.

    Returns:
        R dicts token id -> `Logprob`; a rank is 1 + the number of tokens with a strictly larger log-probability.
    """
    if logits.dim() != 2 or len(token_ids) != logits.shape[0] or len(num_top) != logits.shape[0]:
        raise ValueError(
            f"logits [R, V] {tuple(logits.shape)} needs R token_ids and num_top, got {len(token_ids)}, {len(num_top)}"
        )
    logp = torch.log_softmax(logits.float(), dim=-1)
    chosen = torch.tensor(token_ids, dtype=torch.long, device=logp.device)
    chosen_logp = logp.gather(1, chosen[:, None])
    chosen_rank = (logp > chosen_logp).sum(-1) + 1
    top_logp, top_ids = logp.topk(max(num_top, default=0), dim=-1)
    # Every token above a top-n one is itself in the top n, so counting inside the top n ranks it (ties share).
    top_rank = (top_logp[:, None, :] > top_logp[..., None]).sum(-1) + 1
    rows = zip(token_ids, chosen_logp[:, 0].tolist(), chosen_rank.tolist(), top_logp.tolist(), top_ids.tolist())
    out = []
    for (tok, lp, rank, tops, ids), ranks, n in zip(rows, top_rank.tolist(), num_top):
        entry = {i: Logprob(v, r, None) for v, i, r in zip(tops[:n], ids[:n], ranks[:n])}
        entry[tok] = Logprob(lp, rank, None)
        if decode is not None:
            for i, item in entry.items():
                item.decoded_token = decode(i)
        out.append(entry)
    return out


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator:
    """A generator on `device` for one request.

    `seed` seeds it directly. With `seed=None` it is seeded with a 63-bit draw from torch's global CPU generator, so
    unseeded requests still repeat exactly after `torch.manual_seed`, and two unseeded requests differ.
    """
    if seed is None:
        seed = int(torch.randint(0, 2**63 - 1, (), dtype=torch.int64).item())
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return generator


def sample(
    logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]
) -> torch.Tensor:
    """Draw one token per row.

    Args:
        logits: [N, V], any float dtype; computed in fp32 on its own device.
        params: N `SamplingParams`, one per row.
        generators: N generators on the logits' device (None: torch's global generator for that device). The
            same generator may appear in several rows; it then advances row by row.

    Returns:
        token ids [N], int64, on the logits' device.

    Greedy rows take the argmax (the first index among ties) and use no randomness. The other rows divide by their
    temperature, mask all but the top_k logits and then all but the top_p nucleus (per-row tensors, so one batch
    mixes any settings; rows with both filters off skip the sort), take the softmax, and draw by an *exponential
    race*: with E_v ~ Exp(1) i.i.d., `argmax_v p_v / E_v` is distributed exactly as `p` (E_v / p_v ~ Exp(p_v), and
    the smallest of independent exponentials is v with probability p_v / sum p). A row's noise is V draws from its
    own generator, so its token depends only on its logits, its params and its generator's state - never on its
    neighbours - and each sampled step advances the generator by the same amount. The race also turns the draw into
    one batched argmax instead of N `multinomial` calls.
    """
    if logits.dim() != 2:
        raise ValueError(f"logits must be [N, V], got shape {tuple(logits.shape)}")
    n, vocab = logits.shape
    if len(params) != n or len(generators) != n:
        raise ValueError(f"logits has {n} rows but params has {len(params)} and generators {len(generators)}")
    device = logits.device  # per-row tensors go over without a blocking copy: a step syncs once, for its tokens
    logits = logits.float()
    out = torch.empty(n, dtype=torch.int64, device=device)

    greedy = [i for i, p in enumerate(params) if p.greedy]
    rand = [i for i, p in enumerate(params) if not p.greedy]
    if not rand:  # all greedy (plain decoding's usual batch): one argmax, no row indices to copy over
        return logits.argmax(dim=-1)
    if greedy:
        rows = torch.tensor(greedy).to(device, non_blocking=True)
        out[rows] = logits[rows].argmax(dim=-1)
    if not rand:
        return out

    rows = torch.tensor(rand).to(device, non_blocking=True)
    temps = torch.tensor([params[i].temperature for i in rand], dtype=torch.float32).to(device, non_blocking=True)
    scaled = logits[rows] / temps[:, None]

    # Only rows that filter are sorted; a row with both filters off keeps its logits bit for bit either way.
    filtered = [j for j, i in enumerate(rand) if params[i].top_k > 0 or params[i].top_p < 1]
    if filtered:
        sub = torch.tensor(filtered).to(device, non_blocking=True)
        scaled[sub] = filter_top_k_top_p(scaled[sub], [params[rand[j]] for j in filtered])

    probs = torch.softmax(scaled, dim=-1)
    noise = torch.empty_like(probs)
    for j, i in enumerate(rand):
        noise[j].exponential_(generator=generators[i])
    # exponential_ may return exactly 0 in some torch versions; a tiny floor keeps p/E finite.
    noise.clamp_min_(torch.finfo(torch.float32).tiny)
    out[rows] = (probs / noise).argmax(dim=-1)
    return out


def filter_top_k_top_p(scaled: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Set every logit outside a row's top_k and top_p nucleus to -inf. scaled: [M, V] fp32 (temperature applied)."""
    m, vocab = scaled.shape
    device = scaled.device
    # top_k off (0 / -1) or >= V keeps everything; top_p = 1 keeps everything without trusting a float cumsum.
    k = torch.tensor([p.top_k if 0 < p.top_k < vocab else vocab for p in params]).to(device, non_blocking=True)
    top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32).to(device, non_blocking=True)
    p_off = torch.tensor([p.top_p >= 1 for p in params]).to(device, non_blocking=True)

    # A stable sort ranks tied logits by index, so top_k=1 and a tiny top_p keep exactly the argmax.
    sorted_logits, order = scaled.sort(dim=-1, descending=True, stable=True)
    rank = torch.arange(vocab, device=device)
    keep = rank[None, :] < k[:, None]
    sorted_logits = sorted_logits.masked_fill(~keep, float("-inf"))
    sorted_probs = torch.softmax(sorted_logits, dim=-1)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    keep &= (mass_before < top_p[:, None]) | p_off[:, None]
    keep[:, 0] = True
    keep_by_vocab = torch.empty_like(keep).scatter_(1, order, keep)
    return scaled.masked_fill(~keep_by_vocab, float("-inf"))
