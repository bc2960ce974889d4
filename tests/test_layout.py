"""The package's module graph: imports at module level form no cycle, and the backend is
chosen in one module."""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parent.parent / "turbospark_mlx"


def _module_name(path: Path) -> str:
    parts = path.relative_to(PKG.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """Package modules `path` imports at module level (not inside functions)."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    out = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.startswith("turbospark_mlx"):
                out.add(target)
                out.update(f"{target}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.startswith("turbospark_mlx"))
    return out


def _graph() -> dict[str, set[str]]:
    modules = {_module_name(p): p for p in PKG.rglob("*.py")}
    return {m: {t for t in _imports(p) if t in modules and t != m} for m, p in modules.items()}


def test_no_import_cycles():
    graph = _graph()
    # A package's __init__ importing its own submodules is how packages re-export: not a cycle.
    edges = {m: {t for t in ts if not m.startswith(t + ".")} for m, ts in graph.items()}
    state: dict[str, int] = {}

    def visit(m, stack):
        state[m] = 1
        for t in edges[m]:
            if state.get(t) == 1:
                raise AssertionError(" -> ".join(stack[stack.index(t) :] + [t]))
            if t not in state:
                visit(t, stack + [t])
        state[m] = 2

    for m in edges:
        if m not in state:
            visit(m, [m])


def test_backend_chosen_in_one_module():
    users = [p for p in PKG.rglob("*.py") if "mx.metal.is_available" in p.read_text() or "mx.cuda.is_available" in p.read_text()]
    assert [p.relative_to(PKG).as_posix() for p in users] == ["gpu/backend.py"]
