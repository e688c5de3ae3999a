"""What each command of the command line does with its parsed flags (cli.py parses them): resolve the
settings, run the job or print what was asked, and return the exit status. Each imports its job where
it runs, so that `towerlab --help` imports no torch.
"""

from __future__ import annotations

import argparse
import contextlib
import shlex
import sys
from pathlib import Path
from typing import Any, Iterator

from towerlab import atomic
from towerlab.config import RunConfig, SearchConfig, TrainConfig
from towerlab.errors import UserError
from towerlab.fields import given

# RunConfig's fields that a search does not read (not flags of its commands, not in its --print-config).
SEARCH_RUN_SKIP = ("preset", "strategy", "input", "display_step", "compile", "allow_changed_data")


def resolve_train(args: argparse.Namespace) -> tuple[TrainConfig, RunConfig]:
    """The run's configs from the flags, as `towerlab.api.train` resolves its keyword arguments."""
    from towerlab.settings import resolve_train as resolve

    return resolve(_train_options(args), getattr(args, "config", None))


def _train_options(args: argparse.Namespace) -> dict:
    return {**given(args, TrainConfig), **given(args, RunConfig)}


def resolve_search(args: argparse.Namespace) -> tuple[SearchConfig, RunConfig]:
    from towerlab.search.samplers import settings_classes
    from towerlab.settings import resolve_search as resolve

    classes: list[type] = [SearchConfig, *settings_classes(), RunConfig]
    options = {k: v for cls in classes for k, v in given(args, cls).items()}
    return resolve(args.kind, options, getattr(args, "config", None))


def train(args: argparse.Namespace) -> int:
    function = None
    if ":" in getattr(args, "model", ""):  # FILE.py:FUNCTION: a model function of yours (no model name has a colon)
        from towerlab.config import CUSTOM_MODEL
        from towerlab.models.custom import load_function

        function, args.model = load_function(args.model), CUSTOM_MODEL
    cfg, run = resolve_train(args)
    if args.print_config:
        return _print_config(train=cfg, run=run)
    from towerlab.jobs.train import start
    from towerlab.settings import batch_size_chosen

    return start(cfg, run, function=function,
                 fit_batch=not batch_size_chosen(_train_options(args), getattr(args, "config", None)))


def search(args: argparse.Namespace) -> int:
    from towerlab.jobs.search.job import check_settings

    cfg, run = resolve_search(args)
    check_settings(cfg, run, args.model_function)  # a file the search would refuse is not printed, nor imported
    if args.print_config:  # the settings this search reads: not other samplers' nor training-only run options
        from towerlab.fields import to_dict
        from towerlab.search import settings_of_others

        foreign = settings_of_others(cfg.sampler)
        return _print_config(search={k: v for k, v in to_dict(cfg).items() if k not in foreign},
                             run={k: v for k, v in to_dict(run).items() if k not in SEARCH_RUN_SKIP})
    from towerlab.models.custom import load_function
    from towerlab.jobs.search.job import start_search

    function = load_function(args.model_function) if args.model_function else None
    return start_search(args.kind, cfg, run, function=function)


def _print_config(**sections: object) -> int:
    from towerlab.settings import config_toml

    print(config_toml(**sections), end="")
    return 0


def search_worker(args: argparse.Namespace) -> int:
    from towerlab.jobs.search.workers import start_workers
    from towerlab.search.store.location import store_named, store_path

    target = store_named(args.store, "the store to join")
    if args.workers_per_device < 1:
        raise UserError(f"--workers-per-device must be at least 1, got {args.workers_per_device}")
    run = RunConfig(**{k: v for k, v in given(args, RunConfig).items()})
    return start_workers(str(store_path(target)), run, per_device=args.workers_per_device, search_id=args.search,
                         wait=args.wait, model_files=tuple(args.model_files), named=_named_objective(args),
                         trials=args.trials)


def _named_objective(args: argparse.Namespace) -> Any:
    """The objective that `search worker` names (`--objective`, `--command`; neither: towerlab's training), checked
    by its kind before any worker starts (`Kind.check_worker`)."""
    from towerlab.objective import named

    found = named(args)
    if found.own and args.model_files:
        raise UserError(f"--model builds towerlab's networks; a worker of your own objective runs {found.kind} "
                        f"{found.spec!r} alone: drop --model")
    return found


def search_show(args: argparse.Namespace) -> int:
    from towerlab.search import Store, evaluation_records, format_search
    from towerlab.search.store.integrity import records_of
    from towerlab.report import printable
    from towerlab.search.store.location import folder_search, store_named, store_path
    from towerlab.search.views.show import records_csv, records_json

    path = store_named(args.path, "the search to show")
    search_id = args.search if args.search is not None else folder_search(path)
    if args.plot:
        atomic.refuse_overwriting(args.plot, (store_path(path),), (path,), option="--plot")
    with Store(store_path(path), create=False) as store, records_of(store):
        if search_id is not None and store.records.search(search_id) is None:
            raise UserError(f"store {printable(store.path)} holds no search {search_id}: `towerlab search show "
                            f"{printable(store.path)}` lists them")
        if args.csv or args.json or args.plot:
            records = [r for r in evaluation_records(store) if search_id is None or r["search"] == search_id]
            if args.plot:
                from towerlab.plots import plot_accuracy_time

                plot_accuracy_time(records, Path(args.plot), f"searches of {store.path}")
        text = (records_csv(records) if args.csv else records_json(records) if args.json
                else format_search(store, search_id))
    sys.stdout.write(text if text.endswith("\n") else text + "\n")
    return 0


