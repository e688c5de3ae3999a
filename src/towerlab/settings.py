"""Where a job's settings come from, for the command line and the Python API alike.

Layers, each over the one before: the dataclasses' defaults, a preset (`preset = "mnist-fast"`),
a config file (`--config FILE`, `config=FILE`), then what you pass (flags, or keyword arguments).
`--resume` instead continues a stored job with its stored settings.

A config file is TOML, or JSON: the keys are the flags' names (`batch_size` or `batch-size`, one
of the two), at the top level or under `[train]` / `[search]` and `[run]` (not both for one key), as
a job's config.json writes them; any setting but `resume` (continuing a job is `--resume`'s). A
run's own config.json is a config file: its recorded facts (versions, command, host) are skipped,
and so are its `out` and `resume`, so it repeats the run into a new folder. Relative paths in a file
are read from the current directory, like flags. `config_toml` writes any resolved settings as
such a file (`towerlab train --preset mnist-fast --print-config > run.toml`), which is how a
preset becomes a file to edit. Standard library only, like config.py.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any, Mapping

from towerlab.config import RunConfig, SearchConfig, TrainConfig
from towerlab.checks import check_direction_named
from towerlab.upgrades import upgrade_search_config
from towerlab.fields import checked_values, flag_name, from_dict, replace, to_dict, unknown_keys
from towerlab.errors import UserError
from towerlab.atomic import require_regular_file
from towerlab.job_files import CONFIG, config_path, job_record, read_json

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]  # tomllib's backport, the same API

# Keys a job's config.json records beside its settings: facts about the job, not settings.
RECORD_MARKERS = ("towerlab_version", "torch_version", "command")
# Run settings a record holds that must not carry over to a repeat: it gets a folder of its own.
NOT_REPEATED = ("out", "resume")
# Settings a resumed search may change: they do not alter what has been computed.
SEARCH_EXTENSIBLE = ("generations", "max_evaluations", "top", "export_best", "workers_per_device", "trial_timeout")
# The settings that name what a search ranks by, decided by its kind of objective (`towerlab.objective`).
GOALS = ("metric", "direction")
# The sampler each search command runs (`towerlab search run`, kind "search", takes --sampler).
SEARCH_COMMANDS = {"evolve": "ga", "grid": "grid"}

MAIN = {"train": TrainConfig, "search": SearchConfig}


def _aliases(cls: type) -> dict[str, str]:
    """key as written (field name or flag name, dashes or underscores) -> field name."""
    names = {}
    for f in dataclasses.fields(cls):
        for alias in (f.name, f.metadata.get("flag", f.name)):
            names[alias.replace("-", "_")] = f.name
    return names


def _normalised(values: Mapping, cls: type | tuple[type, ...], what: str) -> dict:
    """Keys as written -> field names; two spellings of one field (`batch-size` and `batch_size`)
    are refused, where the later would silently win."""
    aliases = {}
    for c in cls if isinstance(cls, tuple) else (cls,):
        aliases.update(_aliases(c))
    normalised: dict = {}
    written: dict[str, str] = {}
    for key, value in values.items():
        name = aliases.get(str(key).replace("-", "_"), str(key).replace("-", "_"))
        if name in written:
            raise UserError(f"{what}s {written[name]} and {key} both set {name}: keep one")
        normalised[name], written[name] = value, str(key)
    return normalised


def _extra(main: str) -> list[type]:
    """The classes whose fields are settings of the main config besides its own: a search's samplers'."""
    if main != "search":
        return []
    from towerlab.search.samplers import settings_classes

    return settings_classes()


def split_options(options: Mapping, main: str, *, what: str = "option") -> tuple[dict, dict]:
    """Flat settings (keyword arguments, or a file's top level) -> (the main config's, RunConfig's),
    each checked for unknown keys and wrong types."""
    cls, extra = MAIN[main], _extra(main)
    values = _normalised(options, (cls, *extra, RunConfig), what)
    main_names = {f.name for c in (cls, *extra) for f in dataclasses.fields(c) if not f.metadata.get("flat")}
    run_names = {f.name for f in dataclasses.fields(RunConfig)}
    unknown = sorted(set(values) - main_names - run_names)
    if unknown:
        raise unknown_keys(unknown, main_names | run_names, what)
    return (checked_values(cls, {k: v for k, v in values.items() if k in main_names}, what=what, extra=extra),
            checked_values(RunConfig, {k: v for k, v in values.items() if k in run_names}, what=what))


def read_config_file(config: str | os.PathLike | Mapping, main: str) -> tuple[dict, dict]:
    """A config file (or the same layout as a dict) -> (the main config's settings, RunConfig's)."""
    if isinstance(config, Mapping):
        data, where = dict(config), "config"
    else:
        data, where = _parse(Path(config)), str(config)
    other = "search" if main == "train" else "train"
    if other in data and main not in data:
        raise UserError(f"{where} holds {other} settings (a [{other}] section): towerlab "
                        f"{'train' if main == 'train' else 'evolve or grid'} takes [{main}] settings")
    # (a record's "command" is its argv, a list; a search's --command is its trials' text)
    is_record = any(k in data for k in RECORD_MARKERS if k != "command") or isinstance(data.get("command"), list)
    top = {k: v for k, v in data.items() if k not in (main, "run", other)}
    main_values, run_values = ({}, {}) if is_record else split_options(top, main, what=f"{where} key")
    for section, cls, into in ((main, MAIN[main], main_values), ("run", RunConfig, run_values)):
        if section not in data:
            continue
        if not isinstance(data[section], Mapping):
            raise UserError(f"{where}: {section} must be a table ([{section}] and KEY = VALUE lines under it)")
        values = data[section]
        if is_record and section == "search" and isinstance(data.get("kind"), str):
            values = upgrade_search_config(dict(values), data["kind"])  # a search from before samplers
        what = f"{where} [{section}] key"
        extra = _extra(main) if section == main else []
        values = checked_values(cls, _normalised(values, (cls, *extra), what), what=what, extra=extra)
        twice = sorted(set(into) & set(values))
        if twice:
            raise UserError(f"{where} sets {', '.join(twice)} at the top level and under [{section}]: keep one")
        into.update(values)
    if is_record:
        for key in NOT_REPEATED:
            run_values.pop(key, None)
    elif "resume" in run_values:
        # Continuing a job is --resume's: its guards (--out is the folder it continues, the stored
        # settings stay) cannot hold for a file that is also the new job's settings.
        raise UserError(f"{where}: resume is not a config file setting: continue a job with --resume FOLDER "
                        "(resume= from Python), without --config")
    return main_values, run_values


def _parse(path: Path) -> dict:
    require_regular_file(path)
    kind = "JSON" if path.suffix.lower() == ".json" else "TOML"
    try:
        if kind == "JSON":  # a run's config.json among them: read as every job record is (`job_files`)
            data = read_json(path, f"config file {path}")
        else:
            data = tomllib.loads(path.read_bytes().decode("utf-8-sig"))
    except OSError as exc:
        raise UserError(f"cannot read config file {path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise UserError(f"config file {path} is not UTF-8 text") from None
    except RecursionError:  # both parsers recurse once per level of nesting
        raise UserError(f"config file {path} nests its values too deeply: settings are at most a table "
                        "within a table") from None
    except (ValueError, tomllib.TOMLDecodeError) as exc:  # JSONDecodeError is a ValueError
        raise UserError(f"config file {path} is not valid {kind}: {' '.join(str(exc).split())[:200]}") from None
    if not isinstance(data, dict):
        raise UserError(f"config file {path} must hold a table of settings, not a {type(data).__name__}")
    return data


# --------------------------------------------------------------------------------------------- train

def resolve_train(options: Mapping, config: str | os.PathLike | Mapping | None = None
                  ) -> tuple[TrainConfig, RunConfig]:
    """The run's configs from `options` (flat: TrainConfig and RunConfig fields) over `config` over
    a preset; for `resume`, the stored run's, where only run options may be changed."""
    train_given, run_given = split_options(options, "train")
    if "resume" in run_given:
        if config is not None:
            raise UserError("--config does not go with --resume: the stored run already holds its settings")
        return _resumed_train(train_given, run_given)
    file_train, file_run = read_config_file(config, "train") if config is not None else ({}, {})
    _refuse_new_run_only_options({**file_run, **run_given})
    preset = run_given.get("preset", file_run.get("preset"))
    preset_train, preset_run = _preset_layers(preset, run_given.get("device", file_run.get("device", "auto")))
    return (TrainConfig(**{**preset_train, **file_train, **train_given}),
            RunConfig(**{**preset_run, **file_run, **run_given}))


def batch_size_chosen(options: Mapping, config: str | os.PathLike | Mapping | None = None) -> bool:
    """Whether a run's batch size is its user's (a flag or keyword, a config file, a resumed run's), not
    towerlab's (TrainConfig's default, or a preset's): only towerlab's is fitted to data too small for it
    (`jobs.train`); the user's is refused there."""
    train_given, run_given = split_options(options, "train")
    if "resume" in run_given or "batch_size" in train_given:
        return True
    return config is not None and "batch_size" in read_config_file(config, "train")[0]


def _preset_layers(name: str | None, device: str) -> tuple[dict, dict]:
    """A preset's settings for the device type the run will use."""
    if name is None:
        return {}, {}
    from towerlab.distributed.env import device_type
    from towerlab.presets import apply_preset, run_options

    kind = device_type(device)
    return apply_preset(name, kind), run_options(name, kind)


def _resumed_train(train_given: dict, run_given: dict) -> tuple[TrainConfig, RunConfig]:
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
    _check_kept_run_options(folder, stored_run, run_given)
    return cfg, _resumed_run(folder, stored_run, run_given)


def read_run_config(folder: Path) -> tuple[TrainConfig, RunConfig]:
    path = config_path(folder)
    try:
        stored = job_record(folder)
        return from_dict(TrainConfig, stored["train"], where=path), from_dict(RunConfig, stored["run"], where=path)
    except FileNotFoundError:
        raise UserError(f"{folder} is not a towerlab run (no {CONFIG}): check the --resume path") from None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise UserError(f"{path} is unreadable ({type(exc).__name__}): it was not written by towerlab train") from None


def _refuse_new_run_only_options(run_given: dict) -> None:
    if run_given.get("allow_changed_data"):
        raise UserError("--allow-changed-data goes with --resume only: a new run reads the data as it is now")


def _resumed_run(folder: Path, stored: RunConfig, run_given: dict) -> RunConfig:
    """The stored run options with those given now; --allow-changed-data holds for this resume only
    (one a config.json recorded is not inherited)."""
    return replace(stored, **{"allow_changed_data": False, **run_given, "out": str(folder)})


def _check_kept_run_options(folder: Path, stored: RunConfig, run_given: dict, free: tuple[str, ...] = ()) -> None:
    """A resumed run keeps the options that change its arithmetic (config's `resume="keep"`, less
    `free`), so that it ends with the parameters of the uninterrupted run; the others may change."""
    from towerlab.distributed.env import device_type

    for f in dataclasses.fields(RunConfig):
        if f.metadata.get("resume") != "keep" or f.name in free or f.name not in run_given:
            continue
        value, kept = run_given[f.name], getattr(stored, f.name)
        if f.name == "device":
            value, kept = device_type(value), device_type(kept)
        if value != kept and kept is not None:  # None: a record from before the option was resolved
            flag = "--" + f.name.replace("_", "-")
            wanted = (flag if kept else "--no-" + flag[2:]) if isinstance(kept, bool) else f"{flag} {kept}"
            raise UserError(f"{folder} was trained with {wanted}: resume with that (or without {flag}); another "
                            "value computes differently, so the result would not equal an uninterrupted run")


def _check_resume_out(folder: Path, run_given: dict) -> None:
    """--resume names a folder, and writes into the folder it continues; a different --out would be
    silently ignored."""
    RunConfig(**run_given)  # the path itself (not empty, not too long) and every other option given
    if not folder.exists():
        raise UserError(f"--resume {folder} does not exist: give the output folder of the run to continue")
    if not folder.is_dir():
        raise UserError(f"--resume {folder} is a file: give the output folder of the run to continue")
    out = run_given.get("out")
    if out is not None and Path(out).absolute() != folder.absolute():
        raise UserError(f"--resume {folder} continues that folder and writes there: drop --out {out}")


# -------------------------------------------------------------------------------------------- search

def resolve_search(kind: str, options: Mapping, config: str | os.PathLike | Mapping | None = None
                   ) -> tuple[SearchConfig, RunConfig]:
    """The search's configs from `options` over `config` (`kind`: evolve or grid, whose sampler is
    theirs, or search); for `resume`, the stored search's, where only SEARCH_EXTENSIBLE settings and
    run options may be changed. Either way with the sampler's own settings complete, as the search
    records them (`towerlab.search.samplers.resolved_settings`)."""
    from towerlab.search.samplers import resolved_settings

    search_given, run_given = split_options(options, "search")
    if kind in SEARCH_COMMANDS:
        search_given["sampler"] = SEARCH_COMMANDS[kind]
    if "resume" not in run_given:
        file_search, file_run = read_config_file(config, "search") if config is not None else ({}, {})
        _refuse_new_run_only_options({**file_run, **run_given})
        return (resolved_settings(SearchConfig(**{**file_search, **search_given})),
                RunConfig(**{**file_run, **run_given}))
    if config is not None:
        raise UserError("--config does not go with --resume: the stored search already holds its settings")
    folder = Path(run_given["resume"])
    _check_resume_out(folder, run_given)
    path = config_path(folder)
    try:
        stored = job_record(folder)
        search = upgrade_search_config(stored["search"], stored["kind"])
        cfg = from_dict(SearchConfig, search, where=path, extra=_extra("search"))
        stored_run = from_dict(RunConfig, stored["run"], where=path)
    except FileNotFoundError:
        raise UserError(f"{folder} is not a towerlab search (no {CONFIG}): check the --resume path") from None
    except (OSError, ValueError, KeyError, TypeError, AttributeError):  # JSONDecodeError is a ValueError
        raise UserError(f"{path} is unreadable: it was not written by a towerlab search") from None
    if kind in SEARCH_COMMANDS and cfg.sampler != SEARCH_COMMANDS[kind]:
        command = next((k for k, v in SEARCH_COMMANDS.items() if v == cfg.sampler), "search run")
        raise UserError(f"{folder} holds a {cfg.sampler} search: resume it with towerlab {command} --resume {folder}")
    recorded = to_dict(cfg)
    # --metric and --direction may change: the search's kind of objective takes them (ranked anew from its rows,
    # `towerlab.objective.regoal`) or refuses them (`towerlab.objective.resolve`).
    changed = [k for k, v in search_given.items() if recorded.get(k) != v and k not in (*SEARCH_EXTENSIBLE, *GOALS)]
    if search_given.get("metric", cfg.metric) != cfg.metric:
        check_direction_named(str(search_given["metric"]), search_given.get("direction"))
    if changed:
        flags = ", ".join(flag_name(SearchConfig, k) for k in changed)
        raise UserError(f"--resume continues the stored search, whose {flags} differ(s) from what you passed: "
                        "drop those flags or start a new search")
    # How many workers take part never changes a fitness (each candidate trains alone, from its own seed).
    _check_kept_run_options(folder, stored_run, run_given, free=("devices",))
    return resolved_settings(replace(cfg, **search_given)), _resumed_run(folder, stored_run, run_given)


# ------------------------------------------------------------------------------------------- writing

def config_toml(**sections: Any) -> str:
    """Resolved configs as a config file: `config_toml(train=cfg, run=run)`. Settings left at None
    are left out (None is every optional setting's default)."""
    lines: list[str] = []
    for name, cfg in sections.items():
        values = to_dict(cfg) if dataclasses.is_dataclass(cfg) else dict(cfg)
        lines += [f"[{name}]"] + [f"{key} = {_toml_value(value)}" for key, value in values.items()
                                  if value is not None] + [""]
    return "\n".join(lines)


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)  # repr gives TOML's forms: 0.001, 1e-05, inf, nan
    if isinstance(value, str):
        return json.dumps(value)  # JSON's escapes are TOML's basic-string escapes
    if isinstance(value, Mapping):
        items = ", ".join(f"{json.dumps(str(k))} = {_toml_value(v)}" for k, v in value.items())
        return "{" + items + "}"
    raise TypeError(f"no TOML form for {type(value).__name__}")
