"""`moe-async report` on a run directory with damaged files: each file named with what is
wrong, the report made from the rest, a non-zero exit, and never a traceback."""

import json
import os

from moe_async.cli import main
from moe_async.report import make_report

from tests.report.test_report import _write_run


def test_random_bytes_in_metrics_are_named_without_a_traceback(tmp_path, capsys):
    _write_run(tmp_path / "r", [0.2, 0.4])
    (tmp_path / "r" / "metrics.jsonl").write_bytes(os.urandom(512) + b"\xff\xfe")
    assert main(["report", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err
    assert "metrics.jsonl: not a metrics file (not UTF-8 text" in err and "Traceback" not in err


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
    (n,) = json.loads((tmp_path / "r" / "report" / "report.json").read_text())["runs"]
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
