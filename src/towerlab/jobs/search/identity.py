"""What decides a search's results besides its settings and seeds, and the one function that admits a
process to train a search: `admit`, which a worker that joins calls before it trains anything, and the
search's own job when it resumes the search.

Each item is one entry of ITEMS: recorded in the search's setup when it starts (`recorded`), measured by
every process that would train it, and compared the same way (equal, or refused in one line that names the
item and says what to do; a search recorded before an item existed is not compared on it). In the order
they are checked: the numerics (the device kind; on a CPU, the threads per candidate, whose count changes a
float sum's order, and the CPU kernels torch runs, whose sums round otherwise), the software (towerlab's
version, torch's, and the digest of towerlab's code as it runs: `code_digest`), a search of your own
objective's objective (its kind, metric, direction and proof: `towerlab.jobs.search.trials`), the data's
content (`towerlab.data.digest`), the model file's content (for `--model FILE.py:FUNCTION`) and, once it
is imported, its proof (the file and the modules of yours it imports, as they ran: `towerlab.proof`), and at
last the search's training-config hash, made again here from all of them. What is cheap comes first: a
data set is read, and a model file imported, only once every item before it matched. A resume of the
search's own job records this machine's software as the search's from then on (with a warning) where it
differs; its training hash is `Search.resume`'s to check, which names the settings.

Which model files a worker imports (the trust boundary): a model file is code, and a store's rows are
data that anyone who can write the store may change. So a worker imports a model file only where its own
command names it (`towerlab search worker --model FILE.py:FUNCTION`; a search's own job, and its
`--resume`, name theirs with --model), never because the store names a path, and only once every other
check has passed and the named file's SHA-256 is the one the search recorded; what it imports in turn is
compared once it is loaded, before anything trains.

And the provenance that every evaluation row records (`row_provenance`): the host, towerlab's and torch's
versions, towerlab's code digest, the device's name (on a CPU, torch's kernels), the data's digest;
`towerlab search show` says when a search's rows come from more than one.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Literal, Optional, Protocol

import torch

import towerlab
from towerlab.proof import Proof, short
from towerlab.proof.package import package_proof
from towerlab.data.load import Dataset
from towerlab.distributed.env import cpu_capability, device_name
from towerlab.errors import UserError
from towerlab.config import SearchConfig
from towerlab.jobs.candidate import CandidateModel, train_config_hash
from towerlab.models.custom import function_proof
from towerlab.search import Search, genome_hash

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


class Here(Protocol):
    """This process's side of a search, as `admit` measures it: what it trains on (`device`, and on a CPU
    `threads` per candidate), its data and their digest (`towerlab.data.digest.digest_as`: the `recorded`
    one where an older towerlab's formula gives it of these data; None: it has none, an objective of yours
    trains on its own), the digest of the model file it would import for the search (the one whose digest
    is `recorded`, of those it may import; None where its networks come from no file: a family, or a
    function given from Python) and where that file is (`model_path`), the model itself and its proof
    (`model_proof`: the parts of `towerlab.proof.Proof`, the file and the modules of yours it imports, as
    they ran; None where no file of yours was loaded through towerlab.proof), and whether it is the
    search's own job resuming it. Each is measured once, when asked."""

    resuming: bool
    device: str
    threads: Optional[int]

    def data(self) -> Dataset: ...

    def digest(self, recorded: Optional[str] = None) -> Optional[str]: ...

    def model_digest(self, recorded: Optional[str]) -> Optional[str]: ...

    @property
    def model_path(self) -> str: ...

    def model(self) -> CandidateModel: ...

    def objective(self, recorded: Optional[dict]) -> Optional[dict]:
        """The objective of yours it would run (kind, metric, direction, proof), measured against the search's
        `recorded` one where there is one; None where it runs towerlab's own training."""

    def model_proof(self) -> Optional[dict]: ...


TRAINING_HASH = "train_config_hash"  # the search's own column, not a key of its setup


@dataclass(frozen=True)
class Item:
    """One thing that decides a search's results (see the module's docstring), stored under `key`;
    `measure(here, search, stored)` is this process's (None: it has none to compare); `differs(stored,
    ours, here, search)` says in one line which differs and what to do; `on_resume`: what the search's own
    job does where it differs as it resumes ("refuse"; "adopt": record this process's as the search's from
    then on; "search": left to `Search.resume`)."""

    key: str
    measure: Callable[[Here, Search, Any], Any]
    differs: Callable[[Any, Any, Here, Search], str]
    on_resume: Literal["refuse", "adopt", "search"] = "refuse"

    def stored(self, search: Search) -> Any:
        """What `search` holds of this item (None: recorded before it existed)."""
        return search.train_config_hash if self.key == TRAINING_HASH else search.recorded(self.key)


