"""Checkpoint loads that must be refused before anything of the trainer changes, and the PP2 ->
PP2 x VPP2 resume of a plain-optimizer checkpoint. One 2-process torchrun (see
_checkpoint_refusal_checks.py: a tiny 4-layer Mixtral, checkpoints saved at PP2 after one step).

Before these fixes: a distributed-optimizer checkpoint with damaged optimizer items loaded the
model weights and then raised torch's raw CheckpointException; one without
moe_async_state.json, or loaded at PP2 x VPP2, loaded silently (Megatron's bucket-space state
read into other parameters); a truncated moe_async_version.txt / rng file raised an unnamed
ValueError / OSError after the weights had changed.
"""

from __future__ import annotations

import os

import pytest
import torch
from _launch import merged_json, torchrun

HERE = os.path.dirname(__file__)
SCRIPT = os.path.join(HERE, "_checkpoint_refusal_checks.py")

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU/gloo checks")


@pytest.fixture(scope="module")
def res(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("ckrefuse"))
    out = os.path.join(tmp, "out.json")
    torchrun(2, SCRIPT, tmp, out, timeout=400)
    r = merged_json(tmp, "out")
    r["tmp"] = tmp
    return r


def _untouched(r: dict) -> None:
    """Weights (HF checksums), version and the (never allocated) optimizer state as before."""
    assert r["weights_unchanged"] and r["version_unchanged"] and r["opt_state_empty"], r


@pytest.mark.parametrize("case", ["opt_truncated", "opt_zeroed"])
def test_damaged_optimizer_items_named_before_weights_change(res, case):
    """Only the optimizer items of the .distcp shards are damaged (the model part reads): a
    CheckpointReadError (UserInputError and RuntimeError) naming the checkpoint and the
    optimizer state; weights and optimizer state unchanged."""
    assert res[f"{case}_files"]["optimizer_items"] > 0
    r = res[case]
    ck = os.path.join(res["tmp"], case)
    assert r["type"] == "CheckpointReadError" and {"UserInputError", "RuntimeError"} <= set(r["mro"])
    if case == "opt_truncated":  # the shard lengths are checked before any read: the file is named
        f = res[f"{case}_files"]["files"][0]
        assert r["error"].startswith(f"checkpoint {ck}: shard {os.path.join(ck, f)} is truncated ("), r["error"]
        assert ".optimizer." in "." + r["error"].rsplit("e.g. ", 1)[1]
    else:
        assert r["error"].startswith(f"checkpoint {ck}: cannot read its optimizer state"), r["error"]
    _untouched(r)


def test_truncated_shard_and_common_state_named(res):
    """A .distcp shard cut to half (model items lost) and common.pt cut to half: each named
    before any tensor is read (before: torch's CheckpointException text, blaming ".distcp
    shards" for a cut common.pt); nothing changed."""
    ck = os.path.join(res["tmp"], "shard_truncated")
    r = res["shard_truncated"]
    assert r["type"] == "CheckpointReadError"
    assert r["error"].startswith(f"checkpoint {ck}: shard {os.path.join(ck, '__1_0.distcp')} is truncated ("), r
    _untouched(r)
    ck = os.path.join(res["tmp"], "common_truncated")
    r = res["common_truncated"]
    assert r["type"] == "CheckpointReadError"
    assert r["error"].startswith(f"checkpoint {ck}: cannot read {os.path.join(ck, 'common.pt')} (Megatron common"), r
    _untouched(r)
    ck = os.path.join(res["tmp"], "common_missing")
    r = res["common_missing"]
    assert r["type"] == "CheckpointReadError"
    assert r["error"].startswith(f"checkpoint {ck}: {os.path.join(ck, 'common.pt')} (Megatron common state) is "
                                 "missing"), r
    _untouched(r)
    ck = os.path.join(res["tmp"], "metadata_empty")
    r = res["metadata_empty"]
    assert r["type"] == "CheckpointReadError"
    assert f"{os.path.join(ck, 'metadata.json')} (Megatron checkpoint metadata) has no 'sharded_backend'" in r["error"]
    _untouched(r)


