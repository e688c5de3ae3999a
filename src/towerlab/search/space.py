"""Search spaces: which genes a genome has and which values each may take.

A gene is categorical (a list of values, or `{values = [...]}`) or a numeric `Range` (`{low = A, high =
B}`: ints when both bounds are ints, floats otherwise, with `log = true` and `step = N` as wished: see
towerlab.search.ranges); a range is never listed out, so a search draws from a space of any size
without materialising it. Either may be conditional (`when = {booster = "dart"}`: active only where
the genes it names hold those values; towerlab.search.conditions).

A genome is a plain dict gene name -> value (ints, floats and strings only) of its active genes, in
the space's gene order. Its identity is `canonical(genome)` (compact JSON, sorted keys) and
`genome_hash` (sha256 of that text): the store caches evaluations by this hash, so two dicts with equal items are the same
genome whatever their key order.

A space comes from a built-in name (`mlp`, `cnn`, `whitenet`), a TOML file or a JSON text (what the
Python API makes of a dict). A space's model is a family of the model catalog (`towerlab.models`)
or "custom" (a function of yours): the training genes' rules are in towerlab.search.genes (the one
reader of a [genes] table), a family's declared options' rules in its catalog entry (`gene_rules`),
and every other gene is a keyword of the model's
function, which the search job checks against the function before anything trains. A space searched
with an objective of your own (`--objective`, `--command`) is its `[genes]` alone, which towerlab
does not interpret: its model is recorded as OBJECTIVE, and its genes are checked by the objective.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import reprlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

from towerlab.atomic import require_regular_file
from towerlab.errors import UserError
from towerlab.fields import json_loads
from towerlab.search.conditions import Conditions, Gene, When, check_when
from towerlab.search.genes import OBJECTIVE, check_genes, gene_rules, model_names, parse_genes
from towerlab.search.ranges import Range

# Read from here too (a space and the rules its genes are read by): the names of towerlab.search.genes.
__all__ = ["BUILTIN_SPACES", "OBJECTIVE", "Gene", "Range", "Space", "canonical", "check_genes", "gene_rules",
           "genome_hash", "load_space", "space_of"]

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]  # tomllib's backport, the same API


def canonical(genome: Mapping[str, Any]) -> str:
    """The genome as compact JSON with sorted keys: its identity, independent of key order."""
    return json.dumps(dict(genome), sort_keys=True, separators=(",", ":"), allow_nan=False)


def genome_hash(genome: Mapping[str, Any]) -> str:
    return hashlib.sha256(canonical(genome).encode()).hexdigest()


@dataclass(frozen=True)
class Space:
    """An ordered set of genes, each a tuple of allowed values or a `Range`, and the conditions of
    those that are conditional (`when`: gene -> {gene it names: the values under which it is active}).
    Treat `genes` and `when` as read-only.

    The gene order and the value order are part of the space: the search draws by position, so
    `fingerprint` covers both (and the model, and the conditions), but not `name`: a copied file is
    the same space.
    """

    name: str
    model: str
    genes: dict[str, Gene]
    when: Mapping[str, When] = field(default_factory=dict)
    fingerprint: str = field(init=False, compare=False)
    conditions: Conditions = field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        genes = {str(k): v if isinstance(v, Range) else tuple(v) for k, v in dict(self.genes).items()}
        if not genes:
            raise ValueError(f"space {self.name!r} has no genes")
        for gene, values in genes.items():
            if isinstance(values, Range):
                continue
            if not values:
                raise ValueError(f"space {self.name!r}: gene {gene!r} has no values")
            # (type, repr) tells values apart as `canonical` does (1, 1.0, True), at a fraction of its cost
            if len({(type(v), repr(v)) for v in values}) != len(values):
                raise ValueError(f"space {self.name!r}: gene {gene!r} lists a value twice")
        object.__setattr__(self, "genes", genes)
        try:  # the checks a file's conditions had, for a space made in Python
            when = check_when({k: v for k, v in dict(self.when).items() if v}, genes, {}, f"space {self.name!r}")
        except UserError as e:
            raise ValueError(str(e)) from None
        object.__setattr__(self, "when", when)
        object.__setattr__(self, "conditions", Conditions(genes, when))
        content = json.dumps({"model": self.model, "genes": [[k, _gene_json(v, when.get(k))] for k, v in genes.items()]},
                             separators=(",", ":"))
        object.__setattr__(self, "fingerprint", hashlib.sha256(content.encode()).hexdigest())

    def __hash__(self) -> int:
        return hash(self.fingerprint)

    @property
    def typed(self) -> bool:
        """Whether a gene is a range: the samplers then draw from each gene's distribution."""
        return any(isinstance(v, Range) for v in self.genes.values())

    @property
    def conditional(self) -> bool:
        """Whether a gene is conditional: a genome then holds its active genes only."""
        return bool(self.when)

    @property
    def drawn_by_gene(self) -> bool:
        """Whether the samplers draw a genome gene by gene (each from its distribution, an inactive one
        left out, as Optuna's samplers do) rather than by its position: a range, or a conditional gene."""
        return self.typed or self.conditional

    def active(self, name: str, genome: Mapping[str, Any]) -> bool:
        """Whether gene `name` is active in `genome` (or in the genes decided so far, in `order`)."""
        return self.conditions.active(name, genome)

    @property
    def order(self) -> tuple[str, ...]:
        """The genes in the order a genome is decided: each after those its conditions name."""
        return self.conditions.order

    def settled(self, genome: Mapping[str, Any], fill: Callable[[str], Any]) -> dict:
        """`genome` with its active genes (`fill(name)` gives one it lacks) and no other, in gene order."""
        return self.conditions.settled(genome, fill)

    @property
    def size(self) -> float:
        """Number of distinct genomes (math.inf with an unstepped float range)."""
        if self.conditional:
            return self.conditions.count({k: _count(v) for k, v in self.genes.items()})
        return math.prod(_count(v) for v in self.genes.values())

    @property
    def size_text(self) -> str:
        """Its genome count, or the genes that make it infinite (a space with listed genes beside them is not
        "a continuous space": it is continuous in those alone)."""
        if self.size != math.inf:
            return f"{self.size} genomes"
        return f"a space continuous in {', '.join(name for name, gene in self.genes.items() if _count(gene) == math.inf)}"

    def gene_size(self, name: str) -> float:
        return _count(self.genes[name])

    def all_genomes(self) -> Iterator[dict]:
        """Every genome once, the last gene varying fastest (`itertools.product` order). A finite space only."""
        if self.conditional:
            yield from self.conditions.every(lambda name: tuple(_values(self.genes[name])))
            return
        names = list(self.genes)
        for values in itertools.product(*(_values(v) for v in self.genes.values())):
            yield dict(zip(names, values))

    def genome_at(self, index: int) -> dict:
        """The genome `all_genomes()` yields at position `index`, without listing the others."""
        if self.size == math.inf:
            raise ValueError(f"space {self.name!r} has a float range: its genomes have no positions")
        if not 0 <= index < self.size:
            raise IndexError(f"genome index {index} outside space of {self.size}")
        if self.conditional:
            return self.conditions.at(index, {k: int(_count(v)) for k, v in self.genes.items()}, self._value_at)
        genome = {}
        for name, values in reversed(list(self.genes.items())):
            index, digit = divmod(index, int(_count(values)))
            genome[name] = values.value_at(digit) if isinstance(values, Range) else values[digit]
        return {name: genome[name] for name in self.genes}

    def contains(self, genome: Mapping[str, Any]) -> bool:
        """Whether the genome has exactly this space's active genes, each with an allowed value (type
        included: True is not 1, 1 is not 1.0)."""
        return self.outside(genome) is None

    def outside(self, genome: Any) -> str | None:
        """None where `genome` is one of this space's (`contains`); else why not, in words: the first active
        gene it lacks, gene it has beyond the space's active ones, or value the space does not hold."""
        if not isinstance(genome, Mapping):
            return f"it is {type(genome).__name__}, not a genome"
        active = {gene for gene in self.genes if self.active(gene, genome)}
        wrong = [f"it has no gene {gene!r}" for gene in self.genes if gene in active and gene not in genome]
        wrong += [f"it has the gene {gene!r}, inactive where its other genes are what they are"
                  if gene in self.genes else f"it has a gene {reprlib.repr(gene)} that the space has not"
                  for gene in genome if gene not in active]
        wrong += [f"its {gene} is {reprlib.repr(genome[gene])}, not one of the space's values"
                  for gene, values in self.genes.items() if gene in genome and not (
                      values.holds(genome[gene]) if isinstance(values, Range)
                      else any(type(v) is type(genome[gene]) and v == genome[gene] for v in values))]
        return wrong[0] if wrong else None

    def grid_counts(self) -> list[int]:
        """How many values a grid tries of each gene: a list's, and a range's `grid_count` (UserError
        for an unstepped float range without `points`). A range is never listed out."""
        counts = []
        for name, values in self.genes.items():
            count = values.grid_count if isinstance(values, Range) else len(values)
            if count is None:
                raise UserError(f"space {self.name}: a grid cannot list float gene {name!r} (a range without "
                                f"step): add points = N (N values from low to high) or step = S to it")
            counts.append(count)
        return counts

    def grid_size(self, counts: list[int] | None = None) -> int:
        """How many genomes the grid holds (`counts`: `grid_counts()`, where the caller has them): a
        conditional gene counts only where it is active."""
        counts = counts or self.grid_counts()
        return int(self.conditions.count(dict(zip(self.genes, counts)))) if self.conditional else math.prod(counts)

    def grid_genome_at(self, index: int, counts: list[int] | None = None) -> dict:
        """The genome at position `index` of the grid, the last gene varying fastest, as `genome_at`
        numbers a space's genomes (`counts`: `grid_counts()`, where the caller has them)."""
        if self.conditional:
            return self.conditions.at(index, dict(zip(self.genes, counts or self.grid_counts())),
                                      lambda name, i: _grid_value_at(self.genes[name], i))
        genome = {}
        for (name, values), count in zip(reversed(list(self.genes.items())), reversed(counts or self.grid_counts())):
            index, digit = divmod(index, count)
            genome[name] = values.grid_value_at(digit) if isinstance(values, Range) else values[digit]
        return {name: genome[name] for name in self.genes}

    def _value_at(self, name: str, index: int) -> Any:
        gene = self.genes[name]
        return gene.value_at(index) if isinstance(gene, Range) else gene[index]

    def to_dict(self) -> dict:
        return {"name": self.name, "model": self.model,
                "genes": {k: _gene_json(v, self.when.get(k)) for k, v in self.genes.items()}}


