"""`towerlab search show DIR`: a store's searches as text (generations, counts, the crowned top with
its spread), or every evaluation as records (`--csv`, `--json`) to take elsewhere. A search of your own
objective is shown by its metric's name and direction: its values as your objective returned them (the
fitness, higher is better, is the metric negated where it is minimized), and every other metric it
returned (`metric_<name>` columns in CSV). `numerics_used`: the numerics a search's trainings ran with, which
its record names where they differ."""

from __future__ import annotations

import csv
import io
import json
import os
from typing import Callable, Optional, TypeVar

from towerlab.report import duration, printable
from towerlab.search.store.location import store_path
from towerlab.search.history import SearchResult, spread as sd
from towerlab.search.search import Search
from towerlab.search.samplers.auto import described
from towerlab.search.store import SearchRow, Store
from towerlab.search.store.integrity import records_of

# The columns of `--csv`, in order; the genes follow as gene_<name>.
RECORD_FIELDS = ("id", "search", "sampler", "generation", "index", "rung", "max_epochs", "replicate", "seed",
                 "status", "val_accuracy", "val_loss", "test_accuracy", "epochs", "seconds", "worker",
                 "device", "threads", "precision", "torch_version", "finished_at", "reason", "genome_hash", "host",
                 "towerlab_version", "code_digest", "data_digest")

_NUMERICS = {"device": "device", "threads": "threads", "precision": "precision", "torch_version": "torch"}
_PROVENANCE = {"host": "host", "towerlab_version": "towerlab", "code_digest": "code", "data_digest": "data"}

T = TypeVar("T")


def _open(store_or_path: Store | str | os.PathLike, what: Callable[[Store], T]) -> T:
    if isinstance(store_or_path, Store):
        with records_of(store_or_path):
            return what(store_or_path)
    with Store(store_path(store_or_path), create=False) as store, records_of(store):
        return what(store)


def format_search(store_or_path: Store | str | os.PathLike, search_id: Optional[int] = None) -> str:
    """Every search of the store (or only `search_id`): one line per generation with evaluated,
    cached, failed, best/mean/worst validation accuracy and seconds, then the summary counts and
    the top genomes with validation accuracy (the mean over their seeds, its standard deviation
    and the number of seeds) and test accuracy, when set. A path may be the store file or the
    folder holding `search.db`; a missing, foreign or damaged file is a UserError."""
    return _open(store_or_path, lambda store: _format(store, search_id))


def evaluation_records(store_or_path: Store | str | os.PathLike) -> list[dict]:
    """Every training the store holds, in the order they finished: which search made it (and its
    sampler), where (generation, index; -1 for a re-measure), the rung and its epochs, the
    replicate (0: the evaluation, 1..: re-measures), the seed, the outcome (validation and test
    accuracy, loss, epochs trained, seconds), the worker and its numerics (device, threads,
    precision, torch version) and provenance (host, towerlab version, the digests of the training
    code and of the data), None where the store predates them, and the genome; and what it ranks by: its
    search's `metric` and `direction`, its `value` (validation accuracy, or the metric of your objective as
    it returned it: the fitness negated where it is minimized) and every metric it returned (`metrics`)."""
    def records(store: Store) -> list[dict]:
        searches = {row.id: Search.of_row(row, str(store.path)) for row in store.records.searches()}
        rows = []
        for e in store.records.evaluations():
            search = searches[e.search_id]
            value = search.goal.value(e.fitness) if e.status == "ok" else None
            rows.append({"id": e.id, "search": e.search_id, "sampler": search.cfg.sampler,
                         "metric": search.goal.metric, "direction": search.goal.direction, "value": value,
                         "metrics": e.metrics, "curve": e.curve, "objective": search.aim.kind,
                         "generation": e.generation + 1, "index": e.index,  # from 1, as the console counts
                         "rung": search.ladder.rung_of(e.max_epochs),
                         "max_epochs": e.max_epochs, "replicate": e.replicate, "seed": e.seed, "status": e.status,
                         "val_accuracy": None if search.own else e.fitness, "val_loss": e.val_loss,
                         "test_accuracy": e.test_accuracy,
                         "epochs": e.epochs, "seconds": e.seconds, "worker": e.worker,
                         **{field: (e.numerics or {}).get(key) for field, key in _NUMERICS.items()},
                         "finished_at": e.finished_at, "reason": e.reason, "genome_hash": e.genome_hash,
                         **{field: (e.provenance or {}).get(key) for field, key in _PROVENANCE.items()},
                         "genome": e.genome})
        return rows

    return _open(store_or_path, records)


