"""The three launches that run the conversion checks of test_convert.py, test_convert_glm4_moe.py
and test_convert_uneven_pp.py (_convert_checks.py, _convert_glm4_moe_checks.py,
_convert_uneven_pp_checks.py), each family in its own directory under TMP; one JSON file per
launch, ``{family: results}``.

    python _convert_launches.py prep TMP
        every family's HF checkpoints (before Megatron is imported), then the 1-process
        conversions of test_convert and GLM-4.5. Writes TMP/prep.json.
    torchrun --nproc_per_node 2 _convert_launches.py w2 TMP
        one gloo process group for the 2-rank conversions of all three (each conversion sets
        up and tears down its own Megatron parallel state; the uneven-PP trainer last).
        Rank 0 writes TMP/w2.json.
    python _convert_launches.py final TMP
        the 1-process back-conversions and comparisons of all three. Writes TMP/final.json.
"""

from __future__ import annotations

import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import _convert_checks as convert  # noqa: E402  (puts tests/models, tools/ and the root on sys.path)
import _convert_glm4_moe_checks as glm4_moe  # noqa: E402
import _convert_uneven_pp_checks as uneven_pp  # noqa: E402
import torch  # noqa: E402

FAMILIES = ("convert", "glm4_moe", "uneven_pp")


def prep(d: dict) -> dict:
    convert.make_checkpoints(d["convert"])  # every HF checkpoint before Megatron is imported
    glm4_moe.make_hf(d["glm4_moe"])
    uneven_pp.make_hf(d["uneven_pp"])
    return {"convert": convert.prep(d["convert"]), "glm4_moe": glm4_moe.prep(d["glm4_moe"])}


def w2(d: dict) -> dict:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    convert.w2(d["convert"])
    glm4_moe.w2(d["glm4_moe"])
    res = {"uneven_pp": uneven_pp.w2(d["uneven_pp"])}  # last: it builds trainers
    dist.barrier()
    dist.destroy_process_group()
    return res


def final(d: dict) -> dict:
    return {"convert": convert.final(d["convert"]), "glm4_moe": glm4_moe.final(d["glm4_moe"]),
            "uneven_pp": uneven_pp.w1(d["uneven_pp"])}  # last: it builds a trainer


if __name__ == "__main__":
    torch.set_num_threads(1)
    mode, tmp = sys.argv[1], sys.argv[2]
    dirs = {f: os.path.join(tmp, f) for f in FAMILIES}
    for path in dirs.values():
        os.makedirs(path, exist_ok=True)
    out = {"prep": prep, "w2": w2, "final": final}[mode](dirs)
    if int(os.environ.get("RANK", "0")) == 0:
        with open(os.path.join(tmp, f"{mode}.json"), "w") as f:
            json.dump(out, f)
