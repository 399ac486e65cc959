"""Router replay in MegatronTrainer (1 CPU process, gloo), all modes in ONE subprocess.

The supplied "engine" routes come from a different random router, so the trainer's own
choice disagrees with them (checked in mode off): R3 must force them on 100% of real tokens."""

from __future__ import annotations

import os

import pytest
from _launch import cpu_check_json

HERE = os.path.dirname(__file__)


@pytest.fixture(scope="module")
def res(tmp_path_factory):
    return cpu_check_json(os.path.join(HERE, "_replay_checks.py"), str(tmp_path_factory.mktemp("rc")), timeout=300)


def test_routes_differ_without_replay(res):
    off = res["off"]
    assert off["agree"] < 0.5 * off["total"]  # the test would fail without replay
    assert off["metrics"]["routing_agreement"] == pytest.approx(off["agree"] / off["total"])


def test_r3_forces_engine_routes_on_every_real_token(res):
    r3 = res["R3"]
    assert r3["n_routers"] == 2
    assert r3["total"] == 2 * sum(n - 1 for n in (12, 9, 12, 13, 11))
    assert r3["agree"] == r3["total"]  # 100% of (real token, layer) pairs


def test_r3_gate_weights_from_trainer_scores_and_router_learns(res):
    r3 = res["R3"]
    assert r3["gate_err"] < 1e-6  # probs = softmax of the trainer's logits over the replayed k
    assert r3["router_moved"] > 0  # the router still gets gradients
    assert r3["metrics"]["loss"] != res["off"]["metrics"]["loss"]


def test_r3_padding_valid_and_spread(res):
    r3 = res["R3"]
    assert r3["pad_ok"]  # every pad row routed to exactly top-k valid experts
    for layer in r3["pad_counts"]:
        assert max(layer) - min(layer) <= 1, layer


def test_replay_state_cleared_after_step(res):
    for m in ("off", "R3", "R2"):
        assert res[m]["replay_instances_clean"], m


def test_r2_replays_own_old_policy_routes(res):
    # one optimizer step per batch: the old policy's routes are the trainer's own -> same step as off
    assert res["R2"]["metrics"]["loss"] == res["off"]["metrics"]["loss"]
    assert res["R2"]["agree"] == res["off"]["agree"]


def test_mismatch_metrics_reported(res):
    for m in ("off", "R3", "R2"):
        mm = res[m]["metrics"]
        for k in ("mismatch_logp_absdiff_mean", "mismatch_logp_absdiff_max", "mismatch_kl_k3",
                  "mismatch_ratio_gt2_frac", "routing_agreement", "routing_agreement_l0", "routing_agreement_l1"):
            assert k in mm, (m, k)
        assert mm["mismatch_num_tokens"] == 26
        assert mm["mismatch_logp_absdiff_max"] >= mm["mismatch_logp_absdiff_mean"] > 0


def test_r3_without_routes_is_a_clear_error(res):
    assert "router_replay='R3' needs routed experts" in res["missing_err"]


def test_replay_agreement_metric_counts_the_used_routes(res):
    """R3: every real (token, layer) pair used the engine's experts (replay_agreement 1.0, the
    metric the driver logs as train/replay_agreement); off and R2 do not report it."""
    assert res["R3"]["metrics"]["replay_agreement"] == 1.0
    assert "replay_agreement" not in res["off"]["metrics"] and "replay_agreement" not in res["R2"]["metrics"]
