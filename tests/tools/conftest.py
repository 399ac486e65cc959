"""The conversion checks shared by several test modules of this directory: one launch
(starting the processes is the costly part) serves test_convert.py, test_convert_glm4_moe.py
and test_convert_uneven_pp.py."""

from __future__ import annotations

import os

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(scope="session")
def convert_results(tmp_path_factory) -> dict:
    """``{family: results}`` of the one 2-process launch of ``_convert_launches.py`` (rank 0
    alone for the 1-process parts before and after the 2-rank part), ``family`` one of
    ``convert``, ``glm4_moe``, ``uneven_pp``; seconds per part under ``times``. Skipped where
    CUDA is available (CPU/gloo checks)."""
    import json

    import torch
    from _launch import torchrun

    if torch.cuda.is_available():
        pytest.skip("CPU/gloo conversion checks")
    pytest.importorskip("megatron.core")
    tmp = str(tmp_path_factory.mktemp("convert"))
    wall = torchrun(2, os.path.join(HERE, "_convert_launches.py"), tmp, timeout=1200)
    with open(os.path.join(tmp, "results.json")) as f:
        out = json.load(f)
    print(f"conversion checks: {wall:.1f} s wall, seconds per part:", out["times"])
    return out
