"""The marker that keeps a test out of ``make test-oldest`` says the truth.

``make test-oldest`` runs the unit tier again with the oldest transformers the project allows. A test module marked
``transformers_free`` runs the same code under either transformers (the fused kernels in Triton's interpreter, the
methods' tensor math), so that tier skips it. The mark is checked here, for every module that carries it: nothing
it imports, at any level, reaches a file that imports transformers (followed through src/, benchmarks/ and the
tests' helper modules, function-level imports included), no test in it asks for a fixture that builds a model, and
it starts no subprocess (which could load anything)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
SRC = TESTS.parent / "src"
BENCHMARKS = TESTS.parent / "benchmarks"
MARK = "transformers_free"
#: what :func:`imported_modules` reports for an import whose module is computed at run time
DYNAMIC = "<import_module>"


def _marked(tree: ast.Module) -> bool:
    """Whether the module sets ``pytestmark`` to (a list holding) ``pytest.mark.transformers_free``."""
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "pytestmark" for t in node.targets):
            return any(isinstance(n, ast.Attribute) and n.attr == MARK for n in ast.walk(node.value))
    return False


def marked_modules() -> list[Path]:
    return sorted(p for p in TESTS.glob("test_*.py") if _marked(ast.parse(p.read_text(encoding="utf-8"))))


def imported_modules(tree: ast.Module, *, run_on_import: bool = False) -> set[str]:
    """Every absolute module an ``import`` or ``from ... import`` names, with each name a ``from`` import takes as a
    possible submodule (``from slake import methods``: ``slake`` and ``slake.methods``), and :data:`DYNAMIC` for an
    ``import_module`` or ``__import__`` call (whatever it loads cannot be read off the file); imports under
    ``if TYPE_CHECKING:`` never run and are left out. All of them, inside functions included (a caller may call
    those functions), or with ``run_on_import`` only those that importing the module runs (not inside a function)."""
    out: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            for child in node.orelse:
                visit(child)
            return
        if run_on_import and isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            return
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.add(node.module)
            out.update(f"{node.module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Call) and ast.unparse(node.func).split(".")[-1] in {"import_module", "__import__"}:
            out.add(DYNAMIC)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return out


def model_fixtures() -> set[str]:
    """The fixtures of conftest.py whose body builds a model (calls a function from ``tiny_models``)."""
    tree = ast.parse((TESTS / "conftest.py").read_text(encoding="utf-8"))
    builders = {
        alias.asname or alias.name
        for node in tree.body
        if isinstance(node, ast.ImportFrom) and node.module == "tiny_models"
        for alias in node.names
    }
    out = set()
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and any("fixture" in ast.unparse(d) for d in node.decorator_list):
            calls = {getattr(c.func, "id", None) for c in ast.walk(node) if isinstance(c, ast.Call)}
            if calls & builders:
                out.add(node.name)
    return out


def loads_transformers(modules: set[str]) -> list[str]:
    """The files of src/, benchmarks/ and tests/ that ``modules`` reach and that import transformers themselves (or a
    module computed at run time), as ``module: transformers...``. A module named by an import is followed through
    all its imports, function-level ones included (the importer may call any of its functions), and so is every
    module it reaches; a package whose
    ``__init__`` only runs because a module below it is imported is followed through what that import runs, and no
    further (nothing calls its functions unless it is imported by name, and then it is followed whole). Empty:
    importing ``modules`` and calling anything in them loads no transformers, unless a third-party package does."""
    src = {".".join(p.relative_to(SRC).with_suffix("").parts).removesuffix(".__init__"): p for p in SRC.rglob("*.py")}
    # the repository's benchmarks package, which tests import as ``benchmarks.<module>``
    bench = {
        ".".join(p.relative_to(BENCHMARKS.parent).with_suffix("").parts).removesuffix(".__init__"): p
        for p in BENCHMARKS.glob("*.py")
    }
    files = {**src, **bench, **{p.stem: p for p in TESTS.glob("*.py")}}
    seen: set[tuple[str, bool]] = set()
    todo = [(name, False) for name in modules]
    bad = []
    while todo:
        name, only_import = todo.pop()
        if (name, only_import) in seen or (name, False) in seen:
            continue
        seen.add((name, only_import))
        if name in files:
            parts = name.split(".")
            todo.extend((".".join(parts[:i]), True) for i in range(1, len(parts)) if name in src)
            tree = ast.parse(files[name].read_text(encoding="utf-8"))
            direct = imported_modules(tree, run_on_import=only_import)
            todo.extend((m, only_import) for m in direct)
            bad.extend(f"{name}: {m}" for m in sorted(direct) if m.split(".")[0] == "transformers" or m == DYNAMIC)
        elif name.split(".")[0] == "transformers":
            bad.append(name)
    return sorted(set(bad))


def test_the_benchmarks_package_is_followed():
    """A test importing ``benchmarks.host_step`` (whose model is transformers' Llama) reaches transformers: the
    check follows the repository's benchmarks package as it follows src/ (it did not, and a marked module that ran
    the host-step benchmark passed it)."""
    assert any(b.startswith("benchmarks.host_step: transformers") for b in loads_transformers({"benchmarks.host_step"}))


def test_the_marker_is_set_where_expected():
    """The kernels' equality tests carry it (a check that the AST reading finds the mark at all)."""
    assert TESTS / "test_fused_decode.py" in marked_modules()
    assert TESTS / "test_fused_decode_models.py" not in marked_modules()
    assert "llama_gqa" in model_fixtures()


@pytest.mark.parametrize("path", marked_modules(), ids=lambda p: p.name)
def test_a_transformers_free_module_never_loads_transformers(path):
    tree = ast.parse(path.read_text(encoding="utf-8"))
    imports = imported_modules(tree)
    assert "subprocess" not in imports
    assert loads_transformers(imports) == []
    fixtures = model_fixtures()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and node.name.startswith("test"):
            assert not {a.arg for a in node.args.args} & fixtures, f"{node.name} asks for a model"


def test_the_check_follows_imports_down_to_a_file_that_loads_transformers():
    """A test helper that imports transformers inside a function, and a package that imports the transformers
    engine inside a function, are both seen; the methods' tensor math (whose packages' ``__init__`` files hold
    such functions but do not run them on import) is not flagged."""
    assert "transformers" in loads_transformers({"tiny_models"})
    assert any(b.startswith("slake.engines.transformers") for b in loads_transformers({"slake.engines"}))
    assert loads_transformers({"slake.methods", "slake.kernels", "torch"}) == []
    assert loads_transformers({"slake"}) == [f"slake: {DYNAMIC}"]  # its lazy public names (SlakeCache...)
