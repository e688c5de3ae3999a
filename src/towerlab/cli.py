"""The command line: the only module that reads argv and chooses the exit status. Here, its parser
(every command and its flags, generated from the configs) and `main`; what each command then does
is in commands.py.

User mistakes (`UserError`) become one line on stderr and exit status 2; Ctrl-C and SIGTERM exit
130 and 143 after the run saved what it had; anything else is our bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import difflib
import os
import sys
from typing import Any, NoReturn, Sequence

# The Agg backend before anything imports pyplot: plots are files, never windows.
os.environ.setdefault("MPLBACKEND", "Agg")

from towerlab import __version__, commands
from towerlab.catalog import datasets
from towerlab.config import DIRECTIONS, RunConfig, SearchConfig, TrainConfig
from towerlab.fields import add_arguments
from towerlab.distributed.signals import EXIT_PEER_LOST, EXIT_SIGPIPE, EXIT_USER_ERROR, Interrupted
from towerlab.errors import UserError


class _Parser(argparse.ArgumentParser):
    def __init__(self, *args: Any, **kwargs: Any):
        # No abbreviations: `--device cpu` must never be read as an abbreviation of `--devices`.
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:  # argparse's own errors: one line, exit 2, like ours
        raise UserError(f"{message} (see {self.prog} --help)")

    def parse_known_args(self, args=None, namespace=None) -> tuple[argparse.Namespace, list[str]]:  # type: ignore[override]  # noqa: ANN001 - argparse's overloads, in one
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
        (action.type if callable(action.type) else str)(value)
    except (TypeError, ValueError, argparse.ArgumentTypeError):
        return False
    return True


DESCRIPTION = """\
Train ConvNets on MNIST, Fashion-MNIST, CIFAR-10 or your own images over every device (GPUs, or
CPU processes), and search network hyperparameters, or those of your own training, with the sampler
that fits the space (auto, the default: a Gaussian process, gp, where a numeric range is in every
trial; TPE for lists alone), a genetic algorithm (ga), a grid or at random (--min-epochs prunes
hopeless candidates early).

  towerlab train --model lenet5 --dataset mnist --epochs 2     train, and test; the run lands in runs/
  towerlab evaluate runs/RUN                                   score a trained model on its test set
  towerlab predict runs/RUN photo.jpg folder/                  label your own images (or an .npz of them)
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
    p.set_defaults(handler=commands.train)


