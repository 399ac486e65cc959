"""A scripted engine speaking the rollout manager's engine protocol: each call replies with
the next scripted token ids, distinct logprobs, per-token versions and routes whose rows
name the call that produced them ([call id, row % 5] in every layer). Used to check a
trajectory token by token against what the engine "sampled"."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import numpy as np

L, K = 2, 2


class ScriptedEngine:
    """``script``: list of ``(ids, finish_reason, versions)`` per call. Records every call as
    ``(input_ids, output_ids, logprobs, versions)`` in ``self.calls``."""

    base_url = "scripted://engine"
    timeout_s = 30.0

    def __init__(self, script):
        self.script = list(script)
        self.calls: list[tuple[list[int], list[int], list[float], list[int]]] = []
        self._lp = 0

    async def generate(self, input_ids, sp, return_logprob=True, return_routed_experts=False):
        ids, reason, versions = self.script.pop(0)
        ids = list(ids)[: sp["max_new_tokens"]]
        versions = list(versions)[: len(ids)]
        lps = []
        for _ in ids:
            self._lp += 1
            lps.append(-0.001 * self._lp)
        c = len(self.calls) + 1
        rows = len(input_ids) + len(ids) - 1
        r = np.zeros((rows, L, K), dtype=np.int32)
        r[:, :, 0] = c
        r[:, :, 1] = (np.arange(rows) % 5)[:, None]
        self.calls.append((list(input_ids), ids, lps, versions))
        await asyncio.sleep(0)
        return SimpleNamespace(output_ids=ids, output_logprobs=lps, finish_reason=reason,
                               weight_version=versions[-1] if versions else 0,
                               output_token_weight_versions=versions,
                               routed_experts=r if return_routed_experts else None)
