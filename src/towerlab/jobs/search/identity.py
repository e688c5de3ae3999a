"""What decides a search's results besides its settings and seeds, recorded in its setup when it starts and
checked item by item by every worker before the worker trains it: towerlab's version and a digest of the
training code, torch's version, the data's content (`towerlab.data.digest`), and for `--model
FILE.py:FUNCTION` the model file's content. The numerics (device kind, CPU threads per candidate) are
checked by the worker beside these. A worker where one differs trains nothing of that search and says in
one line which item differs and what to do; a search recorded before an item existed is not checked for it.

And the provenance that every evaluation row records: the host, towerlab's and torch's versions, the
training code's digest, the device's name, the data's digest; `towerlab search show` says when a search's
rows come from more than one.

Which model files a worker imports (the trust boundary): a model file is code, and a store's rows are
data that anyone who can write the store may change. So a worker imports a model file only where its own
command names it (`towerlab search worker --model FILE.py:FUNCTION`; a search's own job, and its
`--resume`, name theirs with --model), never because the store names a path, and only once every other
check has passed and the named file's SHA-256 is the one the search recorded.
"""

from __future__ import annotations

import functools
import hashlib
import socket
from pathlib import Path
from typing import Optional

import torch

import towerlab
from towerlab.distributed.env import device_name

# The source of towerlab that decides a candidate's result, relative to the package: the training loop and
# its steps, the networks and their catalog, the bridge from a genome to a training, the settings and their
# defaults, the presets, and the data's normalisation (the data's own content has its own digest).
TRAINING_CODE = ("training", "models", "catalog/models.py", "catalog/model_options.py", "jobs/candidate.py",
                 "config.py", "presets.py", "data/load.py")

# What a search records of the software that trains it (its setup's keys), in the order a worker checks them.
VERSIONS = ("towerlab", "torch", "code")


@functools.lru_cache(maxsize=1)
def code_digest() -> str:
    """SHA-256 over the files of TRAINING_CODE (their paths and bytes): the same version number with other
    source (a checkout with changes) has another."""
    root = Path(towerlab.__file__).resolve().parent
    digest = hashlib.sha256()
    for part in TRAINING_CODE:
        for path in sorted((root / part).rglob("*.py")) if (root / part).is_dir() else [root / part]:
            digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
    return f"sha256:{digest.hexdigest()}"


def file_digest(path: str | Path) -> str:
    """`sha256:` and the SHA-256 of a file's bytes (a model file's, read before it is ever imported)."""
    return f"sha256:{hashlib.sha256(Path(path).read_bytes()).hexdigest()}"


def versions() -> dict:
    """This process's software, as VERSIONS name it."""
    return {"towerlab": towerlab.__version__, "torch": torch.__version__, "code": code_digest()}


def identity(data_digest: str, model_file: Optional[str] = None) -> dict:
    """What a search records of the machine that starts it (setup keys: VERSIONS, data_digest, and with a
    model function's FILE.py, model_sha256), and a worker compares."""
    found = {**versions(), "data_digest": data_digest}
    if model_file is not None:
        found["model_sha256"] = file_digest(model_file)
    return found


def short(digest: str) -> str:
    return digest.removeprefix("sha256:")[:12]


def version_difference(recorded: dict, here: dict) -> Optional[str]:
    """The first of VERSIONS that the search recorded and that differs here, in words with what to do;
    None when none does."""
    for item in VERSIONS:
        theirs, ours = recorded.get(item), here[item]
        if theirs is None or theirs == ours:
            continue
        if item == "code":
            return (f"towerlab's training code here differs from the search's (digest {short(ours)}, the search's "
                    f"{short(theirs)}): the same version with other source (a checkout with changes?); run the "
                    "search's towerlab here")
        return (f"it was started with {item} {theirs}, and this is {item} {ours}, whose results may differ: "
                f"install {item} {theirs} here")
    return None


def data_difference(recorded: dict, digest: str, dataset: str, source: dict) -> Optional[str]:
    """Why this machine's copy of the data is not the search's (None: it is, or the search recorded none)."""
    theirs = recorded.get("data_digest")
    if theirs is None or theirs == digest:
        return None
    files = source.get("files") or []
    where = f"{source.get('format')}, {files[0]}" + (f" and {len(files) - 1} more" if len(files) > 1 else "") \
        if files else str(source.get("format"))
    return (f"its data differ: {dataset} here ({where}) holds content {short(digest)}, the search's "
            f"{short(theirs)} (another file, a label changed?): use the search's data here (--data-dir)")


def provenance(device: torch.device, data_digest: Optional[str]) -> dict:
    """Where an evaluation came from, as its row records it."""
    return {"host": socket.gethostname(), **versions(), "device": device_name(device), "data": data_digest}
