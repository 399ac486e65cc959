"""Megatron-Core parallel runtime shared by the trainer and the converters.

Initialises and checks Megatron's model-parallel state for a
:class:`~moe_async.layout.ParallelLayout`, sets up and tears down process groups, and holds the
one Transformer Engine probe (:func:`have_te`) and the one free-port helper. Importing this
module imports neither torch nor Megatron-Core (functions import them).

Design notes: ``docs/design/megatron.md``."""

from __future__ import annotations

import contextlib
import functools
import math
import os

from moe_async.layout import ParallelLayout
from moe_async.net import free_port


def have_te() -> bool:
    """True when torch sees CUDA and ``transformer_engine`` imports: the GPU path (NCCL + the
    TE layer spec). False on the CPU path (gloo + the local spec + ``moe_async.compat``), also
    when the import raises anything."""
    import importlib.util

    if importlib.util.find_spec("transformer_engine") is None:
        return False
    try:
        import torch

        if not torch.cuda.is_available():
            return False
        import transformer_engine  # noqa: F401
    except Exception:
        return False
    return True


def init_model_parallel(layout: ParallelLayout) -> None:
    """Megatron-Core's parallel state (``parallel_state.initialize_model_parallel``) at ``layout``;
    the process group must exist. Its errors are Megatron-Core's (check
    :meth:`ParallelLayout.check_world` first for ones that name the fields)."""
    from megatron.core import parallel_state as ps

    ps.initialize_model_parallel(**layout.megatron_kwargs())


def check_model_parallel(layout: ParallelLayout) -> None:
    """The Megatron-Core parallel state already initialised in this process (another trainer)
    has ``layout``'s sizes.

    Raises:
        RuntimeError: naming the sizes found and the ones wanted.
    """
    from megatron.core import parallel_state as ps

    got = (
        ps.get_tensor_model_parallel_world_size(),
        ps.get_pipeline_model_parallel_world_size(),
        ps.get_expert_model_parallel_world_size(),
        ps.get_virtual_pipeline_model_parallel_world_size(),
        ps.get_context_parallel_world_size(),
    )
    want = (layout.tp, layout.pp, layout.ep, layout.vpp, layout.cp)
    if got != want:
        raise RuntimeError(
            f"Megatron parallel state already initialised with (tp, pp, ep, vpp, cp)={got}, "
            f"this trainer wants {want}"
        )
    if ps.get_expert_tensor_parallel_world_size() != layout.etp:
        raise RuntimeError(
            f"Megatron parallel state already initialised with expert_tensor_parallel_size="
            f"{ps.get_expert_tensor_parallel_world_size()}, this trainer wants "
            f"trainer.expert_tensor_parallel_size={layout.etp}")


def init_distributed(master_addr: str, master_port: int | None) -> bool:
    """``torch.distributed.init_process_group`` for this process unless one exists: world size
    and rank from ``WORLD_SIZE`` / ``RANK`` (torchrun; default 1 process), TCP rendezvous at
    ``master_addr:master_port`` (port: ``MASTER_PORT``, else a free port at 1 process); NCCL
    with CUDA (device ``LOCAL_RANK``), gloo otherwise.

    Returns:
        True when this call created the process group (the caller destroys it).

    Raises:
        ValueError: no port given and no ``MASTER_PORT`` at ``WORLD_SIZE`` > 1.
    """
    import torch
    import torch.distributed as dist

    if dist.is_initialized():
        return False
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    if master_port is None:
        env_port = os.environ.get("MASTER_PORT")
        if env_port:
            master_port = int(env_port)
        elif world == 1:
            master_port = free_port()
        else:
            raise ValueError("master_port (or MASTER_PORT) is required for WORLD_SIZE > 1")
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(
        backend=backend,
        init_method=f"tcp://{master_addr}:{master_port}",
        rank=rank,
        world_size=world,
    )
    return True


def global_rank() -> int:
    """This process's global rank (0 without a process group)."""
    import torch.distributed as dist

    return dist.get_rank() if dist.is_initialized() else 0


def world_size() -> int:
    """The process group's world size (1 without a process group)."""
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_initialized() else 1


