"""The command line: the only module that reads argv and chooses the exit status.

User mistakes (`UserError`) become one line on stderr and exit status 2; Ctrl-C and SIGTERM exit
130 and 143 after the run saved what it had; anything else is our bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import os
import shlex
import sys
from pathlib import Path
from typing import Any, Iterator, Sequence

# The Agg backend before anything imports pyplot: plots are files, never windows.
os.environ.setdefault("MPLBACKEND", "Agg")

from towerlab import __version__, atomic  # noqa: E402
from towerlab.config import RunConfig, SearchConfig, TrainConfig  # noqa: E402
from towerlab.fields import add_arguments, given  # noqa: E402
from towerlab.catalog import datasets  # noqa: E402
from towerlab.distributed.signals import EXIT_PEER_LOST, EXIT_SIGPIPE, EXIT_USER_ERROR, Interrupted  # noqa: E402
from towerlab.errors import UserError  # noqa: E402


class _Parser(argparse.ArgumentParser):
    def __init__(self, *args, **kwargs):  # noqa: ANN002, ANN003
        # No abbreviations: `--device cpu` must never be read as an abbreviation of `--devices`.
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> None:  # argparse's own errors: one line, exit 2, like ours
        raise UserError(f"{message} (see {self.prog} --help)")

    def parse_known_args(self, args=None, namespace=None):  # noqa: ANN001, ANN201 - argparse's signature
        namespace, extras = super().parse_known_args(args, namespace)
        # A command's own parser refuses what it does not know here, where its flags are at hand for a
        # did-you-mean (the top-level parser, which would refuse them otherwise, knows none of them).
        if extras and self._subparsers is None:
            self.error(f"unrecognized arguments: {' '.join(extras)}{_did_you_mean(self, extras)}")
        return namespace, extras


def _did_you_mean(parser: argparse.ArgumentParser, extras: list[str]) -> str:
    """' (did you mean --devices?)' for the unknown flags among `extras` that are near a known one;
    where a value follows (`--dev 2`), only flags that take that value count (--devices, not --device)."""
    known = {s: a for s, a in parser._option_string_actions.items() if s.startswith("--")}
    hints = {}
    for i, arg in enumerate(extras):
        if not arg.startswith("--"):
            continue
        flag, eq, value = arg.partition("=")
        if not eq and i + 1 < len(extras) and not extras[i + 1].startswith("-"):
            value = extras[i + 1]
        takes = [s for s, a in known.items() if not value or _accepts(a, value)]
        hints[flag] = difflib.get_close_matches(flag, takes, n=1, cutoff=0.6)
    if len(hints) == 1 and all(hints.values()):
        return f" (did you mean {next(iter(hints.values()))[0]}?)"
    named = [f"{flag} -> {near[0]}" for flag, near in hints.items() if near]
    return f" (did you mean {', '.join(named)}?)" if named else ""


def _accepts(action: argparse.Action, value: str) -> bool:
    if action.nargs == 0:  # a switch (--augment, --help) takes no value
        return False
    choices = action.choices or getattr(action, "field_choices", None)
    if choices:
        return value in choices
    try:
        (action.type or str)(value)
    except (TypeError, ValueError, argparse.ArgumentTypeError):
        return False
    return True


DESCRIPTION = """\
Train ConvNets on MNIST, Fashion-MNIST, CIFAR-10 or your own images over every device (GPUs, or
CPU processes), and search network hyperparameters with TPE (the default sampler), a genetic
algorithm (ga), a grid or at random (--min-epochs prunes hopeless candidates early).

  towerlab train --model lenet5 --dataset mnist --epochs 2     train, and test; the run lands in runs/
  towerlab evaluate runs/RUN                                   score a trained model on its test set
  towerlab predict runs/RUN images.npz                         label your own images
  towerlab search run --dataset mnist                          search MLPs for MNIST (TPE)
  towerlab evolve --dataset mnist                              the same with the genetic algorithm
  towerlab data info                                           which datasets are found where

