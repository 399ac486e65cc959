"""The rollout manager: admitted GRPO groups -> engine requests -> rewards -> buffer.

Runs in an asyncio loop (a Ray async actor in production). Per admitted group: tokenise and
check lengths, send G requests to the routable engines, resubmit aborted segments (partial
rollouts, each token keeping its ``weight_version``), score rewards with a timeout, put the
group into the buffer. Engines: :class:`moe_async.protocols.GenerateEngine`; buffer:
:class:`moe_async.protocols.GroupBuffer`.

With a distillation teacher (``teacher``) every sample is also scored by it, beside the reward.

Design notes: ``docs/design/rollout.md``."""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections import Counter
from collections.abc import Coroutine, Sequence
from typing import Any

from moe_async.buffer.buffer import STOPPED
from moe_async.engines.replies import GenerateOutput
from moe_async.logging.timeline import SpanRecorder
from moe_async.protocols import GenerateEngine, GroupBuffer
from moe_async.rollout.config import RolloutConfig
from moe_async.rollout.engine_router import EngineRouter
from moe_async.rollout.failures import MAX_GROUP_ERRORS_IN_A_ROW, DropGroup, GroupsFailingError, PromptsAllDroppedError
from moe_async.rollout.reward import RewardPool, RewardResult
from moe_async.rollout.reward_streak import RewardErrorStreak, RewardFailureError
from moe_async.rollout.seams import DrawnPrompt, GroupTeacher
from moe_async.types import Group, Sample

log = logging.getLogger(__name__)