@contextlib.contextmanager
def parallel_layout(tp: int, pp: int, ep: int):
    """torch.distributed (gloo on CPU, NCCL with CUDA; world from ``WORLD_SIZE``/``RANK``/
    ``MASTER_ADDR``/``MASTER_PORT`` as set by torchrun; 1 process otherwise, with an
    in-memory ``HashStore`` instead of a TCP rendezvous) + Megatron parallel state at
    (tp, pp, ep) with ETP 1, the CPU compat mends and the CPU device scope.
    Destroys the Megatron parallel state (and the process group if it created it) on exit."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from moe_async.compat import apply_cpu_compat, cpu_device_scope, model_parallel_manual_seed

    own_pg = False
    if not dist.is_initialized():
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if world == 1:  # no rendezvous needed (a TCP store costs ~0.1 s to start)
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
        else:
            dist.init_process_group(backend, init_method="env://", rank=int(os.environ.get("RANK", "0")),
                                    world_size=world)
        own_pg = True
    if ps.model_parallel_is_initialized():
        raise RuntimeError("Megatron parallel state is already initialised in this process")
    world = dist.get_world_size()
    if world % (tp * pp):
        raise ValueError(f"world size {world} is not a multiple of tp*pp={tp * pp}")
    init_model_parallel(ParallelLayout(tp=tp, pp=pp, ep=ep))
    try:
        apply_cpu_compat()
        with cpu_device_scope():
            model_parallel_manual_seed(1234)
            yield
    finally:
        ps.destroy_model_parallel()
        if own_pg:
            destroy_process_groups()


def cpu_tensors_only(fn):
    """Decorator: run ``fn`` under :func:`no_device_scope`."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        from moe_async.compat import no_device_scope  # imports torch: not at this module's import

        with no_device_scope():
            return fn(*args, **kwargs)

    return wrapper


def destroy_process_groups() -> None:
    """``dist.destroy_process_group()`` with the groups' C++ teardown on another thread.

    Megatron's ``initialize_model_parallel`` creates ~20 groups even at 1 process; each gloo
    group's destructor joins its worker threads, which took 0.05-0.45 s in all on this
    shared 2-core machine, on the caller's clock. Here the destroy unregisters every group
    at once (the global state is clean when it returns: a new ``init_process_group`` works),
    while references to the group objects are kept and dropped on a background thread, where
    the destructors then run (they do not hold the GIL while joining); the interpreter waits
    for that thread at exit. At world size > 1 the
    default group (which owns the TCP store and its port) is still destroyed here. Without
    torch's ``distributed_c10d._world`` registry the destroy is plain."""
    import threading

    import torch.distributed as dist

    try:
        from torch.distributed import distributed_c10d as c10d

        keep = [pg for pg in list(c10d._world.pg_map)
                if dist.get_world_size() == 1 or pg is not dist.GroupMember.WORLD]
    except (AttributeError, ImportError):  # pragma: no cover - other torch versions
        keep = []
    dist.destroy_process_group()
    if keep:
        # not a daemon: the interpreter waits for it at exit (a group destroyed while the
        # process exits aborts it in C++: "terminate called without an active exception")
        threading.Thread(target=keep.clear, name="moe_async-release-process-groups", daemon=False).start()


FIRST_FLAG = "--num-layers-in-first-pipeline-stage"
LAST_FLAG = "--num-layers-in-last-pipeline-stage"


def _uneven_stage_errors(num_layers: int, pp: int, first: int | None, last: int | None) -> list[str]:
    """Why layers per first / last PP stage do not fit ``num_layers`` at ``pp`` stages
    (Megatron-Core's TransformerConfig rule: the stages in between split the rest evenly,
    each at least one layer when there is a rest), naming the flags; [] when they fit."""
    set_ = [f"{f} {v}" for f, v in ((FIRST_FLAG, first), (LAST_FLAG, last)) if v is not None]
    if pp < 2:
        return [f"{' and '.join(set_)} need --pp > 1 (got --pp {pp})"]
    rest = num_layers - (first or 0) - (last or 0)
    others = pp - (first is not None) - (last is not None)
    if rest < 0 or (others == 0 and rest != 0) or (others and (rest % others or rest == 0)):
        return [f"{' and '.join(set_)} leave {rest} of num_hidden_layers={num_layers} for the {others} other "
                f"stage(s) of --pp {pp}: they must split evenly"]
    return []


