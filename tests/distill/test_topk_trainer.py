"""The Megatron trainer's top-k forward KL term (tests/distill/_topk_reference_checks.py): one
distillation step (reverse-KL advantages + ``topk_kl_coef`` x the teacher top-k forward KL, token
TIS, one sample without a top-k) equals a plain-PyTorch step on the same Hugging Face model and
batch -- loss, mean KL per token and the gradient under HF names to fp32 rounding; at TP2 (sequence
parallel: the output layer's vocabulary shards all-gathered, the k ids gathered from the whole
vocabulary) and CP2 (top-k ids split with the labels, the student's top-k logprobs gathered over
CP) the step equals 1 process."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from _launch import torchrun

HERE = Path(__file__).resolve().parent
SCRIPT = str(HERE / "_topk_reference_checks.py")


@pytest.fixture(scope="module")
def ref(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("topk")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("WORLD_SIZE", None), env.pop("RANK", None)
    p = subprocess.run([sys.executable, SCRIPT, "ref", str(tmp)], capture_output=True, text=True, env=env,
                       timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    return tmp, json.loads((tmp / "ref.json").read_text())


def test_topk_step_equals_reference(ref):
    _, r = ref
    m = r["train"]
    assert m["topk_tokens"] == r["ref_topk_tokens"] and 0 < m["topk_tokens"] < m["num_tokens"]  # one sample without
    assert abs(m["topk_forward_kl"] - r["ref64_kl"]) < 1e-6 * abs(r["ref64_kl"]) and r["ref64_kl"] > 0.5
    assert abs(m["loss"] - r["ref64_loss"]) < 2e-6 * abs(r["ref64_loss"])
    assert m["topk_kl_loss"] > 0.3 and abs(m["pg_loss"]) > 0.1  # both terms carry weight
    # The gradient: both sides in fp32 with different kernels. Measured: trainer vs HF fp32 max abs
    # 1.2e-6 (largest element 0.65), trainer vs the float64 reference 3.3e-6 while HF's own fp32
    # is 3.7e-6 from it: the trainer is as close to the exact gradient as HF's fp32.
    assert r["grad_vs_ref64"]["max_abs_diff"] <= 1.1 * r["ref32_vs_ref64"]["max_abs_diff"], r
    assert r["grad_vs_ref64"]["rel_l2"] < 1e-5 and r["grad_vs_ref32"]["rel_l2"] < 1e-5, r
    assert r["grad_vs_ref32"]["abs_max"] > 0.1  # the check bites


@pytest.mark.slow
def test_topk_tp2_and_cp2_equal_one_process(ref, tmp_path):
    """Slow (a 2-process torchrun). By default TP2 and CP2 logprobs and steps equal 1 process in
    tests/trainer/test_layouts.py; the top-k ids are gathered from the same full-vocabulary
    log-softmax (``parallel_output=False``) and, at CP, split and gathered as the labels."""
    tmp, r = ref
    out = tmp_path / "run.json"
    torchrun(2, SCRIPT, "run", str(tmp), str(out), "tp2", "cp2", timeout=600)
    res = json.loads(out.read_text())
    one = r["train"]
    for case in ("tp2", "cp2"):
        m, g = res[case]["train"], res[case]["grad_vs_tp1"]
        assert m["topk_tokens"] == one["topk_tokens"] and m["num_tokens"] == one["num_tokens"], case
        for k in ("loss", "topk_kl_loss", "topk_forward_kl", "grad_norm"):
            assert abs(m[k] - one[k]) <= 1e-5 * abs(one[k]), (case, k, m[k], one[k])
        assert g["rel_l2"] < 1e-5 and g["max_abs_diff"] < 1e-5 * max(1.0, g["abs_max"]), (case, g)
