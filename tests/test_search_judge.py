"""The pruner's judge (issue 73): a generation trains at a rung below the last only where the search's own
earlier generations show that rung ranks as the last does (Spearman's rank correlation of at least
MIN_CORRELATION over at least MIN_PAIRS genomes, read from the curves its last-rung trainings reported, else
from its trainings at both rungs); a rung not shown is skipped. So the first generation is unpruned, a rung
whose early epochs rank nothing like the last is never pruned at (a pruned search costs what an unpruned one
does), and one that ranks is pruned at as successive halving does; the same whoever trains what, and on a
replay or a resume. Fake fitness with a curve: no torch."""

from __future__ import annotations

import dataclasses
import math
import random
from collections import Counter

import pytest

from towerlab.config import SearchConfig
from towerlab.search import Outcome, Search, Store, format_search, load_space, rank_key, run_search, serial
from towerlab.search.goal import Goal
from towerlab.search.judge import MIN_CORRELATION, MIN_PAIRS, Evidence, curve_fitness, spearman
from towerlab.search.plan import planned_trainings
from towerlab.search.store.rows import Evaluation

TCH = "judge-tch"
SPACE = load_space("mlp")


def objective(early: str):
    """A fake training whose validation accuracy after each epoch it reports as its curve: at the last
    epoch (9) a genome's own quality; before it, as `early` says: "ranks" (the quality, growing with the
    epochs), "reversed" (its opposite: the worst finish first), "first-epoch-noise" (noise at epoch 1 that
    ranks nothing like the last, the quality from epoch 2 on)."""
    def value(h: str, epoch: int) -> float:
        quality = int(h[:8], 16) / 16**8
        noise = int(h[8:16], 16) / 16**8
        if epoch == 9 or early == "ranks" or (early == "first-epoch-noise" and epoch > 1):
            return 0.3 + 0.5 * quality * (1 - 0.5 / epoch)
        return 0.3 + 0.5 * (1 - quality if early == "reversed" else noise) * (1 - 0.5 / epoch)

    def train(candidate):
        epochs = candidate.max_epochs
        curve = [{"epoch": e, "val_accuracy": value(candidate.genome_hash, e)} for e in range(1, epochs + 1)]
        return Outcome.ok(value(candidate.genome_hash, epochs), epochs=epochs, seconds=float(epochs), curve=curve)

    return train


def without_curve(early: str):
    """`objective(early)` reporting its last value alone, as an objective that returns its score does."""
    train = objective(early)
    return lambda candidate: dataclasses.replace(train(candidate), curve=None)


def pruned(**settings):
    return SearchConfig(**{"sampler": "ga", "population": 12, "generations": 3, "max_epochs": 9, "min_epochs": 1,
                           "prune_factor": 3, "remeasure": 0, "seed": 5, **settings})


def search(path, cfg, evaluate, **kw):
    with Store(path) as store:
        return run_search(cfg, SPACE, evaluate, store, TCH, **kw)


def trained(path) -> list[tuple[int, int]]:
    """(generation, epochs) of every training the store holds."""
    with Store(path) as store:
        return [(e.generation, e.max_epochs) for e in store.records.evaluations()]


def test_spearman_and_the_curve_read_at_a_rungs_epochs():
    assert spearman([(1, 10), (2, 20), (3, 30)]) == 1.0 and spearman([(1, 3), (2, 2), (3, 1)]) == -1.0
    assert spearman([(1, 1), (1, 2), (2, 3)]) == pytest.approx(0.8660254)  # a tie at its mean rank
    assert spearman([(1, 1)]) is None and spearman([(1, 1), (1, 2)]) is None  # one side constant: no verdict

    def row(curve, epochs=9):
        return Evaluation(1, "h", "t", {}, "ok", 0.5, None, None, epochs, 1.0, "w", None, 1, 0, 0, 0, "", 9, 0,
                          curve=curve)

    from_one = row([{"epoch": e, "loss": 1 / e} for e in range(1, 10)])
    from_zero = row([{"epoch": e, "loss": 1 / (e + 1)} for e in range(0, 9)])
    loss = Goal("loss", "minimize")
    assert curve_fitness(from_one, 3, loss) == curve_fitness(from_zero, 3, loss) == -1 / 3  # after 3 epochs
    assert curve_fitness(from_one, 3, Goal("accuracy")) is None  # no such metric
    steps = row([{"epoch": s, "loss": 1.0} for s in range(0, 900, 100)])
    assert curve_fitness(steps, 3, loss) is None  # numbered by steps: not read
    assert curve_fitness(row(None), 3, loss) is None