def _model_parsers(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("evaluate", help="score a trained model on a dataset's test (or validation) split",
                       description="Score the model of a run (its folder, or a model.pt) on the test split of "
                                   "the dataset it was trained on, found as the run found it, or of --dataset; see "
                                   "docs/api.md.")
    p.add_argument("run", metavar="RUN_DIR", help="a run's output folder, or a model.pt")
    p.add_argument("--dataset", default=None, help="a dataset name, an .npz path or an image folder (PATH/) "
                                                   "(default: the run's own)")
    p.add_argument("--data-dir", default=None, help="dataset folder (default: the run's, else $TOWERLAB_DATA, "
                                                    "else the user cache)")
    p.add_argument("--split", default="test", choices=("test", "val"), help="which split (default: test)")
    p.add_argument("--module", metavar="FILE.py:NAME", default=None, help=MODULE_HELP)
    p.set_defaults(handler=commands.evaluate)
    p = sub.add_parser("predict", help="label images with a trained model",
                       description="Label image files (JPEG, PNG, BMP, WebP, GIF) and the images of folders with "
                                   "the model of a run: prints each file's class name and probability and writes "
                                   "them (CSV, or JSON with --out FILE.json). Or label the images of an .npz "
                                   "(array x, or images or x_test: uint8, (N, H, W) or (N, H, W, C)): writes "
                                   "predictions and probabilities, and the accuracy when the file holds labels "
                                   "(y, labels or y_test). See docs/data.md and docs/api.md.")
    p.add_argument("run", metavar="RUN_DIR", help="a run's output folder, or a model.pt")
    p.add_argument("images", nargs="+", metavar="IMAGES",
                   help="image files and folders of them, or one .npz holding images")
    p.add_argument("--out", default=None, help="where to write the predictions (images: .csv, or .json; an .npz: "
                                               ".npz; default: <first input's name>-predictions.csv (or .npz) "
                                               "beside it, or in --out when it is a folder)")
    p.add_argument("--module", metavar="FILE.py:NAME", default=None, help=MODULE_HELP)
    p.set_defaults(handler=commands.predict)


def _data_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("data", help="download datasets or show which are found",
                       description="Download datasets or show which are found where; see docs/data.md.")
    data_sub = p.add_subparsers(dest="data_command", required=True, parser_class=_Parser)
    fetch = data_sub.add_parser("fetch", help="download a dataset's official files (checksums verified)")
    fetch.add_argument("name", help=f"one of {', '.join(datasets.downloadable())}")
    fetch.add_argument("--data-dir", default=None, help="target folder (default: $TOWERLAB_DATA, else the user cache)")
    fetch.set_defaults(handler=commands.data_fetch)
    info = data_sub.add_parser("info", help="which datasets are found where")
    info.add_argument("--data-dir", default=None, help="folder to look in (default: $TOWERLAB_DATA, else the user cache)")
    info.set_defaults(handler=commands.data_info)


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
    add_arguments(parser, RunConfig, skip=commands.SEARCH_RUN_SKIP, helps=_search_run_helps(kind))
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
        p.set_defaults(handler=commands.search, kind=kind)
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
    p.set_defaults(handler=commands.search, kind="search")
    text = "join the searches of a store with this machine's devices, until nothing is left to do"
    p = search_sub.add_parser("worker", help=text, description=text + "; see docs/distributed-search.md.")
    p.add_argument("store", nargs="?", default=None,
                   help="the store: a postgresql:// URL, a search.db, or a search's folder (default: $TOWERLAB_STORE)")
    p.add_argument("--search", type=int, default=None, metavar="ID", help="join this search only")
    p.add_argument("--wait", action="store_true", help="when nothing is left, wait for new work (until Ctrl-C or "
                                                       "SIGTERM), and on a store no search has made yet, for one")
    p.add_argument("--model", dest="model_files", action="append", default=[], metavar="FILE.py:FUNCTION",
                   help="a model file that searches of the store train with (give it once per file): a worker "
                        "imports only the model files named here, and only where its content is the search's")
    p.add_argument("--workers-per-device", type=int, default=1, metavar="N",
                   help="candidates trained at once on each device")
    own = p.add_mutually_exclusive_group()
    own.add_argument("--objective", metavar="FILE.py:FUNCTION", default=None,
                     help="join the searches of your own function objective, running this file's function (imported "
                          "only where its bytes are the search's; see docs/objectives.md)")
    own.add_argument("--command", dest="trial_command", metavar="COMMAND", default=None,
                     help="join the searches of your own command objective, running this command (the search's)")
    p.add_argument("--metric", default=None, help="the metric of your objective (default: the search's)")
    p.add_argument("--direction", default=None, choices=DIRECTIONS, help="maximize or minimize it (default: the "
                                                                          "search's)")
    p.add_argument("--trials", default="trials", metavar="DIR",
                   help="where the trials of your objective keep their folders (default: ./trials)")
    add_arguments(p, RunConfig, skip=tuple(f for f in RunConfig.__dataclass_fields__
                                           if f not in ("device", "devices", "threads", "data_dir", "download")),
                  helps={"devices": "local devices, one worker each (None: every GPU, or one per core without one)",
                         "threads": "CPU threads per candidate (None: each search's own; another count is "
                                    "refused, since it changes the results)"})
    p.set_defaults(handler=commands.search_worker)
    p = search_sub.add_parser("show", help="the generations and top genomes of a stored search, or every "
                                           "evaluation as CSV or JSON")
    p.add_argument("path", nargs="?", default=None,
                   help="a search's output folder (its search), its search.db, or a postgresql:// URL (every "
                        "search of the store; default: $TOWERLAB_STORE)")
    p.add_argument("--search", type=int, default=None, metavar="ID", help="show this search of the store only")
    form = p.add_mutually_exclusive_group()
    form.add_argument("--csv", action="store_true", help="print every evaluation as CSV (genes as gene_<name>)")
    form.add_argument("--json", action="store_true", help="print every evaluation as JSON")
    p.add_argument("--plot", metavar="PNG", help="also draw validation accuracy against training time, "
                                                 "one colour per search, into this file")
    p.set_defaults(handler=commands.search_show)
    p = search_sub.add_parser("export", help="write a store's searches as Optuna studies (optuna-dashboard, "
                                             "optuna.visualization)")
    p.add_argument("path", help="a search's output folder, its search.db, or a postgresql:// URL")
    p.add_argument("--optuna", required=True, metavar="STORAGE_URL",
                   help="the Optuna storage to write to, e.g. sqlite:///study.db")
    p.add_argument("--study-name", default=None,
                   help="the study's name (default: the folder's name; NAME-ID for each search of a shared store)")
    p.add_argument("--follow", action="store_true",
                   help="keep the studies in step with running searches (a trial per genome as each generation "
                        "completes) until they are finished, so that optuna-dashboard follows them")
    p.set_defaults(handler=commands.search_export)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="towerlab", description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"towerlab {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser, metavar="COMMAND")
    _train_parser(sub)
    _model_parsers(sub)
    _search_parsers(sub)
    _data_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    _warn_of_passwords(sys.argv[1:] if argv is None else argv)
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


def _warn_of_passwords(words: Sequence[str]) -> None:
    """One line where a URL on the command line holds a password (every user of the machine reads it)."""
    if any("://" in word for word in words):
        from towerlab.search.store.location import PASSWORD_WARNING, shows_a_password

        if any(shows_a_password(word) for word in words):
            print(PASSWORD_WARNING, file=sys.stderr, flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
