"""Checkpoints a Transformer Engine model loads strictly: megatron-core's own
``dist_checkpointing.load`` of a ``GPTModel`` built from the TE layer spec (TE modules replaced
by stand-ins carrying ``_extra_state`` as TE does: tests/models/_te_standins.py) succeeds on the
converter's and the trainer's torch_dist checkpoints of deepseek_v3 and qwen3_moe
(``StrictHandling.RAISE_ALL`` for the converter's: exactly the model's keys; Megatron-LM's
default for the trainer's, whose optimizer keys the model does not ask for), also when
written at TP2 / EP2 (deepseek_v3; 2 processes; `pytest -m slow`), the loaded
weights equal the HF checkpoint bit for bit, and the same converter without the
``_extra_state`` writer (this project's output before it) is refused naming the norms' and
MLA down projections' ``_extra_state`` keys. Three launches (_te_strict_load_checks.py)."""

from __future__ import annotations

import os
import sys

import pytest
from _launch import cpu_check_json, selected_params, slow_marked, torchrun
from _launch import run as _run

HERE = os.path.dirname(__file__)
FAMILIES = ["deepseek_v3", "qwen3_moe"]


@pytest.fixture(scope="module")
def res(request, tmp_path_factory):
    pytest.importorskip("megatron.core")
    script, tmp = os.path.join(HERE, "_te_strict_load_checks.py"), str(tmp_path_factory.mktemp("te_strict"))
    _run([sys.executable, script, "prep", tmp], 300)
    if selected_params(request, "case") & W2:  # the 2-process writers: only for a selected slow case
        torchrun(2, script, "w2", tmp, timeout=400)
    return cpu_check_json(script, tmp, timeout=600)


# written by 2 ranks (TP2 / EP2): `pytest -m slow` only; the default run keeps every 1-process
# writer here; multi-rank writers' checkpoints load bit-exact in tests/tools/test_convert.py
# (the converter at TP2 / EP2) and tests/trainer/test_layouts.py (the trainer's, across layouts)
W2 = {"deepseek_v3_converter_tp2", "deepseek_v3_converter_ep2", "deepseek_v3_trainer_tp2"}
CASES = [f"{f}_{w}" for f in FAMILIES for w in ("converter", "trainer")] + sorted(W2)


@pytest.mark.parametrize("case", slow_marked(CASES, W2))
def test_te_spec_model_loads_strictly(res, case):
    """Every writer, also at TP2 / EP2 (2 ranks writing their share of the objects)."""
    family = case.split("_")[0] + "_" + case.split("_")[1]
    r = res[case]
    assert "error" not in r, r.get("error")
    assert r["hf_equal"] is True
    # every TE module's extra state reached it: TE's empty uint8 (norms, duplicated linears)
    # or None (Megatron's local linears' own get_extra_state)
    n = {"deepseek_v3": 59, "qwen3_moe": 27}[family]
    assert r["model_extra_state_keys"] == r["extra_states_set"] == n
    kinds = r["extra_states_kinds"]
    assert kinds["empty_uint8"] + kinds["none"] == n and kinds["empty_uint8"] > 0


@pytest.mark.parametrize("family", FAMILIES)
def test_output_without_extra_state_is_refused(res, family):
    """Without the writer, the strict load stops naming the TE-only modules' _extra_state."""
    err = res[f"{family}_old"].get("error", "")
    assert err.startswith("CheckpointingException") and "_extra_state" in err
    want = {"deepseek_v3": ["decoder.final_layernorm._extra_state", "decoder.layers.1.input_layernorm._extra_state",
                            "decoder.layers.0.self_attention.linear_q_down_proj._extra_state",
                            "decoder.layers.2.self_attention.linear_kv_down_proj._extra_state",
                            "decoder.layers.1.pre_mlp_layernorm._extra_state"],
            "qwen3_moe": ["decoder.layers.pre_mlp_layernorm._extra_state",
                          "decoder.layers.self_attention.q_layernorm._extra_state"]}[family]
    assert all(k in err for k in want), err
