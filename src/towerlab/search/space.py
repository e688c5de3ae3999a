"""Search spaces: which genes a genome has and which values each may take.

A genome is a plain dict gene name -> value (ints, floats and strings only), in the space's gene
order. Its identity is `canonical(genome)` (compact JSON, sorted keys) and `genome_hash` (sha256 of
that text): the store caches evaluations by this hash, so two dicts with equal items are the same
genome whatever their key order.

A space comes from a built-in name (`mlp`, `cnn`, `whitenet`) or a TOML file; `GENE_RULES` (pure data) says
which genes exist for each model family and which values are valid.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Mapping

from towerlab.config import OPTIMIZERS
from towerlab.errors import UserError
from towerlab.readers import require_regular_file

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

ACTIVATIONS = ("relu", "elu", "tanh", "sigmoid")


@dataclass(frozen=True)
class GeneRule:
    """The values a gene accepts: ints and floats within bounds, or one of fixed strings."""

    kind: str  # "int", "float" or "choice"
    low: float | None = None
    low_open: bool = False
    high: float | None = None
    high_open: bool = False
    odd: bool = False
    choices: tuple[str, ...] = ()

    def describe(self) -> str:
        if self.kind == "choice":
            return "one of " + ", ".join(self.choices)
        text = ("an odd int" if self.odd else "an int") if self.kind == "int" else "a number"
        if self.low is not None and self.high is not None:
            return (f"{text} in {'(' if self.low_open else '['}{_num(self.low)}, "
                    f"{_num(self.high)}{')' if self.high_open else ']'}")
        if self.low is not None:
            return f"{text} {'>' if self.low_open else '>='} {_num(self.low)}"
        return text

    def normalize(self, value: Any) -> Any:
        """The value in canonical form (floats stay floats even when written as ints), or None
        when the value is not valid."""
        if self.kind == "choice":
            return value if isinstance(value, str) and value in self.choices else None
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return None
        if self.kind == "int":
            if not isinstance(value, int) or (self.odd and value % 2 == 0):
                return None
        else:
            value = float(value)
            if not math.isfinite(value):
                return None
        if self.low is not None and (value < self.low or (self.low_open and value == self.low)):
            return None
        if self.high is not None and (value > self.high or (self.high_open and value == self.high)):
            return None
        return value


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


_POSITIVE_INT = GeneRule("int", low=1)
_TRAINING_GENES = {
    "optimizer": GeneRule("choice", choices=OPTIMIZERS),
    "lr": GeneRule("float", low=0.0, low_open=True),
    "batch_size": _POSITIVE_INT,
    "epochs": _POSITIVE_INT,
    "label_smoothing": GeneRule("float", low=0.0, high=1.0, high_open=True),
}
GENE_RULES: dict[str, dict[str, GeneRule]] = {
    "mlp": {
        "neurons": _POSITIVE_INT,
        "layers": _POSITIVE_INT,
        "activation": GeneRule("choice", choices=ACTIVATIONS),
        **_TRAINING_GENES,
    },
    "cnn": {
        "blocks": GeneRule("int", low=1, high=4),
        "filters": _POSITIVE_INT,  # of the first block; the model doubles them per block
        "kernel_size": GeneRule("int", low=1, odd=True),
        "dense": _POSITIVE_INT,
        "dropout": GeneRule("float", low=0.0, high=1.0, high_open=True),
        **_TRAINING_GENES,
    },
    "whitenet": {
        "width1": _POSITIVE_INT,  # channels of the three stages
        "width2": _POSITIVE_INT,
        "width3": _POSITIVE_INT,
        "depth": GeneRule("int", low=1, high=4),  # convolutions per stage
        **_TRAINING_GENES,
    },
}


def canonical(genome: Mapping[str, Any]) -> str:
    """The genome as compact JSON with sorted keys: its identity, independent of key order."""
    return json.dumps(dict(genome), sort_keys=True, separators=(",", ":"), allow_nan=False)


def genome_hash(genome: Mapping[str, Any]) -> str:
    return hashlib.sha256(canonical(genome).encode()).hexdigest()


@dataclass(frozen=True)
class Space:
    """An ordered set of genes, each with its tuple of allowed values. Treat `genes` as read-only.

    The gene order and the value order are part of the space: the search draws by position, so
    `fingerprint` covers both (and the model), but not `name`: a copied file is the same space.
    """

    name: str
    model: str
    genes: dict[str, tuple]
    fingerprint: str = field(init=False, compare=False)

    def __post_init__(self) -> None:
        genes = {str(k): tuple(v) for k, v in dict(self.genes).items()}
        if not genes:
            raise ValueError(f"space {self.name!r} has no genes")
        for gene, values in genes.items():
            if not values:
                raise ValueError(f"space {self.name!r}: gene {gene!r} has no values")
            if len({canonical({"v": v}) for v in values}) != len(values):
                raise ValueError(f"space {self.name!r}: gene {gene!r} lists a value twice")
        object.__setattr__(self, "genes", genes)
        content = json.dumps({"model": self.model, "genes": [[k, list(v)] for k, v in genes.items()]},
                             separators=(",", ":"))
        object.__setattr__(self, "fingerprint", hashlib.sha256(content.encode()).hexdigest())

    def __hash__(self) -> int:
        return hash(self.fingerprint)

    @property
    def size(self) -> int:
        """Number of distinct genomes."""
        return math.prod(len(v) for v in self.genes.values())

    def all_genomes(self) -> Iterator[dict]:
        """Every genome once, the last gene varying fastest (`itertools.product` order)."""
        names = list(self.genes)
        for values in itertools.product(*self.genes.values()):
            yield dict(zip(names, values))

    def genome_at(self, index: int) -> dict:
        """The genome `all_genomes()` yields at position `index`, without listing the others."""
        if not 0 <= index < self.size:
            raise IndexError(f"genome index {index} outside space of {self.size}")
        genome = {}
        for name, values in reversed(list(self.genes.items())):
            index, digit = divmod(index, len(values))
            genome[name] = values[digit]
        return {name: genome[name] for name in self.genes}

    def contains(self, genome: Mapping[str, Any]) -> bool:
        """Whether the genome has exactly this space's genes, each with an allowed value (type
        included: True is not 1, 1 is not 1.0)."""
        if set(genome) != set(self.genes):
            return False
        return all(any(type(v) is type(genome[k]) and v == genome[k] for v in values)
                   for k, values in self.genes.items())

    def to_dict(self) -> dict:
        return {"name": self.name, "model": self.model, "genes": {k: list(v) for k, v in self.genes.items()}}


BUILTIN_SPACES: dict[str, Space] = {
    # The original Keras search: 6 x 4 x 4 x 7 = 672 networks.
    "mlp": Space("mlp", "mlp", {
        "neurons": (64, 128, 256, 512, 768, 1024),
        "layers": (1, 2, 3, 4),
        "activation": ("relu", "elu", "tanh", "sigmoid"),
        "optimizer": ("rmsprop", "adam", "sgd", "adagrad", "adadelta", "adamax", "nadam"),
    }),
    # A CIFAR-10 convnet space: 3 x 3 x 2 x 3 x 3 x 3 x 3 = 1458 networks.
    "cnn": Space("cnn", "cnn", {
        "blocks": (1, 2, 3),
        "filters": (16, 32, 64),
        "kernel_size": (3, 5),
        "dense": (128, 256, 512),
        "dropout": (0.0, 0.25, 0.5),
        "lr": (0.0003, 0.001, 0.003),
        "batch_size": (64, 128, 256),
    }),
    # airbench94's family (K. Jordan, arXiv 2404.00498; 64-256-256, depth 2, 9.9 epochs, label
    # smoothing 0.2 there) around the cifar-94 preset, whose recipe fills in what a genome leaves open:
    # 3 x 3 x 3 x 2 x 4 x 3 x 3 = 1944 networks.
    "whitenet": Space("whitenet", "whitenet", {
        "width1": (32, 64, 128),
        "width2": (128, 256, 384),
        "width3": (128, 256, 512),
        "depth": (2, 3),
        "epochs": (8, 11, 14, 18),
        "lr": (1.0, 1.5, 2.0),
        "label_smoothing": (0.1, 0.2, 0.3),
    }),
}

_TOP_LEVEL_KEYS = ("model", "genes")


def check_genes(model: str, genes: Mapping[str, Any], where: str) -> dict[str, tuple]:
    """Validate gene lists against `GENE_RULES`; return them normalized. `where` names the source
    in the messages ("search space FILE")."""
    if model not in GENE_RULES:
        raise UserError(f"{where}: unknown model {model!r}: use one of {', '.join(GENE_RULES)}")
    rules = GENE_RULES[model]
    if not genes:
        raise UserError(f"{where}: no genes: list at least one under [genes], "
                        f"e.g. {next(iter(rules))} = [...]")
    checked: dict[str, tuple] = {}
    for gene, values in genes.items():
        if gene not in rules:
            raise UserError(f"{where}: unknown gene {gene!r} for model {model}: "
                            f"known genes are {', '.join(rules)}")
        if not isinstance(values, list) or not values:
            raise UserError(f"{where}: gene {gene!r} must be a non-empty list of values, "
                            f"got {values!r}")
        rule, seen = rules[gene], set()
        normalized = []
        for value in values:
            ok = rule.normalize(value)
            if ok is None:
                raise UserError(f"{where}: gene {gene!r} has value {value!r}, "
                                f"expected {rule.describe()}")
            if ok in seen:
                raise UserError(f"{where}: gene {gene!r} lists {value!r} twice: list each value once")
            seen.add(ok)
            normalized.append(ok)
        checked[gene] = tuple(normalized)
    return checked


def load_space(name_or_path: str | Path) -> Space:
    """A built-in space by name, or a TOML file: `model = "mlp"` and a `[genes]` table of lists."""
    text = str(name_or_path)
    if text in BUILTIN_SPACES:
        return BUILTIN_SPACES[text]
    path = Path(text)
    where = f"search space {text}"
    if not path.exists():
        raise UserError(f"unknown search space {text!r}: use {', '.join(BUILTIN_SPACES)} "
                        f"or the path of a TOML file")
    require_regular_file(path)
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except OSError as e:
        raise UserError(f"cannot read {where}: {e.strerror or e}") from None
    except tomllib.TOMLDecodeError as e:
        raise UserError(f"{where} is not valid TOML: {e}") from None
    except UnicodeDecodeError:
        raise UserError(f"{where} is not valid TOML: not UTF-8 text") from None
    unknown = sorted(set(data) - set(_TOP_LEVEL_KEYS))
    if unknown:
        raise UserError(f"{where}: unknown key(s) {', '.join(unknown)}: a space file holds only "
                        f"model = \"mlp\"|\"cnn\"|\"whitenet\" and a [genes] table")
    if "model" not in data:
        choices = " or ".join(f'model = "{m}"' for m in GENE_RULES)
        raise UserError(f"{where}: missing model: add {choices}")
    model = data["model"]
    if not isinstance(model, str):
        raise UserError(f"{where}: model must be a string, one of {', '.join(GENE_RULES)}")
    genes = data.get("genes", {})
    if not isinstance(genes, dict):
        raise UserError(f"{where}: genes must be a table: write [genes] and one list per gene under it")
    return Space(text, model, check_genes(model, genes, where))
