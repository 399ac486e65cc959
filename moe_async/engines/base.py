"""Engine processes: the ``Engine`` interface and its two implementations.

:class:`EmbeddedEngine` (CPU, ``moe_async.engines.embedded.server``) and :class:`SGLangEngine`
(GPU, ``sglang.launch_server``), both speaking SGLang's HTTP protocol on ``host:port``.
``launch()`` starts the process in its own session and waits for ``/health`` up to
``startup_timeout_s`` (a death first raises with its log's tail); ``shutdown()`` sends SIGTERM,
then SIGKILL; no engine outlives its parent.

Design notes: ``docs/design/engines.md``."""

from __future__ import annotations

import abc
import io
import atexit
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import weakref

import httpx

from moe_async.engines.config import EngineConfig
from moe_async.net import free_port

_LIVE: "weakref.WeakSet[Engine]" = weakref.WeakSet()


def _shutdown_all() -> None:
    for eng in list(_LIVE):
        try:
            eng.shutdown()
        except Exception:
            pass


atexit.register(_shutdown_all)

_HEALTH: httpx.Client | None = None
_HEALTH_LOCK = threading.Lock()


def health_ok(url: str, timeout_s: float) -> bool:
    """``GET {url}/health`` answered 200 within ``timeout_s`` (False on any HTTP error). One
    client for every call in this process: a new ``httpx`` client loads the CA bundle into an
    SSL context (tens of ms of CPU), which a wait polling every 0.2 s paid on each poll."""
    global _HEALTH
    with _HEALTH_LOCK:
        if _HEALTH is None:
            _HEALTH = httpx.Client(trust_env=False)
    try:
        return _HEALTH.get(f"{url}/health", timeout=timeout_s).status_code == 200
    except httpx.HTTPError:
        return False


class EngineLaunchError(RuntimeError):
    """The engine process exited or did not become healthy in time."""


class Engine(abc.ABC):
    """One inference server process."""

    #: a multi-node engine's ``--dist-init-addr`` (HOST:PORT); None for a one-node engine
    dist_init_addr: str | None = None

    @abc.abstractmethod
    def launch(self) -> "Engine":
        """Start the server and block until ``/health`` answers 200."""

    @property
    @abc.abstractmethod
    def url(self) -> str:
        """``http://host:port`` of the running server."""

    @abc.abstractmethod
    def shutdown(self) -> None:
        """Stop the server (idempotent)."""

    @property
    @abc.abstractmethod
    def alive(self) -> bool:
        """Whether the server process is running."""

    def healthy(self, timeout_s: float = 5.0) -> bool:
        """Process alive and ``GET /health`` answers 200 within ``timeout_s``."""
        if not self.alive:
            return False
        return health_ok(self.url, timeout_s)

    def restart(self) -> "Engine":
        """Stop whatever is left of the server and launch it again (same port)."""
        self.shutdown()
        return self.launch()

    def __enter__(self) -> "Engine":
        return self.launch()

    def __exit__(self, *exc) -> None:
        self.shutdown()


