"""Every test asserts something: an ``assert``, a ``pytest.raises``/``fail``, or a call to a helper that does."""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent
_CHECKS = ("raises", "fail", "warns")


def _called(node: ast.AST) -> set[str]:
    names = set()
    for call in ast.walk(node):
        if isinstance(call, ast.Call):
            func = call.func
            if isinstance(func, ast.Name):
                names.add(func.id)
            elif isinstance(func, ast.Attribute):
                names.add(func.attr)
    return names


def _checks_directly(node: ast.AST) -> bool:
    for sub in ast.walk(node):
        if isinstance(sub, ast.Assert):
            return True
        if (
            isinstance(sub, ast.Call)
            and isinstance(sub.func, ast.Attribute)
            and sub.func.attr in _CHECKS
            and isinstance(sub.func.value, ast.Name)
            and sub.func.value.id == "pytest"
        ):
            return True
    return False


def _functions() -> dict[str, list[tuple[Path, ast.FunctionDef | ast.AsyncFunctionDef]]]:
    found: dict[str, list[tuple[Path, ast.FunctionDef | ast.AsyncFunctionDef]]] = {}
    for path in sorted(TESTS.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                found.setdefault(node.name, []).append((path, node))
    return found


def test_every_test_function_asserts_something() -> None:
    functions = _functions()
    asserting = {
        name for name, defs in functions.items() if any(_checks_directly(d) for _, d in defs)
    }
    while True:  # helpers that call asserting helpers assert too
        more = {
            name
            for name, defs in functions.items()
            if name not in asserting and any(_called(d) & asserting for _, d in defs)
        }
        if not more:
            break
        asserting |= more
    silent = [
        f"{path.name}::{name}"
        for name, defs in functions.items()
        if name.startswith("test_")
        for path, _ in defs
        if path.name.startswith("test_") and name not in asserting
    ]
    assert not silent, f"these tests assert nothing: {silent}"


def test_the_check_finds_a_silent_test() -> None:
    tree = ast.parse("def test_x():\n    do_something()\n")
    assert not _checks_directly(tree)
    assert _checks_directly(ast.parse("def test_y():\n    assert 1\n"))
    assert _checks_directly(ast.parse("def test_z():\n    with pytest.raises(E):\n        f()\n"))
