"""Placement of the trainer ranks and the engines on a Ray cluster (its devices, or its cores).

Disaggregated pools: ``trainer.nodes`` ``STRICT_PACK`` placement groups for the ranks (numbered
node by node in numeric address order, so TP groups stay inside a node) and one bundle per
engine. A cluster short of resources fails after a timeout naming what was needed and what
the cluster has.

Design notes: ``docs/design/orchestration.md``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ray.util.placement_group import PlacementGroup
    from moe_async.config import ExperimentConfig
    from moe_async.engines.config import EngineConfig

#: seconds to wait for a placement group's resources before failing
PLACEMENT_TIMEOUT_S = 300.0


class PlacementError(RuntimeError):
    """The cluster cannot hold a placement group; the message names the need and the supply."""


@dataclass(frozen=True)
class Slot:
    """Where one process runs: its placement group and bundle, the resources it asks for,
    and (once placed) the node it landed on."""

    pg: PlacementGroup
    bundle_index: int
    num_cpus: float
    num_gpus: float
    node_id: str
    node_ip: str

    def options(self) -> dict[str, object]:
        """``actor_cls.options(**slot.options())``: the bundle as the actor's scheduling strategy."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        return dict(num_cpus=self.num_cpus, num_gpus=self.num_gpus,
                    scheduling_strategy=PlacementGroupSchedulingStrategy(
                        placement_group=self.pg, placement_group_bundle_index=self.bundle_index,
                        placement_group_capture_child_tasks=False))


@dataclass
class Placement:
    """Placed slots in rank (or engine-index) order, and the placement groups holding them."""

    slots: list[Slot]
    groups: list[PlacementGroup] = field(default_factory=list)

    def local_ranks(self) -> list[int]:
        """Each slot's index among the slots on its node (``LOCAL_RANK``)."""
        seen: dict[str, int] = {}
        out = []
        for s in self.slots:
            out.append(seen.get(s.node_id, 0))
            seen[s.node_id] = out[-1] + 1
        return out

    @property
    def node_ids(self) -> list[str]:
        return [s.node_id for s in self.slots]

    def spans_nodes(self) -> bool:
        return len(set(self.node_ids)) > 1

    def remove(self) -> None:
        """Remove the placement groups (idempotent; actors in them are killed by Ray)."""
        from ray.util.placement_group import remove_placement_group

        for pg in self.groups:
            try:
                remove_placement_group(pg)
            except Exception:  # noqa: BLE001 - already gone with the cluster
                pass
        self.groups = []


def cluster_gpus() -> float:
    """GPUs the Ray cluster declares (0 on a CPU machine)."""
    import ray

    return float(ray.cluster_resources().get("GPU", 0.0))


def cpu_share(threads: int, n_bundles: int) -> float:
    """CPUs one bundle asks for: ``min(threads, cluster CPUs / n_bundles)``, >= 0.01, in 0.01 steps."""
    import math

    import ray

    total = float(ray.cluster_resources().get("CPU", 1.0))
    return max(0.01, min(float(threads), math.floor(100 * total / max(1, n_bundles)) / 100))


def _node_ips() -> dict[str, str]:
    import ray

    return {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes() if n.get("Alive")}