def test_a_rung_that_ranks_unlike_the_last_is_never_pruned_at_and_costs_what_an_unpruned_search_does(tmp_path):
    result = search(tmp_path / "p.db", pruned(), serial(objective("reversed")))
    unpruned = search(tmp_path / "u.db", pruned(min_epochs=None), serial(objective("reversed")))
    # every generation trains every member to the end, as the unpruned search does, and nothing more
    assert {epochs for _, epochs in trained(tmp_path / "p.db")} == {9}
    assert sorted(trained(tmp_path / "p.db")) == sorted(trained(tmp_path / "u.db"))
    assert [[(m.genome_hash, m.fitness) for m in g.members] for g in result.history] == \
        [[(m.genome_hash, m.fitness) for m in g.members] for g in unpruned.history]
    assert all(m.rung == 2 for g in result.history for m in g.members)
    shown = format_search(tmp_path / "p.db")
    assert "pruning, judged on its complete generations: rung 1 (1 epoch): rank correlation -1.00 over " in shown
    assert "rung 2 (3 epochs): rank correlation -1.00 over " in shown and "pruning\n" not in shown


def test_a_rung_that_ranks_like_the_last_is_pruned_at_from_the_second_generation(tmp_path):
    path = tmp_path / "s.db"
    result = search(path, pruned(), serial(objective("ranks")))
    assert Counter(trained(path))[0, 9] == 12 and {e for g, e in trained(path) if g == 0} == {9}  # unpruned first
    with Store(path) as store:
        rows = store.records.evaluations()
    fitness = {(e.genome_hash, e.max_epochs): e.fitness for e in rows}
    genomes = {e.genome_hash: e.genome for e in rows}
    for gen in result.history[1:]:  # successive halving at each rung, the held going on besides
        rung_of = {m.genome_hash: m.rung for m in gen.members}
        assert set(rung_of.values()) <= {0, 1, 2} and 0 in rung_of.values()
        for rung, (at, above) in enumerate([(1, 3), (3, 9)]):
            held = {e.genome_hash for e in rows if e.max_epochs == above and e.generation < gen.generation}
            here = sorted((h for h, r in rung_of.items() if r >= rung), key=lambda h: rank_key(genomes[h], fitness[h, at]))
            places = set(here[:math.ceil(len(here) / 3)])
            assert {e.genome_hash for e in rows if e.max_epochs == above and e.generation == gen.generation} == \
                places - held
            assert {h for h, r in rung_of.items() if r > rung} == places | (held & set(here))
    epochs = sum(e for _, e in trained(path))
    assert epochs < 3 * 12 * 9 * 0.6  # far fewer than an unpruned search's
    shown = format_search(path)
    assert "rung 1 (1 epoch): rank correlation 1.00 over " in shown and "rung 2 (3 epochs): rank correlation 1.00" in shown


def test_too_few_pairs_judge_nothing(tmp_path):
    """A first generation smaller than MIN_PAIRS leaves the second unpruned as well: it is judged on too few."""
    path = tmp_path / "s.db"
    search(path, pruned(population=MIN_PAIRS - 2, generations=2), serial(objective("ranks")))
    assert {epochs for _, epochs in trained(path)} == {9}


