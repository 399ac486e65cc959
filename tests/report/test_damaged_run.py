"""`moe-async report` on a run directory with damaged files: each file (and line) named with
what is wrong, bad lines skipped with a count, the report made from the rest, exit 1 (2 only
when nothing of the run can be read), and never a traceback."""

import json
import os

from moe_async.cli import main
from moe_async.logging.timeline import chrome_trace
from moe_async.report import make_report
from moe_async.report.runs import NAMED_LINES

from tests.report.test_report import _write_run


def _numbers(run_dir):
    (n,) = json.loads((run_dir / "report" / "report.json").read_text())["runs"]
    return n


def test_random_bytes_in_metrics_are_named_and_the_summary_is_still_reported(tmp_path, capsys):
    _write_run(tmp_path / "r", [0.2, 0.4])
    (tmp_path / "r" / "metrics.jsonl").write_bytes(b"\xff\xfe" + os.urandom(512) + b"\n")
    assert main(["report", str(tmp_path / "r")]) == 1
    err = capsys.readouterr().err
    assert "metrics.jsonl:1: not a metrics record (not UTF-8 text" in err and "Traceback" not in err
    assert "metrics.jsonl: no metrics record can be read; reported from summary.json only" in err
    n = _numbers(tmp_path / "r")
    assert n["steps"] == 0 and n["last_step"] is None and n["reward_mean_last"] is None
    assert (n["heldout_accuracy_before"], n["heldout_accuracy_after"]) == (0.25, 0.5)


