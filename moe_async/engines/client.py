"""HTTP client for an engine speaking SGLang's protocol (SGLang itself or the embedded one).

:class:`EngineClient` is async (``httpx.AsyncClient``); :class:`SyncEngineClient` has the
same methods, blocking, for callers without an event loop. Both build requests and parse
responses with the same helpers, so they cannot drift apart.

Retries (tenacity, exponential backoff): connection errors and 5xx on idempotent calls
(health, versions, model info, checksums, pause/continue, flush, abort); ``generate`` is
retried only when the connection could not be made (nothing ran). Weight-group calls are
collectives and are never retried. A 4xx raises :class:`EngineRequestError` carrying the
server's message.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass, field
from typing import Any

import httpx
import numpy as np
from tenacity import (
    AsyncRetrying,
    Retrying,
    retry_if_exception,
    stop_after_attempt,
    wait_exponential,
)


class EngineRequestError(RuntimeError):
    """The engine answered an error status; ``message`` is the server's own text."""

    def __init__(self, path: str, status_code: int, message: str):
        super().__init__(f"{path} -> HTTP {status_code}: {message}")
        self.path, self.status_code, self.message = path, status_code, message


@dataclass
class GenerateOutput:
    """One finished generation.

    Attributes:
        output_ids: ``[R]`` generated token ids.
        output_logprobs: ``[R]`` logprob of each generated token (SGLang's definition:
            ``log_softmax(logits / temperature)``; raw logits when greedy).
        finish_reason: ``"stop"`` | ``"length"`` | ``"abort"``.
        weight_version: the engine's weight version reported with the result.
        output_token_weight_versions: ``[R]`` version per token (from the server's
            ``output_token_weight_versions`` or SGLang's ``weight_versions`` spans, else
            ``weight_version`` repeated).
        routed_experts: ``None`` or int32 ``[prompt + R - 1, moe_layers, top_k]``.
        prompt_tokens: prompt length the engine saw.
        rid: request id.
        text: decoded text ("" without a tokenizer).
        finish_info: the raw ``finish_reason`` dict.
        sampling_mask: ``None`` or, per output token, the token ids the sampler could pick
            after top-k/top-p/min-p truncation (SGLang's ``output_token_sampling_mask``;
            greedy: just the chosen token).
        sampling_logprobs: ``None`` or, per output token, the behaviour logprob: log of the
            chosen token's probability renormalised over that support (``"selected"``
            mode; 0.0 when greedy), or the list over the support (``"support"`` mode).
    """

    output_ids: list[int]
    output_logprobs: list[float]
    finish_reason: str
    weight_version: int
    output_token_weight_versions: list[int]
    routed_experts: np.ndarray | None
    prompt_tokens: int
    rid: str = ""
    text: str = ""
    finish_info: dict = field(default_factory=dict)
    sampling_mask: list[list[int]] | None = None
    sampling_logprobs: list | None = None


def _version(v: Any) -> int:
    try:
        return int(v)
    except (TypeError, ValueError):
        return -1  # SGLang's default version string ("default") is not a number


def parse_generate(
    resp: dict, moe_shape: tuple[int, int] | None = None
) -> GenerateOutput:
    """SGLang ``/generate`` response dict -> :class:`GenerateOutput`."""
    meta = resp["meta_info"]
    ids = list(resp.get("output_ids") or [])
    lps = [x[0] for x in meta.get("output_token_logprobs") or []]
    version = _version(meta.get("weight_version"))
    if "output_token_weight_versions" in meta:
        versions = [int(v) for v in meta["output_token_weight_versions"]]
    elif meta.get("weight_versions"):
        versions = [version] * len(ids)
        for span in meta["weight_versions"]:
            for i in range(span["start"], min(span["end"], len(ids))):
                versions[i] = _version(span["version"])
    else:
        versions = [version] * len(ids)
    routed = None
    if meta.get("routed_experts") is not None:
        flat = np.frombuffer(base64.b64decode(meta["routed_experts"]), dtype=np.int32)
        if "routed_experts_shape" in meta:
            routed = flat.reshape(meta["routed_experts_shape"])
        elif moe_shape is not None:
            routed = flat.reshape(-1, *moe_shape)
        else:
            raise ValueError(
                "routed_experts came without routed_experts_shape; construct the client with "
                "moe_layers= and top_k= to decode it"
            )
    finish = meta.get("finish_reason") or {}
    return GenerateOutput(
        output_ids=ids,
        output_logprobs=lps,
        finish_reason=finish.get("type", "length") if isinstance(finish, dict) else str(finish),
        weight_version=version,
        output_token_weight_versions=versions,
        routed_experts=routed,
        prompt_tokens=int(meta.get("prompt_tokens", 0)),
        rid=str(meta.get("id", "")),
        text=resp.get("text", ""),
        finish_info=finish if isinstance(finish, dict) else {},
        sampling_mask=meta.get("output_token_sampling_mask"),
        sampling_logprobs=meta.get("output_token_sampling_logprobs"),
    )


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


