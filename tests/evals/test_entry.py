"""`kimi-helix eval` without lm-eval installed says how to install it."""

import sys

from kimi_helix.cli import main


def test_eval_without_lm_eval_names_the_extra(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "lm_eval._cli", None)  # importing it now raises ImportError
    assert main(["eval", "--model", "kimi_helix", "--tasks", "kimi_helix_next_line"]) == 2
    assert "pip install kimi-helix[eval]" in capsys.readouterr().err


def test_eval_is_listed_in_the_help(capsys):
    assert main(["--help"]) == 0
    assert "eval" in capsys.readouterr().out
