"""Ray actors: the buffer, the trainer, the engine manager and the rollout manager.

Every actor asks for ``num_cpus=0``: the pieces share the machine's cores and set their
own thread counts (``trainer.num_threads``, ``engine.num_threads``) so trainer and
engines do not oversubscribe them. The actors only adapt the plain classes of
``buffer``, ``trainer``, ``engines`` and ``rollout`` to Ray; they hold no logic of their own.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import ray

from moe_async.config import ExperimentConfig
from moe_async.types import Group


@ray.remote(num_cpus=0)
class BufferActor:
    """Ray home of :class:`moe_async.buffer.buffer.AsyncRolloutBuffer` (an async actor, so
    waiting callers do not block admissions; waits are woken by puts, version bumps and
    cancels, not polled)."""

    def __init__(self, groups_per_step: int, max_staleness: int, start_version: int = 0):
        from moe_async.buffer.buffer import AsyncRolloutBuffer

        self.abuf = AsyncRolloutBuffer(groups_per_step, max_staleness, start_version)

    async def admit(self) -> int | None:
        return self.abuf.buf.admit()

    async def admit_wait(self, timeout_s: float) -> int | None:
        """Like ``admit`` but waits up to ``timeout_s`` seconds for capacity to open."""
        return await self.abuf.admit_wait(timeout_s)

    async def cancel(self, reason: str = "cancelled") -> None:
        await self.abuf.cancel(reason)

    async def put(self, group: Group) -> None:
        await self.abuf.put(group)

    async def set_engine_version(self, version: int) -> None:
        await self.abuf.set_engine_version(version)

    async def get_batch(self, trainer_version: int, timeout_s: float) -> list[Group] | None:
        """Wait up to ``timeout_s`` seconds for ``B`` fresh groups; ``None`` on time-out."""
        return await self.abuf.get_batch_wait(trainer_version, timeout_s)

    async def stats(self) -> dict[str, Any]:
        return self.abuf.buf.stats()


class BufferProxy:
    """The async ``admit/put/cancel`` interface the RolloutManager expects, over a Ray
    handle of :class:`BufferActor`. ``admit`` waits in the actor up to ``admit_wait_s``
    seconds for capacity (``admit_waits`` tells the manager not to sleep after a refusal)."""

    admit_waits = True

    def __init__(self, handle: Any, admit_wait_s: float = 1.0):
        self.h = handle
        self.admit_wait_s = admit_wait_s

    async def admit(self) -> int | None:
        return await self.h.admit_wait.remote(self.admit_wait_s)

    async def put(self, group: Group) -> None:
        await self.h.put.remote(group)

    async def cancel(self, reason: str = "cancelled") -> None:
        await self.h.cancel.remote(reason)


@ray.remote(num_cpus=0)
class EngineManager:
    """Launches the engines (embedded CPU servers or SGLang) and shuts them down."""

    def __init__(self, cfg: ExperimentConfig, model_path: str):
        self.cfg = cfg
        self.model_path = model_path
        self.engines: list[Any] = []

    def launch(self) -> list[str]:
        """Start ``engine.num_engines`` servers; returns their base URLs once healthy.

        Raises: RuntimeError naming the engine whose process died or timed out.
        """
        from moe_async.engines.base import make_engine

        ec = self.cfg.engine
        for i in range(ec.num_engines):
            port = ec.base_port + i if ec.base_port else 0
            eng = make_engine(ec, self.model_path, port)
            self.engines.append(eng)
            eng.launch()
        return [e.url for e in self.engines]

    def check_and_restart(self) -> list[int]:
        """Restart engines whose process died or whose ``/health`` fails (same URLs).

        Returns the restarted indices: those engines run the checkpoint weights again, so the
        caller re-joins them to the weight-update group and re-sends the current weights.
        Not called by the driver yet: the update group is one process group over the trainer
        and all engines, which a restarted engine cannot rejoin without every member
        re-forming it; a dead engine instead fails the run, named by :meth:`dead_engines`.
        """
        from moe_async.engines.base import ensure_healthy

        return ensure_healthy(self.engines)

    def dead_engines(self) -> list[str]:
        """One line per engine whose process has exited: index, URL, exit code, log file
        (kept, since it died on its own). Used to name the engine when a step fails."""
        out = []
        for i, e in enumerate(self.engines):
            proc = getattr(e, "proc", None)
            if proc is not None and proc.poll() is not None:
                out.append(f"engine {i} at {e.url} exited with code {proc.returncode}; log: {getattr(e, 'log_path', None)}")
        return out

    def shutdown(self) -> None:
        for e in self.engines:
            e.shutdown()
        self.engines = []


@ray.remote(num_cpus=0)
class TrainerActor:
    """Megatron-Core trainer plus the sending side of weight sync."""

    def __init__(self, cfg: ExperimentConfig, model_path: str):
        import torch

        from moe_async.trainer.megatron_trainer import MegatronTrainer

        from moe_async.orchestration.affinity import pin_this_process

        # trainer.cpu_affinity: before torch starts its thread pool, which inherits the mask
        pin_this_process(cfg.trainer.cpu_affinity, "trainer.cpu_affinity")
        torch.set_num_threads(cfg.trainer.num_threads)
        self.cfg = cfg
        self.trainer = MegatronTrainer(cfg.trainer, model_path)
        self.transport = None

    def version(self) -> int:
        return self.trainer.version

    def connect_engines(self, urls: list[str]) -> None:
        from moe_async.engines.client import SyncEngineClient
        from moe_async.weight_sync.transport import make_transport

        clients = [SyncEngineClient(u, timeout_s=self.cfg.weight_sync.timeout_s) for u in urls]
        # weight_sync.transport: broadcast (bucketed, overlapped packing) | disk (fallback)
        self.transport = make_transport(clients, self.cfg.weight_sync, pause_mode=self.cfg.engine.pause_mode)
        self.transport.connect()

    def train_step(self, groups: list[Group]) -> dict[str, float]:
        """GRPO advantages per group, then one optimizer step on all samples."""
        from moe_async.trainer.advantages import compute_grpo_advantages

        adv = compute_grpo_advantages([[s.reward for s in g.samples] for g in groups])
        samples = [s for g in groups for s in g.samples]
        flat_adv = [a for ga in adv for a in ga]
        return {f"train/{k}": v for k, v in self.trainer.train_step(samples, flat_adv).items()}

    def sync_weights(self) -> dict[str, float]:
        """Send the current weights to every engine under the trainer's version."""
        assert self.transport is not None, "connect_engines() first"
        # The exporter writes each tensor straight into the transport's send buffer when the
        # engines publish their layout (embedded engines), so buckets go out without packing.
        out = getattr(self.transport, "destination", None)
        return self.transport.send(self.trainer.export_hf_weights(out=out), self.trainer.version)

    def checksums(self) -> dict[str, str]:
        return self.trainer.hf_checksums()

    def save_checkpoint(self, save_dir: str, step: int, extra: dict[str, Any]) -> str:
        """Write ``<save_dir>/step_<step>`` (torch_dist model + optimizer, RNG, version and
        ``extra``) and point ``<save_dir>/latest`` at it; returns the checkpoint path.

        The checkpoint is written under ``step_<step>.tmp`` and renamed when complete, and
        ``latest`` is replaced atomically after that, so a crash never leaves a partial
        checkpoint under a valid name."""
        import os
        import shutil

        final = os.path.join(save_dir, f"step_{step}")
        tmp = final + ".tmp"
        shutil.rmtree(tmp, ignore_errors=True)  # left by a crash during an earlier save
        self.trainer.save_checkpoint(tmp, extra={**extra, "step": step})
        if os.path.exists(final):
            shutil.rmtree(final)
        os.replace(tmp, final)
        with open(os.path.join(save_dir, "latest.tmp"), "w") as f:
            f.write(f"step_{step}\n")
        os.replace(os.path.join(save_dir, "latest.tmp"), os.path.join(save_dir, "latest"))
        return final

    def load_checkpoint(self, path: str) -> dict[str, Any]:
        """Load model, optimizer, version (hence LR schedule) and RNG from ``path``; returns
        the ``extra`` dict saved with it (``step``, ``dataset``)."""
        return self.trainer.load_checkpoint(path)

    def check_engines(self, urls: list[str]) -> dict[str, float]:
        """Check mode: compare per-tensor checksums of every engine with the trainer's.

        Raises: WeightSyncError naming the engine, the version and the first differing tensors.
        """
        from moe_async.engines.client import SyncEngineClient
        from moe_async.weight_sync.transport import check_engines

        t0 = time.perf_counter()
        mine = self.trainer.hf_checksums()
        m = check_engines([SyncEngineClient(u) for u in urls], mine, self.trainer.version)
        m["sync/check_seconds"] = time.perf_counter() - t0  # including the trainer's checksums
        return m

    def shutdown(self) -> None:
        if self.transport is not None:
            self.transport.shutdown()


