"""LoRA in the embedded engine, against the references on the other side of each seam:

* HF ``peft`` applying the same PEFT adapter (attention q/k/v/o and the fused routed experts of a
  tiny Mixtral, random nonzero A and B): greedy tokens and logprobs equal within 1e-4;
* SGLang 0.5.23's own ``LoadLoRAAdapterFromTensorsReqInput`` decoder accepts our body, and its
  deserializer (``MultiprocessingSerializer.deserialize``, as its tp_worker runs it) rebuilds our
  tensors bit-identically;
* a request in flight across an adapter update finishes on its version (per-token
  ``weight_version``) while the new version serves new requests, and its unload waits for it
  without blocking anything.
"""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
import threading
import time

import httpx
import pytest
import torch

from moe_async.engines.client import EngineRequestError, SyncEngineClient
from moe_async.weight_sync.lora_sync import AdapterVersions, lora_bucket_entries, lora_entries, sync_adapter

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "..", ".."))
sys.path.insert(0, os.path.join(HERE, "..", "models"))
PROMPTS = [[5, 17, 42, 7, 99, 3], [11, 12, 13]]


def _peft_adapter(model_dir: str, out: str, seed: int) -> None:
    """A random PEFT adapter (nonzero B) on q/k/v/o and the fused experts, saved by peft."""
    from peft import LoraConfig, get_peft_model
    from transformers import MixtralForCausalLM

    torch.manual_seed(seed)
    m = MixtralForCausalLM.from_pretrained(model_dir)
    cfg = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                     target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
                     init_lora_weights=False)
    pm = get_peft_model(m, cfg)
    with torch.no_grad():
        for n, p in pm.named_parameters():
            if "lora_" in n:
                p.mul_(3.0)  # a visible change of the logits
    pm.save_pretrained(out)


def _peft_greedy(model_dir: str, adapter: str, prompt: list[int], n: int) -> tuple[list[int], list[float]]:
    from peft import PeftModel
    from transformers import MixtralForCausalLM

    pm = PeftModel.from_pretrained(MixtralForCausalLM.from_pretrained(model_dir), adapter).eval()
    ids, lps = list(prompt), []
    with torch.no_grad():
        for _ in range(n):
            lp = pm(torch.tensor([ids])).logits[0, -1].float().log_softmax(-1)
            t = int(lp.argmax())
            ids.append(t)
            lps.append(float(lp[t]))
    return ids[len(prompt):], lps


@pytest.fixture(scope="module")
def eng(tmp_path_factory):
    from _tiny import make_tiny_mixtral

    from moe_async.engines.base import make_engine
    from moe_async.engines.config import EngineConfig

    d = tmp_path_factory.mktemp("lora_engine")
    model_dir = make_tiny_mixtral(str(d / "model"), eos_token_id=255)
    _peft_adapter(model_dir, str(d / "a1"), 1)
    _peft_adapter(model_dir, str(d / "a2"), 2)
    e = make_engine(EngineConfig(startup_timeout_s=180, num_threads=1, max_running_requests=8), model_dir, 0)
    e.launch()
    try:
        yield {"url": e.url, "model": model_dir, "a1": str(d / "a1"), "a2": str(d / "a2")}
    finally:
        e.shutdown()


