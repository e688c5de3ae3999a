"""The digest of towerlab's code that a search records and every worker's must equal
(`towerlab.objective.admission.code_digest`, `towerlab.proof.package_proof`): of every source file of the
installed package, by its path in it, from the bytes its modules ran from. Another install of the same
files has the same; an edit anywhere changes it (issue 65, defect 3: a listed set of modules missed the one
that derives the seed); a stale .pyc with its source's size and modification time put back neither runs
unseen nor lies about what runs (defect 7). Each case runs in a fresh interpreter on a copy of the package,
compiled as pip compiles an install."""

from __future__ import annotations

import compileall
import json
import os
import py_compile
import shutil
import subprocess
import sys
from importlib.util import cache_from_source
from pathlib import Path

import pytest

import towerlab

PACKAGE = Path(towerlab.__file__).resolve().parent

# What a process of the copy prints: where towerlab is, the code digest, and what `names` evaluate to.
PROBE = """
import json, sys
import towerlab
from towerlab.objective.admission import code_digest
found = {name: eval(name, {"towerlab": towerlab, "__import__": __import__}) for name in sys.argv[1:]}
print(json.dumps({"file": towerlab.__file__, "code": code_digest(), **found}))
"""


def installed_copy(folder: Path) -> Path:
    """towerlab's package copied into `folder` (another machine's site-packages), its .pyc files compiled
    as pip compiles an install (stamped with their sources' times and sizes)."""
    shutil.copytree(PACKAGE, folder / "towerlab", ignore=shutil.ignore_patterns("__pycache__"))
    assert compileall.compile_dir(folder / "towerlab", quiet=1)
    return folder


def probe(site: Path, *names: str) -> dict:
    env = {**{k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}, "PYTHONPATH": str(site)}
    done = subprocess.run([sys.executable, "-c", PROBE, *names], capture_output=True, text=True, cwd=site,
                          env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout)
    assert found["file"] == str(site / "towerlab" / "__init__.py")
    return found


def put_back(path: Path, text: str, like: os.stat_result) -> None:
    """`text` written over `path`, of the size it had, with `like`'s modification time."""
    assert len(text.encode()) == like.st_size
    path.write_text(text)
    os.utime(path, ns=(like.st_atime_ns, like.st_mtime_ns))


def stale_pyc(path: Path, old: str, new: str) -> str:
    """A .pyc of `path` with `old` replaced by `new` (of its size), stamped with the source's time and size,
    then the source put back as it was: what Python's own import runs from then on is the edit."""
    source, stat = path.read_text(), path.stat()
    assert source.count(old) == 1 and len(old) == len(new)
    edited = source.replace(old, new)
    put_back(path, edited, stat)
    py_compile.compile(str(path), cfile=cache_from_source(str(path)), doraise=True,
                       invalidation_mode=py_compile.PycInvalidationMode.TIMESTAMP)
    put_back(path, source, stat)
    return edited


@pytest.fixture(scope="module")
def clean(tmp_path_factory) -> dict:
    site = installed_copy(tmp_path_factory.mktemp("clean"))
    return probe(site)


def test_a_copy_elsewhere_has_the_digest_of_the_package_here(clean):
    """Another machine's install of the same files (another path) joins."""
    here = subprocess.run([sys.executable, "-c", "from towerlab.objective.admission import code_digest; "
                           "print(code_digest())"], capture_output=True, text=True, check=True, timeout=300)
    assert here.stdout.strip() == clean["code"]


@pytest.mark.parametrize("module", ["jobs/search/workers.py", "distributed/group.py", "data/readers.py",
                                    "data/folder_decode.py", "search/candidates.py", "cli.py"])
def test_an_edit_in_any_module_changes_the_digest(tmp_path, clean, module):
    """Defect 3: jobs/search_workers.py (the seed), distributed/group.py, data/readers.py and the decoder were
    outside the listed modules, and an edit there joined with the search's digest."""
    site = installed_copy(tmp_path)
    path = site / "towerlab" / module
    path.write_text(path.read_text() + "# an edit\n")
    assert probe(site)["code"] != clean["code"]


def test_a_stale_pyc_of_a_towerlab_module_does_not_run(tmp_path, clean):
    """Defect 7: Python's own import ran a .pyc stamped with its source's time and size, whatever the source
    said, and the digest vouched for the source."""
    site = installed_copy(tmp_path)
    stale_pyc(site / "towerlab" / "search" / "work" / "worker.py", "DEFAULT_LEASE = 30.0", "DEFAULT_LEASE = 31.0")
    found = probe(site, "__import__('towerlab.search.work.worker').search.work.worker.DEFAULT_LEASE")
    assert found["__import__('towerlab.search.work.worker').search.work.worker.DEFAULT_LEASE"] == 30.0
    assert found["code"] == clean["code"]
    # the .pyc written in its place is a checked hash-based one, which Python's own import checks as well
    pyc = Path(cache_from_source(str(site / "towerlab" / "search" / "work" / "worker.py"))).read_bytes()
    assert int.from_bytes(pyc[4:8], "little") == 0b11


def test_a_stale_pyc_of_the_package_s_first_module_changes_the_digest(tmp_path, clean):
    """towerlab/__init__.py (and towerlab/proof.py) run before towerlab's loader is in place: a stale .pyc of
    theirs runs, and the digest says so (no other process has it)."""
    site = installed_copy(tmp_path)
    stale_pyc(site / "towerlab" / "__init__.py", '__version__ = "0.1.0"', '__version__ = "0.1.9"')
    found = probe(site, "towerlab.__version__")
    assert found["towerlab.__version__"] == "0.1.9" and found["code"] != clean["code"]


def test_a_module_edited_after_the_proof_is_not_imported(tmp_path):
    site = installed_copy(tmp_path)
    script = ("from towerlab.objective.admission import code_digest\ncode_digest()\n"
              f"open({str(site / 'towerlab' / 'plots.py')!r}, 'a').write('# an edit\\n')\n"
              "import towerlab.plots\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=site, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(site)})
    assert done.returncode == 1 and done.stderr.splitlines()[-1].startswith(
        "ImportError: towerlab's plots.py changed on disk after this process proved its code ("), done.stderr
