"""Check the package's import graph: no import circles, and every import goes down the layers.

    python3 .ci/check_layers.py        # exit 1 with one line per offending import

Layers, lowest first: core ← backends ← methods ← training, session ← render ← app and the command-line front
ends (bench, record, replay, __main__). A module may import its own layer or a lower one. Every import counts:
top-level, inside functions, and under ``TYPE_CHECKING``.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "specdemo"
#: the rank of each top-level part of the package (a module in the package's root is a front end)
LAYERS = {"core": 0, "backends": 1, "methods": 2, "training": 3, "session": 3, "render": 4, "app": 5}
FRONT_END = 6


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def layer(module: str) -> int:
    parts = module.split(".")
    if len(parts) == 1:  # the package itself
        return -1
    return LAYERS.get(parts[1], FRONT_END)


def imports_of(path: Path, module: str, known: set[str]) -> set[str]:
    """The package's modules ``path`` imports (a `from pkg import name` of a submodule counts as that module)."""
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            names = [source] + [f"{source}.{alias.name}" for alias in node.names]
        else:
            continue
        for name in names:
            while name and name not in known:
                name = name.rpartition(".")[0]
            if name and name != module:
                found.add(name)
    return found


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def main() -> int:
    paths = sorted((ROOT / PACKAGE).rglob("*.py"))
    modules = {module_name(p): p for p in paths}
    known = set(modules)
    graph: dict[str, set[str]] = {}
    problems: list[str] = []
    for module, path in modules.items():
        # a package's __init__ may gather its own submodules (the methods registry does)
        graph[module] = {m for m in imports_of(path, module, known) if not m.startswith(module + ".")}
        for target in sorted(imports_of(path, module, known)):
            if layer(target) > layer(module):
                problems.append(f"{module} imports {target}: an upward import ({path.relative_to(ROOT)})")
    cycle = find_cycle(graph)
    if cycle:
        problems.append("import circle: " + " -> ".join(cycle))
    for line in problems:
        print(line)
    if not problems:
        print(f"import graph: {len(modules)} modules, no circles, every import goes down the layers")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
