"""Every third-party module that src/ or tests/ imports is declared in pyproject.toml.

A test that imports a package which only the developer's machine has passes there and fails on a
fresh one (issue: `jsonschema` was imported by two test files and declared nowhere). This check
reads the imports with `ast`, maps each top-level module to the distributions that provide it
(`importlib.metadata.packages_distributions`), and requires one of them to be declared *directly*
in the dependency set the file may use: a transitive dependency can vanish with an upgrade.
"""

from __future__ import annotations

import ast
import importlib.metadata
import re
import sys
import tomllib
from collections.abc import Iterable, Mapping
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# Which extras (beyond the runtime dependencies) a file may import from, by path prefix. The
# first match wins. src/myserve/testing/ holds the shared test fakes (built with transformers and
# torch), so only tests import it; frontend/tracing.py is imported only when tracing is on, and
# models/native_checkpoint.py imports TensorStore only when an Orbax or Levanter checkpoint is read;
# src/myserve/ray/ runs only on Ray Serve (ray.replicas).
EXTRAS_BY_PREFIX: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("src/myserve/bench/", ("bench",)),
    ("src/myserve/testing/", ("test",)),
    ("src/myserve/frontend/tracing.py", ("otel",)),
    ("src/myserve/models/native_checkpoint.py", ("jax-checkpoints",)),
    ("src/myserve/ray/", ("ray",)),
    ("src/", ()),
    ("tests/", ("test",)),
)


def _normalize(name: str) -> str:
    """PEP 503 normalized distribution name."""
    return re.sub(r"[-_.]+", "-", name).lower()


def _requirement_name(requirement: str) -> str:
    return _normalize(re.split(r"[\s<>=!~;\[]", requirement, maxsplit=1)[0])


def declared_dependencies(pyproject: Path) -> dict[str, set[str]]:
    """{"": runtime dependencies, extra: its dependencies} as normalized distribution names."""
    project = tomllib.loads(pyproject.read_text())["project"]
    declared = {"": {_requirement_name(r) for r in project.get("dependencies", [])}}
    for extra, requirements in project.get("optional-dependencies", {}).items():
        declared[extra] = {_requirement_name(r) for r in requirements}
    return declared


def imported_top_level_modules(source: str) -> set[str]:
    """Top-level names of every absolute import in `source`, at any depth (lazy imports too)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def undeclared_imports(
    files: Iterable[tuple[str, str]],
    declared: Mapping[str, set[str]],
    providers: Mapping[str, list[str]],
    first_party: set[str],
) -> list[str]:
    """One line per (file, module) whose module no allowed declared distribution provides.

    `files` are (path relative to the repository, source); `providers` maps a top-level module to
    the distributions that install it.
    """
    problems = []
    stdlib = set(sys.stdlib_module_names)
    for path, source in files:
        extras = next(extras for prefix, extras in EXTRAS_BY_PREFIX if path.startswith(prefix))
        allowed = set(declared[""]).union(*(declared.get(extra, set()) for extra in extras))
        for module in sorted(imported_top_level_modules(source) - stdlib - first_party):
            dists = {_normalize(d) for d in providers.get(module, [])}
            if not dists:
                problems.append(f"{path}: imports {module!r}, which no installed distribution provides")
            elif not dists & allowed:
                where = " or ".join(["dependencies", *(f"the {e!r} extra" for e in extras)])
                problems.append(f"{path}: imports {module!r} ({', '.join(sorted(dists))}), not declared in {where}")
    return problems


def _project_files() -> list[tuple[str, str]]:
    paths = sorted((ROOT / "src").rglob("*.py")) + sorted((ROOT / "tests").rglob("*.py"))
    return [(p.relative_to(ROOT).as_posix(), p.read_text()) for p in paths]


def test_every_imported_third_party_module_is_declared() -> None:
    first_party = {"myserve"} | {p.stem for p in (ROOT / "tests").glob("*.py")}
    problems = undeclared_imports(
        _project_files(),
        declared_dependencies(ROOT / "pyproject.toml"),
        importlib.metadata.packages_distributions(),
        first_party,
    )
    assert not problems, "undeclared imports:\n" + "\n".join(problems)


def test_the_check_names_an_installed_but_undeclared_module() -> None:
    # The case that broke a fresh machine: a test importing a package present on the developer's
    # machine (here: pytest, which is installed) but missing from the extras.
    files = [("tests/test_x.py", "import json\nimport pytest\nfrom myserve import config\n")]
    providers = {"pytest": ["pytest"]}
    assert undeclared_imports(files, {"": set(), "test": set()}, providers, {"myserve"}) == [
        "tests/test_x.py: imports 'pytest' (pytest), not declared in dependencies or the 'test' extra"
    ]
    assert undeclared_imports(files, {"": set(), "test": {"pytest"}}, providers, {"myserve"}) == []
    # src/ may not lean on the test extra, and an unknown module is named too.
    src = [("src/myserve/x.py", "def f():\n    import pytest, nowhere_to_be_found\n")]
    assert undeclared_imports(src, {"": set(), "test": {"pytest"}}, providers, {"myserve"}) == [
        "src/myserve/x.py: imports 'nowhere_to_be_found', which no installed distribution provides",
        "src/myserve/x.py: imports 'pytest' (pytest), not declared in dependencies",
    ]
