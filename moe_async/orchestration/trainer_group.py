"""The trainer as a group of Ray actors, one per Megatron rank.

Ranks are placed in node order; rank 0 binds the store (``MASTER_ADDR``/``MASTER_PORT``); every
call goes to all ranks with the same arguments and returns rank 0's result. When one rank
raises or dies, every rank is killed (none is left in a collective) and
:class:`TrainerRankError` names the rank and the call.

Design notes: ``docs/design/orchestration.md``."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from moe_async.orchestration.placement import Placement, place_trainer
from moe_async.types import JsonDict

if TYPE_CHECKING:
    from ray.actor import ActorClass
    from ray import ObjectRef
    from moe_async.weight_sync.outcome import SyncOutcome
    from moe_async.config import ExperimentConfig

FAULT_ENV = "MOE_ASYNC_TRAINER_FAULT"
_POLL_S = 2.0  # s: how often a waiting call checks watch()
_ERROR_GRACE_S = 2.0  # s: after a first failure, how long to collect the other ranks' errors


class TrainerRankError(RuntimeError):
    """A trainer rank raised or died; every rank of the group has been killed."""


def parse_fault(value: str | None, rank: int) -> tuple[str, int] | None:
    """``(method, n)`` for ``rank`` from ``MOE_ASYNC_TRAINER_FAULT=RANK:METHOD:N``, else None.

    Raises: ValueError naming the variable when the value is not of that form."""
    if not value:
        return None
    parts = value.split(":")
    if len(parts) != 3 or not parts[0].isdigit() or not parts[2].isdigit():
        raise ValueError(f"{FAULT_ENV}={value!r}: expected RANK:METHOD:N, e.g. 1:train_step:2")
    return (parts[1], int(parts[2])) if int(parts[0]) == rank else None


def rank_envs(placement: Placement, master_addr: str, master_port: int) -> list[dict[str, str]]:
    """The torch.distributed environment of every rank (rank = slot index)."""
    world = len(placement.slots)
    return [{"RANK": str(r), "WORLD_SIZE": str(world), "LOCAL_RANK": str(lr), "MASTER_ADDR": master_addr,
             "MASTER_PORT": str(master_port)} for r, lr in enumerate(placement.local_ranks())]


def _cause(e: BaseException) -> str:
    c = getattr(e, "cause", None)  # RayTaskError: the exception raised in the actor
    c = c if isinstance(c, BaseException) else e
    return f"{type(c).__name__}: {c}".strip()


class TrainerGroup:
    """``trainer.world_size`` :class:`TrainerActor` ranks behind the TrainerActor's methods.

    Args:
        cfg: the experiment config (``trainer.*`` layout and world size).
        model_path: the HF checkpoint every rank builds from.
        placement: slots in rank order (default :func:`place_trainer`); the group owns it
            and removes it on :meth:`kill` / :meth:`shutdown`.
        watch: called while a call waits (every ``_POLL_S`` s): a non-empty list of lines
            fails the call with them (the driver: dead engines).
        actor_cls: the rank actor class (tests: one that only reports its environment).

    Every method is called on every rank and returns rank 0's result.

    Raises (any method, and the constructor): TrainerRankError naming the failing rank(s),
    after killing every rank; RuntimeError with ``watch``'s lines.
    """

    def __init__(self, cfg: ExperimentConfig, model_path: str, *, placement: Placement | None = None,
                 watch: Callable[[], list[str]] | None = None, actor_cls: ActorClass | None = None):
        cls: ActorClass
        if actor_cls is None:
            from moe_async.orchestration.actors import TrainerActor

            cls = TrainerActor
        else:
            cls = actor_cls
        self.placement = placement if placement is not None else place_trainer(cfg)
        self.watch = watch
        world = len(self.placement.slots)
        fault = os.environ.get(FAULT_ENV)
        self.actors = [cls.options(**s.options()).remote(cfg, model_path, r, world, parse_fault(fault, r))
                       for r, s in enumerate(self.placement.slots)]
        self.world_size = world
        try:
            addr, port = self._gather([self.actors[0].rendezvous.remote(self.placement.slots[0].node_ip)],
                                      "rendezvous")[0]
            self.envs = rank_envs(self.placement, addr, port)
            self.pids = self._gather([a.setup.remote(e) for a, e in zip(self.actors, self.envs)], "setup")
        except BaseException:
            self.kill()
            raise
        self.master_addr, self.master_port = addr, port

    # ---------------------------------------------------------------- calls
    def _gather(self, refs: list[ObjectRef], what: str) -> list[Any]:
        """Every rank's reply in rank order (refs[r] is rank r's); see the class docstring."""
        import ray

        pending = {ref: r for r, ref in enumerate(refs)}
        out: list[Any] = [None] * len(refs)
        while pending:
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=_POLL_S)
            failed = []
            for ref in ready:
                r = pending.pop(ref)
                try:
                    out[r] = ray.get(ref)
                except Exception as e:  # noqa: BLE001 - named below
                    failed.append((r, e))
            if failed:
                # the first failure often makes the others fail (a peer gone from a collective):
                # collect what fails within the grace, then name the actors that died first
                t0 = time.monotonic()
                while pending and time.monotonic() - t0 < _ERROR_GRACE_S:
                    more, _ = ray.wait(list(pending), num_returns=1, timeout=_ERROR_GRACE_S)
                    for ref in more:
                        r = pending.pop(ref)
                        try:
                            out[r] = ray.get(ref)
                        except Exception as e:  # noqa: BLE001
                            failed.append((r, e))
                self.kill()
                from moe_async.errors import UserInputError

                for _, err in failed:  # bad input (a core id this host lacks): the CLI's one line
                    cause = getattr(err, "cause", None)
                    if isinstance(cause, UserInputError):
                        raise cause from err
                failed.sort(key=lambda x: (not isinstance(x[1], ray.exceptions.RayActorError), x[0]))
                lines = [f"trainer rank {r} died in {what} ({type(e).__name__})"
                         if isinstance(e, ray.exceptions.RayActorError)
                         else f"trainer rank {r} failed in {what}: {_cause(e)}" for r, e in failed]
                raise TrainerRankError("; ".join(lines) + f" (all {len(refs)} trainer ranks stopped)") from failed[0][1]
            if not ready and self.watch is not None:
                bad = self.watch()
                if bad:
                    self.kill()
                    raise RuntimeError("; ".join(bad))
        return out

    def _call(self, method: str, *args: object) -> Any:
        if not self.actors:
            raise RuntimeError(f"trainer group stopped: cannot call {method}")
        refs = [getattr(a, method).remote(*args) for a in self.actors]
        return self._gather(refs, method)[0]

    def version(self) -> int:
        return self._call("version")

    def connect_engines(self, urls: list[str]) -> None:
        self._call("connect_engines", urls)

    def reconnect_engines(self, urls: list[str]) -> None:
        self._call("reconnect_engines", urls)

    def train_step(self, groups: list) -> dict[str, float]:
        import ray

        ref = ray.put(groups)  # one copy in the object store for every rank
        return self._call("train_step", ref)

    def sync_weights(self) -> dict[str, float]:
        return self._call("sync_weights")

    def sync_weights_outcome(self) -> SyncOutcome:
        """:meth:`sync_weights` that names an engine lost during it instead of failing
        (:class:`~moe_async.weight_sync.outcome.SyncOutcome`, rank 0's; ``TrainerActor.sync_weights_outcome``)."""
        return self._call("sync_weights_outcome")

    def checksums(self) -> dict[str, str]:
        return self._call("checksums")

    def export_adapter(self, out_dir: str) -> str:
        """Every rank's :meth:`TrainerActor.export_adapter`; returns rank 0's ``out_dir``."""
        return self._call("export_adapter", out_dir)

    def export_merged(self, out_dir: str) -> str:
        """Every rank's :meth:`TrainerActor.export_merged`; returns rank 0's ``out_dir``."""
        return self._call("export_merged", out_dir)

    def check_engines(self, urls: list[str]) -> dict[str, float]:
        return self._call("check_engines", urls)

    def save_checkpoint(self, save_dir: str, step: int, extra: JsonDict) -> str:
        return self._call("save_checkpoint", save_dir, step, extra)

    def load_checkpoint(self, path: str) -> JsonDict:
        return self._call("load_checkpoint", path)

    def arm_preemption(self) -> None:
        """Arm every rank's SIGTERM flag (:mod:`moe_async.orchestration.preemption`).

        Raises: RuntimeError naming the ranks where it could not be armed."""
        armed = self._gather([a.arm_preemption.remote() for a in self.actors], "arm_preemption")
        if not all(armed):
            raise RuntimeError("trainer ranks " + ", ".join(str(r) for r, ok in enumerate(armed) if not ok)
                               + ": SIGTERM flag not armed (the call ran off the process's main thread)")

    def stop_signals(self) -> list[tuple[int, str]]:
        """``[(rank, signal name), ...]`` of the ranks that received a SIGTERM since
        :meth:`arm_preemption` (every rank's own reply), rank order."""
        got = self._gather([a.stop_signal.remote() for a in self.actors], "stop_signal")
        return [(r, s) for r, s in enumerate(got) if s]

    # ---------------------------------------------------------------- teardown
    def shutdown(self) -> None:
        """Close rank 0's transport, then stop every rank (see :meth:`kill`)."""
        try:
            self._call("shutdown")
        finally:
            self.kill()

    def kill(self) -> None:
        """Kill every rank's actor and remove the placement groups (idempotent)."""
        import ray

        for a in getattr(self, "actors", []):
            try:
                ray.kill(a, no_restart=True)
            except Exception:  # noqa: BLE001 - already dead
                pass
        self.actors = []
        self.placement.remove()
