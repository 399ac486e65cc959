"""The driver loop of ``moe-async train``.

Prepare the checkpoint, place and start engines and trainer ranks, then: for each step take a
staleness-checked batch from the buffer, train it, sync weights to the engines, save and
evaluate when due; stop generation, checksum trainer against engines, shut down. ``sync``,
``one_step_off`` and ``fully_async`` share this loop (only the buffer's bound K differs).
Writes ``metrics.jsonl`` per step and ``summary.json`` at the end. The loop asks components
that keep their own state: :class:`~moe_async.orchestration.checkpointer.Checkpointer` (saves,
stop-and-save), :class:`~moe_async.orchestration.evaluator.Evaluator` (held-out evaluations),
:class:`~moe_async.orchestration.metrics_collector.MetricsCollector` (baselines, summary) and
:class:`~moe_async.orchestration.engine_recovery.EngineRecovery` (dead engines).

Design notes: ``docs/design/orchestration.md``."""

from __future__ import annotations

import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from moe_async.config import ExperimentConfig, dump_config
from moe_async.errors import UserInputError
from moe_async.logging.console import RunConsole
from moe_async.logging.run_logger import RunLogger, make_run_dir
from moe_async.logging.timeline import Timeline
from moe_async.affinity import check_run_placement
from moe_async.orchestration.checkpointer import Checkpointer, ray_checkpoint_writer
from moe_async.orchestration.engine_recovery import EngineRecovery
from moe_async.orchestration.eval_threads import EvalThreads
from moe_async.orchestration.evaluator import Evaluator
from moe_async.orchestration.lifecycle import (dead_engines, eval_get, init_ray, refuse_prompt_room,
                                               sigterm_to_checkpoint, sigterm_to_exit)
from moe_async.orchestration.preemption import sigterm_mode, stop_check
from moe_async.orchestration.metrics import batch_metrics, prompt_accounting
from moe_async.orchestration.metrics_collector import MetricsCollector
from moe_async.orchestration.cluster import refuse_without_gpus
from moe_async.orchestration.run_identity import StartPlan, claim, plan_start, trim_metrics
from moe_async.orchestration.run_state import DrawLedger, record_settled, resume_data
from moe_async.orchestration.save_schedule import SaveSchedule
from moe_async.orchestration.start_checks import made_model_checks, refuse_layout_before_run_dir
from moe_async.data.record import record_trained
from moe_async.orchestration.supervisor import EngineFleetError
from moe_async.trainer.ckpt_shapes import check_load_matches_config
from moe_async.types import Group, JsonDict

if TYPE_CHECKING:
    from ray.actor import ActorHandle

    from moe_async.data.check import DataCheck
    from moe_async.orchestration.engine_pool import EnginePool
    from moe_async.orchestration.teacher_pool import TeacherRecovery
    from moe_async.orchestration.trainer_group import TrainerGroup


