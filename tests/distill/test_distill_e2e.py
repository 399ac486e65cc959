"""`moe-async train configs/cpu_smoke.yaml` with a distillation teacher, end to end: the teacher
is the student's starting checkpoint in its own embedded engine, shown one worked example the
student does not see; every sampled token is scored, the per-token reverse-KL advantage trains
the student through the async buffer, and the teacher's metrics and spans are recorded."""

import json

import pytest
from _launch import finished_train


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return finished_train(tmp_path_factory.mktemp("runs"), "num_steps=3", "teacher.enabled=true", "teacher.few_shot=1",
                         "rollout.eval_interval=3")


def test_every_generated_token_is_scored_by_the_teacher(run):
    proc, run_dir, summary, steps = run
    ro = summary["rollout"]
    assert "[moe-async] teacher: http://" in proc.stdout
    assert ro["teacher/failures"] == 0 and ro["teacher/requests"] > 0
    # every sample is scored (groups cut off at the stop may have been scored, not counted as generated)
    assert ro["teacher/tokens"] >= ro["rollout/tokens_generated"] > 0
    assert summary["buffer"]["samples_trained"] == 3 * 2 * 4
    for m in (m for m in steps if m["step"] > 0):
        assert m["teacher/batch_failed_samples"] == 0.0
        assert m["teacher/batch_tokens"] == m["train/response_tokens"]  # every trained token has the teacher's logprob
        assert m["teacher/batch_kl_per_token"] != 0.0  # the teacher's prompt differs: so do its logprobs
        assert 0 <= m["buffer/staleness_min"] and m["buffer/staleness_max"] <= 1  # the staleness bound holds
    assert "teacher/kl_per_token" in steps[-1] and steps[-1]["teacher/seconds"] > 0


def test_student_trained_and_synced(run):
    _, _, summary, _ = run
    assert summary["final_weights_match"] is True and summary["engine_weight_versions"] == [3]


def test_teacher_held_out_evaluation_before_the_curve(run):
    """The teacher (its one-shot prompt, its engine) answers the held-out problems once, at step 0."""
    proc, _, summary, steps = run
    t = summary["eval_teacher"]
    assert t["eval/n"] + t["eval/n_skipped"] == 8 and t["eval/k"] == 4 and 0.0 <= t["eval/mean_at_k"] <= 1.0
    step0 = [m for m in steps if m["step"] == 0]
    assert len(step0) == 1 and step0[0]["eval_teacher/mean_at_k"] == t["eval/mean_at_k"]
    assert [p["step"] for p in summary["eval_curve"]] == [0, 3]
    assert proc.stdout.count("teacher held-out (its prompt, its engines)") == 1


def test_trace_has_teacher_spans(run):
    _, run_dir, _, _ = run
    events = json.loads((run_dir / "trace.json").read_text())["traceEvents"]
    scores = [e for e in events if e.get("ph") == "X" and e.get("cat") == "score"]
    names = {e["args"]["name"] for e in events if e.get("name") == "thread_name"}
    assert scores and any(n.startswith("teacher 0") for n in names)