@pytest.mark.parametrize("early", ["ranks", "reversed"])
def test_rungs_no_curve_reaches_are_probed_then_judged_on_their_own_trainings(tmp_path, early):
    """Without curves, the second generation is probed: its members trained at every rung, all going on; the
    judge then reads its pairs from those trainings, and the third generation prunes where they rank and trains
    each member once where they do not. The plan counts the probing."""
    cfg = pruned(generations=3)
    path = tmp_path / "s.db"
    result = search(path, cfg, serial(without_curve(early)))
    epochs = Counter(trained(path))
    assert {e for g, e in epochs if g == 0} == {9}
    # the probe: every member at every rung (the GA's elite, holding the last from generation 0, below it)
    assert epochs[1, 1] == epochs[1, 3] == 12 and epochs[1, 9] >= MIN_PAIRS
    assert all(m.rung == 2 for m in result.history[1].members)
    with Store(path) as store:
        rows = [e for e in store.records.evaluations() if e.generation == 1]
        judged = Search.open(store, result.search_id).judgement(store)
    assert all(e.status == "ok" for e in rows)
    if early == "ranks":
        assert judged.used == [0, 1, 2] and not judged.probed
        assert epochs[2, 1] > epochs[2, 3] >= epochs[2, 9] and epochs[2, 1] + epochs[2, 9] < 12
    else:
        assert judged.used == [2] and [v.correlation for v in judged.verdicts] == [-1.0, -1.0]
        assert {e for g, e in epochs if g == 2} == {9}
    resolved = Search.resolve(cfg, SPACE)
    plan = planned_trainings(resolved.cfg, resolved.shape, probes=True)
    assert sum(e * n for (_, e), n in epochs.items()) <= plan["epochs"] - plan["test"] * cfg.max_epochs
    assert result.trainings <= plan["search"] + plan["rungs"] + plan["remeasure"]
    assert planned_trainings(resolved.cfg, resolved.shape)["epochs"] < plan["epochs"]


def test_probing_stops_once_min_pairs_genomes_were_tried_whatever_they_gave(tmp_path):
    """A rung whose trainings fail gives no pairs: it is probed until MIN_PAIRS genomes were trained there, then
    skipped (the search does not probe for ever), and the judgement says which it is. Rung 2, which nobody
    reached from the failed rung 1, is probed in the next generation."""
    base = without_curve("ranks")

    def failing_early(candidate):
        return Outcome.failed("out of memory") if candidate.max_epochs < 9 else base(candidate)

    path = tmp_path / "s.db"
    search(path, pruned(generations=4), serial(failing_early))
    epochs = Counter(trained(path))
    assert epochs[1, 1] >= MIN_PAIRS and epochs[1, 3] == 0  # nobody went on from a failed rung
    assert epochs[2, 1] == 0 and epochs[2, 3] >= MIN_PAIRS
    assert not any(e < 9 for g, e in epochs if g == 3)
    shown = format_search(path)
    assert f"rung 1 (1 epoch): 0 of the {MIN_PAIRS} genomes it takes to judge, skipped; " \
           f"rung 2 (3 epochs): 0 of the {MIN_PAIRS} genomes it takes to judge, skipped" in shown


def test_a_budget_in_epochs_charges_a_probed_generation_every_rung_its_members_train(tmp_path):
    """A probed generation's members each train every rung up to the first one pruned at or the last (13 epochs
    here, not the first rung's 1): --budget-epochs counts them so, and the search stops within one member of it."""
    cfg = pruned(sampler="random", population=MIN_PAIRS, generations=100, budget_epochs=300)
    path = tmp_path / "s.db"
    result = search(path, cfg, serial(without_curve("reversed")))
    epochs = Counter(trained(path))
    assert result.ended == "budget_epochs" and epochs[2, 1] == epochs[2, 3] > 0  # generation 2 probed
    assert 300 - 13 < sum(e * n for (_, e), n in epochs.items()) <= 300 + 13


def mixed_workers(seed: int):
    """An evaluator that emulates 3 workers finishing in a random order, asking for the work that unlocks
    after every result (as the queue's driver does)."""
    rng = random.Random(seed)
    train = objective("first-epoch-noise")

    def evaluate(candidates, record):
        queue, running = list(candidates), []
        while queue or running:
            while queue and len(running) < 3:
                running.append(queue.pop(0))
            c = running.pop(rng.randrange(len(running)))
            record(c, train(c))
            queue.extend(record.more())

    return evaluate


