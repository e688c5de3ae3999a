"""A config dataclass as a dict, as JSON, and as command-line flags: the one mapping, so a flag,
a config key and a recorded field cannot drift apart. Standard library only; knows no config in
particular (towerlab.config holds them)."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import difflib
import json
import math
import os
import types
import typing
from typing import Any, ClassVar, Protocol, TypeVar

from towerlab.errors import UserError


class Dataclass(Protocol):
    """Any dataclass instance: a config (TrainConfig, RunConfig, SearchConfig, a sampler's settings)."""

    __dataclass_fields__: ClassVar[dict[str, Any]]


Config = TypeVar("Config", bound=Dataclass)

def json_loads(text: str, where: str) -> Any:
    """JSON text as Python values, a key given twice in one object refused (json.loads keeps the last
    of them without a word), as TOML refuses it: `where` names the text in the message."""
    def unique(pairs: list[tuple[str, Any]]) -> dict:
        found: dict = {}
        for key, value in pairs:
            if key in found:
                raise UserError(f"{where} gives the key {key!r} twice in one object: keep one")
            found[key] = value
        return found

    return json.loads(text, object_pairs_hook=unique)


def to_dict(cfg: Any) -> dict:
    """The config's fields as a dict; a field marked `flat` (SearchConfig.settings) gives its items
    among the others."""
    data = dataclasses.asdict(cfg)
    for f in dataclasses.fields(cfg):
        if f.metadata.get("flat"):
            data.update(data.pop(f.name))
    return data


def from_dict(cls: type, data: dict, *, what: str = "config key", where: str | os.PathLike | None = None,
              extra: typing.Sequence[type] = ()) -> Any:
    """Build `cls` from a dict, refusing unknown keys (a typo must not be ignored) and values of the
    wrong type (a config file or a Python caller may give "2" for 2); `where` (the file it was read
    from) prefixes any complaint. `extra`: as in `checked_values`."""
    try:
        return cls(**checked_values(cls, data, what=what, extra=extra))
    except UserError as exc:
        if where is None:
            raise
        raise UserError(f"{where}: {exc}") from None


def unknown_keys(unknown: list[str], known: typing.Iterable[str], what: str) -> UserError:
    """The error for keys no config has: each named with the known key nearest to it, where one is
    near (a typo), rather than all forty known ones."""
    known = sorted(known)
    near = {key: difflib.get_close_matches(key, known, n=1, cutoff=0.6) for key in unknown}
    named = ", ".join(f"{key} (did you mean {found[0]}?)" if found else key for key, found in near.items())
    listed = "" if all(near.values()) else " (docs/config.md lists the keys)"
    return UserError(f"unknown {what}(s) {named}{listed}")


def checked_values(cls: type, data: dict, *, what: str = "config key", extra: typing.Sequence[type] = ()) -> dict:
    """`data` with every key a field of `cls` (or of the `extra` dataclasses: a search's sampler
    settings) and every value of its field's type (an int is accepted for a float); a UserError
    naming the first that is not (`what` names a key: "config key", "option")."""
    fields = {f.name: f for c in (*extra, cls) for f in dataclasses.fields(c)}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise unknown_keys(unknown, fields, what)
    checked: dict[str, Any] = {}
    for key, value in data.items():
        kind, optional = base_type(fields[key].type)
        if value is None and optional:
            checked[key] = None
        elif kind is float and isinstance(value, (int, float)) and not isinstance(value, bool):
            try:
                checked[key] = float(value)
            except OverflowError:  # an int beyond every float: as infinite as 1e400
                checked[key] = math.inf
        elif isinstance(value, kind) and not (kind is int and isinstance(value, bool)):
            checked[key] = value
        else:
            expected = {int: "a whole number", float: "a number", str: "a string", bool: "true or false",
                        dict: "a table of KEY = VALUE"}.get(kind, kind.__name__)
            raise UserError(f"{what} {key} must be {expected}{' (or left out)' if optional else ''}, "
                            f"got {value!r}")
    return checked


def replace(cfg: Config, **changes: Any) -> Config:
    """`cfg` (a config dataclass) with `changes`, checked again as a new one is."""
    return dataclasses.replace(cfg, **changes)


def dumps(**configs: Any) -> str:
    """The resolved configuration as JSON, one object per concern."""
    return json.dumps({k: to_dict(v) if dataclasses.is_dataclass(v) else v for k, v in configs.items()},
                      indent=2, sort_keys=True)


def field_default(f: dataclasses.Field) -> Any:
    """A dataclass field's default: its factory's product for a mutable one."""
    return f.default_factory() if callable(f.default_factory) else f.default


def base_type(annotation: Any) -> tuple[type, bool]:
    """(the scalar type, whether None is allowed) of a field annotation."""
    hint = annotation if not isinstance(annotation, str) else eval(annotation, vars(typing), {})  # noqa: S307 - a config field's own annotation
    origin = typing.get_origin(hint)
    if origin is typing.Union or origin is types.UnionType:
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        return args[0], True
    return hint, False


def parse_option_value(text: str) -> Any:
    """'3' -> 3, '0.5' -> 0.5, 'true' -> True, anything else stays a string; a string in double quotes
    is that string ('"3"' -> '3': how `to_flags` writes a string that would read as something else)."""
    if len(text) >= 2 and text[0] == text[-1] == '"':
        with contextlib.suppress(ValueError):
            value = json.loads(text)
            if isinstance(value, str):
                return value
    lowered = text.lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    for convert in (int, float):
        try:
            return convert(text)
        except ValueError:
            pass
    return text


class _KeyValueAction(argparse.Action):
    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        key, sep, value = values.partition("=")
        if not sep or not key:
            raise UserError(f"{option_string} expects KEY=VALUE, got {values!r}")
        current = dict(getattr(namespace, self.dest, None) or {})
        current[key.strip().replace("-", "_")] = parse_option_value(value.strip())
        setattr(namespace, self.dest, current)


def add_arguments(parser: argparse.ArgumentParser, cls: type, *, skip: tuple[str, ...] = (),
                  helps: dict[str, str] | None = None) -> None:
    """One flag per field. Defaults are left out of the namespace (argparse.SUPPRESS) so the caller
    can tell what the user typed from what is a default (needed by --resume and presets). `helps`
    replaces fields' help texts where a command means something of its own by them."""
    summary = " ".join((cls.__doc__ or "").split()).split(". ")[0].rstrip(".") + "."  # the first sentence
    group = parser.add_argument_group(cls.__name__, summary)
    for f in dataclasses.fields(cls):
        if f.name in skip or f.metadata.get("flat"):  # a flat field's items have flags of their own
            continue
        flag = "--" + f.metadata.get("flag", f.name.replace("_", "-"))
        default = field_default(f)
        choices = f.metadata.get("choices")
        # Choices are checked by the dataclass, whose message names them all in one line.
        one_of = f"; one of {', '.join(choices)}" if choices else ""
        help_text = f"{(helps or {}).get(f.name, f.metadata['help'])} (default: {default}{one_of})"
        kind, optional = base_type(f.type)
        if kind is dict:
            group.add_argument(flag, dest=f.name, action=_KeyValueAction, metavar="KEY=VALUE",
                               default=argparse.SUPPRESS, help=help_text)
        elif kind is bool:
            group.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction,
                               default=argparse.SUPPRESS, help=help_text)
        else:
            action = group.add_argument(flag, dest=f.name, type=kind, default=argparse.SUPPRESS, help=help_text,
                                        metavar="NAME" if choices else kind.__name__.upper())
            # Not argparse's own choices (the dataclass checks them); read by the CLI's did-you-mean,
            # so that `--dev 2` suggests --devices, not --device.
            setattr(action, "field_choices", choices)  # an attribute of ours on argparse's Action


