"""Suite-wide: this directory is on ``sys.path`` (pytest's rootdir-relative conftest import),
so test modules in every sub-directory import the shared launch helpers as ``_launch``.

``shared_layout_launch``: the check scripts of several modules in one ``ref`` process and one
2-process torchrun (``_shared_launch.py``)."""

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
    """The selected test modules that declare ``SHARED_LAUNCH``, each job in its own directory
    ``tmp``: either a layout script (``{"script", "param": parameter name, "cases": want ->
    2-process cases}``, ``want`` that parameter's selected values in the module; writes
    ``tmp/ref.json`` and ``tmp/w2.json``) or a plain 2-process script (``{"script", "argv":
    tmp -> its arguments}``, and ``"prepare": tmp -> None`` run here first if given). Every
    layout script's ``ref`` runs in one python process, then every 2-process part in one
    torchrun. Returns ``{module file stem: tmp}`` and ``"times"`` (s)."""
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
        out[path.stem] = str(tmp)
        if "argv" in job:
            if "prepare" in job:
                job["prepare"](str(tmp))
            jobs.append({"script": job["script"], "argv": list(job["argv"](str(tmp)))})
        else:
            jobs.append({"script": job["script"], "tmp": str(tmp),
                         "cases": list(job["cases"](_selected(request.session, path, job.get("param", ""))))})
    spec = root / "spec.json"
    spec.write_text(json.dumps(jobs))
    script = os.path.join(HERE, "_shared_launch.py")
    times = {}
    n_ref = sum("cases" in j for j in jobs)
    if n_ref:
        times["ref"] = run([sys.executable, script, "ref", str(spec)], timeout=300 * n_ref)
    n_run = sum(bool(j.get("cases")) or "argv" in j for j in jobs)
    if n_run:
        times["w2"] = torchrun(2, script, "run", str(spec), timeout=400 * n_run)
    print("shared launch wall times (s):", times, "jobs:", [os.path.basename(j["script"]) for j in jobs])
    out["times"] = times
    return out