def run_experiment(cfg: ExperimentConfig, console: RunConsole | None = None) -> JsonDict:
    """Run one experiment end to end and return its summary (also in summary.json).

    ``console`` (``moe-async train`` passes one) folds expected warnings and keeps the whole
    console text in ``<run dir>/console.log``; every run writes its timeline to
    ``<run dir>/trace.json`` (:mod:`moe_async.logging.timeline`).

    Raises: whatever a component raises (config/model/engine errors name their source);
    :class:`~moe_async.errors.UserInputError` at start-up, before Ray or any process starts,
    for a ``cpu_affinity`` core this host lacks, a bad ``trainer.load``, an unwritable
    ``trainer.save_dir``, a bad ``model.hf_path``, a layout the model cannot take or MoE kernels
    this host cannot build (no run dir is left); engines and Ray are
    shut down on every exit path.

    Summary timing: ``wall_seconds`` is the whole run from this call to the summary (start-up:
    model preparation, Ray, engines, trainer build, checkpoint load and ``eval_before``, then the
    loop, ``eval_after`` and the final checksums); ``startup_seconds`` the part before the step
    loop; ``perf.loop_seconds`` the step loop alone (the denominator of the ``perf/*_per_s``
    rates). Sample counts: ``rollout["rollout/samples_generated"]`` every sample generated and
    scored (dynamically filtered ones included); ``buffer["samples_put"]`` the samples put into
    the buffer (= ``samples_trained + samples_dropped + samples_buffered``).
    """
    t_launch = time.perf_counter()
    plan, on_sigterm, data_checked = _refuse_before_processes(cfg)
    load_path, start_step = plan.load_path, plan.start_step
    import ray

    from moe_async.models.prepare import prepare_hf_checkpoint

    # source hf only checks the directory (fast): a bad model.hf_path is refused before the run dir
    model_path = str(prepare_hf_checkpoint(cfg.model)) if cfg.model.source == "hf" else None
    # plan's model rules on the config.json known without making the model: before the run dir
    layout_checked = refuse_layout_before_run_dir(cfg)
    room_checked = refuse_prompt_room(cfg, None)  # data.max_prompt_length against the model's context
    from moe_async.agent.start_up import check_tool_parser

    check_tool_parser(cfg.rollout.agent)  # before the run dir: SGLang's parser names, no model needed
    fresh_run_dir = plan.run_dir is None or not plan.run_dir.exists()
    run_dir = make_run_dir(cfg.logging, cfg.name, plan.run_dir)
    console = console or RunConsole(install=False)
    console.attach_log(run_dir)
    timeline = Timeline(run_dir / "trace.json", on_phase=console.status)
    timeline.phase("prepare model")
    # absolute: the trainer actor's working directory need not be the driver's
    save_dir = str(plan.save_dir or run_dir / "checkpoints")
    _keep_superseded_metrics(plan, run_dir, fresh_run_dir)
    (run_dir / "config.yaml").write_text(dump_config(cfg))
    print(f"[moe-async] run dir: {run_dir}", flush=True)
    model_path = model_path or str(prepare_hf_checkpoint(cfg.model))  # other sources: made (and cached) here
    print(f"[moe-async] model: {model_path}", flush=True)
    try:
        made_model_checks(cfg, model_path, room_checked, layout_checked)
    except UserInputError:
        if fresh_run_dir:
            shutil.rmtree(run_dir, ignore_errors=True)  # a refused start leaves no (new) run dir
        raise
    # after the last refusal: a refused start leaves no claim (and no new directory) in save_dir
    if cfg.trainer.save_interval or on_sigterm == "checkpoint":  # this run's checkpoints: no other run writes there
        claim(Path(save_dir), plan.run_id or run_dir.name, run_dir)
    logger = RunLogger(cfg.logging, run_dir, cfg.name, cfg.model_dump(by_alias=True))

    init_ray(engine_log_dir=str(run_dir / "logs"))
    prev_sigterm = sigterm_to_checkpoint() if on_sigterm == "checkpoint" else sigterm_to_exit()
    procs = _Procs()
    summary: JsonDict = {"run_dir": str(run_dir), "seed": cfg.seed, "num_steps": cfg.num_steps}
    if data_checked is not None:
        summary["data"] = data_checked
    metrics = MetricsCollector(summary)
    try:
        run = _start(cfg, procs, model_path, load_path, start_step, summary, timeline, logger, console, run_dir,
                     on_sigterm == "checkpoint")
        ckpt = Checkpointer(SaveSchedule(cfg.trainer.save_interval, cfg.num_steps, start_step),
                            ray_checkpoint_writer(run.trainer, run.rollout, run.buffer, run.ledger, save_dir,
                                                  cfg.effective_staleness, _rget, _BUFFER_REPLY_S),
                            summary, lambda: _rget(run.rollout.data_state.remote(), "rollout.data_state"),
                            lambda s: timeline.phase("save", s, label=f"step {s}/{cfg.num_steps}: checkpoint"))
        eval_s = cfg.rollout.eval_timeout_s
        evaluator = Evaluator(
            cfg.eval_before, cfg.eval_after, cfg.rollout.eval_interval, cfg.num_steps,
            lambda: eval_get(run.rollout.evaluate_curve.remote(), "held-out curve point", eval_s),
            lambda label: eval_get(run.rollout.evaluate.remote(), f"held-out eval ({label})", eval_s),
            summary, timeline, run_dir, resumed=load_path is not None,
            teacher_point=(lambda: eval_get(run.rollout.evaluate_teacher.remote(), "teacher held-out eval", eval_s))
            if cfg.teacher.enabled and cfg.teacher.eval else None,
            engine_threads=EvalThreads(run.recovery.live_urls, cfg.engine.eval_num_threads, cfg.engine.num_threads))
        ev0 = evaluator.before(start_step)  # eval_before and the curve's first point, before generation
        if ev0:
            logger.log(ev0, start_step)
        rm0 = _rget(run.rollout.metrics.remote(), "rollout.metrics")  # after eval_before: not the loop's requests
        _rget(run.rollout.start.remote(), "rollout.start")
        metrics.start(rm0)
        step, version, m = _step_loop(run, ckpt, evaluator, metrics, start_step)
        _rget(run.rollout.stop.remote(), "rollout.stop")
        metrics.loop_done(m, _rget(run.buffer.stats.remote(), "buffer.stats"),
                          _rget(run.rollout.metrics.remote(), "rollout.metrics"))
        evaluator.after(step)
        timeline.idle()
        evaluator.report_curve()
        _final_summary(run, summary, version)
        summary["trainer_world_size"] = run.trainer.world_size
        summary["wall_seconds"] = time.perf_counter() - t_launch  # the whole run, start-up included
        summary["startup_seconds"] = metrics.t_loop0 - t_launch
        logger.summary(summary)
        run.trainer.shutdown()
        _rget(run.rollout.close.remote(), "rollout.close")
    except Exception as e:
        dead = dead_engines(procs.engines) if procs.engines is not None else []
        if dead and not isinstance(e, EngineFleetError):  # name the engine that died, not the HTTP error
            raise RuntimeError("; ".join(dead)) from e
        raise
    finally:
        try:
            procs.shutdown()
        finally:
            logger.close()
            timeline.write()
            ray.shutdown()
            if prev_sigterm is not None:
                import signal

                signal.signal(signal.SIGTERM, prev_sigterm)
    console.report_hidden()
    print(f"[moe-async] done. run files: {run_dir}", flush=True)
    if cfg.logging.wandb_mode == "offline":
        print(f"[moe-async] wandb offline run: sync later with `{wandb_command()} sync {run_dir / 'wandb'}/offline-run-*`",
              flush=True)
    return summary


