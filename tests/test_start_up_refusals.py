"""Config values and start-up paths a breaker session found accepted silently or failing late:
each is now refused naming the field (config: ConfigError; start-up: UserInputError, which
``moe-async train`` prints as one line and exit status 2), and the metrics / summary / console
fixes that go with them (rollout counts present from the first step, the wandb hint)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from moe_async.config import ConfigError, load_config
from moe_async.errors import UserInputError
from moe_async.orchestration import driver
from moe_async.orchestration.metrics import LOOP_COUNT_KEYS, loop_metrics

ROOT = Path(__file__).resolve().parents[1]
SMOKE = ROOT / "configs" / "cpu_smoke.yaml"


# ------------------------------------------------------------------ config
def test_single_sample_groups_refused_for_grpo():
    """G = 1: GRPO's group-relative advantage is always 0 (the only estimator), so refused."""
    with pytest.raises(ConfigError, match=r"rollout\.n_samples_per_prompt=1: GRPO's advantage is group-relative"):
        load_config(SMOKE, ["rollout.n_samples_per_prompt=1"])
    assert load_config(SMOKE, ["rollout.n_samples_per_prompt=2"]).rollout.n_samples_per_prompt == 2


def test_zero_filter_cap_refused():
    with pytest.raises(ConfigError, match=r"rollout\.dynamic_filter_max_per_version: .*must be >= 1.*dynamic_filter=false"):
        load_config(SMOKE, ["rollout.dynamic_filter=true", "rollout.dynamic_filter_max_per_version=0"])
    assert load_config(SMOKE, ["rollout.dynamic_filter_max_per_version=1"]).rollout.dynamic_filter_max_per_version == 1


@pytest.mark.parametrize("field", ["tensor_model_parallel_size", "pipeline_model_parallel_size",
                                   "expert_model_parallel_size", "context_parallel_size",
                                   "virtual_pipeline_model_parallel_size", "micro_batch_size"])
@pytest.mark.parametrize("value", ["true", "2.0", "'2'"])
def test_layout_sizes_are_strict_ints(field, value):
    """YAML ``true`` was read as 1 (``2.0`` as 2): a layout size must be written as an int."""
    with pytest.raises(ConfigError, match=rf"trainer\.{field}: Input should be a valid integer"):
        load_config(SMOKE, [f"trainer.{field}={value}"])


def test_layout_sizes_still_take_ints():
    c = load_config(SMOKE, ["trainer.micro_batch_size=2", "trainer.pipeline_model_parallel_size=2",
                            "trainer.virtual_pipeline_model_parallel_size=2"]).trainer
    assert (c.micro_batch_size, c.pipeline_model_parallel_size, c.virtual_pipeline_model_parallel_size) == (2, 2, 2)


# ------------------------------------------------------------------ trainer.save_dir at start-up
@pytest.mark.parametrize("where", ["file", "under_file"])
def test_save_dir_that_cannot_hold_checkpoints_is_refused(tmp_path, where):
    f = tmp_path / "a_file"
    f.write_text("x")
    d = f if where == "file" else f / "ckpts"
    cfg = load_config(SMOKE, [f"trainer.save_dir={d}", "trainer.save_interval=2"])
    with pytest.raises(UserInputError, match=rf"trainer\.save_dir={str(d)!r}: checkpoints cannot be written there"):
        driver.check_save_dir(cfg)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_file"] and f.read_text() == "x"


def test_save_dir_checks_pass_without_creating(tmp_path):
    d = tmp_path / "new" / "ckpts"
    driver.check_save_dir(load_config(SMOKE, [f"trainer.save_dir={d}", "trainer.save_interval=2"]))
    assert not (tmp_path / "new").exists()  # the first save makes it
    # checkpoints off: save_dir is never written, so not checked
    f = tmp_path / "a_file"
    f.write_text("x")
    driver.check_save_dir(load_config(SMOKE, [f"trainer.save_dir={f}"]))
    # ... unless a SIGTERM writes one (MOE_ASYNC_SIGTERM=checkpoint): then it is
    with pytest.raises(UserInputError, match=r"trainer\.save_dir=.*checkpoints cannot be written there"):
        driver.check_save_dir(load_config(SMOKE, [f"trainer.save_dir={f}"]), sigterm_checkpoint=True)