def _json_or_text(r: httpx.Response) -> Any:
    try:
        return r.json()
    except ValueError:
        return r.text


def _with_version(body: dict[str, Any], weight_version: int | str | None) -> dict[str, Any]:
    """``body`` with ``weight_version`` as SGLang types it (``Optional[str]``; absent when None)."""
    if weight_version is not None:
        body["weight_version"] = str(weight_version)
    return body


class _Base:
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

    def _retry_kw(self, predicate):
        return dict(
            retry=retry_if_exception(predicate),
            stop=stop_after_attempt(self.retries),
            wait=wait_exponential(multiplier=self.backoff_s, max=5.0),
            reraise=True,
        )

    @staticmethod
    def _generate_body(input_ids, sampling_params, return_logprob, return_routed_experts, rid,
                       return_sampling_mask=False, sampling_logprobs_mode=None):
        body: dict[str, Any] = {
            "input_ids": list(input_ids),
            "sampling_params": dict(sampling_params or {}),
            "return_logprob": return_logprob,
            "return_routed_experts": return_routed_experts,
        }
        if rid is not None:
            body["rid"] = rid
        if return_sampling_mask:
            body["return_sampling_mask"] = True
            if sampling_logprobs_mode is not None:
                body["sampling_logprobs_mode"] = sampling_logprobs_mode
        return body

    @staticmethod
    def _update_body(names, dtypes, shapes, group_name, flush_cache, weight_version, load_format,
                     abort_all_requests):
        body: dict[str, Any] = {
            "names": list(names),
            "dtypes": list(dtypes),
            "shapes": [list(s) for s in shapes],
            "group_name": group_name,
            "flush_cache": flush_cache,
            "abort_all_requests": abort_all_requests,
            "load_format": load_format,
        }
        return _with_version(body, weight_version)

    @staticmethod
    def _disk_body(model_path: str, weight_version: int | str | None, flush_cache: bool) -> dict:
        body: dict[str, Any] = {"model_path": model_path, "flush_cache": flush_cache}
        return _with_version(body, weight_version)

    @staticmethod
    def _tensor_body(serialized_named_tensors, load_format, flush_cache, weight_version, abort_all_requests):
        body: dict[str, Any] = {
            "serialized_named_tensors": list(serialized_named_tensors),
            "load_format": load_format,
            "flush_cache": flush_cache,
            "abort_all_requests": abort_all_requests,
        }
        return _with_version(body, weight_version)

    @staticmethod
    def _checksums_of(info: dict) -> dict:
        return {**info, "weight_version": _version(info.get("weight_version"))}

    @staticmethod
    def _begin_body(atomic: bool, selector: str) -> dict:
        body: dict[str, Any] = {"selector": selector}
        if atomic:
            body["atomic"] = True
        return body

    @staticmethod
    def _weight_version_of(info: dict) -> int:
        return _version(info.get("weight_version"))