def flag_name(cls: type, name: str) -> str:
    """The command-line flag of `cls`'s field `name` (`--command` for SearchConfig's trial_command)."""
    found = {f.name: f for f in dataclasses.fields(cls)}.get(name)
    return "--" + (found.metadata.get("flag", name.replace("_", "-")) if found is not None else name.replace("_", "-"))


def to_flags(cfg: Dataclass) -> list[str]:
    """The command-line flags that reproduce `cfg` (the fields that differ from their defaults; a
    flat field's items, each its own flag)."""
    flags = []
    items = []
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        default = field_default(f)
        if f.metadata.get("flat"):
            items += [(name.replace("_", "-"), item) for name, item in value.items()]
        elif value != default:
            items.append((f.metadata.get("flag", f.name.replace("_", "-")), value))
    for name, value in items:
        flag = "--" + name
        if isinstance(value, bool):
            flags.append(flag if value else "--no-" + flag[2:])
        elif isinstance(value, dict):
            for key, item in value.items():
                flags += [flag, f"{key}={option_text(item)}"]
        else:
            flags += [flag, str(value)]
    return flags


def option_text(value: Any) -> str:
    """A KEY=VALUE option's value as text that `parse_option_value` reads back as `value`, type and all:
    a string that would read as a number, a bool or a quoted string ("3", "true") goes in double quotes."""
    text = str(value).lower() if isinstance(value, bool) else str(value)
    if isinstance(value, str) and (parse_option_value(text) != value or text != text.strip()):
        return json.dumps(value)
    return text


def given(namespace: argparse.Namespace, cls: type) -> dict:
    """The fields of `cls` the user set on the command line."""
    names = {f.name for f in dataclasses.fields(cls)}
    return {k: v for k, v in vars(namespace).items() if k in names}
