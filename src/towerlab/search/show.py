"""`towerlab search show DIR`: a store's searches as text (generations, counts, top genomes)."""

from __future__ import annotations

import os
from typing import Optional

from towerlab.store import SearchRow, Store


def format_search(store_or_path: Store | str | os.PathLike, search_id: Optional[int] = None) -> str:
    """Every search of the store (or only `search_id`): one line per generation with evaluated,
    cached, failed, best/mean/worst validation accuracy and seconds, then the summary counts and
    the top genomes with validation (and test, when set) accuracy. A path may be the store file
    or the folder holding `search.db`; a missing or foreign file is a UserError."""
    if isinstance(store_or_path, Store):
        return _format(store_or_path, search_id)
    with Store(store_or_path, create=False) as store:
        return _format(store, search_id)


def _format(store: Store, search_id: Optional[int]) -> str:
    searches = store.searches() if search_id is None else [s for s in store.searches() if s.id == search_id]
    if not searches:
        return f"{store.path}: no searches yet"
    return "\n\n".join(_format_one(store, search) for search in searches)


def _acc(x: Optional[float]) -> str:
    return "-" if x is None else f"{x:.4f}"


def _format_one(store: Store, search: SearchRow) -> str:
    cfg, space = search.config, search.space
    size = 1
    for values in space["genes"].values():
        size *= len(values)
    shape = (f"population {cfg['population']}, {cfg['generations']} generations"
             if search.kind == "evolve" else
             f"limit {cfg['limit']}" if cfg.get("limit") else "every genome")
    state = f"finished {search.finished}" if search.finished else "not finished (resume it with --resume)"
    lines = [f"search {search.id}: {search.kind} over space {space['name']} (model {space['model']}, "
             f"{size} genomes), seed {cfg['seed']}, {shape}; started {search.created}, {state}",
             f"  {'gen':>4} {'evaluated':>9} {'cached':>7} {'failed':>6} {'best':>7} {'mean':>7} "
             f"{'worst':>7} {'seconds':>9}"]
    totals = {"evaluated": 0, "cached": 0, "failed": 0, "seconds": 0.0}
    trained = store.evaluations(search.id)
    for gen in store.generations(search.id):
        if not gen.complete:
            done = sum(e.generation == gen.generation for e in trained)
            lines.append(f"  {gen.generation + 1:>4} incomplete: {done} evaluation(s) recorded of "
                         f"{len(gen.members)} members")
            continue
        s = gen.stats
        for key in totals:
            totals[key] += s[key]
        lines.append(f"  {gen.generation + 1:>4} {s['evaluated']:>9} {s['cached']:>7} {s['failed']:>6} "
                     f"{_acc(s['best']):>7} {_acc(s['mean']):>7} {_acc(s['worst']):>7} "
                     f"{s['seconds']:>9.1f}")
    lines.append(f"  {totals['evaluated']} evaluations, {totals['cached']} cache hits, "
                 f"{totals['failed']} failures, {totals['seconds']:.1f} s")
    top = store.search_top(search.id, int(cfg.get("top", 5)))
    if top:
        lines.append(f"  top {len(top)}:")
        lines.append(f"  {'rank':>4} {'val acc':>8} {'test acc':>8}  genome")
        for rank, e in enumerate(top, 1):
            genome = " ".join(f"{k}={v}" for k, v in e.genome.items())
            lines.append(f"  {rank:>4} {_acc(e.fitness):>8} {_acc(e.test_accuracy):>8}  {genome}")
    return "\n".join(lines)
