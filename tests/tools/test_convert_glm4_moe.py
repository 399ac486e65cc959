"""Case C26 conversion: the tiny GLM-4.5 checkpoint (partial rotary, dense first layer, shared
expert, fp32 router bias, q/k/v bias, q/k norm, an MTP block on disk) HF -> Megatron torch_dist
-> HF at 1 process, EP2 and TP2 (and saved at EP1 / read at EP2, saved and read at TP2):
bit-exact, the MTP block left out (transformers builds none either), the converted Megatron
model's logits equal transformers' within 1e-4 (fp32). Three launches (_convert_glm4_moe_checks.py)."""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch
from _launch import free_port as _port
from _launch import run as _run

HERE = os.path.dirname(__file__)
SCRIPT = os.path.join(HERE, "_convert_glm4_moe_checks.py")

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU/gloo conversion checks")


@pytest.fixture(scope="module")
def res(tmp_path_factory):
    pytest.importorskip("megatron.core")
    tmp = str(tmp_path_factory.mktemp("convert_glm"))
    _run([sys.executable, SCRIPT, "prep", tmp], timeout=300)
    _run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_addr=127.0.0.1",
          f"--master_port={_port()}", SCRIPT, "w2", tmp], timeout=400)
    _run([sys.executable, SCRIPT, "final", tmp], timeout=300)
    out = {}
    for name in ("prep", "final"):
        with open(os.path.join(tmp, f"{name}.json")) as f:
            out.update(json.load(f))
    return out


@pytest.mark.parametrize("src", ["ep1", "ep2", "tp2", "ep1at2", "tp2at2"])
def test_round_trip_bit_exact(res, src):
    assert res["n_mtp_on_disk"] == 32
    r = res[f"back_{src}"]
    assert r["names_are_orig_minus_mtp"] and r["unequal"] == [] and r["n"] == 45
    assert r["bias_dtype"] == "torch.float32" and r["tokenizer_copied"]
    assert r["hf_logits_equal"]


@pytest.mark.parametrize("src", ["ep1", "ep2", "tp2"])
def test_megatron_logits_equal_transformers(res, src):
    assert res["meg_logits_ep1"]["hf_logit_std"] > 0.5
    assert res[f"meg_logits_{src}"]["maxdiff"] < 1e-4