def _version(key: str) -> Item:
    def differs(theirs: Any, ours: Any, here: Here, search: Search) -> str:
        if key == "code":
            return (f"towerlab's code here differs from the search's (digest {short(ours)}, the search's "
                    f"{short(theirs)}): the same version with other source (a checkout with changes, a stale .pyc?); "
                    "run the search's towerlab here")
        return (f"it was started with {key} {theirs}, and this is {key} {ours}, whose results may differ: "
                f"install {key} {theirs} here")
    return Item(key, lambda here, search, stored: versions()[key], differs, on_resume="adopt")


def _data_differs(theirs: str, ours: str, here: Here, search: Search) -> str:
    source = here.data().source
    files = source.get("files") or []
    where = f"{source.get('format')}, {files[0]}" + (f" and {len(files) - 1} more" if len(files) > 1 else "") \
        if files else str(source.get("format"))
    return (f"its data differ: {search.cfg.dataset} here ({where}) holds content {short(ours)}, the search's "
            f"{short(theirs)} (another file, a label changed?): use the search's data here (--data-dir)")


def _model_differs(theirs: str, ours: str, here: Here, search: Search) -> str:
    if here.resuming:
        return (f"its model file changed since it started ({here.model_path} holds SHA-256 {short(ours)}, the "
                f"search's {short(theirs)}): resume with the file it started with")
    recorded_file = Path(str(search.recorded("model")).rpartition(":")[0]).name
    return (f"its model file differs: {here.model_path} here holds SHA-256 {short(ours)}, the search's "
            f"{recorded_file} {short(theirs)}: give this worker the search's file")


def _objective(here: Here, search: Search, recorded: Optional[dict]) -> Optional[dict]:
    """The objective item's measure: this process's objective; towerlab's training ("training") where the search
    `recorded` one of yours, so that a worker of towerlab's networks is refused it."""
    ours = here.objective(recorded)
    return {"kind": "training"} if ours is None and recorded is not None else ours


def _objective_differs(theirs: dict, ours: dict, here: Here, search: Search) -> str:
    if ours["kind"] != theirs["kind"]:
        runs = "towerlab's training" if ours["kind"] == "training" else f"a {ours['kind']}"
        flag = {"function": "--objective FILE.py:FUNCTION", "command": "--command '...'"}.get(theirs["kind"], "")
        return (f"it searches your own {theirs['kind']} objective, and this worker runs {runs}: start it with {flag} "
                f"(the search's: {search.cfg.objective or search.cfg.trial_command})")
    if (ours["metric"], ours["direction"]) != (theirs["metric"], theirs["direction"]):
        return (f"it searches {theirs['metric']} ({theirs['direction']}), this worker {ours['metric']} "
                f"({ours['direction']}): give --metric {theirs['metric']} --direction {theirs['direction']}, or "
                "neither")
    named = Proof(ours["proof"]).difference({k: v for k, v in theirs["proof"].items() if k in ours["proof"]})
    return (f"its objective's code differs here: {named or Proof(ours['proof']).difference(theirs['proof'])}: "
            + ("resume with the files it started with" if here.resuming else "give this worker the search's files"))


def objective_hash(cfg: SearchConfig, device: str, threads: Optional[int], objective: dict,
                   timeout: Optional[float] = None) -> str:
    """The training-config hash of a search of your own objective: what decides a trial's result besides its
    genes and seed (the objective's kind, metric, direction and proof, the last rung's epochs, and the
    numerics: device kind, a function's CPU threads). Not --trial-timeout, which decides no result a row
    holds (a trial past it fails, and a failed row serves no other search): a resume may change it, and a
    new search with one is served the rows of one without. `timeout`: what a search made before took (its
    hash held its --trial-timeout)."""
    return genome_hash({"objective": {key: objective[key] for key in ("kind", "metric", "direction")},
                        "proof": Proof(objective["proof"]).digest, "max_epochs": cfg.max_epochs,
                        "trial_timeout": timeout, "numerics": {"device": device, "threads": threads}})


def model_proof(model: CandidateModel) -> Optional[dict]:
    """What `Here.model_proof` is of `model` (loaded): its function's proof's parts (`function_proof`)."""
    found = function_proof(model) if callable(model) else None
    return None if found is None else dict(found.parts)


