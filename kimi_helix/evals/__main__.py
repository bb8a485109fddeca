"""`python -m kimi_helix.evals ...` (and `kimi-helix eval ...`): lm-eval's own CLI with the `kimi_helix` model
registered and the package's tasks on the include path.

Every lm-eval flag passes through unchanged (`--model kimi_helix --model_args pretrained=DIR,... --tasks ...
--num_fewshot --limit --output_path --log_samples --include_path ...`). One flag is ours:

    --gpqa-data FILE   run the stock gpqa_* tasks from a local CSV/JSONL instead of the gated Hub dataset

Under `torchrun --nproc-per-node N -m kimi_helix.evals ...` the requests are split over the N processes.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from . import INSTALL_HINT, TASKS_DIR

GPQA_FLAG = "--gpqa-data"


def main(argv: list[str] | None = None) -> int:
    """Run lm-eval's CLI on `argv` (default `sys.argv[1:]`); return the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        gpqa_data, argv = _pop_option(argv, GPQA_FLAG)
    except ValueError as err:
        return _fail(str(err))
    try:
        from lm_eval._cli import HarnessCLI
        from lm_eval.utils import setup_logging
    except ImportError:
        return _fail(INSTALL_HINT)
    from . import gpqa
    from .lm_eval_model import KimiHelixLM  # noqa: F401  (importing it registers the `kimi_helix` model)

    if {"-h", "--help"} & set(argv):
        print(
            f"kimi-helix eval: lm-eval's CLI with the kimi_helix model; also {GPQA_FLAG} FILE (GPQA from a CSV/JSONL)\n"
        )
    setup_logging()
    cli = HarnessCLI()
    saved, sys.argv = sys.argv, ["lm-eval", *argv]  # HarnessCLI reads sys.argv
    try:
        args = cli.parse_args()
    finally:
        sys.argv = saved
    wants_gpqa = gpqa.requests_gpqa(getattr(args, "tasks", None))
    if wants_gpqa and gpqa_data is None and gpqa.offline():
        return _fail(gpqa.OFFLINE_HINT)
    with tempfile.TemporaryDirectory(prefix="kimi_helix_gpqa_") as generated:
        include = [TASKS_DIR]
        if gpqa_data is not None:
            try:
                gpqa.write_local_gpqa_tasks(gpqa_data, generated)
            except gpqa.GPQADataError as err:
                return _fail(str(err))
            include.append(Path(generated))  # after lm-eval's own tasks, so the local GPQA tasks replace them
        if hasattr(args, "include_path"):
            # lm-eval's TaskManager takes a list; the user's folder comes last and wins on a name clash.
            args.include_path = [str(p) for p in include] + ([args.include_path] if args.include_path else [])
        try:
            cli.execute(args)
        except Exception as err:
            if wants_gpqa and gpqa_data is None and _hub_unreachable(err):
                return _fail(f"{gpqa.OFFLINE_HINT} ({type(err).__name__}: {err})")
            raise
    return 0


def _pop_option(argv: list[str], flag: str) -> tuple[str | None, list[str]]:
    """Remove `flag VALUE` or `flag=VALUE` from `argv`; return (VALUE or None, the rest)."""
    value, rest, i = None, [], 0
    while i < len(argv):
        arg = argv[i]
        if arg == flag:
            if i + 1 >= len(argv):
                raise ValueError(f"{flag} needs a FILE")
            value, i = argv[i + 1], i + 2
            continue
        if arg.startswith(flag + "="):
            value = arg.split("=", 1)[1]
        else:
            rest.append(arg)
        i += 1
    return value, rest


def _hub_unreachable(err: BaseException) -> bool:
    """Whether `err` (or what caused it) is the Hub refusing or failing to hand over the GPQA dataset."""
    from .gpqa import GATED_DATASET

    seen = err
    while seen is not None:
        if isinstance(seen, OSError) and (GATED_DATASET in str(seen) or "offline" in str(seen).lower()):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def _fail(message: str) -> int:
    print(f"kimi-helix eval: error: {message}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
