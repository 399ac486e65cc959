"""Router replay in the Megatron-Core trainer, through Megatron's native ``RouterReplay``.

``trainer.router_replay``: ``off`` (routers choose; agreement with the engine's routes still
measured), ``R3`` (each MoE layer's top-k set to the engine's ``routed_experts``; gate weights
from the trainer's own scores, so the router keeps its gradient), ``R2`` (routes recorded by a
no-grad old-policy forward, then replayed).

Design notes: ``docs/design/replay.md``."""

from __future__ import annotations

from contextlib import contextmanager
from typing import TYPE_CHECKING, Callable, Iterator, Sequence

import numpy as np
import torch

from moe_async.replay.metrics import MismatchMeter
from moe_async.replay.routes import PAD, batch_routes, fill_padding, num_pad_rows, pack_rows
from moe_async.types import MicroBatch, Sample

if TYPE_CHECKING:
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.moe.router import TopKRouter

MODES = ("off", "R3", "R2")


def moe_layer_pattern(tf_config: TransformerConfig) -> list[int]:
    """1/0 per decoder layer from Megatron's ``moe_layer_freq`` (int or list)."""
    f, n = tf_config.moe_layer_freq, tf_config.num_layers
    if isinstance(f, int):
        return [1 if i % f == 0 else 0 for i in range(n)]
    return [int(x) for x in f]