# What only towerlab's own training gives: no column of a CSV whose every record is of an objective of yours.
TRAINING_FIELDS = ("val_accuracy", "val_loss", "test_accuracy", "precision")


def records_csv(records: list[dict]) -> str:
    """The records as CSV: RECORD_FIELDS (less TRAINING_FIELDS where every record is of an objective of yours),
    then one metric_<name> column per metric an objective of yours returned in any row (its values as returned),
    the curve it reported (`curve`, JSON: [{"epoch": N, metric: value, ...}, ...]) where any row has one, then
    one gene_<name> column per gene of any genome."""
    genes: dict[str, None] = {}
    metrics: dict[str, None] = {}
    for r in records:
        genes.update(dict.fromkeys(r["genome"]))
        metrics.update(dict.fromkeys(r["metrics"] or {}))
    own = bool(records) and all(r.get("objective", "training") != "training" for r in records)
    fields = [k for k in RECORD_FIELDS if not (own and k in TRAINING_FIELDS)]
    curves = ["curve"] if any(r.get("curve") for r in records) else []
    text = io.StringIO()
    writer = csv.writer(text, lineterminator="\n")
    writer.writerow([*fields, *(f"metric_{m}" for m in metrics), *curves, *(f"gene_{g}" for g in genes)])
    for r in records:
        given = r["metrics"] or {}
        writer.writerow([("" if r[k] is None else r[k]) for k in fields]
                        + [("" if given.get(m) is None else given[m]) for m in metrics]
                        + [json.dumps(r.get("curve") or []) for _ in curves]
                        + [r["genome"].get(g, "") for g in genes])
    return text.getvalue()


def records_json(records: list[dict]) -> str:
    return json.dumps(records, indent=1)


def _format(store: Store, search_id: Optional[int]) -> str:
    searches = store.records.searches() if search_id is None else [s for s in store.records.searches() if s.id == search_id]
    if not searches:
        return f"{printable(store.path)}: no searches yet"
    return "\n\n".join([*(_format_one(store, search) for search in searches), *_format_workers(store)])


# Seconds without a claim or a lease renewal after which `search show` calls a worker silent: more than
# a lease (the default's 30 s), renewed every third of it.
SILENT = 60.0


def _format_workers(store: Store) -> list[str]:
    """The workers that joined the store: those at work (what each holds), those silent for long
    (gone without a word: their leases lapse), how many left."""
    workers = store.queue.workers()
    if not workers:
        return []
    here = [w for w in workers if w["left_at"] is None]
    lines = [f"workers: {len(here)} joined and not left, {len(workers) - len(here)} left"]
    for w in here:
        if w["search_id"] is not None:
            doing = (f"{'testing' if w['kind'] == 'test' else 'training'} search {w['search_id']}, generation "
                     f"{w['generation'] + 1}" + (f", member {w['idx']}" if w["idx"] >= 0 else ", a re-measure")
                     + (f", for {duration(w['held'])}" if w.get("held") is not None else ""))
        else:  # its last task may be another worker's now: its lease lapsed (a worker killed, say)
            doing = "idle" if w["task"] is None else "holds no task (its last went to another worker)"
        silent = f", silent for {w['age']:.0f} s" if w["age"] > SILENT else ""
        lines.append(f"  {printable(w['id'])}: {doing}{silent}")
    return ["\n".join(lines)]


def workers_now(store: Store, search: Search) -> str:
    """How many of the store's workers are busy and idle now, and why the idle ones wait: what the search's
    leader is doing (`TaskQueue.tell_activity`), or, in a search of generations, the generation's end."""
    busy, idle, waiting = store.queue.pace(search.stored_id, SILENT)
    held = max((w["held"] for w in store.queue.workers() if w["left_at"] is None and w.get("held") is not None
                and w["search_id"] == search.stored_id), default=None)
    busy_text = f"{busy} busy" + (f" (the longest for {duration(held)})" if held is not None else "")
    if not idle:
        return f"{busy_text}, none idle"
    row = store.records.search(search.stored_id)
    doing = str(((row.activity if row else None) or {}).get("doing", ""))
    if row is None or row.finished:
        why = "the search is finished"
    elif waiting:
        why = f"{waiting} candidate(s) waiting for them"
    elif store.queue.leader(search.stored_id) is None:
        why = "no worker leads the search now: one takes over within a lease"
    elif doing.startswith("testing"):
        why = f"the search is ending: {doing}"
    elif doing.startswith(("ending", "crowning")):
        why = doing.replace("ending: ", "").replace("crowning: ", "the search is ending: ")
    elif not search.asynchronous:
        why = f"each generation of {search.shape.population} ends with its last trainings (give no --population, " \
              "and the search proposes as workers free up)"
    elif doing.startswith("proposing"):
        why = f"a proposal is being made ({doing})"
    else:
        why = "the next proposal is being made"
    return f"{busy_text}, {idle} idle: {why}"


