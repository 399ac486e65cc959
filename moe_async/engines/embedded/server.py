"""The embedded engine's HTTP server: SGLang 0.5.23's endpoints and payloads, on a CPU or one
CUDA device.

Run: ``python -m moe_async.engines.embedded.server --model-path DIR --port N [--device
cpu|cuda|auto]`` (``cuda`` without a visible GPU: one line naming ``engine.device``, exit 2).
Serves ``/generate`` (every SGLang request and sampling field honoured or refused with a 400
naming it), the OpenAI-compatible ``/v1/*``, pause/continue/abort/flush, the weight-update
endpoints of :mod:`moe_async.engines.embedded.weight_update`, and ``/set_num_threads`` (ours).

Design notes: ``docs/design/engines.md``."""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import os
import sys
import threading
import time
from typing import Literal, cast

import torch
import uvicorn
from fastapi import FastAPI, Query, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field
from starlette.requests import ClientDisconnect

from moe_async.engines.embedded.admission import Admission
from moe_async.engines.embedded.lora_routes import lora_router
from moe_async.engines.embedded.openai_api import register_openai_routes
from moe_async.engines.embedded.request import decode_generate
from moe_async.engines.embedded.sampling import RequestError
from moe_async.engines.embedded.req import Req
from moe_async.engines.embedded.scheduler import Scheduler
from moe_async.engines.embedded.tensor_update import tensor_update_router
from moe_async.engines.embedded.weight_update import WeightUpdater, weight_update_router
from moe_async.types import Tokenizer, JsonDict

log = logging.getLogger("moe_async.engines.embedded")

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "float32": torch.float32,
           "bfloat16": torch.bfloat16}


# ---------------------------------------------------------------- request bodies (SGLang's)
class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class PauseGenerationReqInput(_Body):
    mode: Literal["abort", "retract", "in_place"] = "abort"


class AbortReq(_Body):
    rid: str | None = ""
    abort_all: bool = False


class SlowDownReqInput(_Body):
    forward_sleep_time: float | None = None


class SetNumThreadsReq(_Body):
    num_threads: int = Field(ge=1)


def set_forward_threads(n: int) -> int:
    """torch's intra-op threads for the forward passes of the calling thread (run it on the
    scheduler thread: torch's OpenMP / MKL thread counts are per calling thread); returns the
    count now in effect there."""
    torch.set_num_threads(n)
    return torch.get_num_threads()


def _error(message: str, status: int = 400) -> JSONResponse:
    return JSONResponse({"error": {"message": message}}, status_code=status)


def context_length_error(prompt_len: int, max_new_tokens: int | None, context_length: int) -> str | None:
    """SGLang's refusal of a request that does not fit the context, or ``None`` when it fits.

    Same rule and wording as sglang 0.5.23 ``TokenizerManager._validate_one_request``
    without ``--allow-auto-truncate`` (and no speculative decoding, so no reserved tokens):
    ``prompt_len >= context_length`` is refused; then, when the client set
    ``max_new_tokens``, ``prompt_len + max_new_tokens > context_length`` is refused.
    ``max_new_tokens=None`` (unset by the client) skips the second check.
    """
    if prompt_len >= context_length:
        return (f"The input ({prompt_len} tokens) is longer than the "
                f"model's context length ({context_length} tokens).")
    if max_new_tokens is None or prompt_len + max_new_tokens <= context_length:
        return None
    total = prompt_len + max_new_tokens
    return (f"Requested token count exceeds the model's maximum context length "
            f"of {context_length} tokens. You requested a total of {total} "
            f"tokens: {prompt_len} tokens from the input messages and "
            f"{max_new_tokens} tokens for the completion. Please reduce the number "
            f"of tokens in the input messages or the completion to fit within the limit.")


class DeviceUnavailable(RuntimeError):
    """``--device cuda`` (``engine.device``) in a process that sees no CUDA device."""


