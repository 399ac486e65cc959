"""`moe-async report` on run directories written here: every plot, numbers equal to the
records they come from, several runs overlaid, bad input named."""

import json

import pytest

from moe_async.cli import main
from moe_async.errors import UserInputError
from moe_async.report import fmt, make_report
from moe_async.report.stats import hist_quantile

PNG = b"\x89PNG\r\n\x1a\n"


def _write_run(d, rewards, routes=True):
    d.mkdir()
    recs = []
    for i, r in enumerate(rewards, 1):
        m = {"step": i, "rollout/reward_mean": r, "rollout/accuracy": r / 2, "rollout/reward_mean_generated_step": r - 0.1,
             "rollout/reward_mean_generated": 0.3, "buffer/staleness_hist/0": 30.0, "buffer/staleness_hist/1": 10.0 * i,
             "perf/wait_seconds": 1.5, "perf/wait_filling_seconds": 1.0, "perf/wait_straggler_seconds": 0.5,
             "train/step_time_s": 2.0 + i, "sync/seconds": 0.25, "perf/step_seconds": 4.0 + i,
             "perf/samples_per_s": 1.0 * i, "perf/tokens_per_s": 10.0 * i, "perf/trainer_idle_frac": 0.5 / i,
             "perf/engine_idle_frac": 0.1, "buffer/samples_dropped": float(i), "rollout/samples_filtered": 0.0,
             "train/mismatch_logp_absdiff_mean": 0.01 * i, "train/mismatch_kl_k3": 0.001 * i}
        if routes:
            m.update({"train/routing_agreement_l0": 0.9, "train/routing_agreement_l1": 0.8, "train/routing_agreement": 0.85})
        recs.append(m)
    (d / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in recs))
    (d / "summary.json").write_text(json.dumps({"eval_before": {"accuracy": 0.25}, "eval_after": {"accuracy": 0.5}}))
    return recs


def test_report_of_one_run(tmp_path):
    recs = _write_run(tmp_path / "run_a", [0.2, 0.4, 0.6])
    r = make_report([tmp_path / "run_a"])
    out = tmp_path / "run_a" / "report"
    assert r["out"] == out
    assert r["plots"] == ["reward.png", "staleness.png", "time_breakdown.png", "routing_agreement.png",
                          "mismatch.png", "utilisation.png"]
    for p in r["plots"]:
        assert (out / p).read_bytes()[:8] == PNG
    (n,) = json.loads((out / "report.json").read_text())["runs"]
    assert n["steps"] == 3 and n["reward_mean_last"] == recs[-1]["rollout/reward_mean"]
    assert n["reward_mean_avg"] == pytest.approx(0.4)
    assert n["accuracy_last"] == 0.3 and n["tokens_per_s"] == 30.0 and n["trainer_idle_frac"] == 0.5 / 3
    assert n["heldout_accuracy_before"] == 0.25 and n["heldout_accuracy_after"] == 0.5
    # staleness over every trained token: 90 tokens at 0, 60 at 1
    assert n["staleness_mean"] == pytest.approx(60 / 150)
    assert (n["staleness_p50"], n["staleness_p99"], n["staleness_max"]) == (0.0, 1.0, 1.0)
    assert n["wait_straggler_seconds_avg"] == 0.5 and n["step_time_s_avg"] == 4.0
    md = (out / "summary.md").read_text()
    assert f"| reward, last step (trained batch) | {fmt(0.6)} |" in md
    assert f"| trainer idle fraction | {fmt(0.5 / 3)} |" in md
    assert "![routing_agreement.png](routing_agreement.png)" in md


def test_several_runs_overlay_and_optional_plots(tmp_path):
    _write_run(tmp_path / "sync", [0.1, 0.2], routes=False)
    _write_run(tmp_path / "async", [0.3, 0.5, 0.7], routes=False)
    assert main(["report", str(tmp_path / "sync"), str(tmp_path / "async"), "--out", str(tmp_path / "cmp")]) == 0
    rep = json.loads((tmp_path / "cmp" / "report.json").read_text())
    assert [n["run"] for n in rep["runs"]] == ["sync", "async"]
    assert "routing_agreement.png" not in rep["plots"] and not (tmp_path / "cmp" / "routing_agreement.png").exists()
    assert "| | sync | async |" in (tmp_path / "cmp" / "summary.md").read_text()
    assert "timeline.png" not in rep["plots"]  # no trace.json in these runs


def test_timeline_plot_from_the_run_trace(tmp_path):
    from moe_async.logging.timeline import chrome_trace

    _write_run(tmp_path / "r", [0.1, 0.2])
    spans = [("trainer", "wait", 0.0, 1.0, {"step": 1}), ("trainer", "train", 1.0, 2.0, {"step": 1}),
             ("engine 0", "generate", 0.1, 1.5, None), ("reward", "reward", 1.5, 1.6, {"group": 0})]
    (tmp_path / "r" / "trace.json").write_text(json.dumps(chrome_trace(spans)))
    r = make_report([tmp_path / "r"])
    assert "timeline.png" in r["plots"] and (r["out"] / "timeline.png").read_bytes()[:8] == PNG


