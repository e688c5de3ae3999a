"""What decides a search's results besides its settings and seeds, and the one function that admits a
process to train a search: `admit`, which a worker that joins calls before it trains anything, and the
search's own job when it resumes the search.

Each item is one `Item`: recorded in the search's setup when it starts (`recorded`), measured by every
process that would train it (through the kind of objective it runs here: `towerlab.objective.kind.Kind`),
and compared the same way (equal, or refused in one line that names the item and says what to do; a search
recorded before an item existed is not compared on it). In the order they are checked: the numerics (the
device kind; on a CPU, the threads per candidate, whose count changes a float sum's order, and the CPU kernels
torch runs, whose sums round otherwise), the software (towerlab's version, torch's, and the digest of
towerlab's code as it runs: `code_digest`), the objective (its kind and goal, and for an objective of yours
the proof of what it runs: `Kind.objective`), then the kind's own items (towerlab's training: the data's
content, the model file's content and, once it is imported, its proof: `towerlab.objective.training`), and at
last the search's training-config hash, made again here from all of them (`Kind.training_hash`). What is
cheap comes first: a data set is read, and a model file imported, only once every item before it matched. A
resume of the search's own job records this machine's software as the search's from then on (with a
warning) where it differs; its training hash is `Search.resume`'s to check, which names the settings.

And the provenance that every evaluation row records (`row_provenance`): the host, towerlab's and torch's
versions, towerlab's code digest, the device's name (on a CPU, torch's kernels), the data's digest;
`towerlab search show` says when a search's rows come from more than one.
"""

from __future__ import annotations

import socket
from typing import Any, Optional

import torch

import towerlab
from towerlab.distributed.env import cpu_capability, device_name
from towerlab.errors import UserError
from towerlab.objective.kind import TRAINING_HASH, Item, Kind
from towerlab.proof import short
from towerlab.proof.package import package_proof
from towerlab.search import Search

# What a search records of the software that trains it (its setup's keys), in the order a worker checks them.
VERSIONS = ("towerlab", "torch", "code")


def code_digest() -> str:
    """The digest of towerlab's code as this process runs it: every source file of the installed package,
    by its path in it, from the bytes its modules ran from (`towerlab.proof.package.package_proof`: never
    a stale .pyc's word). Whatever decides a result (the seed a worker derives, the process group, a
    reader, a decoder) is in it, not a list of what might; the same package installed elsewhere has the
    same."""
    return package_proof("towerlab").digest


def versions() -> dict:
    """This process's software, as VERSIONS name it."""
    return {"towerlab": towerlab.__version__, "torch": torch.__version__, "code": code_digest()}


def _version(key: str) -> Item:
    def differs(theirs: Any, ours: Any, objective: Kind, search: Search) -> str:
        if key == "code":
            return (f"towerlab's code here differs from the search's (digest {short(ours)}, the search's "
                    f"{short(theirs)}): the same version with other source (a checkout with changes, a stale .pyc?); "
                    "run the search's towerlab here")
        return (f"it was started with {key} {theirs}, and this is {key} {ours}, whose results may differ: "
                f"install {key} {theirs} here")
    return Item(key, lambda objective, search, stored: versions()[key], differs, on_resume="adopt")


def _objective_differs(theirs: dict, ours: dict, objective: Kind, search: Search) -> str:
    if ours["kind"] != theirs["kind"]:
        from towerlab.objective import kind_class, worker_flag

        runs = kind_class(ours["kind"]).runs
        return (f"it searches {kind_class(theirs['kind']).searches(search)}, and this worker runs {runs}: start "
                f"{worker_flag(theirs['kind'], search.aim.spec)}")
    if (ours["metric"], ours["direction"]) != (theirs["metric"], theirs["direction"]):
        return (f"it searches {theirs['metric']} ({theirs['direction']}), this worker {ours['metric']} "
                f"({ours['direction']}): give --metric {theirs['metric']} --direction {theirs['direction']}, or "
                "neither")
    from towerlab.proof import Proof

    named = Proof(ours["proof"]).difference({k: v for k, v in theirs["proof"].items() if k in ours["proof"]})
    return (f"its objective's code differs here: {named or Proof(ours['proof']).difference(theirs['proof'])}: "
            + ("resume with the files it started with" if objective.here.resuming else
               "give this worker the search's files"))


