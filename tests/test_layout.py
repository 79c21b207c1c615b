"""The house rules of the layout (docs/architecture.md, "Layout"), checked on the source itself.

The import graph is read from every module's AST, imports inside functions and under
``TYPE_CHECKING`` included: a cycle hidden in a function body is still a cycle for a reader.
"""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("kvroute", "loadtest", "router", "policies")

#: router's wings from top to bottom: a module may import its own wing and any wing below it.
#: Each wing's settings module (the types of its config sections) sits below every wing, with
#: ``router.config``, which only assembles them; settings modules import nothing above them.
SETTINGS = "settings"
ROUTER_LAYERS = (
    "router.http",
    "router.request_path",
    "router.kv_events",
    "router.fleet",
    "router.index",
    "router.redis",
    SETTINGS,
    "router.metrics",
    "router.tasks",
    "router.errors",
    "router.exports",
)
WINGS = ("http", "request_path", "kv_events", "fleet", "index", "redis")


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, name: str, modules: set[str]) -> set[str]:
    """First-party modules ``path`` imports (``from pkg import mod`` counts as ``pkg.mod``)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    is_package = path.name == "__init__.py"
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = name.split(".")[: len(name.split(".")) - node.level + (1 if is_package else 0)]
                base = ".".join([*anchor, base] if base else anchor)
            targets = [f"{base}.{alias.name}" for alias in node.names] + [base]
        else:
            continue
        for target in targets:
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def _graph() -> dict[str, set[str]]:
    files = {_module_name(p): p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")}
    modules = set(files)
    graph = {name: _imports(path, name, modules) for name, path in files.items()}
    # A package's __init__ is imported along with any of its modules; only explicit edges count.
    return graph


GRAPH = _graph()


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for succ in graph.get(node, ()):
            if succ not in index:
                visit(succ)
                low[node] = min(low[node], low[succ])
            elif succ in on_stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def _package_of(module: str) -> str:
    return module.split(".")[0]


def _layer(module: str) -> int | None:
    if module == "router.config" or (module.startswith("router.") and module.endswith(".settings")):
        return ROUTER_LAYERS.index(SETTINGS)
    for rank, prefix in enumerate(ROUTER_LAYERS):
        if module == prefix or module.startswith(prefix + "."):
            return rank
    return None


def test_the_graph_sees_every_package() -> None:
    assert {_package_of(m) for m in GRAPH} == set(PACKAGES)
    assert "router.request_path.dispatch" in GRAPH["router.http.app"]


def test_no_module_imports_in_a_circle() -> None:
    assert _cycles(GRAPH) == []


@pytest.mark.parametrize(
    ("package", "forbidden"),
    [
        ("policies", {"router", "loadtest", "kvroute"}),
        ("router", {"loadtest", "kvroute"}),
        ("loadtest", {"kvroute"}),
    ],
)
def test_imports_run_one_way_down(package: str, forbidden: set[str]) -> None:
    upward = sorted(
        f"{module} -> {target}"
        for module, targets in GRAPH.items()
        if _package_of(module) == package
        for target in targets
        if _package_of(target) in forbidden
    )
    assert upward == []


def test_every_router_module_sits_in_a_wing() -> None:
    homeless = sorted(m for m in GRAPH if m.startswith("router.") and _layer(m) is None)
    assert homeless == []


def test_router_wings_import_only_their_own_or_lower_wings() -> None:
    upward = sorted(
        f"{module} -> {target}"
        for module, targets in GRAPH.items()
        if (rank := _layer(module)) is not None
        for target in targets
        if (target_rank := _layer(target)) is not None and target_rank < rank
    )
    assert upward == []


@pytest.mark.parametrize("wing", WINGS)
def test_each_wing_exports_its_public_names(wing: str) -> None:
    package = importlib.import_module(f"router.{wing}")
    assert package.__all__, f"router.{wing} exports nothing"
    for name in package.__all__:
        assert getattr(package, name) is not None
    with pytest.raises(AttributeError, match="no attribute 'nothing_of_that_name'"):
        package.nothing_of_that_name  # noqa: B018


def test_loading_the_config_imports_no_wing_beyond_its_settings() -> None:
    """The config imports each wing's settings; the wings' exports must not drag the rest in."""
    probe = (
        "import sys, router.config; "
        "print(sorted(m for m in sys.modules if m.startswith('router.') and m.count('.') > 1 "
        "and not m.endswith('.settings')))"
    )
    loaded = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True, cwd=ROOT
    )
    assert loaded.stdout.strip() == "[]"