def test_random_bytes_and_no_summary_is_refused_naming_the_damage(tmp_path, capsys):
    _write_run(tmp_path / "r", [0.2])
    (tmp_path / "r" / "summary.json").unlink()
    (tmp_path / "r" / "metrics.jsonl").write_bytes(b"\xff\xfe" + os.urandom(64) + b"\n")
    assert main(["report", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err
    assert "no metrics record can be read and no summary.json" in err and "not UTF-8 text" in err
    assert "Traceback" not in err


def test_records_of_the_wrong_shape_are_skipped_and_named_by_line(tmp_path, capsys):
    recs = _write_run(tmp_path / "r", [0.2, 0.4, 0.6])
    lines = [json.dumps(r) for r in recs]
    lines[1:1] = ["[1]", '{"step": "two"}', '{"no_step": 1}', "{bad json"]
    (tmp_path / "r" / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    assert main(["report", str(tmp_path / "r")]) == 1
    err = capsys.readouterr().err
    assert "metrics.jsonl:2: not a metrics record (a JSON list, not an object)" in err
    assert 'metrics.jsonl:3: not a metrics record (step is "two", not an integer)' in err
    assert "metrics.jsonl:4: not a metrics record (no step)" in err
    assert "metrics.jsonl:5: not a metrics record (not JSON" in err
    assert "4 line(s) not metrics records, skipped; 3 records read" in err
    assert "TypeError" not in err and "Traceback" not in err
    n = _numbers(tmp_path / "r")
    assert n["steps"] == 3 and n["reward_mean_last"] == 0.6


def test_many_bad_lines_are_counted_past_the_named_ones(tmp_path):
    recs = _write_run(tmp_path / "r", [0.2])
    (tmp_path / "r" / "metrics.jsonl").write_text(json.dumps(recs[0]) + "\n" + "[1]\n" * (NAMED_LINES + 3))
    r = make_report([tmp_path / "r"])
    assert len(r["damaged"]) == NAMED_LINES + 1
    assert f"{NAMED_LINES + 3} lines in all not metrics records, skipped (3 more after" in r["damaged"][-1]
    assert r["numbers"][0]["steps"] == 1


def test_a_metric_value_that_is_not_a_number_is_named_and_left_out(tmp_path, capsys):
    recs = _write_run(tmp_path / "r", [0.2, 0.4, 0.6])
    recs[1]["rollout/reward_mean"] = "high"
    recs[2]["buffer/staleness_hist/1"] = [3]
    recs[2]["perf/wait_filling_seconds"] = True
    (tmp_path / "r" / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in recs))
    assert main(["report", str(tmp_path / "r")]) == 1
    err = capsys.readouterr().err
    assert 'metrics.jsonl:2: rollout/reward_mean is "high" (a JSON string), not a number; left out' in err
    assert "metrics.jsonl:3: buffer/staleness_hist/1 is [3] (a JSON list), not a number" in err
    assert "metrics.jsonl:3: perf/wait_filling_seconds is true (a JSON bool), not a number" in err
    assert err.count('rollout/reward_mean is "high"') == 1 and "Traceback" not in err
    n = _numbers(tmp_path / "r")
    assert n["reward_mean_avg"] == (0.2 + 0.6) / 2 and n["reward_mean_last"] == 0.6
    # staleness: 30 tokens at 0 per step, 10 and 20 at 1 (the list of step 3 left out)
    assert n["staleness_mean"] == 30 / 120


def test_a_summary_value_that_is_not_a_number_is_named(tmp_path, capsys):
    _write_run(tmp_path / "r", [0.2])
    (tmp_path / "r" / "summary.json").write_text(json.dumps({"eval_before": {"accuracy": "n/a"},
                                                             "eval_after": [0.5]}))
    assert main(["report", str(tmp_path / "r")]) == 1
    err = capsys.readouterr().err
    assert 'summary.json: eval_before.accuracy is "n/a", not a number; left out' in err and "Traceback" not in err
    assert _numbers(tmp_path / "r")["heldout_accuracy_before"] is None


def test_missing_summary_and_trace_are_noted_with_exit_zero(tmp_path, capsys):
    _write_run(tmp_path / "r", [0.2, 0.4])
    (tmp_path / "r" / "summary.json").unlink()
    assert main(["report", str(tmp_path / "r")]) == 0
    err = capsys.readouterr().err
    assert "summary.json: missing (the run did not finish)" in err and "trace.json: missing; no timeline plot" in err


def test_cut_summary_and_empty_trace_are_named_and_the_rest_is_reported(tmp_path, capsys):
    _write_run(tmp_path / "r", [0.2, 0.4, 0.6])
    s = (tmp_path / "r" / "summary.json").read_text()
    (tmp_path / "r" / "summary.json").write_text(s[: len(s) // 2])
    (tmp_path / "r" / "trace.json").write_text("")
    assert main(["report", str(tmp_path / "r")]) == 1
    err = capsys.readouterr().err
    assert "summary.json: not JSON (" in err and "trace.json: not a Chrome trace (" in err
    assert "Traceback" not in err
    # what metrics.jsonl holds is still reported: the plots and the numbers of every step
    n = _numbers(tmp_path / "r")
    assert n["steps"] == 3 and n["reward_mean_last"] == 0.6
    assert n["heldout_accuracy_before"] is None  # it was in the cut summary.json only


def test_json_of_the_wrong_shape_is_named(tmp_path):
    _write_run(tmp_path / "r", [0.2, 0.4])
    (tmp_path / "r" / "summary.json").write_text("[1, 2]")
    (tmp_path / "r" / "trace.json").write_text("[1, 2]")
    r = make_report([tmp_path / "r"])
    assert len(r["damaged"]) == 2
    assert "a JSON list, not an object" in r["damaged"][0] and "not a Chrome trace" in r["damaged"][1]
    assert "reward.png" in r["plots"]


def test_trace_events_without_their_fields_are_named(tmp_path, capsys):
    _write_run(tmp_path / "r", [0.2])
    trace = chrome_trace([("trainer", "train", 0.0, 1.0, {"step": 1})])
    for e in trace["traceEvents"]:
        e.pop("ts", None)
    (tmp_path / "r" / "trace.json").write_text(json.dumps(trace))
    assert main(["report", str(tmp_path / "r")]) == 1
    err = capsys.readouterr().err
    assert "trace.json: an event is not as moe-async writes it (KeyError: 'ts')" in err and "Traceback" not in err
