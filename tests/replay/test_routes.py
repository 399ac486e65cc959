"""Routed-expert storage, alignment, segment joining and padding (C9); numpy/torch only."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from moe_async.replay.metrics import MismatchMeter
from moe_async.replay.routes import (
    batch_routes,
    compact_routes,
    engine_routes,
    fill_padding,
    join_segments,
    route_bytes_per_token,
    select_moe_layers,
    storage_dtype,
    truncate_routes,
)


def _routes(n, L, K, E, seed):
    g = np.random.default_rng(seed)
    return np.stack([np.stack([g.choice(E, K, replace=False) for _ in range(L)]) for _ in range(n)]).astype(np.int32)


def test_c9_padding_and_real_tokens():
    # sequences of 5 and 3 tokens padded to 5, 4 experts, top-2, one MoE layer
    E, K, L, S = 4, 2, 1, 5
    a, b = _routes(4, L, K, E, 0), _routes(2, L, K, E, 1)  # engine: tokens - 1 rows
    r, real = batch_routes([compact_routes(a, E), compact_routes(b, E)], [5, 3], S, L, K)
    assert r.shape == (2, S, L, K)
    assert real.tolist() == [[1, 1, 1, 1, 0], [1, 1, 0, 0, 0]]
    assert (r[~real] == -1).all()  # pad routes -1 before filling
    f = fill_padding(r, E)
    # real tokens keep exactly the recorded experts
    assert torch.equal(f[0, :4], torch.from_numpy(a).long())
    assert torch.equal(f[1, :2], torch.from_numpy(b).long())
    pads = f[~real]  # [4, L, K]
    assert ((pads >= 0) & (pads < E)).all()
    assert all(len(set(row.tolist())) == K for row in pads.reshape(-1, K))  # distinct per row
    counts = torch.bincount(pads.reshape(-1), minlength=E)
    assert counts.max() - counts.min() <= 1  # spread evenly: no expert flooded
    assert counts.sum() == 4 * K


def test_fill_padding_spread_many_rows_and_layers():
    E, K, L = 8, 3, 2
    r = torch.full((37, L, K), -1, dtype=torch.long)
    r[::5] = torch.from_numpy(_routes(len(range(0, 37, 5)), L, K, E, 2)).long()
    f = fill_padding(r, E)
    pad = (r == -1).all(-1)
    for l in range(L):
        c = torch.bincount(f[:, l][pad[:, l]].reshape(-1), minlength=E)
        assert c.max() - c.min() <= 1
    assert torch.equal(f[~pad], r[~pad])
    # EP=4 ranks of 2 experts each: per-rank counts also within 1 row-slot of each other
    rank = torch.bincount((f[:, 0][pad[:, 0]] // 2).reshape(-1), minlength=4)
    assert rank.max() - rank.min() <= 1


def test_fill_padding_rejects_partial_rows_and_bad_ids():
    r = torch.tensor([[[0, -1]]])
    with pytest.raises(ValueError, match="partly"):
        fill_padding(r, 4)
    with pytest.raises(ValueError, match="outside"):
        fill_padding(torch.tensor([[[0, 4]]]), 4)


def test_engine_offset_exact():
    L, K, E = 2, 2, 4
    ok = _routes(6, L, K, E, 3)  # 7-token sequence: 6 rows
    st = engine_routes(ok, 7, num_experts=E)
    assert st.shape == (6, L, K) and st.dtype == np.uint8
    np.testing.assert_array_equal(st, ok)
    for bad in (5, 7, 8):  # anything but tokens - 1 is an error
        with pytest.raises(ValueError, match="expected exactly 6"):
            engine_routes(_routes(bad, L, K, E, 4), 7, num_experts=E)
    with pytest.raises(ValueError, match="expected exactly"):
        batch_routes([compact_routes(ok, E)], [6], 8, L, K)  # sample says 6 tokens
    with pytest.raises(ValueError, match="MoE layers"):
        batch_routes([compact_routes(ok, E)], [7], 8, 3, K)


def test_dense_layers_skipped():
    # 3 decoder layers, the first dense (first-k-dense); engine may give 2 (MoE) or 3 columns
    pattern = [0, 1, 1]
    full = _routes(4, 3, 2, 4, 5)
    np.testing.assert_array_equal(select_moe_layers(full, pattern), full[:, 1:])
    np.testing.assert_array_equal(select_moe_layers(full[:, 1:], pattern), full[:, 1:])
    with pytest.raises(ValueError):
        select_moe_layers(full[:, :1], pattern)
    assert engine_routes(full, 5, num_experts=4, moe_layer_pattern=pattern).shape == (4, 2, 2)


def test_storage_bytes_per_token():
    assert storage_dtype(256) == np.uint8 and storage_dtype(257) == np.int16
    L, K = 48, 8  # Qwen3-30B-A3B: 48 MoE layers, 128 experts, top-8
    r = compact_routes(np.random.default_rng(0).integers(0, 128, (100, L, K)), 128)
    assert route_bytes_per_token(r) <= L * K
    r16 = compact_routes(np.random.default_rng(0).integers(0, 300, (10, 2, 2)), 300)
    assert r16.dtype == np.int16 and int(r16.max()) < 300
    with pytest.raises(ValueError, match="out of range"):
        compact_routes(np.array([[[4]]]), 4)


def test_join_segments_partial_rollout():
    L, K, E = 2, 2, 8
    P = 4
    # segment 1: input P tokens, 3 generated (aborted) -> P+3-1 rows
    s1 = _routes(P + 3 - 1, L, K, E, 6)
    # segment 2: input P+3 tokens (re-prefilled under new weights), 2 more -> P+5-1 rows
    s2 = _routes(P + 5 - 1, L, K, E, 7)
    j = join_segments(None, P, s1, P + 3)
    j = join_segments(compact_routes(j, E), P + 3, s2, P + 5)
    assert j.shape == (P + 5 - 1, L, K) and j.dtype == np.uint8
    np.testing.assert_array_equal(j[: P + 2], s1[: P + 2])  # tokens fed during segment 1
    np.testing.assert_array_equal(j[P + 2 :], s2[P + 2 :])  # last kept token on: segment 2
    with pytest.raises(ValueError):
        join_segments(s1, P + 3, s2[:-1], P + 5)
    np.testing.assert_array_equal(truncate_routes(j, P + 2), j[: P + 1])


def test_mismatch_meter():
    m = MismatchMeter(2)
    lp = torch.tensor([[-1.0, -2.0, -3.0]])
    rl = torch.tensor([[-1.0, -2.0 - np.log(3), -3.5]])
    m.add_logprobs(lp, rl, torch.tensor([[1.0, 1.0, 0.0]]))
    m.set_layer(0, 3, 4)
    m.set_layer(1, 1, 4)
    out = m.result()
    assert out["mismatch_logp_absdiff_mean"] == pytest.approx(np.log(3) / 2)
    assert out["mismatch_logp_absdiff_max"] == pytest.approx(np.log(3))
    assert out["mismatch_kl_k3"] == pytest.approx((3 - 1 - np.log(3)) / 2)
    assert out["mismatch_ratio_gt2_frac"] == pytest.approx(0.5)
    assert out["routing_agreement_l0"] == 0.75 and out["routing_agreement"] == 0.5


def test_config_cross_check_r3_routes():
    from moe_async.config import ConfigError, load_config

    assert load_config(None).rollout.return_routed_experts is False
    assert load_config(None, ["trainer.router_replay=R3"]).rollout.return_routed_experts is True
    assert load_config(None, ["trainer.router_replay=R2"]).rollout.return_routed_experts is True
    with pytest.raises(ConfigError, match="rollout.return_routed_experts must be true"):
        load_config(None, ["trainer.router_replay=R3", "rollout.return_routed_experts=false"])
    with pytest.raises(ConfigError, match="router_replay"):
        load_config(None, ["trainer.router_replay=R4"])