def _count(gene: Gene) -> float:
    return gene.count if isinstance(gene, Range) else len(gene)


def _values(gene: Gene) -> Any:
    if isinstance(gene, tuple):
        return gene
    if gene.count == math.inf:
        raise ValueError("an unstepped float range cannot be listed")
    return (gene.value_at(i) for i in range(int(gene.count)))


def _grid_value_at(gene: Gene, index: int) -> Any:
    return gene.grid_value_at(index) if isinstance(gene, Range) else gene[index]


def _gene_json(gene: Gene, when: When | None = None) -> Any:
    """A gene as its file writes it: a list, or a range's table; a conditional one with its `when`."""
    if not when:
        return gene.to_dict() if isinstance(gene, Range) else list(gene)
    return {**(gene.to_dict() if isinstance(gene, Range) else {"values": list(gene)}),
            "when": {parent: list(values) for parent, values in when.items()}}


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


def load_space(name_or_path: str | Path, objective: bool = False) -> Space:
    """A built-in space by name, a TOML file (`model = "mlp"` and a `[genes]` table: a list of
    values or a range table per gene), or the same as a JSON text (it starts with `{`). For an
    `objective` of yours, a file or text holding its `[genes]` alone."""
    text = str(name_or_path)
    if text in BUILTIN_SPACES:
        if objective:
            raise UserError(f"space {text} is of towerlab's {BUILTIN_SPACES[text].model} networks; a search of your "
                            "own objective takes a space of its genes alone (--space FILE.toml holding [genes])")
        return BUILTIN_SPACES[text]
    if text.lstrip().startswith("{"):
        try:
            data = json_loads(text, "the search space given as JSON")
        except ValueError as e:
            raise UserError(f"the search space given as JSON is not valid JSON: {e}") from None
        if not isinstance(data, dict):
            raise UserError("the search space given as JSON must be an object: {\"model\": ..., \"genes\": {...}}")
        return space_of(data, "inline", "search space (JSON)", objective)
    path = Path(text)
    where = f"search space {text}"
    if not path.exists():
        raise UserError(f"unknown search space {text!r}: use {', '.join(BUILTIN_SPACES)} "
                        f"or the path of a TOML file")
    require_regular_file(path)
    try:
        # utf-8-sig: a byte-order mark, as some Windows editors write, is no TOML (tomllib refuses it)
        data = tomllib.loads(path.read_bytes().decode("utf-8-sig"))
    except OSError as e:
        raise UserError(f"cannot read {where}: {e.strerror or e}") from None
    except tomllib.TOMLDecodeError as e:
        raise UserError(f"{where} is not valid TOML: {e}") from None
    except UnicodeDecodeError:
        raise UserError(f"{where} is not valid TOML: not UTF-8 text") from None
    return space_of(data, text, where, objective)


