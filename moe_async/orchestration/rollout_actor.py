"""The rollout manager's Ray actor: :class:`moe_async.rollout.manager.RolloutManager` in an event
loop, made in two parts (the constructor's tokenizer, prompts and rewards while the engines
start; :meth:`RolloutActor.connect` once their URLs and the buffer exist). It asks for
``num_cpus=0`` like the buffer's actor and holds no logic of its own."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import ray

from moe_async.config import ExperimentConfig
from moe_async.orchestration.buffer_actor import BufferProxy
from moe_async.types import JsonDict

if TYPE_CHECKING:
    from ray.actor import ActorHandle

    from moe_async.distill.teacher import TeacherScorer


@ray.remote(num_cpus=0)
class RolloutActor:
    """Runs :class:`moe_async.rollout.manager.RolloutManager` in an event loop: generation
    keeps going while the trainer trains; the buffer's admission rule paces it."""

    def __init__(self, cfg: ExperimentConfig, model_path: str):
        """The tokenizer, the prompts and the reward pool; :meth:`connect` then makes the manager.
        Made while the engines start and the trainer ranks build (its imports and tokenizer load
        are seconds of CPU); an error here is raised by the first call, :meth:`connect`."""
        from moe_async.models.prepare import load_tokenizer
        from moe_async.rollout.reward import RewardPool
        from moe_async.rollout.tasks import TaskDataset

        self.cfg = cfg
        tok = load_tokenizer(model_path)
        if cfg.data.enabled:  # prompt files (moe_async/data), rewards per data_source
            from moe_async.data.dataset import FileDataset

            self.dataset: FileDataset | TaskDataset = FileDataset(cfg.data, tok, system_prompt=cfg.rollout.system_prompt)
        else:
            self.dataset = TaskDataset(cfg.rollout, tok)
        hf_cfg = json.loads((Path(model_path) / "config.json").read_text())
        from moe_async.models import get_family  # router replay: SGLang sends routes without a shape

        a = get_family(hf_cfg.get("model_type")).arch_args(hf_cfg)
        self.moe_shape = dict(moe_layers=a.num_layers, top_k=a.top_k) if a.num_experts else {}
        self.eos_token_ids = [tok.eos_token_id] if tok.eos_token_id is not None else []
        self.max_context_len = int(hf_cfg.get("max_position_embeddings", 2048))
        from moe_async.rollout.rewards import build_reward_fn

        if cfg.data.enabled:
            from moe_async.rollout.row_rewards import RowReward

            reward_fn: Any = RowReward(cfg.data.rewards, cfg.data.default_reward, cfg.rollout.reward_timeout_s)
        else:
            reward_fn = build_reward_fn(cfg.rollout, self.dataset)  # rollout.reward
        self.reward_pool = RewardPool(
            reward_fn,
            timeout_s=cfg.rollout.reward_timeout_s,
            max_workers=cfg.rollout.reward_workers,
            use_processes=cfg.rollout.reward_use_processes,
        )
        self._stop: asyncio.Event | None = None
        self._task: asyncio.Task | None = None

    def connect(self, urls: list[str], buffer: ActorHandle, teacher_urls: list[str] | None = None) -> None:
        """The engines' clients and the rollout manager over ``urls``, the buffer actor and the
        teacher's servers (once, before any other call but the constructor's)."""
        from moe_async.engines.client import EngineClient
        from moe_async.rollout.manager import RolloutManager

        cfg = self.cfg
        self.clients = [EngineClient(u, timeout_s=cfg.engine.request_timeout_s, **self.moe_shape) for u in urls]
        self.manager = RolloutManager(
            cfg.rollout,
            self.dataset,
            self.clients,
            BufferProxy(buffer),
            self.reward_pool,
            eos_token_ids=self.eos_token_ids,
            max_context_len=self.max_context_len,
            no_engine_wait_s=cfg.engine.startup_timeout_s + 60.0,  # an engine restart (engine_recovery)
            teacher=self._teacher(teacher_urls),
        )

    def set_lora_path(self, name: str | None) -> None:
        """New requests run on the LoRA adapter ``name`` (adapter-only sync's newest version)."""
        self.manager.lora_path = name

    def _teacher(self, urls: list[str] | None) -> TeacherScorer | None:
        """The distillation teacher's scorer over ``urls`` (None without a teacher)."""
        t = self.cfg.teacher
        if not t.enabled:
            return None
        from moe_async.distill.teacher import TeacherScorer, make_teacher_prompt_fn
        from moe_async.engines.client import EngineClient

        self.teacher_clients = [EngineClient(u, timeout_s=t.timeout_s) for u in urls or []]
        r = self.cfg.rollout
        fn = make_teacher_prompt_fn(t, self.dataset, r.task, r.task_kwargs)
        return TeacherScorer(t, self.teacher_clients, fn, source=t.model_path or f"the student's checkpoint, {urls}",
                             first_limit=r.prompts_per_step * r.n_samples_per_prompt)

    async def evaluate(self) -> dict[str, float]:
        return await self.manager.evaluate(self.dataset.eval_problems(), self.cfg.rollout.eval_max_new_tokens)

    async def evaluate_curve(self) -> JsonDict:
        """One point of the held-out curve (greedy + ``rollout.eval_k`` samples per problem):
        :func:`moe_async.rollout.evaluation.evaluate_heldout`."""
        from moe_async.rollout.evaluation import evaluate_heldout

        from moe_async.data.dataset import FileDataset

        r = self.cfg.rollout
        sets = self.dataset.eval_sets if isinstance(self.dataset, FileDataset) else None
        if sets:  # named eval sets (data.eval): each with its k, max new tokens and temperature
            assert isinstance(self.dataset, FileDataset)
            from moe_async.rollout.evaluation import evaluate_sets

            return await evaluate_sets(self.manager, sets, self.dataset.eval_cfgs, r)
        return await evaluate_heldout(self.manager, self.dataset.eval_problems(), r.eval_k, r.eval_max_new_tokens)

    async def evaluate_teacher(self) -> JsonDict:
        """The teacher's held-out point (:func:`~moe_async.rollout.evaluation.evaluate_heldout`
        with its prompt, through a rollout manager over its servers; generation timeout
        ``engine.request_timeout_s``; problems at once fit ``teacher.engine.max_running_requests``
        x its engines). Raises RuntimeError without a teacher."""
        from moe_async.engines.client import EngineClient
        from moe_async.rollout.evaluation import evaluate_heldout
        from moe_async.rollout.manager import RolloutManager

        from moe_async.distill.teacher import TeacherScorer

        scorer = self.manager.teacher
        if not isinstance(scorer, TeacherScorer):
            raise RuntimeError("evaluate_teacher: no teacher (teacher.enabled is false)")
        m, r = self.manager, self.cfg.rollout
        fits = self.cfg.teacher.engine.max_running_requests * len(scorer.clients) // (r.eval_k + 1)
        rollout = r.model_copy(update={"eval_concurrency": max(1, min(r.eval_concurrency or r.max_concurrent_groups,
                                                                      fits))})
        clients = [EngineClient(c.base_url, timeout_s=self.cfg.engine.request_timeout_s) for c in scorer.clients]
        try:
            teacher_manager = RolloutManager(rollout, self.dataset, clients, m.buffer, self.reward_pool,
                                             eos_token_ids=m.eos_token_ids, max_context_len=m.max_context_len)
            return await evaluate_heldout(teacher_manager, self.dataset.eval_problems(), r.eval_k,
                                          r.eval_max_new_tokens, prompt_fn=scorer.prompt_fn)
        finally:
            for c in clients:
                await c.aclose()

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

    async def drain_settled(self) -> list[tuple[int, str]]:
        """``(draw number, reason)`` of the train draws dropped since the last call."""
        return self.manager.drain_settled()

    async def resume_draws(self, frontier: int, settled: list[int], restored: list[int] | None = None) -> None:
        """A resumed run's prompts (before :meth:`start`): rewind to the trained ``frontier``
        and pass over the ``settled`` draws beyond it and the ``restored`` ones (back in the
        buffer from the checkpoint) (moe_async/orchestration/run_state.py)."""
        self.dataset.seek(frontier)
        self.manager.skip_draws(settled)
        self.manager.skip_draws(restored or [], "skipped_restored")

    async def set_routable(self, i: int, ok: bool) -> None:
        """Engine ``i`` into (``ok``) or out of request routing (the driver's engine recovery)."""
        self.manager.set_routable(i, ok)

    async def routable(self) -> list[bool]:
        """The routing mask, one flag per engine (the manager drops an engine that failed a request)."""
        return list(self.manager.routable)

    async def trace_spans(self) -> list[tuple]:
        """The timeline spans recorded since the last call (moe_async.logging.timeline)."""
        return self.manager.trace.drain()

    async def data_state(self) -> dict[str, int]:
        """The train-prompt position (epoch, index in its seeded order), for checkpoints."""
        return self.dataset.state_dict()

    async def load_data_state(self, state: dict[str, int]) -> None:
        """Continue the train prompts from a checkpoint's position (before :meth:`start`)."""
        self.dataset.load_state_dict(state)

    async def close(self) -> None:
        self.reward_pool.close()
