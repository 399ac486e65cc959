"""DeepSeek-V3 with the released YaRN ``rope_scaling`` (factor 40, mscale = mscale_all_dim = 1):
the trainer's logprobs equal transformers' within 1e-5 at 1 process and at TP2 (+SP), the
HF -> Megatron -> HF conversion is bit-exact (at TP1 and TP2) and keeps the rope fields, and the
YaRN softmax mscale (about 1.87) is live: without it the trainer's logprobs move by far more
than the tolerance (so the parity test fails if the mscale is dropped). Two launches
(_deepseek_v3_yarn_checks.py): the 1-process reference and one 2-process torchrun."""

from __future__ import annotations

import math
import os
import sys

import pytest
import torch
from _launch import merged_json, torchrun
from _launch import run as _run

HERE = os.path.dirname(__file__)
SCRIPT = os.path.join(HERE, "_deepseek_v3_yarn_checks.py")
MSCALE2 = (0.1 * math.log(40) + 1.0) ** 2  # get_mscale(40, mscale_all_dim=1)^2 = 1.8739

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU/gloo checks")


@pytest.fixture(scope="module")
def res(tmp_path_factory):
    pytest.importorskip("megatron.core")
    tmp = str(tmp_path_factory.mktemp("ds3_yarn"))
    _run([sys.executable, SCRIPT, "ref", tmp], 300)
    torchrun(2, SCRIPT, "run", tmp, os.path.join(tmp, "w2.json"), "tp2", timeout=400)
    return merged_json(tmp, "ref", "w2")


def _maxdiff(a, b) -> float:
    assert [len(x) for x in a] == [len(y) for y in b]
    return max(abs(x - y) for p, q in zip(a, b) for x, y in zip(p, q))


def test_trainer_builds_yarn_with_the_mscale(res):
    assert res["rope_types"] == ["YarnRotaryEmbedding"]
    assert res["softmax_scales"] == [pytest.approx(MSCALE2, rel=1e-12)]
    assert res["rope_row"].startswith("yarn (theta 10000, factor 40 over 4096 positions") and "softmax x1.874" in res[
        "rope_row"]


def test_the_reference_depends_on_yarn(res):
    """The checks bite: plain RoPE, or YaRN's softmax scale with plain RoPE frequencies, or
    YaRN without the softmax mscale, each move transformers' logprobs by far more than 1e-5."""
    assert min(min(x) for x in res["hf"]) < -7.0  # far from uniform (log 256 = -5.55)
    for other in ("hf_plain_rope", "hf_plain_freqs", "hf_no_softmax_mscale"):
        assert _maxdiff(res[other], res["hf"]) > 1e-2, other


@pytest.mark.parametrize("layout", ["tp1", "tp2"])
def test_logprobs_equal_transformers(res, layout):
    got = res["tp1"] if layout == "tp1" else res["tp2"]["logp"]
    assert _maxdiff(got, res["hf"]) < 1e-5


def test_dropping_the_softmax_mscale_fails_parity(res):
    """The trainer with its MLA softmax scale set back to 1/sqrt(q_head_dim): far from
    transformers' YaRN model (the parity test above would fail), equal to transformers with
    the same mscale taken out."""
    assert _maxdiff(res["tp1_no_softmax_mscale"], res["hf"]) > 1e-2
    assert _maxdiff(res["tp1_no_softmax_mscale"], res["hf_no_softmax_mscale"]) < 1e-5


@pytest.mark.parametrize("layout", ["convert_tp1", "convert_tp2"])
def test_conversion_round_trip_bit_exact(res, layout):
    r = res[layout] if layout == "convert_tp1" else res["tp2"][layout]
    assert r == {"bit_exact": True, "n_tensors": 91, "rope_kept": True}


def test_gqa_family_yarn_equals_transformers(res):
    """qwen3_moe with YaRN rope_parameters (factor 4; cos/sin x get_mscale(4) = 1.139 in both):
    Megatron's GPTModel YarnRotaryEmbedding, logprobs equal transformers' within 1e-5, far
    from plain RoPE's."""
    assert res["qwen3_pos_emb"] == "YarnRotaryEmbedding"
    assert _maxdiff(res["qwen3_tp1"], res["qwen3_hf"]) < 1e-5
    assert _maxdiff(res["qwen3_hf_plain"], res["qwen3_hf"]) > 1e-2