def test_train_with_a_file_as_save_dir_is_one_line_exit_2(tmp_path):
    f = tmp_path / "a_file"
    f.write_text("x")
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    r = subprocess.run([sys.executable, "-m", "moe_async.cli", "train", str(SMOKE), f"trainer.save_dir={f}",
                        "trainer.save_interval=1", f"logging.output_dir={tmp_path / 'runs'}"],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr
    assert r.stderr.splitlines() == [
        f"moe-async: trainer.save_dir={str(f)!r}: checkpoints cannot be written there (it is not a directory)"]
    assert not (tmp_path / "runs").exists()  # refused before the run dir is made


def test_refused_start_leaves_no_claim_in_an_explicit_save_dir(tmp_path):
    """A start refused by a check on the made model (here teacher.top_k above the vocabulary)
    used to leave ``save_dir`` created with this run's owner file in it, naming a run dir it had
    removed: the next run with that save_dir was refused as "another run's"."""
    d = tmp_path / "ckpts"
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    r = subprocess.run([sys.executable, "-m", "moe_async.cli", "train", str(SMOKE), "teacher.enabled=true",
                        "teacher.topk_forward_kl_coef=0.1", "teacher.top_k=100000", "trainer.save_interval=1",
                        f"trainer.save_dir={d}", f"logging.output_dir={tmp_path / 'runs'}"],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 2, r.stderr
    assert "teacher.top_k=100000 exceeds the vocabulary" in r.stderr
    assert not d.exists()  # no claim, no directory made for it
    assert list((tmp_path / "runs").iterdir()) == []  # and no run dir


def test_train_refuses_a_layout_the_model_cannot_take_before_ray(tmp_path):
    """TP3 on the smoke model (4 heads, 2 KV heads) passes the config (3 ranks) but not the
    model: refused at start-up with plan's rules, naming the field and the model's numbers,
    before any Ray process (fresh-user finding: it used to reach Megatron's own assertion)."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    r = subprocess.run([sys.executable, "-m", "moe_async.cli", "train", str(SMOKE), "trainer.world_size=3",
                        "trainer.tensor_model_parallel_size=3", f"logging.output_dir={tmp_path / 'runs'}",
                        f"model.cache_dir={tmp_path / 'cache'}"],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180)
    assert r.returncode == 2, r.stderr
    (line,) = [ln for ln in r.stderr.splitlines() if ln.startswith("moe-async:")]
    assert "layout does not fit the model" in line
    assert "trainer.tensor_model_parallel_size=3 does not divide the 4 attention heads" in line
    assert "trainer.tensor_model_parallel_size=3 does not divide the 2 KV groups" in line
    assert "Traceback" not in r.stderr and "[moe-async] trainer:" not in r.stdout  # no rank was started
    # refused on the config.json known from the config's sizes (issue 16): no run dir, no model made
    assert "layout does not fit the model model.source=random_moe: " in line
    assert sorted(p.name for p in tmp_path.iterdir()) == [], sorted(tmp_path.iterdir())


@pytest.mark.parametrize("override,field", [("trainer.moe_token_dispatcher_type=flex",
                                             "trainer.moe_token_dispatcher_type='flex'")])
def test_train_refuses_kernels_this_host_cannot_build_before_ray(tmp_path, override, field):
    """A local run asking for the flex dispatcher on a host without CUDA / DeepEP: one line naming
    the field, exit 2, before any Ray process or run dir (the trainer actor used to refuse it
    after Ray and the engines started). (The grouped expert MLP builds on such a host:
    tests/trainer/test_grouped_mlp_cpu.py; its refusal on a CUDA host without TE or grouped_gemm:
    tests/trainer/test_memory_features.py.)"""
    import torch

    if torch.cuda.is_available():
        pytest.skip("refusals of a CPU host")
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    r = subprocess.run([sys.executable, "-m", "moe_async.cli", "train", str(SMOKE), override,
                        f"logging.output_dir={tmp_path / 'runs'}", f"model.cache_dir={tmp_path / 'cache'}"],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180)
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr and "[moe-async] trainer:" not in r.stdout
    (line,) = [ln for ln in r.stderr.splitlines() if ln.startswith("moe-async:")]
    assert line.startswith(f"moe-async: {field} needs CUDA"), line
    assert sorted(p.name for p in tmp_path.iterdir()) == [], sorted(tmp_path.iterdir())


def test_layout_refused_after_preparation_removes_its_run_dir(tmp_path, monkeypatch):
    """A model whose config.json is known only once made (smollm2_upcycled before its first
    run): the refusal after preparation removes the run dir it made."""
    from moe_async.models import prepare

    hf = tmp_path / "model"
    hf.mkdir()
    (hf / "config.json").write_text('{"model_type": "mixtral"}')
    monkeypatch.setattr(prepare, "configured_hf_config", lambda m: None)  # unknown before it is made
    monkeypatch.setattr(prepare, "prepare_hf_checkpoint", lambda m: hf)
    import moe_async.plan.report as report

    monkeypatch.setattr(report, "model_layout_errors", lambda cfg, p: ["trainer.tensor_model_parallel_size=3 no"])
    cfg = load_config(SMOKE, [f"logging.output_dir={tmp_path / 'runs'}"])
    with pytest.raises(UserInputError, match=f"layout does not fit the model {hf}: trainer.tensor_model_parallel_size=3"):
        driver.run_experiment(cfg)
    assert list((tmp_path / "runs").iterdir()) == []


@pytest.mark.parametrize("transport,override,value", [("tensor", "weight_sync.backend=gloo", "'gloo'"),
                                                      ("tensor", "weight_sync.backend=nccl", "'nccl'"),
                                                      ("tensor", "weight_sync.disk_dir=/tmp/x", "'/tmp/x'"),
                                                      ("broadcast", "weight_sync.disk_dir=/tmp/x", "'/tmp/x'")])
def test_fields_the_transport_does_not_read_refused(transport, override, value):
    """weight_sync.backend does nothing with transport tensor (no process group), disk_dir with
    any transport but disk (no files): a non-default value is refused naming the field, not
    ignored (issue 16)."""
    field = override.split("=")[0]
    with pytest.raises(ConfigError, match=rf"{field}={value} is unused with weight_sync.transport='{transport}'"):
        load_config(SMOKE, [f"weight_sync.transport={transport}", override])
    assert load_config(SMOKE, ["weight_sync.transport=tensor", "weight_sync.backend=auto"]).weight_sync.backend == "auto"
    assert load_config(SMOKE, ["weight_sync.transport=disk", "weight_sync.disk_dir=/tmp/x"]).weight_sync.disk_dir == "/tmp/x"
    assert load_config(SMOKE, ["weight_sync.backend=gloo"]).weight_sync.backend == "gloo"  # broadcast reads it


# ------------------------------------------------------------------ metrics and console
def test_rollout_counts_are_zero_before_their_first_event():
    """rollout/samples_filtered (and the other cumulative counts) are in the first step's
    metrics as 0.0, not absent until the first filtered sample."""
    m = loop_metrics({"drop_reasons": {}}, {"rollout/samples_generated": 8.0, "rollout/reward_sum": 2.0}, {}, 1.0)
    assert {k: m[k] for k in LOOP_COUNT_KEYS} == {
        **{k: 0.0 for k in LOOP_COUNT_KEYS}, "rollout/samples_generated": 8.0, "rollout/reward_sum": 2.0}
    assert "rollout/samples_filtered" in LOOP_COUNT_KEYS
    m = loop_metrics({"drop_reasons": {}}, {"rollout/samples_filtered": 4.0}, {}, 1.0)
    assert m["rollout/samples_filtered"] == 4.0


def test_wandb_hint_names_the_venv_executable(tmp_path, monkeypatch):
    """The hint is runnable as the README writes it (``.venv/bin/wandb sync``) when the venv is
    under the working directory; absolute when not; plain ``wandb`` when the venv has none."""
    bindir = tmp_path / "proj" / ".venv" / "bin"
    bindir.mkdir(parents=True)
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.setattr(sys, "executable", str(bindir / "python"))
    assert driver.wandb_command() == "wandb"
    (bindir / "wandb").write_text("#!/bin/sh\n")
    monkeypatch.chdir(tmp_path / "proj")
    assert driver.wandb_command() == os.path.join(".venv", "bin", "wandb")
    monkeypatch.chdir(tmp_path / "elsewhere")
    assert driver.wandb_command() == str(bindir / "wandb")


# ------------------------------------------------------------------ trainer.load's step files
@pytest.mark.parametrize("name,text", [("moe_async_version.txt", ""), ("moe_async_state.json", '{"version": 3, "ext')])
def test_truncated_step_file_named_at_start_up(tmp_path, name, text):
    """A truncated step file of the checkpoint given as trainer.load is named (the file, not
    only the directory) before any process starts."""
    from moe_async.orchestration.driver import resolve_checkpoint

    step = tmp_path / "step_3"
    step.mkdir()
    (step / "metadata.json").write_text("{}")
    (step / "moe_async_version.txt").write_text("3")
    (step / name).write_text(text)
    with pytest.raises(UserInputError, match=rf"trainer\.load=.*cannot read the step from .*step_3/{name} \("):
        resolve_checkpoint(load_config(SMOKE, [f"trainer.load={step}"]))


# ------------------------------------------------------------ a tokenizer without a chat template
@pytest.mark.parametrize("template", [None, "{% for m in messages %}{{ m['content'] }}{% endfor %}"])
def test_model_without_chat_template_refused_before_ray(tmp_path, template):
    """Every generated-task prompt goes through the tokenizer's chat template: a model dir whose
    tokenizer has none is refused before any Ray process, naming the model (before, the run
    started and its first held-out evaluation failed with transformers' traceback, exit 1)."""
    import json

    from moe_async.models.config import ModelConfig
    from moe_async.models.prepare import configured_hf_config, load_smollm2_tokenizer
    from moe_async.orchestration.start_checks import made_model_checks

    model = tmp_path / "model"
    smoke = load_config(SMOKE)
    tok = load_smollm2_tokenizer()
    tok.chat_template = template
    tok.save_pretrained(str(model))
    if template is None:
        (model / "chat_template.jinja").unlink(missing_ok=True)
    (model / "config.json").write_text(json.dumps(configured_hf_config(smoke.model)))
    cfg = smoke.model_copy(update={"model": ModelConfig(source="hf", hf_path=str(model))})  # a user's checkpoint
    if template is None:
        with pytest.raises(UserInputError, match=rf"model {model}: its tokenizer has no chat template") as ei:
            made_model_checks(cfg, str(model), True, True)
        assert "apply_chat_template" not in str(ei.value)  # task prompts (rollout.task) have no such switch
    else:
        made_model_checks(cfg, str(model), True, True)