def _step_loop(run: _Run, ckpt: Checkpointer, evaluator: Evaluator, metrics: MetricsCollector,
               start_step: int) -> tuple[int, int, dict[str, float]]:
    """Steps ``start_step + 1 .. num_steps``: wait for a batch, train it, sync, save, log.
    Returns (the last step begun, the trainer's weight_version, the last step's metrics)."""
    cfg, trainer, rollout, buffer, timeline = run.cfg, run.trainer, run.rollout, run.buffer, run.timeline
    n, step, version = cfg.num_steps, start_step, trainer.version()
    synced, m = version, dict[str, float]()
    for step in range(start_step + 1, n + 1):
        t0 = time.perf_counter()
        timeline.phase("wait", step, label=f"step {step}/{n}: waiting for a batch")
        groups, synced = _next_batch(run, version, synced)
        if groups is None:  # pre-emption while waiting: the last finished step's checkpoint, then out
            ckpt.stop(step - 1, run.stop(), waiting_for=step)
            break
        t1 = time.perf_counter()
        metrics.waited(t0, t1)
        timeline.phase("train", step, label=f"step {step}/{n}: train step")
        m = batch_metrics(groups, version)
        m.update(trainer.train_step(groups))  # every rank; a dead engine or rank fails it, named
        version = trainer.version()
        record_settled(run.ledger, groups, rollout, buffer, _BUFFER_REPLY_S)
        if cfg.data.enabled:  # trained_rows.jsonl: file row and prompt ids of each trained group
            record_trained(run.run_dir, step, groups)
        # the prompt position before the sync opens admission for the next version: in sync
        # mode it is exactly the prompts trained, so a resumed run draws what this one would
        data = ckpt.data_before_sync(step)
        if step % cfg.weight_sync.interval_steps == 0 or step == n:
            timeline.phase("sync", step, label=f"step {step}/{n}: weight sync")
            m.update(run.recovery.check())  # the group's members are the live engines
            m.update(run.recovery.sync())  # an engine lost during it: restarted/retired, all re-synced
            synced = int(m["engine/weight_version"])
            if cfg.trainer.lora is not None:  # adapter-only sync: new requests on the newest adapter
                _rget(rollout.set_lora_path.remote(f"policy@{synced}"), "rollout.set_lora_path")
        m.update(ckpt.after_step(step, data))  # perf/save_seconds when it saved
        metrics.counted(m)
        metrics.step(m, _rget(buffer.stats.remote(), "buffer.stats"), _rget(rollout.metrics.remote(), "rollout.metrics"),
                     t0, t1, version, synced, run.recovery.metrics())
        timeline.end_step(step, m["perf/wait_straggler_seconds"], _rget(rollout.trace_spans.remote(), "rollout.trace_spans"))
        m.update(evaluator.at_step(step))  # every rollout.eval_interval steps and at the last step
        metrics.evaluated(m)  # the perf/* rates count the loop without evaluations
        run.logger.log(m, step)
        run.console.report_hidden()  # one line, only when expected warnings were hidden since the last
        run.logger.console_step(step, n, m)
        if run.stop() and step < n:  # launch/slurm's pre-emption signal
            ckpt.stop(step, run.stop())
            break
    return step, version, m