def test_the_judgement_is_the_same_on_a_replay_a_resume_and_whoever_trains_what(tmp_path):
    """Epoch 1 ranks nothing like the last, epoch 3 like it: from the second generation on, rung 1 is skipped
    and rung 2 pruned at; a replay from the store, a search killed mid-generation and resumed, and workers
    finishing in any order all store the same history and the same trainings."""
    cfg = pruned(generations=4)
    with Store(tmp_path / "ref.db") as store:
        reference = run_search(cfg, SPACE, serial(objective("first-epoch-noise")), store, TCH)
        judged = Search.open(store, reference.search_id).judgement(store)

        def nothing(candidates, record):
            raise AssertionError(f"a replay trained {candidates}")

        assert Search.open(store, reference.search_id).run(store, nothing) == reference
    assert judged is not None and judged.used == [1, 2]
    assert judged.verdicts[0].correlation < MIN_CORRELATION <= judged.verdicts[1].correlation
    epochs = Counter(trained(tmp_path / "ref.db"))
    assert {e for g, e in epochs if g == 0} == {9} and all((g, 1) not in epochs for g in range(4))
    assert all((g, 3) in epochs for g in range(1, 4))

    done = []

    def crashing(candidates, record):
        train = objective("first-epoch-noise")
        for c in candidates:
            if len(done) == 20:  # in the second generation
                raise KeyboardInterrupt
            done.append(c)
            record(c, train(c))

    with pytest.raises(KeyboardInterrupt):
        search(tmp_path / "crashed.db", cfg, crashing)
    assert done[-1].generation == 1
    assert search(tmp_path / "crashed.db", cfg, serial(objective("first-epoch-noise")),
                      resume=True) == reference
    for seed in range(2):
        assert search(tmp_path / f"w{seed}.db", cfg, mixed_workers(seed)) == reference

    def rows(path):
        with Store(path) as store:
            return sorted((e.generation, e.genome_hash, e.max_epochs, e.fitness, e.seed)
                          for e in store.records.evaluations())

    assert rows(tmp_path / "crashed.db") == rows(tmp_path / "w0.db") == rows(tmp_path / "w1.db") == \
        rows(tmp_path / "ref.db")


def test_a_generation_that_skips_its_first_rung_is_charged_its_first_trained_rung_under_a_budget(tmp_path):
    """--budget-epochs counts the first rungs a generation begins in the epochs of the first rung it trains:
    4 members of 9 epochs leave a budget of 60 room for 3 more, not 24 one-epoch first rungs."""
    path = tmp_path / "s.db"
    cfg = pruned(sampler="random", population=4, generations=100, budget_epochs=60)
    result = search(path, cfg, serial(objective("reversed")))
    assert result.ended == "budget_epochs" and [len(g.members) for g in result.history] == [4, 3]
    assert sum(e for _, e in trained(path)) == 63


@pytest.mark.parametrize("early", ["ranks", "reversed", "first-epoch-noise"])
def test_the_plan_is_an_upper_bound_whatever_the_judge_decides(tmp_path, early):
    cfg = pruned(generations=4)
    resolved = Search.resolve(cfg, SPACE)
    plan = planned_trainings(resolved.cfg, resolved.shape)
    result = search(tmp_path / "s.db", cfg, serial(objective(early)))
    assert sum(e for _, e in trained(tmp_path / "s.db")) <= plan["epochs"] - plan["test"] * cfg.max_epochs
    assert result.trainings <= plan["search"] + plan["rungs"] + plan["remeasure"]


def test_the_evidence_prefers_the_curve_and_falls_back_on_the_rungs_trainings():
    ladder, hashes, goal = [1, 3, 9], ["r0", "r1", "last"], Goal("val_accuracy")

    def row(h, rung, fitness, curve=None):
        return Evaluation(1, h, hashes[rung], {}, "ok", fitness, None, None, [1, 3, 9][rung], 1.0, "w", None, 1, 0, 0,
                          0, "", [1, 3, 9][rung], 0, curve=curve)

    evidence = Evidence(ladder, hashes, goal)
    genomes = [f"g{i}" for i in range(MIN_PAIRS)]
    # the curves rank rung 1 backwards; the rung-2 trainings (no curve reaches 3 epochs here) rank like the last
    evidence.add([row(h, 2, i / 10, [{"epoch": e, "val_accuracy": None if e == 3 else 1 - i / 10} for e in range(1, 10)])
                  for i, h in enumerate(genomes)])
    judged = evidence.judge()  # no curve reaches rung 2: it is probed (trained, every member going on)
    assert judged.used == [1, 2] and judged.probed == {1}
    assert "rung 2 (3 epochs): no learning curve reaches it, trained to see how it ranks (0 of the " in judged.text()
    evidence.add([row(h, 1, i / 20) for i, h in enumerate(genomes)])
    judged = evidence.judge()
    assert [v.correlation for v in judged.verdicts] == [-1.0, 1.0] and judged.used == [1, 2]
    assert judged.text() == (f"rung 1 (1 epoch): rank correlation -1.00 over {MIN_PAIRS} pairs, skipped; "
                             f"rung 2 (3 epochs): rank correlation 1.00 over {MIN_PAIRS} pairs, pruning")


