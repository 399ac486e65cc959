"""HTTP client for an engine speaking SGLang's protocol (SGLang itself or the embedded one).

:class:`EngineClient` is async (``httpx.AsyncClient``); :class:`SyncEngineClient` has the
same methods, blocking, for callers without an event loop. Each endpoint is written once, as
a :class:`_Calls` method returning a :class:`_Call` (method, path, body, retry predicate,
status check, decode, recovery); the two clients differ only in how they send it (``_run``),
under the one retry policy (``_Base._retry_kw``), so they cannot drift apart.

Retries (tenacity, exponential backoff): connection errors and 5xx on idempotent calls
(health, versions, model info, checksums, pause/continue, flush, abort); ``generate`` is
retried only when the connection could not be made (nothing ran). Weight-group calls are
collectives and are never retried. A 4xx raises :class:`EngineRequestError` carrying the
server's message.

Engines are cluster traffic: both clients ignore ``http_proxy``/``HTTP_PROXY`` and the other
proxy variables (``trust_env=False``), which Slurm hands down to every process.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Concatenate, Coroutine, Generic, ParamSpec, TypedDict, TypeVar, overload

import httpx
from tenacity import (
    AsyncRetrying,
    Retrying,
    retry_if_exception,
    stop_after_attempt,
    wait_exponential,
)
from tenacity.retry import retry_base
from tenacity.stop import stop_base
from tenacity.wait import wait_base

from moe_async.engines.replies import GenerateOutput, ScoreOutput, as_version, parse_generate, parse_score
from moe_async.types import JsonDict

R = TypeVar("R")
P = ParamSpec("P")
#: An engine endpoint's JSON object reply (SGLang's, or the embedded engine's same fields).
EngineReply = JsonDict
#: A request's JSON body as built here (passed through to ``httpx``'s ``json=``).
Body = dict[str, object]


class EngineRequestError(RuntimeError):
    """The engine answered an error status; ``message`` is the server's own text."""

    def __init__(self, path: str, status_code: int, message: str):
        super().__init__(f"{path} -> HTTP {status_code}: {message}")
        self.path, self.status_code, self.message = path, status_code, message

    def __reduce__(self):  # pickle (Ray) rebuilds it from the three fields, not from str(self)
        return type(self), (self.path, self.status_code, self.message)


def _server_message(r: httpx.Response) -> str:
    try:
        body = r.json()
    except ValueError:
        return r.text.strip()
    if isinstance(body, dict):
        if isinstance(body.get("error"), dict) and "message" in body["error"]:
            return str(body["error"]["message"])
        for key in ("message", "detail", "error"):
            if key in body:
                return str(body[key])
    return str(body)


def _transient(e: BaseException) -> bool:
    if isinstance(e, (httpx.ConnectError, httpx.ConnectTimeout, httpx.RemoteProtocolError,
                      httpx.ReadError, httpx.WriteError, httpx.PoolTimeout)):
        return True
    return isinstance(e, EngineRequestError) and e.status_code >= 500


def _connect_only(e: BaseException) -> bool:
    return isinstance(e, (httpx.ConnectError, httpx.ConnectTimeout))


def _check(path: str, r: httpx.Response) -> httpx.Response:
    if r.status_code >= 400:
        raise EngineRequestError(path, r.status_code, _server_message(r))
    return r


def _json_body(r: httpx.Response) -> EngineReply:
    """A response's JSON object body (the decode of most calls)."""
    body: EngineReply = r.json()
    return body


def _version_of(r: httpx.Response) -> int:
    """The ``weight_version`` of a response's JSON body as an int (see :func:`~moe_async.engines.replies.as_version`)."""
    return as_version(r.json().get("weight_version"))


def _with_version(body: Body, weight_version: int | str | None) -> Body:
    """``body`` with ``weight_version`` as SGLang types it (``Optional[str]``; absent when None)."""
    if weight_version is not None:
        body["weight_version"] = str(weight_version)
    return body


