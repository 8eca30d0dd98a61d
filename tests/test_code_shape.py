"""The source stays readable in small pieces (the redesign's rule): no module in src/eyas over 400 lines, no function
over 80 (decorators and docstring included)."""

import ast
from pathlib import Path

SOURCE = Path(__file__).resolve().parents[1] / "src" / "eyas"
MOST_LINES, MOST_FUNCTION_LINES = 400, 80


def test_no_module_over_400_lines_and_no_function_over_80():
    long_modules, long_functions = [], []
    for path in sorted(SOURCE.rglob("*.py")):
        text = path.read_text(encoding="utf-8")
        name = path.relative_to(SOURCE.parent)
        if (lines := len(text.splitlines())) > MOST_LINES:
            long_modules.append(f"{name}: {lines} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
                if (length := node.end_lineno - first + 1) > MOST_FUNCTION_LINES:
                    long_functions.append(f"{name}:{node.lineno} {node.name}: {length} lines")
    assert not long_modules, f"modules over {MOST_LINES} lines (split them by what they hold): {long_modules}"
    assert not long_functions, f"functions over {MOST_FUNCTION_LINES} lines (name their steps): {long_functions}"