def _measured_replay_class():
    from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

    class MeasuredRouterReplay(RouterReplay):
        """Megatron's ``RouterReplay`` that also counts, over real tokens, how often the
        router's OWN top-k set equals a reference (the engine's routes), and records per
        forward (a list, so several micro-batches can be recorded for R2)."""

        def __init__(self, moe_index: int):
            super().__init__()
            # Megatron keeps every instance in a process-global list for its static helpers;
            # this hook addresses its own routers, so do not leak into (or rely on) that list.
            RouterReplay.global_router_replay_instances.remove(self)
            self.moe_index = moe_index
            self.reference: torch.Tensor | None = None  # [N, K] long
            self.reference_real: torch.Tensor | None = None  # [N] bool
            self.agree = 0
            self.count = 0
            self.replayed = 0  # real tokens whose USED top-k set equals the reference (replay forwards)
            self.recorded: list[torch.Tensor] = []
            self.used: torch.Tensor | None = None  # top-k indices of the last forward

        def _measure(self, natural: torch.Tensor) -> None:
            if self.reference is None:
                return
            ref = self.reference.to(natural.device)
            if ref.shape != natural.shape:
                raise ValueError(f"MoE layer {self.moe_index}: reference routes {tuple(ref.shape)} vs router {tuple(natural.shape)}")
            same = (torch.sort(natural, -1).values == torch.sort(ref, -1).values).all(-1)
            assert self.reference_real is not None  # set together with reference
            real = self.reference_real.to(natural.device)
            self.agree += int((same & real).sum())
            self.count += int(real.sum())

        def get_replay_topk(self, scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
            act = self.router_replay_action
            if act is None or act == RouterReplayAction.RECORD:
                probs, idx = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
                self._measure(idx.detach())
                if act == RouterReplayAction.RECORD:
                    self.record_indices(idx.detach())
                    self.recorded.append(idx.detach())
            else:
                if act == RouterReplayAction.REPLAY_FORWARD and self.reference is not None:
                    with torch.no_grad():
                        _, nat = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
                    self._measure(nat)
                if self.target_topk_idx is not None and self.target_topk_idx.shape[0] != scores.shape[0]:
                    raise ValueError(
                        f"MoE layer {self.moe_index}: {self.target_topk_idx.shape[0]} replay rows for "
                        f"{scores.shape[0]} routed tokens"
                    )
                probs, idx = super().get_replay_topk(scores, topk, num_groups, group_topk, default_compute_topk)
                if act == RouterReplayAction.REPLAY_FORWARD and self.reference is not None:
                    ref = self.reference.to(idx.device)
                    same = (torch.sort(idx.detach(), -1).values == torch.sort(ref, -1).values).all(-1)
                    assert self.reference_real is not None  # set together with reference
                    self.replayed += int((same & self.reference_real.to(idx.device)).sum())
            self.used = idx.detach()
            return probs, idx

        def reset(self) -> None:
            self.clear_indices()
            self.clear_router_replay_action()
            self.reference = self.reference_real = None
            self.recorded = []

    return MeasuredRouterReplay, RouterReplayAction


class RouterReplayHook:
    """Drives Megatron's router replay for one model (design notes: ``docs/design/replay.md``).

    Args:
        model: the (unwrapped) Megatron model, or a ``torch.nn.ModuleList`` of model chunks in
            ``vp_stage`` order (virtual pipeline stages); its ``TopKRouter`` modules must have
            been built with ``moe_enable_routing_replay=True`` (see :func:`transformer_overrides`).
        tf_config: its ``TransformerConfig``.
        mode: ``off`` | ``R3`` | ``R2``.

    Use (trainer)::

        extras = hook.pack(samples_of_mb, S)            # MicroBatch fields (routes, masks)
        with hook.step(mbs, forward_fn) as h:            # forward_fn(mb) -> logits (R2 record)
            ... h.before_forward(mb, model); model(...)  # in forward_step (model: the chunk)
            ... h.add_logprobs(logp, mb)                 # in loss_func
        metrics = hook.metrics()
    """

    def __init__(self, model: torch.nn.Module, tf_config: TransformerConfig, mode: str = "off"):
        from megatron.core.transformer.moe.router import TopKRouter

        if mode not in MODES:
            raise ValueError(f"trainer.router_replay must be one of {MODES}, got {mode!r}")
        self.mode = mode
        self.config = tf_config
        self.num_experts = int(tf_config.num_moe_experts or 0)
        self.top_k = int(tf_config.moe_router_topk or 0)
        self.pattern = moe_layer_pattern(tf_config) if self.num_experts else []
        self.num_moe_layers = sum(self.pattern)
        cls, self._Action = _measured_replay_class()
        # model chunks (virtual pipeline stages) in vp_stage order; one chunk otherwise
        self._chunks: list[torch.nn.Module] = list(model) if isinstance(model, torch.nn.ModuleList) else [model]
        self.routers: list[TopKRouter] = []
        self._chunk_routers: list[list[TopKRouter]] = []
        for chunk in self._chunks:
            mine = []
            for mod in chunk.modules():
                if isinstance(mod, TopKRouter):
                    if mod.router_replay is None:
                        raise RuntimeError("TopKRouter built without moe_enable_routing_replay=True")
                    ln = mod.layer_number
                    if ln is None:
                        raise RuntimeError("TopKRouter has no layer_number")
                    idx = sum(self.pattern[: ln - 1])  # global MoE-layer index (dense layers skipped)
                    mod.router_replay = cls(idx)
                    mine.append(mod.router_replay)
            self._chunk_routers.append(mine)
            self.routers.extend(mine)
        self.routers.sort(key=lambda r: r.moe_index)
        if getattr(tf_config, "context_parallel_size", 1) > 1 and mode == "R2":
            # R3 runs: the trainer hands before_forward this CP rank's sequence chunks
            raise NotImplementedError("router replay R2 with context parallelism is not implemented")
        self._meter = MismatchMeter(self.num_moe_layers)
        self._strict = True
        self._r2: list[list[torch.Tensor]] = []
        self._reset_counters()

    def _reset_counters(self) -> None:
        """Per chunk: micro-batches seen in this pass, padding-route rotation offset [L]."""
        self._mb = [0] * len(self._chunks)
        self._pad_offset = [torch.zeros(self.num_moe_layers, dtype=torch.long) for _ in self._chunks]

    def _chunk_index(self, model: torch.nn.Module | None) -> int:
        """Index of the chunk ``model`` is (or wraps, e.g. Megatron's DDP: ``.module``)."""
        if model is None:
            if len(self._chunks) > 1:
                raise ValueError("router replay with virtual pipeline stages: before_forward needs the model chunk")
            return 0
        m: object = model  # a chunk, or a wrapper of one (``.module``)
        while True:
            for c, chunk in enumerate(self._chunks):
                if m is chunk:
                    return c
            if not hasattr(m, "module"):
                break
            m = m.module
        if len(self._chunks) == 1:
            return 0
        raise ValueError(f"router replay: {type(model).__name__} is none of the hook's {len(self._chunks)} model chunks")

    @property
    def enabled(self) -> bool:
        return bool(self.routers)

    # ------------------------------------------------------------------ batching
    def pack(self, samples: Sequence[Sample], S: int, packed_len: int | None = None) -> dict[str, torch.Tensor]:
        """This hook's :class:`~moe_async.trainer.micro_batches.MicroBatch` fields, by name: ``routes_BSLK`` long (-1 = none), ``routes_real_BS``
        bool (when any sample has routes), ``routes_missing_B`` bool (loss-bearing samples
        without routes: an error in an R3 train step) and ``rollout_lp_mask [B, S-1]``
        (response tokens with rollout logprobs and loss_weight > 0, for the mismatch
        metrics). ``packed_len`` T (packed THD micro-batch, ``trainer.sequence_packing='thd'``):
        the routes are given in the model's token order, ONE row ``[1, T, L, K]`` / ``[1, T]``
        with the samples back to back (:func:`routes.pack_rows`; the tail past their tokens
        -1 / False); ``rollout_lp_mask`` stays per sample (the loss side). Raises ValueError on
        a route length/shape mismatch."""
        B = len(samples)
        lp_mask = torch.zeros(B, S - 1)
        for b, s in enumerate(samples):
            P, R = len(s.prompt_ids), len(s.response_ids)
            if R and s.rollout_logprobs and s.loss_weight > 0:
                lp_mask[b, P - 1 : P - 1 + R] = torch.tensor(s.response_mask())  # sampled tokens only
        out = {"rollout_lp_mask": lp_mask}
        if not self.enabled:
            return out
        have = [s.routed_experts is not None for s in samples]
        out["routes_missing_B"] = torch.tensor(
            [not h and s.loss_weight > 0 and len(s.response_ids) > 0 for h, s in zip(have, samples)]
        )
        if any(have):
            routes, real = batch_routes(
                [s.routed_experts for s in samples],
                [len(s.prompt_ids) + len(s.response_ids) for s in samples],
                S,
                self.num_moe_layers,
                self.top_k,
            )
            if packed_len is not None:
                lens = [len(s.prompt_ids) + len(s.response_ids) for s in samples]
                routes, real = pack_rows(routes, lens, packed_len, PAD), pack_rows(real, lens, packed_len, False)
            out.update(routes_BSLK=routes, routes_real_BS=real)
        return out

    # ------------------------------------------------------------------ step
    def _token_rows(self, x_BS: torch.Tensor) -> torch.Tensor:
        """``[B, S, ...]`` -> this rank's router rows ``[S_local * B, ...]`` (s-major)."""
        x = x_BS.transpose(0, 1)  # [S, B, ...]
        if getattr(self.config, "sequence_parallel", False):
            from megatron.core import parallel_state as ps

            tp = ps.get_tensor_model_parallel_world_size()
            if tp > 1:
                if x.shape[0] % tp:
                    raise ValueError(f"sequence length {x.shape[0]} not divisible by TP {tp}")
                n = x.shape[0] // tp
                r = ps.get_tensor_model_parallel_rank()
                x = x[r * n : (r + 1) * n]
        return x.reshape(-1, *x.shape[2:])

    @contextmanager
    def step(
        self, mbs: Sequence[MicroBatch], forward_fn: Callable[[MicroBatch], object] | None = None
    ) -> Iterator["RouterReplayHook"]:
        """One pass of Megatron's schedule over ``mbs``. R2 with ``forward_fn``: first a
        no-grad ``forward_fn(mb)`` per micro-batch with ``RECORD``, replayed in the pass; R2
        without it (a forward-only old-policy pass, e.g. ``compute_logprobs``): the routers
        choose freely (that pass IS the old policy). Then the replay action of the mode is
        set; on exit every router's action, targets, references and recordings are cleared
        (also on error). Metrics are reset on entry."""
        self._meter.reset()
        for r in self.routers:
            r.agree = r.count = r.replayed = 0
        self._r2 = []
        self._reset_counters()
        try:
            self._strict = forward_fn is not None  # a train step: R3 routes are mandatory
            r2_replay = self.enabled and self.mode == "R2" and forward_fn is not None
            if r2_replay:
                assert forward_fn is not None
                if self.config.pipeline_model_parallel_size > 1:
                    raise NotImplementedError("R2 with pipeline parallelism is not implemented")
                for r in self.routers:
                    r.set_router_replay_action(self._Action.RECORD)
                with torch.no_grad():
                    for mb in mbs:
                        forward_fn(mb)
                self._r2 = [list(r.recorded) for r in self.routers]  # [router][mb] -> [N, K]
                for r in self.routers:
                    r.recorded = []
            if self.enabled:
                replay = self.mode == "R3" or r2_replay
                act = self._Action.REPLAY_FORWARD if replay else None
                for r in self.routers:
                    r.router_replay_action = act
            yield self
        finally:
            for r in self.routers:
                r.reset()

    def before_forward(self, mb: MicroBatch, model: torch.nn.Module | None = None) -> None:
        """Set this micro-batch's replay targets (R3/R2) and agreement references on the
        routers of ``model`` (the chunk about to run; may be DDP-wrapped; optional with one
        chunk). Raises ValueError for an unknown chunk, or (R3 train step) a loss-bearing
        sample without routes."""
        c = self._chunk_index(model)
        i = self._mb[c]
        self._mb[c] += 1
        if not self.enabled:
            return
        routers = self._chunk_routers[c]  # (none: a dense-only chunk; the checks below still run)
        routes = mb.routes_BSLK
        if routes is not None:
            rows = self._token_rows(routes)  # [N, L, K]
            assert mb.routes_real_BS is not None  # set with routes_BSLK
            real = self._token_rows(mb.routes_real_BS)  # [N]
            for r in routers:
                r.reference = rows[:, r.moe_index]
                r.reference_real = real
        else:
            for r in routers:
                r.reference = r.reference_real = None
        if self.mode == "R3":
            missing = mb.routes_missing_B
            if missing is not None and bool(missing.any()):
                if self._strict or routes is not None:
                    raise ValueError(
                        "trainer.router_replay='R3' needs routed experts on every sample "
                        f"(sample {int(missing.nonzero()[0, 0])} of micro-batch {i} has none; set "
                        "rollout.return_routed_experts)"
                    )
                for r in routers:  # forward-only pass over route-less samples: own routing
                    r.router_replay_action = None
                return
            for r in routers:
                r.router_replay_action = self._Action.REPLAY_FORWARD
            if routes is None:  # only route-less, loss-free samples: all rows are padding
                B, S = mb.tokens.shape
                routes = torch.full((B, S, self.num_moe_layers, self.top_k), -1, dtype=torch.long)
            rows = self._token_rows(routes)
            filled = fill_padding(rows, self.num_experts, self._pad_offset[c])
            self._pad_offset[c] = self._pad_offset[c] + num_pad_rows(rows)  # rotation continues across mbs
            for r in routers:
                r.set_target_indices(filled[:, r.moe_index].contiguous())
        elif self.mode == "R2" and self._r2:
            for j, r in enumerate(self.routers):
                if any(r is x for x in routers):
                    r.set_target_indices(self._r2[j][i])

    def add_logprobs(self, logp_BS1: torch.Tensor, mb: MicroBatch) -> None:
        """Accumulate the train/rollout mismatch of one micro-batch (in ``loss_func``)."""
        self._meter.add_logprobs(logp_BS1.detach(), mb.rollout_logp, mb.rollout_lp_mask)

    def metrics(self) -> dict[str, float]:
        """Mismatch metrics of the last step (see :class:`MismatchMeter`), over the whole
        global batch and every MoE layer, equal on every rank.

        Collective at world size > 1 (every rank calls it, e.g. at the end of ``train_step``):
        the per-rank sums are all-reduced over the world. Logprob sums come from the last
        PP stage's TP rank 0 (TP ranks hold the same gathered logits); agreement counts from
        every TP rank under sequence parallelism (each routes its own sequence chunk), else
        from TP rank 0; PP stages hold disjoint layers and DP replicas disjoint samples, so
        both are summed."""
        agree = [0] * self.num_moe_layers
        count = [0] * self.num_moe_layers
        replayed = [0] * self.num_moe_layers
        for r in self.routers:
            agree[r.moe_index] += r.agree
            count[r.moe_index] += r.count
            replayed[r.moe_index] += r.replayed
        self._reduce_world(agree, count, replayed)
        for j in range(self.num_moe_layers):
            self._meter.set_layer(j, agree[j], count[j])
        out = self._meter.result()
        if self.mode == "R3" and any(count):
            # R3: share of (real token, MoE layer) pairs whose experts were the replayed ones
            out["replay_agreement"] = sum(replayed) / sum(count)
        return out

    def _reduce_world(self, agree: list[int], count: list[int], replayed: list[int]) -> None:
        """In place: the meter's logprob sums and ``agree``/``count`` summed over the world
        (see :meth:`metrics`); no-op on 1 process."""
        import torch.distributed as dist

        if not dist.is_initialized() or dist.get_world_size() == 1:
            return
        from megatron.core import parallel_state as ps

        m = self._meter
        tp_rank = ps.get_tensor_model_parallel_rank()
        lp_owner = ps.is_pipeline_last_stage() and tp_rank == 0
        route_owner = tp_rank == 0 or bool(getattr(self.config, "sequence_parallel", False))
        lp = [m.n, m.absdiff, m.k3, m.gt2] if lp_owner else [0.0] * 4
        rt = [float(x) for x in agree + count + replayed] if route_owner else [0.0] * (3 * self.num_moe_layers)
        dev = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        t = torch.tensor(lp + rt, dtype=torch.float64, device=dev)
        dist.all_reduce(t)
        mx = torch.tensor([m.absmax if lp_owner else 0.0], dtype=torch.float64, device=dev)
        dist.all_reduce(mx, op=dist.ReduceOp.MAX)
        v = t.tolist()
        m.n, m.absdiff, m.k3, m.gt2 = v[:4]
        m.absmax = float(mx.item())
        L = self.num_moe_layers
        agree[:] = [int(round(x)) for x in v[4 : 4 + L]]
        count[:] = [int(round(x)) for x in v[4 + L : 4 + 2 * L]]
        replayed[:] = [int(round(x)) for x in v[4 + 2 * L :]]

    def used_routes(self) -> list[torch.Tensor | None]:
        """Top-k indices each local router used in its last forward (tests)."""
        return [r.used for r in self.routers]


def transformer_overrides(mode: str) -> dict[str, object]:
    """``TransformerConfig`` keyword overrides: the native replay hooks are always built
    (cost: one branch per router when idle) so agreement is measured in every mode."""
    if mode not in MODES:
        raise ValueError(f"trainer.router_replay must be one of {MODES}, got {mode!r}")
    return {"moe_enable_routing_replay": True}


def routes_to_numpy(idx: torch.Tensor, B: int, S: int) -> np.ndarray:
    """A router's ``[S*B, K]`` rows back to ``[B, S, K]`` (1 process, no SP)."""
    return idx.reshape(S, B, -1).transpose(0, 1).cpu().numpy()
