"""Mend 9 (moe_async.compat): Megatron-Core's uneven first-dim all-gather (tensor_parallel/
mappings.py, called by the alltoall MoE dispatcher with expert tensor parallelism) on gloo.
Three forked gloo processes holding 3, 0 and 5 rows; see _uneven_gather_checks.py."""

from __future__ import annotations

import os

import pytest
import torch
from _launch import run_json

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="mends apply only without CUDA")


@pytest.fixture(scope="module")
def ranks():
    out = run_json(os.path.join(os.path.dirname(__file__), "_uneven_gather_checks.py"), timeout=180)
    assert out["exitcodes"] == [0, 0, 0]
    return out["ranks"]


def test_mend_still_needed(ranks):
    """Megatron's own uneven all-gather fails on gloo (torch.distributed.all_gather with
    different-size tensors)."""
    for r in ranks:
        assert r["applied"] and r["mend_in_place"]
        assert r["before_gather_error"] is not None and "invalid tensor size" in r["before_gather_error"]


def test_uneven_gather_exact(ranks):
    """The mended gather returns every rank's rows in rank order, bit for bit; equal split
    sizes take Megatron's own code."""
    for r in ranks:
        assert r["gather_exact"] is True
        assert r["equal_split_same"] is True


def test_autograd_through_megatron_functions(ranks):
    """gather_from_sequence_parallel_region / reduce_scatter_to_sequence_parallel_region with
    split sizes (the dispatcher's ETP calls): forward and backward exact. The backward of the
    gather and the forward of the reduce-scatter are gloo's own uneven reduce_scatter (no mend
    needed in torch 2.13); the reduce-scatter's backward is the mended gather."""
    for r in ranks:
        assert r["gather_autograd_exact"] is True
        assert r["reduce_scatter_native_exact"] is True
