"""The package's shape: module sizes, the import graph, and a CLI that only parses and prints.

The import graph is read from the source (every ``import``, at module level or inside a
function), so a lazy import cannot hide a cycle; the stage checks leave out the imports under
``if TYPE_CHECKING:`` (annotations name a type, they load nothing), the cycle check does not.
"""

from __future__ import annotations

import ast
import importlib
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
# source folder -> import name (passes/ and backends/ install as looptool.passes / looptool.backends)
TREES = {"looptool": "looptool", "passes": "looptool.passes", "backends": "looptool.backends"}


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
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def imports_of(path: pathlib.Path, name: str, known: set[str], type_checking: bool = False) -> set[str]:
    """The looptool modules ``path`` imports (the deepest known module each import names), with
    ``type_checking`` those under ``if TYPE_CHECKING:`` too."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    targets: set[str] = set()

    def resolve(dotted: str) -> str | None:
        while dotted and dotted not in known:
            dotted = dotted.rpartition(".")[0]
        return dotted or None

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _type_checking_only(child) and not type_checking:
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


def import_graph(type_checking: bool = False) -> dict[str, set[str]]:
    mods = modules()
    known = set(mods)
    return {name: imports_of(path, name, known, type_checking) for name, path in mods.items()}


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
                return stack[stack.index(nxt) :] + [nxt]
            if nxt not in state and (cycle := dfs(nxt)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := dfs(node)):
            return cycle
    return None


def test_no_import_cycle():
    cycle = find_cycle(import_graph(type_checking=True))
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_only_the_entry_points_import_the_top_package():
    """``looptool/__init__`` re-exports the public API, so a module that imports it imports
    everything; inside the package only the entry points (``__main__``, the CLI) may."""
    offenders = sorted(
        name
        for name, targets in import_graph().items()
        if "looptool" in targets
        and name not in {"looptool", "looptool.__main__"}
        and not name.startswith("looptool.cli")
    )
    assert not offenders, f"modules importing the top-level package: {offenders}"


def test_the_cycle_check_catches_a_cycle():
    assert find_cycle({"looptool.a": {"looptool.b"}, "looptool.b": {"looptool.a"}}) == [
        "looptool.a",
        "looptool.b",
        "looptool.a",
    ]
    assert find_cycle({"looptool.a": {"looptool.b"}, "looptool.b": set()}) is None


def test_the_cycle_check_reads_imports_for_type_checking(tmp_path):
    source = tmp_path / "a.py"
    source.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from looptool.b import X\n")
    known = {"looptool.a", "looptool.b"}
    assert imports_of(source, "looptool.a", known, type_checking=True) == {"looptool.b"}
    assert imports_of(source, "looptool.a", known) == set()


NEEDS_RAY = ("looptool.serve.ray.deployments", "looptool.serve.ray.router")  # import Ray: the ray step runs them


@pytest.mark.parametrize(
    "name",
    [
        pytest.param(name, marks=pytest.mark.ray) if name in NEEDS_RAY else name
        for name in sorted(set(modules()) - {"looptool.__main__"})  # __main__ runs the CLI
    ],
)
def test_every_module_imports(name):
    if (
        name.startswith(("looptool.ops.kernels", "looptool.ops.moe_kernels"))
        or name == "looptool.backends.tensorrt.plugins"
    ):
        pytest.importorskip("triton", reason="the Triton kernels need triton")
    importlib.import_module(name)


# The stages from the bottom up; a module may import its own stage and the stages below it.
# storage sits below the runtime: it reads and writes files and tensors duck-typed over the
# model, and the runtime loads and saves through it (rebuilding a model is runtime.convert's).
LAYERS = (
    ("core",),
    ("cache",),  # one keyed store type, an instance per kind; capture and backends keep their kinds' keys
    ("ops",),
    ("engine",),  # the step-engine interface; its registry names the runtimes by import path only
    ("capture",),
    ("passes",),
    ("storage",),
    ("runtime",),
    ("backends",),
    ("train",),
    ("posttrain",),
    ("report",),
    ("eval",),
    ("serve",),
    ("cli",),
)


def _stage(module: str) -> int | None:
    parts = module.split(".")
    if len(parts) < 2:
        return None  # the top-level package (the public API) and testing sit outside the stages
    for rank, names in enumerate(LAYERS):
        if parts[1] in names:
            return rank
    return None


def test_imports_point_down_the_stages():
    assert _stage("looptool.storage.load") < _stage("looptool.runtime.model")  # storage imports no runtime
    upward = sorted(
        f"{a} -> {b}"
        for a, targets in import_graph().items()
        for b in targets
        if _stage(a) is not None and _stage(b) is not None and _stage(b) > _stage(a)
    )
    assert not upward, "imports that point up the stages:\n" + "\n".join(upward)


# what serving may import from the runtime: its text helpers (incremental detokenising), no engine
SERVE_RUNTIME_HELPERS = {"looptool.runtime.text"}


def serve_crossings(graph: dict[str, set[str]], runtime_modules: set[str]) -> list[str]:
    """The imports of ``looptool.serve`` past the step-engine seam: a module of ``backends/``, a
    registered runtime's module (``runtime_modules``), a ``looptool.runtime`` module other than
    :data:`SERVE_RUNTIME_HELPERS`, or storage."""
    return sorted(
        f"{a} -> {b}"
        for a, targets in graph.items()
        if a == "looptool.serve" or a.startswith("looptool.serve.")
        for b in targets
        if b in runtime_modules
        or b.startswith(("looptool.backends", "looptool.storage"))
        or (b.startswith("looptool.runtime") and b not in SERVE_RUNTIME_HELPERS)
    )


def test_serving_reaches_runtimes_only_through_the_step_engine_seam():
    """``looptool.serve`` imports no module of ``backends/``, no ``looptool.runtime`` module
    but its text helpers (no engine: not the step engine, the model, its decode graphs or
    generation) and not storage (deferred imports included): it drives
    :class:`looptool.engine.StepEngine` and opens directories with
    :func:`looptool.engine.open_engine`."""
    from looptool.engine import RUNTIMES

    graph = import_graph()
    assert {"looptool.serve.app", "looptool.serve.scheduler", "looptool.serve.models"} <= set(graph)
    crossing = serve_crossings(graph, set(RUNTIMES.values()))
    assert not crossing, "serving imports past the step-engine seam:\n" + "\n".join(crossing)
    for runtime, module in RUNTIMES.items():  # every registered runtime implements the seam
        mod = importlib.import_module(module)
        assert all(callable(getattr(mod, f, None)) for f in ("detect", "describe", "open_dir")), runtime
        from looptool.engine import StepEngine

        engines = [v for v in vars(mod).values() if isinstance(v, type) and v is not StepEngine]
        assert any(issubclass(c, StepEngine) for c in engines), runtime


def test_the_seam_check_catches_a_crossing():
    runtime_modules = {"looptool.runtime.step_engine", "looptool.backends.ort.engine"}
    graph = {
        "looptool.serve.app": {"looptool.engine", "looptool.runtime.text"},
        "looptool.serve.models": {"looptool.backends.ort.engine", "looptool.runtime.model"},
        "looptool.serve.scheduler": {"looptool.runtime.step_engine", "looptool.storage.load"},
        "looptool.cli.serve": {"looptool.runtime.model"},  # not serving
    }
    assert serve_crossings(graph, runtime_modules) == [
        "looptool.serve.models -> looptool.backends.ort.engine",
        "looptool.serve.models -> looptool.runtime.model",
        "looptool.serve.scheduler -> looptool.runtime.step_engine",
        "looptool.serve.scheduler -> looptool.storage.load",
    ]
    assert not serve_crossings({"looptool.serve.text": {"looptool.runtime.text"}}, runtime_modules)


def test_every_subpackage_has_a_stage():
    packages = {name.split(".")[1] for name in modules() if name.count(".") >= 1}
    loose = sorted(p for p in packages - {"__main__", "testing"} if not any(p in names for names in LAYERS))
    assert not loose, f"subpackages or modules outside the stages: {loose}"


# ---------------------------------------------------------------------- backends: one subpackage each
BACKENDS = ("onnx", "ort", "tensorrt")  # one subpackage per backend
# what every backend shares, the only modules at the top of backends/: the decode interface,
# the engine manifest, the errors, and export/open by backend name (the dtype names are
# looptool.core.dtypes, shared with storage)
BACKENDS_SHARED = ("__init__", "engine_files", "engines", "errors", "interface", "manifest")


def test_backends_top_holds_only_shared_modules_and_one_subpackage_per_backend():
    top = ROOT / "backends"
    assert sorted(p.stem for p in top.glob("*.py")) == sorted(BACKENDS_SHARED)
    folders = sorted(p.name for p in top.iterdir() if p.is_dir() and any(p.glob("*.py")))
    assert folders == sorted(BACKENDS) and all((top / b / "__init__.py").is_file() for b in BACKENDS)


def _backend(module: str) -> str | None:
    """The backend subpackage ``module`` belongs to (``looptool.backends.<backend>...``), else None."""
    parts = module.split(".")
    return parts[2] if len(parts) > 3 and parts[:2] == ["looptool", "backends"] and parts[2] in BACKENDS else None


def private_crossings(path: pathlib.Path, name: str, known: set[str]) -> list[str]:
    """The private names (``_x``) module ``name`` takes from another backend subpackage: ``from
    other import _x``, ``from other import _module``, ``import other._module``, or ``m._x`` of a
    module ``m`` imported from another backend (deferred imports included)."""
    own = _backend(name)
    found: list[str] = []
    aliases: dict[str, str] = {}  # local name -> module of another backend

    def foreign(module: str) -> bool:
        return _backend(module) not in (None, own)

    def private(part: str) -> bool:
        return part.startswith("_") and not part.startswith("__")

    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                if foreign(full if full in known else node.module):
                    if private(alias.name) or any(private(p) for p in node.module.split(".")):
                        found.append(f"line {node.lineno}: from {node.module} import {alias.name}")
                    elif full in known:
                        aliases[alias.asname or alias.name] = full
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if foreign(alias.name) and any(private(p) for p in alias.name.split(".")):
                    found.append(f"line {node.lineno}: import {alias.name}")
                elif foreign(alias.name) and alias.asname:
                    aliases[alias.asname] = alias.name
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases:
            if private(node.attr):
                found.append(f"line {node.lineno}: {aliases[node.value.id]}.{node.attr}")
    return found


def test_no_backend_takes_a_private_name_from_another():
    """What two backends share is public, or lives in a shared module at the top of backends/."""
    mods = modules()
    known = set(mods)
    offenders = {
        name: found for name, path in mods.items() if _backend(name) and (found := private_crossings(path, name, known))
    }
    assert not offenders, f"private names taken across backends: {offenders}"


def test_the_private_crossing_check_catches_one(tmp_path):
    known = {"looptool.backends.ort.runtime", "looptool.backends.onnx.export", "looptool.backends.ort"}
    name = "looptool.backends.tensorrt.export"

    def check(source: str) -> list[str]:
        (tmp_path / "m.py").write_text(source)
        return private_crossings(tmp_path / "m.py", name, known)

    assert check("def f():\n    from looptool.backends.ort.runtime import _NUMPY_DTYPES")
    assert check("from looptool.backends.ort import runtime as r\nx = r._GPU_PROVIDERS")
    assert check("import looptool.backends.ort.runtime as r\nr._shared_cpu_arena()")
    assert not check("from looptool.backends.ort.runtime import Runtime")  # public
    assert not check("from looptool.backends.tensorrt.kernels import _x")  # its own subpackage
    assert not check("from looptool.core.graph import _x")  # not a backend


# ---------------------------------------------------------------------- caches keep no module state
MUTABLE_CALLS = {"dict", "list", "set", "Counter", "OrderedDict", "defaultdict", "deque", "Store", "Caches"}
MUTABLE_LITERALS = (ast.Dict, ast.List, ast.Set, ast.DictComp, ast.ListComp, ast.SetComp)


def cache_modules() -> list[pathlib.Path]:
    """The cache package and every module of a kind of cache (``*cache*.py``) in capture and backends."""
    return sorted(
        {
            *(ROOT / "looptool" / "cache").rglob("*.py"),
            *(ROOT / "looptool" / "capture").glob("*cache*.py"),
            *(ROOT / "backends").rglob("*cache*.py"),
        }
    )


def module_state(source: str) -> list[str]:
    """Module-level assignments of a mutable container (a dict, list or set literal or
    comprehension, ``dict()``/``list()``/``set()``/``Counter()``/``OrderedDict()``/
    ``defaultdict()``/``deque()``) or of a store (``Store(...)``, ``Caches(...)``), also under a
    module-level ``if``/``try``: a cache's entries and counts live in a
    :class:`looptool.cache.Caches`, not in a module."""
    found = []

    def visit(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, (ast.If, ast.Try, ast.With)):
                visit(node.body)
                visit(getattr(node, "orelse", []))
                for handler in getattr(node, "handlers", []):
                    visit(handler.body)
                visit(getattr(node, "finalbody", []))
                continue
            if isinstance(node, ast.Assign):
                value = node.value
            elif isinstance(node, ast.AnnAssign) and node.value is not None:
                value = node.value
            else:
                continue
            if isinstance(value, MUTABLE_LITERALS):
                found.append(f"line {node.lineno}: a {type(value).__name__} literal")
            elif isinstance(value, ast.Call):
                func = value.func
                name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
                if name in MUTABLE_CALLS:
                    found.append(f"line {node.lineno}: {name}(...)")

    visit(ast.parse(source).body)
    return found


def test_cache_modules_keep_no_module_level_state():
    assert len(cache_modules()) >= 8  # the package (3) and the five kinds' modules
    offenders = {
        str(path.relative_to(ROOT)): found for path in cache_modules() if (found := module_state(path.read_text()))
    }
    assert not offenders, f"cache modules holding state at module level: {offenders}"


def test_the_module_state_check_catches_state():
    assert module_state("STATS = collections.Counter()") and module_state("_memory: OrderedDict = OrderedDict()")
    assert module_state("_STORE = Store(KIND, root)") and module_state("x = {}") and module_state("x: list = []")
    assert module_state("seen = set()") and module_state("by_name = defaultdict(list)") and module_state("a = b = {1}")
    assert module_state("try:\n    import fcntl\nexcept ImportError:\n    LOCKS = {}")
    assert module_state("x = {k: 1 for k in 'ab'}")
    assert not module_state("FORMAT = 1") and not module_state("KINDS = ('a', 'b')")
    assert not module_state("CAPTURES = Kind('captures', 2)") and not module_state("log = logging.getLogger(x)")
    assert not module_state("def f():\n    seen = {}\n    return seen")  # a function's own
    assert not module_state("class C:\n    def __init__(self):\n        self.stats = Counter()")


# ---------------------------------------------------------------------- no module keeps state
MUTATORS = {
    "append",
    "appendleft",
    "add",
    "clear",
    "discard",
    "extend",
    "insert",
    "pop",
    "popitem",
    "popleft",
    "remove",
    "setdefault",
    "update",
}


def module_mutations(source: str) -> list[str]:
    """Where a function changes module-level state: a ``global`` statement, or an item
    assignment, item deletion or mutating method call (``append``, ``update``, ...) on a name
    the module binds and the function does not. What must live for the process is an object
    made once (``functools.cache``) or passed down, not a container a module changes."""
    tree = ast.parse(source)
    names = set()
    for node in tree.body:
        targets = (
            node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        )
        names |= {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
    found = set()
    for fn in ast.walk(tree):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        own = {a.arg for a in [*fn.args.posonlyargs, *fn.args.args, *fn.args.kwonlyargs]}
        for node in ast.walk(fn):
            if isinstance(node, ast.Global):
                found.add(f"line {node.lineno}: global {', '.join(node.names)}")
            elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
                for t in node.targets if isinstance(node, ast.Assign) else [node.target]:
                    own |= {t.id} if isinstance(t, ast.Name) else set()
        for node in ast.walk(fn):
            changed = None
            if isinstance(node, (ast.Assign, ast.AugAssign, ast.Delete)):
                for t in node.targets if isinstance(node, (ast.Assign, ast.Delete)) else [node.target]:
                    if isinstance(t, ast.Subscript) and isinstance(t.value, ast.Name):
                        changed = t.value.id
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                if node.func.attr in MUTATORS and isinstance(node.func.value, ast.Name):
                    changed = node.func.value.id
            if changed in names and changed not in own:
                found.add(f"line {node.lineno}: changes {changed}")
    return sorted(found)


def test_no_module_keeps_mutable_state():
    offenders = {name: found for name, path in modules().items() if (found := module_mutations(path.read_text()))}
    assert not offenders, f"modules whose functions change module-level state: {offenders}"


def test_the_mutable_state_check_catches_state():
    assert module_mutations("X = {}\ndef f():\n    X['a'] = 1")
    assert module_mutations("X: list = []\ndef f():\n    X.append(1)")
    assert module_mutations("N = 0\ndef f():\n    global N\n    N += 1")
    assert module_mutations("X = {}\nclass C:\n    def f(self):\n        del X['a']")
    assert not module_mutations("X = {}\ndef f():\n    X = {}\n    X['a'] = 1")  # the function's own
    assert not module_mutations("X = {'a': 1}\ndef f():\n    return X['a']")  # a constant table, read
    assert not module_mutations("def f(x):\n    x.append(1)")  # an argument
    assert not module_mutations("class C:\n    def f(self):\n        self.x.append(1)")


# ---------------------------------------------------------------------- a thin command line
CLI_FORBIDDEN_IMPORTS = {"torch", "numpy", "safetensors"}
WRITE_MODES = set("wax+")


def cli_offences(source: str) -> list[str]:
    """What a ``looptool/cli`` module does that belongs in the library: importing torch, numpy
    or safetensors (at module level or in a function), or writing a file itself
    (``.write_text``/``.write_bytes``, ``json.dump``, ``open``/``.open`` in a write mode)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        names = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level:
            names = [node.module or ""]
        found += [f"line {node.lineno}: imports {n}" for n in names if n.split(".")[0] in CLI_FORBIDDEN_IMPORTS]
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        attr = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
        if attr in ("write_text", "write_bytes", "dump"):
            found.append(f"line {node.lineno}: calls {attr}()")
        elif attr == "open":
            mode_at = 1 if isinstance(func, ast.Name) else 0  # open(path, mode) / path.open(mode)
            modes = [a for a in node.args[mode_at : mode_at + 1]] + [k.value for k in node.keywords if k.arg == "mode"]
            for mode in modes:
                if not isinstance(mode, ast.Constant) or set(str(mode.value)) & WRITE_MODES:
                    found.append(f"line {node.lineno}: opens a file for writing")
    return found


