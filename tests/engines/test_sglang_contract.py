"""Contract tests against sglang 0.5.23's own request dataclasses and response builders.

Every body our client sends is captured (``httpx.MockTransport``) and parsed the way SGLang's
HTTP server parses it: pydantic validation of the ``io_struct`` class FastAPI binds to the
endpoint (msgspec structs: unknown keys and wrong types are errors), then the class's own
normalisation (``GenerateReqInput.normalize_batch_and_arguments``, ``__post_init__``).
Responses: SGLang's finish reasons (``FINISH_*.to_json``), logprob tuples and base64
routed experts are fed through our parser. Skipped, with the reason, when sglang cannot be
imported (see ``_sglang_import``).
"""

from __future__ import annotations

import base64
import importlib.util
import json

import httpx
import numpy as np
import pytest

from _sglang_import import io_struct_or_skip
from moe_async.engines.client import SyncEngineClient
from moe_async.engines.replies import parse_generate

io, _, pytestmark = io_struct_or_skip()

# endpoint -> the io_struct class SGLang's http_server binds its body to (None: no body)
ENDPOINT_CLASS = {
    "/generate": "GenerateReqInput",
    "/init_weights_update_group": "InitWeightsUpdateGroupReqInput",
    "/update_weights_from_distributed": "UpdateWeightsFromDistributedReqInput",
    "/pause_generation": "PauseGenerationReqInput",
    "/continue_generation": "ContinueGenerationReqInput",
    "/abort_request": "AbortReq",
    "/flush_cache": None,  # Query(timeout) only
    "/begin_weight_update": "BeginWeightUpdateReqInput",
    "/end_weight_update": "EndWeightUpdateReqInput",
    "/destroy_weights_update_group": "DestroyWeightsUpdateGroupReqInput",
}
# keys of ours that SGLang's decoder ignores (extra="ignore"): never a field it would misread
EXTENSIONS = {"/begin_weight_update": {"atomic"}}


def _record_client():
    sent: list[tuple[str, dict | None]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content) if request.content else None
        sent.append((request.url.path, body))
        if request.url.path == "/generate":
            return httpx.Response(200, json={"text": "", "output_ids": [], "meta_info": {
                "id": "x", "finish_reason": {"type": "length", "length": 0}, "prompt_tokens": 1}})
        return httpx.Response(200, json={"success": True, "message": ""})

    c = SyncEngineClient("http://sglang.test", timeout_s=5)
    c._http = httpx.Client(base_url=c.base_url, transport=httpx.MockTransport(handler))
    return c, sent


def _client_bodies():
    c, sent = _record_client()
    c.generate([1, 2, 3], {"temperature": 1.0, "top_p": 0.9, "top_k": 20, "max_new_tokens": 8,
                           "stop_token_ids": [2], "sampling_seed": 3})
    c.generate([1, 2, 3], {"temperature": 0.0}, return_logprob=True, return_routed_experts=True,
               rid="r-1", return_sampling_mask=True, sampling_logprobs_mode="support")
    c.generate([5], None, return_logprob=False, return_sampling_mask=True)
    c.init_weights_update_group("10.0.0.1", 29500, rank_offset=1, world_size=3,
                                group_name="weight_update_group", backend="nccl")
    for version, fmt in ((None, "flattened_bucket"), (7, "flattened_bucket"), (8, None)):
        c.update_weights_from_distributed(["model.embed_tokens.weight"], ["bfloat16"], [(8, 4)],
                                          weight_version=version, load_format=fmt,
                                          abort_all_requests=version == 8)
    for mode in ("abort", "retract", "in_place"):
        c.pause_generation(mode)
    c.continue_generation()
    c.begin_weight_update(atomic=True)
    c.begin_weight_update()
    c.end_weight_update()
    c.destroy_weights_update_group("weight_update_group")
    c.flush_cache()
    c.abort_request("r-1")
    c.abort_request(abort_all=True)
    return sent


def test_every_client_payload_is_accepted_by_sglang_dataclasses():
    from pydantic import TypeAdapter

    sent = _client_bodies()
    assert {p for p, _ in sent} == set(ENDPOINT_CLASS)
    for path, body in sent:
        cls_name = ENDPOINT_CLASS[path]
        if cls_name is None:
            assert body is None, (path, body)
            continue
        obj = TypeAdapter(getattr(io, cls_name)).validate_python(body)  # wrong types fail
        if path == "/generate":
            obj.normalize_batch_and_arguments()
            assert obj.is_single and obj.input_ids == body["input_ids"]
            assert bool(obj.return_sampling_mask) == body.get("return_sampling_mask", False)
            if body.get("sampling_logprobs_mode"):
                assert obj.sampling_logprobs_mode == body["sampling_logprobs_mode"]
            # SGLang's own sampling params accept ours
            sp = io.SamplingParams(**obj.sampling_params)
            sp.normalize(None)
            sp.verify(vocab_size=1000)
        for key, val in body.items():  # nothing was silently renamed or coerced
            if key in EXTENSIONS.get(path, ()):
                assert not hasattr(obj, key), (path, key)  # ignored by SGLang, not misread
                continue
            assert getattr(obj, key) == val, (path, key)


