"""The report's PNG plots (matplotlib, Agg backend, no display), one function per plot.
Each takes the runs to overlay and the output path, and returns the path, or None when no
run logged what the plot shows (routing agreement needs routes, mismatch rollout logprobs)."""

from __future__ import annotations

from pathlib import Path

import matplotlib
import matplotlib.patches

matplotlib.use("Agg")
from matplotlib.figure import Figure  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

from moe_async.report.runs import Run  # noqa: E402
from moe_async.report.stats import TIME_PARTS, eval_set_names, held_out, held_out_curve, staleness_hist  # noqa: E402
from moe_async.types import JsonDict  # noqa: E402

DPI = 110


def _save(fig: Figure, path: Path) -> Path:
    for ax in fig.axes:
        if ax.get_xlabel() in ("step", "versions behind the trainer"):
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    return path


def _label(run: Run, runs: list[Run]) -> str | None:
    return run.name if len(runs) > 1 else None


def reward_plot(runs: list[Run], path: Path) -> Path:
    """Reward and accuracy over steps: the trained batch's mean reward, the mean reward of
    the samples generated in the step (``rollout/reward_mean_generated_step``), the batch
    accuracy, and the held-out accuracy points (markers; with the held-out curve, greedy
    accuracy and mean@k at the training temperature, +- one standard error)."""
    fig = Figure(figsize=(11, 4))
    ax_r, ax_a = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
    for i, run in enumerate(runs):
        c = f"C{i}"
        name = f"{run.name}: " if len(runs) > 1 else ""
        ax_r.plot(*run.series("rollout/reward_mean"), color=c, marker=".", label=f"{name}trained batch")
        xs, ys = run.series("rollout/reward_mean_generated_step")
        if xs:
            ax_r.plot(xs, ys, color=c, ls="--", alpha=0.7, label=f"{name}generated in step")
        ax_a.plot(*run.series("rollout/accuracy"), color=c, marker=".", label=f"{name}trained batch")
        pts = held_out(run)
        if pts:
            se = {s: e for s, _, e in held_out_curve(run, "greedy_accuracy")}
            ax_a.errorbar([p[0] for p in pts], [p[1] for p in pts], yerr=[se.get(p[0], 0.0) for p in pts], color=c,
                          marker="D", ls=":", ms=7, capsize=3, label=f"{name}held-out (greedy)")
        mk = held_out_curve(run, "mean_at_k")
        if mk:
            ax_a.errorbar([p[0] for p in mk], [p[1] for p in mk], yerr=[p[2] for p in mk], color=c, marker="s",
                          ls="-.", ms=6, capsize=3, alpha=0.8, label=f"{name}held-out mean@k (sampled)")
    ax_r.set(title="reward", xlabel="step", ylabel="mean reward")
    ax_a.set(title="accuracy", xlabel="step", ylabel="fraction with reward >= 1", ylim=(-0.03, 1.03))
    for ax in (ax_r, ax_a):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    return _save(fig, path)


def staleness_plot(runs: list[Run], path: Path) -> Path:
    """Trained tokens per staleness (versions behind the trainer), as fractions, bars side
    by side per run."""
    fig = Figure(figsize=(6, 4))
    ax = fig.add_subplot(1, 1, 1)
    w = 0.8 / len(runs)
    for i, run in enumerate(runs):
        h = staleness_hist(run)
        tot = sum(h.values()) or 1.0
        ax.bar([s + (i - (len(runs) - 1) / 2) * w for s in h], [n / tot for n in h.values()], width=w,
               color=f"C{i}", label=_label(run, runs))
    ax.set(title="staleness of trained tokens", xlabel="versions behind the trainer", ylabel="fraction of tokens")
    ax.set_xticks(sorted({s for r in runs for s in staleness_hist(r)}))
    if len(runs) > 1:
        ax.legend(fontsize=8)
    ax.grid(alpha=0.3, axis="y")
    return _save(fig, path)


def time_breakdown_plot(runs: list[Run], path: Path) -> Path:
    """Per step, stacked seconds: the wait for the batch (filling, straggler), the
    train step, the weight sync, a checkpoint save, and the rest of ``perf/step_seconds``
    (driver bookkeeping); on top, a held-out curve evaluation made after the step
    (``eval/seconds``, outside ``perf/step_seconds``; step 0: the one before training). One
    panel per run."""
    fig = Figure(figsize=(11, 3.6 * len(runs)))
    for i, run in enumerate(runs):
        ax = fig.add_subplot(len(runs), 1, i + 1)
        recs = [i for i, r in enumerate(run.steps) if "perf/step_seconds" in r or "eval/seconds" in r]
        recs = recs or list(range(len(run.steps)))
        steps = [int(run.steps[i]["step"]) for i in recs]
        bottom = [0.0] * len(steps)

        def seconds(key: str) -> list[float]:
            return [run.value(i, key) or 0.0 for i in recs]
        for j, (label, key) in enumerate(TIME_PARTS):
            vals = seconds(key)
            if not any(vals):
                continue
            ax.bar(steps, vals, bottom=bottom, color=f"C{j}", label=label)
            bottom = [b + v for b, v in zip(bottom, vals)]
        other = [max(0.0, t - b) for t, b in zip(seconds("perf/step_seconds"), bottom)]
        ax.bar(steps, other, bottom=bottom, color="0.75", label="other")
        ev = seconds("eval/seconds")
        if any(ev):
            top = [b + o for b, o in zip(bottom, other)]
            ax.bar(steps, ev, bottom=top, color="C9", alpha=0.6, label="held-out eval")
        ax.set(title=f"time per step{': ' + run.name if len(runs) > 1 else ''}", xlabel="step", ylabel="seconds")
        ax.legend(fontsize=8, ncol=3)
        ax.grid(alpha=0.3, axis="y")
    return _save(fig, path)