def test_quantiles():
    assert hist_quantile({0: 50, 1: 49, 3: 1}, 0.99) == 1.0
    assert hist_quantile({0: 50, 1: 48, 3: 2}, 0.99) == 3.0
    assert hist_quantile({}, 0.5) is None


def test_bad_input_is_named(tmp_path, capsys):
    with pytest.raises(UserInputError, match="no such directory"):
        make_report([tmp_path / "nope"])
    (tmp_path / "empty").mkdir()
    assert main(["report", str(tmp_path / "empty")]) == 2
    assert f"{tmp_path / 'empty'}: not a run directory of moe-async train (no metrics.jsonl)" in capsys.readouterr().err
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "metrics.jsonl").write_text('not json\n')
    with pytest.raises(UserInputError, match=r"metrics.jsonl: no metrics record can be read and no summary.json "
                                             r"\(.*metrics.jsonl:1: not a metrics record \(not JSON"):
        make_report([bad])
    _write_run(tmp_path / "ok", [0.1])
    (tmp_path / "afile").write_text("x")
    with pytest.raises(UserInputError, match="a file is in its place"):
        make_report([tmp_path / "ok"], tmp_path / "afile")
    with pytest.raises(UserInputError, match="afile: not a run directory \\(a file"):
        make_report([tmp_path / "afile"])


def test_half_written_last_record_is_left_out_and_named(tmp_path, capsys):
    """A run killed while writing metrics.jsonl: the complete records are reported, the torn
    last one is named on stderr; a torn line in the middle is damage (named, skipped)."""
    _write_run(tmp_path / "r", [0.1, 0.2])
    m = tmp_path / "r" / "metrics.jsonl"
    whole = m.read_text()
    m.write_text(whole + '{"step": 3, "train/lo')
    assert main(["report", str(tmp_path / "r")]) == 0
    err = capsys.readouterr().err
    assert "metrics.jsonl:3: half-written last record left out" in err
    r = make_report([tmp_path / "r"])
    assert len([n for n in r["notes"] if "metrics.jsonl" in n]) == 1
    m.write_text(whole + '{"step": 3, "train/lo\n')
    assert main(["report", str(tmp_path / "r")]) == 1
    assert "metrics.jsonl:3: not a metrics record (not JSON" in capsys.readouterr().err


def test_held_out_curve_points_and_numbers(tmp_path):
    """With rollout.eval_interval the run logs a step-0 record (the curve's first point) and
    eval/* on the last step: held-out points come from the curve, not counted as a step."""
    from moe_async.report.runs import load_run
    from moe_async.report.stats import held_out, held_out_curve

    recs = _write_run(tmp_path / "c", [0.2, 0.4])
    first = {"step": 0, "eval/greedy_accuracy": 0.5, "eval/greedy_accuracy_se": 0.1, "eval/mean_at_k": 0.4,
             "eval/mean_at_k_se": 0.05, "eval/mean_at_k_gain": 0.0, "eval/mean_at_k_gain_se": 0.0, "eval/seconds": 30.0}
    recs[-1].update({"eval/greedy_accuracy": 0.75, "eval/greedy_accuracy_se": 0.1, "eval/mean_at_k": 0.6,
                     "eval/mean_at_k_se": 0.05, "eval/mean_at_k_gain": 0.2, "eval/mean_at_k_gain_se": 0.04,
                     "eval/seconds": 31.0})
    (tmp_path / "c" / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in [first, *recs]))
    run = load_run(tmp_path / "c")
    assert held_out(run) == [(0, 0.5), (2, 0.75)]
    assert held_out_curve(run, "mean_at_k") == [(0, 0.4, 0.05), (2, 0.6, 0.05)]
    r = make_report([tmp_path / "c"])
    (n,) = json.loads((r["out"] / "report.json").read_text())["runs"]
    assert n["steps"] == 2  # the step-0 evaluation is not a trained step
    assert (n["heldout_mean_at_k_first"], n["heldout_mean_at_k_last"]) == (0.4, 0.6)
    assert (n["heldout_mean_at_k_gain"], n["heldout_mean_at_k_gain_se"]) == (0.2, 0.04)
    assert "| held-out mean@k gain (paired) | 0.2 |" in (r["out"] / "summary.md").read_text()
    for p in ("reward.png", "time_breakdown.png"):
        assert (r["out"] / p).read_bytes()[:8] == PNG