def _capability_differs(theirs: str, ours: str, objective: Kind, search: Search) -> str:
    return (f"its CPU workers' torch runs {theirs} kernels, this one's {ours}, whose sums round otherwise: run it "
            f"where torch runs {theirs} (ATEN_CPU_CAPABILITY={theirs.lower()} lowers a CPU's to that)")


# The items every kind of objective is measured on, before its own (`Kind.items`) and the training hash.
COMMON: tuple[Item, ...] = (
    Item("device", lambda objective, search, stored: objective.here.device.type,
         lambda theirs, ours, objective, search: f"it trains on {theirs}, this worker on {ours} (start the worker "
                                                 f"with --device {theirs})"),
    Item("threads", lambda objective, search, stored: objective.threads if objective.here.device.type == "cpu" else None,
         lambda theirs, ours, objective, search: f"it trains each candidate on {theirs} CPU thread(s), this worker "
                                                 f"on {ours}, which sums in another order (leave --threads out)"),
    Item("cpu_capability", lambda objective, search, stored: cpu_capability() if objective.here.device.type == "cpu"
         else None, _capability_differs),
    *(_version(key) for key in VERSIONS),
    Item("objective", lambda objective, search, stored: objective.objective(stored), _objective_differs),
)
TRAINING_ITEM = Item(TRAINING_HASH, lambda objective, search, stored: objective.training_hash(search),
                     lambda theirs, ours, objective, search: "its training settings differ from this worker's (the "
                     "data's content, the model function's source, or an older towerlab's settings): results here "
                     "would not be the search's", on_resume="search")


def items(objective: Kind) -> tuple[Item, ...]:
    """Every item `objective` is admitted on, in the order they are checked."""
    return (*COMMON, *objective.items, TRAINING_ITEM)


def recorded(objective: Kind) -> dict:
    """What a new search (`objective.search`, resolved) records in its setup of the process that starts it: each
    of its items (the training hash is a column of its own), those it has, and what the objective records
    besides (`Kind.setup`)."""
    search = objective.search
    found = {item.key: item.measure(objective, search, None) for item in items(objective) if item.key != TRAINING_HASH}
    return {**objective.setup(), **{key: value for key, value in found.items() if value is not None}}


def admit(search: Search, objective: Kind) -> list[str]:
    """Whether `objective` (of this process) may train `search`: each of its items compared, in order; the first
    that differs is a UserError in one line. Returns what a resume adopts (each adopted item's difference, in
    words)."""
    resuming = objective.here.resuming
    if search.recorded("device") is None and not resuming:
        raise UserError("it was made by an older towerlab, which did not record how its workers train: continue it "
                        "with `towerlab search run --resume`")
    adopted = []
    for item in items(objective):
        theirs = item.stored(search)
        if theirs is None or (resuming and item.on_resume == "search"):
            continue
        ours = item.measure(objective, search, theirs)
        if ours is None or ours == theirs:
            continue
        if resuming and item.on_resume == "adopt":
            adopted.append(item.differs(theirs, ours, objective, search))
            continue
        raise UserError(item.differs(theirs, ours, objective, search))
    return adopted


def row_provenance(device: torch.device, data_digest: Optional[str]) -> dict:
    """Where an evaluation came from, as its row records it (on a CPU, the kernels torch runs as well)."""
    return {"host": socket.gethostname(), **versions(), "device": device_name(device), "data": data_digest,
            **({"cpu": cpu_capability()} if device.type == "cpu" else {})}
