"""The run console: expected CPU warnings (as a smoke run prints them, Ray's worker prefix
included) are hidden and counted in one line, every line is kept in console.log."""

import sys

from moe_async.logging.console import RunConsole, classify

P = "\x1b[36m(TrainerActor pid=11952)\x1b[0m "
MEG = "/venv/lib/python3.11/site-packages/megatron/core"
STARTUP = [
    "Writing model shards:   0%|          | 0/1 [00:00<?, ?it/s]\r"
    "Writing model shards: 100%|██████████| 1/1 [00:00<00:00, 60.19it/s]\n",
    "2026-12-01 10:32:03,280\tWARNING authentication_token_setup.py:85 -- Token authentication is enabled for "
    "this Ray cluster. Set RAY_AUTH_MODE=disabled to opt out.\n",
    "2026-12-01 10:32:07,607\tINFO worker.py:2038 -- Started a local Ray instance.\n",
    f"{P}{MEG}/optimizer/__init__.py:24: UserWarning: Transformer Engine and Apex are not installed. "
    "Falling back to Torch optimizers.\n",
    f"{P}  warnings.warn(\n",
    f"{P}{MEG}/models/backends.py:21: UserWarning: Apex is not installed. Falling back to Torch Norm\n",
    f'{P}  warnings.warn("Apex is not installed. Falling back to Torch Norm")\n',
    f"{P}{MEG}/transformer/transformer_config.py:1705: UserWarning: full scope is deprecated. Use empty "
    "cuda_graph_scope to capture the whole layer.\n",
    f"{P}  warnings.warn(\n",
]


def test_classify():
    assert classify(STARTUP[3]) == "Transformer Engine/Apex fallback"
    assert classify(STARTUP[7]) == "deprecation"
    assert classify(STARTUP[1]) == "Ray notice"
    assert classify("(Ray deduplicates logs by default. Set RAY_DEDUP_LOGS=0 to disable log deduplication.)") == "Ray notice"
    assert classify(f"{P}Apex is not installed. Falling back to Torch Norm [repeated 2x across cluster]") \
        == "Transformer Engine/Apex fallback"
    assert classify("step   1/3 | reward 0.000 acc 0.000") is None
    assert classify(f"{P}RuntimeError: engine 0 died") is None


def test_expected_warnings_hidden_counted_and_logged(tmp_path, capsys):
    with RunConsole() as con:
        print("[moe-async] run dir: X")
        con.attach_log(tmp_path)  # lines before the run dir exists are kept and written now
        for chunk in STARTUP:
            sys.stderr.write(chunk)
        print(f"{P}something unexpected happened", file=sys.stderr)
        line = con.summary_line()
        assert con.summary_line() is None  # reported once
        sys.stderr.write(f"{P}weight sync: model.embed_tokens.weight (12582912 bytes) exceeds bucket_bytes=1048576; "
                         "sent alone in a grown bucket\n")
        later = con.summary_line()
    out, err = capsys.readouterr()
    assert out == "[moe-async] run dir: X\n"
    assert err == f"{P}something unexpected happened\n"  # only the unexpected line is shown
    assert con.hidden == {"Transformer Engine/Apex fallback": 2, "deprecation": 1, "Ray notice": 2,
                          "progress bar": 1, "oversize-bucket note": 1}
    assert line == (f"[moe-async] 6 expected CPU warnings hidden (Ray notice 2, Transformer Engine/Apex fallback 2, "
                    f"progress bar 1, deprecation 1); full text: {tmp_path / 'console.log'}")
    assert later.startswith("[moe-async] 1 more, 7 expected CPU warnings hidden")
    log = (tmp_path / "console.log").read_text()
    assert log.splitlines()[0] == "[moe-async] run dir: X"
    for text in ("Token authentication is enabled", "Falling back to Torch optimizers", "full scope is deprecated",
                 "Writing model shards: 100%", "(TrainerActor pid=11952)   warnings.warn(", "exceeds bucket_bytes"):
        assert text in log, text
    assert "\x1b[" not in log
    assert sys.stdout is not con._out and sys.stderr is not con._err  # restored


def test_partial_line_flushed_at_close(capsys):
    with RunConsole():
        sys.stderr.write("Traceback (most recent call last): no newline")
    assert capsys.readouterr().err == "Traceback (most recent call last): no newline\n"


def test_inert_console_leaves_streams():
    out = sys.stdout
    con = RunConsole(install=False)
    con.attach_log("/nonexistent")  # nothing written, nothing raised
    con.status("x")
    con.close()
    assert sys.stdout is out and con.summary_line() is None


def test_step_line_and_quiet(tmp_path, capsys):
    from moe_async.logging.config import LoggingConfig
    from moe_async.logging.run_logger import RunLogger

    m = {"rollout/reward_mean": 0.5, "rollout/accuracy": 0.25, "perf/wait_seconds": 1.25,
         "perf/wait_straggler_seconds": 0.5, "train/step_time_s": 2.0, "sync/seconds": 0.125}
    loud = RunLogger(LoggingConfig(wandb_mode="disabled"), tmp_path, "x", {})
    line = loud.console_step(3, 24, m)
    assert capsys.readouterr().out == line + "\n"
    assert line.startswith("step   3/24 | reward 0.500 acc 0.250")
    assert "| wait 1.2s (straggler 0.5s) train 2.0s sync 0.12s |" in line
    quiet = RunLogger(LoggingConfig(wandb_mode="disabled", quiet=True), tmp_path, "x", {})
    assert quiet.console_step(3, 24, m) == line and capsys.readouterr().out == ""
    loud.close()
    quiet.close()



def _read_tb_scalars(logdir):
    """(tag, step, value) of every scalar in the TFRecord event files under ``logdir``."""
    import struct

    from tensorboardX.proto.event_pb2 import Event

    out = []
    for f in sorted(logdir.glob("events.out.tfevents.*")):
        data = f.read_bytes()
        pos = 0
        while pos < len(data):
            (n,) = struct.unpack("<Q", data[pos:pos + 8])
            ev = Event.FromString(data[pos + 12:pos + 12 + n])
            pos += 12 + n + 4
            out += [(v.tag, ev.step, v.simple_value) for v in ev.summary.value]
    return out


def test_tensorboard_gets_the_same_names_and_values(tmp_path):
    from moe_async.logging.config import LoggingConfig
    from moe_async.logging.run_logger import RunLogger

    lg = RunLogger(LoggingConfig(wandb_mode="disabled", tensorboard=True), tmp_path, "x", {})
    lg.log({"rollout/reward_mean": 0.5, "perf/wait_seconds": 1.25, "note": "text"}, step=1)
    lg.log({"rollout/reward_mean": 0.75, "perf/wait_seconds": 2.0}, step=2)
    lg.close()
    assert sorted(_read_tb_scalars(tmp_path / "tensorboard")) == [
        ("perf/wait_seconds", 1, 1.25), ("perf/wait_seconds", 2, 2.0),
        ("rollout/reward_mean", 1, 0.5), ("rollout/reward_mean", 2, 0.75)]