class EngineClient(_Base):
    """Async client (one instance per event loop); ``await client.aclose()`` when done."""

    def __init__(self, base_url: str, timeout_s: float = 600.0, **kw):
        super().__init__(base_url, timeout_s, **kw)
        self._http = httpx.AsyncClient(base_url=self.base_url, timeout=timeout_s)

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> "EngineClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()

    async def _request(self, method: str, path: str, json: Any = None, retry=_transient,
                       timeout: float | None = None) -> httpx.Response:
        async def once():
            kw = {"json": json} if json is not None else {}
            if timeout is not None:
                kw["timeout"] = timeout
            return _check(path, await self._http.request(method, path, **kw))

        if retry is None:
            return await once()
        async for attempt in AsyncRetrying(**self._retry_kw(retry)):
            with attempt:
                return await once()
        raise AssertionError("unreachable")

    async def generate(self, input_ids: list[int], sampling_params: dict | None = None,
                       return_logprob: bool = True, return_routed_experts: bool = False,
                       rid: str | None = None, return_sampling_mask: bool = False,
                       sampling_logprobs_mode: str | None = None) -> GenerateOutput:
        body = self._generate_body(input_ids, sampling_params, return_logprob, return_routed_experts, rid,
                                   return_sampling_mask, sampling_logprobs_mode)
        r = await self._request("POST", "/generate", body, retry=_connect_only)
        return parse_generate(r.json(), self.moe_shape)

    async def health(self, timeout: float = 5.0) -> bool:
        try:
            r = await self._http.get("/health", timeout=timeout)
        except httpx.HTTPError:
            return False
        return r.status_code == 200

    async def get_model_info(self) -> dict:
        return (await self._request("GET", "/get_model_info")).json()

    async def get_weight_version(self) -> int:
        try:
            r = await self._request("GET", "/get_weight_version")
        except EngineRequestError as e:  # real SGLang: the version is in /model_info
            if e.status_code != 404:
                raise
            r = await self._request("GET", "/model_info")
        return self._weight_version_of(r.json())

    async def pause_generation(self, mode: str = "abort") -> dict:
        return (await self._request("POST", "/pause_generation", {"mode": mode})).json()

    async def continue_generation(self) -> dict:
        return (await self._request("POST", "/continue_generation", {})).json()

    async def flush_cache(self) -> bool:
        """True when flushed; False when the engine refused (requests in flight)."""
        try:
            await self._request("POST", "/flush_cache")
        except EngineRequestError as e:
            if e.status_code == 400:
                return False
            raise
        return True

    async def abort_request(self, rid: str = "", abort_all: bool = False) -> None:
        await self._request("POST", "/abort_request", {"rid": rid, "abort_all": abort_all})

    async def init_weights_update_group(self, master_address: str, master_port: int,
                                        rank_offset: int, world_size: int,
                                        group_name: str = "weight_update_group",
                                        backend: str = "gloo") -> dict:
        body = dict(master_address=master_address, master_port=master_port, rank_offset=rank_offset,
                    world_size=world_size, group_name=group_name, backend=backend)
        return (await self._request("POST", "/init_weights_update_group", body, retry=None)).json()

    async def update_weights_from_distributed(self, names, dtypes, shapes,
                                              group_name: str = "weight_update_group",
                                              flush_cache: bool = True,
                                              weight_version: int | str | None = None,
                                              load_format: str | None = "flattened_bucket",
                                              abort_all_requests: bool = False) -> dict:
        body = self._update_body(names, dtypes, shapes, group_name, flush_cache, weight_version,
                                 load_format, abort_all_requests)
        return (await self._request("POST", "/update_weights_from_distributed", body, retry=None)).json()

    async def update_weights_from_disk(self, model_path: str, weight_version: int | str | None = None,
                                       flush_cache: bool = True) -> dict:
        """Load the HF checkpoint directory ``model_path`` (SGLang's ``/update_weights_from_disk``)
        and serve it as ``weight_version``."""
        body = self._disk_body(model_path, weight_version, flush_cache)
        return (await self._request("POST", "/update_weights_from_disk", body, retry=None)).json()

    async def update_weights_from_tensor(self, serialized_named_tensors: list[str],
                                         load_format: str | None = "flattened_bucket", flush_cache: bool = True,
                                         weight_version: int | str | None = None,
                                         abort_all_requests: bool = False) -> dict:
        """SGLang's colocated update: ``serialized_named_tensors`` one base64 entry per engine
        TP rank (:mod:`moe_async.weight_sync.tensor_ipc`); ``weight_version`` sent as a string."""
        body = self._tensor_body(serialized_named_tensors, load_format, flush_cache, weight_version,
                                 abort_all_requests)
        return (await self._request("POST", "/update_weights_from_tensor", body, retry=None)).json()

    async def destroy_weights_update_group(self, group_name: str = "weight_update_group") -> dict:
        """Leave the weight-update group ``group_name`` (SGLang's call)."""
        body = {"group_name": group_name}
        return (await self._request("POST", "/destroy_weights_update_group", body, retry=None)).json()

    async def begin_weight_update(self, atomic: bool = False, selector: str = "all") -> dict:
        """Open SGLang 0.5.23's weight-update session (required around
        ``update_weights_from_distributed``); ``atomic`` (ours, SGLang ignores it): the
        embedded engine stages the session's calls until the versioned one."""
        body = self._begin_body(atomic, selector)
        return (await self._request("POST", "/begin_weight_update", body, retry=None)).json()

    async def end_weight_update(self) -> dict:
        """Close the weight-update session."""
        return (await self._request("POST", "/end_weight_update", {}, retry=None)).json()

    async def weights_checksum(self) -> dict:
        """``{"weight_version": int, "checksums": {hf_name: sha256 hex}, ...}`` (embedded engine only;
        the wire's string version parsed to the trainer's int)."""
        return self._checksums_of((await self._request("GET", "/weights_checksum")).json())

    async def weights_layout(self) -> dict | None:
        """``{"names", "shapes", "dtypes"}``: the HF tensors in the order the engine receives
        without a copy (embedded engine's ``GET /weights_layout``); None when the engine has
        no such endpoint (SGLang)."""
        r = await self._http.get("/weights_layout")
        return r.json() if r.status_code == 200 else None


