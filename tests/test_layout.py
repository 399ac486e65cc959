"""Megatron's layout rule (moe_async/layout.py, case C24) and the trainer's world size."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from moe_async.layout import LayoutError, resolve_layout
from moe_async.trainer.config import TrainerConfig


def test_c24_etp_unset_defaults_to_tp_and_is_named():
    with pytest.raises(LayoutError, match=r"expert_tensor_parallel_size unset \(Megatron's default: = TP = 4\)"):
        resolve_layout(64, tp=4, pp=16, ep=4)


@pytest.mark.parametrize("world,kw,dp,edp", [
    (64, dict(tp=4, pp=16, ep=4, etp=1), 1, 1),
    (256, dict(tp=4, pp=8, cp=8, ep=32, etp=1), 1, 1),
    (32, dict(tp=1, pp=2, ep=16), 16, 1),
    (16, dict(tp=2, pp=2, ep=2, etp=2), 4, 2),
])
def test_c24_accepted_layouts(world, kw, dp, edp):
    lay = resolve_layout(world, **kw)
    assert (lay.dp, lay.edp) == (dp, edp)
    assert lay.tp * lay.cp * lay.dp * lay.pp == world == lay.etp * lay.ep * lay.edp * lay.pp


def test_c24_tp_pp_ep_is_not_the_rule():
    # TP1 x PP2 x EP32 = 64 != 32 would be refused by a TP x PP x EP rule and by Megatron alike;
    # TP4 x PP8 x EP32 = 1024 != 256 is accepted by Megatron (EP lies across DP x CP x TP)
    with pytest.raises(LayoutError, match=r"expert_model_parallel_size=32 x trainer.pipeline_model_parallel_size=2 = 64"):
        resolve_layout(32, tp=1, pp=2, ep=32)
    assert resolve_layout(256, tp=4, pp=8, cp=8, ep=32, etp=1).dp == 1


def test_dense_rule_refusal_names_fields():
    with pytest.raises(LayoutError, match=r"world_size=6 is not divisible by .*tensor_model_parallel_size=4"):
        resolve_layout(6, tp=4)


def test_trainer_world_size_derivation():
    assert TrainerConfig().layout.world_size == 1
    lay = TrainerConfig(expert_model_parallel_size=2).layout
    assert (lay.world_size, lay.dp, lay.edp) == (2, 2, 1)
    lay = TrainerConfig(tensor_model_parallel_size=2, nodes=2, devices_per_node=4).layout
    assert (lay.world_size, lay.dp, lay.edp) == (8, 4, 8)
    with pytest.raises(ValidationError, match="trainer.world_size=8 differs from trainer.nodes=1 x trainer.devices_per_node=4"):
        TrainerConfig(world_size=8, devices_per_node=4)
    with pytest.raises(ValidationError, match="not divisible by trainer.nodes=3"):
        TrainerConfig(world_size=4, nodes=3)
    with pytest.raises(ValidationError, match="expert rule"):
        TrainerConfig(world_size=2, expert_model_parallel_size=4)
