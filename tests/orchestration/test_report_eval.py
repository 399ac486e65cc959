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


def test_resumed_run_keeps_the_first_runs_step0_point_as_eval_before(tmp_path):
    """trainer.resume=auto keeps the run dir's metrics up to the checkpoint: its step-0 held-out
    record is eval_before (a resumed run evaluates again at the resumed step, which used to
    replace it); named eval sets are merged weighted by their n; no step 0: None."""
    import json

    from moe_async.orchestration.lifecycle import first_run_eval_before

    assert first_run_eval_before(tmp_path) is None  # no metrics.jsonl (trainer.load into a new run dir)
    f = tmp_path / "metrics.jsonl"
    f.write_text("\n".join(json.dumps(r) for r in [
        {"step": 0, "eval/greedy_accuracy": 0.25, "eval/greedy_reward": 0.5, "eval/n": 8.0, "eval/n_skipped": 1.0},
        {"step": 1, "rollout/reward_mean": 0.1},
        {"step": 2, "eval/greedy_accuracy": 0.75, "eval/greedy_reward": 0.9, "eval/n": 8.0}]) + "\nnot json\n")
    assert first_run_eval_before(tmp_path) == {"accuracy": 0.25, "reward_mean": 0.5, "n": 8.0, "n_skipped": 1.0,
                                               "step": 0, "from": "metrics.jsonl step 0 (the run before the resume)"}
    f.write_text(json.dumps({"step": 0, "eval/a/greedy_accuracy": 1.0, "eval/a/greedy_reward": 1.0, "eval/a/n": 1.0,
                             "eval/b/greedy_accuracy": 0.0, "eval/b/greedy_reward": 0.5, "eval/b/n": 3.0}) + "\n")
    ev = first_run_eval_before(tmp_path)
    assert (ev["accuracy"], ev["reward_mean"], ev["n"]) == (0.25, 0.625, 4.0)
    f.write_text(json.dumps({"step": 0, "rollout/reward_mean": 0.0}) + "\n")  # no held-out record at step 0
    assert first_run_eval_before(tmp_path) is None
