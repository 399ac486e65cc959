"""A LoRA run leaves its adapter: ``moe-async train ... trainer.lora.rank=4`` writes the last
adapter in PEFT format into ``<run_dir>/adapter/`` (it used to sync adapters to the engines and
write nothing), says so on the console, and Hugging Face ``peft`` loads it onto the run's model.
One whole run (slow); the export itself (files, modes, written over an earlier adapter, peft's
logprobs) is in the default suite (test_lora_trainer.py)."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_lora_run_writes_a_peft_adapter(tmp_path):
    out = tmp_path / "runs"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled"}
    cmd = [sys.executable, "-m", "moe_async.cli", "train", str(ROOT / "configs/cpu_smoke.yaml"), "num_steps=2",
           "trainer.lora.rank=4", f"logging.output_dir={out}", "eval_before=false", "eval_after=false"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    (run_dir,) = list(out.iterdir())
    adapter = run_dir / "adapter"
    assert sorted(p.name for p in adapter.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in [run_dir / "config.yaml", *adapter.iterdir()]}
    assert set(modes.values()) == {modes["config.yaml"]}, modes  # the run's other files' mode (not 0600)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["adapter_dir"] == str(adapter)
    assert f"LoRA adapter (PEFT, step 2, weight_version 2): {adapter}" in proc.stdout

    import torch
    from peft import PeftModel, get_peft_model_state_dict
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    config = json.loads((adapter / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["peft_type"] == "LORA"
    base = AutoModelForCausalLM.from_pretrained(config["base_model_name_or_path"])
    pm = PeftModel.from_pretrained(base, str(adapter))
    saved, loaded = load_file(str(adapter / "adapter_model.safetensors")), get_peft_model_state_dict(pm)
    assert sorted(saved) == sorted(loaded) and all(torch.equal(saved[k], loaded[k]) for k in saved)
    assert any(v.abs().max() > 0 for k, v in saved.items() if "lora_B" in k)  # trained: B moved off zero


@pytest.mark.slow
def test_lora_run_saves_merges_and_resumes(tmp_path):
    """``trainer.save_interval`` with LoRA: the checkpoints hold adapter tensors only and record
    the base; ``trainer.lora.merge_and_unload`` writes ``<run_dir>/merged/`` (peft's
    ``merge_and_unload()`` tensors); a second run resumed from the checkpoints continues the
    adapter and its weight_version (step 3 trains at version 2 -> 3)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled"}
    ckpt = tmp_path / "ckpt"

    def train(out, *overrides):
        cmd = [sys.executable, "-m", "moe_async.cli", "train", str(ROOT / "configs/cpu_smoke.yaml"),
               "trainer.lora.rank=4", f"logging.output_dir={out}", "eval_before=false", "eval_after=false",
               *overrides]
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
        assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
        (run_dir,) = list(out.iterdir())
        return run_dir, json.loads((run_dir / "summary.json").read_text()), proc.stdout

    run_a, sa, _ = train(tmp_path / "a", "num_steps=2", "trainer.save_interval=1", f"trainer.save_dir={ckpt}",
                        "trainer.lora.merge_and_unload=true")
    state = json.loads((ckpt / "step_2" / "moe_async_state.json").read_text())
    assert state["version"] == 2 and state["lora"]["rank"] == 4 and len(state["lora"]["base_digest"]) == 64
    from moe_async.trainer.ckpt_shapes import saved_tensor_shapes

    assert all(".lora." in k for k in saved_tensor_shapes(str(ckpt / "step_2")))  # no base tensor saved
    assert sa["merged_dir"] == str(run_a / "merged")

    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base_path = json.loads((run_a / "adapter" / "adapter_config.json").read_text())["base_model_name_or_path"]
    want = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_path),
                                     str(run_a / "adapter")).merge_and_unload().state_dict()
    got = AutoModelForCausalLM.from_pretrained(str(run_a / "merged")).state_dict()
    assert sorted(got) == sorted(want) and max(float((got[k] - want[k]).abs().max()) for k in want) < 1e-6

    run_b, sb, out_b = train(tmp_path / "b", "num_steps=3", f"trainer.load={ckpt}", f"trainer.save_dir={tmp_path / 'ckpt2'}")
    assert sb["resumed_from"].startswith(str(ckpt)) and sb["final_weight_version"] == 3
    assert "(weight_version 2)" in out_b  # the resume line: the adapter's version continues
    assert f"LoRA adapter (PEFT, step 3, weight_version 3): {run_b / 'adapter'}" in out_b
