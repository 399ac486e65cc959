"""The conversion checks shared by several test modules of this directory: three launches
(starting the processes is the costly part) serve test_convert.py, test_convert_glm4_moe.py
and test_convert_uneven_pp.py."""

from __future__ import annotations

import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(scope="session")
def convert_results(tmp_path_factory) -> dict:
    """``{family: results}`` of the three launches of ``_convert_launches.py`` (a 1-process prep,
    ONE 2-process torchrun, a 1-process final pass), ``family`` one of ``convert``,
    ``glm4_moe``, ``uneven_pp``, each with its launches' results merged; the wall time of each
    launch under ``times``. Skipped where CUDA is available (CPU/gloo checks)."""
    import torch
    from _launch import merged_json, torchrun
    from _launch import run as _run

    if torch.cuda.is_available():
        pytest.skip("CPU/gloo conversion checks")
    pytest.importorskip("megatron.core")
    script = os.path.join(HERE, "_convert_launches.py")
    tmp = str(tmp_path_factory.mktemp("convert"))
    times = {"prep": _run([sys.executable, script, "prep", tmp], timeout=400)}
    times["w2"] = torchrun(2, script, "w2", tmp, timeout=600)
    times["final"] = _run([sys.executable, script, "final", tmp], timeout=400)
    print("conversion check wall times (s):", times)
    out: dict = {"times": times}
    for name in ("prep", "w2", "final"):
        for family, res in merged_json(tmp, name).items():
            out.setdefault(family, {}).update(res)
    return out
