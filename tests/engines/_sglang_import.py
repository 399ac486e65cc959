"""Import ``sglang.srt.managers.io_struct`` (sglang 0.5.23, installed ``--no-deps``) on a CPU.

What it needs, found by importing it here:

* light pinned packages (pyproject's ``test`` extra): orjson, pybase64, msgspec, pyzmq,
  ipython, aiohttp, dill, apache-tvm-ffi, sentencepiece, compressed-tensors, loguru, openai,
  partial-json-parser;
* two GPU-only modules that cannot be installed usefully next to the CPU torch, and are
  stubbed for imports *made by sglang itself* only (``moe_async/compat/sglang_cpu.py``, the
  same import moe_async's tool-call parsing uses on a CPU host):

  - ``triton`` (3.9.0 is a 285 MB GPU compiler): ``sglang/srt/utils/common.py`` does
    ``import triton`` at module level and kernel modules decorate with ``@triton.jit``;
  - ``torchvision``: PyPI's wheel is built against the CUDA torch and fails to import on the
    CPU torch (``RuntimeError: operator torchvision::nms does not exist``);
    ``sglang/srt/multimodal/internvl_utils.py`` imports ``torchvision.transforms``.

  torch and transformers probe for both packages; their (cached) probes run before the stub
  is installed, so they keep seeing "not installed". No stubbed object is touched by the
  request dataclasses under test.

:func:`load_io_struct` returns the module, or raises ``ImportError`` with the precise
reason (tests skip with it).
"""

from __future__ import annotations

# the stub and its finder, for the helpers that import more of SGLang (weight_sync, tensor contract)
from moe_async.compat.sglang_cpu import STUBBED, _Stub, _StubFinder  # noqa: E402,F401

_CACHE: dict[str, object] = {}


def load_io_struct():
    if "io" in _CACHE:
        return _CACHE["io"]
    if "err" in _CACHE:
        raise ImportError(_CACHE["err"])
    import importlib.metadata
    import importlib.util

    if importlib.util.find_spec("sglang") is None:
        _CACHE["err"] = "sglang is not installed (make setup runs pip install --no-deps sglang==0.5.23)"
        raise ImportError(_CACHE["err"])
    version = importlib.metadata.version("sglang")
    if version != "0.5.23":
        _CACHE["err"] = f"contract tests are written against sglang 0.5.23, found {version}"
        raise ImportError(_CACHE["err"])
    from moe_async.compat.sglang_cpu import import_sglang  # the stubs, on a host without CUDA

    try:
        io = import_sglang("sglang.srt.managers.io_struct")
    except Exception as e:  # record exactly which import failed
        _CACHE["err"] = f"import sglang.srt.managers.io_struct failed: {type(e).__name__}: {e}"
        raise ImportError(_CACHE["err"]) from None
    _CACHE["io"] = io
    return io


def io_struct_or_skip(*also: str, what: str = "sglang io_struct"):
    """For a test module that needs SGLang: ``(io, modules, pytestmark)``.

    ``io``: SGLang's ``io_struct`` (:func:`load_io_struct`), or None when it (or any module
    named in ``also``, imported after it) cannot be imported; ``modules``: ``also``'s modules
    by name (empty on failure); ``pytestmark``: a ``skipif`` that skips the module then, its
    reason ``"<what> unavailable: <the import error>"``.
    """
    import pytest

    try:
        io = load_io_struct()
        from moe_async.compat.sglang_cpu import import_sglang

        modules = {name: import_sglang(name) for name in also}
        error = None
    except ImportError as e:  # pragma: no cover - depends on the environment
        io, modules, error = None, {}, str(e)
    return io, modules, pytest.mark.skipif(io is None, reason=f"{what} unavailable: {error}")