@dataclass(frozen=True)
class _Call(Generic[R]):
    """One engine call, described once for both clients (the sans-IO half of the client).

    ``retry``: the tenacity predicate of the errors worth another attempt (:func:`_transient`
    for idempotent calls, :func:`_connect_only` for ``generate``), None = one attempt (the
    weight-group collectives). ``check``: a status >= 400 raises :class:`EngineRequestError`
    (the server's message) before ``decode`` sees the response. ``recover``: called with the
    error of the (last) attempt; returns the call's result, or another :class:`_Call` to run
    in its place, or raises (re-raising the error when it does not apply).
    """

    method: str
    path: str
    json: object = None
    retry: Callable[[BaseException], bool] | None = _transient
    decode: Callable[[httpx.Response], R] = field(kw_only=True)
    check: bool = True
    timeout: float | None = None
    recover: Callable[[BaseException], R | _Call[R]] | None = None

    def send(self, http: httpx.Client) -> httpx.Response:
        """Send the request once on ``http`` (no retry; the client's timeout unless ``timeout``); the checked response."""
        timeout = http.timeout if self.timeout is None else self.timeout
        return self.response(http.request(self.method, self.path, json=self.json, timeout=timeout))

    async def asend(self, http: httpx.AsyncClient) -> httpx.Response:
        """:meth:`send` on an async client."""
        timeout = http.timeout if self.timeout is None else self.timeout
        return self.response(await http.request(self.method, self.path, json=self.json, timeout=timeout))

    def response(self, r: httpx.Response) -> httpx.Response:
        """``r``, or :class:`EngineRequestError` when ``check`` and its status is >= 400."""
        return _check(self.path, r) if self.check else r


def _reply(method: str, path: str, json: object = None, *,
           retry: Callable[[BaseException], bool] | None = _transient) -> _Call[EngineReply]:
    """A :class:`_Call` whose result is the reply's JSON object."""
    return _Call(method, path, json, retry=retry, decode=_json_body)


def _not_found_then(call: _Call[R]) -> Callable[[BaseException], _Call[R]]:
    """``recover``: a 404 runs ``call`` instead (real SGLang lacks some of our endpoints)."""

    def recover(e: BaseException) -> _Call[R]:
        if isinstance(e, EngineRequestError) and e.status_code == 404:
            return call
        raise e

    return recover


def _not_found_is_none(e: BaseException) -> None:
    """``recover`` of an endpoint only the embedded engine has: a 404 (SGLang) is the answer None."""
    if isinstance(e, EngineRequestError) and e.status_code == 404:
        return None
    raise e


def _refused_is_false(e: BaseException) -> bool:
    """``recover`` of ``/flush_cache``: a 400 (requests in flight) is the answer False."""
    if isinstance(e, EngineRequestError) and e.status_code == 400:
        return False
    raise e


def _unreachable_is_false(e: BaseException) -> bool:
    """``recover`` of ``/health``: no answer (any transport error) is the answer False."""
    if isinstance(e, httpx.HTTPError):
        return False
    raise e


class _Endpoint(Generic[P, R]):
    """A :class:`_Calls` method (``spec``, returning the :class:`_Call` of one endpoint) as a
    client method of the same name, arguments and docstring that runs the call through the
    client's ``_run``: on an :class:`EngineClient` a coroutine of the decoded result, on a
    :class:`SyncEngineClient` the result itself (the overloads let the type checker see both)."""

    def __init__(self, spec: Callable[Concatenate[_Calls, P], _Call[R]]) -> None:
        self.spec = spec
        self.__doc__ = spec.__doc__
        self.__wrapped__ = spec
        sig = inspect.signature(spec)
        self.signature = sig.replace(parameters=list(sig.parameters.values())[1:])  # without self

    @overload
    def __get__(self, obj: None, owner: type) -> _Endpoint[P, R]: ...

    @overload
    def __get__(self, obj: EngineClient, owner: type | None = None) -> Callable[P, Coroutine[object, None, R]]: ...

    @overload
    def __get__(self, obj: SyncEngineClient, owner: type | None = None) -> Callable[P, R]: ...

    def __get__(self, obj: _Base | None, owner: type | None = None) -> _Endpoint[P, R] | Callable[P, object]:
        if obj is None:
            return self
        spec, client = self.spec, obj

        @functools.wraps(spec)
        def method(*args: P.args, **kw: P.kwargs) -> object:
            return client._run(spec(client, *args, **kw))

        setattr(method, "__signature__", self.signature)  # the bound method's: no self
        return method



