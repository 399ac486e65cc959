"""CPU placement: trainer.cpu_affinity / engine.cpu_affinity (config checks, pinning of
every thread of this process, engine server processes started on the given cores)."""

from __future__ import annotations

import os
import sys
import threading

import pytest

from moe_async.config import ConfigError, load_config
from moe_async.engines.base import _SubprocessEngine
from moe_async.engines.config import EngineConfig
from moe_async.affinity import check_cpu_affinity, pin_this_process

pytestmark = pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="Linux only")


def test_config_fields_checked_and_default_unset() -> None:
    cfg = load_config(None)
    assert cfg.trainer.cpu_affinity is None and cfg.engine.cpu_affinity is None
    cfg = load_config(None, ["trainer.cpu_affinity=[0]", "engine.cpu_affinity=[1, 2]"])
    assert cfg.trainer.cpu_affinity == [0] and cfg.engine.cpu_affinity == [1, 2]
    for bad, why in (("[]", "at least one"), ("[-1]", ">= 0"), ("[1, 1]", "repeat")):
        with pytest.raises(ConfigError, match=rf"engine\.cpu_affinity.*{why}"):
            load_config(None, [f"engine.cpu_affinity={bad}"])
        with pytest.raises(ConfigError, match=rf"trainer\.cpu_affinity.*{why}"):
            load_config(None, [f"trainer.cpu_affinity={bad}"])


def test_unavailable_core_named() -> None:
    missing = max(os.sched_getaffinity(0)) + 1000
    with pytest.raises(ValueError, match=rf"trainer\.cpu_affinity=\[{missing}\].*not available"):
        check_cpu_affinity([missing], "trainer.cpu_affinity")
    assert check_cpu_affinity(None, "x") is None


def test_pin_this_process_pins_existing_and_new_threads() -> None:
    orig = os.sched_getaffinity(0)
    core = max(orig)
    started, release = threading.Event(), threading.Event()
    tid: list[int] = []

    def worker() -> None:
        tid.append(threading.get_native_id())
        started.set()
        release.wait(10)

    t = threading.Thread(target=worker)
    t.start()
    started.wait(10)
    try:
        assert pin_this_process([core], "trainer.cpu_affinity") == {core}
        assert os.sched_getaffinity(0) == {core}
        assert os.sched_getaffinity(tid[0]) == {core}  # a thread started before pinning
        later: list[set] = []
        t2 = threading.Thread(target=lambda: later.append(os.sched_getaffinity(0)))
        t2.start()
        t2.join()
        assert later == [{core}]  # and one started after
    finally:
        release.set()
        t.join()
        for task in os.listdir("/proc/self/task"):  # restore (the check would refuse orig now)
            try:
                os.sched_setaffinity(int(task), orig)
            except ProcessLookupError:
                pass
    assert os.sched_getaffinity(0) == orig


class _HealthOnlyServer(_SubprocessEngine):
    """A stand-in server process that answers 200 to every GET (so launch() succeeds)."""

    name = "health"

    def command(self) -> list[str]:
        code = ("import http.server as h, sys\n"
                "class H(h.BaseHTTPRequestHandler):\n"
                "    def do_GET(self):\n        self.send_response(200); self.end_headers()\n"
                "    def log_message(self, *a):\n        pass\n"
                "h.HTTPServer(('127.0.0.1', int(sys.argv[1])), H).serve_forever()\n")
        return [sys.executable, "-c", code, str(self.port)]


def test_engine_process_started_on_its_cores() -> None:
    core = min(os.sched_getaffinity(0))
    eng = _HealthOnlyServer(EngineConfig(cpu_affinity=[core], startup_timeout_s=60), "unused")
    try:
        eng.launch()
        assert os.sched_getaffinity(eng.proc.pid) == {core}
    finally:
        eng.shutdown()
    free = _HealthOnlyServer(EngineConfig(startup_timeout_s=60), "unused")  # unset: not pinned
    try:
        free.launch()
        assert os.sched_getaffinity(free.proc.pid) == os.sched_getaffinity(0)
    finally:
        free.shutdown()
    bad = _HealthOnlyServer(EngineConfig(cpu_affinity=[max(os.sched_getaffinity(0)) + 1000]), "unused")
    with pytest.raises(ValueError, match=r"engine\.cpu_affinity"):
        bad.launch()
    assert bad.proc is None


@pytest.mark.parametrize("field", ["trainer.cpu_affinity", "engine.cpu_affinity"])
def test_absent_core_refused_at_launch_before_any_process(field, tmp_path, monkeypatch) -> None:
    """A core valid for the schema but absent on this host loads (config stays host-independent)
    and is refused by run_experiment before the run dir, the model, Ray or any engine exists."""
    import ray

    from moe_async.orchestration import driver

    allowed = sorted(os.sched_getaffinity(0))
    missing = max(allowed) + 7
    cfg = load_config(None, [f"{field}=[{min(allowed)}, {missing}]", f"logging.output_dir={tmp_path / 'runs'}"])
    assert getattr(cfg, field.split(".")[0]).cpu_affinity == [min(allowed), missing]  # loads on any host

    def no_process(*a, **k):  # reached by a run that got past the affinity check
        raise AssertionError("run dir / Ray start reached")

    monkeypatch.setattr(driver, "make_run_dir", no_process)
    monkeypatch.setattr(driver, "init_ray", no_process)
    with pytest.raises(ValueError) as ei:
        driver.run_experiment(cfg)
    msg = str(ei.value)
    assert msg == (f"{field}={[min(allowed), missing]}: cores {[missing]} are not available here "
                   f"(allowed: {allowed})")
    assert not ray.is_initialized()
    assert not (tmp_path / "runs").exists()
    # attached to a Ray cluster (RAY_ADDRESS) the actors start on other hosts: not checked here
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")
    with pytest.raises(AssertionError, match="run dir / Ray start reached"):
        driver.run_experiment(cfg)
