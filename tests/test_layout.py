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
    (1, r"towerlab(\.(config|checks|fields|presets|errors|atomic|job_files|proof(\..+)?|upgrades|catalog(\..+)?))?"),
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


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components of `graph`: each of more than one node is a circle."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, ()):
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

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return circles


def test_no_import_circles():
    assert _circles(GRAPH) == []


def _packages(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """`graph` between towerlab's packages and top-level modules (towerlab.search.store.x is towerlab.search)."""
    def top(module: str) -> str:
        return ".".join(module.split(".")[:2])

    found: dict[str, set[str]] = {}
    for a, targets in graph.items():
        found.setdefault(top(a), set()).update(top(b) for b in targets if top(b) != top(a))
    return found


def test_no_circle_between_packages():
    """Within a layer too, the arrows between packages run one way: search.store.location once read a job's
    config.json through settings, which imports search.samplers (settings and search went round a circle)."""
    assert _circles(_packages(GRAPH)) == []
    before = {"towerlab.search.store.location": {"towerlab.settings"}, "towerlab.settings": {"towerlab.search.samplers"}}
    assert _circles(_packages(before)) == [["towerlab.search", "towerlab.settings"]]


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


def _registry_lines(module: str) -> dict[str, str]:
    """A registry's lines (`SAMPLERS`, `KINDS`: a name -> "module:attribute" string, imported when asked for):
    each line's name and the module it imports."""
    found = {}
    for node in ast.walk(ast.parse(MODULES[module].read_text())):
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id in ("SAMPLERS", "KINDS")
                                                for t in node.targets) and isinstance(node.value, ast.Dict):
            found.update({k.value: v.value.partition(":")[0] for k, v in zip(node.value.keys, node.value.values)
                          if isinstance(k, ast.Constant) and isinstance(v, ast.Constant)})
    return found


REGISTRIES = {"towerlab.search.samplers": "SAMPLERS", "towerlab.objective": "KINDS"}


@pytest.mark.parametrize("registry", sorted(REGISTRIES))
def test_a_registry_s_lines_are_imports_that_run_down(registry):
    """A registry line imports its module when asked for: it is an import as any other, of its own layer or
    below (a kind of objective that trains with towerlab's jobs would climb)."""
    lines = _registry_lines(registry)
    assert lines and all(module in MODULES for module in lines.values()), lines
    assert _arrows_up({registry: set(lines.values())}) == []


# The kinds of objective, one module each, and what they share: the registry's lines and their helpers. The
# search, its job and its workers reach them through the registry (`towerlab.objective.kind_class`) alone.
KIND_MODULES = {*_registry_lines("towerlab.objective").values(), "towerlab.objective.yours", "towerlab.objective.regoal"}


def test_the_search_the_job_and_the_worker_know_only_the_protocol():
    knowing = sorted(f"{m} -> {k}" for m in MODULES if m.startswith(("towerlab.search", "towerlab.jobs"))
                     for k in GRAPH[m] & KIND_MODULES)
    assert knowing == []
    assert "towerlab.objective.training" in KIND_MODULES and "towerlab.objective.command" in KIND_MODULES


def test_only_the_kinds_read_the_settings_that_name_them():
    """What a search's objective is (its kind, what names it, its goal) is decided once, from the setting each
    kind names (`Kind.setting`, read by `towerlab.objective.named`), and carried on the search (`Search.aim`):
    no module reads --objective or --command off a search's settings or a command line."""
    readers = set()
    for module, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr in ("objective", "trial_command") and (
                    isinstance(node.value, ast.Name) and node.value.id in ("cfg", "args", "config", "settings")
                    or isinstance(node.value, ast.Attribute) and node.value.attr == "cfg"):
                readers.add(module)
    assert readers == set()


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