def _acc(x: Optional[float]) -> str:
    return "-" if x is None else f"{x:.4f}"


def _trains(search: Search) -> str:
    """What a search trains, as its header says: towerlab's model, or your objective and what it ranks by."""
    if not search.own:
        return f"model {search.space.model}, {search.space.size_text}"
    aim = search.aim
    return f"your {aim.kind} {aim.spec}, {search.space.size_text}; {aim.goal.metric} {aim.goal.direction}d"


def _shape(search: Search, generations: list) -> str:
    cfg = search.cfg
    if cfg.sampler == "grid":
        shape = f"limit {cfg.settings['limit']}" if cfg.settings.get("limit") else "every genome"
    else:  # without --population, the sampler's own: the size of its generations (a budget may cut the last)
        population = cfg.population or max((len(g.members) for g in generations), default="default")
        shape = f"population {population}, {cfg.generations} generation{'' if cfg.generations == 1 else 's'}"
    if cfg.max_evaluations:
        shape += f", at most {cfg.max_evaluations} evaluations"
    if cfg.min_epochs:
        places = ", places counted over the new" if cfg.prune_places == "new" else ""
        shape += f", pruned (rungs of {'/'.join(map(str, search.ladder.epochs))} epochs{places})"
    if cfg.remeasure:
        shape += f", the crowned re-measured with {cfg.remeasure} more seeds"
    return shape


def _format_one(store: Store, row: SearchRow) -> str:
    search = Search.of_row(row, str(store.path))
    space = search.space
    running = not row.finished and store.queue.at_work(row.id, SILENT)
    state = (f"finished {row.finished}" if row.finished else "running" if running else
             "not finished, and no worker is at it (continue it with `towerlab search run --resume DIR`, or start "
             "`towerlab search worker`)")
    generations = store.records.generations(row.id)
    lines = [f"search {row.id}: {described(search.cfg, space)} over space {printable(space.name)} ({printable(_trains(search))}), "
             f"seed {search.cfg.seed}, {_shape(search, generations)}; started {row.created}, {state}",
             f"  {'gen':>4} {'evaluated':>9} {'cached':>7} {'failed':>6} {'best':>7} {'mean':>7} "
             f"{'worst':>7} {'seconds':>9}"]
    totals = {"evaluated": 0, "cached": 0, "failed": 0, "seconds": 0.0}
    counts = store.records.generation_counts(row.id) if not all(g.complete for g in generations) else {}
    for gen in generations:
        if not gen.complete:
            done = counts.get(gen.generation, 0)
            lines.append(f"  {gen.generation + 1:>4} incomplete: {done} evaluation(s) recorded of "
                         f"{len(gen.members)} members")
            continue
        s = gen.final_stats
        for key in totals:
            totals[key] += s[key]
        values = " ".join(f"{search.reads(s[key]):>7}" for key in ("best", "mean", "worst"))  # the metric's
        lines.append(f"  {gen.generation + 1:>4} {s['evaluated']:>9} {s['cached']:>7} {s['failed']:>6} {values} "
                     f"{s['seconds']:>9.1f}")
    top = _top(store, row, search.cfg.top)
    if row.finished:
        lines.append(f"  {totals['evaluated']} evaluations, {totals['cached']} cache hits, "
                     f"{totals['failed']} failures, {totals['seconds']:.1f} s")
    else:  # the generations' counts come as each completes: the queue says where a running search stands
        queue = store.queue.tasks(row.id)
        closed = [t for t in queue if t.state == "done"]
        held = sorted({t.worker for t in queue if t.state == "claimed" and t.worker})
        failed = sum((t.result or {}).get("status") == "failed" for t in closed)
        best = f"; best {printable(search.metric_label)} so far {search.reads(top[0][1])}" if top else ""
        lines.append(f"  so far: {len(closed)} training(s) done ({failed} failed), "
                     f"{sum(t.state == 'claimed' for t in queue)} in progress"
                     + (f" ({', '.join(map(printable, held))})" if held else "")
                     + f", {sum(t.state == 'open' for t in queue)} waiting{best}")
        if running:
            lines.append(f"  workers: {workers_now(store, search)}")
    lines += _provenances(store.records.provenances(row.id))
    judgement = search.judgement(store)
    if judgement is not None:  # how the next generation prunes: on the curves and rungs of those complete
        lines.append(f"  pruning, judged on its complete generations: {judgement.text()}")
    if top:
        lines.append(f"  top {len(top)}:" if row.finished else f"  top {len(top)} so far (measured once):")
        # An objective of yours has its metric and no test accuracy: towerlab tests nothing of it.
        metric, tested = (printable(search.goal.metric)[:10], "") if search.own else ("val acc", f" {'test acc':>8}")
        width = 10 if search.own else 8
        lines.append(f"  {'rank':>4} {metric:>{width}} {'+-':>7} {'seeds':>5}{tested}  genome")
        for rank, (genome, fitness, fitnesses, test) in enumerate(top, 1):
            spread = "-" if len(fitnesses) < 2 else f"{sd(fitnesses):.4g}" if search.own else f"{sd(fitnesses):.4f}"
            text = printable(" ".join(f"{k}={v}" for k, v in genome.items()))
            lines.append(f"  {rank:>4} {search.reads(fitness):>{width}} {spread:>7} {len(fitnesses):>5}"
                         f"{'' if search.own else f' {_acc(test):>8}'}  {text}")
    return "\n".join(lines)


