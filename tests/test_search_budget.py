"""--budget-epochs: a search ends once its trainings were given that many epochs (every rung and re-measure
counted, a restarted training charged its whole length), decided from what the store holds of the earlier
generations, so that a search played in one process, through the queue, or replayed from its store gives the
same history; it keeps what re-measuring the top takes; the other budgets still apply; the summary says which
ended it. A fake fitness (no torch)."""

from __future__ import annotations

import dataclasses

import pytest

from test_search_pinned import SPACE, TCH, fitness, stored
from towerlab.config import SearchConfig
from towerlab.errors import UserError
from towerlab.search import Search, Store, run_search, serial
from towerlab.search.work.worker import Worker, WorkerOptions

PRUNED = dict(population=4, generations=100, max_epochs=9, min_epochs=1, top=2, seed=11)


def given(store: Store, search_id: int) -> list[tuple[int, int]]:
    """(generation, epochs given) of each of the search's trainings."""
    return [(e.generation, e.max_epochs) for e in store.records.evaluations(search_id)]


def through_the_queue(path, cfg: SearchConfig) -> dict:
    def trainer(search):
        return lambda assignment: fitness(assignment.candidate)

    with Store(path) as store:
        search_id = Search.resolve(cfg, SPACE).create(store, TCH, {"test": False}).id
        Worker(store, "w", "cpu", trainer, WorkerOptions(search_ids=[search_id], lease=30.0)).run()
        return stored(store, search_id)


@pytest.mark.usefixtures("every_rung_ranks")  # every rung trained, and charged
@pytest.mark.parametrize("sampler, settings", [("random", {}), ("tpe", {"overlap": True}), ("ga", {"elite": 1})])
def test_a_budget_in_epochs_ends_the_search_alike_in_one_process_and_through_the_queue(tmp_path, sampler, settings):
    cfg = SearchConfig(sampler=sampler, budget_epochs=60, remeasure=1, **PRUNED, **settings)
    with Store(tmp_path / "one.db") as store:
        result = run_search(cfg, SPACE, serial(fitness), store, TCH)
        one = stored(store, result.search_id)
        spent = given(store, result.search_id)
        replayed = Search.open(store, result.search_id).run(store, serial(fitness))  # nothing left to train
    assert result.ended == replayed.ended == "budget_epochs" and result == replayed
    assert through_the_queue(tmp_path / "queue.db", cfg) == one
    # the crowning keeps 1 seed x top 2 x 9 epochs: no generation begins once 60 - 18 = 42 were given (one
    # begun while the one before still trained counted that one's first rungs only)
    last = max(g for g, _ in spent)
    assert sum(epochs for _, epochs in spent) >= 42 and result.generations == last + 1 < cfg.generations
    assert sum(epochs for g, epochs in spent if g < last - (sampler != "ga")) < 42  # ga alone does not overlap
    assert {epochs for _, epochs in spent} == {1, 3, 9}


def test_the_other_budgets_still_apply_and_say_so(tmp_path):
    with Store(tmp_path / "s.db") as store:
        few = run_search(SearchConfig(sampler="random", budget_epochs=10_000, max_evaluations=6, remeasure=0, **PRUNED),
                         SPACE, serial(fitness), store, TCH)
        short = run_search(SearchConfig(sampler="random", budget_epochs=10_000, remeasure=0,
                                        **{**PRUNED, "generations": 2, "seed": 12}), SPACE, serial(fitness), store, TCH)
    assert (few.ended, few.evaluations) == ("max_evaluations", 6)
    assert (short.ended, short.generations) == ("generations", 2)


def test_a_budget_smaller_than_what_it_holds_is_refused_on_resume(tmp_path):
    cfg = SearchConfig(sampler="random", budget_epochs=30, remeasure=0, **PRUNED)
    with Store(tmp_path / "s.db") as store:
        result = run_search(cfg, SPACE, serial(fitness), store, TCH)
        held = sum(epochs for _, epochs in given(store, result.search_id))
        with pytest.raises(UserError, match=f"given {held} epochs: resume with --budget-epochs {held} or more"):
            Search.resolve(dataclasses.replace(cfg, budget_epochs=held - 1), SPACE).resume(store, result.search_id, TCH)
        more = run_search(dataclasses.replace(cfg, budget_epochs=held + 40), SPACE, serial(fitness), store, TCH,
                          resume=result.search_id)
        assert sum(epochs for _, epochs in given(store, result.search_id)) >= held + 40 - 9 and more.ended == "budget_epochs"


def test_the_plan_and_default_remeasuring_keep_to_the_budget():
    search = Search.resolve(SearchConfig(sampler="random", budget_epochs=60, **PRUNED), SPACE)
    # 2 fresh seeds x top 2 x 9 epochs = 36, more than a quarter of 60: 0; the first rungs it holds: 60
    assert search.cfg.remeasure == 0 and search.plan["search"] == 60
    held = Search.resolve(SearchConfig(sampler="random", budget_epochs=400, **PRUNED), SPACE)
    assert held.cfg.remeasure == 2
    # the epochs kept for crowning the top (2 seeds x top 2 x 9 = 36) are not the search's: 364 first rungs
    assert held.plan["search"] == 364 and held.plan["remeasure"] >= 4


def test_a_budget_alone_sets_the_generations_a_search_in_generations_may_take(tmp_path):
    """Without --generations, a search in generations runs its sampler's default, or as many as its budget may
    take where that is more (every member at its shortest rung): the budget is spent, where 10 generations
    stopped a pruned search's --budget-epochs short and refused --max-evaluations 100 in generations of 4."""
    pruned = SearchConfig(sampler="random", population=4, budget_epochs=400, max_epochs=9, min_epochs=1, remeasure=0)
    counted = SearchConfig(sampler="tpe", population=4, max_evaluations=100, remeasure=0)
    assert [Search.resolve(cfg, SPACE).cfg.generations for cfg in (pruned, counted)] == [100, 25]
    assert Search.resolve(dataclasses.replace(counted, max_evaluations=12), SPACE).cfg.generations == 10
    with Store(tmp_path / "s.db") as store:
        spent = run_search(pruned, SPACE, serial(fitness), store, TCH)
        counted_out = run_search(counted, SPACE, serial(fitness), store, TCH)
        epochs = sum(e for _, e in given(store, spent.search_id))
    assert spent.ended == "budget_epochs" and spent.generations > 10 and 400 - 36 <= epochs <= 400 + 36
    assert counted_out.evaluations == 100 and counted_out.generations == 25  # the two budgets end it alike
