"""A search on more workers than one command may start on this machine, as a cluster runs it.

towerlab refuses to start more local processes than a machine holds (8 a core, and 512 MiB each:
`towerlab.distributed.env.check_capacity`; 16 on the 2-core machine these benchmarks ran on). A search of
32 workers is then what it is on a cluster: `towerlab search run ... --devices N` on as many as one
command may start, and `towerlab search worker OUT ... --devices M` for the rest, each joining the
search's store once it exists, as further machines would (`crewed_search`). Each worker that joins pays
its own start (importing torch, proving the objective) before its first claim, inside the search's
span, as a machine joining a running search does.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path


def most_here() -> int:
    """The processes one towerlab command may start on this machine (its own rule, read from towerlab)."""
    from towerlab.distributed.env import OVERSUBSCRIPTION, PROCESS_BYTES, machine_memory

    return max(1, min(OVERSUBSCRIPTION * (os.cpu_count() or 1), machine_memory() // PROCESS_BYTES))


def crewed_search(run: list[str], joining: list[str], workers: int, out: str, cwd: Path,
                  env: dict[str, str]) -> subprocess.CompletedProcess:
    """`towerlab search run *run --devices W --out out` in `cwd`, W its `workers` where one command may start
    them all; else on as many as it may, and `towerlab search worker out *joining --devices M` for the rest
    (M at most as many), started once the search's store exists. The search run's completed process; a
    joining worker that fails is a RuntimeError."""
    most = most_here()
    command = [sys.executable, "-m", "towerlab", "search", "run", *run, "--devices", str(min(workers, most)),
               "--out", out]
    search = subprocess.Popen(command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    crews, left = [], workers - min(workers, most)
    store = Path(cwd, out, "search.db")
    while left > 0 and search.poll() is None:
        if not store.exists():
            time.sleep(0.1)
            continue
        size = min(left, most)
        crews.append(subprocess.Popen([sys.executable, "-m", "towerlab", "search", "worker", out, *joining,
                                       "--device", "cpu", "--devices", str(size)], cwd=cwd, env=env,
                                      stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True))
        left -= size
    stdout, stderr = search.communicate()
    for crew in crews:
        _, said = crew.communicate(timeout=600)
        if crew.returncode != 0:
            raise RuntimeError(f"a joining worker: {said[-2000:]}")
    return subprocess.CompletedProcess(command, search.returncode, stdout, stderr)
