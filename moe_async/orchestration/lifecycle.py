"""Process-level helpers of the driver: Ray start/attach, SIGTERM handling, held-out eval
printing (a resumed run's ``eval_before`` from the first run's step 0), naming dead engines,
the prompt files' room in the model's context."""

from __future__ import annotations

import os
import signal
from types import FrameType
from typing import TYPE_CHECKING, Any, Callable, TypeAlias

from moe_async.types import JsonDict

if TYPE_CHECKING:
    from ray import ObjectRef

    from moe_async.config import ExperimentConfig

#: What ``signal.signal`` returns: the handler it replaced (typeshed's ``signal._HANDLER``).
SignalHandler: TypeAlias = "Callable[[int, FrameType | None], object] | int | signal.Handlers | None"


def init_ray(engine_log_dir: str | None = None) -> None:
    """Attach to the cluster in ``RAY_ADDRESS`` (launch/slurm/train.sbatch), else start a new
    local Ray bound to loopback (never another job's cluster found on this host). Every process
    of the run gets :func:`~moe_async.orchestration.cluster_env.worker_env` (``no_proxy`` for
    loopback and the head, NCCL settings; engine logs under ``engine_log_dir``), the driver's
    own environment the same ``no_proxy``."""
    import ray

    from moe_async.orchestration.cluster_env import head_host, worker_env

    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    env_vars = worker_env(hosts=head_host(os.environ.get("RAY_ADDRESS")), engine_log_dir=engine_log_dir)
    os.environ["no_proxy"] = os.environ["NO_PROXY"] = env_vars["no_proxy"]
    runtime_env = {"env_vars": env_vars}
    if os.environ.get("RAY_ADDRESS"):
        ray.init(address=os.environ["RAY_ADDRESS"], runtime_env=runtime_env)
    else:
        from moe_async.orchestration.reaper import start as start_reaper

        start_reaper()  # the run's processes die with the driver, even on kill -9
        # address="local": a new local instance even where /tmp/ray/ray_current_cluster names
        # another job's cluster (a `ray start` on this host, live or dead); without it ray.init
        # would try to join that one and refuse num_cpus
        ray.init(address="local", num_cpus=os.cpu_count(), include_dashboard=False, _node_ip_address="127.0.0.1",
                 log_to_driver=True, runtime_env=runtime_env)


def sigterm_to_exit() -> SignalHandler:
    """Make SIGTERM (``kill``, Slurm, a container stop) raise ``SystemExit`` in the driver
    (Ray's ``get`` reports it as exit code 1), like Ctrl-C raises KeyboardInterrupt, so
    ``run_experiment``'s cleanup runs
    (engines shut down, logger closed, ``ray.shutdown()``). Without it Ray's own handler
    aborts the driver (exit 134, a C++ stack dump) and leaves actors to Ray's reaper.
    Call after ``ray.init`` (which installs that handler). Returns the previous handler,
    or None off the main thread (where handlers cannot be set)."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        return None

    def _raise(signum, frame):  # noqa: ARG001
        raise SystemExit(128 + signum)

    return signal.signal(signal.SIGTERM, _raise)


_STOP: dict[str, str | None] = {"signal": None}


def sigterm_to_checkpoint() -> SignalHandler:
    """The driver's SIGTERM under ``launch/slurm/train.sbatch`` (``MOE_ASYNC_SIGTERM=checkpoint``,
    the pre-emption signal of ``#SBATCH --signal=B:TERM@LEAD``): the first SIGTERM only sets a
    flag (:func:`stop_requested`) that the step loop reads after each step to write a checkpoint
    and leave the loop (pre-emption); a second one raises ``SystemExit`` as :func:`sigterm_to_exit`.
    Returns the previous handler, or None off the main thread."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        return None
    _STOP["signal"] = None

    def _flag(signum, frame):  # noqa: ARG001
        if _STOP["signal"] is not None:
            raise SystemExit(128 + signum)
        _STOP["signal"] = signal.Signals(signum).name
        print(f"[moe-async] {_STOP['signal']}: checkpoint after the current step, then exit "
              "(a second one exits at once)", flush=True)

    return signal.signal(signal.SIGTERM, _flag)


def stop_requested() -> str | None:
    """The name of the signal that asked the step loop to checkpoint and stop, else None."""
    return _STOP["signal"]


def eval_get(ref: ObjectRef, what: str, timeout_s: float) -> Any:
    """A held-out evaluation's reply (``ray.get``) bounded by ``timeout_s`` seconds.

    Raises: ``ray.exceptions.GetTimeoutError`` naming ``what``, the bound and
    ``rollout.eval_timeout_s``."""
    import ray

    try:
        return ray.get(ref, timeout=timeout_s)
    except ray.exceptions.GetTimeoutError as e:
        raise ray.exceptions.GetTimeoutError(
            f"{what}: no reply within {timeout_s:.0f} s (rollout.eval_timeout_s)") from e


