"""The engines as placed Ray actors: one :class:`EngineActor` per engine, each on its own
bundle (:func:`~moe_async.orchestration.placement.place_engines`: its GPUs on a cluster, a
share of the cores on a CPU), owning one server process (:mod:`moe_async.engines.base`:
SGLang or the embedded engine), which inherits the actor's ``CUDA_VISIBLE_DEVICES``.

:class:`EnginePool` is the driver's handle on them: ``launch()`` starts every engine at once
and returns their URLs in engine-index order; ``dead_engines()`` names an engine whose server
exited (index, URL, exit code, log) or whose actor died; ``shutdown()`` stops them all.

Address: an engine serves on ``engine.host`` (loopback by default) when the Ray cluster is
one node, and on its node's address when the cluster has more than one node, so the
rollout actor and the trainer's rank 0 reach it from other nodes.
"""

from __future__ import annotations

from typing import Any

import ray

from moe_async.errors import UserInputError
from moe_async.orchestration.placement import Placement, place_engines


@ray.remote(num_cpus=0)
class EngineActor:
    """One engine server on this actor's node (placed on its bundle)."""

    def __init__(self, cfg: Any, model_path: str, index: int, host: str | None = None):
        self.cfg = cfg if host is None else cfg.model_copy(update={"host": host})
        self.model_path = model_path
        self.index = index
        self.engine = None

    def launch(self) -> str:
        """Start the server; its URL once ``/health`` answers. Raises EngineLaunchError."""
        from moe_async.engines.base import make_engine

        port = self.cfg.base_port + self.index if self.cfg.base_port else 0
        self.engine = make_engine(self.cfg, self.model_path, port)
        self.engine.launch()
        return self.engine.url

    def dead(self) -> str | None:
        """``"exited with code C; log: PATH"`` when the server process has exited, else None."""
        proc = getattr(self.engine, "proc", None)
        if proc is not None and proc.poll() is not None:
            return f"exited with code {proc.returncode}; log: {getattr(self.engine, 'log_path', None)}"
        return None

    def restart(self) -> str:
        """Stop what is left of the server and start it again on the same port; its URL once
        ``/health`` answers (it holds the base weights: the caller sends the current ones).
        Raises EngineLaunchError."""
        if self.engine is None:
            return self.launch()
        self.engine.restart()
        return self.engine.url

    def restart_if_unhealthy(self) -> bool:
        """Restart the server (same URL) when its process died or ``/health`` fails."""
        from moe_async.engines.base import ensure_healthy

        return bool(ensure_healthy([self.engine])) if self.engine is not None else False

    def shutdown(self) -> None:
        if self.engine is not None:
            self.engine.shutdown()
            self.engine = None


class EnginePool:
    """``engine.num_engines`` placed :class:`EngineActor` s (see the module docstring).

    Args:
        cfg: the experiment config (``engine.*``).
        model_path: the HF checkpoint the engines serve.
        placement: their slots (default :func:`place_engines`); the pool removes it on shutdown.
        actor_cls: the engine actor class (tests).
    """

    def __init__(self, cfg: Any, model_path: str, *, placement: Placement | None = None, actor_cls: Any = None):
        self.placement = placement if placement is not None else place_engines(cfg)
        multi_node = sum(1 for n in ray.nodes() if n.get("Alive")) > 1
        cls = actor_cls or EngineActor
        self.actors = [cls.options(**s.options()).remote(cfg.engine, model_path, i, s.node_ip if multi_node else None)
                       for i, s in enumerate(self.placement.slots)]
        self.urls: list[str | None] = [None] * len(self.actors)
        self.startup_timeout_s = float(cfg.engine.startup_timeout_s)  # bounds launch()/restart() waits

    def launch(self) -> list[str]:
        """Start every engine at once; their URLs in engine-index order.

        Raises: RuntimeError naming the engine (index, node) whose server did not start."""
        refs = [a.launch.remote() for a in self.actors]
        errs = []
        for i, ref in enumerate(refs):
            try:
                # the server's own start is bounded by engine.startup_timeout_s; this bounds the actor too
                self.urls[i] = ray.get(ref, timeout=self.startup_timeout_s + 120.0)
            except Exception as e:  # noqa: BLE001 - named below
                c = getattr(e, "cause", None) or e
                if isinstance(c, UserInputError):  # bad input (engine.cpu_affinity): the CLI's one line
                    raise c from e
                errs.append(f"engine {i} (node {self.placement.slots[i].node_ip}) did not start: "
                            f"{type(c).__name__}: {c}")
        if errs:
            raise RuntimeError("; ".join(errs))
        return list(self.urls)

    def dead_engines(self, timeout_s: float = 30.0) -> list[str]:
        """One line per engine whose server exited or whose actor died (index, URL, why)."""
        out = []
        refs = [a.dead.remote() for a in self.actors]
        for i, ref in enumerate(refs):
            try:
                why = ray.get(ref, timeout=timeout_s)
            except ray.exceptions.GetTimeoutError:
                why = f"did not answer within {timeout_s:.0f} s"
            except Exception as e:  # noqa: BLE001 - the actor itself is gone
                why = f"its actor died ({type(e).__name__})"
            if why:
                out.append(f"engine {i} at {self.urls[i]} {why}")
        return out

    def restart(self, i: int, timeout_s: float) -> str:
        """Restart engine ``i``'s server (same URL); its URL.

        Raises: RuntimeError naming the engine when it did not come back within ``timeout_s``
        (``ray.exceptions.GetTimeoutError``) or its start failed."""
        try:
            url = ray.get(self.actors[i].restart.remote(), timeout=timeout_s)
        except ray.exceptions.GetTimeoutError as e:
            raise RuntimeError(f"engine {i} at {self.urls[i]}: restart not serving within {timeout_s:.0f} s") from e
        except Exception as e:  # noqa: BLE001 - named
            c = getattr(e, "cause", None) or e
            raise RuntimeError(f"engine {i} at {self.urls[i]}: restart failed: {type(c).__name__}: {c}") from e
        self.urls[i] = url
        return url

    def check_and_restart(self) -> list[int]:
        """Restart engines whose process died or whose ``/health`` fails; their indices (see
        :func:`moe_async.engines.base.ensure_healthy`: they need the weights again)."""
        return [i for i, ok in enumerate(ray.get([a.restart_if_unhealthy.remote() for a in self.actors],
                                                                timeout=self.startup_timeout_s + 120.0)) if ok]

    def shutdown(self, timeout_s: float = 60.0) -> None:
        """Stop every server, then the actors and their placement group (idempotent)."""
        try:
            ray.get([a.shutdown.remote() for a in self.actors], timeout=timeout_s)
        except Exception:  # noqa: BLE001 - a dead actor's server died with it (--parent-pid)
            pass
        for a in self.actors:
            try:
                ray.kill(a, no_restart=True)
            except Exception:  # noqa: BLE001
                pass
        self.actors = []
        self.placement.remove()
