"""Crashes and full disks while files are written: checkpoints, summary.json / config.json /
model.pt (atomic replace) and the search store (SQLite). The previous version always stays
readable, a torn file is never loaded, and a corrupt checkpoint is refused with a clear message,
falling back to the previous good one.

A crash is a real SIGKILL of a child process at a chosen point (an `os.replace` call); a full
disk is an injected ENOSPC, or a real one: the file-size limit (RLIMIT_FSIZE) makes the kernel
refuse the write exactly as a full disk does.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from towerlab import atomic
from towerlab.training import checkpoint
from towerlab.config import SearchConfig
from towerlab.errors import UserError
from towerlab.search import Candidate, Outcome, Search, load_space
from towerlab.search.store import Store


def child(code: str, *args: str, fsize: int | None = None) -> subprocess.CompletedProcess:
    """Run `code` in a fresh interpreter; with `fsize`, no file it writes may grow past that many bytes."""
    prelude = "import resource, signal, sys\n"
    if fsize is not None:
        prelude += (f"signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
                    f"resource.setrlimit(resource.RLIMIT_FSIZE, ({fsize}, {fsize}))\n")
    return subprocess.run([sys.executable, "-c", prelude + textwrap.dedent(code), *args],
                          capture_output=True, text=True, timeout=120)


def state(step: int, size: int = 1000) -> dict:
    return {"step": step, "weights": torch.full((size,), float(step))}


def save(path: Path, step: int, size: int = 1000) -> None:
    checkpoint.save(path, state(step, size))


# A child that saves checkpoint `step` and SIGKILLs itself at the n-th os.replace of that save
# (1: the new file is complete but not yet renamed into place; 2: before the current one becomes
# .prev; 3: between the two renames, when only .prev and the new file exist).
KILL_AT_REPLACE = """
import os, torch
from towerlab.training import checkpoint
path, step, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
real, calls = os.replace, []
def replace(src, dst):
    calls.append((src, dst))
    if len(calls) == n:
        os.kill(os.getpid(), signal.SIGKILL)
    return real(src, dst)
