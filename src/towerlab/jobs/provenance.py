"""config.json: a job's resolved configuration with its provenance (versions, code, host, command),
and reading it back.
"""

from __future__ import annotations

import platform
import socket
import subprocess
import sys
from pathlib import Path

import torch

import towerlab
from towerlab import atomic
from towerlab.distributed.env import cpu_capability, torchrun_restart
from towerlab.job_files import CONFIG, config_path, job_record


def code_version() -> dict | None:
    """The git commit of towerlab's own source, and whether the tree differs from it; None when
    towerlab is not run from a git checkout (an installed wheel) or git is absent."""
    source = Path(towerlab.__file__).resolve().parent
    try:
        commit = subprocess.run(["git", "-C", str(source), "rev-parse", "HEAD"], capture_output=True, text=True,
                                timeout=10, check=True).stdout.strip()
        status = subprocess.run(["git", "-C", str(source), "status", "--porcelain", "--untracked-files=no"],
                                capture_output=True, text=True, timeout=10, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return {"git_commit": commit, "dirty": bool(status.strip())}


def provenance() -> dict:
    """What config.json records besides the configuration: versions, code, host, the CPU kernels torch runs,
    command."""
    return {"torch_version": torch.__version__, "towerlab_version": towerlab.__version__, "cpu_capability": cpu_capability(),
            "python_version": platform.python_version(), "code": code_version(), "host": socket.gethostname(),
            "torchelastic_run_id": torchrun_restart()[0], "command": [Path(sys.argv[0]).name, *map(_without_password, sys.argv[1:])]}


def _without_password(arg: str) -> str:
    """A command-line word as config.json records it: a database URL (`--store URL`, `--store=URL`)
    without its password."""
    from towerlab.search.store.location import redacted

    flag, equals, value = arg.partition("=") if arg.startswith("--") else ("", "", arg)
    return flag + equals + redacted(value)


def write_config(out: Path, record: dict) -> None:
    """config.json: the job's resolved configuration (`record`) with its provenance."""
    atomic.write_json(config_path(out), {**record, **provenance()})


def read_config(out: Path, name: str = CONFIG) -> dict | None:
    """config.json (or another JSON record, `name`) of `out`, or None when it is missing or unreadable."""
    try:
        return job_record(out, name)
    except (OSError, ValueError):
        return None
