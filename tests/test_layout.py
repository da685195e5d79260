"""The layout of src/: static imports point one way (no cycle between files, function-level and TYPE_CHECKING
imports included, package ``__init__`` files included), and the commands that run on an engine never ask which
engine they have."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"


def _modules() -> dict[str, Path]:
    out = {}
    for p in SRC.rglob("*.py"):
        out[".".join(p.relative_to(SRC).with_suffix("").parts).removesuffix(".__init__")] = p
    return out


def import_graph(mods: dict[str, Path]) -> dict[str, set[str]]:
    """Every static import between the files of src/, resolved to the file it loads (a name imported from a
    package is the package's submodule when there is one, else the package's ``__init__``)."""
    edges: dict[str, set[str]] = {m: set() for m in mods}
    for m, p in mods.items():
        pkg = m if p.name == "__init__.py" else m.rpartition(".")[0]
        for node in ast.walk(ast.parse(p.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom):
                base = pkg
                for _ in range(max(node.level - 1, 0)):
                    base = base.rpartition(".")[0]
                target = (base + ("." + node.module if node.module else "")) if node.level else (node.module or "")
                for alias in node.names:
                    for t in (f"{target}.{alias.name}", target):
                        if t in mods and t != m:
                            edges[m].add(t)
                            break
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name in mods and alias.name != m:
                        edges[m].add(alias.name)
    return edges


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one file (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0
    for root in edges:
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            v, it = work[-1]
            for w in it:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(edges[w]))))
                    break
                if w in on_stack:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        comp.append(w)
                        if w == v:
                            break
                    if len(comp) > 1:
                        found.append(sorted(comp))
    return found


def test_cycle_finder_finds_a_cycle_through_a_function_level_import():
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(edges) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle_between_the_files_of_src():
    mods = _modules()
    assert "slake.engines.base" in mods and "slake.cli.generate" in mods
    found = cycles(import_graph(mods))
    assert not found, "import cycles in src/: " + "; ".join(" <-> ".join(c) for c in found)


def test_layers_point_down():
    """Method math imports nothing above it; the cache engine nothing from the adapters, tools or commands; only
    the command line imports the command line."""
    mods = _modules()
    edges = import_graph(mods)
    layer_of = [
        ("slake.methods", 0),
        ("slake.budgets", 0),
        ("slake.attention", 1),
        ("slake.cache", 2),
        ("slake.engines", 3),
        ("slake.eval", 4),
        ("slake.quality", 4),
        ("slake.cli", 5),
    ]

    def layer(m: str) -> int | None:
        for prefix, n in layer_of:
            if m == prefix or m.startswith(prefix + "."):
                return n
        return None

    upward = [
        (a, b)
        for a, targets in edges.items()
        for b in targets
        if layer(a) is not None and layer(b) is not None and layer(b) > layer(a)
    ]
    assert not upward, f"imports that point up the layers: {upward}"


def test_engine_commands_never_ask_which_engine_they_have():
    """generate, eval, bench and demo take an engine; no engine name, engine class or engine package appears in
    them (the engines refuse what they cannot do themselves)."""
    for name in ("generate", "eval", "bench", "demo"):
        path = SRC / "slake" / "cli" / f"{name}.py"
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                assert node.value not in ("vllm", "transformers"), f"{path.name}:{node.lineno} names an engine"
            if isinstance(node, ast.Name | ast.Attribute):
                ident = node.id if isinstance(node, ast.Name) else node.attr
                assert ident not in ("VllmEngine", "TransformersEngine"), f"{path.name}:{node.lineno}: {ident}"
            if isinstance(node, ast.ImportFrom) and node.module:
                assert not node.module.startswith(
                    (
                        "slake.engines.vllm.plugin",
                        "slake.engines.vllm",
                        "slake.engines.transformers",
                        "slake.engines.transformers",
                    )
                ), f"{path.name}:{node.lineno} imports {node.module}"


def _package(module: str) -> str:
    """The package a module belongs to, below ``slake`` (``slake.engines.vllm.plugin.paged`` -> ``engines``)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def test_packages_do_not_import_each_other_both_ways():
    """Two packages of slake (``cache`` and ``attention``, ``methods`` and ``budgets``, ...) never import each other
    in both directions: each pair has one direction, so that each package can be read with the ones below it."""
    edges = import_graph(_modules())
    pairs = {(_package(a), _package(b)) for a, targets in edges.items() for b in targets if _package(a) != _package(b)}
    both = sorted({tuple(sorted(p)) for p in pairs if (p[1], p[0]) in pairs})
    assert not both, f"packages that import each other: {both}"


def test_no_private_name_is_imported_across_packages():
    """``from slake.X.y import _name`` only within package X: a private helper is not an interface."""
    found = []
    for m, p in _modules().items():
        for node in ast.walk(ast.parse(p.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("slake."):
                for alias in node.names:
                    if alias.name.startswith("_") and _package(node.module) != _package(m):
                        found.append(f"{m}: from {node.module} import {alias.name}")
    assert not found, found
