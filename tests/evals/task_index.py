"""lm-eval's index of its own ~14k task YAMLs, built once and reused. Every TaskManager (one per `simple_evaluate`
and per CLI run) parses that folder, 10-25 s on the CI's two cores, and it does not change within a test session:
the session's TaskManagers and the ranks the parallel tests launch (handed the index as a pickle) share one build.
The other folders (ours, a test's generated GPQA tasks) are indexed on every call as before, in the same order."""

from __future__ import annotations

from pathlib import Path

import lm_eval.tasks
from lm_eval.tasks._index import TaskIndex

OWN = Path(lm_eval.tasks.__file__).parent
BUILD = TaskIndex.build


def reusing(own_index: dict[bool, dict]) -> staticmethod:
    """A `TaskIndex.build` that takes lm-eval's own folder's entries from `own_index` (keyed by `resolve_includes`,
    filled on first use) instead of parsing it again."""

    def build(paths, *, resolve_includes=True):
        paths = [Path(p) for p in paths]
        if not paths or paths[0] != OWN:
            return BUILD(paths, resolve_includes=resolve_includes)
        if resolve_includes not in own_index:
            own_index[resolve_includes] = BUILD([OWN], resolve_includes=resolve_includes)
        # A later folder's entries replace the earlier ones of the same name, as in TaskIndex.build.
        return {**own_index[resolve_includes], **BUILD(paths[1:], resolve_includes=resolve_includes)}

    return staticmethod(build)