`towerlab COMMAND --help` lists a command's flags; --config FILE reads them from a file.
The guide: docs/index.md (training.md, search.md, data.md, config.md, faults.md, api.md)."""

CONFIG_HELP = ("read settings from a TOML file, or a run's config.json to repeat that run; the flags you type "
               "win over it (see docs/config.md)")
PRINT_CONFIG_HELP = "print the resolved settings as a config file and exit, running nothing"
MODULE_HELP = ("for a run trained with a network of your own (from Python, model=...; see docs/api.md): the "
               "file that defines it and the name of its class, or of a function returning one")


TRAIN_MODEL_HELP = ("network to train: a name, or FILE.py:FUNCTION, a function of yours, FUNCTION(input_shape, "
                    "num_classes) -> nn.Module (give it again on --resume; evaluate its run with --module "
                    "FILE.py:FUNCTION)")


def _config_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", metavar="FILE", default=None, help=CONFIG_HELP)
    p.add_argument("--print-config", action="store_true", help=PRINT_CONFIG_HELP)


def _train_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train", help="train a network over one or more replicas",
                       description="Synchronous data-parallel training: one replica per device, gradients "
                                   "averaged every step (all-reduce or a CPU parameter server); see "
                                   "docs/training.md.")
    _config_flags(p)
    add_arguments(p, TrainConfig, helps={"model": TRAIN_MODEL_HELP})
    add_arguments(p, RunConfig)
    p.set_defaults(handler=_cmd_train)


def _model_parsers(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("evaluate", help="score a trained model on a dataset's test (or validation) split",
                       description="Score the model of a run (its folder, or a model.pt) on the test split of "
                                   "the dataset it was trained on, found as the run found it, or of --dataset; see "
                                   "docs/api.md.")
    p.add_argument("run", metavar="RUN_DIR", help="a run's output folder, or a model.pt")
    p.add_argument("--dataset", default=None, help="a dataset name or an .npz path (default: the run's own)")
    p.add_argument("--data-dir", default=None, help="dataset folder (default: the run's, else $TOWERLAB_DATA, "
                                                    "else the user cache)")
    p.add_argument("--split", default="test", choices=("test", "val"), help="which split (default: test)")
    p.add_argument("--module", metavar="FILE.py:NAME", default=None, help=MODULE_HELP)
    p.set_defaults(handler=_cmd_evaluate)
    p = sub.add_parser("predict", help="label images with a trained model",
                       description="Label the images of an .npz (array x, or images or x_test: uint8, (N, H, W) "
                                   "or (N, H, W, C)) with the model of a run; writes predictions and "
                                   "probabilities, and the accuracy when the file holds labels (y, labels or y_test); "
                                   "see docs/api.md.")
    p.add_argument("run", metavar="RUN_DIR", help="a run's output folder, or a model.pt")
    p.add_argument("images", help="an .npz holding the images")
    p.add_argument("--out", default=None, help="where to write the predictions (.npz; default: "
                                               "<images name>-predictions.npz beside the images, or in --out when "
                                               "it is a folder)")
    p.add_argument("--module", metavar="FILE.py:NAME", default=None, help=MODULE_HELP)
    p.set_defaults(handler=_cmd_predict)


def _data_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("data", help="download datasets or show which are found",
                       description="Download datasets or show which are found where; see docs/data.md.")
    data_sub = p.add_subparsers(dest="data_command", required=True, parser_class=_Parser)
    fetch = data_sub.add_parser("fetch", help="download a dataset's official files (checksums verified)")
    fetch.add_argument("name", help=f"one of {', '.join(datasets.downloadable())}")
    fetch.add_argument("--data-dir", default=None, help="target folder (default: $TOWERLAB_DATA, else the user cache)")
    fetch.set_defaults(handler=_cmd_data_fetch)
    info = data_sub.add_parser("info", help="which datasets are found where")
    info.add_argument("--data-dir", default=None, help="folder to look in (default: $TOWERLAB_DATA, else the user cache)")
    info.set_defaults(handler=_cmd_data_info)


SEARCH_RUN_SKIP = ("preset", "strategy", "input", "display_step", "compile", "tensorboard", "allow_changed_data")


def _search_run_helps(kind: str) -> dict[str, str]:
    """RunConfig's help texts as a search means them."""
    return {"out": f"output folder (None: runs/<timestamp>-{kind}-<space>-<dataset>)",
            "resume": f"continue the interrupted {'' if kind == 'search' else kind + ' '}search in this folder",
            "devices": "local devices, one worker each (None: every GPU, or 2 CPU processes without one; "
                       "1 on a one-core machine)",
            "threads": "CPU threads per worker (None: cores / local workers)",
            "progress": "progress bar over the candidates when the terminal is interactive"}


