"""tools/simulate.py: the discrete-event model of the pipeline.

Exact timings where the model has a closed form (sync step = generation + train), the
pipeline limit of overlapped stages (async step -> max(gen, train)), K=0 async == sync, the
staleness bound and sample conservation on long-tailed, abort-ridden runs, and calibration
recovering known parameters from a run directory written in the driver's metric names.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("moe_simulate", ROOT / "tools" / "simulate.py")
sim = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = sim  # dataclasses look their module up while building SimConfig
_spec.loader.exec_module(sim)


def exact(**kw) -> "sim.SimConfig":
    """Deterministic lengths, no polling quantisation, no overheads."""
    base = dict(mode="sync", num_steps=6, groups_per_step=2, samples_per_group=4, max_concurrent_groups=2,
                num_engines=1, max_running_requests=64, decode_step_s=0.01, decode_step_per_seq_s=0.0,
                prefill_s=0.0, prefill_per_token_s=0.0, prompt_tokens=10, lengths="fixed", length_mean=20,
                max_new_tokens=20, train_fixed_s=0.5, sync_fixed_s=0.0, admit_poll_s=0.0, batch_poll_s=0.0)
    base.update(kw)
    return sim.SimConfig(**base)


@pytest.mark.parametrize("engines,d1,prefill,ptok", [(1, 0.0, 0.0, 0.0), (1, 1e-3, 0.03, 1e-4), (2, 5e-4, 0.02, 0.0)])
def test_sync_step_is_generation_plus_train_exactly(engines, d1, prefill, ptok):
    c = exact(num_engines=engines, decode_step_per_seq_s=d1, prefill_s=prefill, prefill_per_token_s=ptok,
              train_per_token_s=1e-3)
    r = sim.simulate(c)
    b = c.groups_per_step * c.samples_per_group // engines  # requests per engine, all at once
    L = int(c.length_mean)
    gen = prefill + ptok * b * c.prompt_tokens + (L - 1) * (c.decode_step_s + d1 * b)
    train = c.train_fixed_s + 1e-3 * c.groups_per_step * c.samples_per_group * (L + c.prompt_tokens)
    for s in r["step_seconds"]:
        assert s == pytest.approx(gen + train, rel=1e-9, abs=1e-12)
    assert r["wait_seconds"][0] == pytest.approx(gen, rel=1e-9)
    assert r["trainer_idle_frac"] == pytest.approx(gen / (gen + train), rel=1e-9)
    # engines: client view busy exactly during generation
    assert r["engine_idle_frac"] == pytest.approx(train / (gen + train), rel=1e-9)
    assert r["staleness_hist_tokens"] == {0: c.num_steps * c.groups_per_step * c.samples_per_group * L}


def test_sync_step_adds_sync_time_and_group_overhead():
    c = exact(sync_fixed_s=0.2, sync_bytes=3e9, sync_gbps=10.0, group_overhead_s=0.07, step_overhead_s=0.01)
    r = sim.simulate(c)
    gen = 19 * 0.01 + 0.07
    sync_s = 0.2 + 0.3
    assert r["step_seconds"][0] == pytest.approx(gen + 0.5 + sync_s, rel=1e-9)
    ends = r["step_end_seconds"]
    for a, b in zip(ends, ends[1:]):  # the driver's bookkeeping overlaps the next generation
        assert b - a == pytest.approx(gen + 0.5 + sync_s, rel=1e-9)
    for s in r["step_seconds"][1:]:
        assert s == pytest.approx(gen + 0.5 + sync_s - 0.01, rel=1e-9)
    assert r["sync_seconds"] == pytest.approx([sync_s] * c.num_steps)


@pytest.mark.parametrize("gen_s,train_s", [(1.0, 1.0), (0.6, 1.0), (1.0, 0.4)])
def test_async_pipelines_to_the_slower_stage(gen_s, train_s):
    # one batch occupies the engine (max_running = B*G); the next starts when it ends
    L = 11
    # (in_place: an abort's re-prefill would yield a token, here at prefill_s = 0, for free)
    c = exact(mode="fully_async", max_staleness=2, num_steps=30, decode_step_s=gen_s / (L - 1),
              length_mean=L, max_new_tokens=L, max_running_requests=8, train_fixed_s=train_s,
              pause_mode="in_place")
    r = sim.simulate(c)
    s = sim.simulate(dataclasses.replace(c, mode="sync"))
    assert s["step_s_steady"] == pytest.approx(gen_s + train_s, rel=1e-9)
    assert r["step_s_steady"] == pytest.approx(max(gen_s, train_s), rel=1e-6)
    assert r["samples_per_s"] / s["samples_per_s"] == pytest.approx(
        (gen_s + train_s) / max(gen_s, train_s), rel=0.05)  # loop time includes the pipeline fill


def test_async_with_k0_is_sync():
    c = dataclasses.replace(sim.cluster_scenario(), num_steps=5, groups_per_step=8, num_engines=2)
    a = sim.simulate(dataclasses.replace(c, mode="fully_async", max_staleness=0))
    s = sim.simulate(dataclasses.replace(c, mode="sync"))
    a.pop("mode")
    s.pop("mode")
    assert a == s


def _long_tail(**kw):
    base = dict(mode="fully_async", max_staleness=2, num_steps=25, groups_per_step=4, samples_per_group=4,
                max_concurrent_groups=8, num_engines=2, max_running_requests=8, decode_step_s=0.01,
                decode_step_per_seq_s=1e-3, prefill_s=0.02, prefill_per_token_s=1e-5, prompt_tokens=32,
                lengths="lognormal", length_mean=60, length_sigma=1.2, max_new_tokens=1000,
                train_fixed_s=0.3, sync_fixed_s=0.05, group_overhead_s=0.01, seed=3)
    base.update(kw)
    return sim.SimConfig(**base)


@pytest.mark.parametrize("mode,k,pause,partial,interval", [
    ("sync", 0, "abort", True, 1), ("one_step_off", 1, "abort", True, 1), ("fully_async", 2, "abort", True, 1),
    ("fully_async", 3, "in_place", True, 2), ("fully_async", 1, "abort", False, 1),
    ("fully_async", 2, "retract", True, 1)])
def test_staleness_bound_and_sample_conservation(mode, k, pause, partial, interval):
    c = _long_tail(mode=mode, max_staleness=k, pause_mode=pause, partial_rollout=partial, sync_interval=interval)
    r = sim.simulate(c)
    assert max(r["staleness_hist_tokens"]) <= c.K
    assert max(r["staleness_hist_samples"]) <= c.K
    b = r["buffer"]
    assert b["samples_generated"] == b["samples_trained"] + b["samples_dropped"] + b["samples_buffered"]
    assert b["samples_trained"] == c.num_steps * c.groups_per_step * c.samples_per_group
    assert sum(r["staleness_hist_samples"].values()) == b["samples_trained"]
    assert sum(r["staleness_hist_tokens"].values()) == sum(r["batch_tokens"])
    # every admitted group is accounted for once: put into the buffer, cancelled, or generating
    assert b["samples_generated"] == b["groups_put"] * c.samples_per_group
    assert b["in_flight"] == r["samples_in_flight"] // c.samples_per_group
    if c.K > 0:
        assert r["aborts"] > 0 if pause in ("abort",) else r["aborts"] == 0


def test_long_tail_drops_stale_groups_and_biases_lengths():
    c = _long_tail(max_staleness=1, num_steps=40)
    r = sim.simulate(c)
    s = sim.simulate(dataclasses.replace(c, mode="sync"))
    assert r["drop_reasons"].get("stale", 0) == r["buffer"]["groups_dropped"] > 0
    assert s["buffer"]["samples_dropped"] == 0
    assert r["mean_response_len"] < s["mean_response_len"]  # long samples miss the bound


def test_console_table_has_the_stale_dropped_column(tmp_path):
    """The console table shows what --json has: drop_reasons['stale'] (groups) and the stale
    share of the generated samples; measured rows read the driver's buffer/dropped/stale."""
    c = _long_tail(max_staleness=1, num_steps=40)
    r, s = sim.simulate(c), sim.simulate(dataclasses.replace(c, mode="sync"))
    groups = r["drop_reasons"]["stale"]
    assert groups == r["buffer"]["groups_dropped"] > 0
    pct = 100 * r["buffer"]["samples_dropped"] / r["buffer"]["samples_generated"]
    m = {**r, "stale_dropped_groups": 7}
    del m["drop_reasons"], m["buffer"]  # a measured row: the count only
    lines = sim._table([("sync", s), ("fully_async", r), ("measured", m), ("bench", {**m, "stale_dropped_groups": None})]).splitlines()
    end = lines[0].index("stale_dropped") + len("stale_dropped")
    cells = [ln[end - 13:end].strip() for ln in lines[1:]]
    assert cells == ["0 (0%)", f"{groups} ({pct:.0f}%)", "7", "-"]
    # a run directory: the last step's cumulative buffer/dropped/stale
    _write_run(tmp_path / "run", c, r)
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    last = json.loads(lines[-1])
    last["buffer/dropped/stale"] = float(groups)
    (tmp_path / "run" / "metrics.jsonl").write_text("\n".join([*lines[:-1], json.dumps(last)]) + "\n")
    assert sim.measured(tmp_path / "run")["stale_dropped_groups"] == groups


