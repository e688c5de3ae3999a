"""Conditional genes: a gene active only where other genes hold given values, written in a space file
with a `when` key (`rate_drop = {low = 0.0, high = 1.0, when = {booster = "dart"}}`, `updater = {values =
["shotgun", "coord_descent"], when = {booster = "gblinear"}}`).

A gene with a `when` table is active where every gene it names is active and holds one of the values
given for it (a value, or a list of values); a gene without one is always active. Conditions nest (a
condition may name a gene that has its own). A genome holds its active genes only: an inactive gene is
absent, not given a placeholder, so a genome of a space without conditions is what it always was (its
hash too). `check_when` refuses, in one line each, a condition naming an unknown gene or a value that
gene does not take, a gene whose values cannot be listed (an unstepped float range), and a cycle.

`Conditions` answers what the samplers and the space ask: whether a gene is active in a (partial)
genome, the order in which genes are decided (every gene after those its conditions name, else the
file's order), and the positions of a finite space's genomes without listing them (`count`, `at`,
`every`): genomes are ordered by their genes' positions, in that order, an inactive gene skipped, so
that a grid does not multiply by the values of a gene that is not there.
"""

from __future__ import annotations

import itertools
from typing import Any, Callable, Iterator, Mapping, Optional, Sequence, Union

from towerlab.catalog.model_options import GeneRule
from towerlab.errors import UserError, did_you_mean
from towerlab.search.ranges import Range

Gene = Union[tuple, Range]
# A gene's conditions: each gene it names, and the values under which it is active.
When = dict[str, tuple]


def same(a: object, b: object) -> bool:
    """Equal with the same type, as genomes tell values apart (True is not 1, 1 is not 1.0)."""
    return type(a) is type(b) and a == b


def position(gene: Gene, value: Any) -> int:
    """The position of a value a finite gene takes, in increasing order of its values (a list's order)."""
    if isinstance(gene, Range):
        return round((value - gene.low) / (gene.step or 1))
    return next(i for i, v in enumerate(gene) if same(v, value))


def check_when(specs: Mapping[str, Any], genes: Mapping[str, Gene], rules: Mapping[str, GeneRule],
               where: str) -> dict[str, When]:
    """The `when` tables of a space's genes (gene -> what its file wrote), checked against the genes
    (parsed) and their rules, each value in the form the gene's own values take."""
    checked: dict[str, When] = {}
    for gene, spec in specs.items():
        here = f"{where}: gene {gene!r}"
        if not isinstance(spec, dict) or not spec:
            raise UserError(f"{here}: when must be a table of the genes it depends on and their values, "
                            f"e.g. when = {{booster = [\"gbtree\", \"dart\"]}}, got {spec!r}")
        when: When = {}
        for parent, values in spec.items():
            if parent not in genes:
                raise UserError(f"{here}: its condition names gene {parent!r}, which the space does not have"
                                f"{did_you_mean(parent, genes)} (its genes: {', '.join(genes)})")
            if parent == gene:
                raise UserError(f"{here}: its condition names the gene itself: a gene cannot depend on itself")
            when[parent] = _values(parent, genes[parent], rules.get(parent), values, here)
        checked[gene] = when
    try:
        decision_order(list(genes), checked)
    except ValueError as e:
        raise UserError(f"{where}: {e}") from None
    never = Conditions(genes, checked).never_active()
    if never:
        raise UserError(f"{where}: gene {never[0]!r} is never active: its conditions cannot hold together")
    return checked


