"""The house's large-scale structure (docs/development.md, "Layout"): imports run downward through
the layers (cli/api > jobs > {training, search} > {models, data, distributed} > config), a package
sits in one layer whole, no two modules import each other (directly or around a circle), a module
over 350 lines says why in its docstring (none grows past 400), every `noqa` and `type: ignore`
says why, and the search core runs without torch; and bench/'s rules (below)."""
from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"

# The layers, bottom first (the first pattern that matches places a module): a module may import its
# own layer and the layers below it, never above. A package sits in one layer whole (no module of it
# below its siblings: config once imported the dataset and model catalogs from data/ and models/,
# two arrows up that a per-module exception hid). The catalogs (stdlib only) sit beside config, which
# takes its --dataset and --model choices from them.
LAYERS = (
    (1, r"towerlab(\.(config|checks|fields|presets|errors|atomic|proof(\..+)?|upgrades|catalog(\..+)?))?"),
    (2, r"towerlab\.(report|plots|models(\..+)?|data(\..+)?|distributed(\..+)?)"),
    (3, r"towerlab\.(settings|training(\..+)?|search(\..+)?|objective(\..+)?)"),
    (4, r"towerlab\.jobs(\..+)?"),
    (5, r"towerlab\.(cli|commands|api|__main__)"),
)
# The most lines a module may hold, whatever its docstring says.
MOST_LINES = 400


def _modules() -> dict[str, Path]:
    modules = {}
    for path in sorted(SRC.rglob("*.py")):
        parts = path.relative_to(SRC).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


MODULES = _modules()


def _owner(name: str) -> str | None:
    """The module that `name` (a module, or a name inside one) lives in."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _imports(module: str) -> set[str]:
    """Every towerlab module `module` imports, at its top or inside a function."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + [base]).rstrip(".")
            # `from towerlab import data` imports the module towerlab.data, `from towerlab.x import f` towerlab.x
            names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base for alias in node.names]
        else:
            continue
        found.update(owner for name in names if name.startswith("towerlab")
                     if (owner := _owner(name)) and owner != module)
    return found


GRAPH = {module: _imports(module) for module in MODULES}


def _layer(module: str) -> int | None:
    return next((n for n, pattern in LAYERS if re.fullmatch(pattern, module)), None)


def test_every_module_has_a_layer():
    assert [m for m in MODULES if _layer(m) is None] == []


def _arrows_up(graph: dict[str, set[str]]) -> list[str]:
    """Every import of `graph` that climbs to a higher layer, as "importer -> imported"."""
    return sorted(f"{a} -> {b}" for a, targets in graph.items() for b in targets if _layer(b) > _layer(a))


def test_imports_run_downward_only():
    assert _arrows_up(GRAPH) == []


def test_the_arrows_up_of_before_are_counted():
    # config.py once imported the catalogs from their packages, data/ and models/ (issue 51).
    before = {"towerlab.config": {"towerlab.data.catalog", "towerlab.models", "towerlab.errors"}}
    assert _arrows_up(before) == ["towerlab.config -> towerlab.data.catalog", "towerlab.config -> towerlab.models"]
    assert _arrows_up({"towerlab.config": {"towerlab.catalog.datasets", "towerlab.catalog.models"}}) == []


def test_a_package_is_one_layer():
    packages = [m for m, path in MODULES.items() if path.name == "__init__.py" and m != "towerlab"]
    split = sorted(f"{m} ({_layer(m)}) in {package} ({_layer(package)})" for package in packages
                   for m in MODULES if m.startswith(package + ".") and _layer(m) != _layer(package))
    assert split == []