def test_pause_modes_token_versions():
    c = _long_tail(max_staleness=2, sync_fixed_s=0.2)
    lost = sim.simulate(dataclasses.replace(c, pause_mode="abort", partial_rollout=False))
    kept = sim.simulate(dataclasses.replace(c, pause_mode="abort", partial_rollout=True))
    frozen = sim.simulate(dataclasses.replace(c, pause_mode="in_place"))
    assert lost["mixed_version_samples"] == 0 and lost["abort_discarded_tokens"] > 0
    assert kept["mixed_version_samples"] > 0 and kept["abort_discarded_tokens"] == 0
    assert frozen["mixed_version_samples"] > 0 and frozen["aborts"] == 0


def test_same_lengths_for_every_mode():
    c = _long_tail(num_steps=3)
    a, b = sim.Simulation(c), sim.Simulation(dataclasses.replace(c, mode="sync"))
    assert [a._length(i) for i in range(200)] == [b._length(i) for i in range(200)]
    assert max(a._lengths) <= c.max_new_tokens and min(a._lengths) >= 1


def test_buffer_is_the_pipeline_buffer():
    from moe_async.buffer.buffer import RolloutBuffer

    s = sim.Simulation(_long_tail(num_steps=2))
    assert type(s.buf) is RolloutBuffer and s.buf.K == 2 and s.buf.B == 4


