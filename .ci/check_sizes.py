"""Check that every room stays one thing: no module of the package over 700 lines, no function over 80.

    python3 .ci/check_sizes.py        # exit 1 with one line per module or function too long

A file over ~700 lines is several things, and a function over 80 lines is several steps (DEVELOPERS.md). Argument
parsers (a function named ``build_parser``, or one whose body is mostly ``add_argument`` calls) are exempt: they are
one list of flags however long it grows. ``app.py`` counts with the package.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAX_MODULE_LINES = 700
MAX_FUNCTION_LINES = 80


def is_argument_parser(function: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    """A function that builds a command line's flags: named so, or mostly ``add_argument`` calls."""
    if function.name == "build_parser":
        return True
    calls = [node for node in ast.walk(function) if isinstance(node, ast.Call)]
    flags = [call for call in calls if isinstance(call.func, ast.Attribute) and call.func.attr == "add_argument"]
    return len(flags) >= 10 and len(flags) * 2 >= len(function.body)


def too_long(path: Path) -> list[str]:
    """One line per module or function of ``path`` over its limit."""
    text = path.read_text()
    name = path.relative_to(ROOT)
    found = []
    lines = len(text.splitlines())
    if lines > MAX_MODULE_LINES:
        found.append(f"{name}: {lines} lines (at most {MAX_MODULE_LINES}): split it into the things it holds")
    for node in ast.walk(ast.parse(text, str(path))):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not is_argument_parser(node):
            length = (node.end_lineno or node.lineno) - node.lineno + 1
            if length > MAX_FUNCTION_LINES:
                found.append(f"{name}:{node.lineno} {node.name}: {length} lines (at most {MAX_FUNCTION_LINES}): "
                             "cut it into named steps")
    return found


def main() -> int:
    paths = sorted((ROOT / "specdemo").rglob("*.py")) + [ROOT / "app.py"]
    problems = [line for path in paths for line in too_long(path)]
    for line in problems:
        print(line)
    if not problems:
        print(f"Sizes: {len(paths)} modules, none over {MAX_MODULE_LINES} lines, no function over "
              f"{MAX_FUNCTION_LINES}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
