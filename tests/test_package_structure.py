"""Structure of the ``moe_async`` package, read from the source (ast; nothing is imported):
no import cycle among its modules, no lower layer importing ``moe_async.orchestration``, no
module over 800 lines, and ``moe_async.megatron`` importable without torch."""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
PKG = ROOT / "moe_async"
MAX_LINES = 800


def _modules() -> dict[str, pathlib.Path]:
    out = {}
    for p in sorted(PKG.rglob("*.py")):
        parts = list(p.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = p
    return out


def import_graph(mods: dict[str, pathlib.Path]) -> dict[str, set[str]]:
    """Module -> the package modules it imports anywhere in its file (function-level imports
    included: a lazy import is still a dependency). ``from pkg import name`` counts as
    ``pkg.name`` when that is a module, else as ``pkg``."""
    graph: dict[str, set[str]] = {}
    for name, path in mods.items():
        pkg = name if path.name == "__init__.py" else name.rpartition(".")[0]
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                deps.update(a.name for a in node.names if a.name in mods)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = pkg.split(".")[: len(pkg.split(".")) - (node.level - 1)]
                    base = ".".join(up + ([node.module] if node.module else []))
                for a in node.names:
                    if f"{base}.{a.name}" in mods:
                        deps.add(f"{base}.{a.name}")
                    elif base in mods:
                        deps.add(base)
        deps.discard(name)
        graph[name] = deps
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            for w in it:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                    break
                if w in on:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on.discard(w)
                        comp.append(w)
                        if w == v:
                            break
                    if len(comp) > 1:
                        out.append(sorted(comp))
    return out


def test_cycle_finder_finds_a_planted_cycle():
    g = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert cycles(g) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle():
    found = cycles(import_graph(_modules()))
    assert found == [], f"import cycles among moe_async modules: {found}"


def test_lower_layers_do_not_import_orchestration():
    graph = import_graph(_modules())
    upper = ("moe_async.orchestration", "moe_async.cli")
    bad = sorted((m, d) for m, deps in graph.items() if not m.startswith(upper)
                 for d in deps if d.startswith("moe_async.orchestration"))
    assert bad == [], f"modules below orchestration importing it: {bad}"


def test_no_module_over_800_lines():
    long = {str(p.relative_to(ROOT)): n for p in PKG.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert long == {}, f"files over {MAX_LINES} lines: {long}"


def test_megatron_package_import_is_light():
    code = ("import sys, moe_async.megatron, moe_async.megatron.parallel; "
            "print(sorted(m for m in ('torch', 'megatron.core') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_readme_module_table_matches_the_tree():
    """Every package and top-level module of moe_async is in the README's module table, and
    every path the table names exists."""
    import re

    text = (ROOT / "README.md").read_text()
    start = text.index("| piece | module |")
    table = text[start: text.index("\n\n", start)]
    named = set(re.findall(r"`(moe_async/[\w/.]*)`", table))
    tree = {f"moe_async/{p.name}/" for p in PKG.iterdir() if (p / "__init__.py").is_file()}
    tree |= {f"moe_async/{p.name}" for p in PKG.glob("*.py") if p.name != "__init__.py"}
    assert sorted(tree - named) == [], "missing from the README's module table"
    assert sorted(n for n in named if not (ROOT / n).exists()) == [], "named in the table, not in the tree"