def _top(store: Store, search: SearchRow, n: int) -> list[tuple[dict, float, list[float], Optional[float]]]:
    """(genome, fitness, its fitnesses, test accuracy) of the crowned top, or of the best `n` so far."""
    if search.summary is None:
        return [(e.genome, e.fitness, [e.fitness], e.test_accuracy) for e in store.records.search_top(search.id, n)
                if e.fitness is not None]  # every one: they succeeded
    top = []
    for entry in search.summary["top"]:
        row = store.records.lookup(entry["genome_hash"], entry["train_config_hash"], search.id)
        top.append((entry["genome"], entry["fitness"], entry["fitnesses"], None if row is None else row.test_accuracy))
    return top


def _provenances(kinds: dict[str, int]) -> list[str]:
    """A line where a search's rows come from more than one provenance (`towerlab.objective.admission`; `kinds`:
    how many rows each, by its JSON): how many from each, and what tells them apart."""
    if len(kinds) < 2:
        return []
    found = [json.loads(key) or {} for key in kinds]
    recorded = [p for p in found if p]
    differing = sorted({k for p in recorded for k in p if len({json.dumps(q.get(k)) for q in recorded}) > 1})
    named_by = differing or ["host", "towerlab", "torch", "device"]

    def named(where: dict) -> str:
        if not where:
            return "no record of it (rows written before towerlab kept one, or failed when their workers were lost)"
        return ", ".join(f"{k} {printable(_short(where.get(k)))}" for k in named_by)

    return [f"  its rows come from {len(kinds)} provenances"
            + (f", which differ in {', '.join(differing)}" if differing else "") + ": "
            + "; ".join(f"{n} from {named(p)}" for p, n in zip(found, kinds.values()))]


def _short(value: object) -> str:
    text = str(value)
    return text.removeprefix("sha256:")[:12] if text.startswith("sha256:") else text


def numerics_used(store: Store, result: SearchResult) -> list[dict]:
    """The distinct numerics (device, threads, precision, torch) of the trainings this search made
    and of those the store served its top from (another search's, in a shared store); unknown
    ones (rows from before they were recorded) left out."""
    rows = [*store.records.evaluations(result.search_id),
            *(store.records.lookup(t.genome_hash, t.train_config_hash, result.search_id) for t in result.top)]
    used = {json.dumps(r.numerics, sort_keys=True) for r in rows if r is not None and r.numerics}
    return [json.loads(n) for n in sorted(used)]


def numerics_text(numerics: dict) -> str:
    return (f"{numerics.get('device')}, {numerics.get('threads')} thread(s), {numerics.get('precision')}, "
            f"torch {numerics.get('torch')}")