def _next_batch(run: _Run, version: int, synced: int) -> tuple[list[Group] | None, int]:
    """The buffer's batch for ``version`` (None: a stop was asked while waiting) and the
    engines' weight_version, after the engine recovery checks run between 1 s waits.

    Raises: RuntimeError when the rollout loop died (its error); a bounded wait names a lost reply."""
    groups = None
    while groups is None:
        rec = run.recovery.check()  # a dead engine: restarted and re-synced, or retired
        if run.teacher_recovery is not None:
            run.teacher_recovery.check()
        synced = int(rec.get("engine/weight_version", synced))
        # a bounded wait for the buffer's own wait: a lost reply (seen once in CI after an
        # engine was killed) must fail the run instead of hanging it; 1 s buffer waits: a
        # SIGTERM or a dead engine is seen within about a second
        groups = _get_watching(run.buffer.get_batch.remote(version, 1.0), None, _BUFFER_REPLY_S)
        err = _get_watching(run.rollout.error.remote(), None, _BUFFER_REPLY_S)
        if err:
            raise RuntimeError(f"rollout loop died: {err}")
        if groups is None and run.stop():  # pre-emption while waiting for a batch: stop now
            break
    return groups, synced


@dataclass
class _Procs:
    """What the run started (None until started); :meth:`shutdown` on every exit path."""

    engines: EnginePool | None = None
    trainer: TrainerGroup | None = None
    teacher_pool: EnginePool | None = None

    def shutdown(self) -> None:
        if self.trainer is not None:
            self.trainer.kill()  # no rank left blocked in a collective
        if self.engines is not None:
            self.engines.shutdown()
        if self.teacher_pool is not None:
            self.teacher_pool.shutdown()


@dataclass
class _Run:
    """The started run the step loop asks (Ray actor handles for ``rollout``/``buffer``)."""

    cfg: ExperimentConfig
    trainer: TrainerGroup
    rollout: ActorHandle
    buffer: ActorHandle
    recovery: EngineRecovery
    teacher_recovery: TeacherRecovery | None
    ledger: DrawLedger
    timeline: Timeline
    logger: RunLogger
    console: RunConsole
    run_dir: Path
    urls: list[str]
    stop: Callable[[], str | None]  # the pre-emption check (preemption.StopCheck)