def _gen(url: str, prompt: list[int], lora: str | None, n: int = 8) -> dict:
    body = {"input_ids": prompt, "sampling_params": {"temperature": 0.0, "max_new_tokens": n, "ignore_eos": True},
            "return_logprob": True}
    if lora is not None:
        body["lora_path"] = lora
    r = httpx.post(url + "/generate", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def _tensors(adapter_dir: str) -> tuple[dict, dict]:
    from safetensors.torch import load_file

    with open(os.path.join(adapter_dir, "adapter_config.json")) as f:
        return json.load(f), load_file(os.path.join(adapter_dir, "adapter_model.safetensors"))


def test_engine_with_synced_adapter_matches_peft(eng):
    c = SyncEngineClient(eng["url"], timeout_s=120)
    cfg, tensors = _tensors(eng["a1"])
    versions = AdapterVersions(base="policy", max_staleness=1)
    out = sync_adapter([c], versions, 1, tensors, cfg)
    assert out["name"] == "policy@1" and out["bytes"] == sum(t.numel() * 4 for t in tensors.values())
    base = _gen(eng["url"], PROMPTS[0], None)
    for prompt in PROMPTS:
        got = _gen(eng["url"], prompt, "policy@1")
        ids, lps = _peft_greedy(eng["model"], eng["a1"], prompt, 8)
        assert got["output_ids"] == ids
        mine = [x[0] for x in got["meta_info"]["output_token_logprobs"]]
        assert max(abs(a - b) for a, b in zip(mine, lps)) < 1e-4
        assert set(got["meta_info"].get("output_token_weight_versions") or ["1"]) == {"1"}
    assert base["output_ids"] != _gen(eng["url"], PROMPTS[0], "policy@1")["output_ids"] or \
        base["meta_info"]["output_token_logprobs"] != _gen(eng["url"], PROMPTS[0], "policy@1")["meta_info"]["output_token_logprobs"]
    # from a PEFT directory (/load_lora_adapter), and a refusal naming an unknown adapter
    c.load_lora_adapter("dir_a2", eng["a2"])
    got = _gen(eng["url"], PROMPTS[1], "dir_a2")
    assert got["output_ids"] == _peft_greedy(eng["model"], eng["a2"], PROMPTS[1], 8)[0]
    with pytest.raises(EngineRequestError, match="not loaded"):
        c.generate(PROMPTS[0], {"max_new_tokens": 2}, lora_path="nope")
    with pytest.raises(EngineRequestError, match="no module"):
        c.load_lora_adapter_from_tensors("bad", cfg, lora_entries({"base_model.model.model.nope.lora_A.weight": torch.zeros(4, 4),
                                                                   "base_model.model.model.nope.lora_B.weight": torch.zeros(4, 4)}))
    c.unload_lora_adapter("dir_a2")


def test_inflight_request_finishes_on_its_version(eng):
    """policy@1 generating slowly; policy@2 loaded and policy@1 unloaded meanwhile (no pause):
    the request keeps version 1 on every token, a new one runs on 2, then @1 is gone. The
    sender's buffers are reused (@3 is written into @1's once @1 was unloaded, while @1's
    request still runs): the engine copied @1, so that request's tokens and logprobs stay peft's."""
    from moe_async.weight_sync.adapter_buffers import AdapterBuffers

    c = SyncEngineClient(eng["url"], timeout_s=120)
    cfg1, t1 = _tensors(eng["a1"])
    cfg2, t2 = _tensors(eng["a2"])
    versions, buffers = AdapterVersions(base="flight", max_staleness=0), AdapterBuffers()
    sync_adapter([c], versions, 1, t1, cfg1, buffers=buffers)
    httpx.post(eng["url"] + "/slow_down", json={"forward_sleep_time": 0.05})
    res: dict = {}
    th = threading.Thread(target=lambda: res.setdefault("old", _gen(eng["url"], PROMPTS[0], "flight@1", n=40)))
    th.start()
    time.sleep(1.0)
    t0 = time.perf_counter()
    out = sync_adapter([c], versions, 2, t2, cfg2, buffers=buffers)  # loads @2, unloads @1 while it is in use
    res["sync_s"] = time.perf_counter() - t0
    assert out["unloaded"] == ["flight@1"]
    sync_adapter([c], versions, 3, {k: 2 * v for k, v in t2.items()}, cfg2, buffers=buffers)  # into @1's buffer
    assert buffers.allocated == 2 and th.is_alive()
    new = _gen(eng["url"], PROMPTS[0], "flight@3", n=4)
    httpx.post(eng["url"] + "/slow_down", json={"forward_sleep_time": 0.0})
    th.join(120)
    old = res["old"]
    assert old["meta_info"]["finish_reason"]["type"] == "length" and len(old["output_ids"]) == 40
    assert old["meta_info"]["output_token_weight_versions"] == ["1"] * 40
    assert new["meta_info"]["output_token_weight_versions"] == ["3"] * 4
    ids, lps = _peft_greedy(eng["model"], eng["a1"], PROMPTS[0], 40)
    assert old["output_ids"] == ids
    assert max(abs(x[0] - y) for x, y in zip(old["meta_info"]["output_token_logprobs"], lps)) < 1e-4
    assert res["sync_s"] < 1.0 * 40 * 0.05  # the update did not wait for the old request
    with pytest.raises(EngineRequestError, match="not loaded"):  # gone with its last request
        c.generate(PROMPTS[0], {"max_new_tokens": 1}, lora_path="flight@1")


_SGLANG_RECEIVER = r"""
import importlib, json, sys
import torch
sys.path.insert(0, sys.argv[1])
import _sglang_import
io = _sglang_import.load_io_struct()
finder = _sglang_import._StubFinder()
sys.meta_path.insert(0, finder)
try:
    common = importlib.import_module("sglang.srt.utils.common")
    patch = importlib.import_module("sglang.srt.utils.patch_torch")
finally:
    sys.meta_path.remove(finder)
from pydantic import TypeAdapter
tb = importlib.import_module("sglang.srt.weight_sync.tensor_bucket")
out = []
for body in json.load(open(sys.argv[2])):
    obj = TypeAdapter(io.LoadLoRAAdapterFromTensorsReqInput).validate_python(body)   # the HTTP decoder
    assert obj.lora_name == body["lora_name"] and obj.config_dict == body["config_dict"]
    assert obj.load_format == body["load_format"]
    raw = common.normalize_serialized_named_tensor_payload(obj.serialized_named_tensors[0])
    patch.monkey_patch_torch_reductions()
    data = common.MultiprocessingSerializer.deserialize(raw)   # tp_worker.load_lora_adapter_from_tensors:
    if obj.load_format == "flattened_bucket":
        bucket = tb.FlattenedTensorBucket(flattened_tensor=data["flattened_tensor"], metadata=data["metadata"])
        tensors = dict(bucket.reconstruct_tensors())
    else:
        tensors = data
    out.append({k: v.clone() for k, v in tensors.items()})
torch.save(out, sys.argv[3])
print("OK", flush=True)
"""


def test_sglang_decodes_our_adapter_body(eng, tmp_path):
    from _sglang_import import io_struct_or_skip

    if io_struct_or_skip()[0] is None:
        pytest.skip("sglang io_struct unavailable")
    cfg, tensors = _tensors(eng["a1"])
    sent = []

    def handler(request: httpx.Request) -> httpx.Response:
        sent.append(json.loads(request.content))
        return httpx.Response(200, json={"success": True})

    c = SyncEngineClient("http://sglang.test", timeout_s=5)
    c._http = httpx.Client(base_url=c.base_url, transport=httpx.MockTransport(handler))
    keep = {k: v.clone() for k, v in tensors.items()}  # shared memory stays alive until read
    c.load_lora_adapter_from_tensors("policy@3", cfg, lora_entries(keep, copies=2))
    entries, flat = lora_bucket_entries(keep, copies=2)  # what sync_adapter sends
    c.load_lora_adapter_from_tensors("policy@4", cfg, entries, load_format="flattened_bucket")
    (tmp_path / "body.json").write_text(json.dumps(sent))
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), "OMP_NUM_THREADS": "1"}
    p = subprocess.run([sys.executable, "-c", _SGLANG_RECEIVER, HERE, str(tmp_path / "body.json"), str(tmp_path / "o.pt")],
                       env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0 and "OK" in p.stdout, p.stdout[-2000:] + p.stderr[-4000:]
    for got in torch.load(tmp_path / "o.pt"):
        assert sorted(got) == sorted(keep)
        assert all(torch.equal(got[k], keep[k]) for k in keep)
    assert len(sent[0]["serialized_named_tensors"]) == 2 and base64.b64decode(sent[0]["serialized_named_tensors"][1])
