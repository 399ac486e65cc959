"""``moe-async report RUN_DIR [RUN_DIR ...] [--out DIR]``: plots and a summary of runs, from
their own files (metrics.jsonl, summary.json), with no network.

Writes into ``--out`` (default ``<first run dir>/report``): the PNGs of
:data:`moe_async.report.plots.PLOTS` (routing agreement, mismatch and the named eval sets only when a run logged
them; several runs overlay their curves), ``summary.md`` (a table, one column per run, and
the list of plots) and ``report.json`` (the same numbers, unrounded:
:func:`moe_async.report.stats.run_numbers`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence, TypedDict

from moe_async.errors import UserInputError
from moe_async.report.runs import Run, load_run
from moe_async.report.stats import RunNumbers, run_numbers

# (key in run_numbers, row label) of the markdown table
ROWS = (
    ("steps", "steps logged"), ("reward_mean_last", "reward, last step (trained batch)"),
    ("reward_mean_avg", "reward, mean over steps"), ("accuracy_last", "accuracy, last step"),
    ("accuracy_avg", "accuracy, mean over steps"), ("reward_mean_generated", "reward per generated sample (run)"),
    ("heldout_accuracy_before", "held-out accuracy before"), ("heldout_accuracy_after", "held-out accuracy after"),
    ("heldout_mean_at_k_first", "held-out mean@k, first point"), ("heldout_mean_at_k_last", "held-out mean@k, last point"),
    ("heldout_mean_at_k_gain", "held-out mean@k gain (paired)"), ("heldout_mean_at_k_gain_se", "held-out mean@k gain se"),
    ("staleness_mean", "staleness mean (tokens)"), ("staleness_p50", "staleness p50"),
    ("staleness_p99", "staleness p99"), ("staleness_max", "staleness max"),
    ("samples_per_s", "samples/s (trained, loop)"), ("tokens_per_s", "tokens/s (trained, loop)"),
    ("trainer_idle_frac", "trainer idle fraction"), ("engine_idle_frac", "engine idle fraction"),
    ("step_seconds_avg", "step s, mean"), ("wait_seconds_avg", "wait s, mean"),
    ("wait_filling_seconds_avg", "wait: filling s, mean"), ("wait_straggler_seconds_avg", "wait: straggler s, mean"),
    ("step_time_s_avg", "train s, mean"), ("seconds_avg", "sync s, mean"),
    ("samples_dropped", "samples dropped (stale)"), ("samples_filtered", "samples filtered (equal rewards)"),
)


def fmt(v: object) -> str:
    """A table cell: integers as such, floats to 4 significant digits, ``-`` for None."""
    if v is None:
        return "-"
    if isinstance(v, bool) or isinstance(v, int) or (isinstance(v, float) and v.is_integer() and abs(v) < 1e6):
        return str(int(v))
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def summary_markdown(numbers: list[RunNumbers], plots: list[str]) -> str:
    head = "| | " + " | ".join(str(n["run"]) for n in numbers) + " |"
    lines = ["# moe-async report", "", head, "|---" * (len(numbers) + 1) + "|"]
    for key, label in ROWS:
        lines.append(f"| {label} | " + " | ".join(fmt(n.get(key)) for n in numbers) + " |")
    for key in sorted({k for n in numbers for k in n if k.startswith("eval_set/")}):  # named eval sets
        _, name, metric = key.split("/")
        label = f"held-out {name}: {metric.rsplit('_', 1)[0].replace('_', ' ')}, {metric.rsplit('_', 1)[1]} point"
        lines.append(f"| {label} | " + " | ".join(fmt(n.get(key)) for n in numbers) + " |")
    lines += ["", "Sources: last-step values and means over steps from metrics.jsonl; staleness over every "
              "trained token (buffer/staleness_hist); held-out accuracy from summary.json.", "", "## Plots", ""]
    lines += [f"![{p}]({p})" for p in plots]
    return "\n".join(lines) + "\n"


class Report(TypedDict):
    """What :func:`make_report` wrote: the folder, the plot file names, each run's summary row,
    and the notes and damaged files of the runs (one sentence each)."""

    out: Path
    plots: list[str]
    numbers: list[RunNumbers]
    notes: list[str]
    damaged: list[str]


def make_report(run_dirs: Sequence[str | Path], out: str | Path | None = None) -> Report:
    """Write the report of ``run_dirs`` into ``out``; returns ``{"out", "plots", "numbers",
    "notes", "damaged"}`` (``notes``: what :func:`load_run` left out, e.g. a half-written last
    record; ``damaged``: files that could not be read, each named, the report made without them).

    Raises:
        UserInputError: naming a run dir that is not one (see :func:`load_run`), or an
            ``out`` that is a file.
    """
    from moe_async.report.plots import PLOTS

    if not run_dirs:
        raise UserInputError("report: give at least one run directory")
    runs: list[Run] = [load_run(d) for d in run_dirs]
    out_dir = Path(out) if out is not None else runs[0].path / "report"
    if out_dir.exists() and not out_dir.is_dir():
        raise UserInputError(f"--out {out}: a file is in its place")
    out_dir.mkdir(parents=True, exist_ok=True)
    plots = []
    stepped = [r for r in runs if r.steps]  # a run whose metrics.jsonl is unreadable has no curve
    for name, fn in PLOTS.items():
        drawn = runs if name == "timeline.png" else stepped
        if drawn and fn(drawn, out_dir / name) is not None:
            plots.append(name)
    numbers = [run_numbers(r) for r in runs]
    (out_dir / "report.json").write_text(json.dumps({"runs": numbers, "plots": plots}, indent=2))
    (out_dir / "summary.md").write_text(summary_markdown(numbers, plots))
    return {"out": out_dir, "plots": plots, "numbers": numbers, "notes": [n for r in runs for n in r.notes],
            "damaged": [d for r in runs for d in r.damaged]}
