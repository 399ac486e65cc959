"""trainer.lora validation: PEFT names, fused groups, refusals naming the field."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from moe_async.cli import main
from moe_async.config import ConfigError, load_config
from moe_async.lora.config import LoraConfig
from moe_async.trainer.config import TrainerConfig


def test_defaults_and_scaling():
    c = LoraConfig(rank=8, alpha=32)
    assert c.scaling == 4.0 and c.experts == "per_expert"
    assert TrainerConfig(lora={"rank": 4, "target_modules": ["o_proj", "q_proj", "k_proj", "v_proj"]}).lora.target_modules \
        == ["q_proj", "k_proj", "v_proj", "o_proj"]


@pytest.mark.parametrize("bad, words", [
    ({"target_modules": ["q_proj"]}, "fuses"),
    ({"target_modules": ["gate_proj", "down_proj"]}, "up_proj"),
    ({"target_modules": ["w1"]}, "unknown"),
    ({"rank": 0}, "rank"),
    ({"experts": "all"}, "experts"),
    ({"ranks": 4}, "ranks"),
])
def test_refusals_name_the_field(bad, words):
    with pytest.raises(ValueError, match=words):
        TrainerConfig(lora=bad)


# ------------------------------------------------- refused at config load, not after start-up
SMOKE = Path(__file__).resolve().parents[2] / "configs" / "cpu_smoke.yaml"
LORA = ["trainer.lora.rank=4"]


@pytest.mark.parametrize("overrides, message", [
    (["trainer.lora.dropout=0.1"], "trainer.lora.dropout=0.1 with trainer.lora.experts='per_expert': PEFT's"),
    (["trainer.lora.experts=shared", "trainer.expert_model_parallel_size=2"],
     "trainer.lora.experts='shared' with trainer.expert_model_parallel_size=2"),
    (["trainer.moe_grouped_gemm=true"], "trainer.lora.experts='per_expert' with trainer.moe_grouped_gemm=true"),
    (["trainer.expert_tensor_parallel_size=2", "trainer.tensor_model_parallel_size=2"],
     "trainer.lora.experts='per_expert' with trainer.expert_tensor_parallel_size=2"),
    (["weight_sync.senders=all"], "weight_sync.senders='all' with trainer.lora"),
])
def test_lora_combinations_refused_at_load(overrides, message):
    """These failed only inside the trainer actor (after model preparation and engine start-up)
    as a traceback, or (several senders) were silently ignored; now refused by the config."""
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(SMOKE, LORA + overrides)
    if not any(o.startswith("trainer.lora") for o in overrides):
        try:  # the same without LoRA: not refused for LoRA's sake
            load_config(SMOKE, overrides)
        except ConfigError as e:
            assert "trainer.lora" not in str(e)


@pytest.mark.parametrize("overrides", [["trainer.lora.dropout=0.1", "trainer.lora.experts='off'"],
                                       ["trainer.expert_model_parallel_size=2", "trainer.lora.experts=per_expert"],
                                       ["trainer.pipeline_model_parallel_size=2"],
                                       ["trainer.expert_tensor_parallel_size=2", "trainer.tensor_model_parallel_size=2",
                                        "trainer.lora.experts='off'"]])
def test_lora_combinations_that_run_are_accepted(overrides):
    assert load_config(SMOKE, LORA + overrides).trainer.lora.rank == 4


def test_show_config_refuses_in_one_line_exit_2(capsys):
    assert main(["show-config", str(SMOKE), *LORA, "trainer.lora.dropout=0.1"]) == 2
    err = capsys.readouterr().err.splitlines()  # the config refusals' form: file, then the field's message
    assert err == [f"moe-async: invalid config {SMOKE}:", "  trainer.lora.dropout=0.1 with trainer.lora.experts="
                   "'per_expert': PEFT's adapters on fused expert parameters take no dropout; set dropout 0 or experts 'off'"]


# ------------------------------------- a LoRA checkpoint's trainer.lora checked before any process
def _lora_step(tmp_path: Path, lora: dict | None) -> Path:
    """A step dir as a run with trainer.save_interval writes it (the side files only)."""
    import json

    step = tmp_path / "ckpt" / "step_2"
    step.mkdir(parents=True)
    (step / "metadata.json").write_text("{}")
    (step / "moe_async_version.txt").write_text("2")
    (step / "moe_async_state.json").write_text(json.dumps({"version": 2, "extra": {"step": 2},
                                                           **({"lora": lora} if lora else {})}))
    return step


_SAVED = {"base": "/cache/random_moe-x", "base_digest": "ab" * 32, "rank": 4, "alpha": 32.0,
          "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
          "experts": "per_expert"}


@pytest.mark.parametrize("saved, overrides, message", [
    (_SAVED, [], "holds LoRA adapters only (trainer.lora.rank=4, base /cache/random_moe-x); set trainer.lora"),
    (_SAVED, ["trainer.lora.rank=8"], "its adapters have trainer.lora.rank=4, this trainer trainer.lora.rank=8"),
    (_SAVED, ["trainer.lora.rank=4", "trainer.lora.alpha=16"], "trainer.lora.alpha=32.0, this trainer trainer.lora.alpha=16.0"),
    (_SAVED, ["trainer.lora.rank=4", "trainer.lora.experts=shared"], "trainer.lora.experts='per_expert', this trainer"),
    (None, ["trainer.lora.rank=4"], "was saved without trainer.lora (a full model checkpoint)"),
])
def test_lora_resume_mismatch_refused_before_processes(tmp_path, monkeypatch, capsys, saved, overrides, message):
    """A resume whose trainer.lora disagrees with the checkpoint's adapters: refused from
    moe_async_state.json in one line, exit 2, no run dir, no process (before, the trainer actor
    refused it after the model, engines and trainer had started, leaving a run dir)."""
    import moe_async.orchestration.driver as driver
    from moe_async.errors import UserInputError

    step = _lora_step(tmp_path, saved)
    cfg = [f"trainer.load={step}", "num_steps=3", *overrides]
    with pytest.raises(UserInputError, match=re.escape(message)):
        driver.resolve_checkpoint(load_config(SMOKE, cfg))

    def no_process(*a, **k):
        raise AssertionError("a process or Ray was started")

    monkeypatch.setattr(driver, "init_ray", no_process)
    runs = tmp_path / "runs"
    assert main(["train", str(SMOKE), *cfg, f"logging.output_dir={runs}"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and message in err[0] and str(step) in err[0]
    assert not runs.exists()


def test_lora_resume_same_fields_passes_start_up(tmp_path):
    step = _lora_step(tmp_path, _SAVED)
    from moe_async.orchestration.driver import resolve_checkpoint

    assert resolve_checkpoint(load_config(SMOKE, [f"trainer.load={step}", "num_steps=3", "trainer.lora.rank=4"])) \
        == (str(step), 2)
    assert resolve_checkpoint(load_config(SMOKE, [f"trainer.load={_lora_step(tmp_path / 'full', None)}",
                                                  "num_steps=3"]))[1] == 2


# ------------------------------------------------ target modules that match no linear of the model
def test_lora_matching_nothing_refused_before_processes(tmp_path, monkeypatch, capsys):
    """cpu_smoke's model has MoE layers only (no dense or shared-expert MLP): MLP targets with
    experts 'off' adapt nothing. Before, the run started and its first train step failed with
    IndexError after ~45 s; now one line naming the fields, exit 2, no run dir, no process."""
    import moe_async.orchestration.driver as driver

    def no_process(*a, **k):
        raise AssertionError("a process or Ray was started")

    monkeypatch.setattr(driver, "init_ray", no_process)
    runs = tmp_path / "runs"
    assert main(["train", str(SMOKE), *LORA, "trainer.lora.target_modules=[gate_proj,up_proj,down_proj]",
                 "trainer.lora.experts='off'", f"logging.output_dir={runs}"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith(
        "moe-async: trainer.lora.target_modules=['gate_proj', 'up_proj', 'down_proj'] with trainer.lora.experts='off' "
        "adapt no linear of the model model.source=random_moe (mixtral: GQA attention, no dense or shared-expert MLP, "
        "2 MoE layer(s) of routed experts)"), err
    assert not runs.exists()


def test_targets_that_adapt_nothing_per_family():
    """The plan counts what add_lora attaches (GQA's qkv and o, MLA's o only, MLPs, routed
    experts), and the refusal is a count of 0 exported elements: per family, the target sets
    that adapt nothing are refused and the others counted (default rank 16)."""
    import types

    from moe_async.layout import ParallelLayout
    from moe_async.models.prepare import configured_hf_config
    from moe_async.plan.arch import model_shape
    from moe_async.plan.lora import lora_counts
    from moe_async.plan.report import lora_match_error

    mix_hf = configured_hf_config(load_config(SMOKE).model)
    ds3_hf = load_config(SMOKE.parent / "deepseek_v3.yaml").model.arch
    mix, ds3 = model_shape(mix_hf, "smoke"), model_shape(ds3_hf, "ds3")

    def peft(shape, targets, experts="per_expert"):
        lo = LoraConfig(target_modules=targets, experts=experts)
        n = lora_counts(shape, list(shape.layers), lo, ParallelLayout(world_size=1)).peft
        refused = lora_match_error(types.SimpleNamespace(trainer=types.SimpleNamespace(lora=lo)),
                                   mix_hf if shape is mix else ds3_hf, shape.source)
        assert (refused is not None) == (n == 0), (targets, experts, n, refused)
        return n

    assert peft(mix, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]) > 0
    assert peft(mix, ["q_proj", "k_proj", "v_proj"], "off") > 0 and peft(mix, ["o_proj"], "off") > 0
    assert peft(mix, ["gate_proj", "up_proj", "down_proj"], "off") == 0  # MoE layers only
    assert peft(ds3, ["q_proj", "k_proj", "v_proj"], "off") == 0  # MLA: no fused q/k/v
    # MLA's o: 61 layers x (A 16 x (128 heads x v_head_dim 128) + B 7168 x 16)
    assert peft(ds3, ["o_proj"], "off") == 61 * (16 * 128 * 128 + 7168 * 16) == 22_986_752
    # down_proj alone: 3 dense MLPs of 18432 and 58 shared experts of 2048, A 16 x width + B 7168 x 16
    assert peft(ds3, ["down_proj"], "off") == 3 * (16 * 18432 + 7168 * 16) + 58 * (16 * 2048 + 7168 * 16)
    assert peft(ds3, ["q_proj", "k_proj", "v_proj"], "per_expert") == 0  # no MLP target: no expert adapter


def test_plan_refuses_targets_that_adapt_nothing(capsys):
    """`moe-async plan` refuses what train refuses (exit 2, naming both fields), instead of a
    table of 0 adapter parameters; the hint to adapt routed experts only where they are off."""
    ds3 = str(SMOKE.parent / "deepseek_v3.yaml")
    assert main(["plan", ds3, "trainer.lora.rank=16", "trainer.lora.target_modules=[q_proj,k_proj,v_proj]"]) == 2
    err = capsys.readouterr().err
    assert ("trainer.lora.target_modules=['q_proj', 'k_proj', 'v_proj'] with trainer.lora.experts='per_expert' "
            "adapt no linear of the model") in err and "MLA attention" in err, err
    assert err.rstrip().endswith("nothing would train; add target modules"), err
    assert main(["plan", ds3, "trainer.lora.rank=16", "trainer.lora.target_modules=[o_proj]"]) in (0, 3)
    assert "adapter parameters per GPU" in capsys.readouterr().out