MODEL_FUNCTION_HELP = ("FILE.py:FUNCTION: a function of yours, FUNCTION(input_shape, num_classes, **genes) -> "
                       "nn.Module, that builds the networks of a space of model \"custom\" (give it again on --resume)")


def _search_flags(parser: argparse.ArgumentParser, kind: str) -> None:
    """A search command's flags: SearchConfig's, each sampler's own settings', the run's."""
    from towerlab.search.samplers import settings_classes

    add_arguments(parser, SearchConfig, skip=("sampler",) if kind != "search" else ())
    for settings in settings_classes():
        add_arguments(parser, settings)
    add_arguments(parser, RunConfig, skip=SEARCH_RUN_SKIP, helps=_search_run_helps(kind))
    if kind != "search":
        # Not in the help of a command whose sampler never reads them (grid's --population, evolve's --limit);
        # still parsed, so that one is refused in the line saying which sampler reads it.
        from towerlab.search import settings_of_others
        from towerlab.settings import SEARCH_COMMANDS

        unread = settings_of_others(SEARCH_COMMANDS[kind])
        for action in parser._actions:
            if action.dest in unread:
                action.help = argparse.SUPPRESS
        parser._action_groups = [g for g in parser._action_groups  # a heading over no flag at all goes too
                                 if not g._group_actions or any(a.help != argparse.SUPPRESS for a in g._group_actions)]


def _search_parsers(sub: argparse._SubParsersAction) -> None:
    for kind, text in (("evolve", "evolve network hyperparameters with a genetic algorithm"),
                       ("grid", "evaluate every genome of a search space (or a random --limit of them)")):
        p = sub.add_parser(kind, help=text, description=text + ", on every device and machine; see docs/search.md.")
        _config_flags(p)
        _search_flags(p, kind)
        p.add_argument("--model", dest="model_function", metavar="FILE.py:FUNCTION", help=MODEL_FUNCTION_HELP)
        p.set_defaults(handler=_cmd_search, kind=kind)
    search = sub.add_parser("search", help="search with any sampler; inspect stored searches",
                            description="Search with any sampler (tpe, ga, grid, random); inspect stored "
                                        "searches; see docs/search.md.")
    search_sub = search.add_subparsers(dest="search_command", required=True, parser_class=_Parser)
    text = "search network hyperparameters with the --sampler of your choice"
    p = search_sub.add_parser("run", help=text, description=text + ", on every device and machine; see "
                                                                   "docs/search.md.")
    _config_flags(p)
    _search_flags(p, "search")
    p.add_argument("--model", dest="model_function", metavar="FILE.py:FUNCTION", help=MODEL_FUNCTION_HELP)
    p.set_defaults(handler=_cmd_search, kind="search")
    text = "join the searches of a store with this machine's devices, until nothing is left to do"
    p = search_sub.add_parser("worker", help=text, description=text + "; see docs/distributed-search.md.")
    p.add_argument("store", nargs="?", default=None,
                   help="the store: a postgresql:// URL, a search.db, or a search's folder (default: $TOWERLAB_STORE)")
    p.add_argument("--search", type=int, default=None, metavar="ID", help="join this search only")
    p.add_argument("--wait", action="store_true", help="when nothing is left, wait for new work (until Ctrl-C)")
    p.add_argument("--workers-per-device", type=int, default=1, metavar="N",
                   help="candidates trained at once on each device")
    add_arguments(p, RunConfig, skip=tuple(f for f in RunConfig.__dataclass_fields__
                                           if f not in ("device", "devices", "threads", "data_dir", "download")),
                  helps={"devices": "local devices, one worker each (None: every GPU, or one per core without one)",
                         "threads": "CPU threads per candidate (None: each search's own; another count is "
                                    "refused, since it changes the results)"})
    p.set_defaults(handler=_cmd_search_worker)
    p = search_sub.add_parser("show", help="the generations and top genomes of a stored search, or every "
                                           "evaluation as CSV or JSON")
    p.add_argument("path", help="a search's output folder, its search.db, or a postgresql:// URL")
    form = p.add_mutually_exclusive_group()
    form.add_argument("--csv", action="store_true", help="print every evaluation as CSV (genes as gene_<name>)")
    form.add_argument("--json", action="store_true", help="print every evaluation as JSON")
    p.add_argument("--plot", metavar="PNG", help="also draw validation accuracy against training time, "
                                                 "one colour per search, into this file")
    p.set_defaults(handler=_cmd_search_show)
    p = search_sub.add_parser("export", help="write a store's searches as Optuna studies (optuna-dashboard, "
                                             "optuna.visualization)")
    p.add_argument("path", help="a search's output folder, or its search.db")
    p.add_argument("--optuna", required=True, metavar="STORAGE_URL",
                   help="the Optuna storage to write to, e.g. sqlite:///study.db")
    p.add_argument("--study-name", default=None,
                   help="the study's name (default: the folder's name; NAME-ID for each search of a shared store)")
    p.set_defaults(handler=_cmd_search_export)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="towerlab", description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"towerlab {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser, metavar="COMMAND")
    _train_parser(sub)
    _model_parsers(sub)
    _search_parsers(sub)
    _data_parser(sub)
    return parser