def _layout_world() -> int:
    """World size of this run: the process group's, else ``WORLD_SIZE`` (torchrun), else 1."""
    import torch.distributed as dist

    if dist.is_initialized():
        return dist.get_world_size()
    return int(os.environ.get("WORLD_SIZE", "1"))


def check_layout(hf_cfg: dict, tp: int, pp: int, ep: int, world: int | None = None,
                 first: int | None = None, last: int | None = None) -> None:
    """Refuse, before any process group or model exists, a layout Megatron cannot build the
    model of ``hf_cfg`` at, naming the flag and the config field. ValueError when: a size is
    not a positive integer; ``--tp`` does not divide the attention heads, the query groups
    (``num_key_value_heads``; not for MLA), the dense MLP width (``intermediate_size``, when
    the model has dense MLP layers) or the shared-expert width; ``--pp`` does not divide the
    layers; ``--ep`` does not divide the routed experts (or is > 1 for a dense model); the
    world (``world``, default: this run's, see :func:`_layout_world`) is not a multiple of
    ``tp * pp`` or of ``ep * pp`` (expert TP is 1; Megatron's own rules,
    ``parallel_state.initialize_model_parallel``). Uneven stages (``first`` / ``last``: layers
    on the first / last PP stage, Megatron-Core's ``num_layers_in_first/last_pipeline_stage``)
    need ``--pp`` > 1 and leave the other stages an even split of the rest, instead of ``--pp``
    dividing the layers. All problems are listed in one message."""
    for flag, v in (("--tp", tp), ("--pp", pp), ("--ep", ep)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{flag} must be a positive integer, got {v!r}")
    for flag, n in ((FIRST_FLAG, first), (LAST_FLAG, last)):
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
            raise ValueError(f"{flag} must be a positive integer, got {n!r}")
    from moe_async.models import get_family

    world = _layout_world() if world is None else world
    fam = get_family(hf_cfg.get("model_type"))
    a = fam.arch_args(hf_cfg)
    tf = fam.transformer_config(hf_cfg)  # at TP/PP/EP 1: Megatron's own numbers of this model
    errs = []
    if tf.num_attention_heads % tp:
        errs.append(f"--tp {tp} does not divide num_attention_heads={tf.num_attention_heads}")
    mla = bool(getattr(tf, "multi_latent_attention", False))
    if not mla and tf.num_query_groups and tf.num_query_groups % tp:
        errs.append(f"--tp {tp} does not divide num_key_value_heads={tf.num_query_groups} (Megatron's query groups)")
    freq = getattr(tf, "moe_layer_freq", 1)
    has_dense = not tf.num_moe_experts or (isinstance(freq, list) and 0 in freq)
    if has_dense and tf.ffn_hidden_size % tp:
        errs.append(f"--tp {tp} does not divide the dense MLP width intermediate_size={tf.ffn_hidden_size}")
    shared = getattr(tf, "moe_shared_expert_intermediate_size", None)
    if shared and shared % tp:
        errs.append(f"--tp {tp} does not divide the shared-expert width {shared}")
    if first is not None or last is not None:
        errs += _uneven_stage_errors(tf.num_layers, pp, first, last)
    elif tf.num_layers % pp:
        errs.append(f"--pp {pp} does not divide num_hidden_layers={tf.num_layers}")
    if a.num_experts:
        if a.num_experts % ep:
            errs.append(f"--ep {ep} does not divide num_experts={a.num_experts}")
    elif ep > 1:
        errs.append(f"--ep {ep}: {a.model_type} has no experts (use --ep 1)")
    if world % (tp * pp):
        errs.append(f"the world size {world} (processes) is not a multiple of --tp x --pp = {tp * pp}")
    if world % (ep * pp):
        errs.append(f"the world size {world} (processes) is not a multiple of --ep x --pp = {ep * pp}")
    if errs:
        hint = (f" (run it under torchrun --nproc_per_node N with N a multiple of "
                f"{math.lcm(tp * pp, ep * pp)})" if any("world size" in e for e in errs) else "")
        raise ValueError(f"layout tp={tp} pp={pp} ep={ep} (world {world}) refused for {a.model_type}: "
                         + "; ".join(errs) + hint)

