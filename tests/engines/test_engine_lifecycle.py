"""Engine lifecycle: restart on death, no orphan when the parent is SIGKILLed, several
engines behind least-loaded dispatch; a port taken between choosing it and binding it."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from moe_async.engines.base import EngineLaunchError, ensure_healthy, make_engine
from moe_async.engines.multi_client import MultiEngineClient
from moe_async.engines.config import EngineConfig


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    import torch
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    cfg = MixtralConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, num_local_experts=4,
        num_experts_per_tok=2, max_position_embeddings=64, eos_token_id=2,
    )
    d = tmp_path_factory.mktemp("tiny_lifecycle")
    MixtralForCausalLM(cfg).save_pretrained(d)
    return str(d)


def _gone(pid: int, within_s: float) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.2)
    return False


def test_restart_after_kill_and_two_engines_least_loaded(model_dir):
    cfg = EngineConfig(num_engines=2, startup_timeout_s=120, max_running_requests=4)
    engines = [make_engine(cfg, model_dir) for _ in range(cfg.num_engines)]
    try:
        with ThreadPoolExecutor(len(engines)) as ex:  # side by side, as each engine actor starts its own
            list(ex.map(lambda e: e.launch(), engines))
        assert ensure_healthy(engines) == []
        url, pid = engines[1].url, engines[1].proc.pid
        os.kill(pid, signal.SIGKILL)  # the engine dies
        engines[1].proc.wait(5)  # reaped: dead, not a zombie
        assert not engines[1].alive and not engines[1].healthy()
        assert ensure_healthy(engines) == [1]
        assert engines[1].healthy() and engines[1].url == url and engines[1].proc.pid != pid

        async def run():
            async with MultiEngineClient([e.url for e in engines], timeout_s=60) as mc:
                assert await mc.health() == [True, True]
                sp = {"temperature": 0.0, "max_new_tokens": 6, "ignore_eos": True}
                seen = []

                async def one(k):
                    i = mc.pick()  # what generate() will choose next
                    seen.append(i)
                    mc._next = i  # generate() re-picks: keep the same engine
                    return await mc.generate([3, 4, 5 + k], sp)

                outs = await asyncio.gather(*[one(k) for k in range(4)])
                assert all(len(o.output_ids) == 6 for o in outs)
                assert sorted(seen) == [0, 0, 1, 1]  # balanced while all were in flight
                assert mc.inflight == [0, 0]
                assert await mc.get_weight_version() == [0, 0]

        asyncio.run(run())
    finally:
        for e in engines:
            e.shutdown()
    assert not any(e.alive for e in engines)


def test_port_taken_before_the_server_binds_it(model_dir):
    """A port the engine chose (``port=0``) that another process takes before the server binds
    it: the first launch starts the server again on another free port. A port given by the
    caller is kept: the launch fails, naming the cause."""
    import socket

    cfg = EngineConfig(startup_timeout_s=120, max_running_requests=4)
    eng = make_engine(cfg, model_dir)
    taken = eng.port
    with socket.socket() as blocker:
        blocker.bind((eng.host, taken))
        blocker.listen()
        try:
            eng.launch()
            assert eng.port != taken and eng.healthy()
        finally:
            eng.shutdown()
        with pytest.raises(EngineLaunchError, match="address already in use"):
            make_engine(cfg, model_dir, taken).launch()


def test_server_exits_when_parent_is_killed(model_dir):
    parent = textwrap.dedent(f"""
        import sys, time
        from moe_async.engines.base import make_engine
        from moe_async.engines.config import EngineConfig
        e = make_engine(EngineConfig(startup_timeout_s=120), {model_dir!r}).launch()
        print(e.proc.pid, flush=True)
        time.sleep(600)
    """)
    p = subprocess.Popen([sys.executable, "-c", parent], stdout=subprocess.PIPE, text=True,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        server_pid = int(p.stdout.readline())
        os.kill(server_pid, 0)  # running
        p.kill()  # SIGKILL: no atexit, no cleanup in the parent
        p.wait(10)
        assert _gone(server_pid, 10), f"embedded server {server_pid} outlived its parent"
    finally:
        if p.poll() is None:
            p.kill()
        try:
            os.killpg(server_pid, signal.SIGKILL)
        except (ProcessLookupError, UnboundLocalError, PermissionError):
            pass
