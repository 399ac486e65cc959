"""Mend 13 (moe_async.compat): Megatron-Core's distributed optimizer with torch's Adam, whose
``step`` is per parameter (optimizer/distrib_optimizer.py). One fresh 1-process trainer; see
_dist_opt_step_checks.py. The checkpoint round trips it enables are in
tests/trainer/test_dist_opt_reshard.py."""

from __future__ import annotations

import os

import pytest
import torch
from _launch import run_json

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="mends apply only without CUDA")


@pytest.fixture(scope="module")
def r(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("distoptstep"))
    return run_json(os.path.join(os.path.dirname(__file__), "_dist_opt_step_checks.py"), tmp, timeout=240)


def test_applied_with_torch_adam(r):
    assert r["have_apex_or_te"] is False  # Megatron-Core falls back to torch's AdamW
    assert r["applied"] and r["mend_in_place"]


def test_mend_still_needed(r):
    """Megatron-Core's own code: after load_state_dict all parameters share one step tensor
    (one parameter's Adam increment moves every parameter's step), and copying a
    'fully_reshardable' checkpoint's tensors (no 'step') raises KeyError 'step'."""
    assert r["steps_trained"]["values"] == [2.0] and r["steps_trained"]["distinct"] == r["steps_trained"]["n"] > 1
    assert r["steps_after_original_load"]["values"] == [2.0] and r["steps_after_original_load"]["distinct"] == 1
    assert r["shared_step_advanced"] == [3.0] and r["step_restored"]
    assert r["original_set_error"] == "KeyError: 'step'"


def test_mend_works(r):
    """Mended: each parameter its own step tensor with the loaded value; the read tensors are
    copied into the main param and Adam moments, and the step stays the param groups' (neither
    missing nor a stale per-parameter value overrides it)."""
    a = r["steps_after_mended_load"]
    assert a["values"] == [2.0] and a["distinct"] == a["n"] == r["steps_trained"]["n"]
    assert r["one_step_advanced"] == [2.0, 3.0]
    assert r["mended_set_copied"] and r["mended_set_step_kept"] and r["stale_step_ignored"]
