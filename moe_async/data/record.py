"""``trained_rows.jsonl`` in the run dir: which file row each trained GRPO group came from.

One JSON line per trained group, written by the driver right after the step trained it:
``{"step": N, "draw": draw number, "row": train row index (over all train files),
"file": the data.train entry (file or folder) holding it, "file_row": the row within that entry,
"data_source": str | null, "prompt_ids": [token ids the engines received]}``. A resumed run writes its own file; the rows
of a run are the lines of its steps (after a kill, only steps up to the checkpoint it resumed
from count: later ones were lost with the process).
"""

from __future__ import annotations

import json
from pathlib import Path

from moe_async.types import Group


def record_trained(run_dir: str | Path, step: int, groups: list[Group]) -> None:
    """Append one line per group of ``groups`` (trained at ``step``) to ``trained_rows.jsonl``."""
    with open(Path(run_dir) / "trained_rows.jsonl", "a", encoding="utf-8") as fh:
        for g in groups:
            s = g.samples[0]
            fh.write(json.dumps({"step": int(step), "draw": s.metadata.get("draw_seq"),
                                 "row": s.metadata.get("problem_index"), "file": s.metadata.get("file"),
                                 "file_row": s.metadata.get("file_row"), "data_source": s.metadata.get("data_source"),
                                 "prompt_ids": [int(t) for t in s.prompt_ids]}) + "\n")
