"""Import SGLang's pure-Python modules (function-call parsers, request dataclasses) on a host
without CUDA.

SGLang 0.5.23 (installed ``--no-deps``: its own dependencies are CUDA kernels) imports two
GPU-only packages at module level on the way to its parsers: ``triton`` (``sglang/srt/utils/
common.py`` does ``import triton``; kernel modules decorate with ``@triton.jit``) and
``torchvision`` (``sglang/srt/multimodal/internvl_utils.py``; PyPI's wheel fails to import on
the CPU torch). Neither is used by the parsers. :func:`import_sglang` imports a module with
both stubbed for imports *made by sglang itself* only, and only when CUDA is absent (with CUDA
it is a plain import of the real packages). torch's and transformers' own probes for the two
packages run (and cache "not installed") before the stub exists; afterwards the stubs are
taken out of ``sys.modules``, so nobody else finds them.

The light packages SGLang imports on the way (orjson, pybase64, msgspec, pyzmq, ipython,
aiohttp, dill, apache-tvm-ffi, sentencepiece, compressed-tensors, loguru, openai,
partial-json-parser) must be installed: pyproject's ``agent`` extra.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import threading
import types
from typing import Any

STUBBED = frozenset({"triton", "torchvision"})
_LOCK = threading.Lock()


class _Stub(types.ModuleType):
    """Any attribute: a sub-stub; Capitalised names: a class; calling it: a no-op decorator."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        val: Any
        if name[:1].isupper():
            val = type(name, (), {"__init__": lambda self, *a, **k: None,
                                   "__class_getitem__": classmethod(lambda c, i: c)})
        else:
            val = _Stub(f"{self.__name__}.{name}")
            val.__path__ = []
        setattr(self, name, val)
        return val

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if len(args) == 1 and callable(args[0]) and not kwargs:
            return args[0]
        return lambda fn: fn


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds :data:`STUBBED` packages for importers inside sglang (or the stubs) only."""

    def find_spec(self, name: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if name.split(".")[0] not in STUBBED:
            return None
        f = sys._getframe(1)
        while f is not None and (f.f_globals.get("__name__", "").startswith("importlib")
                                 or f.f_code.co_filename.startswith("<frozen")):
            f = f.f_back  # type: ignore[assignment]
        caller = (f.f_globals.get("__name__", "") if f is not None else "").split(".")[0]
        if caller not in {"sglang"} | STUBBED:
            return None
        return importlib.machinery.ModuleSpec(name, self, is_package=True)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        mod = _Stub(spec.name)
        mod.__path__ = []
        return mod

    def exec_module(self, module: types.ModuleType) -> None:
        pass


def _prime_probes() -> None:
    """Let torch and transformers cache "triton / torchvision not installed" first."""
    import torch._inductor.compile_fx  # noqa: F401
    import torch._inductor.runtime.triton_compat  # noqa: F401
    import torch.utils._triton as tt
    import transformers.utils.import_utils as iu

    tt.has_triton_package(), tt.has_triton(), tt.get_triton_version()
    iu.is_torchvision_available(), iu.is_torchvision_greater_or_equal("0.27")


def import_sglang(name: str) -> types.ModuleType:
    """``importlib.import_module(name)`` for an ``sglang.*`` module; on a host without CUDA
    with ``triton``/``torchvision`` stubbed for sglang's own imports (module docstring).

    Raises: ImportError naming the module and what failed (sglang not installed, a light
    dependency missing)."""
    if not name.startswith("sglang"):
        raise ValueError(f"import_sglang is for sglang modules, got {name!r}")
    if name in sys.modules:
        return sys.modules[name]
    import torch

    if torch.cuda.is_available():
        return importlib.import_module(name)
    with _LOCK:
        _prime_probes()
        finder = _StubFinder()
        sys.meta_path.insert(0, finder)
        try:
            return importlib.import_module(name)
        except Exception as exc:  # noqa: BLE001 - any failure of the import, named
            raise ImportError(f"import {name} failed on this CPU host: {type(exc).__name__}: {exc}") from exc
        finally:
            sys.meta_path.remove(finder)
            for mod in [n for n in sys.modules if n.split(".")[0] in STUBBED]:
                if isinstance(sys.modules[mod], _Stub):
                    del sys.modules[mod]