def test_no_import_circles():
    # Tarjan's strongly connected components: a component of more than one module is a circle.
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in GRAPH[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while not component or component[-1] != v:
                component.append(stack.pop())
            if len(component) > 1:
                circles.append(sorted(component))

    for module in MODULES:
        if module not in index:
            visit(module)
    assert circles == []


def test_the_layout_check_sees_an_upward_import_and_a_circle():
    assert "towerlab.config" in GRAPH["towerlab.cli"]
    assert _layer("towerlab.config") < _layer("towerlab.cli")
    assert _layer("towerlab.jobs.anything") == 4 and _layer("towerlab.search.samplers.ga") == 3
    assert _layer("towerlab.catalog.datasets") == 1 and _layer("towerlab.data.load") == 2
    assert _layer("towerlab.models.preprocessing") == 2 and _layer("towerlab.training.batches") == 3


@pytest.mark.parametrize("module", sorted(MODULES))
def test_no_source_module_is_over_400_lines(module):
    assert len(MODULES[module].read_text().splitlines()) <= MOST_LINES


@pytest.mark.parametrize("module", sorted(MODULES))
def test_a_module_over_350_lines_says_why(module):
    """Modules stay around 300 lines, split by role; one that is longer says in its docstring why
    it is one module ("over 350 lines" and the reason)."""
    text = MODULES[module].read_text()
    lines = len(text.splitlines())
    said = "over 350 lines" in " ".join((ast.get_docstring(ast.parse(text)) or "").split())
    assert lines <= 350 or said, f"{module}: {lines} lines, and its docstring does not say why"


SUPPRESSION = re.compile(r"#\s*(noqa|type:\s*ignore)\b(?P<rest>.*)")


def test_every_noqa_and_type_ignore_says_why():
    """A silenced linter or type checker says why on the same line: `# noqa: CODE - why`,
    `# type: ignore[code]  # why`."""
    root = SRC.parent
    silent = []
    for path in sorted([*SRC.rglob("*.py"), *(root / "tests").rglob("*.py"), *(root / "bench").rglob("*.py")]):
        for number, line in enumerate(path.read_text().splitlines(), 1):
            found = SUPPRESSION.search(line)
            if found and " - " not in found["rest"] and not re.search(r"#\s*\w", found["rest"]):
                silent.append(f"{path.relative_to(root)}:{number}")
    assert silent == []


# What the store's parts (its records, queue, rows, schema and integrity checks) may take from the database
# module: the backend interface and the helpers of its SQL, never a backend (`Database` or its subclasses).
BACKEND_INTERFACE = {"Backend", "Transaction", "CHUNK", "placeholders", "damaged"}
STORE_PARTS = ("records", "queue", "rows", "schema", "integrity")
BACKENDS = {"towerlab.search.store.sqlite", "towerlab.search.store.postgresql", "towerlab.search.store.sqlite_file"}


def _names_from(module: str, source: str) -> set[str]:
    """The names `module` imports from `source` (`from source import a, b`)."""
    return {alias.name for node in ast.walk(ast.parse(MODULES[module].read_text()))
            if isinstance(node, ast.ImportFrom) and node.module == source for alias in node.names}


@pytest.mark.parametrize("part", STORE_PARTS)
def test_the_store_s_parts_import_only_the_backend_interface(part):
    module = f"towerlab.search.store.{part}"
    assert not GRAPH[module] & BACKENDS
    assert _names_from(module, "towerlab.search.store.database") <= BACKEND_INTERFACE


def test_only_search_reads_a_stored_search_s_setup():
    """A stored search's setup (how its workers train) is read through `Search` alone (`Search.recorded`):
    no other module touches a `.setup` attribute, except to call a method of that name."""
    readers = set()
    for module, path in MODULES.items():
        tree = ast.parse(path.read_text())
        called = {id(node.func) for node in ast.walk(tree) if isinstance(node, ast.Call)}
        if any(isinstance(node, ast.Attribute) and node.attr == "setup" and id(node) not in called
               for node in ast.walk(tree)):
            readers.add(module)
    assert readers == {"towerlab.search.search"}


def test_the_search_core_imports_no_torch():
    search = sorted(m for m in MODULES if m == "towerlab.search" or m.startswith("towerlab.search."))
    code = "import sys\n" + "".join(f"import {m}\n" for m in search) + \
           "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            env={"PYTHONPATH": str(SRC), "PATH": ""})
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


# --- bench/: the benchmarks (docs/development.md, "Benchmarks") -----------------------------------------
# A benchmark imports nothing from tests/ (the tests are not a library: a bench of its own holds what it
# needs, bench/queue/postgres.py) and no private (underscore) name of towerlab (what towerlab may change
# under it without a word) or of another bench module (what it shares it names); every JSON file it writes
# goes through its one writer, bench/common/record.py.
BENCH = SRC.parent / "bench"
TESTS_MODULES = {path.stem for path in (SRC.parent / "tests").glob("*.py")} | {"tests"}
RECORD_WRITER = "bench/common/record.py"
BENCH_NAMES = {".".join(path.relative_to(SRC.parent).with_suffix("").parts) for path in BENCH.rglob("*.py")}
OWNED = ("towerlab", "bench")  # the packages whose private names a benchmark leaves alone


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def bench_breaches(source: str) -> list[str]:
    """What a bench module's source does that bench/ may not: an import of tests/, a private name of
    towerlab or of another bench module, JSON written past the record writer."""
    tree = ast.parse(source)
    found, aliases = [], {}  # a name bound to a module of towerlab or bench -> that module
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] in TESTS_MODULES:
                    found.append(f"imports tests/ ({alias.name})")
                if alias.name.split(".")[0] in OWNED:
                    if any(_private(part) for part in alias.name.split(".")):
                        found.append(f"imports a private module ({alias.name})")
                    aliases[alias.asname or alias.name.split(".")[0]] = alias.name
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module.split(".")[0] in TESTS_MODULES:
                found.append(f"imports tests/ ({node.module})")
            if node.module.split(".")[0] in OWNED:
                for alias in node.names:
                    if _private(alias.name) or any(_private(part) for part in node.module.split(".")):
                        found.append(f"imports a private name ({node.module}.{alias.name})")
                    elif f"{node.module}.{alias.name}" in MODULES.keys() | BENCH_NAMES:
                        aliases[alias.asname or alias.name] = f"{node.module}.{alias.name}"
        elif isinstance(node, ast.Call):
            func = ast.unparse(node.func)
            if func in ("sys.path.insert", "sys.path.append") and "tests" in ast.unparse(node):
                found.append(f"puts tests/ on sys.path ({ast.unparse(node)})")
            if func in ("json.dump", "os.replace", "os.rename"):
                found.append(f"writes past the record writer ({func})")
            if func.endswith((".write_text", ".write")) and any(
                    isinstance(arg, ast.Call) and ast.unparse(arg.func) == "json.dumps" for part in node.args
                    for arg in ast.walk(part)):
                found.append(f"writes JSON past the record writer ({func})")
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr):
            base = ast.unparse(node.value)
            if base.split(".")[0] in aliases:
                found.append(f"reads a private name ({base}.{node.attr})")
    return found