@ray.remote(num_cpus=0)
class RolloutActor:
    """Runs :class:`moe_async.rollout.manager.RolloutManager` in an event loop: generation
    keeps going while the trainer trains; the buffer's admission rule paces it."""

    def __init__(self, cfg: ExperimentConfig, model_path: str, urls: list[str], buffer: Any):
        from moe_async.engines.client import EngineClient
        from moe_async.models.prepare import load_tokenizer
        from moe_async.rollout.manager import RolloutManager
        from moe_async.rollout.reward import RewardPool
        from moe_async.rollout.tasks import TaskDataset

        import json
        from pathlib import Path

        self.cfg = cfg
        tok = load_tokenizer(model_path)
        self.dataset = TaskDataset(cfg.rollout, tok)
        hf_cfg = json.loads((Path(model_path) / "config.json").read_text())
        from moe_async.models import get_family  # router replay: SGLang sends routes without a shape

        a = get_family(hf_cfg.get("model_type")).arch_args(hf_cfg)
        moe = dict(moe_layers=a.num_layers, top_k=a.top_k) if a.num_experts else {}
        self.clients = [EngineClient(u, timeout_s=cfg.engine.request_timeout_s, **moe) for u in urls]
        from moe_async.rollout.rewards import build_reward_fn

        self.reward_pool = RewardPool(
            build_reward_fn(cfg.rollout, self.dataset),  # rollout.reward
            timeout_s=cfg.rollout.reward_timeout_s,
            max_workers=cfg.rollout.reward_workers,
            use_processes=cfg.rollout.reward_use_processes,
        )
        eos = [tok.eos_token_id] if tok.eos_token_id is not None else []
        self.manager = RolloutManager(
            cfg.rollout,
            self.dataset,
            self.clients,
            BufferProxy(buffer),
            self.reward_pool,
            eos_token_ids=eos,
            max_context_len=int(hf_cfg.get("max_position_embeddings", 2048)),
        )
        self._stop: asyncio.Event | None = None
        self._task: asyncio.Task | None = None

    async def evaluate(self) -> dict[str, float]:
        return await self.manager.evaluate(self.dataset.eval_problems(), self.cfg.rollout.eval_max_new_tokens)

    async def evaluate_curve(self) -> dict[str, Any]:
        """One point of the held-out curve (greedy + ``rollout.eval_k`` samples per problem):
        :func:`moe_async.rollout.evaluation.evaluate_heldout`."""
        from moe_async.rollout.evaluation import evaluate_heldout

        r = self.cfg.rollout
        return await evaluate_heldout(self.manager, self.dataset.eval_problems(), r.eval_k, r.eval_max_new_tokens)

    async def start(self) -> None:
        self._stop = asyncio.Event()
        self._task = asyncio.create_task(self.manager.run(self._stop))

    async def stop(self) -> None:
        """Stop generating; in-flight groups are abandoned (never put)."""
        if self._stop is not None:
            self._stop.set()
        if self._task is not None:
            try:
                await asyncio.wait_for(self._task, timeout=30)
            except (asyncio.TimeoutError, asyncio.CancelledError):
                self._task.cancel()
            exc = None if self._task.cancelled() else self._task.exception()
            self._task = None
            if exc is not None:
                raise exc

    async def error(self) -> str | None:
        """The generation loop's exception, if it died (checked by the driver each step)."""
        if self._task is not None and self._task.done() and not self._task.cancelled():
            exc = self._task.exception()
            return repr(exc) if exc else None
        return None

    async def metrics(self) -> dict[str, Any]:
        return self.manager.metrics()

    async def data_state(self) -> dict[str, int]:
        """The train-prompt position (epoch, index in its seeded order), for checkpoints."""
        return self.dataset.state_dict()

    async def load_data_state(self, state: dict[str, int]) -> None:
        """Continue the train prompts from a checkpoint's position (before :meth:`start`)."""
        self.dataset.load_state_dict(state)

    async def close(self) -> None:
        self.reward_pool.close()
