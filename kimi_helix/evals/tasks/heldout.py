"""Documents of the demo model's held-out tasks, rebuilt from this interpreter's standard library.

The demo corpus manifest (`kimi_helix/assets/demo/corpus_manifest.json`, written by scripts/prepare_corpus.py) lists
every document's path (relative to `sysconfig.get_paths()["stdlib"]`, or `pydoc_data/topics.py#<topic>` for a help
topic), its sha256 and its split. Documents are read as prepare_corpus.py read them; one whose sha256 differs (another
Python version) is left out with a warning, since it is not the text the split was made on.

lm-eval calls the loaders as `custom_dataset(**metadata, **dataset_kwargs)`; `--metadata '{"manifest": FILE}'`
points at another manifest.
"""

from __future__ import annotations

import hashlib
import json
import logging
import random
import sysconfig
from pathlib import Path

import datasets

TOPICS = "pydoc_data/topics.py"
CONTEXT_LINES = 20
NUM_CHOICES = 4
EXAMPLES_PER_FILE = 8
MIN_LINE_CHARS = 8  # a candidate line has at least this many non-blank characters

log = logging.getLogger(__name__)


def default_manifest() -> Path:
    from kimi_helix.assets import DEMO_DIR

    return DEMO_DIR / "corpus_manifest.json"


def heldout_documents(manifest: str | Path | None = None, stdlib: str | Path | None = None) -> list[dict]:
    """[{"path", "text"}] of the manifest's held-out documents whose text matches its sha256, in manifest order."""
    manifest = Path(manifest) if manifest is not None else default_manifest()
    if not manifest.is_file():
        raise FileNotFoundError(f"the demo corpus manifest {manifest} is missing (scripts/prepare_corpus.py writes it)")
    entries = [d for d in json.loads(manifest.read_text())["documents"] if d["split"] == "heldout"]
    root = Path(stdlib) if stdlib is not None else Path(sysconfig.get_paths()["stdlib"])
    docs, skipped = [], []
    for entry in entries:
        text = _read_document(root, entry["path"])
        if text is None or hashlib.sha256(text.encode()).hexdigest() != entry["sha256"]:
            skipped.append(entry["path"])
            continue
        docs.append({"path": entry["path"], "text": text})
    if skipped:
        log.warning(
            "%d of %d held-out documents differ from the manifest and are left out: %s",
            len(skipped),
            len(entries),
            ", ".join(skipped[:5]),
        )
    if not docs:
        raise ValueError(f"none of the {len(entries)} held-out documents of {manifest} is found unchanged under {root}")
    return docs


def _read_document(root: Path, rel: str) -> str | None:
    if rel.startswith(TOPICS + "#"):
        from pydoc_data.topics import topics

        return topics.get(rel.split("#", 1)[1])
    path = root / rel
    # As prepare_corpus.py reads it: a few stdlib files are Latin-1 fixtures.
    return path.read_bytes().decode("utf-8", errors="replace") if path.is_file() else None


def load_code_bpb(manifest=None, stdlib=None, **_metadata) -> datasets.DatasetDict:
    """kimi_helix_code_bpb's documents: one per held-out document, {"path", "text"}, in a "test" split."""
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(heldout_documents(manifest, stdlib))})


def process_code_bpb(doc: dict, results: list[float]) -> dict:
    """lm-eval's (log-likelihood, bytes) pairs; `bits_per_byte` aggregates them over the whole split."""
    (loglikelihood,) = results
    n_bytes = len(doc["text"].encode("utf-8"))
    return {"bits_per_byte": (loglikelihood, n_bytes), "byte_perplexity": (loglikelihood, n_bytes)}


def _candidates(lines: list[str]) -> list[int]:
    """Line indices that can be a question's next line: 20 lines before them, enough text in them."""
    return [i for i in range(CONTEXT_LINES, len(lines)) if len(lines[i].strip()) >= MIN_LINE_CHARS]


def next_line_examples(docs: list[dict]) -> list[dict]:
    """Up to 8 evenly spaced questions per code file: 20 lines of context, the real next line and 3 lines of other
    held-out files, in a position fixed by a seed derived from the file's path and the line number."""
    files = [(d["path"], d["text"].splitlines()) for d in docs if "#" not in d["path"]]
    pools = {path: [lines[i] for i in _candidates(lines)] for path, lines in files}
    examples = []
    for path, lines in files:
        cands = _candidates(lines)
        picks = sorted({cands[j * len(cands) // EXAMPLES_PER_FILE] for j in range(min(len(cands), EXAMPLES_PER_FILE))})
        others = [p for p, _ in files if p != path and pools[p]]
        for i in picks:
            rng = random.Random(hashlib.sha256(f"{path}:{i}".encode()).digest())
            answer = lines[i]
            distractors: list[str] = []
            for other in rng.sample(others, len(others)):
                line = rng.choice(pools[other])
                if line.strip() != answer.strip() and all(line.strip() != d.strip() for d in distractors):
                    distractors.append(line)
                if len(distractors) == NUM_CHOICES - 1:
                    break
            if len(distractors) < NUM_CHOICES - 1:
                continue
            gold = rng.randrange(NUM_CHOICES)
            choices = distractors[:gold] + [answer] + distractors[gold:]
            context = "\n".join(lines[i - CONTEXT_LINES : i]) + "\n"
            examples.append({"path": path, "line": i, "context": context, "choices": choices, "gold": gold})
    return examples


def load_next_line(manifest=None, stdlib=None, **_metadata) -> datasets.DatasetDict:
    """kimi_helix_next_line's questions, {"path", "line", "context", "choices", "gold"}, in a "test" split."""
    examples = next_line_examples(heldout_documents(manifest, stdlib))
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(examples)})