class _Calls:
    """The engine API, one method per endpoint returning its :class:`_Call`; each is an
    :class:`_Endpoint`: on the clients a blocking or an async method of the same name,
    arguments and docstring that runs the call and returns its decoded result."""

    moe_shape: tuple[int, int] | None

    @_Endpoint
    def generate(self, input_ids: list[int], sampling_params: Mapping[str, object] | None = None,
                 return_logprob: bool = True, return_routed_experts: bool = False,
                 rid: str | None = None, return_sampling_mask: bool = False,
                 sampling_logprobs_mode: str | None = None, lora_path: str | None = None) -> _Call[GenerateOutput]:
        """SGLang's ``/generate`` of one prompt (token ids) -> :class:`GenerateOutput`; retried
        only when the connection could not be made (nothing ran). ``lora_path``: the name of a
        loaded LoRA adapter to generate with."""
        body: Body = {
            "input_ids": list(input_ids),
            "sampling_params": dict(sampling_params or {}),
            "return_logprob": return_logprob,
            "return_routed_experts": return_routed_experts,
        }
        if rid is not None:
            body["rid"] = rid
        if lora_path is not None:
            body["lora_path"] = lora_path
        if return_sampling_mask:
            body["return_sampling_mask"] = True
            if sampling_logprobs_mode is not None:
                body["sampling_logprobs_mode"] = sampling_logprobs_mode
        moe_shape = self.moe_shape
        return _Call("POST", "/generate", body, retry=_connect_only,
                     decode=lambda r: parse_generate(r.json(), moe_shape))

    @_Endpoint
    def score(self, input_ids: list[int], logprob_start_len: int, top_logprobs_num: int = 0) -> _Call[ScoreOutput]:
        """SGLang's ``/generate`` as a scoring call (a teacher's): nothing generated
        (``max_new_tokens: 0``), the logprobs (and with ``top_logprobs_num`` the top ones) of
        ``input_ids[logprob_start_len:]`` under the served weights -> :class:`ScoreOutput`;
        ``0 < logprob_start_len < len(input_ids)``. The request's ``logprob_start_len`` is one
        less: SGLang 0.5.23 gives the token AT ``logprob_start_len`` no logprob (its prefill
        computes logits from there on; see :func:`parse_score`). Nothing is generated, so the
        call is idempotent: retried on transient errors (a dropped keep-alive connection, a
        5xx), like the other idempotent calls."""
        n = len(input_ids) - int(logprob_start_len)
        if not 0 < logprob_start_len < len(input_ids):
            raise ValueError(f"logprob_start_len={logprob_start_len} must be in (0, {len(input_ids)})")
        body: Body = {
            "input_ids": list(input_ids),
            "sampling_params": {"max_new_tokens": 0},
            "return_logprob": True,
            "logprob_start_len": int(logprob_start_len) - 1,
        }
        if top_logprobs_num:
            body["top_logprobs_num"] = int(top_logprobs_num)
        return _Call("POST", "/generate", body, retry=_transient, decode=lambda r: parse_score(r.json(), n))

    @_Endpoint
    def health(self, timeout: float = 5.0) -> _Call[bool]:
        """True when ``/health`` answers 200 within ``timeout`` s; False otherwise (no retry)."""
        return _Call("GET", "/health", retry=None, check=False, timeout=timeout,
                     decode=lambda r: r.status_code == 200, recover=_unreachable_is_false)

    @_Endpoint
    def get_model_info(self) -> _Call[EngineReply]:
        """``/get_model_info``'s dict."""
        return _reply("GET", "/get_model_info")

    @_Endpoint
    def get_weight_version(self) -> _Call[int]:
        """The served weight version as an int (-1: SGLang's non-numeric default); from
        ``/get_weight_version``, or ``/model_info`` where that is 404 (real SGLang)."""
        return _Call("GET", "/get_weight_version", decode=_version_of,
                     recover=_not_found_then(_Call("GET", "/model_info", decode=_version_of)))

    @_Endpoint
    def pause_generation(self, mode: str = "abort") -> _Call[EngineReply]:
        """``/pause_generation`` in ``mode`` (``abort`` | ``retract`` | ``in_place``)."""
        return _reply("POST", "/pause_generation", {"mode": mode})

    @_Endpoint
    def continue_generation(self) -> _Call[EngineReply]:
        """``/continue_generation``."""
        return _reply("POST", "/continue_generation", {})

    @_Endpoint
    def flush_cache(self, timeout_s: float = 0.0) -> _Call[bool]:
        """True when flushed; False when the engine refused (requests in flight). ``timeout_s``
        > 0: SGLang's deferred flush (``?timeout=``), performed as soon as the engine is idle,
        False when it is not idle within ``timeout_s``."""
        if timeout_s > 0:
            return _Call("POST", f"/flush_cache?timeout={timeout_s:g}", decode=lambda r: True,
                         recover=_refused_is_false, timeout=timeout_s + 30.0)
        return _Call("POST", "/flush_cache", decode=lambda r: True, recover=_refused_is_false)

    @_Endpoint
    def abort_request(self, rid: str = "", abort_all: bool = False) -> _Call[None]:
        """Abort request ``rid`` (or every request with ``abort_all``); returns None."""
        return _Call("POST", "/abort_request", {"rid": rid, "abort_all": abort_all}, decode=lambda r: None)

    @_Endpoint
    def init_weights_update_group(self, master_address: str, master_port: int,
                                  rank_offset: int, world_size: int,
                                  group_name: str = "weight_update_group",
                                  backend: str = "gloo") -> _Call[EngineReply]:
        """Join the weight-update process group (a collective: never retried)."""
        body = dict(master_address=master_address, master_port=master_port, rank_offset=rank_offset,
                    world_size=world_size, group_name=group_name, backend=backend)
        return _reply("POST", "/init_weights_update_group", body, retry=None)

    @_Endpoint
    def update_weights_from_distributed(self, names: Sequence[str], dtypes: Sequence[str], shapes: Sequence[Sequence[int]],
                                        group_name: str = "weight_update_group",
                                        flush_cache: bool = True,
                                        weight_version: int | str | None = None,
                                        load_format: str | None = "flattened_bucket",
                                        abort_all_requests: bool = False) -> _Call[EngineReply]:
        """Receive one bucket of ``names`` (``dtypes``, ``shapes``) over the group's broadcast
        (a collective: never retried); ``weight_version`` sent as a string."""
        body: Body = {
            "names": list(names),
            "dtypes": list(dtypes),
            "shapes": [list(s) for s in shapes],
            "group_name": group_name,
            "flush_cache": flush_cache,
            "abort_all_requests": abort_all_requests,
            "load_format": load_format,
        }
        return _reply("POST", "/update_weights_from_distributed", _with_version(body, weight_version), retry=None)

    @_Endpoint
    def update_weights_from_disk(self, model_path: str, weight_version: int | str | None = None,
                                 flush_cache: bool = True) -> _Call[EngineReply]:
        """Load the HF checkpoint directory ``model_path`` (SGLang's ``/update_weights_from_disk``)
        and serve it as ``weight_version``."""
        body: Body = {"model_path": model_path, "flush_cache": flush_cache}
        return _reply("POST", "/update_weights_from_disk", _with_version(body, weight_version), retry=None)

    @_Endpoint
    def update_weights_from_tensor(self, serialized_named_tensors: list[str],
                                   load_format: str | None = "flattened_bucket", flush_cache: bool = True,
                                   weight_version: int | str | None = None,
                                   abort_all_requests: bool = False) -> _Call[EngineReply]:
        """SGLang's colocated update: ``serialized_named_tensors`` one base64 entry per engine
        TP rank (:mod:`moe_async.weight_sync.tensor_ipc`); ``weight_version`` sent as a string."""
        body: Body = {
            "serialized_named_tensors": list(serialized_named_tensors),
            "load_format": load_format,
            "flush_cache": flush_cache,
            "abort_all_requests": abort_all_requests,
        }
        return _reply("POST", "/update_weights_from_tensor", _with_version(body, weight_version), retry=None)

    @_Endpoint
    def load_lora_adapter_from_tensors(self, lora_name: str, config_dict: Mapping[str, object],
                                       serialized_named_tensors: list[str],
                                       load_format: str | None = None) -> _Call[EngineReply]:
        """SGLang's ``/load_lora_adapter_from_tensors``: a PEFT ``adapter_config.json`` dict and one
        base64 entry of ``(name, tensor)`` pairs per engine TP rank (:mod:`moe_async.weight_sync.lora_sync`)."""
        return _reply("POST", "/load_lora_adapter_from_tensors",
                      {"lora_name": lora_name, "config_dict": dict(config_dict),
                       "serialized_named_tensors": list(serialized_named_tensors), "load_format": load_format},
                      retry=None)

    @_Endpoint
    def load_lora_adapter(self, lora_name: str, lora_path: str) -> _Call[EngineReply]:
        """SGLang's ``/load_lora_adapter`` from a PEFT directory the engine can read."""
        return _reply("POST", "/load_lora_adapter", {"lora_name": lora_name, "lora_path": lora_path}, retry=None)

    @_Endpoint
    def unload_lora_adapter(self, lora_name: str) -> _Call[EngineReply]:
        """SGLang's ``/unload_lora_adapter``."""
        return _reply("POST", "/unload_lora_adapter", {"lora_name": lora_name}, retry=None)

    @_Endpoint
    def destroy_weights_update_group(self, group_name: str = "weight_update_group") -> _Call[EngineReply]:
        """Leave the weight-update group ``group_name`` (SGLang's call)."""
        return _reply("POST", "/destroy_weights_update_group", {"group_name": group_name}, retry=None)

    @_Endpoint
    def begin_weight_update(self, atomic: bool = False, selector: str = "all") -> _Call[EngineReply]:
        """Open SGLang 0.5.23's weight-update session (required around
        ``update_weights_from_distributed``); ``atomic`` (ours, SGLang ignores it): the
        embedded engine stages the session's calls until the versioned one."""
        body: Body = {"selector": selector}
        if atomic:
            body["atomic"] = True
        return _reply("POST", "/begin_weight_update", body, retry=None)

    @_Endpoint
    def end_weight_update(self) -> _Call[EngineReply]:
        """Close the weight-update session."""
        return _reply("POST", "/end_weight_update", {}, retry=None)

    @_Endpoint
    def weights_checksum(self) -> _Call[EngineReply]:
        """``{"weight_version": int, "checksums": {hf_name: sha256 hex}, ...}`` (embedded engine only;
        the wire's string version parsed to the trainer's int)."""
        return _Call("GET", "/weights_checksum",
                     decode=lambda r: {**(info := r.json()), "weight_version": as_version(info.get("weight_version"))})

    @_Endpoint
    def set_num_threads(self, num_threads: int) -> _Call[int | None]:
        """Torch threads of the engine's forward passes from the next one on (embedded engine's
        ``POST /set_num_threads``); returns the count now in effect, None when the engine has
        no such endpoint (SGLang: a 404)."""
        return _Call("POST", "/set_num_threads", {"num_threads": int(num_threads)},
                     decode=lambda r: int(r.json()["num_threads"]), recover=_not_found_is_none)

    @_Endpoint
    def weights_layout(self) -> _Call[EngineReply | None]:
        """``{"names", "shapes", "dtypes"}``: the HF tensors in the order the engine receives
        without a copy (embedded engine's ``GET /weights_layout``); None when the engine has
        no such endpoint (SGLang)."""
        return _Call("GET", "/weights_layout", retry=None, check=False,
                     decode=lambda r: r.json() if r.status_code == 200 else None)


