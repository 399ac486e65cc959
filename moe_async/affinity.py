"""CPU placement: pin the trainer and the engine servers to disjoint cores.

On a cluster the trainer and the engines own disjoint devices; on one CPU machine the
equivalent is disjoint sets of cores (``trainer.cpu_affinity``, ``engine.cpu_affinity``,
lists of core ids; unset = no pinning). Linux only (``os.sched_setaffinity``).
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from moe_async.errors import UserInputError


def check_cpu_affinity(cores: Sequence[int] | None, field: str) -> set[int] | None:
    """The core set to pin to, or ``None`` when ``cores`` is unset.

    Raises:
        UserInputError (a ValueError): naming ``field`` when a core is not one this process
            may run on (``os.sched_getaffinity(0)``) or when the platform cannot pin.
    """
    if cores is None:
        return None
    if not hasattr(os, "sched_setaffinity"):
        raise UserInputError(f"{field}={list(cores)}: CPU pinning needs Linux (os.sched_setaffinity)")
    allowed = os.sched_getaffinity(0)
    bad = sorted(set(cores) - allowed)
    if bad:
        raise UserInputError(f"{field}={list(cores)}: cores {bad} are not available here (allowed: {sorted(allowed)})")
    return set(cores)


def check_run_placement(trainer_cores: Sequence[int] | None, engine_cores: Sequence[int] | None,
                        teacher_engine_cores: Sequence[int] | None = None) -> None:
    """Launch-time check of ``trainer.cpu_affinity``, ``engine.cpu_affinity`` and the
    distillation teacher's ``teacher.engine.cpu_affinity`` on this host.

    Called by the driver of a local run (no ``RAY_ADDRESS``) before any process or actor is
    created, so a core id that is valid for the schema but absent here (e.g. ``[7]`` on a
    2-core machine) is refused at once instead of when the trainer actor pins itself. On a
    Ray cluster the actors run on other hosts; each checks its own cores when it pins.
    Config loading stays host-independent: a config written for another machine still
    loads (``moe-async show-config``).

    Raises:
        UserInputError (a ValueError): naming the field, its value, the missing cores and the cores this
            process may run on (``os.sched_getaffinity(0)``, which Ray's workers and the
            engine servers started from here inherit).
    """
    check_cpu_affinity(trainer_cores, "trainer.cpu_affinity")
    check_cpu_affinity(engine_cores, "engine.cpu_affinity")
    check_cpu_affinity(teacher_engine_cores, "teacher.engine.cpu_affinity")


def pin_this_process(cores: Sequence[int] | None, field: str) -> set[int] | None:
    """Pin every thread of the calling process (``/proc/self/task``) to ``cores``.

    Threads created later inherit the mask of the thread that creates them, so torch's
    intra-op pool started afterwards stays on ``cores`` too. Returns the core set, or
    ``None`` (nothing done) when ``cores`` is unset.

    Raises:
        UserInputError: see :func:`check_cpu_affinity`.
    """
    mask = check_cpu_affinity(cores, field)
    if mask is None:
        return None
    try:
        tids = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        tids = [0]
    for tid in tids:
        try:
            os.sched_setaffinity(tid, mask)
        except (ProcessLookupError, PermissionError):  # a thread that just exited
            pass
    os.sched_setaffinity(0, mask)
    return mask


def validate_core_list(cores: list[int] | None) -> list[int] | None:
    """Config-time check of a ``cpu_affinity`` list: non-empty, ids >= 0, no repeats.

    Raises:
        ValueError: on an empty list, a negative id or a repeated id.
    """
    if cores is None:
        return None
    if not cores:
        raise ValueError("must list at least one core id (or be null for no pinning)")
    if any(c < 0 for c in cores):
        raise ValueError(f"core ids must be >= 0, got {cores}")
    if len(set(cores)) != len(cores):
        raise ValueError(f"core ids repeat: {cores}")
    return list(cores)
