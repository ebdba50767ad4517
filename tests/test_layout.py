"""The package's layout holds: no import cycles between our modules, nothing under ``runner/``,
``hub/`` or ``wire/`` imports ``ops/`` (the operator's tools sit on top of them), no import goes
up (the layers below import nothing of those above; a subpackage imports no module of an
enclosing package that imports it), a module that calls itself pure (or sans-IO) in its
docstring imports no trio (nor anything that does), every module says its job in a docstring,
and ``docs/layout.md`` is the tree those docstrings make.

``python tests/test_layout.py`` writes ``docs/layout.md`` again after a module is added, moved or
its docstring changed; ``python tests/test_layout.py --depth`` prints the longest import chain
among the hub's modules.
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "gateway"
LAYOUT = ROOT / "docs" / "layout.md"
PURE = re.compile(r"\b(pure|sans-IO)\b", re.IGNORECASE)


def _modules() -> dict[str, Path]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


MODULES = _modules()


def _type_checking(node: ast.AST) -> bool:
    return (
        isinstance(node, ast.If)
        and isinstance(node.test, ast.Name)
        and node.test.id == "TYPE_CHECKING"
    )


def _imports(name: str, *, type_checking: bool = False) -> set[str]:
    """The modules ``name`` imports, at any depth of its code (lazy imports included), and those
    under ``if TYPE_CHECKING:`` only when ``type_checking``; ours by their module name, others by
    their top package."""
    tree = ast.parse(MODULES[name].read_text())
    package = name if MODULES[name].name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    stack: list[ast.AST] = [tree]
    while stack:
        node = stack.pop()
        if _type_checking(node) and not type_checking:
            continue
        stack.extend(ast.iter_child_nodes(node))
        if isinstance(node, ast.Import):
            for alias in node.names:
                found.add(alias.name if alias.name in MODULES else alias.name.split(".")[0])
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1])
                base = f"{base}.{node.module}" if node.module else base
            if base not in MODULES:
                found.add(base.split(".")[0])
                continue
            # ``from package import module`` imports the module; a package's own ``__init__``
            # runs before any of its modules anyway, so it counts only when names come from it
            subs = {f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in MODULES}
            found |= subs
            if len(subs) < len(node.names):
                found.add(base)
    found.discard(name)
    return found


GRAPH = {name: _imports(name) for name in MODULES}
# with the imports made only for the type checker: a cycle there is a cycle of the design
FULL_GRAPH = {name: _imports(name, type_checking=True) for name in MODULES}
MAX_LINES = 600  # a module's bound, but for the settings' declarations and the simulator
LONG_ALLOWED = ("gateway.config", "gateway.sim.")


# (module, what it imports of ops/) allowed for now: none
_UPWARD_PENDING: set[tuple[str, str]] = set()
_BELOW_OPS = ("gateway.runner", "gateway.hub", "gateway.wire")


def _under(name: str, packages: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in packages)


def _docstring(name: str) -> str:
    return ast.get_docstring(ast.parse(MODULES[name].read_text())) or ""


def test_no_import_cycles() -> None:
    """Depth-first search over our modules' imports, those made only for the type checker
    included; a cycle is reported as its path."""
    state: dict[str, int] = {}
    cycles: list[list[str]] = []

    def visit(name: str, path: list[str]) -> None:
        state[name] = 1
        for dep in sorted(FULL_GRAPH[name]):
            if dep not in MODULES:
                continue
            if state.get(dep) == 1:
                cycles.append([*path[path.index(dep) :], dep] if dep in path else [name, dep])
            elif dep not in state:
                visit(dep, [*path, dep])
        state[name] = 2

    for name in MODULES:
        if name not in state:
            visit(name, [name])
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_every_module_is_under_600_lines() -> None:
    long = {
        name: n
        for name, path in MODULES.items()
        if (n := len(path.read_text().splitlines())) > MAX_LINES
        and not name.startswith(LONG_ALLOWED)
    }
    assert not long, f"modules over {MAX_LINES} lines: {long}"


def test_nothing_below_ops_imports_ops() -> None:
    """``ops/`` (doctor, status, the demo) is built on the runner, the hub and ``wire/``; an import
    the other way (type-checking ones included) makes the packages a loop."""
    upward = {
        (name, dep)
        for name in MODULES
        if _under(name, _BELOW_OPS)
        for dep in _imports(name, type_checking=True)
        if _under(dep, ("gateway.ops",))
    }
    assert upward <= _UPWARD_PENDING, f"imports of gateway.ops: {sorted(upward - _UPWARD_PENDING)}"
    gone = _UPWARD_PENDING - upward
    assert not gone, f"no longer there, take them out of _UPWARD_PENDING: {sorted(gone)}"


# a layer and what it never imports (type-checking imports included): ``wire/`` is the bytes on
# the wire, ``apis/`` the client APIs as chat completions (pure), both under the runner and the hub
_LAYERS_BELOW: dict[str, tuple[str, ...]] = {
    "gateway.wire": ("gateway.apis", "gateway.hub", "gateway.runner", "gateway.ops", "gateway.sim"),
    "gateway.apis": ("trio", "gateway.hub", "gateway.runner", "gateway.ops", "gateway.sim"),
    "gateway.runner": ("gateway.hub", "gateway.ops", "gateway.sim"),
    "gateway.hub": ("gateway.runner", "gateway.ops", "gateway.sim"),
}


def test_the_layers_below_import_nothing_of_those_above() -> None:
    """``gateway/apis`` (the three APIs' translations) imports no trio and nothing of the hub,
    the runner or ``ops/``; ``gateway/wire`` nothing of them or of ``apis/``; the runner and the
    hub nothing of each other."""
    found = {
        (name, dep)
        for layer, above in _LAYERS_BELOW.items()
        for name in MODULES
        if _under(name, (layer,))
        for dep in FULL_GRAPH[name]
        if _under(dep, above)
    }
    assert not found, f"imports of a layer above: {sorted(found)}"


def _package(name: str) -> str:
    """The package ``name`` is in (a package's ``__init__``: the package itself)."""
    return name if MODULES[name].name == "__init__.py" else name.rpartition(".")[0]


def _reached(name: str) -> set[str]:
    """Our modules ``name`` imports, directly or not (type-checking imports included)."""
    seen: set[str] = set()
    stack = [name]
    while stack:
        for dep in FULL_GRAPH[stack.pop()]:
            if dep in MODULES and dep not in seen:
                seen.add(dep)
                stack.append(dep)
    return seen


def upward_imports() -> set[tuple[str, str]]:
    """(module, what it imports) where a module of a subpackage imports a module of an enclosing
    package that imports that subpackage, directly or not: the two packages then lean on each
    other (``hub/frontdoor/door.py`` importing ``hub/serving.py`` while ``hub/turn.py`` imported
    ``hub/frontdoor/``, before issue 38)."""
    found = set()
    for name in MODULES:
        inner = _package(name)
        for dep in FULL_GRAPH[name]:
            if dep not in MODULES or not inner.startswith(_package(dep) + "."):
                continue
            if any(_under(m, (inner,)) for m in _reached(dep)):
                found.add((name, dep))
    return found


def test_no_subpackage_imports_a_module_that_imports_it() -> None:
    assert not upward_imports(), f"upward imports: {sorted(upward_imports())}"


def longest_chain(package: str, *, direct: bool = False) -> list[str]:
    """The longest chain of imports among the modules under ``package`` (``direct``: only those
    directly in it, not in its subpackages; the graph is acyclic: ``test_no_import_cycles``)."""
    inside = [n for n in MODULES if (_package(n) == package if direct else _under(n, (package,)))]
    memo: dict[str, list[str]] = {}

    def chain(name: str) -> list[str]:
        if name not in memo:
            below = [chain(d) for d in sorted(GRAPH[name]) if d in memo or d in inside]
            memo[name] = [name, *max(below, key=len, default=[])]
        return memo[name]

    return max((chain(n) for n in inside), key=len, default=[])


def _reaches(name: str, target: str) -> list[str] | None:
    """A chain of imports from ``name`` to the package ``target``, or None."""
    seen = {name}
    queue = [[name]]
    while queue:
        chain = queue.pop(0)
        for dep in sorted(GRAPH.get(chain[-1], ())):
            if dep == target:
                return [*chain, dep]
            if dep in MODULES and dep not in seen:
                seen.add(dep)
                queue.append([*chain, dep])
    return None


def test_pure_modules_import_no_trio() -> None:
    pure = [n for n in MODULES if PURE.search(_docstring(n))]
    # the ones the design leans on say so; a new pure module joins by saying so too
    expected_pure = ("gateway.wire.sse", "gateway.wire.wsframes", "gateway.apis.dialects")
    for expected in (*expected_pure, "gateway.apis.chunks", "gateway.apis.continuation"):
        assert expected in pure, f"{expected}'s docstring no longer says it is pure"
    chains = {n: _reaches(n, "trio") for n in pure}
    assert not {n: c for n, c in chains.items() if c}, chains


def test_every_module_says_its_job() -> None:
    silent = [n for n in MODULES if not _docstring(n).strip() and not n.endswith("__main__")]
    assert not silent, f"modules without a docstring: {silent}"


def render() -> str:
    """``docs/layout.md``: the package as a tree, one line per module (its docstring's first
    sentence)."""
    lines = [
        "# Layout",
        "",
        "The `gateway` package, one line per module: the first sentence of its docstring.",
        "Generated by `python tests/test_layout.py`; `tests/test_layout.py` checks it.",
        "",
        "```",
    ]
    for name, path in MODULES.items():
        rel = path.relative_to(ROOT)
        depth = len(rel.parts) - 1
        doc = " ".join(_docstring(name).split())
        first = re.split(r"(?<=\.)\s", doc, maxsplit=1)[0] if doc else ""
        if len(first) > 100:
            first = first[:100].rsplit(" ", 1)[0] + " …"
        shown = f"{rel.parent.name}/" if path.name == "__init__.py" else path.name
        indent = "    " * (depth - (1 if path.name == "__init__.py" else 0))
        lines.append(f"{indent}{shown:<{max(1, 22 - len(indent))}} {first}".rstrip())
    lines += ["```", ""]
    return "\n".join(lines)


def test_layout_doc_is_current() -> None:
    assert LAYOUT.exists() and LAYOUT.read_text() == render(), "run: python tests/test_layout.py"


def _depth_report() -> str:
    lines = []
    for package, direct in (("gateway.hub", True), ("gateway.hub", False), ("gateway", False)):
        count = sum(
            1 for n in MODULES if (_package(n) == package if direct else _under(n, (package,)))
        )
        chain = longest_chain(package, direct=direct)
        lines.append(
            f"{package} ({'its own modules' if direct else 'with its subpackages'}): {count} "
            f"modules, the longest import chain {len(chain)} deep: {' -> '.join(chain)}"
        )
    lines.append(f"upward imports: {sorted(upward_imports()) or 'none'}")
    return "\n".join(lines)


if __name__ == "__main__":
    if sys.argv[1:] == ["--depth"]:
        print(_depth_report())
    else:
        LAYOUT.write_text(render())
        print(f"wrote {LAYOUT.relative_to(ROOT)}", file=sys.stderr)
