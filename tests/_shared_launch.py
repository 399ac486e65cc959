"""Several check scripts in one process per world size (each layout script's ``ref`` in one
plain python process, every script's 2-process part in one torchrun), so that the Megatron
import and the gloo start-up are paid once for all of them.

    python _shared_launch.py ref SPEC.json
    torchrun --nproc_per_node 2 _shared_launch.py run SPEC.json

SPEC.json: a list of jobs, in order, of two kinds:

- ``{"script", "tmp", "cases"}``: a layout script, one that ends with ``_checks.main(main_ref,
  one, barrier=..., wall=...)`` under ``__main__``; it is executed with that call captured (not
  run), then ``ref`` calls ``main_ref(tmp)`` and ``run`` writes ``tmp/w2.json`` as
  :func:`_checks.run_cases` would (no cases: skipped by ``run``);
- ``{"script", "argv"}``: a plain torchrun script, run by ``run`` as ``script *argv`` under
  ``__main__``, its ``init_process_group`` / ``destroy_process_group`` of the default group
  turned into barriers (the group is this launch's).

One gloo process group for every job, a barrier between jobs.
"""

from __future__ import annotations

import json
import os
import runpy
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

import _checks  # noqa: E402


def _entry(script: str) -> dict:
    """The arguments the script passes to ``_checks.main`` (captured, not run)."""
    got: dict = {}
    real = _checks.main
    _checks.main = lambda ref, one, **kw: got.update(ref=ref, one=one, **kw)
    try:
        runpy.run_path(script, run_name="__main__")
    finally:
        _checks.main = real
    if not got:
        raise RuntimeError(f"{script}: does not call _checks.main under __main__")
    return got


def _run_script(script: str, argv: list[str]) -> None:
    """``script *argv`` as ``__main__`` inside this launch's process group."""
    import torch.distributed as dist

    real_init, real_destroy = dist.init_process_group, dist.destroy_process_group
    dist.init_process_group = lambda *a, **k: dist.barrier()

    def destroy(group=None):
        return dist.barrier() if group is None else real_destroy(group)

    dist.destroy_process_group = destroy
    saved_argv = sys.argv
    sys.argv = [script, *argv]
    try:
        runpy.run_path(script, run_name="__main__")
    finally:
        sys.argv = saved_argv
        dist.init_process_group, dist.destroy_process_group = real_init, real_destroy


def _run_cases(job: dict) -> None:
    import torch.distributed as dist

    entry, res = _entry(job["script"]), {}
    t0 = time.perf_counter()
    for case in job["cases"]:
        res[case] = entry["one"](job["tmp"], case)
        if entry.get("barrier", False):
            dist.barrier()
    if entry.get("wall", True):
        res["wall_s"] = time.perf_counter() - t0
    if _checks.rank() == 0:
        with open(os.path.join(job["tmp"], "w2.json"), "w") as f:
            json.dump(res, f)


def _reset_megatron() -> None:
    """A job that left Megatron's parallel state up: the next one starts clean."""
    ps = sys.modules.get("megatron.core.parallel_state")
    if ps is not None:
        ps.destroy_model_parallel()


def main(mode: str, spec_path: str) -> None:
    torch.set_num_threads(1)
    with open(spec_path) as f:
        jobs = json.load(f)
    if mode == "ref":
        for job in [j for j in jobs if "cases" in j]:
            t0 = time.perf_counter()
            _entry(job["script"])["ref"](job["tmp"])
            print(f"{os.path.basename(job['script'])} ref: {time.perf_counter() - t0:.1f} s", flush=True)
            _reset_megatron()
        return
    import torch.distributed as dist

    dist.init_process_group("gloo")
    for job in [j for j in jobs if j.get("cases") or "argv" in j]:
        t0 = time.perf_counter()
        if "argv" in job:
            _run_script(job["script"], job["argv"])
        else:
            _run_cases(job)
        if _checks.rank() == 0:
            print(f"{os.path.basename(job['script'])} run: {time.perf_counter() - t0:.1f} s", flush=True)
        _reset_megatron()
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
