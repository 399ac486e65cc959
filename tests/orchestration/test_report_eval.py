"""The held-out accuracy line: its numbers, and no accuracy stated when there were no problems."""

from moe_async.orchestration.lifecycle import report_eval


def test_line_states_accuracy_reward_and_n(capsys):
    s = {}
    report_eval(s, "eval_before", "before", {"accuracy": 0.25, "reward_mean": 0.5, "n": 8})
    assert s["eval_before"]["n"] == 8
    assert capsys.readouterr().out == ("[moe-async] held-out accuracy before: 0.250 (configured reward >= 1; "
                                       "mean reward 0.500; n=8)\n")


def test_no_problems_is_not_reported_as_zero_accuracy(capsys):
    """Prompt files with no data.eval set: n=0 used to print 'held-out accuracy before: 0.000'."""
    s = {}
    report_eval(s, "eval_before", "before", {"accuracy": 0.0, "reward_mean": 0.0, "n": 0})
    out = capsys.readouterr().out
    assert "0.000" not in out and "no held-out problems (n=0" in out
    assert s["eval_before"]["n"] == 0  # kept in summary.json as measured