def routing_plot(runs: list[Run], path: Path) -> Path | None:
    """Routing agreement per MoE layer over steps (``train/routing_agreement_l<j>``: share of
    (token, layer) pairs whose trainer top-k set equals the engine's), if logged."""
    if not any(r.keys("train/routing_agreement_l") for r in runs):
        return None
    fig = Figure(figsize=(7, 4))
    ax = fig.add_subplot(1, 1, 1)
    styles = ["-", "--", ":", "-."]
    for i, run in enumerate(runs):
        for j, key in enumerate(run.keys("train/routing_agreement_l")):
            name = (f"{run.name}: " if len(runs) > 1 else "") + f"layer {key.rsplit('_l', 1)[1]}"
            ax.plot(*run.series(key), color=f"C{j}", ls=styles[i % 4], marker=".", label=name)
    ax.set(title="routing agreement (trainer vs engine top-k)", xlabel="step", ylabel="agreement", ylim=(-0.03, 1.03))
    ax.legend(fontsize=7, ncol=2)
    ax.grid(alpha=0.3)
    return _save(fig, path)


def mismatch_plot(runs: list[Run], path: Path) -> Path | None:
    """Train/inference logprob mismatch over steps: mean |logp_train - logp_rollout| and the
    k3 KL estimate (``train/mismatch_*``), if logged."""
    keys = (("train/mismatch_logp_absdiff_mean", "mean |logp diff|"), ("train/mismatch_kl_k3", "KL (k3)"))
    if not any(r.series(k)[0] for r in runs for k, _ in keys):
        return None
    fig = Figure(figsize=(11, 4))
    for j, (key, title) in enumerate(keys):
        ax = fig.add_subplot(1, 2, j + 1)
        for i, run in enumerate(runs):
            ax.plot(*run.series(key), color=f"C{i}", marker=".", label=_label(run, runs))
        ax.set(title=title, xlabel="step", ylabel="nats")
        ax.grid(alpha=0.3)
        if len(runs) > 1:
            ax.legend(fontsize=8)
    return _save(fig, path)


def eval_sets_plot(runs: list[Run], path: Path) -> Path | None:
    """Each named eval set's held-out curve (``eval/<name>/mean_at_k`` and
    ``eval/<name>/greedy_accuracy``, +- one standard error), one panel per set, if logged."""
    names = sorted({n for run in runs for n in eval_set_names(run)})
    if not names:
        return None
    fig = Figure(figsize=(5.5 * len(names), 4))
    for j, set_name in enumerate(names):
        ax = fig.add_subplot(1, len(names), j + 1)
        ax.set(title=f"held-out: {set_name}", xlabel="step", ylabel="fraction with reward >= 1", ylim=(-0.03, 1.03))
        for i, run in enumerate(runs):
            name = f"{run.name}: " if len(runs) > 1 else ""
            for metric, marker, ls in (("mean_at_k", "s", "-."), ("greedy_accuracy", "D", ":")):
                pts = held_out_curve(run, f"{set_name}/{metric}")
                if pts:
                    ax.errorbar([p[0] for p in pts], [p[1] for p in pts], yerr=[p[2] for p in pts], color=f"C{i}",
                                marker=marker, ls=ls, ms=6, capsize=3, label=f"{name}{metric.replace('_', ' ')}")
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    return _save(fig, path)


def utilisation_plot(runs: list[Run], path: Path) -> Path:
    """Engine and trainer utilisation over steps: ``1 - perf/engine_idle_frac`` (an engine is
    busy while it has a request outstanding) and ``1 - perf/trainer_idle_frac`` (the trainer
    is idle while it waits for a batch), both running values over the loop so far."""
    fig = Figure(figsize=(7, 4))
    ax = fig.add_subplot(1, 1, 1)
    for i, run in enumerate(runs):
        name = f"{run.name}: " if len(runs) > 1 else ""
        for key, who, ls in (("perf/engine_idle_frac", "engines", "-"), ("perf/trainer_idle_frac", "trainer", "--")):
            xs, ys = run.series(key)
            ax.plot(xs, [1.0 - y for y in ys], color=f"C{i}", ls=ls, marker=".", label=f"{name}{who}")
    ax.set(title="utilisation (running, over the loop)", xlabel="step", ylabel="busy fraction", ylim=(-0.03, 1.03))
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    return _save(fig, path)


