"""The converter CLIs run in the test process (imported by the test modules of this directory
as ``_cli``; pytest puts their directory on ``sys.path``)."""

from __future__ import annotations

import importlib
import os

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


def cli_in_process(tool: str, args: list, capsys, monkeypatch) -> tuple[int, str]:
    """``tools/<tool>.py``'s ``cli(args + ["--no-progress"])`` run in this process as a 1-process
    run (torchrun's variables removed by ``monkeypatch``): its exit status and what it printed
    on stderr (``capsys``). For refusals raised before any process group or model exists;
    test_convert_refusals.py runs the CLIs as processes as well (the exit path)."""
    for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.syspath_prepend(os.path.join(ROOT, "tools"))
    capsys.readouterr()
    rc = importlib.import_module(tool).cli([*args, "--no-progress"])
    return rc, capsys.readouterr().err
