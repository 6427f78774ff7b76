"""The package's shape holds: no import cycle, small functions in the service layer, the pure
core free of shells, typed per-session state."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "server" / "compactd"
MAX_SERVICE_FUNCTION_LINES = 60


def _modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        if "v1" in parts:  # generated
            continue
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package's modules that ``name`` imports, typing-only imports included: a cycle a
    type checker must untangle is a cycle of the design too."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{parent}.{base}" if base else parent
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return {module for module in found if module in modules and module != name}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of ``graph``, or None."""
    done: set[str] = set()
    path: list[str] = []
    on_path: set[str] = set()

    def visit(module: str) -> list[str] | None:
        path.append(module)
        on_path.add(module)
        for imported in sorted(graph[module]):
            if imported in on_path:
                return [*path[path.index(imported) :], imported]
            if imported not in done:
                found = visit(imported)
                if found is not None:
                    return found
        on_path.discard(path.pop())
        done.add(module)
        return None

    for module in sorted(graph):
        if module not in done:
            found = visit(module)
            if found is not None:
                return found
    return None


def _package_parents(graph: dict[str, set[str]]) -> None:
    """A package's ``__init__`` runs before any of its modules: importing ``a.b`` imports
    ``a`` too. A package that re-exports its modules is no cycle with them, so an edge into a
    package module's own package (``a.b`` -> ``a``) is dropped."""
    for module, imported in graph.items():
        graph[module] = {other for other in imported if not module.startswith(f"{other}.")}


def test_no_module_of_the_package_imports_itself_through_others() -> None:
    modules = _modules()
    graph = {name: _imports(name, path, modules) for name, path in modules.items()}
    _package_parents(graph)
    assert _cycle(graph) is None


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_the_core_imports_no_shell() -> None:
    # The domain core is pure: it may use the error tree, the reasons, the generated messages
    # and the speed helpers, never the service, the store, the API or a provider.
    modules = _modules()
    shells = ("compactd.service", "compactd.store", "compactd.api", "compactd.providers")
    for name, path in modules.items():
        if name.startswith("compactd.core"):
            imported = _imports(name, path, modules)
            assert not [m for m in imported if m.startswith(shells)], name


def test_every_function_of_the_service_layer_is_short() -> None:
    long = []
    for path in (PACKAGE / "service").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = (node.end_lineno or node.lineno) - node.lineno + 1
                if lines >= MAX_SERVICE_FUNCTION_LINES:
                    long.append(f"{path.relative_to(PACKAGE)}:{node.lineno} {node.name} {lines}")
    assert long == []


def test_per_session_state_is_typed_not_keyed_by_strings() -> None:
    # One SessionContext per session (service.context), not a dict several modules fill.
    keyed = [
        f"{path.relative_to(PACKAGE)}"
        for path in PACKAGE.rglob("*.py")
        if "extensions[" in path.read_text(encoding="utf-8")
    ]
    assert keyed == []
