"""Discrete-event model of the moe-async pipeline: step time, samples/s and idle fractions of
``sync``, ``one_step_off`` and ``fully_async`` (max_staleness K) at any scale.

What is modelled (each piece mirrors the code named):

* **Engines** (``moe_async/engines/embedded/scheduler.py``, SGLang's continuous batching):
  ``num_engines`` engines, each running at most ``max_running_requests`` requests. A
  waiting request is admitted between forward passes by a batched prefill of
  ``prefill_s + prefill_per_token_s * (prompt + kept output tokens)`` seconds that yields its
  first token; every decode step then yields one token per running request and takes
  ``decode_step_s + decode_step_per_seq_s * b`` seconds at running batch ``b``. Between batch
  changes the engine runs whole steps, so token counts stay integers and a newcomer waits
  for the step in progress (event-driven: one event per batch change, not per token).
* **Rollout lengths**: ``fixed``, ``lognormal`` (mean ``length_mean`` before the cap, log-sd
  ``length_sigma``) or ``empirical`` (drawn from ``length_values``, e.g. a measured
  histogram), capped at ``max_new_tokens``; the same seeded draws for every mode.
* **Rollout manager** (``moe_async/rollout/manager.py``): keeps up to
  ``max_concurrent_groups`` GRPO groups of ``G`` requests in flight, each request sent
  round-robin over the engines; a refused admission waits for a capacity change (version
  bump, cancel, stale drop), as ``BufferActor.admit_wait`` does; a group is put into the
  buffer ``group_overhead_s`` (reward + put) after its last sample. (``admit_poll_s`` /
  ``batch_poll_s`` > 0 model the polling loops of the pipeline before it was event-driven:
  a change is then seen after a uniform random fraction ``poll_phase`` of the interval.)
* **Buffer**: the real :class:`moe_async.buffer.buffer.RolloutBuffer` (imported, not
  re-implemented): admission while ``admitted - retired < (v - v0 + K + 1) * B``, groups
  admitted and dropped whole, stale groups (oldest token more than ``K`` versions behind the
  trainer) dropped at hand-out (``async.stale_policy='drop'``, the only policy the config
  allows), per-token staleness histogram.
* **Trainer / driver** (``moe_async/orchestration/driver.py``): waits for ``B`` fresh groups
  (``get_batch``, woken by each put), trains ``train_fixed_s + train_per_token_s *
  (prompt + response tokens)`` seconds, bumps the version, and every ``sync_interval``
  steps syncs weights for ``sync_fixed_s + sync_bytes / (sync_gbps * 1e9)`` seconds; the
  engines are paused for the last ``pause_s`` seconds of it (``None``: the whole sync,
  ``weight_sync.pause_scope='sync'``); the pause waits for each engine's forward pass in
  progress, as SGLang's ``pause_generation`` does. Pause modes (``engine.pause_mode``):
  ``abort`` (requests return; resubmitted round-robin, continuing from their prefix with
  ``partial_rollout`` or restarted from the prompt without it, their tokens lost),
  ``retract`` (back to the engine's queue, re-prefilled with their output), ``in_place``
  (frozen, continue). Tokens keep the version they were generated under.
* Metrics as the driver defines them: samples/s = trained samples / loop time; trainer idle
  fraction = time waiting for a batch / loop time; engine idle fraction = 1 - mean over
  engines of (time with a request outstanding) / loop time (the rollout manager's client view,
  which counts paused requests as busy); also the engines' compute idle fraction (no forward
  pass running).

Not modelled: CPU contention between trainer and engines on one machine (on a cluster they
own disjoint GPUs), dynamic filtering, prompt-length drops, reward failures.

Usage::

    python tools/simulate.py                                # the cluster scenario below
    python tools/simulate.py --set num_engines=16 --set train_fixed_s=60
    python tools/simulate.py --calibrate RUNS/sync-run [RUNS/async-run]   # fit + check
    python tools/simulate.py --json out.json

``--calibrate SYNC_RUN`` reads a real run directory (``config.yaml``, ``metrics.jsonl``,
``summary.json`` of ``moe-async train``, best a ``sync`` run of 1 engine + 1 trainer), fits the
stage times (:func:`calibrate`), and predicts ``sync`` and ``fully_async`` for that config;
further run directories (e.g. a ``fully_async`` run of the same config) are compared with
the prediction of their mode. ``--calibrate BENCH.json`` does both from one
``tools/bench_async.py --json`` file (fit to its sync run, check against its fully_async run).

Cluster scenario (the default config, :func:`cluster_scenario`): 8 engines x 128 running
requests, 32 groups x 8 samples per step, lognormal lengths (mean 4k, sigma 1.0, cap 64k
tokens: the slowest of 256 samples is typically ~35k tokens), decode 20 ms/step + 0.05
ms/sequence, prefill 50 ms + 20 us/token of 512-token prompts, a 30 s + 1 us/token train
step (~31 s), 60 GB of weights at 20 GB/s + 1 s per sync (4 s, engines paused throughout,
abort + partial rollouts), reward + put 0.5 s per group, 40 steps, seed 0. Output of
``python tools/simulate.py``::

    mode          K   step_s samples/s  steady trainer_idle engine_idle speedup stale_dropped  staleness(tokens)
    sync          0  816.324     0.314   0.312        0.957       0.464    1.00        0 (0%)  {0: 100%}
    one_step_off  1  226.830     1.129   1.129        0.845       0.000    3.60     230 (15%)  {0: 45%, 1: 55%}
    fully_async   2  149.525     1.712   1.729        0.765       0.000    5.46     251 (16%)  {0: 17%, 1: 58%, 2: 26%}
    fully_async   4   98.557     2.597   2.657        0.643       0.000    8.28     254 (16%)  {0: 6%, 1: 29%, 2: 34%, 3: 22%, 4: 9%}

(``stale_dropped``: groups dropped as stale at hand-out, the ``--json``'s
``drop_reasons["stale"]``, and their share of the generated samples.)

Reading it: ``sync`` waits ~800 s per step for its slowest sample; the engines idle 46% of
the time and, while they work, decode a time-weighted mean batch of 6 sequences (the tail
runs alone). Bounded staleness keeps the engines computing (2-4% idle; ``engine_idle`` is
the client view, a request outstanding, as the driver logs it) with mean batches of
15 (K=1), 25 (K=2), 42 (K=4): the admission cap of ``(K+1) x B`` untrained groups (and
``max_concurrent_groups=128``), most of them waiting on one long sample, bounds the work in
flight, not the engines' 128 slots, so the step time keeps falling with K while the trainer
still idles 64-85%. The price: the hand-out check drops 15-16% of the generated
samples as stale (230 groups at K=1, 254 at K=4), the long ones first, so the trained mean
length falls from 4100 to ~3500 tokens; and at K=4, 18 groups exceed
``max_abort_retries=16`` (a 35k-token sample spans more than 16 syncs).
"""

from __future__ import annotations

import argparse
import dataclasses
import heapq
import itertools
import json
import math
import random
import sys
from collections import Counter, deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from moe_async.buffer.buffer import RolloutBuffer  # noqa: E402  (the real admission rule)
from moe_async.types import Group  # noqa: E402

MODES = ("sync", "one_step_off", "fully_async")
PAUSE_MODES = ("abort", "retract", "in_place")
LENGTHS = ("fixed", "lognormal", "empirical")