async def _gather_or_cancel(coros: list) -> list:
    """``gather`` that cancels the siblings when one fails (no orphaned engine requests)."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


def greedy_summary(greedy: list[tuple[float, str | None, float, int]], n_skipped: int) -> dict[str, float]:
    """The greedy half of an evaluation as the driver's ``eval_before`` / ``eval_after`` dict
    (and what :meth:`RolloutManager.evaluate` returns: ``reward_mean``, ``accuracy`` (reward >= 1),
    ``task_accuracy``, ``reward_errors``, ``n``, ``n_skipped``, ``mean_response_len``), so a run
    with the held-out curve does not answer the same greedy requests twice.

    ``greedy``: ``(reward, reward error or None, task scorer's score, response tokens)`` of
    each scored problem's greedy answer; ``n_skipped``: the problems left out (prompt too long
    or a request dropped).
    """
    g = greedy
    k = len(g)
    return {
        "reward_mean": sum(r[0] for r in g) / k if k else 0.0,
        "accuracy": sum(r[0] >= 1.0 for r in g) / k if k else 0.0,
        "task_accuracy": sum(r[2] for r in g) / k if k else 0.0,
        "reward_errors": sum(r[1] is not None for r in g),
        "n": k,
        "n_skipped": n_skipped,
        "mean_response_len": sum(r[3] for r in g) / k if k else 0.0,
    }


class RolloutManager:
    """Keeps up to ``cfg.max_concurrent_groups`` groups generating (``docs/design/rollout.md``)."""

    def __init__(
        self,
        cfg: RolloutConfig,
        dataset: Any,
        engine_clients: Sequence[GenerateEngine],
        buffer: GroupBuffer,
        reward_pool: RewardPool,
        eos_token_ids: list[int] | None = None,
        max_context_len: int = 2048,
        no_engine_wait_s: float = 600.0,
        teacher: GroupTeacher | None = None,
    ):
        if not engine_clients:
            raise ValueError("RolloutManager needs at least one engine client")
        self.cfg = cfg
        self.dataset = dataset
        self.engines = list(engine_clients)
        #: the LoRA adapter new requests run on (adapter-only sync's newest ``policy@V``); None: the base weights
        self.lora_path: str | None = None
        self.buffer = buffer
        self.reward_pool = reward_pool
        self.eos_token_ids = [int(t) for t in (eos_token_ids or [])]
        self.max_context_len = int(max_context_len)
        self._group_ids = itertools.count()
        self._open_groups: set[int] = set()  # admitted groups whose task has not settled them
        self._skip: dict[int, str] = {}  # draw number -> counter: settled before a resume, or restored
        self._settled: list[tuple[int, str]] = []  # (draw number, drop reason) since drain_settled
        self.counters: Counter = Counter()
        self.dropped: Counter = Counter()
        self._drop_run = 0  # prompts dropped before generation since the last one generated
        self._filtered_per_version: Counter = Counter()  # dynamic filtering: groups per version
        self.trace = SpanRecorder()  # timeline: generate/reward spans, drained by the driver
        # with no engine routable (a restart) a request waits no_engine_wait_s, then engine_lost
        self.router = EngineRouter(self.engines, float(no_engine_wait_s), self.trace, self.counters)
        self._error_run = 0  # groups failed with an error since the last one produced
        self._group_error: GroupsFailingError | None = None
        self.agent = None  # multi-turn trajectories (rollout.agent; moe_async/agent)
        if cfg.agent.enabled:
            from moe_async.agent.rollout import AgentRollout

            self.agent = AgentRollout(cfg.agent, getattr(dataset, "tokenizer", None), dataset.messages,
                                      self.eos_token_ids, self.max_context_len)
        self.teacher = teacher  # distillation: a moe_async.distill.teacher.TeacherScorer, scores beside the reward
        self.reward_streak = RewardErrorStreak(cfg.max_consecutive_reward_errors, self._reward_source(),
                                               cfg.reward_timeout_s,
                                               first_limit=cfg.prompts_per_step * cfg.n_samples_per_prompt)

    # ================================================================== public
    async def run(self, stop_event: asyncio.Event) -> None:
        """Produce groups until ``stop_event`` is set; in-flight groups are then cancelled
        (their admissions returned with ``buffer.cancel("stopped")``; counted as
        ``rollout/in_flight_at_stop``, not as drops)."""
        tasks: set[asyncio.Task] = set()
        try:
            while not stop_event.is_set():
                tasks = {t for t in tasks if not t.done()}
                if self.reward_streak.failure is not None:  # the reward never returns a number
                    raise self.reward_streak.failure
                if self.teacher is not None and self.teacher.failure is not None:  # the teacher never scores
                    raise self.teacher.failure
                if self._group_error is not None:  # every group hits the same error
                    raise self._group_error
                if len(tasks) >= self.cfg.max_concurrent_groups:
                    await self._wait_any(tasks, stop_event)
                    continue
                version = await self.buffer.admit()
                if version is None:
                    if not self.buffer.admit_waits:  # else admit() already waited
                        await self._sleep_or_stop(stop_event, self.cfg.admit_poll_s)
                    continue
                try:
                    seq = self._next_draw()
                    problem = self.dataset.next_train()
                    draw = self._draw_key(problem)
                    prompt_ids = self.dataset.build_prompt_ids(problem)
                except BaseException:
                    await self._cancel("error")
                    raise
                cap = getattr(self.dataset, "max_prompt_length", None)  # data.max_prompt_length
                if cap is not None and len(prompt_ids) > cap:
                    self.dropped["prompt_over_max_length"] += 1
                    self._settle(seq, "prompt_over_max_length")
                    await self._cancel("prompt_over_max_length")
                    self._dropped_in_a_row(cap)
                    continue
                max_new = self._check_length(len(prompt_ids), self.cfg.max_new_tokens)
                if max_new is None:
                    self._settle(seq, "prompt_too_long")
                    await self._cancel("prompt_too_long")
                    self._dropped_in_a_row(cap)
                    continue
                self._drop_run = 0
                gid = next(self._group_ids)
                self._open_groups.add(gid)  # admitted, not yet put or cancelled
                tasks.add(asyncio.create_task(
                    self._produce_group(gid, problem, prompt_ids, max_new, int(version), seed_key=draw, seq=seq),
                    name=f"group-{gid}",
                ))
        finally:
            for t in tasks:
                t.cancel()
            if tasks:
                await asyncio.gather(*tasks, return_exceptions=True)
            # a group task cancelled before its first step never ran its own except-path (e.g.
            # the stop came while buffer.admit() was awaited): its admission is settled here
            for gid in sorted(self._open_groups):
                self._open_groups.discard(gid)
                self.counters["in_flight_at_stop"] += 1
                await asyncio.shield(self._cancel(STOPPED))

    async def evaluate(self, problems: list, max_new_tokens: int | None = None) -> dict[str, float]:
        """Held-out eval: greedy (temperature 0), one sample per problem, concurrent.

        Scored by the same reward pool as training (``rollout.reward``, its timeout and
        error isolation), so eval and the training curve use one scorer. Returns
        ``reward_mean`` (mean configured reward), ``accuracy`` (fraction with configured
        reward >= 1.0, as ``rollout/accuracy`` in training), ``task_accuracy`` (the task's
        reasoning-gym exact-match scorer, ``dataset.score``, reported beside it; equal to
        ``accuracy`` when ``rollout.reward='reasoning_gym'``), ``reward_errors`` (samples whose
        configured reward failed or timed out, scored 0), ``n`` (scored), ``n_skipped``
        (prompt too long or dropped) and ``mean_response_len`` (tokens). With ``rollout.agent``
        each problem is a greedy trajectory: reward its environment's, task score 1.0 when it
        reached reward 1.0 within the turn budget, length its sampled tokens.
        """
        max_new_tokens = int(max_new_tokens or self.cfg.eval_max_new_tokens)
        sem = asyncio.Semaphore(max(1, self.cfg.max_concurrent_groups * self.cfg.n_samples_per_prompt))

        async def one(p: object) -> tuple[float, str | None, float, int] | None:
            if self.agent is not None:  # multi-turn: success within the turn budget, greedy turns
                return await agent_one(p)
            async with sem:
                prompt_ids = self.dataset.build_prompt_ids(p)
                max_new = self._check_length(len(prompt_ids), max_new_tokens, count=False)
                if max_new is None:
                    return None
                try:
                    s = await self._generate_sample(prompt_ids, max_new, greedy=True)
                except DropGroup:
                    return None
            text = self.dataset.decode(s.response_ids)
            r = await self.reward_pool.score(p, text)
            task_score = float(self.dataset.score(p, text))
            return float(r.reward), r.error, task_score, len(s.response_ids)

        async def agent_one(p: object) -> tuple[float, str | None, float, int] | None:
            async def turn(ids: list[int], n: int) -> Sample:
                return await self._generate_sample(ids, n, greedy=True)

            async with sem:
                try:
                    assert self.agent is not None
                    s = await self.agent.sample(p, turn, max_new_tokens, count=False)
                except DropGroup:
                    return None
            return float(s.reward), None, float(s.reward >= 1.0), int(sum(s.response_mask()))

        res = await asyncio.gather(*(one(p) for p in problems))
        done = [r for r in res if r is not None]
        self.reward_streak.update(r[1] for r in done)  # RewardFailureError: stop before training
        return greedy_summary(done, len(problems) - len(done))

    def metrics(self) -> dict[str, float]:
        """Cumulative since this manager was made: counters (``rollout/<name>``), drops by
        reason, ``rollout/gen_wall_seconds`` (wall-clock s with >= 1 request outstanding on
        any engine, never more than the elapsed time), ``rollout/request_seconds_sum`` (s
        summed over requests; overlapping requests add up), ``rollout/engine_busy_s/<i>``
        (per engine), ``rollout/requests/<i>`` (requests sent to engine i),
        ``rollout/engine_request_retries`` (requests retried after their engine failed them),
        ``rollout/requests_in_flight`` (requests outstanding now, all engines)
        and the reward pool's metrics."""
        m: dict[str, float] = {f"rollout/{k}": float(v) for k, v in self.counters.items()}
        for reason, n in self.dropped.items():
            m[f"rollout/dropped/{reason}"] = float(n)
        m["rollout/dropped_total"] = float(sum(self.dropped.values()))
        # wall-clock seconds with >= 1 request outstanding on any engine (<= elapsed time);
        # the per-request sum exceeds wall time when requests overlap
        m.update(self.router.metrics())
        if hasattr(self.reward_pool, "metrics"):
            m.update(self.reward_pool.metrics())
        if self.agent is not None:
            m.update(self.agent.metrics())
        if self.teacher is not None:
            m.update(self.teacher.metrics())
        return m

    def skip_draws(self, seqs, counter: str = "skipped_settled") -> None:
        """Draw numbers a resumed run must not draw again (settled before its checkpoint:
        moe_async/orchestration/run_state.py; or restored into the buffer from it, ``counter``
        ``skipped_restored``); each is passed over once, counted in ``rollout/<counter>``."""
        self._skip.update((int(x), counter) for x in seqs)

    def drain_settled(self) -> list[tuple[int, str]]:
        """``(draw number, reason)`` of the train draws dropped since the last call."""
        out, self._settled = self._settled, []
        return out

    def _next_draw(self) -> int | None:
        """Pass over the draws in :meth:`skip_draws`; the draw number of the next draw
        (None when the dataset has no ``position``)."""
        pos = getattr(self.dataset, "position", None)
        if pos is None:
            return None
        while pos() in self._skip:
            self.counters[self._skip.pop(pos())] += 1
            self.dataset.next_train()
        return pos()

    def _settle(self, seq: int | None, reason: str) -> None:
        if seq is not None:
            self._settled.append((int(seq), reason))

    def set_routable(self, i: int, ok: bool) -> None:
        """Put engine ``i`` into routing (``ok``) or take it out (:meth:`EngineRouter.set_routable`)."""
        self.router.set_routable(i, ok)

    @property
    def routable(self) -> list[bool]:
        """The routing mask, one flag per engine (the driver's and failed requests')."""
        return self.router.routable

    async def _call_engine(self, ids: list[int], sp: dict[str, object]) -> GenerateOutput:
        """One ``/generate`` on a routable engine, on the newest adapter (:meth:`EngineRouter.call`)."""
        return await self.router.call(ids, sp, self.cfg.return_routed_experts, self.lora_path)

    # ================================================================ internals
    def _dropped_in_a_row(self, cap: int | None) -> None:
        """Count one prompt dropped before generation; once a whole epoch of train rows has been
        dropped in a row no prompt can ever be generated, so stop instead of drawing forever.

        Raises:
            PromptsAllDroppedError: naming the counts and the limits that dropped them.
        """
        self._drop_run += 1
        rows = getattr(self.dataset, "n", None) or len(getattr(self.dataset, "train", None) or ())
        if rows and self._drop_run >= rows:
            raise PromptsAllDroppedError(
                f"every one of the last {self._drop_run} train prompts ({rows} rows an epoch) was dropped before "
                f"generation (so far over data.max_prompt_length={cap}: {self.dropped['prompt_over_max_length']}; "
                f"filling the engine's context of {self.max_context_len} tokens: {self.dropped['prompt_too_long']})")

    def _check_length(self, prompt_len: int, max_new: int, count: bool = True) -> int | None:
        """``None`` when the prompt alone fills the context, else the clamped budget."""
        if prompt_len >= self.max_context_len:
            if count:
                self.dropped["prompt_too_long"] += 1
            return None
        room = self.max_context_len - prompt_len
        if max_new > room:
            if count:
                self.counters["max_new_tokens_clamped"] += 1
            return room
        return max_new

    async def _cancel(self, reason: str) -> None:
        try:
            await self.buffer.cancel(reason)
        except Exception:  # noqa: BLE001
            log.exception("buffer.cancel failed")

    @staticmethod
    async def _sleep_or_stop(stop_event: asyncio.Event, seconds: float) -> None:
        try:
            await asyncio.wait_for(stop_event.wait(), timeout=seconds)
        except asyncio.TimeoutError:
            pass

    @staticmethod
    async def _wait_any(tasks: set[asyncio.Task], stop_event: asyncio.Event) -> None:
        stop = asyncio.create_task(stop_event.wait())
        try:
            await asyncio.wait(tasks | {stop}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stop.cancel()

    def _sampling_params(self, max_new: int, greedy: bool, seed: int | None = None,
                         temperature: float | None = None) -> dict[str, object]:
        sp: dict[str, object] = {"max_new_tokens": int(max_new)}
        if seed is not None and not greedy:
            sp["sampling_seed"] = int(seed)
        if greedy:
            sp.update(temperature=0.0, top_p=1.0, top_k=1)
        else:
            sp.update(temperature=self.cfg.temperature if temperature is None else float(temperature),
                      top_p=self.cfg.top_p, top_k=self.cfg.top_k)
        if self.eos_token_ids:
            sp["stop_token_ids"] = list(self.eos_token_ids)
        return sp

    _MAX_REPORTED_REWARD_ERRORS = 5

    def _reward_source(self) -> str:
        """The reward setting, as errors name it."""
        rw = getattr(self.reward_pool, "fn", None)
        if rw is not None and hasattr(rw, "rewards") and hasattr(rw, "default_reward"):  # prompt files: per data_source
            return f"data.rewards={rw.rewards!r}, data.default_reward={rw.default_reward!r}"
        return {"function": f"rollout.reward_function={self.cfg.reward_function!r}",
                "remote": f"rollout.reward_url={self.cfg.reward_url!r}"}.get(
                    self.cfg.reward, f"rollout.reward={self.cfg.reward!r}")

    def _report_reward_errors(self, samples: list) -> None:
        """Log each distinct reward error message once (the first few), naming the reward
        setting: otherwise a scorer that raises or returns garbage on every sample trains on
        reward 0 with nothing but a count to show for it."""
        seen = self.__dict__.setdefault("_reward_errors_seen", set())
        for s in samples:
            err = s.reward_error
            if err is None or err in seen or len(seen) >= self._MAX_REPORTED_REWARD_ERRORS:
                continue
            seen.add(err)
            log.warning("reward error (%s), sample scored 0: %s%s", self._reward_source(), err,
                        "" if len(seen) < self._MAX_REPORTED_REWARD_ERRORS
                        else " (further distinct reward errors are only counted: rollout/reward_errors)")

    async def _produce_group(self, gid: int, problem: DrawnPrompt, prompt_ids: list[int], max_new: int,
                             version: int, seed_key: int | None = None, seq: int | None = None) -> None:
        """Generate, score and put (or cancel) one admitted group; settles ``gid``'s admission.
        ``seed_key`` (default ``gid``): what ``rollout.sampling_seed`` is mixed with."""
        seed_key = gid if seed_key is None else seed_key
        self._open_groups.discard(gid)  # from its first step on, this task settles the admission
        put_attempted = False
        try:
            G = self.cfg.n_samples_per_prompt
            if self.agent is not None:  # GRPO over G trajectories, rewarded by their environment
                samples = await _gather_or_cancel(
                    [self._trajectory(problem, max_new, self._sample_seed(seed_key, i), gid) for i in range(G)])
                # a trajectory cut by a hung environment: its error is the sample's reward_error
                results = [RewardResult(s.reward, s.metadata.get("agent_error")) for s in samples]
            else:
                samples = await _gather_or_cancel(
                    [self._generate_sample(prompt_ids, max_new, seed=self._sample_seed(seed_key, i)) for i in range(G)]
                )
            texts = [self.dataset.decode(s.response_ids) for s in samples]
            if self.agent is None:
                w0 = self.trace.now()
                jobs: list[Coroutine[object, None, object]] = [self.reward_pool.score(problem, t) for t in texts]
                if self.teacher is not None:  # distillation: the teacher scores every token meanwhile
                    jobs.append(self.teacher.score_group(problem, samples, self.trace))
                results = (await _gather_or_cancel(jobs))[: len(texts)]
                self.trace.add("reward", "reward", w0, self.trace.now(), {"group": gid})
            for i, (s, t, r) in enumerate(zip(samples, texts, results)):
                s.response_text = t
                s.reward = float(r.reward)
                s.reward_error = r.error
                s.answer = str(problem.answer)
                s.metadata.update(task=getattr(problem, "data_source", None) or self.cfg.task,
                                  problem_index=problem.index, group_id=gid,
                                  sample_index=i, draw_seq=seq)
                s.validate()
            group = Group(group_id=gid, samples=samples, start_version=version)
            self.counters["samples_generated"] += len(samples)
            # every scored sample, filtered or not: the reward per generated sample
            self.counters["reward_sum"] += sum(s.reward for s in samples)
            if hasattr(problem, "data_source"):  # prompt files: the reward per data source
                ds = str(problem.data_source or "default")  # rows without one: data.default_reward
                for s in samples:
                    s.metadata["data_source"] = ds
                    if getattr(problem, "file", None) is not None:  # trained_rows.jsonl names the file
                        s.metadata.update(file=getattr(problem, "file", None), file_row=getattr(problem, "file_row", None))
                self.counters[f"reward_sum/{ds}"] += sum(s.reward for s in samples)
                self.counters[f"samples/{ds}"] += len(samples)
            self.counters["tokens_generated"] += group.num_tokens
            self.counters["reward_errors"] += sum(s.reward_error is not None for s in samples)
            self._report_reward_errors(samples)
            self.reward_streak.update(s.reward_error for s in samples)  # RewardFailureError
            if self._filter_out(group, version):
                self.dropped["filtered_equal_rewards"] += 1
                self._settle(seq, "filtered_equal_rewards")
                self.counters["samples_filtered"] += len(samples)
                self.counters["tokens_filtered"] += group.num_tokens
                await self._cancel("filtered_equal_rewards")
                return
            put_attempted = True
            await self.buffer.put(group)
            self.counters["groups_produced"] += 1
            self._error_run = 0
        except DropGroup as exc:
            self.dropped[exc.reason] += 1
            self._settle(seq, exc.reason)
            log.warning("group %d dropped: %s", gid, exc.reason)
            await self._cancel(exc.reason)
        except RewardFailureError:  # run() raises it next
            self.dropped["reward_failure"] += 1
            self._settle(seq, "reward_failure")
            await self._cancel("reward_failure")
        except asyncio.CancelledError:
            if not put_attempted:  # the run ended while it generated: not a drop
                self.counters["in_flight_at_stop"] += 1
                await asyncio.shield(self._cancel(STOPPED))
            raise
        except Exception as exc:  # noqa: BLE001 - one bad group must not kill the loop
            if put_attempted:
                log.exception("buffer.put failed for group %d", gid)
                self.dropped["put_failed"] += 1
                self._settle(seq, "put_failed")
            else:
                log.exception("group %d failed", gid)
                self.dropped[f"error:{type(exc).__name__}"] += 1
                self._settle(seq, f"error:{type(exc).__name__}")
                await self._cancel("error")
                self._error_run += 1
                if self._error_run >= MAX_GROUP_ERRORS_IN_A_ROW and self._group_error is None:
                    self._group_error = GroupsFailingError(
                        f"{self._error_run} groups in a row failed with an error, the last: "
                        f"{type(exc).__name__}: {exc}")

    async def _trajectory(self, problem: DrawnPrompt, max_new: int, seed: int | None, gid: int) -> Sample:
        """One multi-turn trajectory (moe_async/agent): each model turn is
        :meth:`_generate_sample` on the sequence so far (partial rollouts, pause modes), the
        turn's seed the sample's plus its turn index; tool calls are spans in the trace."""
        turns = itertools.count()

        async def turn(ids: list[int], n: int) -> Sample:
            k = next(turns)
            return await self._generate_sample(ids, n, seed=None if seed is None else seed + 104_729 * k)

        assert self.agent is not None  # only called for rollout.agent
        s = await self.agent.sample(problem, turn, max_new)
        for name, t0, t1, ok in s.metadata.pop("tool_spans", []):
            self.trace.add("tools", f"tool {name}", t0, t1, {"group": gid, "ok": ok})
        return s

    def _filter_out(self, group: Group, version: int) -> bool:
        """Dynamic filtering (``docs/design/rollout.md``, step 6): True when ``group`` is to be
        dropped because its rewards are all equal and the per-version cap is not reached."""
        if not self.cfg.dynamic_filter or len(group.samples) < 2:
            return False
        r0 = group.samples[0].reward
        if any(s.reward != r0 for s in group.samples):
            return False
        if self._filtered_per_version[version] >= self.cfg.dynamic_filter_max_per_version:
            self.counters["filter_cap_passed"] += 1
            return False
        self._filtered_per_version[version] += 1
        return True

    def _draw_key(self, problem: DrawnPrompt) -> int:
        """Which draw of the train prompts ``problem`` is: ``epoch * 1_000_003 + problem.index``
        (the dataset's epoch after the draw), the same in a run resumed from a checkpoint."""
        st = self.dataset.state_dict() if hasattr(self.dataset, "state_dict") else {}
        return int(st.get("epoch", 0)) * 1_000_003 + int(getattr(problem, "index", 0))

    def _sample_seed(self, key: int, index: int) -> int | None:
        """``rollout.sampling_seed`` mixed with the group's draw key and the sample's index
        (None: unseeded)."""
        if self.cfg.sampling_seed is None:
            return None
        return (self.cfg.sampling_seed * 1_000_003 + key * 1_009 + index) % (2**31 - 1)

    async def _generate_sample(self, prompt_ids: list[int], max_new: int, greedy: bool = False,
                               seed: int | None = None, temperature: float | None = None) -> Sample:
        """One response, resubmitting aborted segments; design notes: ``docs/design/rollout.md``.
        ``seed``: the request's ``sampling_seed`` (a resumed segment's: plus its tokens so far);
        ``temperature``: a sampled request's (None: ``rollout.temperature``; an eval set's own)."""
        tokens: list[int] = []
        logprobs: list[float] = []
        versions: list[int] = []
        routed = None
        aborts = 0
        finish = "length"
        while True:
            remaining = max_new - len(tokens)
            if remaining <= 0:
                finish = "length"
                break
            ids = list(prompt_ids) + tokens
            seg_seed = None if seed is None else (seed + 7_919 * len(tokens)) % (2**31 - 1)
            out = await self._call_engine(ids, self._sampling_params(remaining, greedy, seg_seed, temperature))
            raw_n = len(out.output_ids or [])  # router replay: routes cover ids + raw_n tokens
            seg_ids = [int(t) for t in (out.output_ids or [])]
            seg_lp = [float(x) for x in (out.output_logprobs or [])]
            seg_v = list(getattr(out, "output_token_weight_versions", None) or [])
            if len(seg_lp) != len(seg_ids):
                raise RuntimeError(f"engine returned {len(seg_ids)} tokens but {len(seg_lp)} logprobs")
            if len(seg_v) != len(seg_ids):
                seg_v = [int(out.weight_version)] * len(seg_ids)
            seg_ids, seg_lp, seg_v = seg_ids[:remaining], seg_lp[:remaining], seg_v[:remaining]
            self.counters["engine_tokens"] += len(seg_ids)
            if out.finish_reason == "abort":
                aborts += 1
                self.counters["aborts"] += 1
                if self.cfg.partial_rollout:
                    routed = self._join_routes(routed, ids, out, raw_n, seg_ids)  # router replay
                    tokens += seg_ids
                    logprobs += seg_lp
                    versions += [int(v) for v in seg_v]
                else:
                    self.counters["abort_discarded_tokens"] += len(seg_ids)
                if aborts > self.cfg.max_abort_retries:
                    raise DropGroup("abort_retries")
                self.counters["resubmits"] += 1
                await asyncio.sleep(0)
                continue
            tokens += seg_ids
            logprobs += seg_lp
            versions += [int(v) for v in seg_v]
            routed = self._join_routes(routed, ids, out, raw_n, seg_ids)  # router replay
            finish = out.finish_reason if out.finish_reason in ("stop", "length") else "length"
            break
        s = Sample(prompt_ids=list(prompt_ids), response_ids=tokens, rollout_logprobs=logprobs,
                   weight_versions=versions, finish_reason=finish, routed_experts=routed)
        s.metadata["aborts"] = aborts
        if not tokens:
            s.finish_reason = "length"
            s.loss_weight = 0.0
            self.counters["zero_token_samples"] += 1
        return s

    def _join_routes(self, routed, ids: list[int], out: GenerateOutput, raw_n: int, seg_ids: list[int]):
        """Router replay: the kept routes (``None`` or ``[len(ids) - 1, L, K]``) extended by
        this segment's (engine: ``len(ids) + raw_n - 1`` rows), cut to the kept tokens and
        stored compact (moe_async.replay.routes). ``None`` when routes were not requested."""
        seg = getattr(out, "routed_experts", None)
        if not self.cfg.return_routed_experts or seg is None:
            return None
        from moe_async.replay.routes import compact_routes, join_segments, truncate_routes

        if len(seg) == 0 and raw_n == 0:  # aborted before anything ran
            return routed
        joined = join_segments(routed, len(ids), seg, len(ids) + raw_n)
        if joined is None:
            return None
        return compact_routes(truncate_routes(joined, len(ids) + len(seg_ids)))
