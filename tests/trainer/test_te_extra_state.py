"""C18, the GPU side as far as a CPU can show it: a checkpoint written without Transformer
Engine's ``_extra_state`` objects (every CPU-written one) loads into a trainer whose
core-attention modules carry extra state, as TE's attention does on a GPU; the modules keep
their own, the weights arrive bit-exact (tests/trainer/_te_extra_state_checks.py). Before, the
load failed with "Missing key(s) ... core_attention._extra_state"."""

from __future__ import annotations

import os

from _launch import cpu_check_json

HERE = os.path.dirname(__file__)


def test_checkpoint_without_te_extra_state_loads_under_a_model_that_has_it(tmp_path):
    res = cpu_check_json(os.path.join(HERE, "_te_extra_state_checks.py"), str(tmp_path), timeout=300)
    assert res.get("error") is None and res["loaded"] is True
    assert res["extra_keys"] == ["decoder.layers.0.self_attention.core_attention._extra_state",
                                 "decoder.layers.1.self_attention.core_attention._extra_state"]
    assert res["bit_exact"] is True
    assert res["extra_state_set_from_checkpoint"] == 2  # each module given its own state back