def _start(cfg: ExperimentConfig, procs: _Procs, model_path: str, load_path: str | None, start_step: int,
           summary: JsonDict, timeline: Timeline, logger: RunLogger, console: RunConsole, run_dir: Path,
           stop_on_sigterm: bool) -> _Run:
    """Place and start engines (the teacher's, the rollout actor), the trainer ranks, load ``load_path`` (synced
    to the engines), the buffer, the saved data side back; ``stop_on_sigterm``: SIGTERM stops after a checkpoint."""
    from moe_async.orchestration.rollout_actor import RolloutActor
    from moe_async.orchestration.buffer_actor import BufferActor
    from moe_async.orchestration.engine_pool import EnginePool
    from moe_async.orchestration.placement import (check_tensor_transport_nodes, cluster_gpus, place_engines,
                                                   place_trainer)
    from moe_async.orchestration.trainer_group import TrainerGroup

    teacher_urls = teacher_recovery = None
    # both pools placed first (each its own devices or cores), so a cluster short of them
    # fails before anything starts; then the engines start (in parallel) and the ranks
    refuse_without_gpus(cfg, cluster_gpus(), "the Ray cluster")  # before any bundle is placed
    trainer_slots, engine_slots = place_trainer(cfg), place_engines(cfg)
    check_tensor_transport_nodes(cfg, trainer_slots, engine_slots)  # memory handles stay on one host
    engines = procs.engines = EnginePool(cfg, model_path, placement=engine_slots)
    timeline.phase("start engines")
    engines.start()  # their servers start while the teacher's and the trainer ranks do (2 cores: ~10 s less)
    rollout = RolloutActor.remote(cfg, model_path)  # type: ignore[attr-defined]  # its tokenizer and prompts too
    if cfg.teacher.enabled:  # distillation: the teacher's own servers (moe_async/distill)
        from moe_async.orchestration.teacher_pool import start_teacher

        timeline.phase("start teacher")
        procs.teacher_pool, teacher_urls = start_teacher(cfg, model_path)
        print(f"[moe-async] teacher: {', '.join(teacher_urls or [])}", flush=True)
        if procs.teacher_pool is not None:  # a dead teacher engine: restarted (same URL), or the run stops
            from moe_async.orchestration.teacher_pool import TeacherRecovery

            te = cfg.teacher.engine
            teacher_recovery = TeacherRecovery(procs.teacher_pool, te.max_restarts, te.startup_timeout_s)
    timeline.phase("build trainer")
    # no engine watch while the engines start (their actors answer once started): wait() names a failed one
    trainer = procs.trainer = TrainerGroup(cfg, model_path, placement=trainer_slots)
    timeline.phase("wait engines")
    urls = engines.wait()
    trainer.watch = engines.dead_engines  # an engine dying while the ranks connect or load: named
    lay = cfg.trainer.layout
    print(f"[moe-async] trainer: {trainer.world_size} rank(s) (TP{lay.tp} PP{lay.pp} CP{lay.cp} EP{lay.ep} "
          f"ETP{lay.etp} DP{lay.dp}) on {len(set(trainer_slots.node_ids))} node(s), rendezvous "
          f"{trainer.master_addr}:{trainer.master_port}; engines: {', '.join(urls)}", flush=True)
    trainer.connect_engines(urls)
    resumed: JsonDict = {}
    if load_path is not None:
        resumed = trainer.load_checkpoint(load_path)
        summary["resumed_from"] = load_path
        summary["start_step"] = start_step
        summary["loaded_weights_digest"] = weights_digest(trainer.checksums())
        sync_m = trainer.sync_weights()  # engines get the loaded weights
        if cfg.weight_sync.check:
            sync_m.update(trainer.check_engines(urls))
        summary["resume_sync"] = sync_m
        print(f"[moe-async] resumed from {load_path} at step {start_step} "
              f"(weight_version {trainer.version()})", flush=True)
    B, K = cfg.rollout.prompts_per_step, cfg.effective_staleness
    buffer = BufferActor.remote(B, K, trainer.version())  # type: ignore[attr-defined]  # v0 = loaded version
    _rget(rollout.connect.remote(urls, buffer, teacher_urls), "rollout.connect")
    if cfg.trainer.lora is not None and load_path is not None:  # the resumed adapter, synced above
        _rget(rollout.set_lora_path.remote(f"policy@{trainer.version()}"), "rollout.set_lora_path")
    # engine failures: dead engines restarted/retired between waits, and one lost during a weight
    # sync (recovery.sync): the trainer's calls no longer fail on a dead engine
    recovery = EngineRecovery(cfg, engines, trainer, rollout, buffer, _BUFFER_REPLY_S)
    trainer.watch = None
    ledger = DrawLedger(resumed.get("run_state"))  # the trained frontier (run_state.py)
    # pre-emption: the driver's SIGTERM flag, or one a trainer rank reports (preemption.py)
    stop = stop_check(trainer, stop_on_sigterm)
    if resumed:  # the saved buffer back (stale ones dropped); prompts from the frontier, none drawn twice
        summary["buffer_restored"] = resume_data(ledger, resumed, buffer, rollout, trainer.version(), _BUFFER_REPLY_S)
    return _Run(cfg, trainer, rollout, buffer, recovery, teacher_recovery, ledger, timeline, logger, console,
                run_dir, urls, stop)


