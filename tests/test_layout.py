"""The house's large-scale structure (docs/development.md, "Where things live"): imports run downward
through the layers, no two modules import each other (directly or around a circle), no source module
grows past 500 lines, and the search core runs without torch."""
from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"

# The layers, bottom first (the first pattern that matches places a module): a module may import its
# own layer and the layers below it, never above. The dataset and model catalogs (stdlib only) sit
# beside config, which takes its --dataset and --model choices from them.
LAYERS = (
    (1, r"towerlab(\.(config|fields|presets|errors|atomic|catalog(\..+)?))?"),
    (2, r"towerlab\.(step|strategies|optim|lookahead|batches|checkpoint|report|"
        r"models(\..+)?|data(\..+)?|distributed(\..+)?)"),
    (3, r"towerlab\.(train|settings|search(\..+)?)"),
    (4, r"towerlab\.jobs(\..+)?"),
    (5, r"towerlab\.(cli|api|__main__)"),
)


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


def test_imports_run_downward_only():
    upward = sorted(f"{a} -> {b}" for a, targets in GRAPH.items() for b in targets if _layer(b) > _layer(a))
    assert upward == []


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


@pytest.mark.parametrize("module", sorted(MODULES))
def test_no_source_module_is_over_500_lines(module):
    assert len(MODULES[module].read_text().splitlines()) <= 500


def test_the_search_core_imports_no_torch():
    search = sorted(m for m in MODULES if m == "towerlab.search" or m.startswith("towerlab.search."))
    code = "import sys\n" + "".join(f"import {m}\n" for m in search) + \
           "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            env={"PYTHONPATH": str(SRC), "PATH": ""})
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
