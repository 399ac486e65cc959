"""Routes carried through the rollout manager: partial rollouts concatenate the segments'
routes (each token keeps the routes it was generated under), stored compact."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import numpy as np
import pytest

from moe_async.rollout.config import RolloutConfig
from moe_async.rollout.manager import RolloutManager

L, K = 2, 2


class SegEngine:
    """Each call returns ``n`` tokens; route row t = [t % 7, segment id] in every layer."""

    def __init__(self, script):
        self.script = list(script)
        self.seg = 0

    async def generate(self, input_ids, sp, return_logprob=True, return_routed_experts=False):
        n, reason = self.script.pop(0)
        n = min(n, sp["max_new_tokens"])
        self.seg += 1
        rows = len(input_ids) + n - 1
        r = np.zeros((rows, L, K), dtype=np.int32)
        r[:, :, 0] = (np.arange(rows) % 7)[:, None]
        r[:, :, 1] = 7 + self.seg
        await asyncio.sleep(0)
        return SimpleNamespace(output_ids=[50 + k for k in range(n)], output_logprobs=[-1.0] * n,
                               finish_reason=reason, weight_version=self.seg,
                               output_token_weight_versions=[self.seg] * n,
                               routed_experts=r if return_routed_experts else None)


class _Buf:
    admit_waits = False

    async def cancel(self, reason: str = "") -> None:  # unused here
        pass


def _gen(script, partial=True, routes=True, max_new=9, P=4):
    cfg = RolloutConfig(return_routed_experts=routes, partial_rollout=partial)
    m = RolloutManager(cfg, None, [SegEngine(script)], _Buf(), None)
    return asyncio.run(m._generate_sample([5] * P, max_new))


def test_partial_rollout_routes_concatenated():
    P = 4
    s = _gen([(3, "abort"), (0, "abort"), (2, "abort"), (4, "stop")], P=P)
    T = P + len(s.response_ids)
    assert len(s.response_ids) == 9
    assert s.routed_experts.shape == (T - 1, L, K) and s.routed_experts.dtype == np.uint8
    seg = s.routed_experts[:, 0, 1] - 7
    # rows fed in segment 1: 0..P+1; seg 2 produced nothing but re-fed row P+2; seg 3 then owns it
    assert seg.tolist() == [1] * (P + 2) + [3] * 2 + [4] * 4
    np.testing.assert_array_equal(s.routed_experts[:, 0, 0], np.arange(T - 1) % 7)


def test_restart_without_partial_and_no_routes_when_off():
    s = _gen([(3, "abort"), (5, "stop")], partial=False)
    assert s.routed_experts.shape == (4 + 5 - 1, L, K)
    assert set((s.routed_experts[:, 0, 1] - 7).tolist()) == {2}
    assert _gen([(5, "stop")], routes=False).routed_experts is None


def test_engine_row_mismatch_raises():
    class Bad(SegEngine):
        async def generate(self, *a, **k):
            out = await super().generate(*a, **k)
            out.routed_experts = out.routed_experts[:-1]
            return out

    cfg = RolloutConfig(return_routed_experts=True)
    m = RolloutManager(cfg, None, [Bad([(3, "stop")])], _Buf(), None)
    with pytest.raises(ValueError, match="expected exactly"):
        asyncio.run(m._generate_sample([5] * 4, 5))