def _final_summary(run: _Run, summary: JsonDict, version: int) -> None:
    """After generation stopped: engines checked (one that died after the last sync back at
    this version), prompt accounting, the draw ledger, trainer-vs-engine checksums, the LoRA
    adapter exported."""
    from moe_async.engines.client import SyncEngineClient

    trainer_sums = run.trainer.checksums()
    run.recovery.check()  # an engine that died after the last sync: back, at this version
    summary["engines"] = {**run.recovery.metrics(), "events": run.recovery.events}
    summary["accounting"] = prompt_accounting(summary["buffer"])
    record_settled(run.ledger, [], run.rollout, run.buffer, _BUFFER_REPLY_S)
    summary["draws"] = run.ledger.state_dict()  # the trained frontier and what was settled beyond it
    engine_sums = [SyncEngineClient(u).weights_checksum() for u in run.recovery.live_urls()]
    summary["final_weights_match"] = all(e["checksums"] == trainer_sums for e in engine_sums)
    summary["final_weight_version"] = version
    summary["final_weights_digest"] = weights_digest(trainer_sums)
    summary["engine_weight_versions"] = [e["weight_version"] for e in engine_sums]
    summary["engine_weights_match"] = [e["checksums"] == trainer_sums for e in engine_sums]
    if run.cfg.trainer.lora is not None:  # the run's product: the last trained adapter, PEFT format
        summary["adapter_dir"] = run.trainer.export_adapter(str(run.run_dir / "adapter"))
        print(f"[moe-async] LoRA adapter (PEFT, step {summary.get('stopped_at_step', run.cfg.num_steps)}, "
              f"weight_version {version}): {summary['adapter_dir']}", flush=True)
        if run.cfg.trainer.lora.merge_and_unload:  # the base with the adapter merged: a full HF checkpoint
            summary["merged_dir"] = run.trainer.export_merged(str(run.run_dir / "merged"))
            print(f"[moe-async] merged model (base + LoRA, HF): {summary['merged_dir']}", flush=True)


def _refuse_before_processes(cfg: ExperimentConfig) -> tuple[StartPlan, str, DataCheck | None]:
    """Start-up checks before Ray or any process starts: cores, the run's id/dir/checkpoint
    (``plan_start``), GPUs, MoE kernels, ``MOE_ASYNC_SIGTERM``, ``trainer.save_dir``, prompt
    files. Returns (the start plan, the SIGTERM mode, the prompt files' check or None).
    Raises UserInputError naming the field."""
    if not os.environ.get("RAY_ADDRESS"):  # a local run (init_ray): every process starts on this host's cores
        tch = cfg.teacher
        check_run_placement(cfg.trainer.cpu_affinity, cfg.engine.cpu_affinity,  # before any process
                            tch.engine.cpu_affinity if tch.enabled and not tch.urls else None)
    # the run's id, run dir and save_dir's owner, trainer.resume=auto, trainer.load
    plan = plan_start(cfg, resolve_checkpoint)
    refuse_without_gpus(cfg)  # engine.backend=sglang (or the teacher's) on a host without GPUs (a local run)
    if not os.environ.get("RAY_ADDRESS"):  # the trainer runs on this host: its MoE kernels must build here
        from moe_async.trainer.moe_kernels import refuse_unavailable_kernels

        try:
            refuse_unavailable_kernels(cfg.trainer)
        except ValueError as e:
            raise UserInputError(str(e)) from None
    try:
        on_sigterm = sigterm_mode()  # MOE_ASYNC_SIGTERM: refused before any process starts
    except ValueError as e:
        raise UserInputError(str(e)) from None
    check_save_dir(cfg, on_sigterm == "checkpoint")  # an explicit trainer.save_dir: refused now, not at the first save
    data_checked: DataCheck | None = None
    if cfg.data.enabled:  # prompt files: every table, key and data_source reward checked before any process
        from moe_async.data.check import check_data

        try:
            data_checked = check_data(cfg.data)
        except ValueError as e:
            raise UserInputError(str(e)) from None
    return plan, on_sigterm, data_checked


