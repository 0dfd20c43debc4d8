"""The package's shape: module sizes, the import graph, and a CLI that only parses and prints.

The import graph is read from the source (every ``import``, at module level or inside a
function, except those under ``if TYPE_CHECKING:``), so a lazy import cannot hide a cycle.
"""

from __future__ import annotations

import ast
import importlib
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
# source folder -> import name (passes/ and backends/ install as looptool.passes / looptool.backends)
TREES = {"looptool": "looptool", "passes": "looptool.passes", "backends": "looptool.backends"}
MAX_LINES = 500


def modules() -> dict[str, pathlib.Path]:
    """Every module of the package: import name -> file."""
    found = {}
    for folder, prefix in TREES.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = list(path.relative_to(ROOT / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join([prefix, *parts])] = path
    return found


def _type_checking_only(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def imports_of(path: pathlib.Path, name: str, known: set[str]) -> set[str]:
    """The looptool modules ``path`` imports (the deepest known module each import names)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    targets: set[str] = set()

    def resolve(dotted: str) -> str | None:
        while dotted and dotted not in known:
            dotted = dotted.rpartition(".")[0]
        return dotted or None

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _type_checking_only(child):
                for alt in child.orelse:
                    visit(alt)
                continue
            if isinstance(child, ast.Import):
                for alias in child.names:
                    if alias.name.startswith("looptool"):
                        targets.add(resolve(alias.name))
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    anchor = package.split(".")[: len(package.split(".")) - child.level + 1]
                    base = ".".join(anchor + ([base] if base else []))
                if base.startswith("looptool"):
                    for alias in child.names:  # `from pkg import submodule` imports the submodule
                        full = f"{base}.{alias.name}"
                        targets.add(full if full in known else resolve(base))
            visit(child)

    visit(ast.parse(path.read_text()))
    targets.discard(None)
    targets.discard(name)
    return targets


def import_graph() -> dict[str, set[str]]:
    mods = modules()
    known = set(mods)
    return {name: imports_of(path, name, known) for name, path in mods.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as a list of modules, or None. A package's ``__init__`` importing its
    own submodules is how packages re-export, not a cycle: edges from a package into itself and
    from a submodule to one of its parent packages are left out."""
    def relevant(a: str, b: str) -> bool:
        return not (b.startswith(a + ".") or a.startswith(b + "."))

    state: dict[str, int] = {}
    stack: list[str] = []

    def dfs(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if not relevant(node, nxt) or nxt == "looptool":
                continue
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (cycle := dfs(nxt)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := dfs(node)):
            return cycle
    return None


def test_no_module_over_500_lines():
    long = {name: n for name, path in modules().items() if (n := len(path.read_text().splitlines())) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines: {long}"


def test_no_import_cycle():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_only_the_entry_points_import_the_top_package():
    """``looptool/__init__`` re-exports the public API, so a module that imports it imports
    everything; inside the package only the entry points (``__main__``, the CLI) may."""
    offenders = sorted(name for name, targets in import_graph().items()
                       if "looptool" in targets and name not in {"looptool", "looptool.__main__"} and not name.startswith("looptool.cli"))
    assert not offenders, f"modules importing the top-level package: {offenders}"


def test_the_cycle_check_catches_a_cycle():
    assert find_cycle({"looptool.a": {"looptool.b"}, "looptool.b": {"looptool.a"}}) == ["looptool.a", "looptool.b", "looptool.a"]
    assert find_cycle({"looptool.a": {"looptool.b"}, "looptool.b": set()}) is None


@pytest.mark.parametrize("name", sorted(set(modules()) - {"looptool.__main__"}))  # __main__ runs the CLI
def test_every_module_imports(name):
    if name.startswith("looptool.ops.kernels") or name == "looptool.backends.trt_plugins":
        pytest.importorskip("triton", reason="the Triton kernels need triton")
    importlib.import_module(name)
