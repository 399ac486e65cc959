"""Suite-wide: this directory is on ``sys.path`` (pytest's rootdir-relative conftest import),
so test modules in every sub-directory import the shared launch helpers as ``_launch``.

``shared_layout_launch``: the layout check scripts of several modules in one ``ref`` process
and one 2-process torchrun (``_shared_launch.py``)."""

from __future__ import annotations

import json
import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))


def _selected(session, path, name: str) -> set:
    return {item.callspec.params[name] for item in session.items
            if item.path == path and name in getattr(getattr(item, "callspec", None), "params", {})}


@pytest.fixture(scope="session")
def shared_layout_launch(request, tmp_path_factory) -> dict:
    """The selected test modules that declare ``SHARED_LAUNCH = {"script": check script,
    "param": parameter name, "cases": want -> 2-process cases}`` (``want``: that parameter's
    selected values in the module): every script's ``ref`` in one python process, then every
    script's cases in one 2-process torchrun, each job in its own directory (``ref.json``,
    ``w2.json``). Returns ``{module file stem: that directory}`` and ``"times"`` (s)."""
    from _launch import run, torchrun

    mods: dict = {}
    for item in request.session.items:
        job = getattr(getattr(item, "module", None), "SHARED_LAUNCH", None)
        if job is not None and item.path not in mods:
            mods[item.path] = job
    root = tmp_path_factory.mktemp("shared_launch")
    jobs, out = [], {}
    for path, job in mods.items():
        tmp = root / path.stem
        tmp.mkdir()
        jobs.append({"script": job["script"], "tmp": str(tmp),
                     "cases": list(job["cases"](_selected(request.session, path, job.get("param", ""))))})
        out[path.stem] = str(tmp)
    spec = root / "spec.json"
    spec.write_text(json.dumps(jobs))
    script = os.path.join(HERE, "_shared_launch.py")
    times = {"ref": run([sys.executable, script, "ref", str(spec)], timeout=300 * len(jobs))}
    n_run = sum(bool(j["cases"]) for j in jobs)
    if n_run:
        times["w2"] = torchrun(2, script, "run", str(spec), timeout=400 * n_run)
    print("shared layout launch wall times (s):", times, "jobs:", [os.path.basename(j["script"]) for j in jobs])
    out["times"] = times
    return out
