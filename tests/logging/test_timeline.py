"""The timeline: driver phases, the C27 split of the wait, engine requests in lanes."""

import json

from moe_async.logging.timeline import SpanRecorder, Timeline, chrome_trace


def test_chrome_trace_lanes_and_counter():
    spans = [("engine 0", "generate", 10.0, 12.0, None), ("engine 0", "generate", 11.0, 13.0, None),
             ("engine 0", "generate", 12.5, 14.0, None), ("reward", "reward", 13.0, 13.5, {"group": 1})]
    ev = chrome_trace(spans)["traceEvents"]
    gen = [e for e in ev if e.get("cat") == "generate"]
    assert [(e["ts"], e["dur"]) for e in gen] == [(0.0, 2e6), (1e6, 2e6), (2.5e6, 1.5e6)]
    assert gen[0]["tid"] == gen[2]["tid"] != gen[1]["tid"]  # the overlapping request has its own lane
    counts = [e["args"]["requests"] for e in ev if e["ph"] == "C"]
    assert counts == [1, 2, 1, 2, 1, 0]
    assert [e["args"] for e in ev if e.get("cat") == "reward"] == [{"group": 1}]


def test_timeline_phases_and_wait_split(tmp_path, monkeypatch):
    clock = iter([100.0, 103.0, 105.0, 105.5, 106.0])
    monkeypatch.setattr("moe_async.logging.timeline.time.time", lambda: next(clock))
    seen = []
    tl = Timeline(tmp_path / "trace.json", on_phase=seen.append)
    tl.phase("wait", 1)   # 100
    tl.phase("train", 1)  # 103
    tl.phase("sync", 1)   # 105
    rec = SpanRecorder()
    rec.add("engine 0", "generate", 100.5, 102.0)
    tl.end_step(1, straggler_s=1.0, spans=rec.drain())  # 105.5
    assert rec.drain() == []
    tl.write()  # 106
    ev = json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
    x = {e["name"]: (e["ts"], e["dur"]) for e in ev if e["ph"] == "X"}
    assert x == {"wait": (0.0, 3e6), "filling": (0.0, 2e6), "straggler": (2e6, 1e6), "train": (3e6, 2e6),
                 "sync": (5e6, 0.5e6), "generate": (0.5e6, 1.5e6)}
    assert seen == ["step 1: wait", "step 1: train", "step 1: sync"]


def test_recorder_is_bounded():
    rec = SpanRecorder(max_spans=2)
    for i in range(5):
        rec.add("reward", "reward", i, i + 1)
    assert len(rec.spans) == 2 and rec.dropped == 3
