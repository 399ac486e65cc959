"""The GPU environment resolves, without installing it, for Linux x86_64 on Python 3.11 and 3.12
against the package index, to exactly the committed lock; a pin that conflicts with sglang's is
refused with uv's explanation naming both; the CPU venv holds the lock's transformers/tokenizers.

Needs the package index (as ``make setup`` does); uv comes from the test extra."""

from __future__ import annotations

import importlib.util
import re
from importlib.metadata import version
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _tool():
    spec = importlib.util.spec_from_file_location("gpu_env", ROOT / "tools" / "gpu_env.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


G = _tool()


def test_gpu_environment_resolves_to_the_lock_on_python_311_and_312():
    problems = G.check_all(G.PYTHONS)
    assert problems == {py: [] for py in G.PYTHONS}, "\n".join(sum(problems.values(), []))


@pytest.mark.parametrize("python", G.PYTHONS)
def test_lock_holds_one_stack(python):
    """What the cluster runs: sglang's torch/transformers/tokenizers, TE and megatron-core together."""
    pins = G.parse_pins(G.lock_path(python).read_text())
    want = {"sglang": "0.5.23", "torch": "2.14.1", "transformers": "5.19.0", "tokenizers": "0.23.2",
            "transformer-engine": "2.20.2", "transformer-engine-torch": "2.20.2", "megatron-core": "0.16.1"}
    assert {k: pins.get(k) for k in want} == want


def test_cpu_venv_has_the_gpu_locks_transformers_and_tokenizers():
    pins = G.parse_pins(G.lock_path("3.12").read_text())
    assert (version("transformers"), version("tokenizers")) == (pins["transformers"], pins["tokenizers"])
    assert version("torch").split("+")[0] == "2.13.0"  # the CPU path keeps its CPU wheel


def test_a_pin_conflicting_with_sglang_does_not_resolve(tmp_path):
    """pyproject.toml as it was before the GPU environment: transformers 5.23.0 against sglang's 5.19.0."""
    text = (ROOT / "pyproject.toml").read_text()
    bad = re.sub(r'"transformers==[^"]+"', '"transformers==5.23.0"', text)
    assert bad != text
    (tmp_path / "pyproject.toml").write_text(bad)
    res = G.resolve("3.12", project=tmp_path / "pyproject.toml")
    assert not res.ok and not res.pins
    assert "No solution found" in res.output
    assert re.search(r"sglang\S* depends on transformers==5\.19\.0", res.output), res.output
    assert "transformers==5.23.0" in res.output, res.output


def test_resolve_downloads_no_interpreter(monkeypatch):
    """uv resolves with the interpreters at hand: it is not sent to download a CPython of the
    target version first (seconds of retries where that host is unreachable)."""
    cmds = []

    def run(cmd, **kw):
        cmds.append(cmd)
        Path(cmd[cmd.index("-o") + 1]).write_text("torch==2.14.1\n")
        return G.subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(G.subprocess, "run", run)
    res = G.resolve("3.12")
    assert res.ok and res.pins == {"torch": "2.14.1"}
    assert "--no-python-downloads" in cmds[0] and cmds[0][cmds[0].index("--python-version") + 1] == "3.12"


def test_drift_from_the_lock_is_named():
    res = G.Resolution("3.12", True, {"torch": "2.14.1", "sglang": "0.5.23", "uvloop": "0.23.0"}, "")
    lock = {"torch": "2.14.1", "sglang": "0.5.22", "flashinfer-python": "0.7.2"}
    assert G.lock_problems(res, lock) == [
        "Python 3.12: flashinfer-python resolves to nothing, the lock gpu-py312.txt has 0.7.2",
        "Python 3.12: sglang resolves to 0.5.23, the lock gpu-py312.txt has 0.5.22",
        "Python 3.12: uvloop resolves to 0.23.0, the lock gpu-py312.txt has nothing"]
    failed = G.Resolution("3.11", False, {}, "error: No solution found")
    assert G.lock_problems(failed, lock) == ["Python 3.11: no GPU environment resolves:\nerror: No solution found"]


def test_parse_pins_reads_uv_output():
    text = "# header\nTorch==2.14.1\n    # via sglang\nflashinfer_python==0.7.2 ; sys_platform == 'linux'\n" \
           "zope.interface==8.0 \\\n"
    assert G.parse_pins(text) == {"torch": "2.14.1", "flashinfer-python": "0.7.2", "zope-interface": "8.0"}
