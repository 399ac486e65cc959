"""``engine.device``: the config field, its refusals (a CUDA engine on a host without CUDA is
refused at start naming the field: by the driver before Ray for a local run, by the cluster
preflight for an allocation without GPUs, and by the engine server itself before it loads
anything), and an NCCL weight-update group refused by an engine that is not on CUDA."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

from moe_async.config import load_config
from moe_async.engines.config import EngineConfig
from moe_async.errors import UserInputError

ROOT = Path(__file__).resolve().parents[2]
SMOKE = ROOT / "configs" / "cpu_smoke.yaml"
no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="refusals of a host without CUDA")


def test_device_field_defaults_to_cpu_and_is_embedded_only():
    assert EngineConfig().device == "cpu"
    assert EngineConfig(device="auto").device == "auto"
    with pytest.raises(ValidationError, match="device"):
        EngineConfig(device="tpu")
    with pytest.raises(ValidationError, match=r"engine.device='cuda' with engine.backend='sglang': only the "
                                              r"embedded engine takes a device"):
        EngineConfig(backend="sglang", device="cuda")


def test_embedded_command_passes_the_device():
    from moe_async.engines.base import EmbeddedEngine

    cmd = EmbeddedEngine(EngineConfig(device="cuda"), "/model", 1234).command()
    assert cmd[cmd.index("--device") + 1] == "cuda"
    cmd = EmbeddedEngine(EngineConfig(), "/model", 1234).command()
    assert cmd[cmd.index("--device") + 1] == "cpu"


@no_cuda
def test_cuda_engine_is_refused_before_ray_naming_the_field(tmp_path, monkeypatch):
    """A local run with ``engine.device=cuda`` on this CPU host: one error naming the field,
    before Ray or any process or run dir; the allocation check (Slurm preflight) says the same."""
    from moe_async.orchestration import driver
    from moe_async.orchestration.cluster import refuse_without_gpus

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.delenv("MOE_ASYNC_RUN_ID", raising=False)

    def no_process(*a, **k):
        raise AssertionError("a process or Ray was started")

    monkeypatch.setattr(driver, "init_ray", no_process)
    cfg = load_config(SMOKE, ["engine.device=cuda", f"logging.output_dir={tmp_path / 'runs'}"])
    with pytest.raises(UserInputError, match=r"^engine\.device='cuda' needs GPUs and this host has 0 GPU "
                                              r"\(.*on CPU: engine\.device=cpu\)$"):
        driver.run_experiment(cfg)
    assert not (tmp_path / "runs").exists()
    with pytest.raises(UserInputError, match=r"engine\.device='cuda' needs GPUs and the allocation"):
        refuse_without_gpus(cfg, 0.0, "the allocation (--gpus-per-node)")
    refuse_without_gpus(cfg, 8.0, "the allocation (--gpus-per-node)")  # GPUs there: accepted
    for ok in ("engine.device=cpu", "engine.device=auto"):  # auto falls back to the CPU
        refuse_without_gpus(load_config(SMOKE, [ok]))


@no_cuda
def test_engine_server_refuses_cuda_without_a_gpu(tmp_path, monkeypatch):
    """The server itself (a cluster node whose engine sees no GPU): exit 2 with one line naming
    ``engine.device``, before it loads the model (the model path here holds nothing)."""
    from moe_async.engines.base import EngineLaunchError, make_engine

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    eng = make_engine(EngineConfig(device="cuda", startup_timeout_s=120), str(tmp_path), 0)
    with pytest.raises(EngineLaunchError, match=r"exited with code 2") as e:
        eng.launch()
    assert "engine.device='cuda' (--device cuda) but this engine process sees no CUDA device" in str(e.value)
    assert "Traceback" not in str(e.value)
    assert not eng.alive


def test_resolve_device():
    from moe_async.engines.embedded.server import DeviceUnavailable, resolve_device

    assert resolve_device("cpu") == torch.device("cpu")
    if torch.cuda.is_available():
        assert resolve_device("auto").type == resolve_device("cuda").type == "cuda"
    else:
        assert resolve_device("auto") == torch.device("cpu")
        with pytest.raises(DeviceUnavailable, match="engine.device='cuda'"):
            resolve_device("cuda")
    with pytest.raises(ValueError, match="--device"):
        resolve_device("gpu")


def test_nccl_group_refused_by_an_engine_off_cuda():
    from moe_async.engines.embedded.weight_update import InitWeightsUpdateGroupReqInput, join_refusal

    body = InitWeightsUpdateGroupReqInput(master_address="127.0.0.1", master_port=1234, rank_offset=1,
                                          world_size=2, backend="nccl")
    why = join_refusal(body, device=torch.device("cpu"))
    assert why is not None and "backend 'nccl'" in why and "engine.device" in why
    assert join_refusal(body.model_copy(update={"backend": "gloo"}), device=torch.device("cpu")) is None
    assert join_refusal(body, device=torch.device("cuda", 0)) is None
