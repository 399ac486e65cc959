"""Contract of ``weight_sync.transport: tensor`` against sglang 0.5.23's own code, on CPU.

* Our ``/update_weights_from_tensor`` body validates as SGLang's HTTP server validates it
  (pydantic over ``io_struct.UpdateWeightsFromTensorReqInput``: the base64 entries decode to
  exactly our ForkingPickler bytes; nothing renamed or coerced), and the embedded engine's
  body model has exactly SGLang's fields.
* In a separate process (an unrelated process opening our CPU shared memory by name, as the
  engine does), SGLang's receive path: ``normalize_serialized_named_tensor_payload``,
  ``monkey_patch_torch_reductions`` + ``MultiprocessingSerializer.deserialize`` (its
  ``SafeUnpickler``), then its ``WeightUpdater._update_weights_from_flattened_bucket`` (the
  ``FlattenedTensorBucket`` reconstruction that feeds ``model.load_weights``) rebuild every
  tensor bit-identically (mixed dtypes, odd sizes).
"""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys

import httpx
import pytest
import torch

from _sglang_import import io_struct_or_skip
from moe_async.engines.client import SyncEngineClient

io, _, pytestmark = io_struct_or_skip()

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "..", ".."))


def _bucket():
    """A packed bucket of mixed dtypes and odd sizes (Bucket.flatten, as the packer makes it)."""
    from moe_async.weight_sync.bucket import Bucket

    g = torch.Generator().manual_seed(3)
    named = [("model.layers.0.mlp.gate.e_score_correction_bias", torch.randn(4, generator=g).double()),
             ("model.embed_tokens.weight", torch.randn(7, 5, generator=g)),
             ("lm_head.weight", torch.randn(2, 3, generator=g).to(torch.float16)),
             ("model.norm.weight", torch.randn(3, generator=g).to(torch.bfloat16))]  # each offset aligned
    b = Bucket([n for n, _ in named], [t for _, t in named], sum(t.numel() * t.element_size() for _, t in named))
    return named, b, b.flatten()


def _serialize(b, flat, copies=1):
    from moe_async.weight_sync.bucket import str_to_dtype
    from moe_async.weight_sync.tensor_ipc import serialize_flattened_bucket

    return serialize_flattened_bucket(flat, b.names, [str_to_dtype(d) for d in b.dtypes], b.shapes, copies=copies)


def test_request_body_is_accepted_by_sglang_decoder():
    from pydantic import TypeAdapter

    _, b, flat = _bucket()
    entries = _serialize(b, flat, copies=2)
    sent = []

    def handler(request: httpx.Request) -> httpx.Response:
        sent.append((request.url.path, json.loads(request.content)))
        return httpx.Response(200, json={"success": True, "message": ""})

    c = SyncEngineClient("http://sglang.test", timeout_s=5)
    c._http = httpx.Client(base_url=c.base_url, transport=httpx.MockTransport(handler))
    c.update_weights_from_tensor(entries, load_format="flattened_bucket", flush_cache=False)
    c.update_weights_from_tensor(entries, load_format="flattened_bucket", flush_cache=True, weight_version=7)
    ta = TypeAdapter(io.UpdateWeightsFromTensorReqInput)
    for (path, body), version in zip(sent, (None, "7")):
        assert path == "/update_weights_from_tensor"
        obj = ta.validate_python(body)
        assert obj.serialized_named_tensors == [base64.b64decode(e) for e in entries]  # bytes, decoded
        assert obj.weight_version == version and obj.load_format == "flattened_bucket"
        for key, val in body.items():
            if key != "serialized_named_tensors":
                assert getattr(obj, key) == val, key


def test_embedded_tensor_body_has_sglang_fields():
    import msgspec
    from pydantic import ValidationError

    from moe_async.engines.embedded.tensor_update import UpdateWeightsFromTensorReqInput as Ours

    theirs = {f.name for f in msgspec.structs.fields(io.UpdateWeightsFromTensorReqInput)}
    assert set(Ours.model_fields) == theirs
    with pytest.raises(ValidationError, match="not_a_field"):
        Ours.model_validate({"serialized_named_tensors": [], "not_a_field": 1})


_SGLANG_RECEIVER = r"""
import importlib, json, sys, types
import torch
sys.path.insert(0, sys.argv[1])
import _sglang_import
_sglang_import.load_io_struct()
finder = _sglang_import._StubFinder()
sys.meta_path.insert(0, finder)
try:
    common = importlib.import_module("sglang.srt.utils.common")
    patch = importlib.import_module("sglang.srt.utils.patch_torch")
    wu = importlib.import_module("sglang.srt.model_executor.model_runner_components.weight_updater")
finally:
    sys.meta_path.remove(finder)
entries = json.load(open(sys.argv[2]))
got = {}
for rank, entry in enumerate(entries):
    raw = common.normalize_serialized_named_tensor_payload(entry)   # tokenizer manager
    patch.monkey_patch_torch_reductions()                           # tp_worker.deserialize_own_rank
    data = common.MultiprocessingSerializer.deserialize(raw)         # SafeUnpickler
    loaded = []
    model = types.SimpleNamespace(load_weights=lambda named: loaded.extend(named))
    fake = types.SimpleNamespace(get_model=lambda: model)
    ok, msg = wu.WeightUpdater._update_weights_from_flattened_bucket(fake, data)
    assert ok, msg
    got[rank] = {n: t.clone() for n, t in loaded}
torch.save(got, sys.argv[3])
print("OK", flush=True)
"""


def test_sglang_receiver_rebuilds_our_bucket_bit_identically(tmp_path):
    named, b, flat = _bucket()
    entries = _serialize(b, flat, copies=2)  # one per TP rank; each opened on its own
    (tmp_path / "in.json").write_text(json.dumps(entries))
    out = tmp_path / "out.pt"
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), "OMP_NUM_THREADS": "1"}
    p = subprocess.run([sys.executable, "-c", _SGLANG_RECEIVER, HERE, str(tmp_path / "in.json"), str(out)],
                       env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0 and "OK" in p.stdout, p.stdout[-2000:] + p.stderr[-4000:]
    got = torch.load(out)
    assert sorted(got) == [0, 1]
    for rank in (0, 1):
        assert list(got[rank]) == [n for n, _ in named]  # order kept
        for n, t in named:
            r = got[rank][n]
            assert r.dtype == t.dtype and r.shape == t.shape, n
            assert torch.equal(r.reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8)), n
