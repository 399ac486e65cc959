"""The buffer's contents in the whole-run checkpoint, end to end (issue 19): a fully_async run
(K=1) saves at step 2 with groups buffered (generated ahead under version 1 or 2); the run
resumed from it puts them back (stale ones at the loaded version dropped, reason ``stale``),
trains the oldest fresh ones in its first step (their rewards and per-token staleness are that
batch's) and never draws them again (``rollout/skipped_restored``; the draw ledger refuses a
draw settled twice): over both runs every prompt is trained once, dropped with a reason, or
pending."""

from __future__ import annotations

import json
from collections import Counter

from tests.orchestration.test_resume import _train


def test_restored_buffered_groups_are_trained_after_resume_not_redrawn(tmp_path) -> None:
    ckpt = tmp_path / "ckpt"
    _train(tmp_path / "a", "num_steps=2", "trainer.save_interval=2", f"trainer.save_dir={ckpt}",
           "async.mode=fully_async", "async.max_staleness=1")
    extra = json.loads((ckpt / "step_2" / "moe_async_state.json").read_text())["extra"]
    snap, rs = extra["buffer"], extra["run_state"]
    groups = snap["groups"]
    assert groups, f"the checkpoint's buffer held no group (generation did not run ahead): {snap['counters']}"
    assert snap["counters"]["buffered_groups"] == len(groups)
    seqs = [g["samples"][0]["metadata"]["draw_seq"] for g in groups]
    assert all(s >= rs["frontier"] and str(s) not in rs["settled"] for s in seqs)  # pending in the ledger
    stale = [g for g in groups if 2 - min(v for s in g["samples"] for v in s["weight_versions"]) > 1]
    fresh = [g for g in groups if g not in stale]
    assert fresh, groups  # at K=1 a group generated under version >= 1 is fresh at version 2

    s2, steps2 = _train(tmp_path / "b", "num_steps=3", f"trainer.load={ckpt}", f"trainer.save_dir={tmp_path / 'c2'}",
                        "async.mode=fully_async", "async.max_staleness=1")
    assert s2["start_step"] == 2 and [m["step"] for m in steps2] == [3]
    assert s2["buffer_restored"] == {"restored": len(groups), "dropped_stale": len(stale)}
    # step 3's batch (B=2, FIFO) begins with the restored fresh groups: their tokens are the only
    # ones at staleness >= 1 (the resumed engines generate at the loaded version 2)
    first = fresh[:2]
    want = Counter(2 - v for g in first for s in g["samples"] for v in s["weight_versions"])
    got = {int(k.rsplit("/", 1)[1]): v for k, v in steps2[0].items() if k.startswith("buffer/staleness_hist/")}
    assert {k: v for k, v in got.items() if k >= 1} == {k: float(v) for k, v in want.items() if k >= 1}
    if len(first) == 2:  # the whole batch restored: its rewards are the saved ones
        rewards = [s["reward"] for g in first for s in g["samples"]]
        assert steps2[0]["rollout/reward_mean"] == sum(rewards) / len(rewards)
        assert got == {k: float(v) for k, v in want.items()}
    # not drawn again: each restored draw passed over by the resumed prompts at most once, and
    # the ledger (which refuses a second settle) counts 3 steps x 2 prompts trained, the stale ones dropped
    assert s2["rollout"].get("rollout/skipped_restored", 0.0) <= len(groups)
    d = s2["draws"]
    assert d["counts"]["trained"] == 3 * 2 and d["counts"].get("stale", 0) >= len(stale)
    for g in first:
        seq = g["samples"][0]["metadata"]["draw_seq"]
        assert seq < d["frontier"] or d["settled"].get(str(seq)) == "trained", (seq, d)
    acc = s2["accounting"]
    assert acc["balanced"] and acc["drawn"] >= len(groups), acc
