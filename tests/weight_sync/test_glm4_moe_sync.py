"""Case C26 on the engine side: the embedded engine (transformers-backed, fp32) serves the tiny
GLM-4.5 checkpoint (tests/models/_tiny_glm4_moe.py, MTP block on disk); weight syncs over gloo
carry the family's mapping output (HF names of Megatron's tensors, the fp32
``e_score_correction_bias`` included); after EVERY sync the engine's checksums equal the sent
tensors and its routing of 32 tokens equals an fp32 transformers reference built from the
same tensors on disk. The new router biases move the routing (a sync that left the bias out
would fail the check)."""

from __future__ import annotations

import os
import shutil
import sys

import numpy as np
import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "models"))

from moe_async.engines.base import make_engine  # noqa: E402
from moe_async.models.checksum import tensor_checksum  # noqa: E402
from moe_async.engines.client import SyncEngineClient  # noqa: E402
from moe_async.engines.config import EngineConfig  # noqa: E402
from moe_async.weight_sync.config import WeightSyncConfig  # noqa: E402
from moe_async.weight_sync.transport import BroadcastTransport  # noqa: E402

PROMPT = [(7 * i + 3) % 125 + 3 for i in range(32)]  # 32 tokens, vocab 128


def _ref_routing(model_dir: str, ids: list[int]) -> np.ndarray:
    """[S, 1, K] sorted expert ids of transformers' fp32 Glm4MoeForCausalLM from ``model_dir``."""
    from transformers import Glm4MoeForCausalLM

    m = Glm4MoeForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    assert m.model.layers[1].mlp.gate.e_score_correction_bias.dtype == torch.float32
    got = []
    h = m.model.layers[1].mlp.gate.register_forward_hook(lambda mod, i, o: got.append(o[2].clone()))
    with torch.no_grad():
        m(torch.tensor([ids]))
    h.remove()
    return np.sort(torch.stack(got, dim=1).numpy(), axis=-1)


@pytest.fixture(scope="module")
def glm_engine(tmp_path_factory):
    from _tiny_glm4_moe import make_tiny_glm4_moe

    model_dir = str(tmp_path_factory.mktemp("glm_engine"))
    make_tiny_glm4_moe(model_dir)
    eng = make_engine(EngineConfig(startup_timeout_s=180, num_threads=1, max_running_requests=4, dtype="fp32"),
                      model_dir, 0)
    eng.launch()
    try:
        yield eng, model_dir
    finally:
        eng.shutdown()


def test_sync_then_routing_equals_fp32_reference(glm_engine, tmp_path):
    from safetensors.torch import load_file, save_file

    from moe_async.models import get_family, hf_to_megatron, megatron_to_hf

    eng, model_dir = glm_engine
    disk = load_file(os.path.join(model_dir, "model.safetensors"))
    fam = get_family("glm4_moe")
    mtp = set(fam.mtp_hf_keys(fam.arch_args(model_dir)))
    c = SyncEngineClient(eng.url, timeout_s=60)
    init = c.weights_checksum()
    # the engine holds the checkpoint minus the MTP block, router bias included
    assert init["checksums"] == {n: tensor_checksum(t) for n, t in disk.items() if n not in mtp}
    assert "model.layers.1.mlp.gate.e_score_correction_bias" in init["checksums"]
    out = c.generate(PROMPT, {"temperature": 0.0, "max_new_tokens": 1}, return_routed_experts=True)
    assert out.routed_experts.shape == (32, 1, 2)
    np.testing.assert_array_equal(np.sort(out.routed_experts, -1), _ref_routing(model_dir, PROMPT))

    # the trainer's own sender (the update group formed as SGLang forms it, a begin/end
    # session, the version on the last bucket); 16 KiB buckets: several per sync
    with pytest.warns(UserWarning, match="bucket_bytes"):
        cfg = WeightSyncConfig(bucket_bytes=16 << 10, backend="gloo", timeout_s=60)
    tr = BroadcastTransport([c], cfg, pause_mode="in_place", group_name="wu")
    tr.connect()

    g = torch.Generator().manual_seed(7)
    base = {k: v for k, v in disk.items() if k not in mtp}
    prev = None
    for version in (1, 2):
        new_hf = {k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in base.items()}
        for k in new_hf:
            if k.endswith("e_score_correction_bias"):  # large enough to steer the choice
                new_hf[k] = (0.3 * torch.randn(new_hf[k].shape, generator=g)).float()
        # what the trainer sends: the mapping's HF names of Megatron's tensors, in its order
        sent = list(megatron_to_hf(hf_to_megatron(new_hf, model_dir).items(), model_dir))
        assert {n for n, _ in sent} == set(base)
        bias = dict(sent)["model.layers.1.mlp.gate.e_score_correction_bias"]
        assert bias.dtype == torch.float32
        m = tr.send(sent, version)
        assert m["sync/buckets"] > 1
        got = c.weights_checksum()
        assert got["weight_version"] == version
        assert got["checksums"] == {n: tensor_checksum(t) for n, t in sent}
        # fp32 reference: transformers from a checkpoint holding exactly the sent tensors
        ref_dir = str(tmp_path / f"v{version}")
        os.makedirs(ref_dir)
        shutil.copy(os.path.join(model_dir, "config.json"), ref_dir)
        save_file({n: t.contiguous() for n, t in sent}, os.path.join(ref_dir, "model.safetensors"),
                  metadata={"format": "pt"})
        ref = _ref_routing(ref_dir, PROMPT)
        out = c.generate(PROMPT, {"temperature": 0.0, "max_new_tokens": 1}, return_routed_experts=True)
        assert out.weight_version == version
        np.testing.assert_array_equal(np.sort(out.routed_experts, -1), ref)
        # the bias is live: the same weights with the old bias route some token differently
        no_bias = {n: t for n, t in sent}
        no_bias["model.layers.1.mlp.gate.e_score_correction_bias"] = base["model.layers.1.mlp.gate.e_score_correction_bias"]
        nb_dir = str(tmp_path / f"v{version}_oldbias")
        os.makedirs(nb_dir)
        shutil.copy(os.path.join(model_dir, "config.json"), nb_dir)
        save_file({n: t.contiguous() for n, t in no_bias.items()}, os.path.join(nb_dir, "model.safetensors"),
                  metadata={"format": "pt"})
        assert not np.array_equal(_ref_routing(nb_dir, PROMPT), ref)
        if prev is not None:
            assert not np.array_equal(prev, ref)  # the second sync changed the routing
        prev = ref
    tr.shutdown()
    c.close()
