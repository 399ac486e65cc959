"""qwen3_moe, deepseek_v3, glm4_moe and dense llama at parallel layouts against 1 process (gloo, CPU):
the loss, grad norm and entropy of two optimizer steps (fp32, relative difference <= 1e-5),
logprobs (and their parity with transformers), bit-exact HF export after loading.

Layouts: deepseek_v3 and qwen3_moe at TP2+SP, EP2, PP2 (2 processes) and TP2+EP2, PP2+EP2,
TP2+PP2+EP2, EP4 (4 processes); deepseek_v3 also at PP2+VPP2 (one layer per model chunk, the
first dense layer in rank 0's chunk 0, from Megatron's decoder block spec with ``vp_stage``);
glm4_moe at TP2+SP, EP2, PP2 (the dense layer on stage 0) and TP2+EP2; llama at TP2+SP, PP2,
TP2+PP2. The default run keeps deepseek_v3 at TP2+SP, EP2 and PP2+VPP2; the rest is `pytest -m
slow` (``SLOW``; Mixtral: tests/trainer/test_layouts.py). Three launches (_family_layouts.py):
the 1-process references, one 2-process and one 4-process torchrun (only for selected cases).

Also the detector of the local MLA spec mend (moe_async/compat/mla_local_attention.py,
``local_mla_submodules``): with Megatron's own ColumnParallelLinear q/kv down projections,
deepseek_v3 at TP2+SP still has the right loss but the wrong grad norm.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch
from _launch import merged_json, selected_params, slow_marked, torchrun
from _launch import run as _run
from _checks import rel_err

HERE = os.path.dirname(__file__)
SCRIPT = os.path.join(HERE, "_family_layouts.py")
MOE_W2 = ["tp2pp1ep1", "tp1pp1ep2", "tp1pp2ep1"]
MOE_W4 = ["tp2pp1ep2", "tp1pp2ep2", "tp2pp2ep2", "tp1pp1ep4"]
W2 = [f"{ck}-{lay}" for ck in ("ds3", "qwen3") for lay in MOE_W2] + ["llama-tp2pp1ep1", "llama-tp1pp2ep1",
                                                                      "ds3cpl-tp2pp1ep1", "ds3-tp1pp2ep1vpp2",
                                                                      *(f"glm-{lay}" for lay in MOE_W2)]
W4 = [f"{ck}-{lay}" for ck in ("ds3", "qwen3") for lay in MOE_W4] + ["llama-tp2pp2ep1", "glm-tp2pp1ep2"]
REFS = ["ds3-tp1pp1ep1", "qwen3-tp1pp1ep1", "llama-tp1pp1ep1", "glm-tp1pp1ep1"]
CASES = [c for c in W2 + W4 if not c.startswith("ds3cpl")]
# the 4-process launch is `pytest -m slow` only, and so are most 2-process cases: the default run
# keeps deepseek_v3 (MLA, a dense first layer) at TP2+SP (with the local MLA mend's detector), EP2
# and PP2+VPP2; qwen3_moe at TP2+SP, mixtral at every 2-process layout and llama with THD at TP2+SP
# stay in tests/trainer/test_layouts.py; qwen3_moe, glm4_moe, llama here and deepseek_v3 at plain
# PP2 are slow-only
W2_DEFAULT = {"ds3-tp2pp1ep1", "ds3-tp1pp1ep2", "ds3-tp1pp2ep1vpp2"}
SLOW = set(W4) | {c for c in W2 if c not in W2_DEFAULT and not c.startswith("ds3cpl")}
REL = 1e-5

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU/gloo layout checks")


@pytest.fixture(scope="module")
def res(request, tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("family_layouts"))
    times = {"ref": _run([sys.executable, SCRIPT, "ref", tmp], 300)}
    want = selected_params(request, "case")
    names = ["ref"]
    w2 = [c for c in W2 if c not in SLOW or c in want]  # ds3cpl: test_local_mla_down_proj_mend_still_needed
    for n, cases in ((2, w2), (4, [c for c in W4 if c in want])):
        if cases:
            times[f"w{n}"] = torchrun(n, SCRIPT, "run", tmp, os.path.join(tmp, f"w{n}.json"), *cases, timeout=400)
            names.append(f"w{n}")
    out = merged_json(tmp, *names)
    print("family layout wall times (s):", times)
    return out


def _maxdiff(a, b) -> float:
    assert [len(x) for x in a] == [len(y) for y in b]
    return max(abs(x - y) for p, q in zip(a, b) for x, y in zip(p, q))


def _ref(res, case: str) -> dict:
    return res[case.split("-")[0].replace("ds3cpl", "ds3") + "-tp1pp1ep1"]


@pytest.mark.parametrize("case", slow_marked(CASES, SLOW))
def test_two_steps_equal_one_process(res, case):
    got, ref = res[case]["steps"], _ref(res, case)["steps"]
    assert len(got) == 2
    for s, r in zip(got, ref):
        assert s["num_tokens"] == r["num_tokens"] == 45  # 50 response tokens, sample 4 (5) has weight 0
        for k in ("loss", "grad_norm", "entropy"):
            assert rel_err(s[k], r[k]) <= REL, (case, k, s[k], r[k])
    assert got[0]["loss"] != got[1]["loss"]  # the second step sees the first update


@pytest.mark.parametrize("case", slow_marked(REFS + CASES, SLOW))
def test_logprobs_equal_one_process_and_hf(res, case):
    hf = res[case.split("-")[0] + "-hf"]["logp"]
    assert min(min(x) for x in hf) < -7.0  # far from uniform (log 256 = -5.55)
    assert _maxdiff(res[case]["logp"], _ref(res, case)["logp"]) < 2e-5
    assert _maxdiff(res[case]["logp"], hf) < 1e-4


@pytest.mark.parametrize("case", slow_marked(REFS + CASES, SLOW))
def test_export_bit_exact(res, case):
    assert res[case]["export_equals_disk"] is True


def test_local_mla_down_proj_mend_still_needed(res):
    """Megatron 0.16.1's local-spec ColumnParallelLinear q/kv down projections at TP2+SP:
    forward right, k_pos_emb's gradient not summed over TP (grad norm off by > 0.1%). When
    this fails, Megatron has fixed it and local_mla_submodules need not swap the Linears."""
    got, ref = res["ds3cpl-tp2pp1ep1"]["steps"][0], res["ds3-tp1pp1ep1"]["steps"][0]
    assert rel_err(got["loss"], ref["loss"]) <= REL
    assert rel_err(got["grad_norm"], ref["grad_norm"]) > 1e-3, (got["grad_norm"], ref["grad_norm"])