def test_cli_modules_only_parse_call_and_print():
    """A command parses its options, calls the library and prints: the CLI imports no torch,
    numpy or safetensors and writes no file itself, so what it computes or writes is a library
    function that Python users get too."""
    offenders = {
        path.name: found
        for path in sorted((ROOT / "looptool" / "cli").glob("*.py"))
        if (found := cli_offences(path.read_text()))
    }
    assert not offenders, f"cli modules doing library work: {offenders}"


def test_the_cli_check_catches_library_work():
    assert (
        cli_offences("import torch")
        and cli_offences("from numpy import zeros")
        and cli_offences("import safetensors.torch")
    )
    assert cli_offences("def f():\n    import torch.nn")
    assert cli_offences("p.write_text('x')") and cli_offences("p.write_bytes(b'')") and cli_offences("json.dump(x, f)")
    assert cli_offences("open(p, 'w')") and cli_offences("open(p, mode='a')") and cli_offences("p.open('wb')")
    assert cli_offences("open(p, m)")  # a mode only known at run time may write
    assert not cli_offences("open(p)") and not cli_offences("open(p, 'rb')") and not cli_offences("p.open()")
    assert not cli_offences("json.dumps(x)") and not cli_offences("import typer\nfrom rich.table import Table")


def _docstrings_and_comments(path: pathlib.Path) -> list[tuple[int, str]]:
    """(line, text) of every docstring and ``#`` comment of a Python file."""
    import io
    import tokenize

    src = path.read_text()
    out = [
        (tok.start[0], tok.string)
        for tok in tokenize.generate_tokens(io.StringIO(src).readline)
        if tok.type == tokenize.COMMENT
    ]
    for node in ast.walk(ast.parse(src)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and ast.get_docstring(
            node
        ):
            out.append((node.body[0].lineno, ast.get_docstring(node)))
    return out


def test_docstrings_cite_papers_not_files_and_keep_no_process_notes():
    """Docstrings and comments read like documentation: no internal issue numbers, no paper
    file names (cite a paper by title and equation), no notes about how work was done."""
    from test_readme import FORBIDDEN  # the Markdown rules; first person is fine in code ("We the People")

    forbidden = {
        "an internal issue number": FORBIDDEN["an internal issue number"],
        "a paper's source file": FORBIDDEN["a paper's source file (cite it by title and equation)"],
        "a process note": re.compile(FORBIDDEN["a process note"].pattern + r"|for now\b|\bTODO\b|\bFIXME\b", re.I),
    }
    files = [
        p
        for folder in (*TREES, "examples", "tests")
        for p in sorted((ROOT / folder).rglob("*.py"))
        if p.resolve() != pathlib.Path(__file__).resolve()
    ]
    offenders = [
        f"{p.relative_to(ROOT)}:{line}: {what}"
        for p in files
        for line, text in _docstrings_and_comments(p)
        for what, pattern in forbidden.items()
        if pattern.search(text)
    ]
    assert not offenders, "\n".join(offenders)