def test_strictness_is_real():
    """The validation above would catch a drift: a wrong type is an error; an unknown key is
    silently dropped by SGLang, which is why the test above also checks every key we send."""
    from pydantic import TypeAdapter, ValidationError

    ta = TypeAdapter(io.UpdateWeightsFromDistributedReqInput)
    base = {"names": ["a"], "dtypes": ["float32"], "shapes": [[2]]}
    ta.validate_python(base)
    with pytest.raises(ValidationError):
        ta.validate_python({**base, "weight_version": 3})
    assert not hasattr(ta.validate_python({**base, "bucket": 1}), "bucket")
    with pytest.raises(ValidationError):
        TypeAdapter(io.PauseGenerationReqInput).validate_python({"mode": "stop"})


def test_sglang_finish_reasons_and_logprob_tuples_parse():
    from sglang.srt.managers import schedule_batch as sb

    reasons = {
        "stop": sb.FINISH_MATCHED_TOKEN(matched=2).to_json(),
        "length": sb.FINISH_LENGTH(length=3).to_json(),
        "abort": sb.FINISH_ABORT("paused").to_json(),
    }
    # tokenizer_manager.detokenize_logprob_tokens(decode_to_text=False) builds these tuples
    lp_tuples = io_detok([-0.5, -1.0, -2.0], [7, 8, 2])
    routed = np.arange(4 * 2 * 2, dtype=np.int32).reshape(4, 2, 2)  # (prompt 2 + 3 - 1, L, K)
    for kind, reason in reasons.items():
        resp = json.loads(json.dumps({  # through JSON, as over HTTP (tuples become lists)
            "text": "", "output_ids": [7, 8, 2],
            "meta_info": {
                "id": "abc", "finish_reason": reason, "prompt_tokens": 2, "weight_version": "5",
                "completion_tokens": 3, "cached_tokens": 0, "num_retractions": 0,
                "output_token_logprobs": lp_tuples,
                "routed_experts": base64.b64encode(routed.tobytes()).decode("utf-8"),
                "output_token_sampling_mask": [[7], [8, 9], [2]],
                "output_token_sampling_logprobs": [0.0, -0.3, 0.0],
                "output_token_sampling_mask_length": 3,
            },
        }))
        out = parse_generate(resp, moe_shape=(2, 2))
        assert out.finish_reason == kind and out.finish_info == reason
        assert out.output_logprobs == [-0.5, -1.0, -2.0]
        assert out.weight_version == 5 and out.output_token_weight_versions == [5, 5, 5]
        np.testing.assert_array_equal(out.routed_experts, routed)
        assert out.sampling_mask == [[7], [8, 9], [2]]
        assert out.sampling_logprobs == [0.0, -0.3, 0.0]


def _tokenizer_manager_source() -> str:
    # Read, not imported: importing it needs uvloop and the rest of the server stack.
    spec = importlib.util.find_spec("sglang.srt.managers.tokenizer_manager")
    with open(spec.origin) as f:
        return f.read()


def io_detok(vals, idx):
    """``TokenizerManager.detokenize_logprob_tokens(decode_to_text=False)``, as written there."""
    assert "(logprob, token_id, None)\n                for logprob, token_id in zip(token_logprobs_val, token_logprobs_idx)" in _tokenizer_manager_source()
    return [(v, i, None) for v, i in zip(vals, idx)]


def test_response_keys_we_parse_are_the_ones_sglang_writes():
    """Read SGLang's tokenizer manager: the meta_info keys and routed-experts encoding."""
    src = _tokenizer_manager_source()
    for key in ("finish_reason", "prompt_tokens", "weight_version", "output_token_logprobs",
                "routed_experts", "output_token_sampling_mask", "output_token_sampling_logprobs",
                "completion_tokens", "num_retractions"):
        assert f'"{key}"' in src, key
    assert "pybase64.b64encode(val.numpy().tobytes())" in src
    gen_fields = {f for f in io.GenerateReqInput.__dataclass_fields__}
    assert {"return_routed_experts", "return_sampling_mask", "sampling_logprobs_mode",
            "routed_experts_start_len", "logprob_start_len"} <= gen_fields



