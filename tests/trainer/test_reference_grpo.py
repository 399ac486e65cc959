"""The trainer's GRPO step equals a plain-PyTorch GRPO step on the same Hugging Face model and
batch, piece by piece (tests/trainer/_reference_checks.py): advantages, per-token logprobs,
the TIS-weighted loss value, the gradient (under HF names) and the Adam update.

Measured (tiny Mixtral, 2 groups x 4 samples, 45 response tokens, TIS weight mean 1.58 with 13
tokens at the cap 2): logprobs within 4.3e-6 of transformers, loss 0.142979 both (1e-6
relative), gradient cosine 1 - 3e-12 with norm ratio 0.9999995 (grad norm 16.368), Adam update
cosine 1 - 3e-10 with norm ratio 0.999999."""

import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def test_trainer_step_equals_reference_grpo_step(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("WORLD_SIZE", None), env.pop("RANK", None)
    p = subprocess.run([sys.executable, str(HERE / "_reference_checks.py"), str(tmp_path)],
                       capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    r = json.loads(p.stdout.strip().splitlines()[-1])
    assert r["adv_max_abs_diff"] < 1e-12
    assert r["weights_equal_before"] == 0.0
    assert r["logp_max_abs_diff"] < 1e-4 and r["logp_min"] < -5  # far from uniform: the check bites
    assert r["tis_capped"] > 0 and abs(r["tis_mean_ref"] - 1.0) > 0.05  # TIS weights not trivial
    assert abs(r["train_tis_mean"] - r["tis_mean_ref"]) < 1e-5
    assert abs(r["train_pg_loss"] - r["ref_loss"]) < 1e-5 * max(1.0, abs(r["ref_loss"]))
    assert r["train_num_tokens"] == 45
    assert r["grad_cos"] > 1 - 1e-6 and abs(r["grad_norm_ratio"] - 1) < 1e-4
    assert abs(r["train_grad_norm"] - r["grad_norm_ref"]) < 1e-4 * r["grad_norm_ref"]
    assert r["update_cos"] > 1 - 1e-5 and abs(r["update_norm_ratio"] - 1) < 1e-3
    assert r["update_max_abs"] < 1.001e-3  # Adam's first step: at most lr per element
    assert r["adv_weighted_logp_gain"] > 0
