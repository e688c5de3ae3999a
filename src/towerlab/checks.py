"""The checks every config makes the same way (standard library only): finite numbers, paths, seeds,
choices, positive numbers and fractions, each a UserError naming its flag, and seconds set by an
environment variable; and what a dataset's name means (a name of the catalog, the path of an .npz, a
folder of images, or arrays given from Python), which the configs and the data loader read alike."""

from __future__ import annotations

import dataclasses
import math
import os
import re
from typing import Callable, Collection, TypeVar

from towerlab.catalog import datasets
from towerlab.errors import UserError, did_you_mean
from towerlab.fields import Dataclass, base_type

# Images given from Python as arrays (towerlab.api.train(data=(x, y))): the dataset name a config records
# for them.
ARRAYS_DATASET = "arrays"

N = TypeVar("N", int, float)
# Seeds reach torch's generators as seed + epoch, which take at most 2**64 - 1.
MAX_SEED = 2**63 - 1


def check_finite(cfg: Dataclass) -> None:
    """Every number of a float field is finite: nan and inf pass every `<` and `<=` check unnoticed
    (nan) or mean nothing (an infinite learning rate, timeout or decay)."""
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if not isinstance(value, (int, float)) or isinstance(value, bool) or base_type(f.type)[0] is not float:
            continue
        check_finite_number(f.metadata.get("flag", f.name.replace("_", "-")), value)


def check_finite_number(flag: str, value: float) -> None:
    try:
        finite = math.isfinite(value)
    except OverflowError:  # an int beyond every float
        finite = False
    if not finite:
        raise UserError(f"--{flag} must be a finite number, got {value}")


def check_path(flag: str, path: str) -> None:
    """A path option given as an empty string (an unset shell variable: `--out "$OUT"`) is refused,
    not read as "the current folder" or "the default"; so is a name longer than Linux allows."""
    if not path.strip():
        raise UserError(f"{flag} is empty: give a path, or leave the flag out")
    if len(os.fsencode(path)) >= 4096 or any(len(os.fsencode(part)) > 255 for part in path.split(os.sep)):
        raise UserError(f"{flag} is too long a path (at most 255 bytes a name, 4095 in all)")


def check_paths(cfg: Dataclass, *names: str) -> None:
    for name in names:
        if getattr(cfg, name) is not None:
            check_path("--" + name.replace("_", "-"), getattr(cfg, name))


def check_seed(value: int) -> None:
    if not 0 <= value <= MAX_SEED:
        raise UserError(f"--seed must be between 0 and {MAX_SEED} (2**63 - 1), got {value}")


def check_choice(name: str, value: str, choices: Collection[str]) -> None:
    if value not in choices:
        raise UserError(f"unknown {name} {value!r}{did_you_mean(value, choices)}: choose one of {', '.join(choices)}")


def is_custom_dataset(name: str) -> bool:
    """A dataset named by the path of an .npz file rather than by a name of the catalog."""
    return name.lower().endswith(".npz")


def is_image_folder(name: str) -> bool:
    """A dataset named by the path of a folder of images (PATH/): a name ending in a slash, or a
    folder that is neither a catalog name nor an .npz (a catalog name wins: `mnist/` names a folder)."""
    if name.endswith(("/", os.sep)):
        return True
    return not is_custom_dataset(name) and name not in datasets.CATALOG and name != ARRAYS_DATASET \
        and os.path.isdir(os.path.expanduser(name))


def dataset_label(name: str) -> str:
    """A short name for folder names and titles: the file's stem for a custom dataset, the folder's
    name for an image folder."""
    if is_image_folder(name):
        return os.path.basename(os.path.normpath(name))
    return os.path.splitext(os.path.basename(name))[0] if is_custom_dataset(name) else name


def check_dataset(name: str) -> str:
    """The dataset as stored in a config: a known name, or a custom .npz or an image folder made
    absolute (so a resumed run or a torchrun worker started elsewhere reads the same data; a folder
    keeps a final slash, which names it a folder wherever the path is read)."""
    if is_custom_dataset(name):
        check_path("--dataset", name)
        return os.path.abspath(os.path.expanduser(name))
    if is_image_folder(name):
        check_path("--dataset", name)
        return os.path.join(os.path.abspath(os.path.expanduser(name)), "")
    if name not in datasets.CATALOG and name != ARRAYS_DATASET:
        raise UserError(f"unknown dataset {name!r}{did_you_mean(name, datasets.names())}: choose one of "
                        f"{', '.join(datasets.names())}, or give the path of your own .npz (x_train, y_train, x_test, "
                        "y_test) or of a folder of images (PATH/<class>/*.jpg)")
    return name


def check_positive(name: str, value: float | int | None, *, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if value is None or value <= 0:
        raise UserError(f"--{name.replace('_', '-')} must be positive, got {value}")


def parse_shape(text: str) -> tuple[int, int, int]:
    """'3x32x32' -> (3, 32, 32)."""
    try:
        shape = tuple(int(part) for part in text.lower().split("x"))
    except ValueError:
        shape = ()
    if len(shape) != 3 or min(shape) < 1 or shape[0] > 4:
        raise UserError(f"--synthetic-shape must look like 1x28x28 or 3x32x32 (CxHxW), got {text!r}")
    return shape


def check_fraction(name: str, value: float) -> None:
    if not 0.0 <= value <= 1.0:
        raise UserError(f"--{name.replace('_', '-')} is a probability in [0, 1], got {value}")


def env_number(name: str, default: N, valid: Callable[[N], bool], refusal: str) -> N:
    """The number the environment variable `name` sets, of `default`'s type (unset or blank: `default`).
    One that is no such number, or not `valid`, is a UserError: `refusal`, its `{text}` what `name` holds."""
    text = os.environ.get(name, "").strip()
    if not text:
        return default
    try:
        value = type(default)(text)
    except ValueError:
        value = None
    if value is None or not valid(value):  # float's NaN is no valid number of any range
        raise UserError(refusal.format(text=repr(text)))
    return value


# Words of a metric's name that say lower is better (val_loss, top1_err, mse): a search of such a metric
# names its direction (`towerlab.objective.yours.Yours.settings`).
LOSS_WORDS = frozenset({"loss", "losses", "error", "errors", "err", "mse", "mae", "rmse", "nll", "perplexity", "ppl",
                        "wer", "cer", "regret", "cost"})


def reads_like_a_loss(metric: str) -> bool:
    """Whether a metric's name reads like a loss or an error (one of its words is in LOSS_WORDS)."""
    return any(word in LOSS_WORDS for word in re.findall(r"[a-z]+", metric.lower()))


def check_direction_named(metric: str, direction: object) -> None:
    """A search of a metric that reads like a loss names its direction (`direction` None: it named none):
    maximizing a loss by default would spend a whole budget the wrong way (Optuna's default minimizes)."""
    if direction is None and reads_like_a_loss(metric):
        raise UserError(f"--metric {metric} reads like a loss or an error, and a search maximizes its metric unless "
                        "told (Optuna's default would minimize it): give --direction minimize, or --direction maximize "
                        "if a higher value is better")
