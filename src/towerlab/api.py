"""towerlab from Python: a script, a notebook, or code fed through stdin.

    from towerlab.api import train
    run = train(model="lenet5", data="mnist", epochs=2, devices=2)
    run.test_accuracy, run.out, run.history
    run.model.predict(images)        # raw uint8 images in, class indices out

The same jobs as the command line, through the same calls: keyword arguments are the flags
(`batch_size=64` for `--batch-size 64`), `config=` a config file, then the job runs and its record
comes back as an object. Local workers are forked where that is safe (CPU workers, CUDA untouched
in this process), so a module class defined in a notebook or in a script without an
`if __name__ == "__main__"` guard, and arrays in memory, reach every replica as they are.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Union

from towerlab.config import CUSTOM_MODEL
from towerlab.checks import ARRAYS_DATASET
from towerlab.fields import replace
from towerlab.distributed.signals import EXIT_SIGINT, EXIT_SIGTERM, Interrupted
from towerlab.data.load import DataGiven, Dataset
from towerlab.models.classifier import Classifier
from towerlab.models.custom import NetworkSource
from towerlab.models.files import load_model
from towerlab.errors import UserError
from towerlab.job_files import BEST, SUMMARY, config_path, job_record

# A config file (TOML, or a run's config.json) or its settings as a dict; None: none.
ConfigGiven = Union[str, os.PathLike, dict, None]


class _Record:
    """The summary's fields, readable as attributes (`run.test_accuracy`)."""

    summary: dict

    def __getattr__(self, name: str) -> Any:
        summary = self.__dict__.get("summary") or {}
        if name.startswith("_") or name not in summary:
            raise AttributeError(f"{type(self).__name__} has no attribute {name!r}")
        return summary[name]


@dataclass
class TrainRun(_Record):
    """What `train` returns: the run's folder and record, and the trained model.

    `summary`: summary.json (also readable as attributes: `run.test_accuracy`, `run.train_seconds`);
    `history`: one entry per evaluation of the validation set (metrics.jsonl's "epoch" and "eval"
    lines); `metrics`: every line of metrics.jsonl; `config`: config.json; `model`: the trained
    network as a `towerlab.models.classifier.Classifier` (raw uint8 images in; `.network` is the bare module).
    """

    out: Path
    summary: dict
    history: list[dict]
    metrics: list[dict]
    config: dict
    model: Classifier = field(repr=False)


@dataclass
class SearchRun(_Record):
    """What `evolve` and `grid` return: the search's folder and record.

    `summary`: summary.json (also as attributes: `search.best_val_accuracy`, `search.best_genome`);
    `generations`: generations.jsonl; `best`: best.json (with the `towerlab train` command that
    retrains the winner); `config`: config.json; `model`: the winner as a Classifier with
    `export_best=True`, else None.
    """

    out: Path
    summary: dict
    generations: list[dict]
    best: dict | None
    config: dict
    model: Optional[Classifier] = field(default=None, repr=False)



def _data_option(options: dict, data: DataGiven, validation: tuple | None, test: tuple | None) -> tuple | None:
    """`data` into `options`: a dataset's name or file as `dataset`; arrays given from Python, (images,
    labels), as ARRAYS_DATASET, and returned (None otherwise)."""
    pair = None if data is None or isinstance(data, (str, os.PathLike)) else data
    if isinstance(data, (str, os.PathLike)):
        options["dataset"] = os.fspath(data)
    elif pair is not None:
        options["dataset"] = ARRAYS_DATASET
    if (validation is not None or test is not None) and pair is None:
        raise UserError("validation= and test= go with data given as arrays, (images, labels)")
    return pair

def train(model: str | Any | Callable[[], Any] | None = None, data: str | os.PathLike | tuple | None = None, *,
          validation: tuple | None = None, test: tuple | None = None,
          config: str | os.PathLike | dict | None = None, **options: Any) -> TrainRun:
    """Train over the replicas, as `towerlab train` does, and return the run.

    `model`: a model name ("lenet5", ...), or a network of your own: an `nn.Module` (its current
    weights are the initial ones on every replica) or a function returning a new one (called after
    the run's seed is set, so every replica starts equal). `data`: a dataset name or the path of
    an .npz, or arrays in memory, `(images, labels)`: uint8 images (N, H, W) or (N, H, W, C),
    integer labels 0..K-1; with arrays, `validation=(images, labels)` (else the last `val_size`
    training images are held out: a tenth of them, at most 5,000, unless you set `val_size`) and
    `test=(images, labels)` (else no test accuracy).
    `config`: a config file (TOML, or a run's config.json) under `options`, which are the flags of
    `towerlab train` by their names (`epochs=2`, `devices=2`, `batch_size=64`, `out="runs/a"`,
    `preset="mnist-fast"`, `resume="runs/a"`).

    Raises `towerlab.errors.UserError` (one line saying what to change) for bad input,
    KeyboardInterrupt when stopped (after the replicas saved a checkpoint), RuntimeError when a
    replica failed. It may be called from a thread other than the main one; signals (Ctrl-C,
    SIGTERM) are then left to the main thread's handlers.
    """
    from towerlab.jobs.job import resolved_run
    from towerlab.jobs.train import default_out, start
    from towerlab.settings import batch_size_chosen, resolve_train

    options = dict(options)
    module = None
    if model is not None and not isinstance(model, str):
        module, model = model, CUSTOM_MODEL
    if model is not None:
        options["model"] = model
    pair = _data_option(options, data, validation, test)
    cfg, run = resolve_train(options, config)
    dataset = None
    if pair is not None:
        dataset = _array_dataset(pair, validation, test, cfg.val_size, "train", options, config, run.resume)
        cfg = replace(cfg, val_size=dataset.n_val)
    run = resolved_run(run)
    out = Path(run.resume or run.out or default_out(cfg))
    if run.resume is None and run.out is None:
        run = replace(run, out=str(out))
    fit_batch = not batch_size_chosen(options, config)
    _run(lambda: start(cfg, run, data=dataset, module=module, fit_batch=fit_batch), "training")

    metrics = _jsonl(out / "metrics.jsonl")
    return TrainRun(out=out, summary=_json(out / SUMMARY), config=_json(config_path(out)),
                    history=[m for m in metrics if m.get("kind") in ("epoch", "eval")], metrics=metrics,
                    model=load_model(out / "model.pt", module=module)[0])