class _SubprocessEngine(Engine):
    """A server started as a child process in its own session."""

    name = "engine"

    def __init__(self, cfg: EngineConfig, model_path: str, port: int = 0):
        self.cfg = cfg
        self.model_path = str(model_path)
        self.host = cfg.host
        self.port = port or free_port(cfg.host)
        self._auto_port = not port  # chosen here: another may be tried (first launch only)
        self._was_healthy = False
        self.proc: subprocess.Popen | None = None
        self.log_path: str | None = None
        self._log_file: io.BufferedWriter | None = None

    @abc.abstractmethod
    def command(self) -> list[str]:
        """argv of the server process."""

    def preexec(self) -> None:
        """Runs in the child before exec (after ``setsid``; after pinning to
        ``cfg.cpu_affinity`` when set, so the server and all its threads and children
        inherit the core mask)."""

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        env["OMP_NUM_THREADS"] = str(self.cfg.num_threads)
        env["MKL_NUM_THREADS"] = str(self.cfg.num_threads)
        return env

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def launch(self) -> "Engine":
        """Start the server and wait until ``/health`` answers. A port this engine chose itself
        (``port=0``) can be taken by another process before the server binds it: on its first
        launch the server is then started again on another free port (3 tries in all); a
        restart keeps its port. Raises EngineLaunchError (the log's tail in the message)."""
        tries = 1
        while True:
            try:
                return self._launch_once()
            except EngineLaunchError as e:
                if not (self._auto_port and not self._was_healthy and tries < 3
                        and "address already in use" in str(e).lower()):
                    raise
            if self.log_path and os.path.exists(self.log_path):
                os.remove(self.log_path)  # that try's log; the next try writes its own
            self.port, tries = free_port(self.host), tries + 1

    def _launch_once(self) -> "Engine":
        if self.alive:
            return self
        from moe_async.affinity import check_cpu_affinity

        cores = check_cpu_affinity(self.cfg.cpu_affinity, "engine.cpu_affinity")  # raises in the parent
        fd, self.log_path = tempfile.mkstemp(prefix=f"moe_async_{self.name}_{self.port}_", suffix=".log",
                                             dir=_log_dir())
        self._log_file = os.fdopen(fd, "wb")
        preexec = self.preexec
        if cores is not None:
            mask = cores

            def preexec() -> None:
                os.sched_setaffinity(0, mask)
                self.preexec()
        self.proc = subprocess.Popen(
            self.command(),
            stdout=self._log_file,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=self.env(),
            start_new_session=True,
            preexec_fn=preexec,
        )
        _LIVE.add(self)
        deadline = time.monotonic() + self.cfg.startup_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                rc = self.proc.returncode
                self.shutdown()
                raise EngineLaunchError(
                    f"{self.name} server exited with code {rc} during startup; log tail:\n{self.log_tail()}"
                )
            if health_ok(self.url, 2.0):
                self._was_healthy = True
                return self
            time.sleep(0.2)
        tail = self.log_tail()
        self.shutdown()
        raise EngineLaunchError(
            f"{self.name} server at {self.url} not healthy after {self.cfg.startup_timeout_s}s; "
            f"log tail:\n{tail}"
        )

    def log_tail(self, n_bytes: int = 4000) -> str:
        if not self.log_path or not os.path.exists(self.log_path):
            return ""
        with open(self.log_path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - n_bytes))
            return f.read().decode("utf-8", "replace")

    def shutdown(self, grace_s: float = 10.0) -> None:
        """Stop the server (SIGTERM to its process group, SIGKILL after ``grace_s`` s).

        The log file is deleted when the server was still running (a clean stop) and kept
        when it had died on its own (its path is in the error that reported the death).
        """
        proc, self.proc = self.proc, None
        _LIVE.discard(self)
        clean_stop = proc is not None and proc.poll() is None
        if proc is not None and proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGTERM)  # the group this engine created
            except ProcessLookupError:
                pass
            try:
                proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc.wait(timeout=grace_s)
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None
        # a clean stop removes a temporary log; one in the run's log dir stays with the run
        if clean_stop and self.log_path and os.path.exists(self.log_path) and not _log_dir():
            os.remove(self.log_path)


class EmbeddedEngine(_SubprocessEngine):
    """The embedded engine: ``python -m moe_async.engines.embedded.server`` (on ``engine.device``)."""

    name = "embedded"

    def command(self) -> list[str]:
        return [
            sys.executable, "-m", "moe_async.engines.embedded.server",
            "--model-path", self.model_path,
            "--host", self.host,
            "--port", str(self.port),
            "--max-running-requests", str(self.cfg.max_running_requests),
            "--num-threads", str(self.cfg.num_threads),
            "--dtype", self.cfg.dtype,
            "--device", self.cfg.device,
            "--weight-version", "0",  # the checkpoint is the trainer's version 0 (SGLang's default: "default")
            "--parent-pid", str(os.getpid()),
        ]


_SGLANG_DTYPE = {"fp32": "float32", "bf16": "bfloat16"}