def _user_module(spec: str | None) -> Any:
    """--module FILE.py:NAME -> what FILE.py defines as NAME (a network class, a function returning a
    network, or a network)."""
    from towerlab.models.custom import load_function

    return None if spec is None else load_function(spec, "--module", "NAME")


@contextlib.contextmanager
def _own_module_flag() -> Iterator[None]:
    """A run trained with a network of your own needs it again: say so in terms of the flag."""
    from towerlab.models.files import ModuleNeeded

    try:
        yield
    except ModuleNeeded as exc:
        if exc.function:  # model.pt names the function that built it: the very flag to give
            raise UserError(f"{exc.path} holds a network built by a model function of yours: give the file that "
                            f"defines it, --module {shlex.quote(exc.function)}") from None
        name = exc.module_class.rpartition(".")[2] if "." in exc.module_class else "NAME"
        raise UserError(f"{exc.path} holds a network of your own ({exc.module_class}): give the file that defines "
                        f"it, --module FILE.py:{name}") from None


def search_export(args: argparse.Namespace) -> int:
    from towerlab.search import Store
    from towerlab.report import printable
    from towerlab.search.views.export import export_optuna
    from towerlab.search.store.location import store_path

    path = store_path(args.path)

    def told(written: list[tuple[str, int]]) -> None:
        for study, trials in written:
            print(f"study {study}: {trials} trials -> {printable(args.optuna)}", flush=True)

    with Store(path, create=False) as store:
        name = args.study_name or (Path(args.path).resolve().name if Path(args.path).is_dir() else Path(path).stem)
        written = export_optuna(store, args.optuna, name, follow=told if args.follow else None)
        if not args.follow:
            told(written)
    return 0


def evaluate(args: argparse.Namespace) -> int:
    from towerlab.jobs.scoring import score_run

    with _own_module_flag():
        result = score_run(args.run, args.dataset, split=args.split, data_dir=args.data_dir,
                           module=_user_module(args.module), log=lambda line: print(line, file=sys.stderr, flush=True))
    from towerlab.report import printable

    recorded = f" (the run recorded {result['recorded']:.4f})" if "recorded" in result else ""
    print(f"{printable(args.run)}: {result['split']} accuracy {result['accuracy']:.4f}, loss {result['loss']:.4f} on "
          f"{result['n']} images of {printable(result['dataset'])}{recorded}")
    names = [printable(row["class"]) for row in result["per_class"]]
    width = max(len(name) for name in names)
    for name, row in zip(names, result["per_class"]):
        print(f"  {name:<{width}}  accuracy {row['accuracy']:.4f} on {row['n']} images")
    return 0


def predict(args: argparse.Namespace) -> int:
    from towerlab.jobs.scoring import predict_file, predict_images
    from towerlab.report import counted, printable

    npz = [path for path in args.images if str(path).lower().endswith(".npz")]
    if npz and len(args.images) > 1:
        raise UserError(f"an .npz ({npz[0]}) is labelled alone: give it by itself, or image files and folders")
    with _own_module_flag():
        if npz:
            result = predict_file(args.run, npz[0], args.out, module=_user_module(args.module))
        else:
            result = predict_images(args.run, args.images, args.out, module=_user_module(args.module),
                                    say=lambda line: print(line, flush=True))
    if not npz:
        if result["skipped"]:
            from towerlab.data.folders import skip_summary

            print(f"towerlab: skipped {skip_summary(result['skipped'])}", file=sys.stderr, flush=True)
        print(f"Predicted {counted(result['n'], 'image')} -> {printable(result['out'])}", file=sys.stderr, flush=True)
        return 0
    accuracy = (f"; accuracy {result['accuracy']:.4f} against its labels ({result['labels']})"
                if result["accuracy"] is not None else "")
    print(f"Predicted {counted(result['n'], 'image')} of {printable(npz[0])} ({result['images']}) -> "
          f"{printable(result['out'])}{accuracy}")
    return 0


def data_fetch(args: argparse.Namespace) -> int:
    from towerlab.data.fetch import fetch
    from towerlab.data.locate import resolve_data_dir

    def downloaded(filename: str, done: int, total: int | None) -> None:
        if done == total:  # a line per file, once its bytes are in (the MD5 is checked next)
            print(f"{filename}: {done:,} bytes downloaded", flush=True)

    folder = resolve_data_dir(args.data_dir)
    paths = fetch(args.name, folder, progress=downloaded)
    for path in paths:
        print(path)
    return 0


def data_info(args: argparse.Namespace) -> int:
    from towerlab.data.locate import dataset_info, resolve_data_dir

    folder = resolve_data_dir(args.data_dir)
    print(f"data folder: {folder}")
    for row in dataset_info(args.data_dir):  # as given: whether a folder was named decides the fallback
        where = row.get("path") or row.get("where") or ""
        status = "found" if row.get("found") else "missing"
        note = f"unusable: {row['problem']}" if row.get("problem") else \
            row.get("fallback") if not row.get("found") and row.get("fallback") else ""
        print(f"  {row['name']:<14} {status:<8} {row.get('format') or '':<13} {where}{'  ' if where and note else ''}"
              f"{note}".rstrip())
    return 0