def _keep_superseded_metrics(plan: StartPlan, run_dir: Path, fresh_run_dir: bool) -> None:
    """A run that continues in its own dir: the metrics (and ``trained_rows.jsonl``) lines of
    steps that run again are moved to ``metrics.superseded.jsonl`` (``trained_rows.superseded.jsonl``);
    the metrics count is printed."""
    if not plan.auto_resumed and fresh_run_dir:
        return
    # from the checkpoint's step, or (the run's own dir, no checkpoint) from step 0: later steps run again
    keep = plan.start_step if plan.auto_resumed or plan.start_step else -1
    trim_metrics(run_dir, keep, "trained_rows.jsonl")  # their rows are recorded again
    moved = trim_metrics(run_dir, keep)
    if plan.auto_resumed:
        print(f"[moe-async] trainer.resume=auto: run {plan.run_id} continues from {plan.load_path} (step "
              f"{plan.start_step}" + (f"; {moved} later metrics line(s) moved to metrics.superseded.jsonl"
                                      if moved else "") + ")", flush=True)
    elif moved:
        print(f"[moe-async] run {plan.run_id}: no checkpoint to resume; {moved} earlier metrics line(s) "
              "moved to metrics.superseded.jsonl", flush=True)


def wandb_command() -> str:
    """The ``wandb`` executable to suggest: the one next to this Python (the project's venv,
    ``.venv/bin/wandb`` as the README writes it when run from the repository), relative to the
    working directory when under it; plain ``wandb`` when there is none."""
    import sys

    exe = Path(sys.executable).parent / "wandb"
    if not exe.is_file():
        return "wandb"
    try:
        return str(exe.relative_to(Path.cwd()))
    except ValueError:
        return str(exe)


def check_save_dir(cfg: ExperimentConfig, sigterm_checkpoint: bool = False) -> None:
    """With checkpoints on (``trainer.save_interval > 0``, or ``sigterm_checkpoint``: a SIGTERM
    writes one, ``MOE_ASYNC_SIGTERM=checkpoint``) an explicit ``trainer.save_dir`` must be
    a directory this process can write, or creatable: its nearest existing ancestor a writable
    directory. Nothing is created here (the first save makes it). The default (None: under the
    run directory) is checked by :func:`make_run_dir`.

    Raises:
        UserInputError: naming ``trainer.save_dir`` (a file in its place or above it, not writable).
    """
    t = cfg.trainer
    if not (t.save_interval or sigterm_checkpoint) or t.save_dir is None:
        return
    p = Path(t.save_dir).expanduser().resolve()
    q = p
    while not q.exists() and q != q.parent:
        q = q.parent
    if not q.is_dir():
        why = "it is not a directory" if q == p else f"{q} is not a directory"
    elif not os.access(q, os.W_OK | os.X_OK):
        why = f"{q} is not writable"
    else:
        return
    raise UserInputError(f"trainer.save_dir={t.save_dir!r}: checkpoints cannot be written there ({why})")


_BUFFER_REPLY_S = 120.0  # s: the most a buffer/rollout actor reply may take in the step loop
_ENGINE_POLL_S = 5.0  # s: how often a step-loop wait checks that the engine processes are alive


def _rget(ref, what: str, timeout_s: float = _BUFFER_REPLY_S):
    """``ray.get(ref)`` bounded by ``timeout_s``; on expiry ``GetTimeoutError`` names ``what``
    (the actor call) and the bound, instead of a run that hangs on a lost reply."""
    import ray

    try:
        return ray.get(ref, timeout=timeout_s)
    except ray.exceptions.GetTimeoutError as e:
        raise ray.exceptions.GetTimeoutError(f"{what}: no reply within {timeout_s:.0f} s") from e