PLOTS = {"reward.png": reward_plot, "staleness.png": staleness_plot, "time_breakdown.png": time_breakdown_plot,
         "routing_agreement.png": routing_plot, "mismatch.png": mismatch_plot, "utilisation.png": utilisation_plot,
         "eval_sets.png": eval_sets_plot}


def timeline_plot(runs: list[Run], path: Path, max_steps: int = 3) -> Path | None:
    """The first run's ``trace.json`` drawn as a Gantt chart over its last ``max_steps`` steps:
    the trainer loop's phases (wait split into filling/straggler, train, sync) on one row,
    each engine's requests on rows of concurrent lanes, reward scoring below (None without
    a trace)."""
    import json

    tp = runs[0].path / "trace.json"
    if not tp.is_file():
        runs[0].notes.append(f"{tp}: missing; no timeline plot")
        return None
    try:
        ev = json.loads(tp.read_bytes())["traceEvents"]
        if not isinstance(ev, list) or not all(isinstance(e, dict) for e in ev):
            raise TypeError("traceEvents is not a list of events")
    except (ValueError, KeyError, TypeError) as e:  # UnicodeDecodeError is a ValueError
        runs[0].damaged.append(f"{tp}: not a Chrome trace ({type(e).__name__}: {e}); no timeline plot")
        return None
    try:
        return _draw_timeline(ev, path, max_steps)
    except (KeyError, TypeError, ValueError, AttributeError) as e:  # an event without the fields Timeline writes
        runs[0].damaged.append(f"{tp}: an event is not as moe-async writes it ({type(e).__name__}: {e}); "
                               "no timeline plot")
        return None


def _draw_timeline(ev: list[JsonDict], path: Path, max_steps: int) -> Path | None:
    """:func:`timeline_plot`'s drawing of the trace events ``ev`` (``KeyError`` / ``TypeError``
    on an event without the fields :mod:`moe_async.logging.timeline` writes)."""
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in ev if e.get("ph") == "M" and e["name"] == "thread_name"}
    xs = [e for e in ev if e.get("ph") == "X"]
    steps = sorted({e["args"]["step"] for e in xs if e.get("cat") == "phase" and "step" in e.get("args", {})})
    if not steps:
        return None
    keep = set(steps[-max_steps:])
    loop = [e for e in xs if e.get("cat") == "phase" and e.get("args", {}).get("step") in keep]
    t0 = min(e["ts"] for e in loop)
    t1 = max(e["ts"] + e["dur"] for e in loop)
    colors = {"wait": "0.85", "filling": "C0", "straggler": "C1", "train": "C2", "sync": "C3", "save": "C4",
              "generate": "C9", "reward": "C6"}
    bars: list[tuple[str, float, float, float, str]] = []  # row, start s, length s, height, colour
    for x in xs:
        if x["ts"] + x["dur"] < t0 or x["ts"] > t1:
            continue
        if x.get("cat") == "phase":
            if x.get("args", {}).get("step") not in keep:
                continue
            row, h = "trainer loop", (0.8 if x["name"] == "wait" else 0.5)
        else:
            row, h = threads.get((x["pid"], x["tid"]), str(x["tid"])), 0.7
        bars.append((row, (x["ts"] - t0) / 1e6, x["dur"] / 1e6, h, colors.get(x["name"], "0.5")))

    def order(row: str):
        lane = row.rsplit(" ", 1)[-1]
        return ({"trainer loop": 0}.get(row, 1 if row.startswith("engine") else 2), row.split(" · ")[0],
                int(lane) if lane.isdigit() else 0)
    rows = sorted({b[0] for b in bars}, key=order)
    fig = Figure(figsize=(11, 1.2 + 0.3 * len(rows)))
    ax = fig.add_subplot(1, 1, 1)
    for row, x0, w, h, c in bars:
        y = rows.index(row)
        ax.broken_barh([(x0, w)], (y - h / 2, h), color=c, edgecolor="white", linewidth=0.3)
    ax.set_yticks(range(len(rows)), rows, fontsize=7)
    ax.invert_yaxis()
    handles = [matplotlib.patches.Patch(color=c, label=n) for n, c in colors.items()]
    ax.legend(handles=handles, fontsize=7, ncol=8, loc="upper center", bbox_to_anchor=(0.5, -0.14))
    ax.set(title=f"timeline, steps {min(keep)}-{max(keep)} (trace.json)", xlabel="seconds")
    ax.grid(alpha=0.3, axis="x")
    return _save(fig, path)


PLOTS["timeline.png"] = timeline_plot
