"""The demo model's held-out tasks, on a made-up stdlib folder and manifest."""

import hashlib
import json
import math

import pytest

pytest.importorskip("lm_eval")

import lm_eval  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402

from kimi_helix.evals import TASKS_DIR  # noqa: E402
from kimi_helix.evals.lm_eval_model import KimiHelixLM  # noqa: E402
from kimi_helix.evals.tasks import heldout  # noqa: E402


def fake_corpus(tmp_path, n_files=5, n_lines=40):
    """A stdlib folder of `n_files` held-out modules plus one train module, and its manifest."""
    root = tmp_path / "stdlib"
    (root / "pkg").mkdir(parents=True)
    docs = {}
    for f in range(n_files):
        docs[f"pkg/mod{f}.py"] = "".join(f"value_{f}_{i} = compute({f}, {i})  # line {i}\n" for i in range(n_lines))
    docs["train_only.py"] = "x = 1\n" * 30
    for rel, text in docs.items():
        (root / rel).write_text(text)
    entries = [
        {
            "path": rel,
            "sha256": hashlib.sha256(text.encode()).hexdigest(),
            "split": "train" if "train" in rel else "heldout",
        }
        for rel, text in sorted(docs.items())
    ]
    entries.append({"path": "pkg/changed.py", "sha256": "0" * 64, "split": "heldout"})  # another Python's text
    (root / "pkg" / "changed.py").write_text("print('not the manifest text')\n")
    manifest = tmp_path / "manifest.json"
    manifest.write_text(json.dumps({"documents": entries}))
    return manifest, root, docs


def test_heldout_documents_are_the_manifest_files_with_matching_hashes(tmp_path):
    manifest, root, docs = fake_corpus(tmp_path)
    got = heldout.heldout_documents(manifest, root)
    assert [d["path"] for d in got] == [f"pkg/mod{f}.py" for f in range(5)]
    assert all(d["text"] == docs[d["path"]] for d in got)


def test_next_line_questions(tmp_path):
    manifest, root, docs = fake_corpus(tmp_path)
    examples = heldout.next_line_examples(heldout.heldout_documents(manifest, root))
    assert examples == heldout.next_line_examples(heldout.heldout_documents(manifest, root))  # deterministic
    assert len(examples) == 5 * heldout.EXAMPLES_PER_FILE
    for ex in examples:
        lines = docs[ex["path"]].splitlines()
        assert ex["context"] == "\n".join(lines[ex["line"] - 20 : ex["line"]]) + "\n"
        assert len(ex["choices"]) == 4 and ex["choices"][ex["gold"]] == lines[ex["line"]]
        distractors = [c for i, c in enumerate(ex["choices"]) if i != ex["gold"]]
        sources = {p for d in distractors for p, text in docs.items() if d in text.splitlines()}
        assert ex["path"] not in sources and len(sources) == 3
    assert len({ex["gold"] for ex in examples}) == 4  # the answer's position varies


def test_tasks_run_through_lm_eval(tiny_checkpoint, tmp_path):
    manifest, root, docs = fake_corpus(tmp_path)
    lm = KimiHelixLM(pretrained=str(tiny_checkpoint), dtype="float32", device="cpu")
    results = lm_eval.simple_evaluate(
        model=lm,
        tasks=["kimi_helix_code_bpb", "kimi_helix_next_line"],
        task_manager=TaskManager(
            include_path=str(TASKS_DIR), metadata={"manifest": str(manifest), "stdlib": str(root)}
        ),
        limit=4,
    )["results"]
    assert 0 <= results["kimi_helix_next_line"]["acc,none"] <= 1
    # 4 documents' rolling log-likelihoods over their bytes, in bits.
    texts = [docs[f"pkg/mod{f}.py"] for f in range(4)]
    total = sum(lm.loglikelihood_rolling([_Req(t) for t in texts]))
    want = -total / sum(len(t.encode()) for t in texts) / math.log(2)
    assert results["kimi_helix_code_bpb"]["bits_per_byte,none"] == pytest.approx(want, rel=1e-6)


class _Req:
    def __init__(self, text):
        self.args = (text,)