def _get_watching(ref, engines, timeout_s: float | None = None):  # engines None: no engine check
    """``ray.get(ref)`` that checks the engine processes every :data:`_ENGINE_POLL_S` seconds
    while it waits: a dead engine fails the step at once, named (index, URL, exit code, log),
    instead of leaving the driver waiting on a call blocked by it (a weight sync into a
    killed engine, a buffer reply after the rollout loop lost its engine).

    Raises:
        RuntimeError: naming the dead engine(s).
        ray.exceptions.GetTimeoutError: no reply within ``timeout_s`` seconds (None: no limit).
    """
    import ray

    t0 = time.monotonic()
    while True:
        ready, _ = ray.wait([ref], timeout=_ENGINE_POLL_S)
        if ready:
            return ray.get(ref)
        dead = dead_engines(engines) if engines is not None else []
        if dead:
            raise RuntimeError("; ".join(dead))
        if timeout_s is not None and time.monotonic() - t0 > timeout_s:
            raise ray.exceptions.GetTimeoutError(f"no reply within {timeout_s:.0f} s")


def resolve_checkpoint(cfg: ExperimentConfig) -> tuple[str | None, int]:
    """``(checkpoint dir, its step)`` for ``trainer.load``; ``(None, 0)`` when unset.

    ``trainer.load`` is a ``step_<N>`` directory written by a run, or a save_dir whose
    ``latest`` file names one. The step is the saved data-side step (``moe_async_state.json``),
    else the weight_version (``moe_async_version.txt``).

    Raises:
        UserInputError (a ValueError) naming ``trainer.load`` when the path does not exist or
        is not such a checkpoint or its step file cannot be read, naming ``num_steps``
        when it is not above the checkpoint's step, naming the first tensor whose shape
        differs when it is another model's checkpoint (from its metadata: ``ckpt_shapes``),
        naming ``trainer.lora`` when it disagrees with the saved adapters (``check_lora_fields``).
    """
    import json
    import os

    p = cfg.trainer.load
    if p is None:
        return None, 0
    p = os.path.abspath(os.path.expanduser(p))
    if not os.path.isdir(p):
        raise UserInputError(f"trainer.load={cfg.trainer.load!r}: no such directory")
    latest = os.path.join(p, "latest")
    if os.path.isfile(latest):
        with open(latest) as f:
            p = os.path.join(p, f.read().strip())
    else:  # a Megatron-LM container root: its tracker names the iteration dir
        from moe_async.megatron.container import resolve

        try:
            p = resolve(p)
        except (OSError, ValueError) as e:
            raise UserInputError(f"trainer.load={cfg.trainer.load!r}: {e}") from e
    ver_p, state_p = os.path.join(p, "moe_async_version.txt"), os.path.join(p, "moe_async_state.json")
    if not (os.path.isfile(ver_p) and os.path.isfile(os.path.join(p, "metadata.json"))):
        raise UserInputError(
            f"trainer.load={cfg.trainer.load!r}: {p} is not a checkpoint of this trainer (needs the torch_dist "
            "metadata.json and moe_async_version.txt written by trainer.save_interval); a converter's "
            "model-only checkpoint is not a run to resume: start from those weights with model.source=hf "
            "model.hf_path=<the HF checkpoint>")
    f_p, state = ver_p, {}  # state: moe_async_state.json's object ({}: none, an older checkpoint)
    try:
        with open(ver_p) as f:
            step = int(f.read().strip())
        if os.path.isfile(state_p):
            f_p = state_p
            with open(state_p) as f:
                state = json.load(f)
            step = int(state.get("extra", {}).get("step", step))
    except (OSError, ValueError, AttributeError, TypeError) as e:  # unreadable, not an int / JSON object
        raise UserInputError(f"trainer.load={cfg.trainer.load!r}: cannot read the step from {f_p} "
                             f"({type(e).__name__}: {e})") from e
    from moe_async.lora.checkpoint import check_lora_fields  # trainer.lora against the saved adapters

    check_lora_fields(p, state.get("lora") or None, cfg.trainer.lora)
    if cfg.num_steps <= step:
        raise UserInputError(f"num_steps={cfg.num_steps} counts steps in total and the checkpoint trainer.load={p} "
                             f"is at step {step}: nothing left to train (set num_steps above {step})")
    check_load_matches_config(p, cfg)  # another model's checkpoint: refused naming the first tensor that differs
    return p, step


def weights_digest(checksums: dict[str, str]) -> str:
    """One sha256 over the per-tensor checksums (name-sorted), to compare weights across runs."""
    import hashlib
    import json

    return hashlib.sha256(json.dumps(sorted(checksums.items())).encode()).hexdigest()