BENCH_MODULES = sorted(path.relative_to(SRC.parent).as_posix() for path in BENCH.rglob("*.py"))


@pytest.mark.parametrize("module", BENCH_MODULES)
def test_a_benchmark_imports_no_tests_and_no_private_name_and_writes_json_through_the_record_writer(module):
    if module == RECORD_WRITER:
        return
    assert bench_breaches((SRC.parent / module).read_text()) == []


def test_the_bench_check_sees_each_breach():
    assert bench_breaches("import postgres\nfrom util import REPO\n") == ["imports tests/ (postgres)",
                                                                         "imports tests/ (util)"]
    assert bench_breaches("import sys\nsys.path.insert(0, str(REPO / 'tests'))\n") == [
        "puts tests/ on sys.path (sys.path.insert(0, str(REPO / 'tests')))"]
    assert bench_breaches("from towerlab.training.batches import _gather_pixels, crop_flip\n") == [
        "imports a private name (towerlab.training.batches._gather_pixels)"]
    assert bench_breaches("import towerlab.proof as proof\nproof._RAN.clear()\n") == [
        "reads a private name (proof._RAN)"]
    assert bench_breaches("from towerlab import proof\nx = proof._IMPORTS\n") == ["reads a private name (proof._IMPORTS)"]
    assert bench_breaches("import towerlab.proof\ntowerlab.proof._RAN\n") == ["reads a private name (towerlab.proof._RAN)"]
    assert bench_breaches("from bench.common.measure import _run\n") == [
        "imports a private name (bench.common.measure._run)"]
    assert bench_breaches("from bench.common import measure\nmeasure._env()\n") == ["reads a private name (measure._env)"]
    assert bench_breaches("import json\njson.dump({}, f)\n") == ["writes past the record writer (json.dump)"]
    assert bench_breaches("import json\npath.write_text(json.dumps(r, indent=1) + '\\n')\n") == [
        "writes JSON past the record writer (path.write_text)"]
    # what is allowed: a public name, an object's own private attribute, a file that is not JSON
    assert bench_breaches("from towerlab.search import Search\nimport json\nself._x = 1\n"
                          "path.write_text('[genes]')\nprint(json.dumps({}))\n") == []