def resolve_device(name: str) -> torch.device:
    """The device the engine runs on for ``--device`` ``name``: ``"cpu"``; ``"cuda"``: this
    process's current CUDA device (the first visible one unless set); ``"auto"``: that when
    CUDA is available, else the CPU.

    Raises:
        DeviceUnavailable: ``"cuda"`` without a visible CUDA device (names ``engine.device``).
        ValueError: any other name.
    """
    if name not in ("cpu", "cuda", "auto"):
        raise ValueError(f"--device must be cpu, cuda or auto, got {name!r}")
    if name == "cpu" or (name == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise DeviceUnavailable(
            f"engine.device='cuda' (--device cuda) but this engine process sees no CUDA device "
            f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')!r}, torch "
            f"{torch.__version__}, built for CUDA {torch.version.cuda}); set engine.device=cpu or run on a GPU")
    return torch.device("cuda", torch.cuda.current_device())


class EngineState:
    """Everything the endpoints share: model, scheduler, weight map, staged update, groups.

    The model is loaded on the CPU, cast to ``--dtype`` and moved to ``--device``
    (:func:`resolve_device`); the scheduler and the weight updater follow the model's device."""

    def __init__(self, args: argparse.Namespace):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        torch.set_num_threads(args.num_threads)
        self.device = resolve_device(getattr(args, "device", "cpu"))
        self.model_path = args.model_path
        self.dtype = _DTYPES[args.dtype]
        self.model = AutoModelForCausalLM.from_pretrained(args.model_path, dtype=self.dtype)
        torch.nn.Module.to(self.model, self.device)
        self.model.eval()
        self.tokenizer: Tokenizer | None
        try:
            self.tokenizer = cast(Tokenizer, AutoTokenizer.from_pretrained(args.model_path))  # transformers' wider types
        except Exception:
            self.tokenizer = None
        cfg = self.model.config
        self.context_length = int(args.context_length or cfg.max_position_embeddings)
        eos: set[int] = set()
        for src in (cfg, getattr(self.model, "generation_config", None)):
            e = getattr(src, "eos_token_id", None) if src is not None else None
            if e is not None:
                eos.update([e] if isinstance(e, int) else list(e))
        self.scheduler = Scheduler(
            self.model,
            context_length=self.context_length,
            max_running_requests=args.max_running_requests,
            eos_token_ids=eos,
            return_original_logprob=args.return_original_logprob,
            tokenizer=self.tokenizer,
            sampling_mask_max_tokens=args.sampling_mask_max_tokens,
        )
        self.scheduler.weight_version = args.weight_version
        self.admission = Admission()
        self.weights = WeightUpdater(self.model, self.scheduler, self.dtype, args.weight_update_timeout_s,
                                     admission=self.admission)


def create_app(state: EngineState) -> FastAPI:
    app = FastAPI(title="moe-async embedded engine")
    sched = state.scheduler

    async def on_sched(fn):
        return await asyncio.wrap_future(sched.call(fn))

    @app.get("/health")
    @app.get("/health_generate")
    async def health():
        return Response(status_code=200 if sched.alive else 503)

    @app.get("/get_model_info")
    @app.get("/model_info")
    async def model_info():
        cfg = state.model.config
        return {
            "model_path": state.model_path,
            "is_generation": True,
            "weight_version": str(sched.weight_version),
            "model_type": getattr(cfg, "model_type", None),
            "architectures": getattr(cfg, "architectures", None),
            "context_length": state.context_length,
            "vocab_size": cfg.vocab_size,
            "num_moe_layers": sched.capture.num_layers,
            "moe_top_k": sched.top_k,
            "num_experts": getattr(cfg, "num_local_experts", getattr(cfg, "num_experts", None)),
        }

    @app.get("/get_server_info")
    @app.get("/server_info")
    async def server_info():
        return {
            "max_running_requests": sched.max_running,
            "device": state.device.type,  # SGLang's server_args.device ("cpu" | "cuda")
            "context_length": state.context_length,
            "num_requests": sched.num_requests(),
            "paused": sched.paused,
            "max_decode_batch_size": sched.max_decode_batch,
            "scheduler_stats": dict(sched.stats),
            "weight_version": str(sched.weight_version),
        }

    @app.get("/get_weight_version")
    async def get_weight_version():
        return {"weight_version": str(sched.weight_version)}

    async def run_generate(body: object) -> JsonDict | list[JsonDict]:
        """One ``/generate`` body, decoded by :func:`decode_generate` (every field honoured
        or refused), one :class:`Req` per sample -> SGLang's response (a list for a batch
        or ``n`` > 1). Raises :class:`RequestError` (a 400) before anything is queued."""
        items, single = decode_generate(body, tokenizer=state.tokenizer,
                                        vocab_size=state.model.config.vocab_size)
        for it in items:
            asked = it.params.max_new_tokens if it.params.max_new_tokens_set else None
            err = (context_length_error(len(it.input_ids), None, state.context_length)
                   or context_length_error(len(it.input_ids), asked, state.context_length))
            if err:
                raise RequestError(err)
        for it in items:
            if it.lora_path is not None and it.lora_path not in sched.lora.names():
                raise RequestError(f"lora_path: the LoRA adapter {it.lora_path!r} is not loaded "
                                   f"(loaded: {sched.lora.names()})")
        reqs = [Req(input_ids=it.input_ids, lora_name=it.lora_path, params=it.params, rid=it.rid, return_logprob=it.return_logprob,
                    logprob_start_len=it.logprob_start_len, top_logprobs_num=it.top_logprobs_num,
                    token_ids_logprob=it.token_ids_logprob, return_text_in_logprobs=it.return_text_in_logprobs,
                    return_routed_experts=it.return_routed_experts,
                    routed_experts_start_len=it.routed_experts_start_len,
                    return_sampling_mask=it.return_sampling_mask,
                    sampling_logprobs_mode=it.sampling_logprobs_mode,
                    return_prompt_token_ids=it.return_prompt_token_ids)
                for it in items]
        async with state.admission.request():  # waits while paused; updates wait for it
            futs = [sched.submit(r) for r in reqs]
            results = [await asyncio.wrap_future(f) for f in futs]
        return results[0] if single else results

    @app.post("/generate")
    async def generate(request: Request):
        try:
            body = await request.json()
        except ValueError:
            return _error("the /generate body is not valid JSON")
        except ClientDisconnect:  # the client left before its body arrived (a run stopping): no one to answer
            return Response(status_code=499)
        try:
            return await run_generate(body)
        except RequestError as e:
            return _error(str(e))

    register_openai_routes(app, generate=run_generate, tokenizer=state.tokenizer,
                           model_path=state.model_path, context_length=state.context_length)

    @app.post("/pause_generation")
    async def pause_generation(body: PauseGenerationReqInput):
        await state.admission.pause(lambda: on_sched(lambda: sched.pause(body.mode)))
        return {"message": "Generation paused successfully.", "status": "ok"}

    @app.post("/continue_generation")
    async def continue_generation():
        await state.admission.resume(lambda: on_sched(sched.resume))
        return {"message": "Generation continued successfully.", "status": "ok"}

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache(timeout: float = Query(0.0, ge=0.0)):
        # No prefix cache here; SGLang's rule for when a flush may run (Scheduler.is_fully_idle
        # with ignore_waiting while paused) and its deferred form (?timeout=s: performed as soon
        # as the engine is idle, refused when it is not idle by then)
        deadline = time.monotonic() + timeout
        while True:  # deferred: polled off the scheduler thread, confirmed on it
            if (not timeout or sched.idle()) and await on_sched(sched.idle):
                return Response("Cache flushed.\n", status_code=200)
            if time.monotonic() >= deadline:
                return Response("Timed out waiting for idle state." if timeout else "Flush cache failed.\n",
                                status_code=400)
            await asyncio.sleep(0.05)

    @app.post("/abort_request")
    async def abort_request(body: AbortReq):
        rid = None if body.abort_all else body.rid
        if rid is None and not body.abort_all:
            return Response(status_code=200)
        await on_sched(lambda: sched.abort(rid))
        return Response(status_code=200)

    @app.api_route("/slow_down", methods=["GET", "POST"])
    async def slow_down(body: SlowDownReqInput):
        """SGLang's debug knob: sleep ``forward_sleep_time`` s after each decode step."""
        sched.forward_sleep_s = float(body.forward_sleep_time or 0.0)
        return Response(status_code=200)

    @app.post("/set_num_threads")
    async def set_num_threads(body: SetNumThreadsReq):
        """Not SGLang's: torch threads of the forward passes from the next one on (``engine.
        eval_num_threads`` while the trainer idles); ``{"num_threads": n}``. A body without a
        positive ``num_threads`` is a 422 naming it."""
        return {"num_threads": await on_sched(lambda: set_forward_threads(body.num_threads))}

    app.include_router(weight_update_router(state.weights))
    app.include_router(tensor_update_router(state.weights))
    app.include_router(lora_router(sched, state.dtype))  # LoRA adapters (SGLang's --enable-lora endpoints)
    return app


def _watch_parent(pid: int) -> None:
    """Exit when the launching process is gone, so the server is never orphaned."""
    while True:
        time.sleep(1.0)
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            os._exit(0)
        except PermissionError:
            pass


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model-path", required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--max-running-requests", type=int, default=16)
    p.add_argument("--num-threads", type=int, default=1)
    p.add_argument("--dtype", choices=sorted(_DTYPES), default="fp32")
    p.add_argument("--device", choices=("cpu", "cuda", "auto"), default="cpu",
                   help="where the model lives and every forward runs (engine.device); cuda: refused "
                        "at start without a visible GPU")
    p.add_argument("--context-length", type=int, default=None,
                   help="default: config.max_position_embeddings")
    p.add_argument("--return-original-logprob", action="store_true",
                   help="logprobs of the raw distribution even when temperature != 1")
    p.add_argument("--sampling-mask-max-tokens", type=int, default=4096,
                   help="largest per-token sampling support returned (SGLang's flag); more aborts")
    p.add_argument("--enable-return-routed-experts", action="store_true",
                   help="accepted for SGLang parity; routing is always captured here")
    p.add_argument("--weight-update-timeout-s", type=float, default=600.0,
                   help="bound on joining a weight-update group and on each of its broadcasts")
    p.add_argument("--weight-version", default="default",
                   help="version string served before the first update (SGLang's flag and default)")
    p.add_argument("--parent-pid", type=int, default=None,
                   help="exit when this process is gone")
    p.add_argument("--log-level", default="warning")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(message)s")
    if args.parent_pid:
        threading.Thread(target=_watch_parent, args=(args.parent_pid,), daemon=True).start()
    try:
        state = EngineState(args)
    except DeviceUnavailable as e:
        print(f"moe-async embedded engine: {e}", file=sys.stderr, flush=True)
        sys.exit(2)
    state.scheduler.start()
    app = create_app(state)
    # what start-up made (modules, model, tokenizer) lives as long as the process: out of the
    # collector's sight, a full collection (set off now and then by per-request objects) does
    # not walk it (~0.2 s each for the demo model on a CPU, in the middle of a request);
    # start-up's garbage is collected first, not frozen
    gc.collect()
    gc.freeze()
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, access_log=False)
    state.scheduler.stop()


if __name__ == "__main__":
    main()