class _RetryKw(TypedDict):
    """:meth:`_Base._retry_kw`: tenacity's ``Retrying`` / ``AsyncRetrying`` arguments."""

    retry: retry_base
    stop: stop_base
    wait: wait_base
    reraise: bool


class _Base(_Calls):
    def __init__(
        self,
        base_url: str,
        timeout_s: float = 600.0,
        *,
        retries: int = 5,
        backoff_s: float = 0.2,
        moe_layers: int | None = None,
        top_k: int | None = None,
    ):
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s
        self.retries = retries
        self.backoff_s = backoff_s
        self.moe_shape = (moe_layers, top_k) if moe_layers is not None and top_k is not None else None

    def _retry_kw(self, predicate: Callable[[BaseException], bool]) -> _RetryKw:
        """The one retry policy (tenacity ``Retrying`` / ``AsyncRetrying`` arguments): up to
        ``retries`` attempts of the errors ``predicate`` accepts, exponential backoff from
        ``backoff_s`` (at most 5 s apart), the last error re-raised."""
        return _RetryKw(
            retry=retry_if_exception(predicate),
            stop=stop_after_attempt(self.retries),
            wait=wait_exponential(multiplier=self.backoff_s, max=5.0),
            reraise=True,
        )

    def _call(self, method: str, path: str, json: object = None,
              retry: Callable[[BaseException], bool] | None = _transient,
              timeout: float | None = None) -> _Call[httpx.Response]:
        return _Call(method, path, json, retry=retry, decode=lambda r: r, timeout=timeout)

    def _run(self, call: _Call[R]) -> object:
        """Run ``call``: the result (:class:`SyncEngineClient`) or a coroutine of it (:class:`EngineClient`)."""
        raise NotImplementedError


