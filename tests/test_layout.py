"""The package layout holds: imports flow one way between the process and layer packages, no
module imports itself back through others (type-only imports included), and no source file
grows past 450 lines. Read with ``ast`` from the source tree (nothing is imported)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"

SHARED = {"config", "errors", "bundled", "tokenizer", "grammar", "validation", "subprocesses"}
"""The configuration package and the top-level modules either process may import: no JAX, no
process state."""

ALLOWED: dict[str, set[str]] = {
    # package -> the packages (or shared top-level modules) its modules may import
    "ops": {"ops", "errors"},
    "models": {"models", "ops", "errors", "bundled"},
    "runtime": {"runtime", "models", "ops", "config", "errors", "bundled", "tokenizer"},
    "wire": {"wire", "grammar", "errors"},
    "core": {"core", "runtime", "wire"} | SHARED,
    "frontend": {"frontend", "wire"} | SHARED,
    "config": {"config", "errors"},
    "errors": set(),
    "bundled": {"errors"},
    "tokenizer": {"errors", "models"},
    "grammar": {"errors"},
    "validation": {"grammar", "wire", "errors"},
    "subprocesses": set(),
    "client": {"client"},
}
"""Which way the flow runs: frontend -> wire <- core -> runtime -> models -> ops. The tokenizer
reads a GGUF file's metadata with ``models/gguf_file.py`` (plain numpy). Packages not listed
(``entrypoints``: the programs, ``bench``, ``testing``, ``ray``, and the ``python -m`` forwarders at
the top level) assemble the others and may import anything."""

ROOT_MODULES = {
    "__init__",
    "serve",  # python -m myserve.serve: forwards to entrypoints/serve.py
    "run_batch",  # python -m myserve.run_batch
    "generate",  # python -m myserve.generate
    "errors",
    "bundled",
    "tokenizer",
    "grammar",
    "validation",
    "subprocesses",
}
"""What the top level of the package holds: the forwarding modules of the documented ``python -m``
commands and the modules several process roles share (each docstring says which); the programs are
in ``entrypoints/``, the configuration in ``config/``, the rest in the package of its layer."""

MAX_LINES = 450


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path, name: str) -> set[str]:
    """The myserve modules ``path`` imports, anywhere in it (lazy and ``TYPE_CHECKING`` ones too)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join([*base, *([node.module] if node.module else [])])
            else:
                target = node.module or ""
            found.add(target)
            found.update(f"{target}.{alias.name}" for alias in node.names)  # `from pkg import module`
    return {m for m in found if m.split(".")[0] == "myserve"}


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    """Module -> the myserve modules it imports (names that are not modules are dropped)."""
    files = {_module_name(p): p for p in (SRC / "myserve").rglob("*.py")}
    edges = {name: {m for m in _imports(path, name) if m in files and m != name} for name, path in files.items()}
    return edges


def _package(module: str) -> str:
    """The layer or process package of a module (``myserve.core.scheduler`` -> ``core``)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def test_no_import_circles(graph: dict[str, set[str]]) -> None:
    """Tarjan's strongly connected components: every one must be a single module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    assert not circles, f"import circles: {circles}"


def test_imports_flow_one_way(graph: dict[str, set[str]]) -> None:
    wrong = [
        f"{module} imports {target}"
        for module, targets in sorted(graph.items())
        if _package(module) in ALLOWED
        for target in sorted(targets)
        if _package(target) not in ALLOWED[_package(module)] | {""}
    ]
    assert not wrong, "imports against the flow:\n" + "\n".join(wrong)


def test_the_layout_check_sees_a_wrong_import(graph: dict[str, set[str]]) -> None:
    # The checks above must be able to fail: a runtime module importing the core is caught, and
    # so is a circle through it.
    assert "myserve.runtime.executor" in graph and "myserve.core.engine_core" in graph
    bad = {**graph, "myserve.runtime.executor": graph["myserve.runtime.executor"] | {"myserve.core.engine_core"}}
    with pytest.raises(AssertionError, match="runtime.executor imports myserve.core.engine_core"):
        test_imports_flow_one_way(bad)
    with pytest.raises(AssertionError, match="import circles"):
        test_no_import_circles(bad)


def test_every_package_says_its_process_and_imports() -> None:
    for package in ("frontend", "wire", "core", "runtime", "models", "ops"):
        doc = ast.get_docstring(ast.parse((SRC / "myserve" / package / "__init__.py").read_text()))
        assert doc and "import" in doc and "process" in doc, f"myserve/{package}/__init__.py: {doc!r}"


def test_no_source_file_over_450_lines() -> None:
    long = {
        str(p.relative_to(SRC)): n
        for p in (SRC / "myserve").rglob("*.py")
        if (n := len(p.read_text().splitlines())) > MAX_LINES
    }
    assert not long, f"over {MAX_LINES} lines: {long}"


def test_the_package_root_holds_forwarders_and_shared_modules_only() -> None:
    root = {p.stem for p in (SRC / "myserve").glob("*.py")}
    assert root == ROOT_MODULES, (
        f"top-level modules: {sorted(root - ROOT_MODULES)} new, {sorted(ROOT_MODULES - root)} gone"
    )
    for name in ("serve", "run_batch", "generate"):
        text = (SRC / "myserve" / f"{name}.py").read_text()
        assert f"from myserve.entrypoints.{name} import main" in text and len(text.splitlines()) < 15, name
    for name in ROOT_MODULES - {"__init__", "serve", "run_batch", "generate"}:
        doc = ast.get_docstring(ast.parse((SRC / "myserve" / f"{name}.py").read_text())) or ""
        assert "Shared by" in doc or "shares" in doc, f"{name}.py does not say which processes share it"
