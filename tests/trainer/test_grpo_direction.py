"""A GRPO step moves the policy the right way: after one optimizer step, a sample with a
positive advantage became more likely and one with a negative advantage less likely."""

import json
import os
import subprocess
import sys
import textwrap

_SCRIPT = textwrap.dedent(
    """
    import json, sys
    from moe_async.models.config import ModelConfig
    from moe_async.models.prepare import prepare_hf_checkpoint
    from moe_async.trainer.config import TrainerConfig
    from moe_async.trainer.megatron_trainer import MegatronTrainer
    from moe_async.types import Sample
    path = str(prepare_hf_checkpoint(ModelConfig(source="random_moe", init_seed=3, cache_dir=sys.argv[1])))
    tr = MegatronTrainer(TrainerConfig(lr=1e-3, moe_aux_loss_coeff=0.0), path)
    prompt = [1, 504, 3370, 28]
    good = Sample(prompt, [17, 30, 216, 2], [0.0] * 4, [0] * 4)
    bad = Sample(prompt, [901, 77, 5, 2], [0.0] * 4, [0] * 4)
    before = tr.compute_logprobs([good, bad])
    good.rollout_logprobs, bad.rollout_logprobs = before  # on-policy: TIS weight 1
    m = tr.train_step([good, bad], [1.0, -1.0])
    after = tr.compute_logprobs([good, bad])
    print("RESULT" + json.dumps({"before": before, "after": after, "metrics": m, "version": tr.version}))
    tr.close()
    """
)


def test_grpo_step_direction(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("WORLD_SIZE", None), env.pop("RANK", None)
    p = subprocess.run([sys.executable, "-c", _SCRIPT, str(tmp_path)], capture_output=True,
                       text=True, env=env, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    r = json.loads(p.stdout.split("RESULT", 1)[1])
    (g0, b0), (g1, b1) = r["before"], r["after"]
    assert sum(g1) > sum(g0) + 1e-3
    assert sum(b1) < sum(b0) - 1e-3
    assert r["version"] == 1
    assert abs(r["metrics"]["tis_mean"] - 1.0) < 1e-5
