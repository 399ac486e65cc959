"""Structure of the ``moe_async`` package, read from the source (ast; nothing is imported):
the declared layer order (:data:`LAYERS`) holds for every import, no import cycle among its
modules, no re-export shim module, no module over 600 lines, and ``moe_async.megatron``
importable without torch."""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
PKG = ROOT / "moe_async"
MAX_LINES = 600

#: The package's layers, lowest first: a module may import only modules of its own entry or of
#: an entry listed before it. An entry is a package or module; a module belongs to the longest
#: entry that prefixes it (a package's leaf module that a lower layer shares is listed on its own).
LAYERS = (
    "moe_async.errors", "moe_async.types", "moe_async.layout", "moe_async.protocols",
    "moe_async.config_base", "moe_async.net", "moe_async.affinity",
    "moe_async.compat",
    "moe_async.models",
    "moe_async.lora",
    "moe_async.trainer.finite",
    "moe_async.weight_sync",
    "moe_async.megatron",
    "moe_async.engines",
    "moe_async.buffer",
    "moe_async.logging",
    "moe_async.replay",
    "moe_async.trainer",
    "moe_async.agent.config", "moe_async.rollout.rewards", "moe_async.rollout.config", "moe_async.rollout.draw_cursor",
    "moe_async.rollout.tasks",
    "moe_async.agent",
    "moe_async.rollout",
    "moe_async.distill",
    "moe_async.data",
    "moe_async.plan.config",
    "moe_async.config",
    "moe_async.plan",
    "moe_async.report",
    "moe_async.orchestration",
    "moe_async.cli",
    "moe_async",
)


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


def layer_of(module: str) -> int:
    """Index in :data:`LAYERS` of the longest entry that is ``module`` or a package above it."""
    best = max((e for e in LAYERS if module == e or module.startswith(e + ".")), key=len, default=None)
    if best is None:
        raise KeyError(f"{module} is in no layer of LAYERS")
    return LAYERS.index(best)


def upward_imports(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    """(importer, imported) pairs whose imported module sits in a later layer than the importer
    (the package root ``moe_async`` itself may import anything)."""
    return sorted((m, d) for m, deps in graph.items() for d in deps
                  if m != "moe_async" and layer_of(d) > layer_of(m))


def test_layer_finder_flags_a_planted_upward_import():
    g = {"moe_async.models.family": {"moe_async.errors"}, "moe_async.errors": {"moe_async.trainer.loss"}}
    assert upward_imports(g) == [("moe_async.errors", "moe_async.trainer.loss")]
    assert layer_of("moe_async.trainer.finite") < layer_of("moe_async.weight_sync.bucket") < layer_of("moe_async.trainer")


def test_every_import_follows_the_layer_order():
    """Every module is in a layer and no import points to a later one; prints the import graph
    between layers (``importer -> imported``, with the number of module imports behind each)."""
    graph = import_graph(_modules())
    for m in graph:
        layer_of(m)  # KeyError for a module in no layer
    arrows: dict[tuple[str, str], int] = {}
    for m, deps in graph.items():
        for d in deps:
            a, b = LAYERS[layer_of(m)], LAYERS[layer_of(d)]
            if a != b:
                arrows[a, b] = arrows.get((a, b), 0) + 1
    print("\nimport graph between layers (lowest layer first):")
    for entry in LAYERS:
        out = sorted((LAYERS.index(b), b, n) for (a, b), n in arrows.items() if a == entry)
        print(f"  {entry} -> " + (", ".join(f"{b} ({n})" for _, b, n in out) or "-"))
    bad = upward_imports(graph)
    print(f"arrows against the layer order: {len(bad)}")
    assert bad == [], f"imports against the layer order in LAYERS: {bad}"


def is_shim(source: str) -> bool:
    """True for a module whose body is only imports from ``moe_async`` (plus its docstring and
    ``__all__``): a re-export kept for callers."""
    body = [n for n in ast.parse(source).body if not (isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant))]
    imports = [n for n in body if isinstance(n, (ast.Import, ast.ImportFrom))]
    rest = [n for n in body if n not in imports and not (
        isinstance(n, ast.Assign) and [getattr(t, "id", None) for t in n.targets] == ["__all__"])]
    return bool(imports) and not rest and any(
        isinstance(n, ast.ImportFrom) and (n.module or "").startswith("moe_async") for n in imports)


def test_shim_finder_flags_a_planted_shim():
    shim = '"""Re-export."""\nfrom moe_async.megatron.sharding import Piece\n\n__all__ = ["Piece"]\n'
    assert is_shim(shim)
    assert not is_shim(shim + "\n\ndef f():\n    return Piece\n")


def test_no_reexport_shim_modules():
    """Callers import a name from the module that defines it: no re-export shim module
    (package ``__init__`` files, which gather a package's API, are exempt)."""
    shims = [name for name, path in _modules().items() if path.name != "__init__.py" and is_shim(path.read_text())]
    assert shims == [], f"re-export shim modules: {shims}"


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


def test_no_module_over_600_lines():
    long = {str(p.relative_to(ROOT)): n for p in PKG.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert long == {}, f"files over {MAX_LINES} lines: {long}"


def megatron_imports(package: pathlib.Path) -> list[tuple[str, str]]:
    """(file, imported module) for every import in ``package`` (function-level included) of
    Megatron-Core (``megatron.*``) or of this project's Megatron side (``moe_async.megatron``,
    ``moe_async.trainer``)."""
    bad = ("megatron", "moe_async.megatron", "moe_async.trainer")
    out = []
    for p in sorted(package.rglob("*.py")):
        for node in ast.walk(ast.parse(p.read_text(), str(p))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
            out += [(p.name, n) for n in names if any(n == b or n.startswith(b + ".") for b in bad)]
    return out


def test_megatron_import_finder_flags_a_planted_import(tmp_path):
    (tmp_path / "a.py").write_text("def f():\n    from megatron.core import parallel_state\n")
    (tmp_path / "b.py").write_text("import moe_async.trainer.finite\nimport megatron_like\n")
    assert megatron_imports(tmp_path) == [("a.py", "megatron.core"), ("b.py", "moe_async.trainer.finite")]


def test_weight_sync_holds_no_megatron_code():
    """The transports (groups, buckets, engine calls) read the model only through their
    source interface; the HF view of the Megatron model lives in moe_async.megatron."""
    assert megatron_imports(PKG / "weight_sync") == []


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
