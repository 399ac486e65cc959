"""`moe-async train configs/cpu_smoke.yaml` with a distillation teacher and the top-k forward KL
term, end to end, 2 steps: the teacher returns its top-k for every scored token, the trainer adds
the term, and the metrics show it.

Slow (a second ``moe-async train``). By default: the distillation run end to end is
tests/distill/test_distill_e2e.py; the teacher engine's top-k vs transformers is
tests/distill/test_teacher_engine.py::test_teacher_top_k_equals_transformers; the trainer's term
vs a plain-PyTorch step is tests/distill/test_topk_trainer.py::test_topk_step_equals_reference."""

import math

import pytest
from _launch import finished_train


@pytest.mark.slow
def test_topk_forward_kl_run_shows_the_term(tmp_path):
    proc, _, summary, steps = finished_train(tmp_path, "num_steps=2", "teacher.enabled=true", "teacher.few_shot=1",
                                             "teacher.topk_forward_kl_coef=0.5", "teacher.top_k=5")
    assert summary["rollout"]["teacher/failures"] == 0 and summary["final_weights_match"] is True
    assert len(steps) == 2
    for m in steps:
        # every trained token has the teacher's top-5, and the term is in the loss
        assert m["train/topk_tokens"] == m["train/response_tokens"] > 0
        kl = m["teacher/topk_forward_kl"]
        assert math.isfinite(kl) and kl != 0.0 and kl == m["train/topk_forward_kl"]
        aux = 0.01 * m["train/moe_aux_loss"]  # cpu_smoke's trainer.moe_aux_loss_coeff
        assert m["train/loss"] == pytest.approx(m["train/pg_loss"] + m["train/topk_kl_loss"] + aux, abs=1e-6)
        assert m["train/topk_kl_loss"] != 0.0
