"""Build the demo model's corpus, tokenizer and token arrays from the running interpreter's standard library.

Documents: every pure-Python stdlib source (`sysconfig.get_paths()["stdlib"]`, `*.py`, test folders and
site-packages excluded) and each English help topic of `pydoc_data/topics.py` (as text, one document per topic,
named `pydoc_data/topics.py#<topic>`). A document is held out when the first 8 bytes of the sha256 of its relative
path, read as an integer, fall in the lowest `--heldout-percent` of the range: the split depends on the path only,
so it is the same on every machine and Python version.

Writes:
- `kimi_helix/assets/demo/corpus_manifest.json`: per document its path, sha256 and split (committed);
- `kimi_helix/assets/demo/` tokenizer files: a byte-level BPE trained on the train split (committed);
- `data/demo/{train,heldout}.npy` (uint16 token streams, documents joined by eos) and `data/demo/meta.json`
  (git-ignored; carry `data/demo` to the training machine).

    python scripts/prepare_corpus.py            # all of it
    python scripts/prepare_corpus.py --check    # only verify the committed manifest against this interpreter
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import sysconfig
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
ASSETS = REPO / "kimi_helix" / "assets" / "demo"
DATA = REPO / "data" / "demo"
MANIFEST = ASSETS / "corpus_manifest.json"
# Folders that hold tests (unittest/test, lib2to3/tests, idlelib/idle_test, ...) or are not the stdlib itself.
SKIP_PARTS = frozenset({"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"})
TOPICS = "pydoc_data/topics.py"
SPECIALS = {"bos_token": "<|bos|>", "eos_token": "<|eos|>", "pad_token": "<|pad|>"}


def is_heldout(rel_path: str, percent: float) -> bool:
    """Deterministic split: the path's sha256 prefix as a fraction of 2**64, below `percent` / 100."""
    prefix = int.from_bytes(hashlib.sha256(rel_path.encode()).digest()[:8], "big")
    return prefix < percent / 100 * 2**64


def collect_documents(stdlib: Path) -> list[tuple[str, str]]:
    """(relative path, text) of every corpus document, sorted by path."""
    docs = []
    for path in stdlib.rglob("*.py"):
        rel = path.relative_to(stdlib)
        if SKIP_PARTS & set(rel.parts[:-1]) or rel.as_posix() == TOPICS:
            continue
        # A few stdlib files are Latin-1 test fixtures; replacement keeps the text valid UTF-8.
        docs.append((rel.as_posix(), path.read_bytes().decode("utf-8", errors="replace")))
    from pydoc_data.topics import topics

    docs.extend((f"{TOPICS}#{name}", text) for name, text in topics.items())
    return sorted(docs)


def build_manifest(docs: list[tuple[str, str]], percent: float) -> dict:
    entries = [
        {
            "path": rel,
            "sha256": hashlib.sha256(text.encode()).hexdigest(),
            "split": "heldout" if is_heldout(rel, percent) else "train",
        }
        for rel, text in docs
    ]
    return {
        "python": sys.version.split()[0],
        "heldout_percent": percent,
        "split_rule": "sha256(path)[:8] as big-endian int < heldout_percent / 100 * 2**64 -> heldout",
        "documents": entries,
    }


def train_tokenizer(texts: list[str], vocab_size: int, out_dir: Path):
    """Byte-level BPE over `texts`, saved in HF format (`tokenizer.json` + `tokenizer_config.json`)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIALS.values()),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=True,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, model_max_length=4096, **SPECIALS)
    fast.save_pretrained(out_dir)
    # The class name every transformers version resolves (5.x aliases it to its tokenizers backend).
    config_file = out_dir / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config_file.write_text(json.dumps(config, indent=2) + "\n")
    return fast


def tokenize_stream(tokenizer, texts: list[str]) -> np.ndarray:
    """All documents end to end, each followed by eos, as uint16."""
    eos = tokenizer.eos_token_id
    ids = tokenizer(texts, add_special_tokens=False, verbose=False)["input_ids"]
    out = np.fromiter((t for doc in ids for t in (*doc, eos)), dtype=np.int64)
    if out.max() >= 2**16:
        raise ValueError(f"token id {out.max()} does not fit uint16")
    return out.astype(np.uint16)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--heldout-percent", type=float, default=5.0)
    ap.add_argument("--vocab-size", type=int, default=8192)
    ap.add_argument("--check", action="store_true", help="compare this interpreter's corpus with the manifest")
    args = ap.parse_args(argv)

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    docs = collect_documents(stdlib)
    manifest = build_manifest(docs, args.heldout_percent)
    if args.check:
        committed = {d["path"]: d for d in json.loads(MANIFEST.read_text())["documents"]}
        same = sum(committed.get(d["path"]) == d for d in manifest["documents"])
        print(f"{same} of {len(manifest['documents'])} documents match the manifest ({len(committed)} committed)")
        return

    ASSETS.mkdir(parents=True, exist_ok=True)
    DATA.mkdir(parents=True, exist_ok=True)
    MANIFEST.write_text(json.dumps(manifest, indent=1) + "\n")
    splits = {
        s: [text for (_, text), d in zip(docs, manifest["documents"]) if d["split"] == s] for s in ("train", "heldout")
    }
    tokenizer = train_tokenizer(splits["train"], args.vocab_size, ASSETS)
    meta = {"vocab_size": len(tokenizer), "python": manifest["python"]}
    for split, texts in splits.items():
        stream = tokenize_stream(tokenizer, texts)
        np.save(DATA / f"{split}.npy", stream)
        meta[split] = {
            "documents": len(texts),
            "tokens": int(stream.size),
            "bytes": sum(len(t.encode()) for t in texts),
        }
        print(f"{split}: {len(texts)} documents, {meta[split]['bytes'] / 1e6:.2f} MB, {stream.size / 1e6:.2f} M tokens")
    (DATA / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")


if __name__ == "__main__":
    main()
