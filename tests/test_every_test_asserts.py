"""Every test asserts something: an ``assert``, a ``pytest.raises``/``fail``, or a call to a helper that does."""

from __future__ import annotations

import ast
import tomllib
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
    for path in sorted(TESTS.rglob("*.py")):
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
        f"{path.relative_to(TESTS)}::{name}"
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


def _skips_without_reason(tree: ast.AST) -> list[int]:
    """Lines of ``pytest.skip()`` with no reason and ``pytest.mark.skip``/``skipif`` marks with
    no ``reason=`` (``-rs`` would print an empty or made-up reason for them)."""
    lines = []
    for call in ast.walk(tree):
        if not isinstance(call, ast.Call) or not isinstance(call.func, ast.Attribute):
            continue
        func, owner = call.func, call.func.value
        reasons = [k for k in call.keywords if k.arg == "reason"]
        if func.attr == "skip" and isinstance(owner, ast.Name) and owner.id == "pytest":
            if not call.args and not reasons:
                lines.append(call.lineno)
        elif func.attr in ("skip", "skipif") and isinstance(owner, ast.Attribute):
            if owner.attr == "mark" and not reasons:
                lines.append(call.lineno)
    return lines


def test_every_skip_says_why_and_pytest_prints_it() -> None:
    missing = [
        f"{path.relative_to(TESTS)}:{line}"
        for path in sorted(TESTS.rglob("*.py"))
        for line in _skips_without_reason(ast.parse(path.read_text(), str(path)))
    ]
    assert not missing, f"skips without a reason: {missing}"
    with (TESTS.parent / "pyproject.toml").open("rb") as f:
        addopts = tomllib.load(f)["tool"]["pytest"]["ini_options"]["addopts"].split()
    assert "-rs" in addopts, "pytest prints skip reasons only with -rs (or -ra)"
    assert _skips_without_reason(ast.parse("pytest.skip()\n@pytest.mark.skipif(x)\ndef f(): 0"))
    assert not _skips_without_reason(ast.parse("pytest.skip('why')\npytest.mark.skip(reason='r')"))
