"""The command line: the only module that reads argv and chooses the exit status.

User mistakes (`UserError`) become one line on stderr and exit status 2; Ctrl-C and SIGTERM exit
130 and 143 after the run saved what it had; anything else is our bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Sequence

# The Agg backend before anything imports pyplot: plots are files, never windows.
os.environ.setdefault("MPLBACKEND", "Agg")

from towerlab import __version__  # noqa: E402
from towerlab.config import (RunConfig, SearchConfig, TrainConfig, add_arguments, from_dict, given,  # noqa: E402
                             replace, upgrade_search_config)
from towerlab.distributed import EXIT_PEER_LOST, EXIT_USER_ERROR, Interrupted, peer_lost  # noqa: E402
from towerlab.errors import UserError  # noqa: E402


class _Parser(argparse.ArgumentParser):
    def __init__(self, *args, **kwargs):  # noqa: ANN002, ANN003
        # No abbreviations: `--device cpu` must never be read as an abbreviation of `--devices`.
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> None:  # argparse's own errors: one line, exit 2, like ours
        raise UserError(f"{message} (see {self.prog} --help)")


def _train_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train", help="train a network over one or more replicas",
                       description="Synchronous data-parallel training: one replica per device, gradients "
                                   "averaged every step (all-reduce or a CPU parameter server).")
    add_arguments(p, TrainConfig)
    add_arguments(p, RunConfig)
    p.set_defaults(handler=_cmd_train)


def _data_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("data", help="download datasets or show which are found")
    data_sub = p.add_subparsers(dest="data_command", required=True, parser_class=_Parser)
    fetch = data_sub.add_parser("fetch", help="download a dataset's official files (checksums verified)")
    fetch.add_argument("name", help="mnist, fashion-mnist or cifar10")
    fetch.add_argument("--data-dir", default=None, help="target folder (default: $TOWERLAB_DATA, else the user cache)")
    fetch.set_defaults(handler=_cmd_data_fetch)
    info = data_sub.add_parser("info", help="which datasets are found where")
    info.add_argument("--data-dir", default=None, help="folder to look in (default: $TOWERLAB_DATA, else the user cache)")
    info.set_defaults(handler=_cmd_data_info)


SEARCH_RUN_SKIP = ("preset", "strategy", "input", "display_step", "compile", "tensorboard")
# The sampler each search command runs (`towerlab search run` takes --sampler).
SEARCH_COMMANDS = {"evolve": "ga", "grid": "grid"}


def _search_parsers(sub: argparse._SubParsersAction) -> None:
    for kind, text in (("evolve", "evolve network hyperparameters with a genetic algorithm"),
                       ("grid", "evaluate every genome of a search space (or a random --limit of them)")):
        p = sub.add_parser(kind, help=text, description=text + ", on every device and machine.")
        add_arguments(p, SearchConfig, skip=("sampler",))
        add_arguments(p, RunConfig, skip=SEARCH_RUN_SKIP)
        p.set_defaults(handler=_cmd_search, kind=kind)
    search = sub.add_parser("search", help="search with any sampler; inspect stored searches")
    search_sub = search.add_subparsers(dest="search_command", required=True, parser_class=_Parser)
    text = "search network hyperparameters with the --sampler of your choice"
    p = search_sub.add_parser("run", help=text, description=text + ", on every device and machine.")
    add_arguments(p, SearchConfig)
    add_arguments(p, RunConfig, skip=SEARCH_RUN_SKIP)
    p.set_defaults(handler=_cmd_search, kind="search")
    p = search_sub.add_parser("show", help="the generations and top genomes of a stored search, or every "
                                           "evaluation as CSV or JSON")
    p.add_argument("path", help="a search's output folder, or its search.db")
    form = p.add_mutually_exclusive_group()
    form.add_argument("--csv", action="store_true", help="print every evaluation as CSV (genes as gene_<name>)")
    form.add_argument("--json", action="store_true", help="print every evaluation as JSON")
    p.add_argument("--plot", metavar="PNG", help="also draw validation accuracy against training time, "
                                                 "one colour per search, into this file")
    p.set_defaults(handler=_cmd_search_show)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="towerlab", description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--version", action="version", version=f"towerlab {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    _train_parser(sub)
    _search_parsers(sub)
    _data_parser(sub)
    return parser


def resolve_train(args: argparse.Namespace) -> tuple[TrainConfig, RunConfig]:
    """The run's configs: from the flags, or for --resume from the stored run (where only run
    options may be changed)."""
    from towerlab.runner import read_run_config

    train_given, run_given = given(args, TrainConfig), given(args, RunConfig)
    if "resume" not in run_given:
        if "preset" in run_given:
            train_given, run_given = _with_preset(run_given["preset"], train_given, run_given)
        return TrainConfig(**train_given), RunConfig(**run_given)
    if "preset" in run_given:
        raise UserError("--preset does not go with --resume: the stored run already holds the preset's settings")
    folder = Path(run_given["resume"])
    _check_resume_out(folder, run_given)
    cfg, stored_run = read_run_config(folder)
    changed = [k for k, v in train_given.items() if getattr(cfg, k) != v]
    if changed:
        flags = ", ".join("--" + k.replace("_", "-") for k in changed)
        raise UserError(f"--resume continues the stored run, whose {flags} differ(s) from what you passed: "
                        "drop those flags or start a new run")
    if "devices" in run_given and run_given["devices"] != stored_run.devices:
        raise UserError(f"{folder} was trained on {stored_run.devices} replica(s): resume with "
                        f"--devices {stored_run.devices} so the result equals an uninterrupted run")
    return cfg, replace(stored_run, **{**run_given, "out": str(folder)})


def _check_resume_out(folder: Path, run_given: dict) -> None:
    """--resume writes into the folder it continues; a different --out would be silently ignored."""
    out = run_given.get("out")
    if out is not None and Path(out).absolute() != folder.absolute():
        raise UserError(f"--resume {folder} continues that folder and writes there: drop --out {out}")


# Settings a resumed search may change: they do not alter what has been computed.
SEARCH_EXTENSIBLE = ("generations", "max_evaluations", "top", "export_best", "workers_per_device")


def resolve_search(args: argparse.Namespace) -> tuple[SearchConfig, RunConfig]:
    search_given, run_given = given(args, SearchConfig), given(args, RunConfig)
    if args.kind in SEARCH_COMMANDS:
        search_given["sampler"] = SEARCH_COMMANDS[args.kind]
    if "resume" not in run_given:
        return SearchConfig(**search_given), RunConfig(**run_given)
    folder = Path(run_given["resume"])
    _check_resume_out(folder, run_given)
    try:
        stored = json.loads((folder / "config.json").read_text(encoding="utf-8"))
        search = upgrade_search_config(stored["search"], stored["kind"])
        cfg, stored_run = from_dict(SearchConfig, search), from_dict(RunConfig, stored["run"])
    except FileNotFoundError:
        raise UserError(f"{folder} is not a towerlab search (no config.json): check the --resume path") from None
    except (json.JSONDecodeError, KeyError, TypeError, AttributeError):
        raise UserError(f"{folder}/config.json is unreadable: it was not written by a towerlab search") from None
    if args.kind in SEARCH_COMMANDS and cfg.sampler != SEARCH_COMMANDS[args.kind]:
        command = next((k for k, v in SEARCH_COMMANDS.items() if v == cfg.sampler), "search run")
        raise UserError(f"{folder} holds a {cfg.sampler} search: resume it with towerlab {command} --resume {folder}")
    changed = [k for k, v in search_given.items() if getattr(cfg, k) != v and k not in SEARCH_EXTENSIBLE]
    if changed:
        flags = ", ".join("--" + k.replace("_", "-") for k in changed)
        raise UserError(f"--resume continues the stored search, whose {flags} differ(s) from what you passed: "
                        "drop those flags or start a new search")
    return replace(cfg, **search_given), replace(stored_run, **{**run_given, "out": str(folder)})


def _cmd_search(args: argparse.Namespace) -> int:
    from towerlab.search_job import start_search

    cfg, run = resolve_search(args)
    return start_search(args.kind, cfg, run)


def _cmd_search_show(args: argparse.Namespace) -> int:
    from towerlab.search import Store, evaluation_records, format_search
    from towerlab.search.show import records_csv, records_json

    with Store(args.path, create=False) as store:
        if args.csv or args.json or args.plot:
            records = evaluation_records(store)
            if args.plot:
                from towerlab.report import plot_accuracy_time

                plot_accuracy_time(records, Path(args.plot), f"searches of {store.path}")
        text = records_csv(records) if args.csv else records_json(records) if args.json else format_search(store)
    sys.stdout.write(text if text.endswith("\n") else text + "\n")
    return 0


def _with_preset(name: str, train_given: dict, run_given: dict) -> tuple[dict, dict]:
    """The preset's settings for this machine's device type, under the flags the user typed."""
    from towerlab.distributed import device_type
    from towerlab.presets import apply_preset, run_options

    kind = device_type(run_given.get("device", "auto"))
    return {**apply_preset(name, kind), **train_given}, {**run_options(name, kind), **run_given}


def _cmd_train(args: argparse.Namespace) -> int:
    from towerlab.runner import start

    cfg, run = resolve_train(args)
    return start(cfg, run)


def _cmd_data_fetch(args: argparse.Namespace) -> int:
    from towerlab.data import resolve_data_dir
    from towerlab.fetch import fetch

    folder = resolve_data_dir(args.data_dir)
    paths = fetch(args.name, folder, progress=lambda line: print(line, flush=True))
    for path in paths:
        print(path)
    return 0


def _cmd_data_info(args: argparse.Namespace) -> int:
    from towerlab.data import dataset_info, resolve_data_dir

    folder = resolve_data_dir(args.data_dir)
    print(f"data folder: {folder}")
    for row in dataset_info(folder):
        where = row.get("path") or row.get("where") or ""
        status = "found" if row.get("found") else "missing"
        print(f"  {row['name']:<14} {status:<8} {row.get('format') or '':<13} {where}")
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
    except RuntimeError as exc:
        # Under torchrun a worker runs main() itself: when another worker dies, say so in one line
        # (torchrun's agent reports which one died, and restarts the group with --max-restarts).
        if not peer_lost(exc):
            raise
        print(f"towerlab: error: another process of the job is gone ({' '.join(str(exc).split())[:200]}); "
              "stopping", file=sys.stderr, flush=True)
        return EXIT_PEER_LOST


if __name__ == "__main__":
    raise SystemExit(main())
