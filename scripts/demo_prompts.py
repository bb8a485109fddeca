"""Prompts from the demo model's corpus: the running interpreter's standard library, split as the manifest says.

`scripts/prepare_corpus.py` holds a document out by a hash of its path only, so the split is the same on every
machine and Python version, and no corpus file has to travel with the repository: the drafter trains on prompts
from the train split and `scripts/bench_spec.py` measures on prompts from the held-out split.
"""

from __future__ import annotations

import bisect
import json
import random
import re
import sysconfig
from pathlib import Path

from prepare_corpus import MANIFEST, collect_documents, is_heldout

SPLITS = ("train", "heldout")


def split_documents(split: str) -> list[tuple[str, str]]:
    """(relative path, text) of the corpus documents in `split` ("train" or "heldout") in this interpreter's
    stdlib."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    percent = json.loads(Path(MANIFEST).read_text())["heldout_percent"]
    docs = collect_documents(Path(sysconfig.get_paths()["stdlib"]))
    return [(path, text) for path, text in docs if is_heldout(path, percent) == (split == "heldout")]


def corpus_prompts(tokenizer, split: str, num: int, prompt_len: int, seed: int = 0) -> list[list[int]]:
    """`num` prompts of exactly `prompt_len` token ids, each starting at a random non-blank line of a document of
    `split`, documents drawn in proportion to their length (seeded: the same prompts on every call)."""
    texts = [text for _, text in split_documents(split) if text.strip()]
    if not texts:
        raise ValueError(f"no {split} documents of the demo corpus in this interpreter's standard library")
    ends = []
    for t in texts:
        ends.append((ends[-1] if ends else 0) + len(t))
    rng = random.Random(seed)
    line_starts: dict[int, list[int]] = {}
    prompts: list[list[int]] = []
    for _ in range(100 * num):
        if len(prompts) == num:
            return prompts
        doc = bisect.bisect_right(ends, rng.randrange(ends[-1]))
        text = texts[doc]
        if doc not in line_starts:
            line_starts[doc] = [0] + [m.end() for m in re.finditer(r"\n(?=[^\s])", text)]
        start = rng.choice(line_starts[doc])
        ids = tokenizer(text[start : start + 16 * prompt_len], add_special_tokens=False).input_ids
        if len(ids) >= prompt_len:
            prompts.append(ids[:prompt_len])
    raise ValueError(f"found {len(prompts)} of {num} {split} prompts of {prompt_len} tokens")
