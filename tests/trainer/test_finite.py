"""C28: a non-finite value where the mask is zero never poisons a step, and a non-finite loss,
gradient or weight never passes silently (moe_async/trainer/loss.py, moe_async/trainer/finite.py).

The trainer checks run ``_finite_checks.py`` in a fresh process (1 process) and in one 2-rank
torchrun for both layouts: DP2 (the NaN sample sits in rank 1's slice, the NaN gradient is made
on rank 0 and the NaN weight on rank 1 only) and PP2 (the loss, the NaN gradient's origin and the final norm on the
last stage only), so every failure must be agreed by all ranks."""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch
from _launch import free_port, run, selected_params

from moe_async.trainer.loss import grpo_token_loss, masked_mean

HERE = os.path.dirname(__file__)
NAN = float("nan")


def test_masked_token_mean_by_selection():
    x = torch.tensor([1.0, NAN, 3.0], requires_grad=True)
    mean = masked_mean(x, torch.tensor([1.0, 0.0, 1.0]))
    assert mean.item() == 2.0
    mean.backward()
    assert x.grad.tolist() == [0.5, 0.0, 0.5]  # NaN x 0 would have given NaN here


def test_grpo_loss_nan_logp_under_zero_mask():
    logp = torch.tensor([[-1.0, NAN, -0.5]], requires_grad=True)
    mask = torch.tensor([[1.0, 0.0, 1.0]])
    loss, m = grpo_token_loss(logp, torch.tensor([[2.0]]), mask, torch.tensor([[-1.0, -1.0, -0.5]]))
    assert loss.item() == pytest.approx(-4.0)  # -A * (w=1 + w=1), tis weights exp(0) = 1
    loss.backward()
    assert logp.grad.tolist() == [[-2.0, 0.0, -2.0]]
    assert m["nonfinite_rows"].tolist() == [False]
    assert m["pg_loss"].item() == pytest.approx(-2.0) and m["kl_k3"].item() == 0.0


@pytest.mark.parametrize("corr", ["tis", "tis_seq", "mis", "mis_seq", "icepop", "opsm"])
def test_nan_rollout_logp_of_zero_weight_row_is_inert(corr):
    """Row 1 has loss weight 0 and a NaN rollout logprob: the loss, the metrics and the
    gradient equal those of the same batch with that logprob finite."""
    def run_loss(bad):
        logp = torch.tensor([[-1.0, -2.0], [-0.3, -0.7]], requires_grad=True)
        roll = torch.tensor([[-1.2, -1.9], [bad, -0.6]])
        loss, m = grpo_token_loss(logp, torch.tensor([[1.0], [-1.0]]), torch.tensor([[1.0, 1.0], [0.0, 0.0]]),
                                  roll, off_policy_correction=corr)
        loss.backward()
        return loss.item(), {k: v.tolist() for k, v in m.items()}, logp.grad.tolist()

    got, ref = run_loss(NAN), run_loss(-0.5)
    assert got == ref
    assert got[0] == got[0]  # finite
    assert got[2][1] == [0.0, 0.0]


def test_nan_at_loss_bearing_token_is_flagged():
    logp = torch.tensor([[-1.0, -2.0], [-0.3, -0.7]], requires_grad=True)
    roll = torch.tensor([[-1.2, -1.9], [NAN, -0.6]])
    loss, m = grpo_token_loss(logp, torch.tensor([[1.0], [-1.0]]), torch.ones(2, 2), roll)
    assert loss.item() != loss.item()  # NaN: not hidden
    assert m["nonfinite_rows"].tolist() == [False, True]


def _check_trainer(r: dict, world: int, pp: bool = False) -> None:
    z = r["zero_weight_nan"]
    assert z["ok"] and z["m"]["loss"] == r["ref_step"]["loss"] and z["m"]["grad_norm"] == r["ref_step"]["grad_norm"]
    assert r["zero_weight_nan_equals_ref"]  # the same update as without the NaN
    for e in r["nan_loss"]:
        assert not e["ok"] and "non-finite loss" in e["error"] and "sample(s) 6 (group_id 3, sample_index 2)" in e["error"]
        assert "weight_version 0" in e["error"]
    assert len(r["nan_loss"]) == world
    assert r["nan_loss_version"] == [0] * world and r["nan_loss_unchanged"]
    assert len(r["nan_grad"]) == world
    for e in r["nan_grad"]:
        assert not e["ok"] and "non-finite gradient" in e["error"]
        assert ("parameter module." if pp else "parameter module.embedding") in e["error"]
    assert r["nan_grad_version"] == [0] * world and r["nan_grad_unchanged"]
    # after two refused steps the next one is exactly a fresh trainer's first (nothing kept)
    assert r["after_step"]["loss"] == r["ref_step"]["loss"]
    assert r["after_step"]["grad_norm"] == r["ref_step"]["grad_norm"]
    assert r["after_version"] == 1 and r["after_equals_ref"]
    assert [e["kind"] for e in r["export"]] == ["NonFiniteError"] * world
    assert any("decoder.final_layernorm.weight holds NaN/inf" in e["error"] for e in r["export"])
    assert r["exported_before_error"] == [0] * world
    assert r["raised_at_call"] == [True] * world  # at the call: a send(export, v) never pauses an engine for it


@pytest.fixture(scope="module")
def cpu_only():
    if torch.cuda.is_available():
        pytest.skip("CPU/gloo checks")


def test_trainer_one_process(cpu_only, tmp_path):
    run([sys.executable, os.path.join(HERE, "_finite_checks.py"), "one", str(tmp_path), str(tmp_path)], timeout=240)
    _check_trainer(json.loads((tmp_path / "one.json").read_text()), 1)


@pytest.fixture(scope="module")
def two_ranks(cpu_only, request, tmp_path_factory) -> dict:
    """One 2-rank torchrun of every selected layout (DP2, PP2): ``{layout: results}``."""
    layouts = sorted(selected_params(request, "layout"))
    tmp = tmp_path_factory.mktemp("finite")
    run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_addr=127.0.0.1",
         f"--master_port={free_port()}", os.path.join(HERE, "_finite_checks.py"), ",".join(layouts), str(tmp),
         str(tmp)], timeout=150 + 150 * len(layouts))
    return {layout: json.loads((tmp / f"{layout}.json").read_text()) for layout in layouts}


@pytest.mark.parametrize("layout", ["dp2", "pp2"])
def test_trainer_two_ranks(two_ranks, layout):
    _check_trainer(two_ranks[layout], 2, pp=layout == "pp2")