class EngineClient(_Base):
    """Async client (one instance per event loop); ``await client.aclose()`` when done. Its
    methods are :class:`_Calls`'s, awaitable."""

    def __init__(self, base_url: str, timeout_s: float = 600.0, **kw):
        super().__init__(base_url, timeout_s, **kw)
        self._http = httpx.AsyncClient(base_url=self.base_url, timeout=timeout_s, trust_env=False)

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> "EngineClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()

    async def _run(self, call: _Call[R]) -> R:
        """Run ``call`` (its retries, check, decode and recovery) and return its result."""

        async def once() -> httpx.Response:
            return await call.asend(self._http)

        try:
            r = await (once() if call.retry is None else AsyncRetrying(**self._retry_kw(call.retry))(once))
        except Exception as e:
            if call.recover is None:
                raise
            out = call.recover(e)
            return await self._run(out) if isinstance(out, _Call) else out
        return call.decode(r)

    async def _request(self, method: str, path: str, json: object = None,
                       retry: Callable[[BaseException], bool] | None = _transient,
                       timeout: float | None = None) -> httpx.Response:
        """An endpoint of any path: the checked ``httpx.Response`` (``retry`` as :class:`_Call`'s)."""
        return await self._run(self._call(method, path, json, retry, timeout))


class SyncEngineClient(_Base):
    """Blocking twin of :class:`EngineClient` (``httpx.Client``): the same :class:`_Calls`
    methods, run by the same policy."""

    def __init__(self, base_url: str, timeout_s: float = 600.0, **kw):
        super().__init__(base_url, timeout_s, **kw)
        self._http = httpx.Client(base_url=self.base_url, timeout=timeout_s, trust_env=False)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> "SyncEngineClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _run(self, call: _Call[R]) -> R:
        """Run ``call`` (its retries, check, decode and recovery) and return its result."""

        def once() -> httpx.Response:
            return call.send(self._http)

        try:
            r = once() if call.retry is None else Retrying(**self._retry_kw(call.retry))(once)
        except Exception as e:
            if call.recover is None:
                raise
            out = call.recover(e)
            return self._run(out) if isinstance(out, _Call) else out
        return call.decode(r)

    def _request(self, method: str, path: str, json: object = None,
                 retry: Callable[[BaseException], bool] | None = _transient,
                 timeout: float | None = None) -> httpx.Response:
        """An endpoint of any path: the checked ``httpx.Response`` (``retry`` as :class:`_Call`'s)."""
        return self._run(self._call(method, path, json, retry, timeout))


if TYPE_CHECKING:
    from moe_async.protocols import GenerateEngine, WeightReceiver

    def _clients_bind(sync: SyncEngineClient, aio: EngineClient) -> tuple[WeightReceiver, GenerateEngine]:
        """Never called: the type checker proves the generated methods satisfy the Protocols."""
        return sync, aio
