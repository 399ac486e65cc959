"""``MOE_ASYNC_SIGTERM=checkpoint`` (set by launch/slurm/train.sbatch): the driver's first SIGTERM
only asks the step loop to checkpoint and stop (``stop_requested``), a second one exits at once.
The whole path under Slurm: tests/launch/test_slurm.py::test_preemption_signal_checkpoints_then_stops."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap


def test_first_sigterm_flags_second_exits() -> None:
    script = textwrap.dedent("""
        import os, signal, time
        from moe_async.orchestration.lifecycle import sigterm_to_checkpoint, stop_requested

        sigterm_to_checkpoint()
        assert stop_requested() is None
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.2)
        print("flag", stop_requested(), flush=True)  # still running: the loop decides when to stop
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)
        except SystemExit as e:
            print("exit", e.code, flush=True)
    """)
    p = subprocess.run([sys.executable, "-c", script], env=dict(os.environ, OMP_NUM_THREADS="1"),
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr[-3000:]
    lines = [ln for ln in p.stdout.splitlines() if not ln.startswith("[moe-async]")]
    assert lines == ["flag SIGTERM", "exit 143"], p.stdout
    assert "checkpoint after the current step, then exit" in p.stdout
