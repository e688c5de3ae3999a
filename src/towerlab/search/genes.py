"""What a space file's [genes] may hold, and how each gene is read: the rules of towerlab's training
genes and of a model family's options (`gene_rules`), the model an objective's space records
(OBJECTIVE), and `parse_genes`, the one reader of a [genes] table, whatever the space comes from (a
file, a JSON text, a dict from Python, a store's record): a list of values, `{values = [...]}`, a range
table (towerlab.search.ranges), each with an optional `when` (towerlab.search.conditions).
"""

from __future__ import annotations

from typing import Any, Mapping

from towerlab.config import CUSTOM_MODEL, OPTIMIZERS
from towerlab.errors import UserError
from towerlab.catalog.models import CATALOG
from towerlab.catalog.model_options import FRACTION, POSITIVE_INT, GeneRule
from towerlab.search.conditions import Gene, When, check_when
from towerlab.search.ranges import parse_range

_TRAINING_GENES = {
    "optimizer": GeneRule("choice", choices=OPTIMIZERS),
    "lr": GeneRule("float", low=0.0, low_open=True),
    "batch_size": POSITIVE_INT,
    "epochs": POSITIVE_INT,
    "label_smoothing": FRACTION,
}
# A gene that is no training gene and no declared option: a keyword of the model's function (a
# family's builder, or a function of yours), which the search job checks against the function's
# signature before anything trains.
_OPTION_GENE = GeneRule("any")
# The model a space of your own objective's genes records (it has none: `load_space(..., objective=True)`).
OBJECTIVE = "objective"


def gene_rules(model: str, where: str) -> tuple[dict[str, GeneRule], bool]:
    """The rules of a space's genes for `model`, and whether they are all its genes: a catalog
    family that declares the options a search varies (`towerlab.catalog.models.ModelEntry.genes`) takes those
    and the training genes only; any other model (a family without the declaration, or a function
    of yours: model "custom") takes the training genes and any keyword of its function; an objective's
    space (OBJECTIVE) takes any gene, with no rule of towerlab's."""
    if model == OBJECTIVE:
        return {}, False
    if model not in model_names():
        raise UserError(f"{where}: unknown model {model!r}: use one of {', '.join(model_names())}")
    declared = CATALOG[model].genes if model in CATALOG else None
    return {**(declared or {}), **_TRAINING_GENES}, declared is not None


def model_names() -> tuple[str, ...]:
    return (*CATALOG, CUSTOM_MODEL)


def check_genes(model: str, genes: Mapping[str, Any], where: str) -> dict[str, Gene]:
    """Validate genes (lists of values, or range tables) against `gene_rules`; return them
    normalized. `where` names the source in the messages ("search space FILE")."""
    return parse_genes(model, genes, where)[0]


def parse_genes(model: str, genes: Mapping[str, Any], where: str) -> tuple[dict[str, Gene], dict[str, When]]:
    """A space file's [genes], checked against `gene_rules`: each gene normalized (a list of values,
    `{values = [...]}`, or a range table), and the conditions of those with a `when` key (checked by
    `conditions.check_when`). `where` names the source in the messages ("search space FILE")."""
    rules, complete = gene_rules(model, where)
    if not genes:
        raise UserError(f"{where}: no genes: list at least one under [genes], "
                        f"e.g. {next(iter(rules), 'lr')} = [...]")
    checked: dict[str, Gene] = {}
    when: dict[str, Any] = {}
    for gene, values in genes.items():
        if gene not in rules and complete:
            raise UserError(f"{where}: unknown gene {gene!r} for model {model}: "
                            f"known genes are {', '.join(rules)}")
        rule = rules.get(gene, _OPTION_GENE)
        if isinstance(values, dict) and "when" in values:
            values = dict(values)
            when[gene] = values.pop("when")
        if isinstance(values, dict) and "values" in values:
            if set(values) != {"values"}:
                extra = ", ".join(sorted(map(str, set(values) - {"values"})))
                raise UserError(f"{where}: gene {gene!r}: a list of values takes only values and when, not {extra}")
            values = values["values"]
        elif isinstance(values, dict):
            checked[gene] = parse_range(gene, values, rule, f"{where}: gene {gene!r}")
            continue
        if not isinstance(values, list) or not values:
            raise UserError(f"{where}: gene {gene!r} must be a non-empty list of values, {{values = [...]}} or a "
                            f"range {{low = A, high = B}}, got {values!r}")
        seen = set()
        normalized = []
        for value in values:
            ok = rule.normalize(value)
            if ok is None:
                raise UserError(f"{where}: gene {gene!r} has value {value!r}, "
                                f"expected {rule.describe()}")
            if isinstance(ok, str) and "\x00" in ok:  # no program takes it as an argument, no file as a name
                raise UserError(f"{where}: gene {gene!r} has value {value!r}, which holds a NUL character: "
                                "give text without one")
            if (type(ok), ok) in seen:  # with its type: 1 == True, yet [1, true] are two values, as in a genome
                raise UserError(f"{where}: gene {gene!r} lists {value!r} twice: list each value once")
            seen.add((type(ok), ok))
            normalized.append(ok)
        checked[gene] = tuple(normalized)
    return checked, check_when(when, checked, {gene: rules.get(gene, _OPTION_GENE) for gene in checked}, where)