def test_a_rung_that_tells_good_from_bad_but_not_the_best_from_the_good_is_skipped():
    """The lower half of the genomes (by their last rung) rank at rung 1 as at the last; the better half, which a
    promotion chooses among, in blocks of four turned round. Over every pair the rung ranks (0.97), over the better
    half not (0.79): once that half holds MIN_PAIRS pairs, the rung is skipped."""
    ladder, hashes, goal = [1, 9], ["r0", "last"], Goal("val_accuracy")

    def row(i, early):
        return Evaluation(1, f"g{i:02d}", "last", {}, "ok", i / 100, None, None, 9, 1.0, "w", None, 1, 0, 0, 0, "",
                          9, 0, curve=[{"epoch": e, "val_accuracy": early if e == 1 else None} for e in range(1, 10)])

    def judged(n):
        evidence = Evidence(ladder, hashes, goal)
        half = n // 2
        early = list(range(half)) + [half + 4 * (k // 4) + 3 - k % 4 for k in range(n - half)]  # blocks turned round
        evidence.add([row(i, e / 100) for i, e in enumerate(early)])
        return evidence.judge().verdicts[0]

    verdict = judged(3 * MIN_PAIRS)
    assert round(verdict.correlation, 2) == 0.97 and round(verdict.better, 2) == 0.79 and not verdict.used
    assert verdict.text() == (f"rung 1 (1 epoch): rank correlation 0.97 over {3 * MIN_PAIRS} pairs, 0.79 over their "
                              f"better half, skipped")
    assert verdict.to_json()["better_half_correlation"] == verdict.better
    # fewer pairs than that half needs: judged on them all, as before
    verdict = judged(2 * MIN_PAIRS - 2)
    assert verdict.better is None and verdict.correlation >= MIN_CORRELATION and verdict.used
    assert verdict.text().endswith(f"over {2 * MIN_PAIRS - 2} pairs, pruning")


def test_a_generation_begun_while_the_one_before_trains_is_budgeted_in_its_own_first_rung(tmp_path):
    """random proposes generation 3 while generation 2 trains: it is judged on generation 1 alone (complete by
    then), prunes at 1 epoch, and the 150 epochs less generation 1's 72 and generation 2's 72 in flight leave
    it 6 one-epoch first rungs."""
    path = tmp_path / "s.db"
    cfg = pruned(sampler="random", population=MIN_PAIRS, generations=100, budget_epochs=150)
    result = search(path, cfg, serial(objective("ranks")))
    assert result.ended == "budget_epochs" and [len(g.members) for g in result.history] == [8, 8, 6]
    assert Counter(trained(path)) == {(0, 9): 8, (1, 9): 8, (2, 1): 6, (2, 3): 2, (2, 9): 1}


def test_a_promotion_continues_its_lower_rung_and_a_budget_charges_its_epochs_once(tmp_path):
    """A promoted candidate starts from the epochs its genome trained at the rung below in this very generation
    (its seed's training: a held rung's was another), and a training that says it continued (`continued`) is
    charged the rest by --budget-epochs: the same budget trains more genomes than one that starts again."""
    base = objective("ranks")
    told: list[tuple[int, str, int, int]] = []

    def continuing(candidate):
        told.append((candidate.generation, candidate.genome_hash, candidate.max_epochs, candidate.starts))
        return dataclasses.replace(base(candidate), continued=candidate.starts)

    cfg = pruned(sampler="random", generations=100, budget_epochs=300)
    again = search(tmp_path / "again.db", cfg, serial(base))
    result = search(tmp_path / "on.db", cfg, serial(continuing))
    below = {}
    for generation, h, epochs, starts in told:
        assert starts == below.get((generation, h), 0)
        below[generation, h] = epochs
    assert sum(starts > 0 for *_, starts in told) >= 5
    with Store(tmp_path / "on.db") as store:
        rows = store.records.evaluations()
        assert store.records.epochs_given(1, 1000, 9) == sum(r.max_epochs - r.continued for r in rows)
    assert sum(r.continued for r in rows) == sum(starts for *_, starts in told)
    assert result.ended == again.ended == "budget_epochs"
    with Store(tmp_path / "again.db") as store:
        restarted = store.records.evaluations()
    assert sum(r.continued for r in restarted) == 0
    assert len({r.genome_hash for r in rows}) > len({r.genome_hash for r in restarted})
