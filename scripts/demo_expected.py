"""Write `kimi_helix/assets/demo/expected_logits.json`: the shipped demo model's logits on a held-out snippet.

The snippet is the first 64 tokens of the first held-out source file of the corpus manifest (read from this
interpreter's standard library, which must match the manifest's sha256). Its text is stored in the json, so the
test (`tests/assets/test_demo_model.py`) needs no corpus. Rerun this only when the shipped weights change.

    python scripts/demo_expected.py
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import sysconfig
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from kimi_helix.assets import DEMO_DIR, demo_model_dir  # noqa: E402
from kimi_helix.assets.demo_recipe import logit_fingerprint  # noqa: E402

EXPECTED = DEMO_DIR / "expected_logits.json"
SNIPPET_TOKENS = 64


def heldout_snippet(tokenizer) -> tuple[str, str]:
    """(path, text) of the snippet: the first `SNIPPET_TOKENS` tokens of the first held-out stdlib source."""
    manifest = json.loads((DEMO_DIR / "corpus_manifest.json").read_text())
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for doc in manifest["documents"]:
        if doc["split"] != "heldout" or "#" in doc["path"]:
            continue
        data = (stdlib / doc["path"]).read_bytes()
        if hashlib.sha256(data).hexdigest() != doc["sha256"]:
            continue  # this interpreter's copy differs from the one the model was split on
        ids = tokenizer(data.decode(), add_special_tokens=False, verbose=False)["input_ids"][:SNIPPET_TOKENS]
        return doc["path"], tokenizer.decode(ids)
    raise RuntimeError("no held-out source of the manifest matches this interpreter's standard library")


def main(argv: list[str] | None = None) -> None:
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args(argv)
    from transformers import AutoTokenizer

    from kimi_helix.modeling.model import KimiK3ForCausalLM

    model_dir = demo_model_dir()
    tokenizer = AutoTokenizer.from_pretrained(model_dir, trust_remote_code=False)
    model = KimiK3ForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    path, text = heldout_snippet(tokenizer)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    record = {"source": path, "text": text, "token_ids": ids, **logit_fingerprint(model, ids)}
    # one key per line, each list on one line: readable diffs when the weights change
    EXPECTED.write_text("{\n" + ",\n".join(f" {json.dumps(k)}: {json.dumps(v)}" for k, v in record.items()) + "\n}\n")
    print(f"wrote {EXPECTED} ({len(ids)} tokens of {path})")


if __name__ == "__main__":
    main()