class SyncEngineClient(_Base):
    """Blocking twin of :class:`EngineClient` (``httpx.Client``)."""

    def __init__(self, base_url: str, timeout_s: float = 600.0, **kw):
        super().__init__(base_url, timeout_s, **kw)
        self._http = httpx.Client(base_url=self.base_url, timeout=timeout_s)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> "SyncEngineClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _request(self, method: str, path: str, json: Any = None, retry=_transient,
                 timeout: float | None = None) -> httpx.Response:
        def once():
            kw = {"json": json} if json is not None else {}
            if timeout is not None:
                kw["timeout"] = timeout
            return _check(path, self._http.request(method, path, **kw))

        if retry is None:
            return once()
        for attempt in Retrying(**self._retry_kw(retry)):
            with attempt:
                return once()
        raise AssertionError("unreachable")

    def generate(self, input_ids: list[int], sampling_params: dict | None = None,
                 return_logprob: bool = True, return_routed_experts: bool = False,
                 rid: str | None = None, return_sampling_mask: bool = False,
                 sampling_logprobs_mode: str | None = None) -> GenerateOutput:
        body = self._generate_body(input_ids, sampling_params, return_logprob, return_routed_experts, rid,
                                   return_sampling_mask, sampling_logprobs_mode)
        r = self._request("POST", "/generate", body, retry=_connect_only)
        return parse_generate(r.json(), self.moe_shape)

    def health(self, timeout: float = 5.0) -> bool:
        try:
            r = self._http.get("/health", timeout=timeout)
        except httpx.HTTPError:
            return False
        return r.status_code == 200

    def get_model_info(self) -> dict:
        return self._request("GET", "/get_model_info").json()

    def get_weight_version(self) -> int:
        try:
            r = self._request("GET", "/get_weight_version")
        except EngineRequestError as e:
            if e.status_code != 404:
                raise
            r = self._request("GET", "/model_info")
        return self._weight_version_of(r.json())

    def pause_generation(self, mode: str = "abort") -> dict:
        return self._request("POST", "/pause_generation", {"mode": mode}).json()

    def continue_generation(self) -> dict:
        return self._request("POST", "/continue_generation", {}).json()

    def flush_cache(self) -> bool:
        try:
            self._request("POST", "/flush_cache")
        except EngineRequestError as e:
            if e.status_code == 400:
                return False
            raise
        return True

    def abort_request(self, rid: str = "", abort_all: bool = False) -> None:
        self._request("POST", "/abort_request", {"rid": rid, "abort_all": abort_all})

    def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int,
                                  world_size: int, group_name: str = "weight_update_group",
                                  backend: str = "gloo") -> dict:
        body = dict(master_address=master_address, master_port=master_port, rank_offset=rank_offset,
                    world_size=world_size, group_name=group_name, backend=backend)
        return self._request("POST", "/init_weights_update_group", body, retry=None).json()

    def update_weights_from_distributed(self, names, dtypes, shapes,
                                        group_name: str = "weight_update_group",
                                        flush_cache: bool = True, weight_version: int | str | None = None,
                                        load_format: str | None = "flattened_bucket",
                                        abort_all_requests: bool = False) -> dict:
        body = self._update_body(names, dtypes, shapes, group_name, flush_cache, weight_version,
                                 load_format, abort_all_requests)
        return self._request("POST", "/update_weights_from_distributed", body, retry=None).json()

    def update_weights_from_disk(self, model_path: str, weight_version: int | str | None = None,
                                 flush_cache: bool = True) -> dict:
        """See :meth:`EngineClient.update_weights_from_disk`."""
        body = self._disk_body(model_path, weight_version, flush_cache)
        return self._request("POST", "/update_weights_from_disk", body, retry=None).json()

    def update_weights_from_tensor(self, serialized_named_tensors: list[str],
                                   load_format: str | None = "flattened_bucket", flush_cache: bool = True,
                                   weight_version: int | str | None = None, abort_all_requests: bool = False) -> dict:
        """See :meth:`EngineClient.update_weights_from_tensor`."""
        body = self._tensor_body(serialized_named_tensors, load_format, flush_cache, weight_version,
                                 abort_all_requests)
        return self._request("POST", "/update_weights_from_tensor", body, retry=None).json()

    def destroy_weights_update_group(self, group_name: str = "weight_update_group") -> dict:
        """See :meth:`EngineClient.destroy_weights_update_group`."""
        return self._request("POST", "/destroy_weights_update_group", {"group_name": group_name}, retry=None).json()

    def begin_weight_update(self, atomic: bool = False, selector: str = "all") -> dict:
        """See :meth:`EngineClient.begin_weight_update`."""
        return self._request("POST", "/begin_weight_update", self._begin_body(atomic, selector), retry=None).json()

    def end_weight_update(self) -> dict:
        """See :meth:`EngineClient.end_weight_update`."""
        return self._request("POST", "/end_weight_update", {}, retry=None).json()

    def weights_checksum(self) -> dict:
        return self._checksums_of(self._request("GET", "/weights_checksum").json())

    def weights_layout(self) -> dict | None:
        """See :meth:`EngineClient.weights_layout`."""
        r = self._http.get("/weights_layout")
        return r.json() if r.status_code == 200 else None


