"""Every exception class the package defines survives pickling (what Ray does to an exception
raised in an actor) with its type, message and fields.

The classes are found by walking the package's source (ast): a class whose base is an
exception name (``...Error``, ``...Exception``, ``TimeoutError``...) or another class found so
(to a fixed point); only the modules that define one are imported. A new exception class is
covered without touching this test. An exception whose ``__init__`` takes other arguments than
one message used to reach the driver as Ray's ``UnserializableException`` ("Failed to
deserialize exception") with about 60 traceback lines, naming no engine.
"""

from __future__ import annotations

import ast
import builtins
import importlib
import inspect
import pathlib
import pickle

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PKG = ROOT / "moe_async"
_BUILTIN_EXC = {n for n, v in vars(builtins).items() if isinstance(v, type) and issubclass(v, BaseException)}


def _base_name(node: ast.expr) -> str:
    return node.attr if isinstance(node, ast.Attribute) else getattr(node, "id", "")


def _exception_modules() -> set[str]:
    """Modules of ``moe_async`` defining a class derived (by name) from an exception."""
    classes: list[tuple[str, str, list[str]]] = []
    for p in sorted(PKG.rglob("*.py")):
        mod = ".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        for node in ast.walk(ast.parse(p.read_text(), str(p))):
            if isinstance(node, ast.ClassDef):
                classes.append((mod, node.name, [_base_name(b) for b in node.bases]))
    known = set(_BUILTIN_EXC)
    found: set[tuple[str, str]] = set()
    while True:
        new = {(m, n) for m, n, bases in classes
               if (m, n) not in found and any(b in known or b.endswith(("Error", "Exception")) for b in bases)}
        if not new:
            break
        found |= new
        known |= {n for _, n in new}
    return {m for m, _ in found}


def _exception_classes() -> list[type[BaseException]]:
    out = []
    for mod in sorted(_exception_modules()):
        for obj in vars(importlib.import_module(mod)).values():
            if isinstance(obj, type) and issubclass(obj, BaseException) and obj.__module__ == mod:
                out.append(obj)
    return out


def _instance(cls: type[BaseException]) -> BaseException:
    """``cls`` built with a message, or with a value per parameter of its own ``__init__``."""
    init = cls.__init__
    if init in {getattr(b, "__init__", None) for b in cls.__mro__ if b.__module__ == "builtins"}:
        return cls(f"{cls.__name__}: engine 1 at http://10.0.0.7:30001 failed")
    args = []
    for name, p in inspect.signature(init).parameters.items():
        if name == "self" or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) or p.default is not p.empty:
            continue
        ann = str(p.annotation)
        args.append(7 if "int" in ann else 1.5 if "float" in ann else f"{name} value")
    return cls(*args)


CLASSES = _exception_classes()


def test_the_walk_finds_the_product_exceptions():
    names = {c.__name__ for c in CLASSES}
    # a few that must be there (the walk is what covers the rest, and new ones)
    assert {"EngineRequestError", "WeightSyncError", "GroupFormationError", "TrainerRankError", "PlacementError",
            "UserInputError", "ConfigError", "EngineLaunchError"} <= names, names
    assert len(CLASSES) >= 20, names


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: f"{c.__module__}.{c.__name__}")
def test_exception_round_trips_through_pickle(cls):
    e = _instance(cls)
    back = pickle.loads(pickle.dumps(e))
    assert type(back) is cls
    assert str(back) == str(e) and back.args == e.args
    assert vars(back) == vars(e)


def test_engine_request_error_keeps_its_fields():
    from moe_async.engines.client import EngineRequestError

    e = pickle.loads(pickle.dumps(EngineRequestError("/update_weights_from_distributed", 400, "bad shape")))
    assert (e.path, e.status_code, e.message) == ("/update_weights_from_distributed", 400, "bad shape")
    assert str(e) == "/update_weights_from_distributed -> HTTP 400: bad shape"
