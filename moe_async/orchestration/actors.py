"""The trainer rank's Ray actor (the rollout manager's is
:class:`moe_async.orchestration.rollout_actor.RolloutActor`, the buffer's
:class:`moe_async.orchestration.buffer_actor.BufferActor`, the engines'
:class:`moe_async.orchestration.engine_pool.EngineActor`).

The trainer ranks and the engines are placed on bundles of their own
(:mod:`moe_async.orchestration.placement`). Every process sets its own thread count
(``trainer.num_threads``, ``engine.num_threads``) so trainer and engines do not oversubscribe them. The actors only adapt the plain classes of
``buffer``, ``trainer``, ``engines`` and ``rollout`` to Ray; they hold no logic of their own.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import ray

from moe_async.config import ExperimentConfig
from moe_async.types import Group, JsonDict

if TYPE_CHECKING:
    from torch.distributed import TCPStore

    from moe_async.trainer.megatron_trainer import MegatronTrainer
    from moe_async.weight_sync.outcome import SyncOutcome
    from moe_async.weight_sync.sender_groups import SenderGroups
    from moe_async.weight_sync.transport import WeightTransport


@ray.remote(num_cpus=0)
class TrainerActor:
    """One Megatron rank: the trainer's shard plus, on global rank 0, the sending side of
    weight sync. Made and driven by :class:`~moe_async.orchestration.trainer_group.TrainerGroup`,
    which calls every method on every rank with the same arguments (the trainer's methods
    are collective) and takes rank 0's result.

    Start-up: ``__init__`` pins the process (``trainer.cpu_affinity``) and sets the thread
    count; rank 0's :meth:`rendezvous` binds the TCPStore of ``torch.distributed`` on a port
    its node picks (held from then on, so nobody else can take it); :meth:`setup` on every
    rank sets ``RANK``/``WORLD_SIZE``/``LOCAL_RANK``/``MASTER_ADDR``/``MASTER_PORT``, joins the
    process group (NCCL with CUDA, else gloo) through that store and builds the
    :class:`MegatronTrainer`.

    ``fault`` (tests only, from ``MOE_ASYNC_TRAINER_FAULT``; see :func:`trainer_group.parse_fault`):
    ``(method, n)`` makes this rank raise RuntimeError at its n-th call of ``method``.
    """

    def __init__(self, cfg: ExperimentConfig, model_path: str, rank: int = 0, world_size: int = 1,
                 fault: tuple[str, int] | None = None):
        import torch

        from moe_async.affinity import pin_this_process

        # trainer.cpu_affinity: before torch starts its thread pool, which inherits the mask
        pin_this_process(cfg.trainer.cpu_affinity, "trainer.cpu_affinity")
        torch.set_num_threads(cfg.trainer.num_threads)
        self.cfg = cfg
        self.model_path = model_path
        self.rank, self.world_size = rank, world_size
        self.fault = fault
        self._calls: dict[str, int] = {}
        self._store: TCPStore | None = None
        self.trainer: MegatronTrainer | None = None
        self.transport: WeightTransport | None = None
        self._senders: SenderGroups | None = None  # weight_sync.senders: all: every sender's update group

    @property
    def _trainer(self) -> MegatronTrainer:
        """The trainer; RuntimeError before :meth:`init_trainer`."""
        if self.trainer is None:
            raise RuntimeError("TrainerActor: init_trainer() first")
        return self.trainer

    @property
    def _transport(self) -> WeightTransport:
        """The weight transport (several senders: rank 0's current one); RuntimeError before
        :meth:`connect_engines`."""
        tr = self._senders.transport if self._senders is not None else self.transport
        if tr is None:
            raise RuntimeError("TrainerActor: connect_engines() first")
        return tr

    def _enter(self, method: str) -> None:
        """Count the call; raise the test-only injected fault when it is due."""
        n = self._calls[method] = self._calls.get(method, 0) + 1
        if self.fault is not None and self.fault == (method, n):
            raise RuntimeError(f"injected fault (MOE_ASYNC_TRAINER_FAULT) in {method} call {n} "
                               f"on trainer rank {self.rank}")

    def rendezvous(self, host: str, timeout_s: float = 600.0) -> tuple[str, int]:
        """Rank 0: bind the process group's TCPStore on this node (port picked by the OS and
        held); returns ``(host, port)`` for every rank's ``MASTER_ADDR/PORT``. ``host``: this
        node's address as Ray knows it (its NodeManagerAddress; loopback for a local run)."""
        from datetime import timedelta

        import torch.distributed as dist

        ip = host
        self._store = store = dist.TCPStore(ip, 0, self.world_size, is_master=True, wait_for_workers=False,
                                            timeout=timedelta(seconds=timeout_s))
        return ip, int(store.port)

    def setup(self, env: dict[str, str], timeout_s: float = 600.0) -> int:
        """Join the process group as ``env["RANK"]`` and build this rank's trainer; returns the
        process id. Collective: every rank calls it."""
        import os
        from datetime import timedelta

        import torch
        import torch.distributed as dist

        from moe_async.trainer.megatron_trainer import MegatronTrainer

        os.environ.update(env)
        self._enter("setup")
        if self._store is None:  # not rank 0: a client of rank 0's store
            self._store = dist.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), self.world_size,
                                        is_master=False, timeout=timedelta(seconds=timeout_s))
        cuda = torch.cuda.is_available()
        if cuda:  # Ray leaves one visible device per rank (its bundle's GPU)
            torch.cuda.set_device(0 if torch.cuda.device_count() == 1 else int(env["LOCAL_RANK"]))
        if not dist.is_initialized():
            dist.init_process_group("nccl" if cuda else "gloo", store=self._store, rank=self.rank,
                                    world_size=self.world_size, timeout=timedelta(seconds=timeout_s))
        self.trainer = MegatronTrainer(self.cfg.trainer, self.model_path)
        return os.getpid()

    def version(self) -> int:
        return self._trainer.version

    def connect_engines(self, urls: list[str]) -> None:
        """Rank 0 joins the weight-update group with every engine; the other ranks only
        take part in the export (:meth:`sync_weights`)."""
        self._enter("connect_engines")
        if self._several_senders():
            self._connect_senders(urls)
            return
        if self.rank != 0:
            return
        import os

        from moe_async.engines.client import SyncEngineClient
        from moe_async.weight_sync.factory import make_transport

        clients = [SyncEngineClient(u, timeout_s=self.cfg.weight_sync.timeout_s) for u in urls]
        # weight_sync.transport: broadcast (bucketed, overlapped packing) | disk (fallback);
        # the engines reach the update group's store on this rank's node
        kw = {} if self.cfg.weight_sync.transport == "disk" else dict(
            master_address=os.environ["MASTER_ADDR"], ranks_per_engine=self.cfg.engine.tensor_parallel_size)
        self.transport = make_transport(clients, self.cfg.weight_sync, pause_mode=self.cfg.engine.pause_mode, **kw)
        self._transport.connect()

    def train_step(self, groups: list[Group]) -> dict[str, float]:
        """GRPO advantages per group, then one optimizer step on all samples (the same global
        batch on every rank; the trainer takes its data-parallel slice)."""
        from moe_async.trainer.advantages import compute_grpo_advantages

        self._enter("train_step")
        samples = [s for g in groups for s in g.samples]
        t = self.cfg.teacher
        if t.enabled:  # on-policy distillation: per-token reverse-KL advantages (moe_async/distill)
            from moe_async.distill.advantages import distill_advantages, distill_metrics

            # and, with teacher.topk_forward_kl_coef, the top-k forward KL loss term
            m = self._trainer.train_step(samples, distill_advantages(groups, t.kl_coef, t.reward_coef),
                                         topk_kl_coef=t.topk_forward_kl_coef)
            return {**{f"train/{k}": v for k, v in m.items()}, **distill_metrics(groups, m)}
        adv = compute_grpo_advantages([[s.reward for s in g.samples] for g in groups])
        flat_adv = [a for ga in adv for a in ga]
        return {f"train/{k}": v for k, v in self._trainer.train_step(samples, flat_adv).items()}

    def reconnect_engines(self, urls: list[str]) -> None:
        """Rank 0 re-forms the weight-update group with ``urls`` (the engines in it from now
        on: the live ones, a restarted one at its URL): every old member leaves first
        (``/destroy_weights_update_group``; a dead one's failure is logged), then the group
        is formed again with the same transport (its send buffer kept). Collective."""
        self._enter("reconnect_engines")
        if self._several_senders():  # every sender leaves its group, then all form again in turn
            self._connect_senders(urls)
            return
        if self.rank != 0:
            return
        from moe_async.engines.client import SyncEngineClient

        assert self.transport is not None, "connect_engines() first"
        clients = [SyncEngineClient(u, timeout_s=self.cfg.weight_sync.timeout_s) for u in urls]
        self._transport.reform(clients)

    def _several_senders(self) -> bool:
        ws = self.cfg.weight_sync
        return ws.senders == "all" and ws.transport == "broadcast" and self.world_size > 1

    def _connect_senders(self, urls: list[str]) -> None:
        """weight_sync.senders: all: rank 0's transport and every other rank's SenderLink, each
        with its own update group, formed in rank order under fresh names and a fresh store
        key (:class:`~moe_async.weight_sync.sender_groups.SenderGroups`); a previous group of
        this rank is left first. Collective."""
        import os

        import ray

        from moe_async.engines.client import SyncEngineClient
        from moe_async.weight_sync.sender_groups import SenderGroups
        from moe_async.weight_sync.senders import SenderLink
        from moe_async.weight_sync.transport import BroadcastTransport

        ws = self.cfg.weight_sync
        clients = [SyncEngineClient(u, timeout_s=ws.timeout_s) for u in urls]
        tp = self.cfg.engine.tensor_parallel_size

        def make(name: str) -> BroadcastTransport | SenderLink:
            if self.rank == 0:
                return BroadcastTransport(clients, ws, pause_mode=self.cfg.engine.pause_mode, group_name=name,
                                          master_address=os.environ["MASTER_ADDR"], ranks_per_engine=tp)
            # the engines reach this sender's store on this rank's node
            return SenderLink(clients, ws, rank=self.rank, ranks_per_engine=tp, group_name=name,
                              master_address=ray.util.get_node_ip_address())

        if self._senders is None:
            assert self._store is not None, "setup() first"
            self._senders = SenderGroups(self.rank, self.world_size, self._store, make, timeout_s=ws.timeout_s)
        self._senders.connect(make)

    def sync_weights(self) -> dict[str, float]:
        """Send the current weights to every engine under the trainer's version (rank 0 sends;
        every rank takes part in the export's gather). At world size > 1 over the broadcast
        transport the export is streamed (bounded memory, :mod:`moe_async.weight_sync.stream_export`):
        each tensor is gathered into the bucket that is sent, so rank 0 never holds the model.
        Returns rank 0's sync metrics."""
        self._enter("sync_weights")
        return self._sync(lambda export, v: self._transport.send(export, v))

    def sync_weights_outcome(self) -> SyncOutcome:
        """:meth:`sync_weights` (counted as it for the test-only fault hook) as a
        :class:`~moe_async.weight_sync.outcome.SyncOutcome`: an engine whose process died during
        the sync is named in ``lost`` instead of raised, once every rank has finished the
        export (:func:`~moe_async.weight_sync.outcome.send_or_lost`). Other ranks: an empty one.

        Raises: as :meth:`sync_weights` when every engine still answers ``/health``."""
        from moe_async.weight_sync.outcome import SyncOutcome, send_or_lost

        self._enter("sync_weights")
        out = self._sync(lambda export, v: send_or_lost(self._transport, export, v))
        return out if isinstance(out, SyncOutcome) else SyncOutcome(out)

    def _sync(self, send: Any) -> Any:
        """The export of :meth:`sync_weights`; rank 0 hands it to ``send(export, version)``.
        With ``trainer.lora`` only the adapter goes (:meth:`_sync_adapter`), no pause; else with
        ``weight_sync.senders: all`` every rank sends its own shards (weight_sync/senders.py)."""
        if self._trainer.cfg.lora is not None:
            return self._sync_adapter()
        if self._several_senders():
            # every rank sends through its group (rank 0: its transport, read by ``send``); after
            # a failed or engine-losing sync the groups are formed again before the next one
            assert self._senders is not None, "connect_engines() first"
            out = self._senders.sync(self._trainer.hf_exporter(), self._trainer.version, send=send)
            return out if self.rank == 0 else {}
        if self.world_size > 1 and self.cfg.weight_sync.transport != "disk":
            # streamed export: each tensor gathered straight into the bucket that is sent (stream_export.py)
            from moe_async.weight_sync.stream_export import source_buckets, source_export

            if self.rank != 0:
                for _ in source_buckets(self._trainer.hf_exporter(), self.cfg.weight_sync.bucket_bytes):
                    pass
                return {}
            assert self.transport is not None, "connect_engines() first"
            return send(source_export(self._trainer.hf_exporter()), self._trainer.version)
        if self.rank != 0:
            for _ in self._trainer.export_hf_weights():
                pass
            return {}
        assert self.transport is not None, "connect_engines() first"
        # The exporter writes each tensor straight into the transport's send buffer when the
        # engines publish their layout (embedded engines), so buckets go out without packing.
        return send(self._trainer.export_hf_weights(out=self._transport.destination), self._trainer.version)

    def _sync_adapter(self) -> dict[str, float]:
        """Adapter-only sync (:mod:`moe_async.weight_sync.lora_sync`): every rank gathers the
        PEFT tensors, rank 0 loads them on every engine as ``policy@<version>`` and unloads the
        versions beyond ``async.max_staleness``; rollouts then ask for that name."""
        import time

        from moe_async.weight_sync.adapter_buffers import AdapterBuffers
        from moe_async.weight_sync.lora_sync import AdapterVersions, sync_adapter

        t0 = time.perf_counter()
        if getattr(self, "_adapters", None) is None:  # the engines' versions; shared-memory buffers kept across syncs
            self._adapters = (AdapterVersions(base="policy", max_staleness=self.cfg.async_.max_staleness), AdapterBuffers())
        versions, buffers = self._adapters  # rank 0 exports straight into the next buffer it sends
        tensors, config = self._trainer.export_lora(with_config=True, out=buffers.destination if self.rank == 0 else None)
        version = self._trainer.version
        if self.rank != 0:
            return {}
        assert self.transport is not None, "connect_engines() first"
        out = sync_adapter(self._transport.clients, versions, version, tensors, config, buffers=buffers)
        return {"sync/bytes": float(out["bytes"]), "sync/seconds": time.perf_counter() - t0,
                "sync/pause_seconds": 0.0, "sync/adapter_unloaded": float(len(out["unloaded"]))}

    def export_adapter(self, out_dir: str) -> str | None:
        """Write the LoRA adapter in PEFT format (``adapter_model.safetensors`` +
        ``adapter_config.json``) into ``out_dir``, replacing one there; rank 0 writes and
        returns ``out_dir``, other ranks None. Collective."""
        self._trainer.export_lora(out_dir, replace=True)
        return out_dir if self.rank == 0 else None

    def export_merged(self, out_dir: str) -> str | None:
        """Write the base with the LoRA adapter merged (PEFT's ``merge_and_unload``) as a full HF
        checkpoint into ``out_dir``, replacing one there; rank 0 writes and returns ``out_dir``,
        other ranks None. Collective."""
        self._trainer.export_merged(out_dir, replace=True)
        return out_dir if self.rank == 0 else None

    def checksums(self) -> dict[str, str]:
        return self._trainer.hf_checksums()

    def save_checkpoint(self, save_dir: str, step: int, extra: JsonDict) -> str:
        """Write ``<save_dir>/step_<step>`` (torch_dist model + optimizer, RNG, version and
        ``extra``) and point ``<save_dir>/latest`` at it, and Megatron-LM's
        ``latest_checkpointed_iteration.txt`` at ``iter_<step:07d>``, a symlink to it
        (:func:`moe_async.megatron.container.link_iteration`); returns the checkpoint path.
        Collective; ``save_dir`` must be one directory for every rank (a shared file system
        on a cluster).

        The checkpoint is written under ``step_<step>.tmp`` and renamed by rank 0 when every
        rank has written its part, and ``latest`` is replaced atomically after that, so a crash
        never leaves a partial checkpoint under a valid name."""
        import os
        import shutil

        import torch.distributed as dist

        self._enter("save_checkpoint")
        multi = dist.is_initialized() and dist.get_world_size() > 1
        final = os.path.join(save_dir, f"step_{step}")
        tmp = final + ".tmp"
        if self.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)  # left by a crash during an earlier save
        if multi:
            dist.barrier()
        self._trainer.save_checkpoint(tmp, extra={**extra, "step": step})
        from moe_async.orchestration.preemption import stall_if_due

        stall_if_due(self.rank, self._calls["save_checkpoint"], tmp)  # test-only crash point
        if multi:
            dist.barrier()
        if self.rank == 0:
            if os.path.exists(final):
                shutil.rmtree(final)
            os.replace(tmp, final)
            with open(os.path.join(save_dir, "latest.tmp"), "w") as f:
                f.write(f"step_{step}\n")
            os.replace(os.path.join(save_dir, "latest.tmp"), os.path.join(save_dir, "latest"))
            from moe_async.megatron.container import link_iteration

            link_iteration(save_dir, f"step_{step}", step)  # Megatron-LM's --load: tracker + iter_<N:07d>
        if multi:
            dist.barrier()
        return final

    def load_checkpoint(self, path: str) -> JsonDict:
        """Load model, optimizer, version (hence LR schedule) and RNG from ``path``; returns
        the ``extra`` dict saved with it (``step``, ``dataset``). Collective."""
        self._enter("load_checkpoint")
        return self._trainer.load_checkpoint(path)

    def check_engines(self, urls: list[str]) -> dict[str, float]:
        """Check mode: compare per-tensor checksums of every engine with the trainer's
        (collective: every rank computes the checksums; rank 0 compares).

        Raises: WeightSyncError naming the engine, the version and the first differing tensors.
        """
        from moe_async.engines.client import SyncEngineClient
        from moe_async.weight_sync.transport import check_engines

        t0 = time.perf_counter()
        mine = self._trainer.hf_checksums()
        if self.rank != 0:
            return {}
        # LoRA: the engines' base weights stay those they started with (version 0) and equal the
        # trainer's frozen base; the adapter went under its own version (policy@V)
        base_version = 0 if self._trainer.cfg.lora is not None else self._trainer.version
        m = check_engines([SyncEngineClient(u) for u in urls], mine, base_version)
        m["sync/check_seconds"] = time.perf_counter() - t0  # including the trainer's checksums
        return m

    def arm_preemption(self) -> bool:
        """From now on this rank's first SIGTERM only records itself for the driver to read
        (:meth:`stop_signal`; :mod:`moe_async.orchestration.preemption`). False: not armed
        (the call did not run on the process's main thread)."""
        from moe_async.orchestration.preemption import arm_rank_sigterm

        return arm_rank_sigterm(self.rank)

    def stop_signal(self) -> str | None:
        """The signal name this rank received since :meth:`arm_preemption`, else None."""
        from moe_async.orchestration.preemption import rank_stop_signal

        return rank_stop_signal()

    def shutdown(self) -> None:
        if self.transport is not None:
            self.transport.shutdown()
        if self._senders is not None:
            self._senders.close()