def test_save_over_old_checkpoint_removes_its_files(res):
    """Saving at 2 ranks into a dir holding (fake) files of an 8-rank save: the old shard and
    rank-7 RNG file are gone, a file that is not a checkpoint's stays, and the checkpoint loads
    (test_trainer_usable_after_refusals resumes from it exactly)."""
    files = res["do_files"]
    assert "__7_0.distcp" not in files and "rank_7.pt" not in files, files
    # a converter-made checkpoint's files: its hf_config.json (deepseek_v3) would refuse the new weights
    assert "hf_config.json" not in files and "moe_async_convert.json" not in files, files
    assert "notes.txt" in files and {"__0_0.distcp", "__1_0.distcp", "rank_0.pt", "rank_1.pt"} <= set(files), files


def test_missing_state_json_refused_for_distributed_optimizer(res):
    r = res["no_state"]
    assert r["type"] == "UserInputError"
    assert os.path.join(res["tmp"], "no_state", "moe_async_state.json") + " (which records that layout) is missing" \
        in r["error"]
    _untouched(r)


@pytest.mark.parametrize("case,name", [("version_txt", "moe_async_version.txt"),
                                       ("state_json", "moe_async_state.json"),
                                       ("rng_rank0", os.path.join("moe_async_rng", "rank_0.pt"))])
def test_truncated_side_files_named_before_weights_change(res, case, name):
    """Each file cut to half its size: named (the RNG file of rank 0 only: both ranks raise
    the same error, none waits in a collective); nothing changed."""
    r = res[case]
    assert r["type"] == "CheckpointReadError"
    assert f"cannot read {os.path.join(res['tmp'], case, name)} (rank 0;" in r["error"]
    assert r["error"].endswith("the trainer is unchanged")
    _untouched(r)


def test_trainer_usable_after_refusals(res):
    """The same trainer, after the ten refusals, loads the good checkpoint: its next step
    equals the saving run's next step exactly."""
    a = res["after_refusals"]
    assert a["version"] == 1 and a["next"] == res["do_ref"]["next"]


def test_distributed_optimizer_state_refused_at_another_vpp(res):
    """PP2 'dp_reshardable' state at PP2 x VPP2: refused naming both layouts."""
    r = res["do_vpp"]
    assert r["type"] == "UserInputError"
    assert "not at another TP/PP/EP/ETP/VPP/CP" in r["error"] and "'vpp': (1, 2)" in r["error"]
    assert "saved at TP1 PP2 EP1 ETP1 VPP1 CP1, this trainer at TP1 PP2 EP1 ETP1 VPP2 CP1" in r["error"]
    _untouched(r)


def test_plain_checkpoint_reshards_from_pp2_to_pp2_vpp2(res):
    """The plain optimizer's state is keyed by global parameter names (Megatron's
    optim_state_to_sharding_state), so torch_dist reshards it like the weights: the PP2 x VPP2
    trainer's next step equals the PP2 run's next step (measured: bit-equal)."""
    v, ref = res["plain_vpp"], res["plain_ref"]["next"]
    assert v["version"] == 1
    for k in ("loss", "grad_norm"):
        assert abs(v["next"][k] - ref[k]) <= 1e-6 * abs(ref[k]), (k, v["next"][k], ref[k])


def test_checkpoint_read_error_is_one_cli_line(monkeypatch, capsys):
    """Raised in the trainer actor, a CheckpointReadError reaches the CLI through Ray as
    RayTaskError(CheckpointReadError): one line, exit status 2."""
    from ray.exceptions import RayTaskError

    import moe_async.orchestration.driver as driver
    from moe_async.cli import main
    from moe_async.errors import CheckpointReadError

    cause = CheckpointReadError("checkpoint /x/step_3: cannot read /x/step_3/moe_async_rng/rank_0.pt (rank 0; "
                                "EOFError: ); the trainer is unchanged")

    def remote_refusal(cfg, console=None):  # run_experiment(cfg, console)
        raise RayTaskError("TrainerActor.load_checkpoint", "Traceback ...", cause).as_instanceof_cause()

    monkeypatch.setattr(driver, "run_experiment", remote_refusal)
    assert main(["train", os.path.join(HERE, "..", "..", "configs", "cpu_smoke.yaml")]) == 2
    assert capsys.readouterr().err.splitlines() == [f"moe-async: {cause}"]