def test_named_eval_sets_each_get_their_rows(tmp_path):
    """data.eval sets (eval/<name>/... records): first/last points and the paired gain per set."""
    recs = _write_run(tmp_path / "run_s", [0.2, 0.4])
    recs[0].update({"eval/gsm/mean_at_k": 0.25, "eval/gsm/greedy_accuracy": 0.5, "eval/gsm/pass_at_k": 0.5,
                    "eval/math/mean_at_k": 0.1, "eval/math/greedy_accuracy": 0.0, "eval/math/pass_at_k": 0.2})
    recs[1].update({"eval/gsm/mean_at_k": 0.5, "eval/gsm/greedy_accuracy": 0.75, "eval/gsm/pass_at_k": 1.0,
                    "eval/gsm/mean_at_k_gain": 0.25, "eval/gsm/mean_at_k_gain_se": 0.05,
                    "eval/math/mean_at_k": 0.3, "eval/math/greedy_accuracy": 0.1, "eval/math/pass_at_k": 0.4})
    (tmp_path / "run_s" / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in recs))
    n = make_report([tmp_path / "run_s"])["numbers"][0]
    assert (n["eval_set/gsm/mean_at_k_first"], n["eval_set/gsm/mean_at_k_last"]) == (0.25, 0.5)
    assert (n["eval_set/gsm/mean_at_k_gain_last"], n["eval_set/math/pass_at_k_last"]) == (0.25, 0.4)
    assert n["eval_set/math/mean_at_k_gain_last"] is None
    md = (tmp_path / "run_s" / "report" / "summary.md").read_text()
    assert "| held-out gsm: mean at k, last point | 0.5 |" in md
    assert "| held-out math: greedy accuracy, first point | 0 |" in md
    assert "eval_sets.png" in make_report([tmp_path / "run_s"])["plots"]


def test_named_eval_sets_plot_draws_each_sets_points(tmp_path):
    """eval_sets.png: one panel per named set, each drawing that set's own mean@k and greedy
    points with their standard errors (not the unnamed held-out curve's)."""
    from moe_async.report.plots import eval_sets_plot
    from moe_async.report.runs import load_run

    recs = _write_run(tmp_path / "run_p", [0.2, 0.4])
    recs[0].update({"eval/mean_at_k": 0.9, "eval/a/mean_at_k": 0.25, "eval/a/mean_at_k_se": 0.05,
                    "eval/a/greedy_accuracy": 0.5, "eval/b/mean_at_k": 0.1})
    recs[1].update({"eval/a/mean_at_k": 0.5, "eval/a/mean_at_k_se": 0.1, "eval/b/mean_at_k": 0.3})
    (tmp_path / "run_p" / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in recs))
    run = load_run(tmp_path / "run_p")
    drawn = {}
    import matplotlib.axes
    orig = matplotlib.axes.Axes.errorbar

    def spy(self, x, y, yerr=None, **kw):
        drawn[(self.get_title(), kw["label"])] = (list(x), list(y), list(yerr))
        return orig(self, x, y, yerr=yerr, **kw)

    matplotlib.axes.Axes.errorbar = spy
    try:
        out = eval_sets_plot([run], tmp_path / "sets.png")
    finally:
        matplotlib.axes.Axes.errorbar = orig
    assert out.read_bytes()[:8] == PNG
    assert drawn == {("held-out: a", "mean at k"): ([1, 2], [0.25, 0.5], [0.05, 0.1]),
                     ("held-out: a", "greedy accuracy"): ([1], [0.5], [0.0]),
                     ("held-out: b", "mean at k"): ([1, 2], [0.1, 0.3], [0.0, 0.0])}
    recs_plain = _write_run(tmp_path / "run_q", [0.2])
    assert recs_plain and eval_sets_plot([load_run(tmp_path / "run_q")], tmp_path / "none.png") is None


def test_named_eval_set_points_with_bad_values_are_skipped_not_a_traceback(tmp_path):
    """A null or negative standard error draws the point with no error bar; a NaN, inf or
    non-number value is not drawn (these used to raise TypeError / ValueError mid-report)."""
    from moe_async.report.runs import load_run
    from moe_async.report.stats import held_out_curve

    recs = _write_run(tmp_path / "run_b", [0.2, 0.4, 0.6, 0.8])
    recs[0].update({"eval/a/mean_at_k": 0.25, "eval/a/mean_at_k_se": None})
    recs[1].update({"eval/a/mean_at_k": 0.5, "eval/a/mean_at_k_se": -1.0})
    recs[2].update({"eval/a/mean_at_k": float("nan")})
    recs[3].update({"eval/a/mean_at_k": True, "eval/a/greedy_accuracy": 0.5})
    (tmp_path / "run_b" / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in recs))
    assert held_out_curve(load_run(tmp_path / "run_b"), "a/mean_at_k") == [(1, 0.25, 0.0), (2, 0.5, 0.0)]
    r = make_report([tmp_path / "run_b"])
    assert "eval_sets.png" in r["plots"]