def _model_proof_differs(theirs: dict, ours: dict, here: Here, search: Search) -> str:
    difference = Proof(ours).difference(theirs)
    if here.resuming:
        return (f"the modules of yours that its model file imports changed since it started ({difference}): "
                "resume with the files it started with")
    return (f"the modules of yours that its model file imports differ here ({difference}): give this worker the "
            "search's files (those beside its model file, and the packages of yours it imports)")


def training_hash(search: Search, here: Here, stored: Optional[Search] = None) -> str:
    """The search's training-config hash, made here: its settings, and this process's numerics, data and
    model, with the data's digest and the model's proof where `stored` (the search as its store holds it)
    records them (None: a new search, which records both); or those of the objective of yours it runs
    (`objective_hash`)."""
    own = here.objective(search.recorded("objective"))
    if own is not None:
        timeout = None if stored is None else stored.cfg.trial_timeout
        if stored is not None and timeout is not None:  # a search made while the hash held its timeout keeps it
            made_before = objective_hash(search.cfg, here.device, here.threads, own, timeout)
            if made_before == stored.train_config_hash:
                return made_before
        return objective_hash(search.cfg, here.device, here.threads, own)

    def where(key: str, measure: Callable[[], Any]) -> Any:
        return measure() if stored is None or stored.recorded(key) is not None else None

    proven = where("model_proof", here.model_proof)
    return train_config_hash(search.cfg, here.device, here.threads, here.model(), where("data_digest", here.digest),
                             None if proven is None else Proof(proven).digest)


def _capability_differs(theirs: str, ours: str, here: Here, search: Search) -> str:
    return (f"its CPU workers' torch runs {theirs} kernels, this one's {ours}, whose sums round otherwise: run it "
            f"where torch runs {theirs} (ATEN_CPU_CAPABILITY={theirs.lower()} lowers a CPU's to that)")


ITEMS: tuple[Item, ...] = (
    Item("device", lambda here, search, stored: here.device,
         lambda theirs, ours, here, search: f"it trains on {theirs}, this worker on {ours} (start the worker with "
                                            f"--device {theirs})"),
    Item("threads", lambda here, search, stored: here.threads if here.device == "cpu" else None,
         lambda theirs, ours, here, search: f"it trains each candidate on {theirs} CPU thread(s), this worker on "
                                            f"{ours}, which sums in another order (leave --threads out)"),
    Item("cpu_capability", lambda here, search, stored: cpu_capability() if here.device == "cpu" else None,
         _capability_differs),
    *(_version(key) for key in VERSIONS),
    Item("objective", _objective, _objective_differs),
    Item("data_digest", lambda here, search, stored: here.digest(stored), _data_differs),
    Item("model_sha256", lambda here, search, stored: here.model_digest(stored), _model_differs),
    Item("model_proof", lambda here, search, stored: here.model_proof(), _model_proof_differs),
    Item(TRAINING_HASH, lambda here, search, stored: training_hash(search, here, search),
         lambda theirs, ours, here, search: "its training settings differ from this worker's (the data's content, the "
                                            "model function's source, or an older towerlab's settings): results here "
                                            "would not be the search's", on_resume="search"),
)


def recorded(search: Search, here: Here) -> dict:
    """What a new search (`search`, resolved) records in its setup of the process that starts it: each item
    of its setup (the training hash is a column of its own), those it has."""
    found = {item.key: item.measure(here, search, None) for item in ITEMS if item.key != TRAINING_HASH}
    return {key: value for key, value in found.items() if value is not None}


def admit(search: Search, here: Here) -> list[str]:
    """Whether `here` may train `search`: each item of ITEMS compared, in order; the first that differs is
    a UserError in one line. Returns what a resume adopts (each adopted item's difference, in words)."""
    if search.recorded("device") is None and not here.resuming:
        raise UserError("it was made by an older towerlab, which did not record how its workers train: continue it "
                        "with `towerlab search run --resume`")
    adopted = []
    for item in ITEMS:
        theirs = item.stored(search)
        if theirs is None or (here.resuming and item.on_resume == "search"):
            continue
        ours = item.measure(here, search, theirs)
        if ours is None or ours == theirs:
            continue
        if here.resuming and item.on_resume == "adopt":
            adopted.append(item.differs(theirs, ours, here, search))
            continue
        raise UserError(item.differs(theirs, ours, here, search))
    return adopted


def row_provenance(device: torch.device, data_digest: Optional[str]) -> dict:
    """Where an evaluation came from, as its row records it (on a CPU, the kernels torch runs as well)."""
    return {"host": socket.gethostname(), **versions(), "device": device_name(device), "data": data_digest,
            **({"cpu": cpu_capability()} if device.type == "cpu" else {})}