class SGLangEngine(_SubprocessEngine):
    """The GPU engine: ``python -m sglang.launch_server`` with routed-expert capture on.

    ``engine.tensor_parallel_size`` / ``expert_parallel_size`` become ``--tp-size`` /
    ``--ep-size`` (the same sizes the weight-update group counts ranks by). ``cfg.sglang_args``
    become extra flags: ``{"enable_dp_attention": True, "mem_fraction_static": 0.85}`` ->
    ``--enable-dp-attention --mem-fraction-static 0.85`` (``False`` drops the flag).
    ``engine.nodes_per_engine > 1``: one process per node, ``--nnodes N --node-rank R
    --dist-init-addr HOST:PORT`` (node rank 0's address); raises ValueError without the address.
    """

    name = "sglang"

    def __init__(self, cfg: EngineConfig, model_path: str, port: int = 0, *, node_rank: int = 0,
                 dist_init_addr: str | None = None):
        super().__init__(cfg, model_path, port)
        #: this process's node among the engine's ``cfg.nodes_per_engine`` (SGLang --node-rank);
        #: rank 0 serves the API, the others SGLang's health-only server on their own port
        self.node_rank = node_rank
        #: ``HOST:PORT`` of node rank 0 for torch.distributed inside the engine (--dist-init-addr)
        self.dist_init_addr = dist_init_addr

    def preexec(self) -> None:
        _set_pdeathsig(signal.SIGTERM)

    def command(self) -> list[str]:
        cmd = [
            sys.executable, "-m", "sglang.launch_server",
            "--model-path", self.model_path,
            "--host", self.host,
            "--port", str(self.port),
            "--dtype", _SGLANG_DTYPE[self.cfg.dtype],
            "--max-running-requests", str(self.cfg.max_running_requests),
            "--tp-size", str(self.cfg.tensor_parallel_size),
            "--ep-size", str(self.cfg.expert_parallel_size),
            "--enable-return-routed-experts",
            "--weight-version", "0",  # the checkpoint is the trainer's version 0 (default: "default")
        ]
        if self.cfg.nodes_per_engine > 1:
            if not self.dist_init_addr:
                raise ValueError(f"engine.nodes_per_engine={self.cfg.nodes_per_engine}: the SGLang command needs "
                                 "node rank 0's dist_init_addr (HOST:PORT, from the engine's placement)")
            cmd += ["--nnodes", str(self.cfg.nodes_per_engine), "--node-rank", str(self.node_rank),
                    "--dist-init-addr", self.dist_init_addr]
        for key, val in self.cfg.sglang_args.items():
            flag = "--" + key.replace("_", "-")
            if val is True:
                cmd.append(flag)
            elif val is False:
                continue
            else:
                cmd += [flag, str(val)]
        return cmd


def _log_dir() -> str | None:
    """Where engine logs go: ``MOE_ASYNC_ENGINE_LOG_DIR`` (the run dir's ``logs/``, set by the
    driver for its workers; created here), else the temporary directory."""
    d = os.environ.get("MOE_ASYNC_ENGINE_LOG_DIR")
    if d:
        os.makedirs(d, exist_ok=True)
    return d or None


def _set_pdeathsig(sig: int) -> None:
    """Linux: deliver ``sig`` to this process when the thread that forked it dies."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, int(sig), 0, 0, 0)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def ensure_healthy(engines: list[Engine], timeout_s: float = 5.0) -> list[int]:
    """Restart every engine that is dead or fails ``/health``; returns their indices."""
    restarted = []
    for i, eng in enumerate(engines):
        if not eng.healthy(timeout_s):
            eng.restart()
            restarted.append(i)
    return restarted


def make_engine(cfg: EngineConfig, model_path: str, port: int = 0, *, node_rank: int = 0,
                dist_init_addr: str | None = None) -> Engine:
    """The engine ``cfg.backend`` names (not launched); ``node_rank`` / ``dist_init_addr``: this
    process's place in an engine spanning ``cfg.nodes_per_engine`` nodes (SGLang only)."""
    if cfg.backend == "embedded":
        return EmbeddedEngine(cfg, model_path, port)
    if cfg.backend == "sglang":
        return SGLangEngine(cfg, model_path, port, node_rank=node_rank, dist_init_addr=dist_init_addr)
    raise ValueError(f"engines.backend must be embedded|sglang, got {cfg.backend!r}")
