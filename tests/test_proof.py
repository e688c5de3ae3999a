"""The proof of what runs from your files (towerlab.proof), through the loader that `--model` and
`--objective FILE.py:FUNCTION` share (towerlab.models.custom.load_function): the file and every module of
yours it imports, by name, from the bytes Python executed. Each case runs in a fresh interpreter, as a
worker does."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from towerlab.proof import Proof

# Loads FILE.py:NAME as a worker would, calls it, and prints what it returned and the proof before and after.
LOAD = """
import json, sys
from towerlab.models.custom import file_proof, load_function
spec = sys.argv[1]
function = load_function(spec)
before = dict(file_proof(spec).parts)
print(json.dumps({"value": function(), "before": before, "after": dict(file_proof(spec).parts)}))
"""


def load(spec: str, cwd: Path | None = None) -> dict:
    done = subprocess.run([sys.executable, "-c", LOAD, spec], capture_output=True, text=True, cwd=cwd, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def sha(path: Path) -> str:
    return f"sha256:{hashlib.sha256(path.read_bytes()).hexdigest()}"


def write(folder: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text(text)


MODEL = {
    "net.py": "import json\nimport blocks\nfrom pkg import layers\n\ndef make():\n    return blocks.WIDTH + layers.DEPTH\n",
    "blocks.py": "WIDTH = 16\n",
    "pkg/__init__.py": "",
    "pkg/layers.py": "from . import util\nDEPTH = util.TWO\n",
    "pkg/util.py": "TWO = 2\n",
    "unused.py": "NOT = 'imported'\n",
}


def test_the_proof_is_the_file_and_every_module_of_yours_it_imports(tmp_path):
    write(tmp_path, MODEL)
    found = load(f"{tmp_path / 'net.py'}:make")
    assert found["value"] == 18
    assert found["before"] == {"net": sha(tmp_path / "net.py"), "blocks": sha(tmp_path / "blocks.py"),
                               "pkg": sha(tmp_path / "pkg/__init__.py"), "pkg.layers": sha(tmp_path / "pkg/layers.py"),
                               "pkg.util": sha(tmp_path / "pkg/util.py")}


@pytest.mark.slow
def test_a_changed_neighbour_changes_the_proof_and_is_named(tmp_path):
    write(tmp_path, MODEL)
    before = Proof(load(f"{tmp_path / 'net.py'}:make")["before"])
    (tmp_path / "blocks.py").write_text("WIDTH = 32\n")
    after = load(f"{tmp_path / 'net.py'}:make")
    assert after["value"] == 34
    assert Proof(after["before"]).digest != before.digest
    assert Proof(after["before"]).difference(before.parts).startswith("blocks differs (")
    (tmp_path / "unused.py").write_text("NOT = 'imported either'\n")  # a file it does not import: the same proof
    assert load(f"{tmp_path / 'net.py'}:make")["before"] == after["before"]


@pytest.mark.slow
def test_the_same_files_elsewhere_give_the_same_proof(tmp_path):
    write(tmp_path / "here", MODEL)
    shutil.copytree(tmp_path / "here", tmp_path / "another machine")
    assert load(f"{tmp_path / 'here' / 'net.py'}:make")["before"] == \
        load(f"{tmp_path / 'another machine' / 'net.py'}:make")["before"]


def _put_back(path: Path, text: str) -> None:
    """Write `text` over `path`, of the same size, and put its modification time back."""
    stat = path.stat()
    assert len(text.encode()) == stat.st_size
    path.write_text(text)
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))


def test_a_stale_pyc_beside_a_changed_source_does_not_fool_it(tmp_path):
    write(tmp_path, {"net.py": "import mod\nOWN = 1\n\ndef make():\n    return OWN * 10 + mod.VALUE\n",
                     "mod.py": "VALUE = 1\n"})
    plain = [sys.executable, "-c", "import net; print(net.make())"]
    writing = {name: value for name, value in os.environ.items() if name != "PYTHONDONTWRITEBYTECODE"}
    assert subprocess.run(plain, capture_output=True, text=True, cwd=tmp_path, check=True, env=writing).stdout == "11\n"
    assert sorted(p.name.split(".")[0] for p in (tmp_path / "__pycache__").iterdir()) == ["mod", "net"]
    _put_back(tmp_path / "net.py", "import mod\nOWN = 2\n\ndef make():\n    return OWN * 10 + mod.VALUE\n")
    _put_back(tmp_path / "mod.py", "VALUE = 2\n")
    # Python's own import runs the stale .pyc files: the sources say 22, the code that runs 11.
    assert subprocess.run(plain, capture_output=True, text=True, cwd=tmp_path, check=True).stdout == "11\n"
    found = load(f"{tmp_path / 'net.py'}:make")
    assert found["value"] == 22
    assert found["before"] == {"net": sha(tmp_path / "net.py"), "mod": sha(tmp_path / "mod.py")}


def test_a_module_imported_inside_the_function_is_proven_before_it_runs(tmp_path):
    """Issue 74, item 1: its import statement names it, so the proof holds it before any call imports it
    (it was proven only once imported: a search's proof, taken before any trial, lacked it)."""
    write(tmp_path, {"net.py": "def make():\n    import late\n    from pkg import inner\n    return late.X + inner.Y\n",
                     "late.py": "X = 5\n", "pkg/__init__.py": "", "pkg/inner.py": "import importlib\n"
                     "Y = importlib.import_module('deeper').Z\n", "deeper.py": "Z = 1\n"})
    found = load(f"{tmp_path / 'net.py'}:make")
    assert found["value"] == 6
    assert found["before"] == found["after"] == {
        "net": sha(tmp_path / "net.py"), "late": sha(tmp_path / "late.py"), "pkg": sha(tmp_path / "pkg/__init__.py"),
        "pkg.inner": sha(tmp_path / "pkg/inner.py"), "deeper": sha(tmp_path / "deeper.py")}


def test_a_module_chosen_by_name_inside_a_package_is_proven_with_every_module_of_it(tmp_path):
    """`importlib.import_module(f"models.{name}")`, a plugin chosen by a gene: each module of the package is
    proven (one chosen as a trial runs could not be, and its trial's result would be dropped)."""
    write(tmp_path, {"net.py": "import importlib\n\ndef make(name='small'):\n"
                               "    return importlib.import_module(f'models.{name}').SIZE\n",
                     "models/__init__.py": "", "models/small.py": "SIZE = 1\n", "models/large.py": "SIZE = 9\n"})
    found = load(f"{tmp_path / 'net.py'}:make")
    assert found["value"] == 1 and found["before"] == found["after"] == {
        "net": sha(tmp_path / "net.py"), "models": sha(tmp_path / "models/__init__.py"),
        "models.small": sha(tmp_path / "models/small.py"), "models.large": sha(tmp_path / "models/large.py")}


def test_towerlab_s_own_modules_are_not_a_file_s_proof(tmp_path):
    """towerlab's own code has its proof apart (the digest of its package); an editable install's folder
    (src/towerlab) counted as a folder of yours."""
    write(tmp_path, {"net.py": "from towerlab.errors import UserError\n\ndef make():\n    return 1\n"})
    assert load(f"{tmp_path / 'net.py'}:make")["before"] == {"net": sha(tmp_path / "net.py")}


# A function objective proven, then a module it imports inside its body edited before a trial imports it.
EDITED = """
import json, sys
from pathlib import Path
from towerlab.objective import FunctionObjective, Trial
objective = FunctionObjective(sys.argv[1], [])
before = objective.unproven(Trial({}, 1, 1, "cpu", Path(sys.argv[3])))
Path(sys.argv[2]).write_text(sys.argv[4])
result = objective.run(Trial({}, 1, 1, "cpu", Path(sys.argv[3])))
print(json.dumps({"before": before, "metrics": dict(result.metrics), "after": objective.unproven(None)}))
"""


def test_a_module_edited_after_the_proof_and_imported_by_a_trial_is_not_what_was_proven(tmp_path):
    write(tmp_path, {"net.py": "def make():\n    import late\n    return late.X\n", "late.py": "X = 5\n"})
    proven = sha(tmp_path / "late.py")
    done = subprocess.run([sys.executable, "-c", EDITED, f"{tmp_path / 'net.py'}:make", str(tmp_path / "late.py"),
                           str(tmp_path / "trial"), "X = 6\n"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    found = json.loads(done.stdout)
    assert found["before"] is None and found["metrics"] == {"value": 6}
    assert found["after"] == f"late differs ({sha(tmp_path / 'late.py')[7:19]} now, {proven[7:19]} proven)"


def test_a_module_imported_by_a_name_computed_as_it_runs_is_not_in_the_proof(tmp_path):
    write(tmp_path, {"net.py": "import importlib\n\ndef make():\n    return importlib.import_module('hid' + 'den').X\n",
                     "hidden.py": "X = 5\n"})
    done = subprocess.run([sys.executable, "-c", EDITED, f"{tmp_path / 'net.py'}:make", str(tmp_path / "other.py"),
                           str(tmp_path / "trial"), ""], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["after"].startswith("hidden not in it (a module imported by a name computed")


def test_a_module_already_imported_by_another_file_is_still_in_the_proof(tmp_path):
    write(tmp_path, {"first.py": "import shared\ndef make():\n    return 1\n",
                     "second.py": "import shared\ndef make():\n    return 2\n", "shared.py": "S = 1\n"})
    script = ("import json, sys\nfrom towerlab.models.custom import file_proof, load_function\n"
              "for spec in sys.argv[1:]:\n    load_function(spec)\n"
              "print(json.dumps([sorted(file_proof(spec).parts) for spec in sys.argv[1:]]))\n")
    done = subprocess.run([sys.executable, "-c", script, f"{tmp_path / 'first.py'}:make",
                           f"{tmp_path / 'second.py'}:make"], capture_output=True, text=True, check=True)
    assert json.loads(done.stdout) == [["first", "shared"], ["second", "shared"]]


def test_a_function_objective_proves_its_file_and_neighbours(tmp_path):
    write(tmp_path, {"objective.py": "import helpers\ndef train(x):\n    return helpers.square(x)\n",
                     "helpers.py": "def square(x):\n    return x * x\n"})
    script = ("import json, sys\nfrom towerlab.objective import FunctionObjective, setup\n"
              "print(json.dumps(setup(FunctionObjective(sys.argv[1], ['x']))))\n")
    done = subprocess.run([sys.executable, "-c", script, f"{tmp_path / 'objective.py'}:train"], capture_output=True,
                          text=True, check=True)
    assert json.loads(done.stdout)["proof"] == {"objective": sha(tmp_path / "objective.py"),
                                                "helpers": sha(tmp_path / "helpers.py")}


def test_a_difference_names_what_is_missing_and_what_is_new():
    recorded = {"net": "sha256:aa", "blocks": "sha256:bb", "old": "sha256:cc"}
    here = Proof({"net": "sha256:aa", "blocks": "sha256:dd", "new": "sha256:ee"})
    assert here.difference(recorded) == "blocks differs (dd here, bb recorded); new only here; old missing here"
    assert Proof(recorded).difference(recorded) is None


# Loads FILE.py:NAME, then hands the function to a spawned worker process (as `train --devices 2` and a
# search's crew do), which prints what it returns there and its proof there.
SPAWNED = """
import json, sys
from towerlab.distributed.launch import LaunchOptions, launch
from towerlab.models.custom import file_proof, function_proof, load_function


def child(rank, world_size, store_path, function, out):
    proven = function_proof(function)
    with open(out, "w") as file:
        json.dump({"value": function(), "proof": None if proven is None else dict(proven.parts)}, file)


if __name__ == "__main__":
    function = load_function(sys.argv[1])
    status = launch(child, 1, (function, sys.argv[2]), LaunchOptions(start_method="spawn"))
    print(json.dumps({"status": status, "value": function(), "proof": dict(file_proof(sys.argv[1]).parts)}))
"""


def test_a_spawned_process_imports_a_function_of_yours_through_the_proof_s_loader(tmp_path):
    """A spawned worker unpickled the model function by Python's own import, which ran the stale .pyc: the
    launcher proved 22 and its worker trained 11."""
    write(tmp_path, {"net.py": "import mod\nOWN = 1\n\ndef make():\n    return OWN * 10 + mod.VALUE\n",
                     "mod.py": "VALUE = 1\n"})
    writing = {name: value for name, value in os.environ.items() if name != "PYTHONDONTWRITEBYTECODE"}
    subprocess.run([sys.executable, "-c", "import net"], cwd=tmp_path, check=True, env=writing)
    _put_back(tmp_path / "net.py", "import mod\nOWN = 2\n\ndef make():\n    return OWN * 10 + mod.VALUE\n")
    _put_back(tmp_path / "mod.py", "VALUE = 2\n")
    (tmp_path / "spawned.py").write_text(SPAWNED)
    done = subprocess.run([sys.executable, str(tmp_path / "spawned.py"), f"{tmp_path / 'net.py'}:make",
                           str(tmp_path / "child.json")], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    here = json.loads(done.stdout)
    there = json.loads((tmp_path / "child.json").read_text())
    assert here["status"] == 0 and here["value"] == there["value"] == 22
    assert there["proof"] == here["proof"] == {"net": sha(tmp_path / "net.py"), "mod": sha(tmp_path / "mod.py")}