def _values(parent: str, gene: Gene, rule: Optional[GeneRule], values: Any, here: str) -> tuple:
    """The values a condition gives for `parent`, as `parent`'s own values are written (a float for a
    float gene written 1), each one it takes, each once."""
    if isinstance(gene, Range) and gene.count == float("inf"):
        raise UserError(f"{here}: its condition names {parent!r}, a float range without step, whose values cannot "
                        f"be named: name a listed gene, an int range or a stepped range")
    given = list(values) if isinstance(values, (list, tuple)) else [values]
    if not given:
        raise UserError(f"{here}: its condition gives no value of {parent!r}: give one or a list of them")
    found: list = []
    for value in given:
        ok = _taken(gene, rule, value)
        if ok is None:
            takes = (f"{gene.low!r} to {gene.high!r}" + (f" by {gene.step!r}" if gene.step else "")
                     if isinstance(gene, Range) else ", ".join(map(repr, gene)))
            raise UserError(f"{here}: its condition {parent} = {value!r} names a value {parent!r} does not take "
                            f"(it takes {takes})")
        if any(same(ok, v) for v in found):
            raise UserError(f"{here}: its condition lists {parent} = {value!r} twice: list each value once")
        found.append(ok)
    return tuple(found)


def _taken(gene: Gene, rule: Optional[GeneRule], value: Any) -> Any:
    """`value` as `gene` holds it, or None where the gene does not take it."""
    if isinstance(gene, Range):
        if gene.kind == "float" and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        return value if gene.holds(value) else None
    ok = rule.normalize(value) if rule is not None else value
    return next((v for v in gene if same(v, ok)), None) if ok is not None else None


def decision_order(names: Sequence[str], when: Mapping[str, When]) -> tuple[str, ...]:
    """The genes in the order a sampler decides them: each after every gene its conditions name, else in
    the file's order (a space without conditions: the file's order). A cycle is a ValueError naming it."""
    placed: list[str] = []
    left = list(names)
    while left:
        ready = next((g for g in left if all(p in placed for p in when.get(g, {}))), None)
        if ready is None:
            path = [left[0]]
            while path.count(path[-1]) < 2:
                path.append(next(p for p in when[path[-1]] if p not in placed))
            cycle = path[path.index(path[-1]):]
            raise ValueError(f"genes {' -> '.join(cycle)} depend on each other in a circle (each active only "
                             "where the next has given values): drop one of those conditions")
        placed.append(ready)
        left.remove(ready)
    return tuple(placed)


# A controlling gene's class in a walk over positions: inactive, a position a condition names, or OTHER.
OTHER = -1