def _wait_ready(pg: PlacementGroup, what: str, bundles: list[dict[str, float]], strategy: str, timeout_s: float) -> None:
    import ray
    from ray.util.placement_group import remove_placement_group

    try:
        ray.get(pg.ready(), timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        remove_placement_group(pg)
        need: dict[str, float] = {}
        for b in bundles:
            for k, v in b.items():
                need[k] = round(need.get(k, 0.0) + v, 2)
        raise PlacementError(
            f"{what}: need {len(bundles)} bundles of {bundles[0]} ({strategy}; {need} in all), the cluster has "
            f"{ {k: v for k, v in ray.available_resources().items() if k in need} } free of "
            f"{ {k: v for k, v in ray.cluster_resources().items() if k in need} } after {timeout_s:.0f} s") from None


def node_order_key(node_ip: str, node_id: str) -> tuple:
    """Sort key of a node: its address as a number (``10.0.0.9`` before ``10.0.0.66``; IPv4
    before IPv6), then its id (nodes sharing one address, e.g. a one-host test cluster); a
    name that is no IP address sorts after every address, by name."""
    import ipaddress

    try:
        a = ipaddress.ip_address(node_ip)
    except ValueError:
        return (1, 0, 0, node_ip, node_id)
    return (0, a.version, int(a), "", node_id)


def placed_slots(groups: list[tuple[PlacementGroup, list[dict[str, float]], dict[int, str]]], node_ips: dict[str, str],
                 by_node: bool = False) -> list[Slot]:
    """The slots of placed groups, from what Ray reports of them (nothing is contacted).

    Args:
        groups: per placement group ``(pg, bundles, bundles_to_node_id)`` (Ray's
            ``placement_group_table(pg)["bundles_to_node_id"]``), in creation order.
        node_ips: node id -> address (``ray.nodes()``' ``NodeManagerAddress``), any order.
        by_node: order the slots by their node (:func:`node_order_key`), keeping group and
            bundle order within a node; otherwise group order, then bundle order.

    With ``by_node`` the rank order is the same whichever group Ray put on which node and in
    whatever order it lists the nodes: node k's ranks are contiguous and come after those of
    every node with a lower address.
    """
    slots = [Slot(pg=pg, bundle_index=i, num_cpus=b.get("CPU", 0.0), num_gpus=b.get("GPU", 0.0),
                  node_id=where[i], node_ip=node_ips.get(where[i], "127.0.0.1"))
             for pg, bundles, where in groups for i, b in enumerate(bundles)]
    if by_node:
        slots.sort(key=lambda s: node_order_key(s.node_ip, s.node_id))  # stable: group, bundle order kept
    return slots


def place(bundle_groups: list[list[dict[str, float]]], strategy: str, what: str,
          timeout_s: float = PLACEMENT_TIMEOUT_S, by_node: bool = False) -> Placement:
    """One placement group per entry of ``bundle_groups`` (``strategy``: ``STRICT_PACK``,
    ``PACK``, ...), each waited for; slots in group order, then bundle order, or with
    ``by_node`` in node order (:func:`placed_slots`).

    Raises: PlacementError (every group made so far removed) when one cannot be placed in
    ``timeout_s`` seconds.
    """
    from ray.util.placement_group import placement_group, placement_group_table

    out = Placement(slots=[])
    placed = []
    try:
        for bundles in bundle_groups:
            pg = placement_group(bundles, strategy=strategy)
            _wait_ready(pg, what, bundles, strategy, timeout_s)
            out.groups.append(pg)
            placed.append((pg, bundles, placement_group_table(pg)["bundles_to_node_id"]))
        out.slots = placed_slots(placed, _node_ips(), by_node=by_node)
    except BaseException:
        out.remove()
        raise
    return out


def trainer_bundles(world_size: int, nodes: int, threads: int, use_gpus: bool,
                    n_bundles_total: int) -> list[list[dict[str, float]]]:
    """``nodes`` lists of ``world_size / nodes`` rank bundles (``docs/design/orchestration.md``)."""
    if world_size % nodes:
        raise ValueError(f"trainer world size {world_size} is not divisible by trainer.nodes={nodes}")
    c = cpu_share(threads, n_bundles_total)
    b = {"CPU": c, **({"GPU": 1.0} if use_gpus else {})}
    return [[dict(b) for _ in range(world_size // nodes)] for _ in range(nodes)]


def engine_bundles(num_engines: int, devices: int, threads: int, use_gpus: bool,
                   n_bundles_total: int) -> list[dict[str, float]]:
    """One bundle per engine (design notes: ``docs/design/orchestration.md``)."""
    c = cpu_share(threads, n_bundles_total)
    return [{"CPU": c, **({"GPU": float(devices)} if use_gpus else {})} for _ in range(num_engines)]


def bundle_count(cfg: ExperimentConfig) -> int:
    """Bundles that share the cluster's CPUs: trainer ranks, engines and the distillation
    teacher's engines (``teacher``, when it starts its own)."""
    tch = getattr(cfg, "teacher", None)
    extra = tch.engine.num_engines if tch is not None and tch.enabled and not tch.urls else 0
    return cfg.trainer.resolved_world_size + cfg.engine.num_engines + extra


def place_trainer(cfg: ExperimentConfig, timeout_s: float = PLACEMENT_TIMEOUT_S) -> Placement:
    """The trainer's rank slots for an :class:`~moe_async.config.ExperimentConfig` (rank order)."""
    t = cfg.trainer
    n_total = bundle_count(cfg)
    bundles = trainer_bundles(t.resolved_world_size, t.nodes, t.num_threads, cluster_gpus() > 0, n_total)
    return place(bundles, "STRICT_PACK", f"trainer (trainer.world_size={t.resolved_world_size}, "
                 f"trainer.nodes={t.nodes})", timeout_s, by_node=True)


def place_engines(cfg: ExperimentConfig, timeout_s: float = PLACEMENT_TIMEOUT_S,
                  engine: EngineConfig | None = None) -> Placement:
    """The engines' slots (engine-index order), each engine on its own bundle; ``engine``: the
    pool's :class:`~moe_async.engines.config.EngineConfig` (default ``cfg.engine``; the teacher's)."""
    e = engine if engine is not None else cfg.engine
    n_total = bundle_count(cfg)
    use_gpus = (e.backend == "sglang" or getattr(e, "device", "cpu") != "cpu") and cluster_gpus() > 0
    what = (f"engines (engine.num_engines={e.num_engines}, engine.devices_per_engine="
            f"{e.resolved_devices_per_engine}, engine.nodes_per_engine={e.nodes_per_engine})")
    n = e.nodes_per_engine
    if n == 1:
        bundles = engine_bundles(e.num_engines, e.resolved_devices_per_engine, e.num_threads, use_gpus, n_total)
        return place([bundles], "PACK", what, timeout_s)
    per_node = engine_bundles(n, e.devices_per_engine_node, e.num_threads, use_gpus, n_total + e.num_engines * (n - 1))
    return place([per_node] * e.num_engines, "STRICT_SPREAD", what, timeout_s)


def check_tensor_transport_nodes(cfg: ExperimentConfig, trainer: Placement, engines: Placement) -> None:
    """``weight_sync.transport: tensor`` hands each engine handles to the sending rank's memory
    (CUDA IPC, CPU shared memory by name), which only processes on that rank's node can open.
    The sending rank is trainer rank 0 (slot 0 of ``trainer``); ``engines`` is in engine-major
    slot order (``engine.nodes_per_engine`` slots per engine). Nothing is checked for other
    transports.

    Raises: PlacementError naming the first engine (by index) placed on another node than rank
    0, both nodes (id and address) and the fix; both placements are removed first, so nothing
    stays held."""
    if cfg.weight_sync.transport != "tensor" or not trainer.slots:
        return
    s0, per = trainer.slots[0], max(1, cfg.engine.nodes_per_engine)
    for j, s in enumerate(engines.slots):
        if s.node_id != s0.node_id:
            trainer.remove()
            engines.remove()
            raise PlacementError(
                f"weight_sync.transport='tensor': engine {j // per} was placed on node {s.node_id} ({s.node_ip}), "
                f"trainer rank 0 (the sending rank) on node {s0.node_id} ({s0.node_ip}); its memory handles "
                "open only on the sender's node: use weight_sync.transport='broadcast', or a cluster where the "
                "trainer and every engine fit one node (moe-async plan checks this)")