@dataclass
class SimConfig:
    """Parameters of one simulated run. Times in seconds, sizes in tokens unless named.

    Raises (on construction):
        ValueError: naming the field, on a value out of range or a mode the pipeline lacks.
    """

    mode: str = "fully_async"            # sync | one_step_off | fully_async
    max_staleness: int = 2               # K of fully_async (sync: 0, one_step_off: 1)
    num_steps: int = 20                  # optimizer steps simulated
    groups_per_step: int = 4             # B (rollout.prompts_per_step)
    samples_per_group: int = 4           # G (rollout.n_samples_per_prompt)
    max_concurrent_groups: int = 4       # rollout.max_concurrent_groups
    # engines
    num_engines: int = 1
    max_running_requests: int = 16       # engine.max_running_requests (decode batch cap)
    decode_step_s: float = 0.02          # seconds per decode step, batch-independent part
    decode_step_per_seq_s: float = 0.0   # + seconds per running sequence
    prefill_s: float = 0.0               # seconds per prefill forward
    prefill_per_token_s: float = 0.0     # + seconds per prefilled token
    prompt_tokens: int = 64
    # rollout lengths (response tokens per sample)
    lengths: str = "fixed"               # fixed | lognormal | empirical
    length_mean: float = 8.0             # fixed: the length; lognormal: mean before the cap
    length_sigma: float = 1.0            # lognormal: sd of ln(length)
    length_values: tuple[int, ...] = ()  # empirical: lengths drawn uniformly (a histogram)
    max_new_tokens: int = 8
    # trainer and weight sync
    train_fixed_s: float = 1.0
    train_per_token_s: float = 0.0       # per prompt + response token of the batch
    first_step_extra_s: float = 0.0      # warm-up of the first optimizer step
    train_trace_s: tuple[float, ...] = ()  # measured train step times: step i takes [i] (replaces the above)
    sync_trace_s: tuple[float, ...] = ()   # measured sync times, likewise (engines paused throughout)
    sync_interval: int = 1               # weight_sync.interval_steps
    sync_fixed_s: float = 0.0
    sync_bytes: float = 0.0
    sync_gbps: float = 1.0               # GB/s, 1e9 bytes/s
    pause_s: float | None = None         # engines' stall per sync (None: the whole sync)
    pause_mode: str = "abort"            # engine.pause_mode
    partial_rollout: bool = True         # rollout.partial_rollout
    max_abort_retries: int = 16          # rollout.max_abort_retries
    # orchestration overheads
    group_overhead_s: float = 0.0        # reward scoring + buffer put, per group
    step_overhead_s: float = 0.0         # driver bookkeeping after each step
    startup_s: float = 0.0               # generation starts this late on the loop clock
    admit_poll_s: float = 0.0            # 0: admission woken by capacity changes (BufferActor.admit_wait)
    batch_poll_s: float = 0.0            # 0: get_batch woken by a put (> 0: the older 50 ms polls)
    poll_phase: float = 1.0              # a poll sees a change after U(0, poll_phase x interval)
    seed: int = 0

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        if self.pause_mode not in PAUSE_MODES:
            raise ValueError(f"pause_mode must be one of {PAUSE_MODES}, got {self.pause_mode!r}")
        if self.lengths not in LENGTHS:
            raise ValueError(f"lengths must be one of {LENGTHS}, got {self.lengths!r}")
        for name in ("num_steps", "groups_per_step", "samples_per_group", "max_concurrent_groups",
                     "num_engines", "max_running_requests", "max_new_tokens", "sync_interval"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("max_staleness", "prompt_tokens", "max_abort_retries"):
            if int(getattr(self, name)) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if isinstance(v, float) and not math.isfinite(v):
                raise ValueError(f"{f.name} must be finite, got {v}")
            if f.name.endswith("_s") and isinstance(v, (int, float)) and v < 0:
                raise ValueError(f"{f.name} must be >= 0 seconds, got {v}")
        if not 0.0 <= self.poll_phase <= 1.0:
            raise ValueError(f"poll_phase must be in [0, 1], got {self.poll_phase}")
        if self.decode_step_s + self.decode_step_per_seq_s <= 0:
            raise ValueError("decode_step_s + decode_step_per_seq_s must be > 0 (a decode step takes time)")
        if self.sync_gbps <= 0 or self.sync_bytes < 0:
            raise ValueError(f"sync_gbps must be > 0 and sync_bytes >= 0, got {self.sync_gbps}, {self.sync_bytes}")
        if self.length_mean < 1 or self.length_sigma < 0:
            raise ValueError(f"length_mean must be >= 1 and length_sigma >= 0, got {self.length_mean}, {self.length_sigma}")
        for name in ("train_trace_s", "sync_trace_s"):
            tr = getattr(self, name)
            if tr and (len(tr) < self.num_steps or min(tr) < 0 or not all(map(math.isfinite, tr))):
                raise ValueError(f"{name} needs num_steps={self.num_steps} finite values >= 0, got {len(tr)}")
        if self.lengths == "empirical" and (not self.length_values or min(self.length_values) < 1):
            raise ValueError("lengths='empirical' needs length_values, all >= 1")
        if self.K < self.sync_interval - 1:  # the config's own cross-check (moe_async/config.py)
            raise ValueError(f"max_staleness={self.K} cannot hold with sync_interval={self.sync_interval}")

    @property
    def K(self) -> int:
        """The buffer's bound: 0 for sync, 1 for one_step_off, ``max_staleness`` otherwise."""
        return {"sync": 0, "one_step_off": 1}.get(self.mode, int(self.max_staleness))

    @property
    def sync_s(self) -> float:
        return self.sync_fixed_s + self.sync_bytes / (self.sync_gbps * 1e9)


def cluster_scenario() -> SimConfig:
    """The cluster-scale scenario of the module docstring (8 engines, 64k-token tail)."""
    return SimConfig(
        mode="fully_async", max_staleness=2, num_steps=40, groups_per_step=32, samples_per_group=8,
        max_concurrent_groups=128, num_engines=8, max_running_requests=128,
        decode_step_s=0.020, decode_step_per_seq_s=5e-5, prefill_s=0.05, prefill_per_token_s=2e-5,
        prompt_tokens=512, lengths="lognormal", length_mean=4096, length_sigma=1.0, max_new_tokens=65536,
        train_fixed_s=30.0, train_per_token_s=1e-6, sync_fixed_s=1.0, sync_bytes=60e9, sync_gbps=20.0,
        pause_mode="abort", partial_rollout=True, group_overhead_s=0.5, step_overhead_s=0.1,
        seed=0,
    )


# ------------------------------------------------------------------------------ model
class _Sample:
    """Duck-typed :class:`moe_async.types.Sample` for the real buffer.

    ``weight_versions`` holds one entry per run of equal versions (not per token) so that the
    buffer's rules, which only need ``min()`` and emptiness, run in O(runs); ``segments``
    keeps ``[version, tokens]`` for the token-weighted staleness histogram.
    """

    __slots__ = ("weight_versions", "segments", "num_tokens", "metadata")

    def __init__(self, segments: list[list[int]]):
        self.metadata: dict = {}  # Sample.metadata (the buffer reads its draw_seq on a stale drop)
        self.segments = [list(s) for s in segments]
        self.weight_versions = [v for v, _ in self.segments]
        self.num_tokens = sum(n for _, n in self.segments)

    @property
    def oldest_version(self) -> int:
        return min(self.weight_versions) if self.weight_versions else -1

    def validate(self) -> None:
        pass

    def response_mask(self) -> list[float]:
        """One 1.0 per run in ``weight_versions`` (every simulated token is sampled; the
        token-weighted histogram is the simulator's own, from ``segments``)."""
        return [1.0] * len(self.weight_versions)


class _Req:
    """One sample's request: ``target`` response tokens, ``segments`` [[version, n], ...] kept."""

    __slots__ = ("group", "target", "segments", "generated", "aborts", "engine")

    def __init__(self, group: "_GroupGen", target: int):
        self.group = group
        self.target = target
        self.segments: list[list[int]] = []
        self.generated = 0
        self.aborts = 0
        self.engine: _Engine | None = None

    def add(self, version: int, n: int) -> None:
        if n <= 0:
            return
        if self.segments and self.segments[-1][0] == version:
            self.segments[-1][1] += n
        else:
            self.segments.append([version, n])
        self.generated += n


class _GroupGen:
    __slots__ = ("gid", "version", "reqs", "done", "dead")

    def __init__(self, gid: int, version: int):
        self.gid, self.version = gid, version
        self.reqs: list[_Req] = []
        self.done = 0
        self.dead = False


class _Engine:
    """Continuous batching, one operation (prefill or a run of decode steps) at a time."""

    def __init__(self, sim: "Simulation", idx: int):
        self.sim, self.idx, self.cfg = sim, idx, sim.cfg
        self.running: list[_Req] = []
        self.waiting: deque[_Req] = deque()
        self.version = 0
        self.paused = False
        self.pending_pause: str | None = None
        self.on_paused: Callable[[], None] | None = None
        self.op: str | None = None
        self.op_batch: list[_Req] = []
        self.op_start = self.op_end = self.step_s = 0.0
        self.op_steps = 0
        self.epoch = 0
        self.kick_pending = False
        self.compute_s = 0.0
        self.decode_s = self.decode_rows_s = 0.0  # time-weighted decode batch size
        self.outstanding = 0            # client view (the rollout manager's _EngineBusy)
        self.busy_since = 0.0
        self.busy_s = 0.0

    # client view of busy time
    def _enter(self, now: float) -> None:
        if self.outstanding == 0:
            self.busy_since = now
        self.outstanding += 1

    def _exit(self, now: float) -> None:
        self.outstanding -= 1
        if self.outstanding == 0:
            self.busy_s += now - self.busy_since

    def client_busy(self, now: float) -> float:
        return self.busy_s + (now - self.busy_since if self.outstanding else 0.0)

    def compute_busy(self, now: float) -> float:
        return self.compute_s + (min(now, self.op_end) - self.op_start if self.op else 0.0)

    # requests in
    def submit(self, req: _Req, now: float) -> None:
        req.engine = self
        self._enter(now)
        self.waiting.append(req)
        if self.op is None:
            if not self.kick_pending:  # after every submission of this instant: one prefill
                self.kick_pending = True
                self.sim.at(now, self._kick)
        elif self.op == "decode" and len(self.running) < self.cfg.max_running_requests:
            self._cut(now)  # admit it after the decode step in progress

    def _cut(self, now: float) -> None:
        """End the decode run at the step boundary at or after ``now``."""
        k = min(self.op_steps, math.ceil((now - self.op_start) / self.step_s - 1e-9))
        if k < self.op_steps:
            self.op_steps = k
            self.op_end = self.op_start + k * self.step_s
            self.epoch += 1
            self.sim.at(self.op_end, self._op_done, self.epoch)

    def _kick(self) -> None:
        self.kick_pending = False
        self._next(self.sim.now)

    def _next(self, now: float) -> None:
        if self.paused or self.op is not None:
            return
        free = self.cfg.max_running_requests - len(self.running)
        if self.waiting and free > 0:
            batch = [self.waiting.popleft() for _ in range(min(free, len(self.waiting)))]
            toks = sum(self.cfg.prompt_tokens + r.generated for r in batch)
            self.op, self.op_batch = "prefill", batch
            self.op_start, self.op_end = now, now + self.cfg.prefill_s + self.cfg.prefill_per_token_s * toks
        elif self.running:
            b = len(self.running)
            self.step_s = self.cfg.decode_step_s + self.cfg.decode_step_per_seq_s * b
            self.op_steps = min(r.target - r.generated for r in self.running)
            self.op = "decode"
            self.op_start, self.op_end = now, now + self.op_steps * self.step_s
        else:
            return
        self.epoch += 1
        self.sim.at(self.op_end, self._op_done, self.epoch)

    def _op_done(self, epoch: int) -> None:
        if epoch != self.epoch:
            return
        now = self.sim.now
        self.compute_s += self.op_end - self.op_start
        op, self.op = self.op, None
        if op == "decode":
            self.decode_s += self.op_end - self.op_start
            self.decode_rows_s += len(self.running) * (self.op_end - self.op_start)
        if op == "prefill":
            for r in self.op_batch:  # the prefill yields each request's next token
                r.add(self.version, 1)
            self.running.extend(self.op_batch)
            self.op_batch = []
        else:
            for r in self.running:
                r.add(self.version, self.op_steps)
        finished = [r for r in self.running if r.generated >= r.target]
        if finished:
            self.running = [r for r in self.running if r.generated < r.target]
            for r in finished:
                self._exit(now)
                self.sim.request_done(r, now)
        if self.pending_pause is not None:
            self._apply_pause(now)
        self._next(now)

    # weight updates
    def pause(self, mode: str, now: float, on_paused: Callable[[], None]) -> None:
        """Pause after the forward pass in progress; ``on_paused()`` when it took effect."""
        self.pending_pause, self.on_paused = mode, on_paused
        if self.op is None:
            self._apply_pause(now)
        elif self.op == "decode":
            self._cut(now)

    def _apply_pause(self, now: float) -> None:
        mode, cb = self.pending_pause, self.on_paused
        self.pending_pause = self.on_paused = None
        self.paused = True
        if mode == "abort":
            reqs = self.running + list(self.waiting)
            self.running, self.waiting = [], deque()
            for r in reqs:
                self._exit(now)
                self.sim.request_aborted(r, now)
        elif mode == "retract":
            self.waiting = deque(self.running + list(self.waiting))
            self.running = []
        assert cb is not None
        cb()

    def resume(self, version: int, now: float) -> None:
        self.version = version
        self.paused = False
        self._next(now)


class Simulation:
    """One run of the model; :meth:`run` returns the metrics dict (see :func:`simulate`)."""

    def __init__(self, cfg: SimConfig):
        self.cfg = cfg
        self.now = 0.0
        self._q: list = []
        self._seq = itertools.count()
        self.buf = RolloutBuffer(cfg.groups_per_step, cfg.K, start_version=0)
        self.engines = [_Engine(self, i) for i in range(cfg.num_engines)]
        self.rng = random.Random(cfg.seed)
        self._lengths: list[int] = []
        self._rr = itertools.count()
        self._gids = itertools.count()
        self.in_flight = 0
        self.rollout_state = "wait_task"  # or "poll" (sleeping admit_poll_s), "wait_capacity"
        self._rollout_retry_at: float | None = None
        self.poll_rng = random.Random(cfg.seed + 1)  # poll phases; lengths keep their own stream
        self.version = 0
        self.step = 0
        self.trainer_waiting = False
        self.trainer_wake_at: float | None = None
        self._try_token = 0
        self.wait_since = 0.0
        self.step_t0 = 0.0
        self.idle = 0.0
        self.samples_trained = 0
        self.tokens_trained = 0
        self.step_times: list[float] = []
        self.wait_times: list[float] = []
        self.step_end: list[float] = []
        self.train_times: list[float] = []
        self.batch_tokens: list[int] = []
        self.batch_samples: list[int] = []
        self.sync_times: list[float] = []
        self.busy_times: list[float] = []  # per step: mean over engines of client-busy seconds
        self._busy_prev = 0.0
        self.elapsed = 0.0
        self.counters: Counter = Counter()
        self.sample_staleness: Counter = Counter()
        self.token_staleness: Counter = Counter()
        self.done = False
        self._pauses_left = 0

    # event loop
    def at(self, t: float, fn: Callable, *args: Any) -> None:
        heapq.heappush(self._q, (t, next(self._seq), fn, args))

    def run(self) -> dict[str, Any]:
        self.at(self.cfg.startup_s, self._rollout_try)
        self.at(0.0, self._trainer_begin_step)
        last_step, events = 0, 0
        while self._q and not self.done:
            t, _, fn, args = heapq.heappop(self._q)
            self.now = t
            fn(*args)
            events += 1
            if self.step != last_step:
                last_step, events = self.step, 0
            elif events > 5_000_000:
                raise RuntimeError(f"simulation stuck before step {self.step + 1} (5M events without a step)")
        if not self.done:
            raise RuntimeError(f"simulation ran out of events at step {self.step}")
        return self._results()

    # lengths: one seeded stream shared by all modes
    def _length(self, i: int) -> int:
        c = self.cfg
        while len(self._lengths) <= i:
            if c.lengths == "fixed":
                x = c.length_mean
            elif c.lengths == "lognormal":
                mu = math.log(c.length_mean) - c.length_sigma ** 2 / 2
                x = self.rng.lognormvariate(mu, c.length_sigma)
            else:
                x = self.rng.choice(c.length_values)
            self._lengths.append(int(min(c.max_new_tokens, max(1, round(x)))))
        return self._lengths[i]

    # rollout manager
    def _rollout_try(self) -> None:
        c = self.cfg
        self.rollout_state = "wait_task"
        self._rollout_retry_at = None
        while self.in_flight < c.max_concurrent_groups:
            v = self.buf.admit()
            if v is None:  # refused: only a capacity change (sync, retired group) helps
                self.rollout_state = "poll" if c.admit_poll_s > 0 else "wait_capacity"
                return
            self._start_group(int(v))

    def _start_group(self, version: int) -> None:
        g = _GroupGen(next(self._gids), version)
        self.in_flight += 1
        G = self.cfg.samples_per_group
        for j in range(G):
            g.reqs.append(_Req(g, self._length(g.gid * G + j)))
        for r in g.reqs:
            self._send(r)

    def _send(self, r: _Req) -> None:
        self.counters["requests"] += 1
        self.engines[next(self._rr) % len(self.engines)].submit(r, self.now)

    def request_aborted(self, r: _Req, now: float) -> None:
        self.counters["aborts"] += 1
        if r.group.dead:
            return
        if not self.cfg.partial_rollout:
            self.counters["abort_discarded_tokens"] += r.generated
            r.segments, r.generated = [], 0
        r.aborts += 1
        if r.aborts > self.cfg.max_abort_retries:
            r.group.dead = True  # siblings still in engines finish and are ignored
            self.counters["dropped_abort_retries"] += 1
            self.buf.cancel("abort_retries")
            self._group_finished()
            return
        self._send(r)

    def request_done(self, r: _Req, now: float) -> None:
        g = r.group
        if g.dead:
            return
        g.done += 1
        self.counters["tokens_generated"] += r.generated
        if g.done == len(g.reqs):
            self.at(now + self.cfg.group_overhead_s, self._put, g)

    def _put(self, g: _GroupGen) -> None:
        samples = [_Sample(r.segments) for r in g.reqs]
        self.buf.put(Group(group_id=g.gid, samples=samples, start_version=g.version))
        self._group_finished()
        if self.trainer_waiting:
            self._trainer_wake()

    def _group_finished(self) -> None:
        self.in_flight -= 1
        if self.rollout_state == "wait_task":
            self._rollout_try()
        else:
            self._capacity_changed()

    def _capacity_changed(self) -> None:
        """The manager sleeping in its admission poll sees a capacity change at its next
        tick: after a uniform random part of ``admit_poll_s`` (its phase is not modelled)."""
        if self.rollout_state == "wait_capacity":
            self._rollout_try()
        elif self.rollout_state == "poll" and self._rollout_retry_at is None:
            self._rollout_retry_at = self.now + self.poll_rng.uniform(0.0, self.cfg.poll_phase * self.cfg.admit_poll_s)
            self.at(self._rollout_retry_at, self._rollout_try)

    # trainer / driver
    def _trainer_begin_step(self) -> None:
        self.step_t0 = self.now
        self._try_token += 1
        self._trainer_try(self._try_token)

    def _trainer_wake(self) -> None:
        """A group arrived while the trainer waits: its ``get_batch`` poll sees it after a
        uniform random part of ``batch_poll_s`` (the poll's phase is not modelled)."""
        if self.trainer_wake_at is None:
            p = self.cfg.batch_poll_s
            self.trainer_wake_at = self.now + (self.poll_rng.uniform(0.0, self.cfg.poll_phase * p) if p > 0 else 0.0)
            self._try_token += 1
            self.at(self.trainer_wake_at, self._trainer_try, self._try_token)

    def _trainer_try(self, token: int) -> None:
        if token != self._try_token:
            return  # superseded wake-up
        self.trainer_wake_at = None
        retired = self.buf.retired
        batch = self.buf.get_batch(self.version)
        if self.buf.retired != retired:  # stale groups dropped: their slots are free again
            self._capacity_changed()
        if batch is None:
            if not self.trainer_waiting:
                self.trainer_waiting, self.wait_since = True, self.now
            return
        self.trainer_waiting = False
        wait = self.now - self.step_t0
        self.idle += wait
        self.wait_times.append(wait)
        for g in batch:
            for s in g.samples:
                self.sample_staleness[self.version - s.oldest_version if s.weight_versions else 0] += 1
                for v, n in s.segments:
                    self.token_staleness[self.version - v] += n
        n_samples = sum(len(g.samples) for g in batch)
        resp = sum(s.num_tokens for g in batch for s in g.samples)
        self.samples_trained += n_samples
        self.tokens_trained += resp
        c = self.cfg
        dt = c.train_fixed_s + c.train_per_token_s * (resp + n_samples * c.prompt_tokens)
        if self.step == 0:
            dt += c.first_step_extra_s
        if c.train_trace_s:
            dt = c.train_trace_s[self.step]
        self.train_times.append(dt)
        self.batch_tokens.append(resp)
        self.batch_samples.append(n_samples)
        self.counters["mixed_version_samples"] += sum(len(s.segments) > 1 for g in batch for s in g.samples)
        self.at(self.now + dt, self._trainer_trained)

    def _trainer_trained(self) -> None:
        self.version += 1
        self.step += 1
        c = self.cfg
        if self.step % c.sync_interval == 0 or self.step == c.num_steps:
            sync_s = c.sync_trace_s[self.step - 1] if c.sync_trace_s else c.sync_s
            pause = sync_s if c.pause_s is None or c.sync_trace_s else min(c.pause_s, sync_s)
            self._sync_t0 = self.now
            self.at(self.now + sync_s - pause, self._sync_pause, pause)
        else:
            self.sync_times.append(0.0)
            self._trainer_step_end()

    def _sync_pause(self, pause: float) -> None:
        self._pauses_left = len(self.engines)
        t_req = self.now

        def paused() -> None:
            self._pauses_left -= 1
            if self._pauses_left == 0:  # the transfer starts once every engine has paused
                self.counters["pause_wait_s"] += self.now - t_req
                self.at(self.now + pause, self._sync_done)

        for e in self.engines:
            e.pause(self.cfg.pause_mode, self.now, paused)

    def _sync_done(self) -> None:
        self.sync_times.append(self.now - self._sync_t0)
        for e in self.engines:
            e.resume(self.version, self.now)
        self.buf.set_engine_version(self.version)
        self._capacity_changed()
        self._trainer_step_end()

    def _trainer_step_end(self) -> None:
        self.elapsed = self.now  # the driver's elapsed: after the sync, before its bookkeeping
        self.step_times.append(self.now - self.step_t0)
        busy = sum(e.client_busy(self.now) for e in self.engines) / len(self.engines)
        self.busy_times.append(busy - self._busy_prev)
        self._busy_prev = busy
        self.step_end.append(self.now)
        if self.step >= self.cfg.num_steps:
            self.done = True
            return
        self.at(self.now + self.cfg.step_overhead_s, self._trainer_begin_step)

    def _results(self) -> dict[str, Any]:
        c, el = self.cfg, self.elapsed
        n = len(self.step_times)
        steady = self.step_times[n // 2:] if n >= 2 else self.step_times
        bstats = self.buf.stats()
        client_busy = [e.client_busy(el) for e in self.engines]
        compute_busy = [e.compute_busy(el) for e in self.engines]
        tok_hist = {int(k): int(v) for k, v in sorted(self.token_staleness.items())}
        return {
            "mode": c.mode,
            "K": c.K,
            "steps": n,
            "loop_seconds": el,
            "step_s_mean": el / n,
            "step_s_steady": sum(steady) / len(steady),
            "step_seconds": self.step_times,
            "step_end_seconds": self.step_end,
            "wait_seconds": self.wait_times,
            "engine_busy_seconds": self.busy_times,
            "train_seconds": self.train_times,
            "sync_seconds": self.sync_times,
            "batch_tokens": self.batch_tokens,
            "batch_samples": self.batch_samples,
            "mixed_version_samples": int(self.counters["mixed_version_samples"]),
            "samples_per_s": self.samples_trained / el,
            # steps 2..N over their own time (the first step carries the pipeline fill)
            "steady_samples_per_s": (sum(self.batch_samples[1:]) / (self.step_end[-1] - self.step_end[0])
                                     if n >= 2 else self.samples_trained / el),
            "tokens_per_s": self.tokens_trained / el,
            "trainer_idle_frac": self.idle / el,
            "engine_idle_frac": max(0.0, 1.0 - sum(client_busy) / len(client_busy) / el),
            "engine_compute_idle_frac": max(0.0, 1.0 - sum(compute_busy) / len(compute_busy) / el),
            "engine_busy_seconds_per_step": sum(client_busy) / len(client_busy) / n,
            "mean_decode_batch": sum(e.decode_rows_s for e in self.engines) / max(1e-12, sum(e.decode_s for e in self.engines)),
            "staleness_hist_tokens": tok_hist,
            "staleness_hist_samples": {int(k): int(v) for k, v in sorted(self.sample_staleness.items())},
            "buffer": {k: bstats[k] for k in ("samples_generated", "samples_trained", "samples_dropped",
                                              "samples_buffered", "groups_put", "groups_dropped", "admitted",
                                              "retired", "in_flight")},
            "drop_reasons": dict(bstats["drop_reasons"]),
            "samples_in_flight": self.in_flight * c.samples_per_group,
            "requests": int(self.counters["requests"]),
            "aborts": int(self.counters["aborts"]),
            "abort_discarded_tokens": int(self.counters["abort_discarded_tokens"]),
            "dropped_abort_retries": int(self.counters["dropped_abort_retries"]),
            "mean_response_len": self.tokens_trained / max(1, self.samples_trained),
        }


def simulate(cfg: SimConfig) -> dict[str, Any]:
    """Run the model once.

    Returns: a dict with ``step_s_mean`` (loop time / steps), ``step_s_steady`` (mean of
    the second half of the steps), ``samples_per_s``, ``tokens_per_s`` (trained),
    ``trainer_idle_frac``, ``engine_idle_frac`` (client view, as the driver logs it),
    ``engine_compute_idle_frac``, ``staleness_hist_tokens`` / ``staleness_hist_samples``
    ({versions behind: count}), the buffer's sample counters, per-step ``step_seconds`` and
    ``wait_seconds``, abort counts.

    Raises:
        RuntimeError: when the pipeline cannot make progress (a configuration that deadlocks).
    """
    return Simulation(cfg).run()


def compare_modes(base: SimConfig, ks: tuple[int, ...] = (1, 2)) -> list[dict[str, Any]]:
    """``sync``, ``one_step_off`` (when 1 in ``ks``) and ``fully_async`` at each other K of
    ``ks``, same parameters and seed; each result has ``speedup`` = its samples/s over sync's."""
    runs = [dataclasses.replace(base, mode="sync", max_staleness=0)]
    for k in ks:
        runs.append(dataclasses.replace(base, mode="one_step_off" if k == 1 else "fully_async", max_staleness=k))
    out = [simulate(c) for c in runs]
    for r in out:
        r["speedup"] = r["samples_per_s"] / out[0]["samples_per_s"]
        r["trainer_idle_over_sync"] = r["trainer_idle_frac"] / max(out[0]["trainer_idle_frac"], 1e-12)
    return out


# ------------------------------------------------------------------------ calibration
def _parse_file(path: Path, parse, errors) -> Any:
    """``parse(path's text)``; a parse error, or a top level that is not a mapping (a list
    for a ``.jsonl``), raises ValueError naming ``path``."""
    try:
        data = parse(path.read_text())
    except errors as e:
        raise ValueError(f"{path}: cannot parse: {e}") from None
    want = list if path.suffix == ".jsonl" else dict
    if not isinstance(data, want):
        raise ValueError(f"{path}: top level must be a {'list of objects' if want is list else 'mapping'}, "
                         f"got {type(data).__name__}")
    return data


def _read_run(run_dir: Path) -> tuple[dict, list[dict], dict]:
    import yaml

    for name in ("config.yaml", "metrics.jsonl", "summary.json"):
        if not (run_dir / name).is_file():
            raise FileNotFoundError(f"{run_dir / name}: not found (a run directory of `moe-async train` has "
                                    "config.yaml, metrics.jsonl and summary.json)")
    cfg = _parse_file(run_dir / "config.yaml", yaml.safe_load, yaml.YAMLError)
    steps = _parse_file(run_dir / "metrics.jsonl",
                        lambda t: [json.loads(x) for x in t.splitlines() if x.strip()], ValueError)
    if any(not isinstance(x, dict) for x in steps):
        raise ValueError(f"{run_dir / 'metrics.jsonl'}: every line must be a JSON object")
    summary = _parse_file(run_dir / "summary.json", json.loads, ValueError)
    if not steps:
        raise ValueError(f"{run_dir / 'metrics.jsonl'}: no steps logged")
    for k in ("train/step_time_s", "train/samples", "train/response_tokens", "perf/step_seconds",
              "perf/tokens_per_s", "perf/trainer_idle_frac"):
        if k not in steps[-1]:
            raise ValueError(f"{run_dir / 'metrics.jsonl'}: metric {k!r} missing (written by an older moe-async?)")
    return cfg, steps, summary


def measured(run_dir: str | Path) -> dict[str, Any]:
    """What a real run measured, per step and overall, in the simulator's terms.

    Per-step wait and engine busy seconds are read from ``perf/wait_seconds`` and
    ``perf/engine_busy_seconds`` when logged, else derived from the cumulative fractions:
    loop time at step k = cumulative response tokens / ``perf/tokens_per_s``, wait = the
    increase of ``perf/trainer_idle_frac`` x loop time.
    """
    run_dir = Path(run_dir)
    cfg, steps, summary = _read_run(run_dir)
    cum_tok, el_prev, idle_prev, busy_prev = 0.0, 0.0, 0.0, 0.0
    per = []
    for m in steps:
        cum_tok += m["train/response_tokens"]
        el = cum_tok / m["perf/tokens_per_s"]
        idle = m["perf/trainer_idle_frac"] * el
        busy = (1.0 - m["perf/engine_idle_frac"]) * el if "perf/engine_idle_frac" in m else float("nan")
        per.append({
            "loop_s": el,
            "step_s": el - el_prev,
            "wait_s": m.get("perf/wait_seconds", idle - idle_prev),
            "busy_s": m.get("perf/engine_busy_seconds", busy - busy_prev),
            "train_s": m["train/step_time_s"],
            "sync_s": m.get("sync/seconds", 0.0) + m.get("sync/check_seconds", 0.0),
            "pause_s": m.get("sync/pause_seconds", 0.0),
            "samples": m["train/samples"],
            "tokens": m["train/response_tokens"],
            "driver_step_s": m["perf/step_seconds"],
        })
        el_prev, idle_prev, busy_prev = el, idle, busy
    a = cfg.get("async", {})
    perf = summary.get("perf", {})
    last = steps[-1]
    hist = {int(k.rsplit("/", 1)[1]): 0.0 for m in steps for k in m if k.startswith("buffer/staleness_hist/")}
    for m in steps:
        for k in m:
            if k.startswith("buffer/staleness_hist/"):
                hist[int(k.rsplit("/", 1)[1])] += m[k]
    return {
        "run_dir": str(run_dir),
        "config": cfg,
        "mode": a.get("mode"),
        "K": int(a.get("max_staleness", 0)),
        "per_step": per,
        "samples_per_s": perf.get("perf/samples_per_s", last.get("perf/samples_per_s")),
        "trainer_idle_frac": perf.get("perf/trainer_idle_frac", last["perf/trainer_idle_frac"]),
        "engine_idle_frac": perf.get("perf/engine_idle_frac", last.get("perf/engine_idle_frac")),
        "loop_seconds": perf.get("loop_seconds", per[-1]["loop_s"]),
        "step_s_mean": per[-1]["loop_s"] / len(per),
        "steady_samples_per_s": _steady(per),
        "staleness_hist_tokens": {k: int(v) for k, v in sorted(hist.items())},
        # cumulative; the driver logs a reason once it has happened, so absent = none
        "stale_dropped_groups": int(last.get("buffer/dropped/stale", 0)),
        "rollout": summary.get("rollout", {}),
    }


def measured_from_bench(path: str | Path) -> list[dict[str, Any]]:
    """The runs of one ``tools/bench_async.py --json`` file, each as :func:`measured` returns it
    (sync first). The config is rebuilt from the file's ``config`` and ``overrides``; per-step
    loop time is the driver's ``perf/step_seconds``.

    Raises: ValueError naming the file when it lacks the per-mode ``modes`` section.
    """
    from moe_async.config import load_config

    path = Path(path)
    data = _parse_file(path, json.loads, ValueError)
    if not isinstance(data.get("modes"), dict) or "config" not in data:
        raise ValueError(f"{path}: not a tools/bench_async.py --json file with 'modes' and 'config'")
    out = []
    for mode in sorted(data["modes"], key=lambda m: m != "sync"):
        res = data["modes"][mode]
        k = 0 if mode == "sync" else int(data.get("staleness", 2))
        steps = res["steps"]
        cfg = load_config(data["config"], [*data.get("overrides", []), f"async.mode={mode}",
                                           f"async.max_staleness={k}", f"num_steps={len(steps)}"])
        per, el = [], 0.0
        for st in steps:
            el += st["step_s"]
            per.append({"loop_s": el, "step_s": st["step_s"], "wait_s": st["wait_s"],
                        "busy_s": st["engine_busy_s"] if st.get("engine_busy_s") is not None else float("nan"),
                        "train_s": st["train_s"], "sync_s": st.get("sync_s") or 0.0,
                        "pause_s": st.get("pause_s") or 0.0, "samples": st["samples"],
                        "tokens": st["samples"] * st["response_len_mean"], "driver_step_s": st["step_s"]})
        perf = res["perf"]
        out.append({"run_dir": f"{path}:{mode}", "config": cfg.model_dump(by_alias=True), "mode": mode, "K": k,
                    "per_step": per, "samples_per_s": perf["perf/samples_per_s"],
                    "trainer_idle_frac": perf["perf/trainer_idle_frac"],
                    "engine_idle_frac": perf.get("perf/engine_idle_frac"),
                    "loop_seconds": perf.get("loop_seconds", el), "step_s_mean": el / len(per),
                    "steady_samples_per_s": _steady(per),
                    "staleness_hist_tokens": {}, "rollout": {}})
    return out


def _load_measured(src: str | Path) -> list[dict[str, Any]]:
    """A run directory (one run) or a bench_async ``--json`` file (its runs, sync first)."""
    return measured_from_bench(src) if str(src).endswith(".json") else [measured(src)]


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else 0.0


def _steady(per: list[dict]) -> float:
    """Trained samples / loop time of steps 2..N (all steps when there is one)."""
    tail = per[1:] if len(per) > 1 else per
    return sum(p["samples"] for p in tail) / sum(p["step_s"] for p in tail)


def _bisect(f: Callable[[float], float], target: float, lo: float, hi: float, iters: int = 40,
            grow: bool = True) -> float:
    """x in [lo, hi] with f(x) ~= target for an increasing f (clamped to lo; beyond hi only
    when ``grow``, doubling it)."""
    if f(lo) >= target:
        return lo
    while f(hi) < target:
        if not grow or hi > 1e6:
            return hi
        hi *= 2
    for _ in range(iters):
        mid = (lo + hi) / 2
        if f(mid) < target:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def config_from_run(meas: dict[str, Any], polled: bool = False) -> SimConfig:
    """Pipeline shape (B, G, engines, caps, lengths, sync interval, pause mode) of a run;
    ``polled``: the run's buffer waits polled (moe-async before its event-driven waits)."""
    rc = meas["config"]
    r, e, w, a = rc.get("rollout", {}), rc.get("engine", {}), rc.get("weight_sync", {}), rc.get("async", {})
    per = meas["per_step"]
    n_samp = sum(p["samples"] for p in per)
    mean_len = sum(p["tokens"] for p in per) / max(1.0, n_samp)
    max_new = int(r.get("max_new_tokens", 32))
    # lengths: fixed when every sample hit one length; else lognormal with the measured mean and
    # a log-sd inferred from the spread of the per-step means (CLT: sd(step mean) = sd / sqrt(n))
    means = [p["tokens"] / p["samples"] for p in per if p["samples"]]
    spread = (sum((x - mean_len) ** 2 for x in means) / max(1, len(means) - 1)) ** 0.5 if len(means) > 1 else 0.0
    per_step_n = n_samp / max(1, len(per))
    if spread < 1e-9 or mean_len >= max_new - 1e-9:
        lengths, sigma = "fixed", 0.0
    else:
        cv = spread * per_step_n ** 0.5 / mean_len
        lengths, sigma = "lognormal", math.sqrt(math.log1p(cv * cv))
    mode = a.get("mode", "fully_async")
    return SimConfig(
        mode=mode, max_staleness=int(a.get("max_staleness", 1)), num_steps=len(per),
        groups_per_step=int(r.get("prompts_per_step", 4)), samples_per_group=int(r.get("n_samples_per_prompt", 4)),
        max_concurrent_groups=int(r.get("max_concurrent_groups", 4)), num_engines=int(e.get("num_engines", 1)),
        max_running_requests=int(e.get("max_running_requests", 16)), prompt_tokens=0,
        lengths=lengths, length_mean=max(1.0, mean_len), length_sigma=sigma, max_new_tokens=max_new,
        sync_interval=int(w.get("interval_steps", 1)), pause_mode=e.get("pause_mode", "abort"),
        partial_rollout=bool(r.get("partial_rollout", True)), max_abort_retries=int(r.get("max_abort_retries", 16)),
        admit_poll_s=float(r.get("admit_poll_s", 0.05)) if polled else 0.0, batch_poll_s=0.05 if polled else 0.0,
    )


def stage_times(meas: dict[str, Any]) -> dict[str, float]:
    """Trainer-side stage times of a measured run (see :func:`calibrate`): ``train_fixed_s``,
    ``train_per_token_s``, ``first_step_extra_s``, ``sync_fixed_s`` (``sync_bytes`` = 0),
    ``pause_s``, ``step_overhead_s``."""
    per = meas["per_step"]
    st = per[1:] if len(per) > 1 else per
    train = [p["train_s"] for p in st]
    toks = [p["tokens"] for p in st]
    tm = _mean(toks)
    per_tok, fixed = 0.0, _mean(train)
    if len(st) >= 3 and tm > 0 and (max(toks) - min(toks)) / tm > 0.05:
        cov = sum((x - tm) * (y - fixed) for x, y in zip(toks, train))
        var = sum((x - tm) ** 2 for x in toks)
        per_tok = max(0.0, cov / var)
        fixed = max(0.0, fixed - per_tok * tm)
    first_extra = max(0.0, per[0]["train_s"] - (fixed + per_tok * per[0]["tokens"]))
    sync_s = _mean([p["sync_s"] for p in st])
    pause_s = min(sync_s, _mean([p["pause_s"] for p in st]))
    overhead = max(0.0, _mean([p["step_s"] - p["wait_s"] - p["train_s"] - p["sync_s"] for p in st]))
    return {"train_fixed_s": fixed, "train_per_token_s": per_tok, "first_step_extra_s": first_extra,
            "sync_fixed_s": sync_s, "sync_bytes": 0.0, "pause_s": pause_s, "step_overhead_s": overhead}


def calibrate(run_dir: str | Path | dict, prefill_steps: float = 1.0, polled: bool = False,
              decode_per_seq_s: float = 0.0) -> tuple[SimConfig, dict[str, Any]]:
    """Fit the model's stage times to one real run (best: ``sync``, 1 engine, 1 trainer).

    Fitted (steps 2.. are steady state; step 1 carries start-up):
      * ``train_fixed_s`` (+ ``train_per_token_s`` by least squares when the batch's response
        tokens vary by more than 5% across steps; prompt tokens are not logged and sit in the
        fixed part), ``first_step_extra_s`` = step 1's train time - the fit;
      * ``sync_fixed_s`` = mean ``sync/seconds`` (+ check seconds), ``pause_s`` = mean
        ``sync/pause_seconds``;
      * ``step_overhead_s`` = mean(step - wait - train - sync) (driver bookkeeping);
      * ``decode_step_s`` (with ``prefill_s = prefill_steps x decode_step_s``) by bisection so
        that the simulated engine busy seconds per step equal the measured ones;
      * ``group_overhead_s`` (reward + put) by bisection so that the simulated trainer wait per
        step equals the measured one (when even 0 leaves the model waiting longer: ``poll_phase``,
        the fraction of the poll intervals after which the polls see a change, instead);
      * ``startup_s`` so that the first step's simulated wait equals the measured one.

    One run at one decode batch size cannot separate batch-size scaling from per-step cost:
    ``decode_step_per_seq_s`` is taken as given (``decode_per_seq_s``, default 0: batching
    is free) and ``decode_step_s`` fitted around it. What-ifs that change the decode batch
    (``max_concurrent_groups``, ``max_running_requests``) depend on that value.

    ``run_dir`` may also be an already loaded :func:`measured` dict.

    Returns: ``(config, fit)`` with ``fit`` the measured targets and fitted values.
    Raises: FileNotFoundError / ValueError naming the file or metric that is missing.
    """
    meas = run_dir if isinstance(run_dir, dict) else measured(run_dir)
    base = config_from_run(meas, polled)
    per = meas["per_step"]
    st = per[1:] if len(per) > 1 else per
    stage = stage_times(meas)
    busy_target = _mean([p["busy_s"] for p in st])
    wait_target = _mean([p["wait_s"] for p in st])
    cfg = dataclasses.replace(base, **stage, group_overhead_s=0.0, startup_s=0.0,
                              decode_step_per_seq_s=decode_per_seq_s)

    def steady(r: dict, key: str) -> float:
        xs = r[key][1:] if len(r[key]) > 1 else r[key]
        return _mean(xs)

    def with_decode(d: float) -> SimConfig:
        return dataclasses.replace(cfg, decode_step_s=d, prefill_s=prefill_steps * d)

    def busy_of(d: float) -> float:
        return steady(simulate(with_decode(d)), "engine_busy_seconds")

    decode = _bisect(busy_of, busy_target, 1e-6, 1.0) if busy_target == busy_target and busy_target > 0 else 0.02
    cfg = with_decode(decode)
    g_over = _bisect(lambda x: steady(simulate(dataclasses.replace(cfg, group_overhead_s=x)), "wait_seconds"),
                     wait_target, 0.0, 1.0)
    cfg = dataclasses.replace(cfg, group_overhead_s=g_over)
    if g_over == 0.0 and polled:  # the model waits longer than measured even without reward time: the
        # polls saw the changes sooner than a uniformly random phase would (fit that fraction)
        phase = _bisect(lambda x: steady(simulate(dataclasses.replace(cfg, poll_phase=x)), "wait_seconds"),
                        wait_target, 0.0, 1.0, grow=False)
        cfg = dataclasses.replace(cfg, poll_phase=phase)
    w1 = simulate(cfg)["wait_seconds"][0]
    cfg = dataclasses.replace(cfg, startup_s=max(0.0, per[0]["wait_s"] - w1))
    final = simulate(cfg)
    fit = {
        "run_dir": meas["run_dir"], "mode": meas["mode"], "K": meas["K"],
        "targets": {"train_s": _mean([p["train_s"] for p in st]), "sync_s": stage["sync_fixed_s"],
                    "pause_s": stage["pause_s"], "engine_busy_s_per_step": busy_target,
                    "wait_s_per_step": wait_target, "first_wait_s": per[0]["wait_s"],
                    "overhead_s": stage["step_overhead_s"]},
        "fitted": {k: getattr(cfg, k) for k in ("train_fixed_s", "train_per_token_s", "first_step_extra_s",
                                                "sync_fixed_s", "pause_s", "step_overhead_s", "decode_step_s",
                                                "decode_step_per_seq_s",
                                                "prefill_s", "group_overhead_s", "poll_phase", "startup_s", "lengths",
                                                "length_mean", "length_sigma")},
        # what the fitted model gives for the targets (a residual left when a fit hit a bound)
        "model": {"engine_busy_s_per_step": steady(final, "engine_busy_seconds"),
                  "wait_s_per_step": steady(final, "wait_seconds"), "first_wait_s": final["wait_seconds"][0]},
    }
    return cfg, fit


# ------------------------------------------------------------------------------- CLI
def _fmt_hist(h: dict[int, int]) -> str:
    tot = sum(h.values()) or 1
    return "{" + ", ".join(f"{k}: {100 * v / tot:.0f}%" for k, v in sorted(h.items())) + "}"


def _fmt_stale_dropped(r: dict[str, Any]) -> str:
    """Groups dropped as stale at hand-out (the --json's ``drop_reasons['stale']``) and, when
    known, their share of the generated samples (``buffer.samples_dropped`` counts only stale
    drops: a cancelled admission never generated samples); ``-`` when the source lacks it."""
    if "drop_reasons" in r:
        groups = int(r["drop_reasons"].get("stale", 0))
        gen = r.get("buffer", {}).get("samples_generated", 0)
        dropped = r.get("buffer", {}).get("samples_dropped", 0)
        return f"{groups} ({100 * dropped / gen:.0f}%)" if gen else str(groups)
    if r.get("stale_dropped_groups") is not None:
        return str(int(r["stale_dropped_groups"]))
    return "-"


def _table(rows: list[tuple[str, dict[str, Any]]]) -> str:
    """The console table. ``stale_dropped``: groups dropped as stale at hand-out (share of the
    generated samples in parentheses when known), see :func:`_fmt_stale_dropped`."""
    out = [f"{'':<22} {'K':>2} {'step_s':>8} {'samples/s':>9} {'steady':>7} {'trainer_idle':>12} {'engine_idle':>11}"
           f" {'speedup':>7} {'stale_dropped':>13}  staleness(tokens)"]
    for label, r in rows:
        ei = r.get("engine_idle_frac")
        out.append(f"{label:<22} {r['K']:>2} {r['step_s_mean']:8.3f} {r['samples_per_s']:9.3f} {r['steady_samples_per_s']:7.3f}"
                   f" {r['trainer_idle_frac']:12.3f} {ei if ei is not None else float('nan'):11.3f}"
                   f" {r.get('speedup', float('nan')):7.2f} {_fmt_stale_dropped(r):>13}  {_fmt_hist(r['staleness_hist_tokens'])}")
    return "\n".join(out)


def _parse_set(cfg: SimConfig, items: list[str]) -> SimConfig:
    types = {f.name: f.type for f in dataclasses.fields(SimConfig)}
    kw: dict[str, Any] = {}
    for it in items:
        if "=" not in it:
            raise SystemExit(f"--set {it!r}: expected field=value")
        k, v = it.split("=", 1)
        if k not in types:
            raise SystemExit(f"--set {k}: not a SimConfig field (fields: {', '.join(types)})")
        cur = getattr(cfg, k)
        if k == "length_values":
            kw[k] = tuple(int(x) for x in v.split(",") if x)
        elif k == "pause_s":
            kw[k] = None if v.lower() in ("none", "") else float(v)
        elif isinstance(cur, bool):
            kw[k] = v.lower() in ("1", "true", "yes")
        elif isinstance(cur, int):
            kw[k] = int(v)
        elif isinstance(cur, float):
            kw[k] = float(v)
        else:
            kw[k] = v
    try:
        return dataclasses.replace(cfg, **kw)
    except ValueError as e:
        raise SystemExit(f"--set: {e}") from None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calibrate", nargs="+", metavar="RUN", default=None,
                    help="run directories or tools/bench_async.py --json files: fit to the first run "
                         "(a bench file: its sync run), compare the prediction with every run given")
    ap.add_argument("--polled", action="store_true",
                    help="the runs polled the buffer every 50 ms (moe-async before commit 93596d1)")
    ap.add_argument("--decode-per-seq", type=float, default=0.0, metavar="S",
                    help="calibration: seconds a decode step grows per running sequence (not identifiable "
                         "from one run; default 0)")
    ap.add_argument("--staleness", type=int, nargs="+", default=[1, 2, 4], help="K values to compare with sync")
    ap.add_argument("--set", action="append", default=[], metavar="field=value", help="override a SimConfig field")
    ap.add_argument("--json", default=None, help="also write the results here")
    args = ap.parse_args(argv)

    out: dict[str, Any] = {}
    if args.calibrate:
        try:
            checks = [m for src in args.calibrate for m in _load_measured(src)]
            cfg, fit = calibrate(checks[0], polled=args.polled, decode_per_seq_s=args.decode_per_seq)
        except (OSError, ValueError, KeyError) as e:
            raise SystemExit(f"--calibrate: {type(e).__name__}: {e}") from None
        cfg = _parse_set(cfg, args.set)
        print(f"[simulate] calibrated on {fit['run_dir']} (mode {fit['mode']}, K={fit['K']})")
        print("  measured: " + ", ".join(f"{k}={v:.4g}" for k, v in fit["targets"].items()))
        print("  fitted:   " + ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                                         for k, v in fit["fitted"].items()))
        print("  model:    " + ", ".join(f"{k}={v:.4g}" for k, v in fit["model"].items()))
        ks = sorted({m["K"] for m in checks if m["K"] > 0} | set(args.staleness))
        pred = compare_modes(cfg, tuple(ks))
        by_k = {r["K"]: r for r in pred}
        rows = [(f"predicted {r['mode']}", r) for r in pred]
        sync_meas = next((m for m in checks if m["K"] == 0), None)
        for m in checks:
            if sync_meas is not None:
                m["speedup"] = m["samples_per_s"] / sync_meas["samples_per_s"]
            rows.append((f"measured {m['mode']}", m))
        posthoc = {}
        for m in checks[1:]:  # the check run's own trainer-side times, the engine fit kept
            pc = dataclasses.replace(cfg, **stage_times(m), mode=m["mode"] or "fully_async", max_staleness=m["K"],
                                     startup_s=0.0, num_steps=len(m["per_step"]),
                                     train_trace_s=tuple(p["train_s"] for p in m["per_step"]),
                                     sync_trace_s=tuple(p["sync_s"] for p in m["per_step"]))
            pc = dataclasses.replace(pc, startup_s=max(0.0, m["per_step"][0]["wait_s"] - simulate(pc)["wait_seconds"][0]))
            r = simulate(pc)
            r["speedup"] = r["samples_per_s"] / pred[0]["samples_per_s"]
            posthoc[m["run_dir"]] = r
            rows.append((f"post-hoc {m['mode']}", r))
        print(_table(rows))
        comp = []
        for m in checks:
            p = by_k.get(m["K"])
            if p is None:
                continue
            comp.append({"run_dir": m["run_dir"], "mode": m["mode"], "K": m["K"],
                         **{f"{k}_{w}": (p if w == "pred" else m)[k] for k in
                            ("samples_per_s", "steady_samples_per_s", "trainer_idle_frac", "engine_idle_frac",
                             "step_s_mean")
                            for w in ("pred", "meas")}})
            if m["run_dir"] in posthoc:
                comp[-1]["samples_per_s_posthoc"] = posthoc[m["run_dir"]]["samples_per_s"]
            print(f"  {m['mode']} K={m['K']}: samples/s predicted {p['samples_per_s']:.3f} measured "
                  f"{m['samples_per_s']:.3f} ({100 * (p['samples_per_s'] / m['samples_per_s'] - 1):+.0f}%), "
                  f"steady {p['steady_samples_per_s']:.3f} vs {m['steady_samples_per_s']:.3f} "
                  f"({100 * (p['steady_samples_per_s'] / m['steady_samples_per_s'] - 1):+.0f}%); "
                  f"trainer idle {p['trainer_idle_frac']:.3f} vs {m['trainer_idle_frac']:.3f}; "
                  f"engine idle {p['engine_idle_frac']:.3f} vs {m['engine_idle_frac']:.3f}"
                  + (f"; post-hoc samples/s {posthoc[m['run_dir']]['samples_per_s']:.3f}" if m["run_dir"] in posthoc else ""))
        if posthoc:
            print("  (predicted: every parameter from the first run; post-hoc: that run's own per-step train "
                  "and sync times, driver overhead and first-step wait, the engine/reward fit of the first run)")
        out = {"fit": fit, "predicted": pred, "comparison": comp,
               "measured": [{k: v for k, v in m.items() if k not in ("config", "per_step", "rollout")} for m in checks]}
    else:
        cfg = _parse_set(cluster_scenario(), args.set)
        pred = compare_modes(cfg, tuple(args.staleness))
        print(_table([(r["mode"], r) for r in pred]))
        out = {"config": dataclasses.asdict(cfg), "predicted": pred}
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