def space_of(data: Mapping[str, Any], name: str, where: str, objective: bool = False) -> Space:
    """The space a parsed file (or dict) describes, checked (an `objective`'s: its genes alone)."""
    if objective or data.get("model") == OBJECTIVE:
        if data.get("model", OBJECTIVE) != OBJECTIVE:
            raise UserError(f"{where} says model = {data['model']!r}: the space of your own objective is its [genes] "
                            "alone (the objective trains whatever it trains): drop the model")
        data = {**data, "model": OBJECTIVE}
    unknown = sorted(set(data) - set(_TOP_LEVEL_KEYS))
    if unknown:
        raise UserError(f"{where}: unknown key(s) {', '.join(map(str, unknown))}: a space file holds only "
                        f"model = \"NAME\" ({', '.join(model_names())}) and a [genes] table")
    if "model" not in data:
        choices = " or ".join(f'model = "{m}"' for m in model_names())
        raise UserError(f"{where}: missing model: add {choices}")
    model = data["model"]
    if not isinstance(model, str):
        raise UserError(f"{where}: model must be a string, one of {', '.join(model_names())}")
    genes = data.get("genes", {})
    if not isinstance(genes, dict):
        raise UserError(f"{where}: genes must be a table: write [genes] and one list per gene under it")
    return Space(name, model, *parse_genes(model, genes, where))