def _sglang_validate_one_request():
    """sglang 0.5.23's ``TokenizerManager._validate_one_request``, compiled from its installed
    source (tokenizer_manager.py imports uvloop and the GPU runtime, so it is not imported):
    the function alone, with the names it reads bound to CPU stand-ins (no encoder-SWA replay,
    neither an embedding request nor a GenerateReqInput, so only the length checks apply)."""
    import __future__
    import ast
    import logging
    import types
    from pathlib import Path

    root = Path(importlib.util.find_spec("sglang").submodule_search_locations[0])
    path = root / "srt" / "managers" / "tokenizer_manager.py"
    tree = ast.parse(path.read_text())
    (cls,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "TokenizerManager"]
    (fn,) = [n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "_validate_one_request"]
    features = types.SimpleNamespace(enable_encoder_swa_bounded_replay=False)
    ns = {"get_exec": lambda: types.SimpleNamespace(features=features),
          "EmbeddingReqInput": type("EmbeddingReqInput", (), {}), "logger": logging.getLogger("sglang_contract"),
          # the generation-only checks after the length checks (logprob ids, hidden states) are
          # skipped: the request stand-in is not a GenerateReqInput
          "GenerateReqInput": type("GenerateReqInput", (), {})}
    code = compile(ast.Module(body=[fn], type_ignores=[]), str(path), "exec",
                   flags=__future__.annotations.compiler_flag, dont_inherit=True)  # as the module does
    exec(code, ns)
    return ns["_validate_one_request"]


def test_context_length_refusals_match_sglang():
    """The embedded server's length refusals (sent as HTTP 400 ``{"error": {"message": ...}}``,
    as SGLang's ``_create_error_response`` sends the ValueError) have SGLang's rule and
    wording, for every (prompt, max_new_tokens) around the boundary, max_new_tokens unset too."""
    import types

    from moe_async.engines.embedded.server import context_length_error

    validate = _sglang_validate_one_request()
    ctx = 64
    tm = types.SimpleNamespace(context_len=ctx, num_reserved_tokens=0, allow_auto_truncate=False,
                               validate_total_tokens=True, is_generation=True,
                               _validate_joint_schema_request=lambda obj, ids: None)
    refused = 0
    for prompt_len in (1, 40, 63, 64, 65, 200):
        for max_new in (None, 0, 1, 23, 24, 25, 100):
            obj = types.SimpleNamespace(sampling_params={} if max_new is None else {"max_new_tokens": max_new})
            try:
                validate(tm, obj, list(range(prompt_len)))
                theirs = None
            except ValueError as e:
                theirs = str(e)
            assert context_length_error(prompt_len, max_new, ctx) == theirs, (prompt_len, max_new)
            refused += theirs is not None
    # prompts 64, 65, 200 always (3 x 7); 1 + 100; 40 + {25, 100}; 63 + {23, 24, 25, 100}
    assert refused == 21 + 1 + 2 + 4


def test_embedded_weight_bodies_have_sglang_fields():
    """The embedded engine's weight-update request bodies accept exactly SGLang 0.5.23's
    fields (plus the documented ``atomic`` extension) and refuse any other; their types
    follow SGLang's (``weight_version`` a string)."""
    import msgspec
    from pydantic import ValidationError

    from moe_async.engines.embedded import weight_update as wu

    pairs = {"InitWeightsUpdateGroupReqInput": set(), "DestroyWeightsUpdateGroupReqInput": set(),
             "BeginWeightUpdateReqInput": {"atomic"}, "EndWeightUpdateReqInput": set(),
             "UpdateWeightsFromDistributedReqInput": set(), "UpdateWeightFromDiskReqInput": set()}
    for name, ours_only in pairs.items():
        theirs = {f.name for f in msgspec.structs.fields(getattr(io, name))}
        ours = set(getattr(wu, name).model_fields)
        assert ours == theirs | ours_only, (name, ours ^ (theirs | ours_only))
        with pytest.raises(ValidationError, match="not_a_field"):
            getattr(wu, name).model_validate({"not_a_field": 1})
    with pytest.raises(ValidationError, match="weight_version"):
        wu.UpdateWeightsFromDistributedReqInput.model_validate(
            {"names": [], "dtypes": [], "shapes": [], "weight_version": 3})


def test_weight_version_is_any_string_as_in_sglang():
    """SGLang 0.5.23 takes any ``weight_version`` string (its server starts at ``"default"``):
    the embedded engine's bodies accept what SGLang's dataclasses accept, and the client
    reads a non-numeric version (SGLang's default) as -1, never failing on it."""
    from moe_async.engines.replies import parse_generate
    from moe_async.engines.embedded import weight_update as wu
    from moe_async.engines.embedded.server import parse_args

    body = {"names": ["a"], "dtypes": ["float32"], "shapes": [[2]], "weight_version": "rl-step-9"}
    assert io.UpdateWeightsFromDistributedReqInput(**body).weight_version == "rl-step-9"
    assert wu.UpdateWeightsFromDistributedReqInput.model_validate(body).weight_version == "rl-step-9"
    assert parse_args(["--model-path", "m"]).weight_version == "default"  # SGLang's default
    out = parse_generate({"text": "", "output_ids": [5, 6], "meta_info": {
        "weight_version": "default", "output_token_weight_versions": ["default", "3"]}})
    assert out.weight_version == -1 and out.output_token_weight_versions == [-1, 3]