os.replace = replace
checkpoint.save(path, {"step": step, "weights": torch.full((1000,), float(step))})
"""


@pytest.mark.parametrize("kill_at, loads", [(1, 2), (2, 2), (3, 2), (4, 3)])
def test_a_checkpoint_save_killed_at_any_point_leaves_a_good_checkpoint(tmp_path, kill_at, loads):
    path = tmp_path / "checkpoint.pt"
    save(path, 1)
    save(path, 2)
    done = child(KILL_AT_REPLACE, str(path), "3", str(kill_at))
    assert done.returncode == (-signal.SIGKILL if kill_at <= 3 else 0), done.stderr
    warnings = []
    loaded = checkpoint.load(path, log=warnings.append)
    assert loaded["step"] == loads and torch.equal(loaded["weights"], torch.full((1000,), float(loads)))
    if kill_at == 3:  # only .prev (and the new file) exist: loading says so and falls back
        assert not path.exists() and "checkpoint.pt is missing" in warnings[0] and "checkpoint.pt.prev" in warnings[0]
    save(path, 4)  # the next save goes through, whatever was left over
    assert checkpoint.load(path)["step"] == 4 and checkpoint.load(checkpoint.previous(path))["step"] in (2, 3)
    # A writer killed before its first rename leaves its temporary file: inert, never loaded.
    assert bool(list(tmp_path.glob("*.tmp-*"))) == (kill_at == 1)


def test_a_torn_or_corrupt_checkpoint_is_refused_and_the_previous_one_loads(tmp_path):
    path = tmp_path / "checkpoint.pt"
    save(path, 1)
    save(path, 2)
    good = path.read_bytes()
    for damage, message in [(good[: len(good) // 2], "no checksum trailer"),  # torn: the tail never reached the disk
                            (good[:100] + bytes([good[100] ^ 1]) + good[101:], "checksum mismatch"),
                            (b"", "no checksum trailer")]:
        path.write_bytes(damage)
        warnings = []
        assert checkpoint.load(path, log=warnings.append)["step"] == 1
        assert message in warnings[0] and "resuming from checkpoint.pt.prev instead" in warnings[0]
    checkpoint.previous(path).write_bytes(good[:200] + bytes([good[200] ^ 4]) + good[201:])
    with pytest.raises(UserError, match=r"no usable checkpoint in .*checkpoint\.pt: no checksum trailer.*"
                                        r"checkpoint\.pt\.prev: checksum mismatch"):
        checkpoint.load(path)


@pytest.mark.slow
def test_a_huge_checkpoint_is_refused_unread_by_its_size_and_resume_says_so_in_one_line(tmp_path):
    """A 30 GB (sparse) checkpoint.pt, resumed under a 4 GiB address space: refused by its size (more
    than the run's model can need) before a byte is read; once the whole file was read first."""
    from util import TINY, run_cli

    out = tmp_path / "run"
    assert run_cli("train", *TINY, "--model", "mlp", "--model-opt", "neurons=16", "--model-opt", "layers=1",
                   "--steps", "2", "--out", str(out)).returncode == 0
    checkpoint.previous(out / "checkpoint.pt").unlink(missing_ok=True)
    os.truncate(out / "checkpoint.pt", 30 * 10**9)
    done = child("""
        resource.setrlimit(resource.RLIMIT_AS, (4 * 2**30, 4 * 2**30))
        from towerlab.cli import main
        sys.exit(main(["train", "--resume", sys.argv[1]]))
        """, str(out))
    assert done.returncode == 2, done.stderr
    lines = done.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("towerlab: error: no usable checkpoint"), done.stderr
    assert "checkpoint.pt: 30,000,000,000 bytes, more than a checkpoint of this run's model can be" in lines[0]
    limit = checkpoint.size_limit(torch.nn.Linear(784, 16))  # 4 x 12,560 + 64 bytes of tensors: 64 MiB of margin
    assert limit == 8 * 4 * (784 * 16 + 16) + 64 * 2**20


def test_a_checkpoint_too_large_for_memory_is_unusable_not_a_traceback(tmp_path, monkeypatch):
    path = tmp_path / "checkpoint.pt"
    save(path, 1, size=10**6)
    real_open = open

    class Starved:  # a machine that cannot hold more than a chunk at once
        def __init__(self, *args):
            self.file = real_open(*args)

        def __getattr__(self, name):
            return getattr(self.file, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.file.close()

        def read(self, n=-1):
            if n < 0 or n > 2**20:
                raise MemoryError
            return self.file.read(n)

    monkeypatch.setattr(checkpoint, "open", Starved, raising=False)
    with pytest.raises(UserError, match=r"checkpoint\.pt: too large to read in this machine's memory"):
        checkpoint.load(path)


def test_a_save_after_falling_back_cannot_lose_the_last_good_checkpoint(tmp_path):
    """checkpoint.pt corrupt, .prev good: the next save rotates the corrupt file onto .prev; killed
    right then, the new complete file is still there and loads."""
    path = tmp_path / "checkpoint.pt"
    save(path, 1)
    save(path, 2)
    path.write_bytes(b"garbage")
    assert checkpoint.load(path, log=lambda _: None)["step"] == 1
    assert child(KILL_AT_REPLACE, str(path), "3", "3").returncode == -signal.SIGKILL
    warnings = []
    assert checkpoint.load(path, log=warnings.append)["step"] == 3
    assert ".checkpoint.pt.new" in warnings[0]


def test_a_full_disk_while_saving_a_checkpoint_keeps_both_old_ones(tmp_path):
    path = tmp_path / "checkpoint.pt"
    save(path, 1)
    save(path, 2)
    size = path.stat().st_size
    # A real refusal by the kernel: the new file may not grow past 1 KB (the old ones are ~5 KB).
    done = child("""
        import torch
        from towerlab.training import checkpoint
        from towerlab.errors import UserError
        try:
            checkpoint.save(sys.argv[1], {"step": 3, "weights": torch.full((1000,), 3.0)})
        except UserError as exc:
            print(exc)
            sys.exit(2)
        """, str(path), fsize=1024)
    assert done.returncode == 2, done.stderr
    message = done.stdout
    assert "could not write" in message and "File too large" in message and "previous version is intact" in message
    assert path.stat().st_size == size
    assert checkpoint.load(path)["step"] == 2 and checkpoint.load(checkpoint.previous(path))["step"] == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint.pt", "checkpoint.pt.prev"]  # no debris


@pytest.mark.parametrize("name", ["summary.json", "config.json"])
def test_json_records_survive_a_kill_between_write_and_rename(tmp_path, name):
    target = tmp_path / name
    atomic.write_json(target, {"version": 1})
    done = child("""
        import os
        from towerlab import atomic
        def replace(src, dst):
            os.kill(os.getpid(), signal.SIGKILL)
        os.replace = replace
        atomic.write_json(sys.argv[1], {"version": 2, "padding": "x" * 100000})
        """, str(target))
    assert done.returncode == -signal.SIGKILL
    assert json.loads(target.read_text()) == {"version": 1}  # the old version, whole
    leftovers = [p for p in tmp_path.iterdir() if p.name != name]
    assert [p.name.startswith(f".{name}.tmp-") for p in leftovers] == [True]  # inert: never read as the record
    atomic.write_json(target, {"version": 3})
    assert json.loads(target.read_text()) == {"version": 3}


def test_enospc_while_writing_a_record_raises_our_error_and_keeps_the_old_file(tmp_path, monkeypatch):
    target = tmp_path / "summary.json"
    atomic.write_json(target, {"version": 1})

    def full(_fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(UserError, match=r"could not write .*summary\.json: No space left on device; "
                                        r"the previous version is intact"):
        atomic.write_json(target, {"version": 2})
    monkeypatch.undo()
    assert json.loads(target.read_text()) == {"version": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["summary.json"]


def test_a_record_that_cannot_be_written_at_all_says_nothing_was_written(tmp_path):
    target = tmp_path / "missing" / "plot.png"  # `search show --plot` into a folder that is not there
    with pytest.raises(UserError, match=r"could not write .*plot\.png: No such file or directory; nothing was "
                                        r"written$"):
        atomic.write_bytes(target, b"png")
    assert list(tmp_path.iterdir()) == []


def test_a_first_checkpoint_on_a_full_disk_says_nothing_was_written(tmp_path, monkeypatch):
    def full(_fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(UserError, match=r"No space left on device; nothing was written$"):
        checkpoint.save(tmp_path / "checkpoint.pt", {"step": 1})
    assert list(tmp_path.iterdir()) == []  # no half-written file, no debris

# --------------------------------------------------------------------------------- the store

def fill(store: Store, search_id: int, n: int, start: int = 0, padding: int = 0) -> None:
    for i in range(start, start + n):
        genome = {"neurons": i, "pad": "x" * padding}
        store.records.record(Candidate(0, i, genome, f"h{i:06d}", i), Outcome.ok(0.5, val_loss=0.5, epochs=1, worker="w"),
                     "tch", search_id)


def new_store(path: Path) -> int:
    with Store(path) as store:
        cfg = SearchConfig(sampler="grid")
        search_id = Search.resolve(cfg, load_space("mlp")).create(store, "tch").id
        fill(store, search_id, 5)
    return search_id


def integrity(path: Path) -> str:
    db = sqlite3.connect(path)
    try:
        return db.execute("PRAGMA integrity_check").fetchone()[0]
    finally:
        db.close()


def test_a_full_disk_under_the_store_is_our_error_and_keeps_every_committed_row(tmp_path):
    path = tmp_path / "search.db"
    search_id = new_store(path)
    done = child("""
        from towerlab.search.store import Store
        from towerlab.errors import UserError
        sys.path.insert(0, sys.argv[3])
        from test_faults_files import fill
        store = Store(sys.argv[1])
        try:
            fill(store, int(sys.argv[2]), 200, start=5, padding=2000)
        except UserError as exc:
            print(exc)
            sys.exit(2)
        """, str(path), str(search_id), str(Path(__file__).parent), fsize=128 * 1024)
    assert done.returncode == 2, done.stderr
    assert "cannot write to search store" in done.stdout and "every evaluation recorded before is kept" in done.stdout
    assert "Traceback" not in done.stderr
    assert integrity(path) == "ok"
    with Store(path) as store:
        rows = store.records.evaluations(search_id)
        assert 5 < len(rows) < 205  # the ones committed before the disk filled, each whole
        assert [r.index for r in rows] == list(range(len(rows)))
        fill(store, search_id, 1, start=1000)  # and with space again, the store takes writes


def test_the_store_survives_sigkill_during_a_stream_of_writes(tmp_path):
    path = tmp_path / "search.db"
    search_id = new_store(path)
    writer = subprocess.Popen([sys.executable, "-c", textwrap.dedent("""
        import sys
        sys.path.insert(0, sys.argv[3])
        from test_faults_files import fill
        from towerlab.search.store import Store
        store = Store(sys.argv[1])
        for i in range(5, 100000):
            fill(store, int(sys.argv[2]), 1, start=i, padding=500)
            print(i, flush=True)
        """), str(path), str(search_id), str(Path(__file__).parent)], stdout=subprocess.PIPE, text=True)
    committed = 0
    for line in writer.stdout:
        committed = int(line)
        if committed >= 60:
            break
    writer.send_signal(signal.SIGKILL)
    writer.wait()
    assert integrity(path) == "ok"
    with Store(path) as store:
        rows = store.records.evaluations(search_id)
    assert len(rows) >= committed + 1  # every commit it reported (synchronous=FULL), and no torn row
    assert [r.index for r in rows] == list(range(len(rows)))
    assert all(r.genome["pad"] == "x" * 500 for r in rows[5:])