def _array_dataset(data: tuple, validation: tuple | None, test: tuple | None, val_size: int, kind: str,
                   options: dict, config: ConfigGiven, resume: str | None) -> Dataset:
    """The in-memory dataset of a job given arrays: without `validation`, a tenth of the training
    images (at most `val_size`) are held out, unless `val_size` was chosen (or the job resumes)."""
    from towerlab.data.load import from_arrays
    from towerlab.settings import read_config_file, split_options

    main = "train" if kind == "train" else "search"
    chosen = resume is not None or "val_size" in split_options(options, main)[0] or \
        (config is not None and "val_size" in read_config_file(config, main)[0])
    return from_arrays(data, validation, test, val_size if chosen else min(val_size, len(data[1]) // 10))


# An objective of yours (`objective=`): FILE.py:FUNCTION, or the function itself.
ObjectiveGiven = Union[str, os.PathLike, Callable[..., Any], None]


def evolve(space: str | os.PathLike | dict | None = None, data: str | os.PathLike | tuple | None = None, *,
           validation: tuple | None = None, test: tuple | None = None, model: str | Callable | None = None,
           objective: ObjectiveGiven = None, config: str | os.PathLike | dict | None = None,
           **options: Any) -> SearchRun:
    """A genetic search, as `towerlab evolve` does: `space` ("mlp", "cnn", "whitenet", a TOML file,
    or the same as a dict: `{"model": "mlp", "genes": {"neurons": {"low": 16, "high": 512, "log":
    True}, "activation": ["relu", "tanh"]}}`), `data` (a dataset name, an .npz path, or arrays
    `(images, labels)` with `validation=` and `test=` as `train` takes them), `config` a config file,
    `options` the flags by their names (`population=10`, `generations=5`, `devices=2`,
    `export_best=True`). Or a search of your own training (docs/objectives.md): `objective=` a function
    of yours (or "FILE.py:FUNCTION"), or `command="python train.py --lr {lr}"`, with `metric=` and
    `direction=`, over a space of genes alone (a dict of them, or a file holding [genes]), without data."""
    return _search("evolve", space, data, validation, test, model, objective, config, options)


def grid(space: str | os.PathLike | dict | None = None, data: str | os.PathLike | tuple | None = None, *,
         validation: tuple | None = None, test: tuple | None = None, model: str | Callable | None = None,
         objective: ObjectiveGiven = None, config: str | os.PathLike | dict | None = None,
         **options: Any) -> SearchRun:
    """Every genome of a space (or a random `limit` of them), as `towerlab grid` does; arguments as
    for `evolve`."""
    return _search("grid", space, data, validation, test, model, objective, config, options)


def search(space: str | os.PathLike | dict | None = None, data: str | os.PathLike | tuple | None = None, *,
           validation: tuple | None = None, test: tuple | None = None, model: str | Callable | None = None,
           objective: ObjectiveGiven = None, config: str | os.PathLike | dict | None = None,
           **options: Any) -> SearchRun:
    """A search with the sampler of your choice (`sampler="tpe"`, ...), as `towerlab search run`
    does; arguments as for `evolve`."""
    return _search("search", space, data, validation, test, model, objective, config, options)


def _objective_option(options: dict, objective: ObjectiveGiven, data: DataGiven, model: object) -> Optional[Callable]:
    """`objective` into `options` (FILE.py:FUNCTION, or what a search records of a function given from
    Python); the function itself, where one was given."""
    if objective is None:
        return None
    if data is not None or model is not None:
        raise UserError("objective= trains whatever it trains: it goes without data= and model=")
    if isinstance(objective, (str, os.PathLike)):
        options["objective"] = os.fspath(objective)
        return None
    if not callable(objective):
        raise UserError(f"objective= is a function of yours, or \"FILE.py:FUNCTION\"; got {type(objective).__name__}")
    from towerlab.models.custom import function_spec

    options["objective"] = function_spec(objective)
    return objective


def _names_yours(options: dict) -> bool:
    """Whether `options` name an objective of yours (of any kind: `towerlab.objective.named`)."""
    from types import SimpleNamespace

    from towerlab.objective import named
    from towerlab.settings import split_options

    return named(SimpleNamespace(**split_options(options, "search")[0])).own


def _search(kind: str, space: str | os.PathLike | dict | None, data: DataGiven, validation: tuple | None,
            test: tuple | None, model: str | Callable | None, objective: ObjectiveGiven, config: ConfigGiven,
            options: dict) -> SearchRun:
    from towerlab.jobs.job import resolved_run
    from towerlab.jobs.search.job import start_search
    from towerlab.jobs.search.place import search_out
    from towerlab.settings import resolve_search

    options = dict(options)
    function = model if model is not None and not isinstance(model, str) else None
    own = _objective_option(options, objective, data, model)
    if isinstance(space, dict) and "genes" not in space and _names_yours(options):
        space = {"genes": space}  # the genes of your own objective
    if isinstance(space, dict) and "genes" not in space:  # the genes alone: the model is model=
        if model is None:
            raise UserError("a space given as its genes alone needs model=: a model name (\"mlp\", \"cnn\", "
                            "\"whitenet\") or a function of yours, (input_shape, num_classes, **genes) -> nn.Module")
        space = {"model": CUSTOM_MODEL if function is not None else model, "genes": space}
    elif isinstance(model, str):
        raise UserError(f"model={model!r} names the model of a space given as its genes alone (a dict); a space "
                        "file, a name or a dict with \"genes\" says its model itself")
    if isinstance(space, dict):
        # as JSON text: config.json records it, and a resume given the same dict finds the same space
        try:
            options["space"] = json.dumps(space, allow_nan=False)
        except (TypeError, ValueError) as exc:
            raise UserError(f"the space dict must hold only strings, finite numbers, lists and dicts ({exc})") from None
    elif space is not None:
        options["space"] = os.fspath(space)
    pair = _data_option(options, data, validation, test)
    cfg, run = resolve_search(kind, options, config)
    dataset = None
    if pair is not None:
        dataset = _array_dataset(pair, validation, test, cfg.val_size, kind, options, config, run.resume)
        cfg = replace(cfg, val_size=dataset.n_val)
    run = resolved_run(run)
    out = search_out(kind, cfg, run)
    if run.resume is None and run.out is None:
        run = replace(run, out=str(out))
    _run(lambda: start_search(kind, cfg, run, data=dataset, function=function, objective=own), kind)
    best = out / BEST
    return SearchRun(out=out, summary=_json(out / SUMMARY), config=_json(config_path(out)),
                     generations=_jsonl(out / "generations.jsonl"), best=_json(best) if best.exists() else None,
                     model=_exported(out, function) if cfg.export_best and (out / "model.pt").exists() else None)


def _exported(out: Path, function: Callable | None) -> Classifier:
    """A search's model.pt as a Classifier; a model function's network is rebuilt by the function, from
    the shape and classes the file records and the winner's genes."""
    if function is None:
        return load_model(out / "model.pt")[0]
    import torch

    from towerlab.objective.candidate import model_genes

    record = torch.load(out / "model.pt", map_location="cpu", weights_only=True)
    genes = model_genes(_json(out / BEST)["genome"])
    return load_model(out / "model.pt", module=lambda: function(tuple(record["input_shape"]), record["num_classes"],
                                                                **genes))[0]


def _run(job: Callable[[], int], what: str) -> None:
    """Run a job (here, or in workers it starts) and turn its exit status into Python's terms. A job
    run here sets this process's torch threads for itself; the caller gets its own back."""
    import torch

    threads = torch.get_num_threads()
    try:
        status = job()
    except Interrupted as exc:
        status = exc.exit_status
    finally:
        torch.set_num_threads(threads)
    if status in (EXIT_SIGINT, EXIT_SIGTERM):
        raise KeyboardInterrupt(f"{what} stopped: its last checkpoint is kept; continue it with resume=")
    if status:
        raise RuntimeError(f"{what} failed (exit status {status}): see the lines above")


def _json(path: Path) -> dict:
    return job_record(path.parent, path.name)


def _jsonl(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def evaluate(run: str | os.PathLike, data: DataGiven = None, *, split: str = "test", data_dir: str | None = None,
             module: NetworkSource | None = None) -> dict:
    """Score a run's model (its folder or its model.pt) on `split` ("test" or "val") of the data it
    was trained on, or of `data` (a dataset name, an .npz path, or (images, labels) arrays).
    Returns {"dataset", "split", "n", "accuracy", "loss", "recorded" (the run's own figure)}."""
    from towerlab.jobs.scoring import score_run

    return score_run(run, data, split=split, data_dir=data_dir, module=module)