def resolve_train(args: argparse.Namespace) -> tuple[TrainConfig, RunConfig]:
    """The run's configs from the flags, as `towerlab.api.train` resolves its keyword arguments."""
    from towerlab.settings import resolve_train as resolve

    return resolve({**given(args, TrainConfig), **given(args, RunConfig)}, getattr(args, "config", None))


def resolve_search(args: argparse.Namespace) -> tuple[SearchConfig, RunConfig]:
    from towerlab.search.samplers import settings_classes
    from towerlab.settings import resolve_search as resolve

    options = {k: v for cls in (SearchConfig, *settings_classes(), RunConfig) for k, v in given(args, cls).items()}
    return resolve(args.kind, options, getattr(args, "config", None))


def _cmd_train(args: argparse.Namespace) -> int:
    function = None
    if ":" in getattr(args, "model", ""):  # FILE.py:FUNCTION: a model function of yours (no model name has a colon)
        from towerlab.config import CUSTOM_MODEL
        from towerlab.models.custom import load_function

        function, args.model = load_function(args.model), CUSTOM_MODEL
    cfg, run = resolve_train(args)
    if args.print_config:
        return _print_config(train=cfg, run=run)
    from towerlab.jobs.train import start

    return start(cfg, run, function=function)


def _cmd_search(args: argparse.Namespace) -> int:
    cfg, run = resolve_search(args)
    if args.print_config:  # the settings this search reads: not other samplers' nor training-only run options
        from towerlab.fields import to_dict
        from towerlab.search import settings_of_others
        from towerlab.jobs.search import check_settings

        check_settings(cfg, run)  # a file the search would refuse is not printed

        foreign = settings_of_others(cfg.sampler)
        return _print_config(search={k: v for k, v in to_dict(cfg).items() if k not in foreign},
                             run={k: v for k, v in to_dict(run).items() if k not in SEARCH_RUN_SKIP})
    from towerlab.models.custom import load_function
    from towerlab.jobs.search import start_search

    function = load_function(args.model_function) if args.model_function else None
    return start_search(args.kind, cfg, run, function=function)


def _print_config(**sections: object) -> int:
    from towerlab.settings import config_toml

    print(config_toml(**sections), end="")
    return 0


