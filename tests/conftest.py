"""Suite-wide: this directory is on ``sys.path`` (pytest's rootdir-relative conftest import),
so test modules in every sub-directory import the shared launch helpers as ``_launch``.

Under pytest-xdist (``make test`` runs ``-n 2 --dist loadgroup``) every test module is one work
unit (its module-scoped fixtures are built once), and modules that share a session-scoped
fixture of this suite (one smoke run read by three modules, one conversion launch read by
three) are one unit together, so that no fixture is built twice, once per worker."""
from __future__ import annotations

import pytest

_BUILTIN_SESSION = {"tmp_path_factory", "tmpdir_factory", "worker_id", "testrun_uid"}


def _module(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def work_units(items: list[pytest.Item]) -> dict[str, str]:
    """``{module: unit}``: modules joined (union-find) when their tests use the same
    session-scoped fixture defined in ``tests/``; a unit is named by its first module."""
    parent: dict[str, str] = {}

    def find(m: str) -> str:
        while parent.setdefault(m, m) != m:
            m = parent[m]
        return m

    owner: dict[str, str] = {}
    for item in items:
        mod = find(_module(item.nodeid))
        info = getattr(item, "_fixtureinfo", None)
        for name, defs in (info.name2fixturedefs.items() if info else ()):
            if name in _BUILTIN_SESSION or not defs or defs[-1].scope != "session":
                continue
            if name in owner:
                a, b = find(owner[name]), find(mod)
                if a != b:
                    parent[b] = a
            else:
                owner[name] = mod
    return {m: find(m) for m in parent}


@pytest.hookimpl(trylast=True)  # after the deselection of slow tests
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """On xdist's workers under ``--dist loadgroup``: append ``@<unit>`` to every node id, the
    suffix xdist's scheduler groups by. xdist 3.8 writes that suffix from ``xdist_group`` marks
    into ``item._nodeid``, which pytest 9 no longer reads (the id lives in ``item._id``), so the
    suffix is set here; the controller prints the ids with it."""
    if not getattr(config.option, "loadgroup", False):
        return
    units = work_units(items)
    for item in items:
        item._id = type(item._id).parse(f"{item.nodeid}@{units[_module(item.nodeid)]}")