class MultiEngineClient:
    """Several engines behind one async client: least-loaded dispatch of ``generate``.

    Each ``generate`` goes to the engine with the fewest requests in flight *from this
    client* (ties: the lowest index, rotated so equal loads spread). Control calls (pause,
    continue, flush, version) fan out to every engine and return their per-engine results.
    On GPU clusters ``sglang-router`` (``python -m sglang_router.launch_router
    --worker-urls ...``) does the same job for SGLang engines; pointing a single
    :class:`EngineClient` at the router is equivalent, except that weight-update calls must
    still go to each engine's own URL.
    """

    def __init__(self, urls: list[str], timeout_s: float = 600.0, **kw):
        if not urls:
            raise ValueError("MultiEngineClient needs at least one engine URL")
        self.clients = [EngineClient(u, timeout_s, **kw) for u in urls]
        self.inflight = [0] * len(urls)
        self._next = 0

    def pick(self) -> int:
        n = len(self.clients)
        order = [(self._next + j) % n for j in range(n)]
        i = min(order, key=lambda k: self.inflight[k])
        self._next = (i + 1) % n
        return i

    async def generate(self, *args, **kw) -> GenerateOutput:
        i = self.pick()
        self.inflight[i] += 1
        try:
            return await self.clients[i].generate(*args, **kw)
        finally:
            self.inflight[i] -= 1

    async def _all(self, name: str, *args, **kw) -> list:
        import asyncio

        return list(await asyncio.gather(*[getattr(c, name)(*args, **kw) for c in self.clients]))

    async def health(self) -> list[bool]:
        return await self._all("health")

    async def pause_generation(self, mode: str = "abort") -> list[dict]:
        return await self._all("pause_generation", mode)

    async def continue_generation(self) -> list[dict]:
        return await self._all("continue_generation")

    async def flush_cache(self) -> list[bool]:
        return await self._all("flush_cache")

    async def get_weight_version(self) -> list[int]:
        return await self._all("get_weight_version")

    async def aclose(self) -> None:
        await self._all("aclose")

    async def __aenter__(self) -> "MultiEngineClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()
