"""Import ``sglang.srt.managers.io_struct`` (sglang 0.5.23, installed ``--no-deps``) on a CPU.

What it needs, found by importing it here:

* light pinned packages (pyproject's ``test`` extra): orjson, pybase64, msgspec, pyzmq,
  ipython, aiohttp, dill, apache-tvm-ffi, sentencepiece, compressed-tensors, loguru, openai,
  partial-json-parser;
* two GPU-only modules that cannot be installed usefully next to the CPU torch, and are
  stubbed for imports *made by sglang itself* only:

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

import importlib
import importlib.abc
import importlib.machinery
import sys
import types

STUBBED = frozenset({"triton", "torchvision"})
_CACHE: dict[str, object] = {}


class _Stub(types.ModuleType):
    """Any attribute: a sub-stub; Capitalised names: a class; calling it: a no-op decorator."""

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        if name[:1].isupper():
            val = type(name, (), {"__init__": lambda self, *a, **k: None,
                                   "__class_getitem__": classmethod(lambda c, i: c)})
        else:
            val = _Stub(f"{self.__name__}.{name}")
            val.__path__ = []
        setattr(self, name, val)
        return val

    def __call__(self, *args, **kwargs):
        if len(args) == 1 and callable(args[0]) and not kwargs:
            return args[0]
        return lambda fn: fn


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] not in STUBBED:
            return None
        f = sys._getframe(1)
        while f is not None and (
            f.f_globals.get("__name__", "").startswith("importlib")
            or f.f_code.co_filename.startswith("<frozen")
        ):
            f = f.f_back
        caller = (f.f_globals.get("__name__", "") if f is not None else "").split(".")[0]
        if caller not in {"sglang"} | STUBBED:
            return None
        return importlib.machinery.ModuleSpec(name, self, is_package=True)

    def create_module(self, spec):
        mod = _Stub(spec.name)
        mod.__path__ = []
        return mod

    def exec_module(self, module):
        pass


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
    # Let torch/transformers cache "triton/torchvision not installed" before the stub exists.
    import torch._inductor.compile_fx  # noqa: F401
    import torch._inductor.runtime.triton_compat  # noqa: F401
    import torch.utils._triton as tt
    import transformers.utils.import_utils as iu

    tt.has_triton_package(), tt.has_triton(), tt.get_triton_version()
    iu.is_torchvision_available(), iu.is_torchvision_greater_or_equal("0.27")
    finder = _StubFinder()
    sys.meta_path.insert(0, finder)
    try:
        io = importlib.import_module("sglang.srt.managers.io_struct")
    except Exception as e:  # record exactly which import failed
        _CACHE["err"] = f"import sglang.srt.managers.io_struct failed: {type(e).__name__}: {e}"
        raise ImportError(_CACHE["err"]) from None
    finally:
        sys.meta_path.remove(finder)
        # sglang's modules keep their references; nobody else may find the stubs later.
        for name in [n for n in sys.modules if n.split(".")[0] in STUBBED]:
            if isinstance(sys.modules[name], _Stub):
                del sys.modules[name]
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
        modules = {name: importlib.import_module(name) for name in also}
        error = None
    except ImportError as e:  # pragma: no cover - depends on the environment
        io, modules, error = None, {}, str(e)
    return io, modules, pytest.mark.skipif(io is None, reason=f"{what} unavailable: {error}")