@pytest.mark.parametrize("field,value", [("mode", "async"), ("pause_mode", "retreat"), ("groups_per_step", 0),
                                         ("decode_step_s", -1.0), ("lengths", "empirical"),
                                         ("train_fixed_s", math.inf)])
def test_bad_config_names_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        sim.SimConfig(**{field: value})


def test_staleness_below_sync_interval_refused():
    with pytest.raises(ValueError, match="sync_interval"):
        sim.SimConfig(mode="one_step_off", sync_interval=3)


# --------------------------------------------------------------------- calibration
def _write_run(d: Path, c: "sim.SimConfig", r: dict) -> None:
    """A run directory as moe_async.orchestration.driver writes it, from a simulated run."""
    import yaml

    d.mkdir(parents=True)
    cfg = {"rollout": {"prompts_per_step": c.groups_per_step, "n_samples_per_prompt": c.samples_per_group,
                       "max_concurrent_groups": c.max_concurrent_groups, "max_new_tokens": c.max_new_tokens,
                       "partial_rollout": c.partial_rollout, "admit_poll_s": c.admit_poll_s},
           "engine": {"num_engines": c.num_engines, "max_running_requests": c.max_running_requests,
                      "pause_mode": c.pause_mode},
           "weight_sync": {"interval_steps": c.sync_interval},
           "async": {"mode": c.mode, "max_staleness": c.K}}
    (d / "config.yaml").write_text(yaml.safe_dump(cfg))
    lines, idle, busy, tok, n = [], 0.0, 0.0, 0.0, 0.0
    for i in range(r["steps"]):
        el = r["step_end_seconds"][i]  # the driver's elapsed: loop start to after the sync
        idle += r["wait_seconds"][i]
        busy += r["engine_busy_seconds"][i]
        tok += r["batch_tokens"][i]
        n += r["batch_samples"][i]
        lines.append(json.dumps({
            "step": i + 1, "train/step_time_s": r["train_seconds"][i], "train/samples": r["batch_samples"][i],
            "train/response_tokens": r["batch_tokens"][i], "sync/seconds": r["sync_seconds"][i],
            "sync/pause_seconds": r["sync_seconds"][i], "perf/step_seconds": r["step_seconds"][i],
            "perf/tokens_per_s": tok / el, "perf/samples_per_s": n / el, "perf/trainer_idle_frac": idle / el,
            "perf/engine_idle_frac": 1 - busy / el, "rollout/response_len_mean": r["batch_tokens"][i] / r["batch_samples"][i]}))
    (d / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    (d / "summary.json").write_text(json.dumps({"perf": {"perf/samples_per_s": r["samples_per_s"],
                                                         "perf/trainer_idle_frac": r["trainer_idle_frac"],
                                                         "perf/engine_idle_frac": r["engine_idle_frac"],
                                                         "loop_seconds": r["loop_seconds"]}}))


@pytest.mark.parametrize("polled", [False, True])
def test_calibration_recovers_a_known_pipeline(tmp_path, polled):
    poll = 0.05 if polled else 0.0  # the buffer's waits: 50 ms polls (older pipeline) or events
    truth = exact(num_steps=8, length_mean=16, max_new_tokens=16, decode_step_s=0.013, prefill_s=0.013,
                  group_overhead_s=0.04, train_fixed_s=0.7, first_step_extra_s=0.2, sync_fixed_s=0.05,
                  step_overhead_s=0.02, startup_s=0.3, admit_poll_s=poll, batch_poll_s=poll, prompt_tokens=0)
    r = sim.simulate(truth)
    _write_run(tmp_path / "sync", truth, r)
    m = sim.measured(tmp_path / "sync")  # per-step values derived from the cumulative fractions
    assert [p["wait_s"] for p in m["per_step"]] == pytest.approx(r["wait_seconds"], abs=1e-9)
    assert [p["busy_s"] for p in m["per_step"]] == pytest.approx(r["engine_busy_seconds"], abs=1e-9)
    cfg, fit = sim.calibrate(tmp_path / "sync", polled=polled)
    assert (cfg.admit_poll_s, cfg.batch_poll_s) == (poll, poll)
    assert cfg.train_fixed_s == pytest.approx(0.7, rel=1e-6)
    assert cfg.first_step_extra_s == pytest.approx(0.2, rel=1e-6)
    assert cfg.sync_fixed_s == pytest.approx(0.05, rel=1e-6)
    assert cfg.step_overhead_s == pytest.approx(0.02, rel=1e-6)
    assert cfg.decode_step_s == pytest.approx(0.013, rel=1e-4)
    assert cfg.group_overhead_s == pytest.approx(0.04, abs=0.05 if polled else 1e-6)  # polls blur the wait
    pred = sim.simulate(cfg)
    assert pred["samples_per_s"] == pytest.approx(r["samples_per_s"], rel=0.02)
    # and predicts the async run of the same pipeline
    ta = dataclasses.replace(truth, mode="fully_async", max_staleness=2)
    pa = sim.simulate(dataclasses.replace(cfg, mode="fully_async", max_staleness=2))
    assert pa["samples_per_s"] == pytest.approx(sim.simulate(ta)["samples_per_s"], rel=0.03)


def test_calibrate_names_a_missing_file(tmp_path):
    (tmp_path / "config.yaml").write_text("{}")
    with pytest.raises(FileNotFoundError, match="metrics.jsonl"):
        sim.calibrate(tmp_path)


@pytest.mark.parametrize("name,text", [("config.yaml", "a: [\n"), ("config.yaml", "[1]\n"),
                                       ("metrics.jsonl", '{"a": 1}\n{trunc'),
                                       ("metrics.jsonl", "[1]\n"), ("summary.json", "")])
def test_calibrate_names_a_corrupt_run_file(tmp_path, name, text):
    files = {"config.yaml": "name: x\n", "metrics.jsonl": '{"a": 1}\n', "summary.json": "{}"}
    files[name] = text
    for n, t in files.items():
        (tmp_path / n).write_text(t)
    with pytest.raises(SystemExit, match=f"--calibrate: .*{name}"):
        sim.main(["--calibrate", str(tmp_path)])


@pytest.mark.parametrize("text", ["garbage", "[1]"])
def test_calibrate_names_a_corrupt_bench_json(tmp_path, text):
    (tmp_path / "b.json").write_text(text)
    with pytest.raises(SystemExit, match="--calibrate: .*b.json"):
        sim.main(["--calibrate", str(tmp_path / "b.json")])


def test_cli_cluster_scenario_runs(tmp_path, capsys):
    out = tmp_path / "o.json"
    assert sim.main(["--set", "num_steps=4", "--set", "num_engines=2", "--staleness", "2", "--json", str(out)]) == 0
    res = json.loads(out.read_text())["predicted"]
    assert [r["mode"] for r in res] == ["sync", "fully_async"] and res[0]["speedup"] == 1.0
    assert "fully_async" in capsys.readouterr().out


def test_bench_async_json_is_read_with_its_config(tmp_path):
    """A tools/bench_async.py --json file: config rebuilt from its path + overrides, sync first."""
    truth = exact(num_steps=4, length_mean=8, max_new_tokens=8, group_overhead_s=0.02, prompt_tokens=0)
    modes = {}
    for mode, k in (("fully_async", 2), ("sync", 0)):
        r = sim.simulate(dataclasses.replace(truth, mode=mode, max_staleness=k))
        modes[mode] = {"perf": {"perf/samples_per_s": r["samples_per_s"], "perf/trainer_idle_frac": r["trainer_idle_frac"],
                                "perf/engine_idle_frac": r["engine_idle_frac"], "loop_seconds": r["loop_seconds"]},
                       "steps": [{"step": i + 1, "wait_s": r["wait_seconds"][i], "train_s": r["train_seconds"][i],
                                  "sync_s": r["sync_seconds"][i], "pause_s": r["sync_seconds"][i],
                                  "step_s": r["step_end_seconds"][i] - (r["step_end_seconds"][i - 1] if i else 0.0),
                                  "engine_busy_s": r["engine_busy_seconds"][i], "samples": r["batch_samples"][i],
                                  "response_len_mean": r["batch_tokens"][i] / r["batch_samples"][i]}
                                 for i in range(r["steps"])]}
    f = tmp_path / "ba.json"
    f.write_text(json.dumps({"modes": modes, "config": str(ROOT / "configs" / "cpu_smoke.yaml"),
                             "overrides": ["rollout.prompts_per_step=3"], "staleness": 2}))
    runs = sim.measured_from_bench(f)
    assert [(m["mode"], m["K"]) for m in runs] == [("sync", 0), ("fully_async", 2)]
    assert runs[0]["config"]["rollout"]["prompts_per_step"] == 3  # the override applied
    assert runs[0]["config"]["async"] == {"mode": "sync", "max_staleness": 0, "stale_policy": "drop"}
    assert [p["tokens"] for p in runs[1]["per_step"]] == pytest.approx([8.0 * 8] * 4)
    cfg, _ = sim.calibrate(runs[0])
    assert cfg.groups_per_step == 3 and cfg.train_fixed_s == pytest.approx(truth.train_fixed_s)
    with pytest.raises(ValueError, match="bench_async"):
        (tmp_path / "x.json").write_text("{}")
        sim.measured_from_bench(tmp_path / "x.json")


def test_train_and_sync_traces_replace_the_fixed_times():
    c = exact(num_steps=3, sync_fixed_s=0.1)
    r = sim.simulate(dataclasses.replace(c, train_trace_s=(0.2, 0.9, 0.4), sync_trace_s=(0.01, 0.02, 0.03)))
    gen = 19 * 0.01
    assert r["train_seconds"] == pytest.approx([0.2, 0.9, 0.4])
    assert r["sync_seconds"] == pytest.approx([0.01, 0.02, 0.03])
    assert r["step_seconds"] == pytest.approx([gen + 0.21, gen + 0.92, gen + 0.43], rel=1e-9)
    with pytest.raises(ValueError, match="train_trace_s"):
        dataclasses.replace(c, train_trace_s=(0.2,))


def test_calibration_with_a_known_decode_slope(tmp_path):
    truth = exact(num_steps=6, length_mean=16, max_new_tokens=16, decode_step_s=0.01, decode_step_per_seq_s=2e-3,
                  prefill_s=0.01, train_fixed_s=0.5, prompt_tokens=0)
    _write_run(tmp_path / "sync", truth, sim.simulate(truth))
    cfg, _ = sim.calibrate(tmp_path / "sync", decode_per_seq_s=2e-3)
    assert cfg.decode_step_s == pytest.approx(0.01, rel=1e-4)
    cfg0, _ = sim.calibrate(tmp_path / "sync")  # slope unknown: the same busy time, all in d0
    assert cfg0.decode_step_per_seq_s == 0.0
    assert cfg0.decode_step_s == pytest.approx((15 * (0.01 + 8 * 2e-3) + 0.01) / 16, rel=1e-4)
