"""Continuous batching for the embedded engine: one thread owns the model.

Requests are prefilled together (identical prompts share one row), join the running decode
batch, and leave it when finished (their ``Future`` resolves). Control commands (pause, abort,
weight apply, checksums) run on the same thread between forward passes, so no forward pass
sees a mix of old and new weights.

Design notes: ``docs/design/engines.md``."""

from __future__ import annotations

import concurrent.futures
import logging
import queue
import threading
import time
import traceback
from collections import deque
from typing import Any, Callable, TypeVar

import torch
from transformers import DynamicCache

from moe_async.engines.embedded.forward import LogitsHead, RoutingCapture, cache_kv, left_pad
from moe_async.engines.embedded.lora import EngineLora
from moe_async.engines.embedded.req import Req
from moe_async.engines.embedded.response import build_response
from moe_async.engines.embedded.sampling import SamplingParams, adjust_logits, check_finish

T = TypeVar("T")

__all__ = ["Scheduler"]

log = logging.getLogger("moe_async.engines.embedded")

class Scheduler:
    """Owns the model; runs prefill/decode and control commands on one thread."""

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        context_length: int,
        max_running_requests: int,
        eos_token_ids: set[int],
        return_original_logprob: bool = False,
        tokenizer: Any = None,
        sampling_mask_max_tokens: int = 4096,
        max_prefill_tokens: int = 8192,
    ):
        self.model = model
        #: the model's device: every tensor built here is made on it (results leave as lists)
        self.device = next(model.parameters()).device
        self.context_length = context_length
        self.max_running = max_running_requests
        self.eos_token_ids = eos_token_ids
        self.return_original_logprob = return_original_logprob
        self.tokenizer = tokenizer
        self.sampling_mask_max_tokens = sampling_mask_max_tokens
        cfg = model.config
        self.top_k = int(getattr(cfg, "num_experts_per_tok", 0) or 0)
        self.capture = RoutingCapture(model, self.top_k)
        self.head = LogitsHead(model)
        self.lora = EngineLora(model)  # LoRA adapters by name; each forward's rows choose theirs
        self.max_prefill_tokens = max_prefill_tokens
        self.weight_version = "default"  # any string, as SGLang's (its --weight-version default)
        self.paused = False
        self.max_decode_batch = 0  # largest decode batch seen (server info)
        # counters (server info; tools/bench_engine.py): forward passes, rows, seconds
        # (``*_cpu_s``: the scheduler thread's CPU time, steadier than wall time on a busy host)
        self.stats = {"decode_steps": 0, "decode_rows": 0, "decode_s": 0.0, "decode_cpu_s": 0.0,
                      "prefill_forwards": 0, "prefill_reqs": 0, "prefill_s": 0.0,
                      "prefill_cpu_s": 0.0, "prefill_shared_reqs": 0}
        self.forward_sleep_s = 0.0  # SGLang's /slow_down: sleep after each decode step
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []
        # Batch KV cache: per layer (keys, values) [B, H, T, D]; pads[b] left-pad columns.
        self.kv: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        self.pads: list[int] = []
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._cmds: queue.SimpleQueue = queue.SimpleQueue()
        self._stop = False
        self._thread = threading.Thread(target=self._loop, name="embedded-scheduler", daemon=True)

    # ------------------------------------------------------------------ public API
    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop = True
        self._wake.set()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def submit(self, req: Req) -> concurrent.futures.Future:
        """Queue ``req``; returns the future resolving to its response dict."""
        prompt_len = len(req.input_ids)
        if req.lora_name is not None:
            self.lora.acquire(req.lora_name)  # LoraError (a 400) when it is not loaded
        req.max_new_tokens = max(0, min(req.params.max_new_tokens, self.context_length - prompt_len))
        if req.params.sampling_seed is not None:
            req.generator = torch.Generator(device=self.device).manual_seed(req.params.sampling_seed)
        if req.max_new_tokens == 0:
            # Prompt fills the context (or 0 tokens asked): nothing is generated and the prompt
            # is never cut. A forward pass still runs when the request wants what the prompt
            # alone gives: routed experts of its P-1 positions that predict a following token,
            # or input logprobs (a scoring call: return_logprob with logprob_start_len >= 0).
            if not ((req.return_routed_experts and prompt_len > 1) or self._wants_input_logprobs(req)):
                self._finish(req, {"type": "length", "length": 0})
                return req.future
        with self._lock:
            self.waiting.append(req)
        self._wake.set()
        return req.future

    @staticmethod
    def _wants_input_logprobs(req: Req) -> bool:
        return (req.return_logprob and 0 <= req.logprob_start_len < len(req.input_ids)
                and req.input_token_logprobs is None)

    def call(self, fn: Callable[[], T]) -> concurrent.futures.Future[T]:
        """Run ``fn`` on the scheduler thread between forward passes."""
        fut: concurrent.futures.Future[T] = concurrent.futures.Future()
        self._cmds.put((fn, fut))
        self._wake.set()
        return fut

    # control commands (call these through :meth:`call`)
    def abort(self, rid: str | None = None, message: str = "aborted") -> int:
        """Finish running/waiting requests (all, or the one ``rid``) with ``abort``."""
        n = 0
        keep = []
        for i, r in enumerate(self.running):
            if rid is None or r.rid == rid:
                self._finish(r, self._abort_reason(message))
                n += 1
            else:
                keep.append(i)
        if len(keep) != len(self.running):
            self._keep_rows(keep)
        with self._lock:
            remaining: deque[Req] = deque()
            for r in self.waiting:
                if rid is None or r.rid == rid:
                    self._finish(r, self._abort_reason(message))
                    n += 1
                else:
                    remaining.append(r)
            self.waiting = remaining
        return n

    def pause(self, mode: str) -> None:
        if mode == "abort":
            self.abort(message="aborted by pause_generation(mode=abort)")
        elif mode == "retract":
            with self._lock:
                for r in reversed(self.running):
                    r.num_retractions += 1
                    self.waiting.appendleft(r)
            self.running, self.kv, self.pads = [], None, []
        elif mode != "in_place":
            raise ValueError(f"pause mode must be abort|retract|in_place, got {mode!r}")
        self.paused = True

    def resume(self) -> None:
        self.paused = False

    def idle(self) -> bool:
        """SGLang's ``Scheduler.is_fully_idle(ignore_waiting=paused)``, the condition for a
        cache flush: nothing running (a request paused in place still is), and nothing
        waiting unless the engine is paused (retracted requests wait for the continue)."""
        with self._lock:
            return not self.running and (self.paused or not self.waiting)

    def num_requests(self) -> int:
        with self._lock:
            return len(self.running) + len(self.waiting)

    # ------------------------------------------------------------------ loop
    def _loop(self) -> None:
        while not self._stop:
            self._wake.clear()
            self._run_commands()
            try:
                if not self.paused:
                    self._admit()
                if self.running and not self.paused:
                    self._decode_step()
                    if self.forward_sleep_s:
                        self._wake.wait(self.forward_sleep_s)
                    continue
            except Exception as e:  # never let a bad batch kill the server
                log.error("scheduler step failed: %s\n%s", e, traceback.format_exc())
                for r in list(self.running):
                    self._finish(r, self._abort_reason(f"internal error: {e}", 500))
                self.running, self.kv, self.pads = [], None, []
                continue
            if self._cmds.empty():
                self._wake.wait(0.5)

    def _run_commands(self) -> None:
        while True:
            try:
                fn, fut = self._cmds.get_nowait()
            except queue.Empty:
                return
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn())
            except BaseException as e:  # reported to the caller
                fut.set_exception(e)
            finally:
                self.head.invalidate()  # a command may have written weights

    def _admit(self) -> None:
        """Prefill every waiting request that fits, in one left-padded batch."""
        while len(self.running) < self.max_running:
            batch: list[Req] = []
            longest = 0
            with self._lock:
                while self.waiting and len(self.running) + len(batch) < self.max_running:
                    n = len(self.waiting[0].input_ids) + len(self.waiting[0].output_ids)
                    # padded tokens of the batch (attention is [n, S, S]) within the budget;
                    # a request alone always fits
                    if batch and (len(batch) + 1) * max(longest, n) > self.max_prefill_tokens:
                        break
                    longest = max(longest, n)
                    batch.append(self.waiting.popleft())
            if not batch:
                return
            for req in [r for r in batch if r.max_new_tokens == 0]:  # prompt-only, alone
                self._prefill_guarded([req])
            batch = [r for r in batch if r.max_new_tokens > 0]
            if batch:
                self._prefill_guarded(batch)

    def _prefill_guarded(self, reqs: list[Req]) -> None:
        st = self.stats
        t0, c0 = time.perf_counter(), time.thread_time()
        try:
            st["prefill_forwards"] += 1
            st["prefill_reqs"] += len(reqs)
            if reqs[0].max_new_tokens == 0:
                self._prefill_prompt_only(reqs[0])
            else:
                self._prefill(reqs)
        except Exception as e:
            log.error("prefill failed for %s: %s\n%s", [r.rid for r in reqs], e, traceback.format_exc())
            for req in reqs:
                self._finish(req, self._abort_reason(f"internal error in prefill: {e}", 500))
        finally:
            st["prefill_s"] += time.perf_counter() - t0
            st["prefill_cpu_s"] += time.thread_time() - c0

    # ------------------------------------------------------------------ model steps
    @torch.inference_mode()
    def _prefill_prompt_only(self, req: Req) -> None:
        """0-token request: routed experts of the first P-1 prompt tokens and/or input
        logprobs (scoring), from one forward over the prompt."""
        need_lp = self._wants_input_logprobs(req)
        ids = req.input_ids if need_lp else req.input_ids[:-1]
        self.capture.enabled = req.return_routed_experts
        self.lora.rows = [req.lora_name]
        out = self.model(input_ids=torch.tensor([ids], dtype=torch.long, device=self.device), use_cache=False,
                         logits_to_keep=0 if need_lp else 1)
        if req.return_routed_experts:
            req.routed = [self.capture.take(len(ids))[: len(req.input_ids) - 1]]
        if need_lp:
            self._input_logprobs(req, out.logits[0].float())
        self._finish(req, {"type": "length", "length": 0})

    @torch.inference_mode()
    def _prefill(self, reqs: list[Req]) -> None:
        """One forward over ``reqs`` (left-padded to the longest), first token of each, then
        their KV joins the running batch. One request: no padding, no mask.

        Requests whose sequences are identical (a GRPO group's samples, an evaluation's greedy
        and sampled requests of one prompt) share one row of the forward: the model runs over
        the distinct sequences only and each request gets a copy of its row's KV, last logits,
        input logits and routed experts (``prefill_shared_reqs`` counts the rows saved); each
        request then samples its first token with its own parameters."""
        seqs_all = [r.input_ids + r.output_ids for r in reqs]  # re-prefill after a retract includes outputs
        row_of: dict[tuple, int] = {}  # (adapter, sequence) -> row: rows are shared within one adapter
        inv = [row_of.setdefault((r.lora_name, tuple(x)), len(row_of)) for r, x in zip(reqs, seqs_all)]
        seqs = [list(x) for _, x in row_of]
        self.lora.rows = [name for name, _ in row_of]
        self.stats["prefill_shared_reqs"] += len(reqs) - len(seqs)
        n, S = len(seqs), max(len(x) for x in seqs)
        pads = [S - len(x) for x in seqs]
        need_lp_req = [self._wants_input_logprobs(r) for r in reqs]
        need_lp = [False] * n
        for i, want in zip(inv, need_lp_req):
            need_lp[i] = need_lp[i] or want
        routed = any(r.return_routed_experts for r in reqs)
        self.capture.enabled = routed
        cache = DynamicCache()
        if n == 1:
            ids_NS, mask_NS, pos_NS = torch.tensor(seqs, dtype=torch.long, device=self.device), None, None
        else:
            ids_NS = torch.zeros(n, S, dtype=torch.long, device=self.device)
            mask_NS = torch.zeros(n, S, dtype=torch.long, device=self.device)
            for i, x in enumerate(seqs):
                ids_NS[i, pads[i]:] = torch.tensor(x, dtype=torch.long, device=self.device)
                mask_NS[i, pads[i]:] = 1
            pos_NS = (mask_NS.cumsum(-1) - 1).clamp_(min=0)
        kw = dict(input_ids=ids_NS, attention_mask=mask_NS, position_ids=pos_NS,
                  past_key_values=cache, use_cache=True)
        full: dict[int, torch.Tensor] = {}  # row -> [len(seq), V] logits (input logprobs)
        if self.head.enabled:
            h_NSH = self.head.hidden(**kw)
            last_NV = self.head.project(h_NSH[:, -1])
            for i in (i for i in range(n) if need_lp[i]):
                full[i] = self.head.project(h_NSH[i, pads[i]:])
        else:
            logits = self.model(**kw, logits_to_keep=0 if any(need_lp) else 1).logits
            last_NV = logits[:, -1]
            for i in (i for i in range(n) if need_lp[i]):
                full[i] = logits[i, pads[i]:]
        if routed:
            routing = self.capture.take(n * S).reshape(n, S, self.capture.num_layers, -1)
        last_NV = last_NV.float()
        keep = []
        for j, req in enumerate(reqs):
            i = inv[j]  # this request's row of the forward
            # [S, L, K] over prompt (+ outputs after a retract): recomputed on re-prefill
            req.routed = [routing[i, pads[i]:]] if req.return_routed_experts else []
            if need_lp_req[j]:
                self._input_logprobs(req, full[i].float())
            self._append(req, self._adjusted(req, last_NV[i]).unsqueeze(0))
            if req.finish is None:
                keep.append(j)
        if not keep:
            return
        kv = cache_kv(cache)
        rows = [inv[j] for j in keep]
        if rows != list(range(n)):  # finished requests leave; shared rows are copied per request
            idx = torch.tensor(rows, dtype=torch.long, device=self.device)
            kv = [(k.index_select(0, idx), v.index_select(0, idx)) for k, v in kv]
        pads = [pads[i] for i in rows]
        for j, p in enumerate(pads):
            if p:  # padding columns: zeros, as left_pad makes them (never NaN under a mask)
                for k, v in kv:
                    k[j, :, :p] = 0
                    v[j, :, :p] = 0
        self._join(kv, pads)
        self.running.extend(reqs[j] for j in keep)

    def _input_logprobs(self, req: Req, logits_SV: torch.Tensor) -> None:
        """``input_token_logprobs`` (and top / asked-id logprobs) of the prompt positions
        ``[logprob_start_len, P)``: position ``pos`` scored by the logits at ``pos - 1`` (the
        raw ``log_softmax``); the first, ``logprob_start_len`` itself, has none (``null``), as
        in SGLang 0.5.23, whose prefill computes logits from ``logprob_start_len`` on (the
        scheduler's ``[None] + logprobs[:-1]``): score ``input_ids[s:]`` with ``s - 1``."""
        prompt = req.input_ids
        lp_SV = torch.log_softmax(logits_SV[: len(prompt)], dim=-1)
        start = min(req.logprob_start_len, len(prompt))
        res, top, asked = [], [], []
        k = req.top_logprobs_num
        ids = torch.tensor(req.token_ids_logprob or [], dtype=torch.long, device=self.device)
        for pos in range(start, len(prompt)):
            row = None if pos == start else lp_SV[pos - 1]
            res.append([None if row is None else float(row[prompt[pos]]), prompt[pos], None])
            if k:
                top.append(None if row is None else _topk(row, k))
            if req.token_ids_logprob is not None:
                asked.append(None if row is None else (row[ids].tolist(), ids.tolist()))
        req.input_token_logprobs, req.input_top, req.input_ids_lp = res, top, asked

    def _adjusted(self, req: Req, logits_V: torch.Tensor) -> torch.Tensor:
        """``logits_V`` after the request's penalties and logit bias (:func:`adjust_logits`)."""
        p = req.params
        if not p.adjusts_logits:
            return logits_V
        stop_ids = set(self.eos_token_ids) | set(p.stop_token_ids)
        if self.tokenizer is not None and getattr(self.tokenizer, "eos_token_id", None) is not None:
            stop_ids.add(int(self.tokenizer.eos_token_id))
        return adjust_logits(logits_V, p, req.output_ids, stop_ids)

    @torch.inference_mode()
    def _decode_step(self) -> None:
        assert self.kv is not None
        B = len(self.running)
        self.max_decode_batch = max(self.max_decode_batch, B)
        st = self.stats
        st["decode_steps"] += 1
        st["decode_rows"] += B
        t0, c0 = time.perf_counter(), time.thread_time()
        try:
            self._decode_step_inner(B)
        finally:
            st["decode_s"] += time.perf_counter() - t0
            st["decode_cpu_s"] += time.thread_time() - c0

    def _decode_step_inner(self, B: int) -> None:
        assert self.kv is not None  # a decode step runs only with requests running
        T = self.kv[0][0].shape[2]
        dev = self.device
        input_ids_B1 = torch.tensor([[r.output_ids[-1]] for r in self.running], dtype=torch.long, device=dev)
        if any(self.pads):
            pads = torch.tensor(self.pads, dtype=torch.long, device=dev)
            position_ids_B1 = (T - pads).unsqueeze(1)  # real tokens already cached = next position
            cols = torch.arange(T + 1, device=dev).unsqueeze(0)
            attention_mask_BT = (cols >= pads.unsqueeze(1)).long()  # [B, T+1]
        else:  # no padding: what generate() passes for an unpadded batch
            position_ids_B1 = torch.full((B, 1), T, dtype=torch.long, device=dev)
            attention_mask_BT = torch.ones(B, T + 1, dtype=torch.long, device=dev)
        routed = any(r.return_routed_experts for r in self.running)
        self.capture.enabled = routed
        self.lora.rows = [r.lora_name for r in self.running]
        cache = DynamicCache(ddp_cache_data=self.kv)
        kw = dict(input_ids=input_ids_B1, attention_mask=attention_mask_BT,
                  position_ids=position_ids_B1, past_key_values=cache, use_cache=True)
        if self.head.enabled:
            logits_BV = self.head.project(self.head.hidden(**kw)[:, -1])
        else:
            logits_BV = self.model(**kw).logits[:, -1]
        self.kv = cache_kv(cache)
        routing_BLK = self.capture.take(B) if routed else None
        logits_BV = logits_BV.float()
        for b, r in enumerate(self.running):
            if r.params.adjusts_logits:
                logits_BV[b] = self._adjusted(r, logits_BV[b])
        # One batched log_softmax (and argmax) for every row instead of one per request (the
        # fused log_softmax kernel is ~2x faster than logsumexp on a CPU).
        temps = [1.0 if (r.params.greedy or self.return_original_logprob) else r.params.temperature
                 for r in self.running]
        scaled = logits_BV if all(t == 1.0 for t in temps) else logits_BV / torch.tensor(temps, device=dev).unsqueeze(1)
        lp_BV = torch.log_softmax(scaled, dim=-1)
        argmax_B = torch.argmax(logits_BV, dim=-1).tolist()
        keep = []
        for b, r in enumerate(self.running):
            if r.return_routed_experts:
                assert routing_BLK is not None
                r.routed.append(routing_BLK[b : b + 1])
            self._append(r, logits_BV[b : b + 1], lp_BV[b], argmax_B[b])
            if r.finish is None:
                keep.append(b)
        if len(keep) != B:
            self._keep_rows(keep)

    # ------------------------------------------------------------------ batch KV bookkeeping
    def _join(self, kv_new: list[tuple[torch.Tensor, torch.Tensor]], new_pads: list[int]) -> None:
        """Append rows ``kv_new`` (left-padded by ``new_pads``) to the running batch KV."""
        n = kv_new[0][0].shape[2]
        if self.kv is None:
            self.kv, self.pads = kv_new, list(new_pads)
        else:
            T = self.kv[0][0].shape[2]
            T2 = max(T, n)
            self.kv = [
                (torch.cat([left_pad(k, T2 - T), left_pad(k1, T2 - n)], dim=0),
                 torch.cat([left_pad(v, T2 - T), left_pad(v1, T2 - n)], dim=0))
                for (k, v), (k1, v1) in zip(self.kv, kv_new)
            ]
            self.pads = [p + (T2 - T) for p in self.pads] + [p + (T2 - n) for p in new_pads]
        trim = min(self.pads)
        if trim:  # all-padding columns
            self.kv = [(k[:, :, trim:], v[:, :, trim:]) for k, v in self.kv]
            self.pads = [p - trim for p in self.pads]

    def _keep_rows(self, keep: list[int]) -> None:
        self.running = [self.running[i] for i in keep]
        if not keep:
            self.kv, self.pads = None, []
            return
        assert self.kv is not None
        idx = torch.tensor(keep, dtype=torch.long, device=self.device)
        pads = [self.pads[i] for i in keep]
        trim = min(pads)
        self.kv = [
            (k.index_select(0, idx)[:, :, trim:], v.index_select(0, idx)[:, :, trim:])
            for k, v in self.kv
        ]
        self.pads = [p - trim for p in pads]

    # ------------------------------------------------------------------ sampling
    def _append(self, req: Req, logits_1V: torch.Tensor, lp_V: torch.Tensor | None = None,
                argmax: int | None = None) -> None:
        """Sample one token for ``req`` from ``logits_1V``; record it and check stops.

        ``lp_V``/``argmax``: the row's logprobs (of the distribution the returned logprob is
        defined on) and argmax, when the caller computed them batched."""
        p = req.params
        logits_V = logits_1V[0]
        probs = None
        if p.greedy:
            tok = argmax if argmax is not None else int(torch.argmax(logits_V))
        else:
            probs = self._sampling_probs(logits_V, p)
            tok = int(torch.multinomial(probs, 1, generator=req.generator))
        if req.return_sampling_mask and not self._record_mask(req, tok, probs):
            return
        # SGLang default: logprob of the temperature-scaled distribution (before top-k/p);
        # greedy or --return-original-logprob: the raw distribution.
        if lp_V is None and (req.top_logprobs_num or req.token_ids_logprob is not None):
            t = 1.0 if (p.greedy or self.return_original_logprob) else p.temperature
            lp_V = torch.log_softmax(logits_V / t if t != 1.0 else logits_V, dim=-1)
        if lp_V is not None:
            lp = lp_V[tok]
        elif p.greedy or self.return_original_logprob:
            lp = torch.log_softmax(logits_V, dim=-1)[tok]
        else:
            lp = torch.log_softmax(logits_V / p.temperature, dim=-1)[tok]
        if req.top_logprobs_num:
            assert lp_V is not None  # computed above whenever asked
            req.output_top.append(_topk(lp_V, req.top_logprobs_num))
        if req.token_ids_logprob is not None:
            assert lp_V is not None
            req.output_ids_lp.append((lp_V[req.token_ids_logprob].tolist(), list(req.token_ids_logprob)))
        req.output_ids.append(tok)
        req.output_logprobs.append(float(lp))
        req.output_versions.append(self.weight_version if req.lora_name is None else self.lora.version_of(req.lora_name))
        finish = check_finish(p, req.output_ids, req.max_new_tokens, self.eos_token_ids, self.tokenizer)
        if finish is not None:
            self._finish(req, finish)

    @staticmethod
    def _sampling_probs(logits_V: torch.Tensor, p: SamplingParams) -> torch.Tensor:
        """``[V]`` the distribution the sampler draws from: temperature, then top-k, then
        top-p over the top-k-renormalised probabilities, then min-p; zeros outside it."""
        x = logits_V / p.temperature
        if p.top_k > 0 and p.top_k < x.numel():
            kth = torch.topk(x, p.top_k).values[-1]
            x = x.masked_fill(x < kth, float("-inf"))
        if p.top_p < 1.0:
            sorted_x, order = torch.sort(x, descending=True)
            probs = torch.softmax(sorted_x, dim=-1)
            drop = (torch.cumsum(probs, dim=-1) - probs) > p.top_p
            x = x.scatter(0, order, sorted_x.masked_fill(drop, float("-inf")))
        probs = torch.softmax(x, dim=-1)
        if p.min_p > 0:
            probs = probs.masked_fill(probs < p.min_p * probs.max(), 0.0)
        return probs

    def _record_mask(self, req: Req, tok: int, probs: torch.Tensor | None) -> bool:
        """Append SGLang's ``output_token_sampling_mask`` row (the support the sampler could
        pick from, ascending ids) and behaviour logprob for ``tok``. Greedy: ``[tok]`` and 0.0.
        A support over ``sampling_mask_max_tokens`` aborts the request, as SGLang does."""
        if probs is None:
            req.sampling_mask.append([tok])
            req.sampling_logprobs.append([0.0] if req.sampling_logprobs_mode == "support" else 0.0)
            return True
        support = torch.nonzero(probs > 0).flatten()
        if support.numel() > self.sampling_mask_max_tokens:
            self._finish(req, self._abort_reason(
                f"Sampling support exceeds --sampling-mask-max-tokens={self.sampling_mask_max_tokens}"
                f" ({support.numel()} tokens); lower top_k/top_p or raise the server limit.", 400))
            return False
        kept = probs[support]
        lps = torch.log(kept / kept.sum())
        req.sampling_mask.append(support.tolist())
        if req.sampling_logprobs_mode == "support":
            req.sampling_logprobs.append(lps.tolist())
        else:
            req.sampling_logprobs.append(float(lps[(support == tok).nonzero()[0, 0]]))
        return True

    # ------------------------------------------------------------------ results
    @staticmethod
    def _abort_reason(message: str, status_code: int | None = None) -> dict:
        return {"type": "abort", "message": message, "status_code": status_code, "err_type": None}

    def _finish(self, req: Req, reason: dict) -> None:
        if req.finish is not None:
            return
        req.finish = reason
        if req.lora_name is not None:
            self.lora.release(req.lora_name)
        if not req.future.done():
            req.future.set_result(self.response(req))

    def response(self, req: Req) -> dict:
        """SGLang's ``/generate`` response for one finished request (:mod:`.response`)."""
        return build_response(req, weight_version=self.weight_version, num_layers=self.capture.num_layers,
                              top_k=self.top_k, tokenizer=self.tokenizer)


def _topk(lp_V: torch.Tensor, k: int) -> tuple[list[float], list[int]]:
    """The ``k`` best ``(logprobs, token ids)`` of a logprob row, best first."""
    v, i = torch.topk(lp_V, min(k, lp_V.numel()))
    return v.tolist(), i.tolist()