class Conditions:
    """The conditions of a space's genes (`when`: gene -> its conditions), and what follows from them."""

    def __init__(self, genes: Mapping[str, Gene], when: Mapping[str, When]) -> None:
        self.genes, self.when = genes, when
        self.order = decision_order(list(genes), when)
        # Each condition's values by their positions, and each gene a condition names: the positions named.
        self._allowed = {g: {p: frozenset(position(genes[p], v) for v in vs) for p, vs in w.items()}
                         for g, w in when.items()}
        named: dict[str, set[int]] = {}
        for w in self._allowed.values():
            for parent, positions in w.items():
                named.setdefault(parent, set()).update(positions)
        self._named = {p: sorted(positions) for p, positions in named.items()}

    def active(self, name: str, genome: Mapping[str, Any]) -> bool:
        """Whether gene `name` is active in `genome` (a genome, or the genes decided so far)."""
        return all(parent in genome and any(same(v, genome[parent]) for v in values)
                   for parent, values in self.when.get(name, {}).items())

    def settled(self, genome: Mapping[str, Any], fill: Callable[[str], Any]) -> dict:
        """`genome` made valid: its genes decided in order, an active gene keeping its value (or given
        `fill(name)` where it has none), an inactive one dropped; in the genes' order."""
        decided: dict[str, Any] = {}
        for name in self.order:
            if self.active(name, decided):
                decided[name] = genome[name] if name in genome else fill(name)
        return {name: decided[name] for name in self.genes if name in decided}

    # Positions: each gene's values are `counts[name]` long; a walk is over the decided genes' classes.

    def _is_active(self, name: str, classes: Mapping[str, int | None]) -> bool:
        return all(classes.get(parent) in positions for parent, positions in self._allowed.get(name, {}).items())

    def _runs(self, name: str, count: int) -> Iterator[tuple[int, int, int]]:
        """A controlling gene's positions as runs of one class: (first position, length, class)."""
        start = 0
        for at in self._named[name]:
            if at > start:
                yield start, at - start, OTHER
            yield at, 1, at
            start = at + 1
        if count > start:
            yield start, count - start, OTHER

    def count(self, counts: Mapping[str, float]) -> float:
        """How many genomes the space holds, gene `name` taking `counts[name]` values."""
        return _Walk(self, counts).rest(0, {})

    def at(self, index: int, counts: Mapping[str, int], value_at: Callable[[str, int], Any]) -> dict:
        """The genome at position `index` of those `every` yields, without listing the others."""
        walk, classes, genome = _Walk(self, counts), dict[str, Optional[int]](), {}
        for k, name in enumerate(self.order):
            if not self._is_active(name, classes):
                continue
            if name not in self._named:
                digit, index = divmod(index, int(walk.rest(k + 1, classes)))
                genome[name] = value_at(name, digit)
                continue
            for first, length, cls in self._runs(name, int(counts[name])):
                after = int(walk.rest(k + 1, {**classes, name: cls}))
                if index < length * after:
                    digit, index = divmod(index, after)
                    genome[name], classes[name] = value_at(name, first + digit), cls
                    break
                index -= length * after
        return {name: genome[name] for name in self.genes if name in genome}

    def every(self, values: Callable[[str], Sequence[Any]]) -> Iterator[dict]:
        """Every genome once, in position order (the last gene decided varies fastest)."""
        def grow(k: int, genome: dict) -> Iterator[dict]:
            if k == len(self.order):
                yield {name: genome[name] for name in self.genes if name in genome}
                return
            name = self.order[k]
            if not self.active(name, genome):
                yield from grow(k + 1, genome)
                return
            for value in values(name):
                yield from grow(k + 1, {**genome, name: value})
        return grow(0, {})

    def never_active(self) -> list[str]:
        """The genes no genome holds (conditions that cannot hold together), in the file's order."""
        seen: set[str] = set()
        for classes in _Walk(self, {}).states():
            seen.update(name for name in self.genes if self._is_active(name, classes))
        return [name for name in self.genes if name not in seen]


class _Walk:
    """Genomes counted by their controlling genes' classes: how many complete the genes decided so far
    (`rest`, remembered per state, so a space's count costs its conditions' states, not its genomes)."""

    def __init__(self, conditions: Conditions, counts: Mapping[str, float]) -> None:
        self.c, self.counts = conditions, counts
        self._memo: dict[tuple, float] = {}

    def rest(self, k: int, classes: Mapping[str, int | None]) -> float:
        c = self.c
        key = (k, *sorted(classes.items()))
        if key in self._memo:
            return self._memo[key]
        if k == len(c.order):
            return 1
        name = c.order[k]
        if not c._is_active(name, classes):  # an inactive gene's class is None, as an undecided one's
            total = self.rest(k + 1, classes)
        elif name not in c._named:
            total = self.counts[name] * self.rest(k + 1, classes)
        else:
            total = sum(length * self.rest(k + 1, {**classes, name: cls})
                        for _, length, cls in c._runs(name, int(self.counts[name])))
        self._memo[key] = total
        return total

    def states(self) -> Iterator[dict]:
        """Every reachable assignment of classes to the controlling genes."""
        def grow(k: int, classes: dict) -> Iterator[dict]:
            if k == len(self.c.order):
                yield classes
                return
            name = self.c.order[k]
            if name not in self.c._named:
                yield from grow(k + 1, classes)
            elif not self.c._is_active(name, classes):
                yield from grow(k + 1, classes)
            else:
                for cls in itertools.chain(self.c._named[name], (OTHER,)):
                    yield from grow(k + 1, {**classes, name: cls})
        return grow(0, {})
