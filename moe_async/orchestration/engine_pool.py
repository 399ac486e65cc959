"""The engines as placed Ray actors: one :class:`EngineActor` per engine on its own bundle,
owning one server process (SGLang or the embedded engine).

:class:`EnginePool` is the driver's handle: ``launch()`` starts every engine at once and returns
their URLs in engine-index order; ``dead_engines()`` names an engine whose server exited
(index, URL, exit code, log) or whose actor died; ``shutdown()`` stops them all.

Design notes: ``docs/design/orchestration.md``."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import ray

from moe_async.errors import UserInputError
from moe_async.orchestration.placement import Placement, place_engines

if TYPE_CHECKING:
    from moe_async.engines.base import Engine
    from ray.actor import ActorClass
    from ray import ObjectRef
    from moe_async.config import ExperimentConfig
    from moe_async.engines.config import EngineConfig


class EngineHost:
    """One engine server process on this actor's node (placed on its bundle); the body of
    :data:`EngineActor`. Engine ``index``, node rank ``node_rank`` of ``cfg.nodes_per_engine``."""

    def __init__(self, cfg: EngineConfig, model_path: str, index: int, host: str | None = None, node_rank: int = 0):
        self.cfg = cfg if host is None else cfg.model_copy(update={"host": host})
        self.model_path = model_path
        self.index = index
        self.node_rank = node_rank
        self.engine: Engine | None = None  # the engine server, once launched

    def _make_engine(self, port: int, dist_init_addr: str | None) -> Engine:
        from moe_async.engines.base import make_engine

        return make_engine(self.cfg, self.model_path, port, node_rank=self.node_rank, dist_init_addr=dist_init_addr)

    def pick_port(self) -> int:
        """A TCP port free on this actor's node (node rank 0's ``--dist-init-addr`` port)."""
        from moe_async.net import free_port

        return free_port("0.0.0.0")

    def launch(self, dist_init_addr: str | None = None) -> str:
        """Start the server; its URL once ``/health`` answers. Raises EngineLaunchError."""
        n = self.cfg.nodes_per_engine
        port = self.cfg.base_port + self.index * n + self.node_rank if self.cfg.base_port else 0
        self.engine = self._make_engine(port, dist_init_addr)
        self.engine.launch()
        return self.engine.url

    def dead(self) -> str | None:
        """``"exited with code C; log: PATH"`` when the server process has exited, else None."""
        proc = getattr(self.engine, "proc", None)
        if proc is not None and proc.poll() is not None:
            return f"exited with code {proc.returncode}; log: {getattr(self.engine, 'log_path', None)}"
        return None

    def stop(self) -> None:
        """Stop the server (idempotent); its port and command are kept for :meth:`restart`."""
        if self.engine is not None:
            self.engine.shutdown()

    def restart(self, dist_init_addr: str | None = None) -> str:
        """Stop what is left of the server and start it again on the same port; its URL once
        ``/health`` answers (it holds the base weights: the caller sends the current ones).
        ``dist_init_addr``: a multi-node engine's new ``--dist-init-addr`` (every node of the
        engine restarts with the same one). Raises EngineLaunchError."""
        if self.engine is None:
            return self.launch(dist_init_addr)
        if dist_init_addr is not None:
            self.engine.dist_init_addr = dist_init_addr
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


#: the Ray actor of one engine process (:class:`EngineHost`)
EngineActor = ray.remote(num_cpus=0)(EngineHost)


class EnginePool:
    """``engine.num_engines`` placed :class:`EngineActor` s (design notes: ``docs/design/orchestration.md``).

    Args:
        cfg: the experiment config (``engine.*``).
        model_path: the HF checkpoint the engines serve.
        placement: their slots (default :func:`place_engines`); the pool removes it on shutdown.
        actor_cls: the engine actor class (tests).
    """

    def __init__(self, cfg: ExperimentConfig, model_path: str, *, placement: Placement | None = None,
                 actor_cls: ActorClass | None = None):
        self.placement = placement if placement is not None else place_engines(cfg)
        multi_node = sum(1 for n in ray.nodes() if n.get("Alive")) > 1
        cls = actor_cls or EngineActor
        self.nodes_per_engine = n = cfg.engine.nodes_per_engine
        #: every engine process's actor: engine i's node rank r at ``i * nodes_per_engine + r``
        self.all_actors = [cls.options(**s.options()).remote(cfg.engine, model_path, j // n,
                                                             s.node_ip if multi_node or n > 1 else None,
                                                             *((j % n,) if n > 1 else ()))
                           for j, s in enumerate(self.placement.slots)]
        #: node rank 0 of each engine (the server the rollouts and the weight sync talk to)
        self.actors = self.all_actors[::n]
        self.urls: list[str | None] = [None] * len(self.actors)
        #: each multi-node engine's ``--dist-init-addr`` (node rank 0's ``HOST:PORT``; None: one node)
        self.dist_init_addrs: list[str | None] = [None] * len(self.actors)
        self.startup_timeout_s = float(cfg.engine.startup_timeout_s)  # bounds launch()/restart() waits
        self._starting: list[ObjectRef] = []  # start()'s launch calls, until wait() collects them

    def _where(self, j: int) -> str:
        n = self.nodes_per_engine
        node = f"node {self.placement.slots[j].node_ip}"
        return f"engine {j // n} ({node}{f', node rank {j % n}' if n > 1 else ''})"

    def launch(self) -> list[str]:
        """Start every engine process at once; the engines' URLs in engine-index order
        (:meth:`start` then :meth:`wait`).

        Raises: RuntimeError naming the engine (index, node, node rank) whose server did not start."""
        self.start()
        return self.wait()

    def start(self) -> None:
        """Start every engine process at once and return without waiting for them (the driver
        builds the trainer meanwhile); :meth:`wait` returns their URLs once they serve."""
        n = self.nodes_per_engine
        addrs: list[str | None] = [None] * len(self.actors)
        if n > 1:
            ports = ray.get([a.pick_port.remote() for a in self.actors], timeout=60)
            addrs = [f"{self.placement.slots[i * n].node_ip}:{p}" for i, p in enumerate(ports)]
        self.dist_init_addrs = addrs
        self._starting = [a.launch.remote(addrs[j // n]) if n > 1 else a.launch.remote()
                          for j, a in enumerate(self.all_actors)]

    def wait(self) -> list[str]:
        """The URLs, in engine-index order, of the engines :meth:`start` started, once each
        answers ``/health`` (``engine.startup_timeout_s`` + 120 s at most per engine).

        Raises: RuntimeError naming the engine (index, node, node rank) whose server did not
        start; UserInputError from an engine actor (``engine.cpu_affinity``) as is."""
        n = self.nodes_per_engine
        refs, self._starting = self._starting, []
        errs = []
        for j, ref in enumerate(refs):
            try:
                # the server's own start is bounded by engine.startup_timeout_s; this bounds the actor too
                url = ray.get(ref, timeout=self.startup_timeout_s + 120.0)
            except Exception as e:  # noqa: BLE001 - named below
                c = getattr(e, "cause", None) or e
                if isinstance(c, UserInputError):  # bad input (engine.cpu_affinity): the CLI's one line
                    raise c from e
                errs.append(f"{self._where(j)} did not start: {type(c).__name__}: {c}")
                continue
            if j % n == 0:
                self.urls[j // n] = url
        if errs:
            raise RuntimeError("; ".join(errs))
        urls = [u for u in self.urls if u is not None]
        assert len(urls) == len(self.urls), "every engine answered"
        return urls

    def dead_engines(self, timeout_s: float = 30.0) -> list[str]:
        """One line per engine whose server exited or whose actor died (index, URL, why)."""
        out = []
        n = self.nodes_per_engine
        refs = [a.dead.remote() for a in self.all_actors]
        for j, ref in enumerate(refs):
            i = j // n
            try:
                why = ray.get(ref, timeout=timeout_s)
            except ray.exceptions.GetTimeoutError:
                why = f"did not answer within {timeout_s:.0f} s"
            except Exception as e:  # noqa: BLE001 - the actor itself is gone
                why = f"its actor died ({type(e).__name__})"
            if why:
                rank = f" (node rank {j % n})" if n > 1 else ""
                at = f"at {self.urls[i]}" if self.urls[i] is not None else "(still starting)"
                out.append(f"engine {i} {at}{rank} {why}")
        return out

    def restart(self, i: int, timeout_s: float) -> str:
        """Restart engine ``i`` (same URL); its URL. A multi-node engine restarts on every
        node (:meth:`_restart_nodes`).

        Raises: RuntimeError naming the engine when it did not come back within ``timeout_s``
        (``ray.exceptions.GetTimeoutError``) or its start failed."""
        if self.nodes_per_engine > 1:
            return self._restart_nodes(i, timeout_s)
        try:
            url = ray.get(self.actors[i].restart.remote(), timeout=timeout_s)
        except ray.exceptions.GetTimeoutError as e:
            raise RuntimeError(f"engine {i} at {self.urls[i]}: restart not serving within {timeout_s:.0f} s") from e
        except Exception as e:  # noqa: BLE001 - named
            c = getattr(e, "cause", None) or e
            raise RuntimeError(f"engine {i} at {self.urls[i]}: restart failed: {type(c).__name__}: {c}") from e
        self.urls[i] = url
        return url

    def _restart_nodes(self, i: int, timeout_s: float) -> str:
        """Restart every node of multi-node engine ``i``: first stop all its processes (a
        survivor would hold the engine's old torch.distributed group and GPUs), then start
        them all at once with a new ``--dist-init-addr`` (node rank 0's address, a port newly
        picked there, never the old one: the old group's rendezvous may still hold it), so
        they form a new group. Its URL (node rank 0's, unchanged).

        Raises: RuntimeError naming the engine and node rank that did not stop or start (every
        process of the engine is stopped again first, so none is left waiting for a peer)."""
        n = self.nodes_per_engine
        actors = self.all_actors[i * n:(i + 1) * n]
        t_end = time.monotonic() + timeout_s

        def left() -> float:
            return max(1.0, t_end - time.monotonic())

        self._on_nodes(i, [a.stop.remote() for a in actors], "stop", left())
        old = self.dist_init_addrs[i]
        old_port = int(old.rsplit(":", 1)[1]) if old else None
        port = old_port
        for _ in range(10):
            port = ray.get(actors[0].pick_port.remote(), timeout=left())
            if port != old_port:
                break
        addr = f"{self.placement.slots[i * n].node_ip}:{port}"
        try:
            urls = self._on_nodes(i, [a.restart.remote(addr) for a in actors], "restart", left())
        except RuntimeError:
            try:
                ray.get([a.stop.remote() for a in actors], timeout=60)
            except Exception:  # noqa: BLE001 - the error below is what matters
                pass
            raise
        self.dist_init_addrs[i] = addr
        self.urls[i] = urls[0]
        return urls[0]

    def _on_nodes(self, i: int, refs: list[ObjectRef], what: str, timeout_s: float) -> list[Any]:
        """Every node's reply to ``what`` on engine ``i`` (node rank order); RuntimeError naming
        each node rank that failed or did not answer within ``timeout_s``."""
        n, out, errs = self.nodes_per_engine, [], []
        t_end = time.monotonic() + timeout_s
        for r, ref in enumerate(refs):
            try:
                out.append(ray.get(ref, timeout=max(0.0, t_end - time.monotonic())))
            except ray.exceptions.GetTimeoutError:
                errs.append(f"{self._where(i * n + r)}: {what} not done within {timeout_s:.0f} s")
            except Exception as e:  # noqa: BLE001 - named
                c = getattr(e, "cause", None) or e
                errs.append(f"{self._where(i * n + r)}: {what} failed: {type(c).__name__}: {c}")
        if errs:
            raise RuntimeError(f"engine {i} at {self.urls[i]}: restart of all {n} nodes failed: " + "; ".join(errs))
        return out

    def check_and_restart(self) -> list[int]:
        """Restart engines whose process died or whose ``/health`` fails; their indices (see
        :func:`moe_async.engines.base.ensure_healthy`: they need the weights again). A
        multi-node engine with a node whose process exited restarts on every node."""
        if self.nodes_per_engine > 1:
            bad = sorted({int(line.split()[1]) for line in self.dead_engines()})
            for i in bad:
                self.restart(i, self.startup_timeout_s + 120.0)
            return bad
        return [i for i, ok in enumerate(ray.get([a.restart_if_unhealthy.remote() for a in self.actors],
                                                                timeout=self.startup_timeout_s + 120.0)) if ok]

    def shutdown(self, timeout_s: float = 60.0) -> None:
        """Stop every server, then the actors and their placement group (idempotent)."""
        try:
            ray.get([a.shutdown.remote() for a in self.all_actors], timeout=timeout_s)
        except Exception:  # noqa: BLE001 - a dead actor's server died with it (--parent-pid)
            pass
        for a in self.all_actors:
            try:
                ray.kill(a, no_restart=True)
            except Exception:  # noqa: BLE001
                pass
        self.actors = []
        self.all_actors = []
        self.placement.remove()