def _cmd_search_worker(args: argparse.Namespace) -> int:
    from towerlab.jobs.search_workers import start_workers
    from towerlab.search.database import STORE_ENV
    from towerlab.search.show import store_path

    target = args.store or os.environ.get(STORE_ENV, "").strip()
    if not target:
        raise UserError(f"give the store to join (a postgresql:// URL or a search.db), or set ${STORE_ENV}")
    if args.workers_per_device < 1:
        raise UserError(f"--workers-per-device must be at least 1, got {args.workers_per_device}")
    run = RunConfig(**{k: v for k, v in given(args, RunConfig).items()})
    return start_workers(str(store_path(target)), run, per_device=args.workers_per_device, search_id=args.search,
                         wait=args.wait)


def _cmd_search_show(args: argparse.Namespace) -> int:
    from towerlab.search import Store, evaluation_records, format_search
    from towerlab.search.show import records_csv, records_json, records_of, store_path

    if args.plot:
        atomic.refuse_overwriting(args.plot, (store_path(args.path),), (args.path,), option="--plot")
    with Store(store_path(args.path), create=False) as store, records_of(store):
        if args.csv or args.json or args.plot:
            records = evaluation_records(store)
            if args.plot:
                from towerlab.plots import plot_accuracy_time

                plot_accuracy_time(records, Path(args.plot), f"searches of {store.path}")
        text = records_csv(records) if args.csv else records_json(records) if args.json else format_search(store)
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


def _cmd_search_export(args: argparse.Namespace) -> int:
    from towerlab.search import Store
    from towerlab.search.export import export_optuna, printable
    from towerlab.search.show import store_path

    path = store_path(args.path)
    with Store(path, create=False) as store:
        name = args.study_name or (Path(args.path).resolve().name if Path(args.path).is_dir() else path.stem)
        for study, trials in export_optuna(store, args.optuna, name):
            print(f"study {study}: {trials} trials -> {printable(args.optuna)}")
    return 0


def _cmd_evaluate(args: argparse.Namespace) -> int:
    from towerlab.jobs.scoring import score_run

    with _own_module_flag():
        result = score_run(args.run, args.dataset, split=args.split, data_dir=args.data_dir,
                           module=_user_module(args.module), log=lambda line: print(line, file=sys.stderr, flush=True))
    recorded = f" (the run recorded {result['recorded']:.4f})" if "recorded" in result else ""
    print(f"{args.run}: {result['split']} accuracy {result['accuracy']:.4f}, loss {result['loss']:.4f} on "
          f"{result['n']} images of {result['dataset']}{recorded}")
    return 0


def _cmd_predict(args: argparse.Namespace) -> int:
    from towerlab.jobs.scoring import predict_file

    with _own_module_flag():
        result = predict_file(args.run, args.images, args.out, module=_user_module(args.module))
    accuracy = (f"; accuracy {result['accuracy']:.4f} against its labels ({result['labels']})"
                if result["accuracy"] is not None else "")
    print(f"Predicted {result['n']} images of {args.images} ({result['images']}) -> {result['out']}{accuracy}")
    return 0


def _cmd_data_fetch(args: argparse.Namespace) -> int:
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


def _cmd_data_info(args: argparse.Namespace) -> int:
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


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
        return int(args.handler(args) or 0)
    except UserError as exc:
        print(f"towerlab: error: {exc}", file=sys.stderr, flush=True)
        return EXIT_USER_ERROR
    except Interrupted as exc:
        return exc.exit_status
    except KeyboardInterrupt:
        print("towerlab: interrupted", file=sys.stderr, flush=True)
        return 130
    except BrokenPipeError:  # the reader of our output went away (`towerlab search show DIR | head`)
        from towerlab.report import closed_by_reader

        closed_by_reader(sys.stdout)
        return EXIT_SIGPIPE
    except RuntimeError as exc:
        # Under torchrun a worker runs main() itself: when another worker dies, say so in one line
        # (torchrun's agent reports which one died, and restarts the group with --max-restarts).
        from towerlab.distributed.group import peer_lost  # here, not at the top: it imports torch

        if not peer_lost(exc):
            raise
        print(f"towerlab: error: another process of the job is gone ({' '.join(str(exc).split())[:200]}); "
              "stopping", file=sys.stderr, flush=True)
        return EXIT_PEER_LOST


if __name__ == "__main__":
    raise SystemExit(main())
