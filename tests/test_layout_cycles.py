"""Import cycles between subpackages: the module graph of tests/test_layout.py (deferred imports
included, ``TYPE_CHECKING`` imports left out) folded onto looptool's subpackages has none, and
storage (the saved-model format) imports nothing from the runtime, which loads and saves
through it."""

from __future__ import annotations

from test_layout import find_cycle, import_graph


def package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """``graph`` folded onto subpackages (``looptool.<name>``): an edge where some module of
    one imports some module of another."""

    def package(module: str) -> str:
        return ".".join(module.split(".")[:2])

    folded: dict[str, set[str]] = {}
    for a, targets in graph.items():
        for b in targets:
            if package(a) != package(b) and package(b) != "looptool":
                folded.setdefault(package(a), set()).add(package(b))
    return folded


def crossing(graph: dict[str, set[str]], source: str, target: str) -> list[str]:
    """The imports of a module of package ``source`` from a module of package ``target``."""
    return sorted(
        f"{a} -> {b}"
        for a, targets in graph.items()
        if a.startswith(source + ".")
        for b in targets
        if b == target or b.startswith(target + ".")
    )


def test_storage_imports_nothing_from_the_runtime():
    upward = crossing(import_graph(), "looptool.storage", "looptool.runtime")
    assert not upward, "storage imports the runtime (the runtime loads and saves through storage):\n" + "\n".join(
        upward
    )


def test_runtime_and_storage_have_no_import_cycle_between_them():
    graph = import_graph()
    there = crossing(graph, "looptool.runtime", "looptool.storage")
    back = crossing(graph, "looptool.storage", "looptool.runtime")
    assert not (there and back), f"runtime and storage import each other: {there[0]} and {back[0]}"


def test_no_two_subpackages_import_each_other():
    cycle = find_cycle(package_graph(import_graph()))
    assert cycle is None, "subpackage import cycle: " + " -> ".join(cycle)


def test_the_package_cycle_check_catches_a_cycle():
    modules = {
        "looptool.runtime.model": {"looptool.storage.save"},
        "looptool.storage.load": {"looptool.runtime.convert"},
        "looptool.storage.save": set(),
        "looptool.runtime.convert": {"looptool.runtime.model"},
    }
    assert find_cycle(modules) is None  # acyclic module by module
    assert find_cycle(package_graph(modules)) == ["looptool.runtime", "looptool.storage", "looptool.runtime"]
    assert crossing(modules, "looptool.storage", "looptool.runtime") == [
        "looptool.storage.load -> looptool.runtime.convert"
    ]
