"""The pieces of C22 for a SIGTERM that reaches one trainer rank (moe_async/orchestration/preemption.py):
a rank's armed handler only records the first SIGTERM and passes the second to the handler it
replaced; the driver's StopCheck prefers its own flag, names the ranks, and keeps its answer;
the test-only checkpoint stall hook refuses a malformed value."""

from __future__ import annotations

import os
from pathlib import Path
import subprocess
import sys
import textwrap

import pytest

from moe_async.orchestration.preemption import (CKPT_STALL_ENV, CKPT_WAIT_BUFFERED_ENV, StopCheck, stall_if_due,
                                                wait_buffered_if_asked)


def test_rank_handler_flags_first_sigterm_and_passes_the_second_on() -> None:
    script = textwrap.dedent("""
        import os, signal, time
        from moe_async.orchestration.preemption import arm_rank_sigterm, rank_stop_signal

        signal.signal(signal.SIGTERM, lambda s, f: print("previous handler", s, flush=True))
        assert arm_rank_sigterm(1) and arm_rank_sigterm(1)  # idempotent
        assert rank_stop_signal() is None
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.2)
        print("flag", rank_stop_signal(), flush=True)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.2)
        print("flag", rank_stop_signal(), flush=True)
    """)
    p = subprocess.run([sys.executable, "-c", script], env=dict(os.environ, OMP_NUM_THREADS="1"),
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.splitlines() == [
        "[moe-async] trainer rank 1: SIGTERM: the run checkpoints after the current step and stops "
        "(a second one exits this rank at once)",
        "flag SIGTERM", "previous handler 15", "flag SIGTERM"], p.stdout


def test_stop_check_driver_first_then_ranks_and_sticky() -> None:
    driver = {"sig": None}
    ranks: list[tuple[int, str]] = []
    asked = []

    def rank_signals():
        asked.append(1)
        return list(ranks)

    chk = StopCheck(lambda: driver["sig"], rank_signals)
    assert chk() is None and len(asked) == 1
    ranks[:] = [(1, "SIGTERM"), (3, "SIGTERM")]
    assert chk() == "SIGTERM on trainer rank 1, 3" and len(asked) == 2
    ranks.clear()
    assert chk() == "SIGTERM on trainer rank 1, 3" and len(asked) == 2  # kept, ranks not asked again

    driver["sig"] = "SIGTERM"
    chk2 = StopCheck(lambda: driver["sig"], rank_signals)
    assert chk2() == "SIGTERM" and len(asked) == 2  # the driver's own flag: ranks not asked
    assert StopCheck(lambda: None)() is None  # not armed: only the driver's flag


def test_ckpt_stall_hook_off_elsewhere_and_refuses_bad_value(monkeypatch) -> None:
    monkeypatch.setenv(CKPT_STALL_ENV, "0:2")
    stall_if_due(0, 1, "/x/step_1.tmp")  # another save: returns at once
    stall_if_due(1, 2, "/x/step_2.tmp")  # another rank
    monkeypatch.setenv(CKPT_STALL_ENV, "0-2")
    with pytest.raises(ValueError, match="MOE_ASYNC_CKPT_STALL='0-2': expected RANK:N"):
        stall_if_due(0, 2, "/x/step_2.tmp")


def test_eval_get_passes_its_bound_and_names_it_on_expiry(monkeypatch) -> None:
    """The held-out evaluation's wait (lifecycle.eval_get, issue 19's timeouts): ``ray.get`` gets
    the bound, and its expiry is re-raised naming the evaluation and rollout.eval_timeout_s."""
    import ray

    from moe_async.orchestration.lifecycle import eval_get

    seen = {}

    def fake_get(ref, timeout=None):
        seen["timeout"] = timeout
        if ref == "slow":
            raise ray.exceptions.GetTimeoutError("Get timed out")
        return {"accuracy": 0.5}

    monkeypatch.setattr(ray, "get", fake_get)
    assert eval_get("fast", "held-out eval (before)", 12.0) == {"accuracy": 0.5} and seen["timeout"] == 12.0
    with pytest.raises(ray.exceptions.GetTimeoutError,
                       match=r"held-out curve point: no reply within 7 s \(rollout.eval_timeout_s\)"):
        eval_get("slow", "held-out curve point", 7.0)


@pytest.mark.parametrize("value,mode", [(None, "exit"), ("", "exit"), ("exit", "exit"), ("checkpoint", "checkpoint")])
def test_sigterm_mode_reads_moe_async_sigterm(value, mode):
    from moe_async.orchestration.preemption import sigterm_mode

    assert sigterm_mode({} if value is None else {"MOE_ASYNC_SIGTERM": value}) == mode


@pytest.mark.parametrize("value", ["1", "true", "Checkpoint", "ckpt"])
def test_an_unknown_moe_async_sigterm_is_refused_naming_it(value):
    """A pre-empted run must not silently fall back to exiting without its checkpoint."""
    from moe_async.orchestration.preemption import sigterm_mode

    with pytest.raises(ValueError, match=rf"MOE_ASYNC_SIGTERM='{value}' is not one of"):
        sigterm_mode({"MOE_ASYNC_SIGTERM": value})


def test_run_experiment_refuses_an_unknown_moe_async_sigterm_before_any_process(monkeypatch, tmp_path):
    from moe_async.config import load_config
    from moe_async.errors import UserInputError
    from moe_async.orchestration.driver import run_experiment

    monkeypatch.setenv("MOE_ASYNC_SIGTERM", "1")
    cfg = load_config(Path(__file__).resolve().parents[2] / "configs" / "cpu_smoke.yaml",
                      [f"logging.output_dir={tmp_path}/runs"])
    with pytest.raises(UserInputError, match="MOE_ASYNC_SIGTERM='1'"):
        run_experiment(cfg)
    assert not (tmp_path / "runs").exists()  # no run dir, no model, no Ray


def test_save_schedule_interval_last_step_and_the_stop_path() -> None:
    """The driver's save decisions (save_schedule.py). test_preemption_resume.py end to end: the
    smoke config without an interval, SIGTERM while waiting for step 3 -> step 2 written."""
    from moe_async.orchestration.save_schedule import SaveSchedule

    none = SaveSchedule(save_interval=0, num_steps=20)
    assert [s for s in range(1, 21) if none.due(s)] == []  # no interval: not even the last step
    assert none.due_on_stop(2) and not none.due_on_stop(0)  # a fresh run stopped before step 1: nothing
    every3 = SaveSchedule(save_interval=3, num_steps=10)
    assert [s for s in range(1, 11) if every3.due(s)] == [3, 6, 9, 10]  # and the last step
    assert [s for s in range(1, 10) if every3.due_on_stop(s)] == [1, 2, 4, 5, 7, 8]  # 3, 6, 9 written already
    resumed = SaveSchedule(save_interval=0, num_steps=4, start_step=2)
    # stopped before it finished a step: the checkpoint it resumed from is the last one
    assert not resumed.due_on_stop(2) and resumed.due_on_stop(3)
    assert SaveSchedule(save_interval=1, num_steps=3, start_step=1).due_on_stop(2) is False


def test_wait_buffered_polls_until_n_groups_and_names_a_bad_value(monkeypatch) -> None:
    counts = iter([0, 0, 1, 2, 5])
    calls = []

    def buffered() -> int:
        calls.append(1)
        return next(counts)

    wait_buffered_if_asked(buffered)  # unset: not even asked
    assert calls == []
    monkeypatch.setenv(CKPT_WAIT_BUFFERED_ENV, "2")
    wait_buffered_if_asked(buffered, timeout_s=30)
    assert len(calls) == 4  # 0, 0, 1, then 2 >= 2
    monkeypatch.setenv(CKPT_WAIT_BUFFERED_ENV, "many")
    with pytest.raises(ValueError, match="MOE_ASYNC_CKPT_WAIT_BUFFERED='many'"):
        wait_buffered_if_asked(lambda: 0)
