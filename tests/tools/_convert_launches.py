"""ONE launch for the conversion checks of test_convert.py, test_convert_glm4_moe.py and
test_convert_uneven_pp.py (_convert_checks.py, _convert_glm4_moe_checks.py,
_convert_uneven_pp_checks.py), each family in its own directory under TMP:

    torchrun --nproc_per_node 2 _convert_launches.py TMP

    prep    rank 0 alone, as a 1-process run (:func:`solo`), rank 1 waiting for the process
            group: every family's HF checkpoints (before Megatron is imported), then the
            1-process conversions of test_convert and GLM-4.5;
    w2      one gloo process group, both ranks: the 2-rank conversions of all three (each
            conversion sets up and tears down its own Megatron parallel state; the uneven-PP
            trainer last); the group is then destroyed and rank 1 exits;
    final   rank 0 alone again: the 1-process back-conversions and comparisons of all three.

Rank 0 writes TMP/results.json: ``{family: results}`` and ``times`` (seconds per part).
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import _convert_checks as convert  # noqa: E402  (puts tests/models, tools/ and the root on sys.path)
import _convert_glm4_moe_checks as glm4_moe  # noqa: E402
import _convert_uneven_pp_checks as uneven_pp  # noqa: E402
import torch  # noqa: E402

FAMILIES = ("convert", "glm4_moe", "uneven_pp")
# torchrun's world, and its flag that makes a tcp:// rendezvous a client of the launcher's store
_WORLD_VARS = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
               "TORCHELASTIC_USE_AGENT_STORE")


@contextlib.contextmanager
def solo():
    """This rank as a 1-process run: torchrun's world variables hidden (no process group
    exists meanwhile), so each conversion or trainer makes and tears down its own world of 1."""
    saved = {k: os.environ.pop(k) for k in _WORLD_VARS if k in os.environ}
    try:
        yield
    finally:
        os.environ.update(saved)


def prep(d: dict) -> dict:
    convert.make_checkpoints(d["convert"])  # every HF checkpoint before Megatron is imported
    glm4_moe.make_hf(d["glm4_moe"])
    uneven_pp.make_hf(d["uneven_pp"])
    return {"convert": convert.prep(d["convert"]), "glm4_moe": glm4_moe.prep(d["glm4_moe"])}


def w2(d: dict) -> dict:
    convert.w2(d["convert"])
    glm4_moe.w2(d["glm4_moe"])
    return {"uneven_pp": uneven_pp.w2(d["uneven_pp"])}  # last: it builds trainers


def final(d: dict) -> dict:
    return {"convert": convert.final(d["convert"]), "glm4_moe": glm4_moe.final(d["glm4_moe"]),
            "uneven_pp": uneven_pp.w1(d["uneven_pp"])}  # last: it builds a trainer


def main(tmp: str) -> None:
    import torch.distributed as dist

    rank = int(os.environ["RANK"])
    dirs = {f: os.path.join(tmp, f) for f in FAMILIES}
    out: dict = {f: {} for f in FAMILIES}
    times: dict = {}

    def part(name: str, fn) -> None:
        t0 = time.perf_counter()
        for family, res in fn(dirs).items():
            out[family].update(res)
        times[name] = time.perf_counter() - t0

    if rank == 0:
        for path in dirs.values():
            os.makedirs(path)
        with solo():
            part("prep", prep)
    # rank 1 waits here until rank 0's prep is done
    dist.init_process_group("gloo", timeout=datetime.timedelta(minutes=15))
    part("w2", w2)
    dist.barrier()
    dist.destroy_process_group()
    if rank == 0:
        with solo():
            part("final", final)
        with open(os.path.join(tmp, "results.json"), "w") as f:
            json.dump({**out, "times": times}, f)


if __name__ == "__main__":
    torch.set_num_threads(1)
    main(sys.argv[1])
