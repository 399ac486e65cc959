"""The embedded engine's model forward pieces: routing capture, the split LM head, the KV cache.

:class:`RoutingCapture` records each MoE router's top-k expert ids (``[tokens, L, K]`` int32)
for ``return_routed_experts``; :class:`LogitsHead` runs the decoder then ``lm_head`` for the
rows asked for only (bit-identical to the plain forward); :func:`cache_kv` and
:func:`left_pad` read and pad a full-attention cache's ``[B, heads, T, D]`` tensors.

Design notes: ``docs/design/engines.md``."""

from __future__ import annotations

import re
from typing import Any, cast

import numpy as np
import torch
import torch.nn.functional as F
from transformers import DynamicCache


class RoutingCapture:
    """Forward hooks on every MoE router that record its top-k expert ids.

    Works for transformers' ``*TopKRouter`` modules (output ``(logits, scores, indices)``)
    and for plain routers returning logits (top-k taken here).
    """

    _NAME = re.compile(r"(?:^|\.)layers\.(\d+)\.mlp\.gate$")

    def __init__(self, model: torch.nn.Module, top_k: int):
        self.top_k = top_k
        modules = dict(model.named_modules())
        found = []
        for name, mod in modules.items():
            m = self._NAME.search(name)
            parent = modules.get(name.rsplit(".", 1)[0])
            if m and parent is not None and hasattr(parent, "experts"):
                found.append((int(m.group(1)), mod))
        found.sort(key=lambda x: x[0])
        self.num_layers = len(found)
        self.enabled = True  # off while no request in the forward asked for routed experts
        self._buf: list[torch.Tensor | None] = [None] * self.num_layers
        for slot, (_, mod) in enumerate(found):
            mod.register_forward_hook(self._make_hook(slot))

    def _make_hook(self, slot: int):
        def hook(_mod, _inp, out):
            if not self.enabled:
                return
            if isinstance(out, tuple) and len(out) == 3:
                idx = out[2]
            else:
                logits = out[0] if isinstance(out, tuple) else out
                idx = torch.topk(logits, self.top_k, dim=-1).indices
            self._buf[slot] = idx.detach().reshape(-1, idx.shape[-1]).to(torch.int32)

        return hook

    def take(self, num_tokens: int) -> np.ndarray:
        """``[num_tokens, L, K]`` int32 routing of the last forward (tokens in b, s order)."""
        if self.num_layers == 0:
            return np.zeros((num_tokens, 0, self.top_k), dtype=np.int32)
        out = torch.stack(cast("list[torch.Tensor]", self._buf), dim=1).cpu().numpy()  # [N, L, K]
        self._buf = [None] * self.num_layers
        return out


class LogitsHead:
    """The model's forward split in two: the decoder (``model.model``) then ``lm_head``,
    with logits only for the rows asked for.

    On a CPU the LM head of a small model is most of a decode step (SmolLM2: a 49k x 576 fp32
    matrix read once per step, memory bound). ``x @ W^T`` with a cached contiguous copy of
    ``W^T`` streams that matrix faster than ``F.linear(x, W)`` does. It is used for a row
    count only once it was checked bit-identical to ``F.linear`` for that count (so logits,
    hence greedy tokens and logprobs, are unchanged); otherwise ``F.linear`` is used. The
    copy is rebuilt after :meth:`invalidate` (the scheduler calls it after every control
    command, weight updates included) or when the weight tensor changes identity.

    Families whose causal-LM forward is not exactly ``lm_head(model(...))`` use the plain
    ``model(...)`` call (``enabled`` False).
    """

    _FAMILIES = {"mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "glm4_moe"}

    def __init__(self, model: torch.nn.Module):
        self.model = model
        cfg = model.config
        get_head = getattr(model, "get_output_embeddings", None)
        head = get_head() if callable(get_head) else None
        self.base: Any = getattr(model, "model", None)
        self.head: Any = head
        self.enabled = (
            getattr(cfg, "model_type", "") in self._FAMILIES
            and isinstance(head, torch.nn.Linear) and head.bias is None
            and isinstance(self.base, torch.nn.Module)
            and not getattr(cfg, "final_logit_softcapping", None)
            and getattr(cfg, "logit_scale", None) in (None, 1, 1.0)
        )
        self._wt: torch.Tensor | None = None
        self._key: tuple | None = None
        self._exact: dict[int, bool] = {}  # rows -> x @ W^T bit-identical to F.linear

    def invalidate(self) -> None:
        self._wt, self._key = None, None

    def hidden(self, **kw) -> torch.Tensor:
        """``[B, S, H]`` last hidden states (``kw``: the decoder's forward arguments)."""
        return self.base(**kw).last_hidden_state

    def project(self, h_NH: torch.Tensor) -> torch.Tensor:
        """``[N, V]`` logits of ``[N, H]`` hidden states."""
        w = self.head.weight
        key = (w.data_ptr(), tuple(w.shape), w.dtype)
        wt = self._wt
        if key != self._key or wt is None:
            wt = self._wt = w.detach().t().contiguous()
            self._key = key
        h_NH = h_NH.contiguous()
        n = h_NH.shape[0]
        ok = self._exact.get(n)
        if ok is None:
            ref = F.linear(h_NH, w)
            self._exact[n] = bool(torch.equal(ref, h_NH @ wt))
            return ref
        return h_NH @ wt if ok else F.linear(h_NH, w)


def cache_kv(cache: DynamicCache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``[(keys, values)]`` per layer of a filled full-attention cache (``[B, heads, T, D]``)."""
    return [(cast(Any, layer).keys, cast(Any, layer).values) for layer in cache.layers]


def left_pad(x: torch.Tensor, n: int) -> torch.Tensor:
    """Prepend ``n`` zero columns on the sequence dim of a ``[B, H, T, D]`` tensor."""
    if n == 0:
        return x
    return F.pad(x, (0, 0, n, 0))