def evaluate(rollout, summary: dict, key: str, label: str, timeout_s: float = 3600.0) -> None:
    """Greedy held-out eval (``RolloutManager.evaluate``) into ``summary[key]``, printed; bounded
    by ``timeout_s`` (:func:`eval_get`)."""
    report_eval(summary, key, label, eval_get(rollout.evaluate.remote(), f"held-out eval ({label})", timeout_s))


def report_eval(summary: dict, key: str, label: str, ev: JsonDict | None) -> None:
    """Keep a greedy held-out eval dict (``accuracy``, ``reward_mean``, ``n``, ...) as
    ``summary[key]`` and print its line (``label``: before/after); nothing for None (no eval)."""
    if ev is None:
        return
    summary[key] = ev
    if not ev.get("n"):  # no held-out problems: no accuracy to state (it would read as 0.000)
        print(f"[moe-async] held-out accuracy {label}: no held-out problems (n=0: no data.eval set, or eval_size 0)",
              flush=True)
        return
    extra = ""
    if "task_accuracy" in ev and ev["task_accuracy"] != ev["accuracy"]:
        extra = f", task scorer accuracy {ev['task_accuracy']:.3f}"
    print(f"[moe-async] held-out accuracy {label}: {ev['accuracy']:.3f} (configured reward >= 1; "
          f"mean reward {ev.get('reward_mean', float('nan')):.3f}{extra}; n={ev['n']})", flush=True)


def dead_engines(engines) -> list[str]:
    """``engines.dead_engines()`` (an :class:`~moe_async.orchestration.engine_pool.EnginePool`),
    or [] when even that fails (Ray itself gone: nothing more to say)."""
    try:
        return engines.dead_engines()
    except Exception:  # noqa: BLE001
        return []


def refuse_prompt_room(cfg: ExperimentConfig, model_path: str | None) -> bool:
    """``data.max_prompt_length`` plus ``rollout.max_new_tokens`` within the model's context
    (:func:`moe_async.data.check.check_prompt_room`), the HF config read from ``model_path`` or,
    None, as known before the model is made. Returns False when it cannot be known yet.
    Raises UserInputError naming both numbers."""
    import json
    from pathlib import Path

    from moe_async.data.check import check_prompt_room
    from moe_async.errors import UserInputError
    from moe_async.models.prepare import configured_hf_config

    if not cfg.data.enabled or cfg.data.max_prompt_length is None:
        return True
    hf = json.loads((Path(model_path) / "config.json").read_text()) if model_path else configured_hf_config(cfg.model)
    if hf is None:
        return False
    where = model_path or (cfg.model.hf_path if cfg.model.source == "hf" else f"model.source={cfg.model.source}")
    try:
        check_prompt_room(cfg.data, cfg.rollout.max_new_tokens, hf, str(where))
    except ValueError as e:
        raise UserInputError(str(e)) from None
    return True


def first_run_eval_before(run_dir: str | os.PathLike[str]) -> JsonDict | None:
    """A resumed run's ``eval_before``: the held-out curve's step-0 record in the run dir's
    ``metrics.jsonl`` (written by the run before the resume; ``trainer.resume=auto`` keeps it)
    as an ``eval_before`` dict (``accuracy`` = ``eval/greedy_accuracy``, ``reward_mean`` =
    ``eval/greedy_reward``, ``n``, ``n_skipped``, ``step`` 0; named eval sets weighted by their
    ``n``). None when there is no such record (a fresh run dir, ``trainer.load``)."""
    import json
    from pathlib import Path

    f = Path(run_dir) / "metrics.jsonl"
    if not f.is_file():
        return None
    for line in f.read_text().splitlines():
        try:
            r = json.loads(line)
        except ValueError:
            continue
        if not isinstance(r, dict) or r.get("step") != 0:
            continue
        sets = sorted({k.split("/")[1] for k in r if k.count("/") == 2 and k.endswith("/greedy_accuracy")})
        prefixes = [f"eval/{s}/" for s in sets] or (["eval/"] if "eval/greedy_accuracy" in r else [])
        if not prefixes:
            continue
        n = sum(float(r.get(p + "n", 0.0)) for p in prefixes)
        mean = (lambda key: sum(float(r.get(p + key, 0.0)) * float(r.get(p + "n", 0.0)) for p in prefixes) / n
                if n else 0.0)
        return {"accuracy": mean("greedy_accuracy"), "reward_mean": mean("greedy_reward"), "n": n,
                "n_skipped": sum(float(r.get(p + "n_skipped", 0.0)) for p in prefixes), "step": 0,
                "from": "metrics.jsonl step 0 (the run before the resume)"}
    return None
