"""The two implementations of the model agree: logprobs the embedded engine server returns
for a sequence equal the Megatron trainer's logprobs for the same weights (fp32)."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

from moe_async.engines.base import make_engine
from moe_async.engines.client import SyncEngineClient
from moe_async.engines.config import EngineConfig
from moe_async.models.config import ModelConfig
from moe_async.models.prepare import prepare_hf_checkpoint

_TRAINER = textwrap.dedent(
    """
    import json, sys
    from moe_async.trainer.config import TrainerConfig
    from moe_async.trainer.megatron_trainer import MegatronTrainer
    from moe_async.types import Sample
    path, seqs = sys.argv[1], json.loads(sys.stdin.read())
    tr = MegatronTrainer(TrainerConfig(), path)
    out = tr.compute_logprobs([Sample(p, r, [0.0] * len(r), [0] * len(r)) for p, r in seqs])
    print("RESULT" + json.dumps(out))
    tr.close()
    """
)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    cfg = ModelConfig(source="random_moe", num_layers=2, hidden_size=64, intermediate_size=128,
                      num_attention_heads=4, num_key_value_heads=2, init_seed=7,
                      cache_dir=str(tmp_path_factory.mktemp("cache")))
    return str(prepare_hf_checkpoint(cfg))


def test_engine_logprobs_equal_megatron_logprobs(model_path):
    eng = make_engine(EngineConfig(num_threads=1), model_path, 0)
    eng.launch()
    try:
        client = SyncEngineClient(eng.url)
        prompts = [[1, 504, 3370, 28, 17, 30, 216], [1, 2085, 3, 17, 99]]
        seqs, engine_lp = [], []
        for i, p in enumerate(prompts):
            # one greedy, one sampled at T=1 (logprobs of the untempered distribution both times)
            sp = {"max_new_tokens": 12, "temperature": 0.0 if i == 0 else 1.0, "ignore_eos": True}
            out = client.generate(p, sp, return_logprob=True)
            assert len(out.output_ids) == 12 and len(out.output_logprobs) == 12
            seqs.append([p, out.output_ids])
            engine_lp.append(out.output_logprobs)
    finally:
        log_path = eng.log_path
        eng.shutdown()
    assert log_path and not os.path.exists(log_path)  # a clean stop leaves no log behind
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", _TRAINER, model_path], input=json.dumps(seqs),
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    trainer_lp = json.loads(proc.stdout.split("RESULT", 1)[1])
    diffs = [abs(a - b) for e, t in zip(engine_lp, trainer_lp) for a, b in zip(e, t)]
    assert len(diffs) == 24
    assert max(diffs) <= 1e-4, max(diffs)
    # not trivially equal: the distribution is far from uniform over the 49152-token vocab
    assert min(lp for e in engine_lp for lp in e) < -5
