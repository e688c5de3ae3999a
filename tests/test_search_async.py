"""A search without --population proposes asynchronously (issue 72): every worker that joined has a candidate
whenever the search has budget left, one worker's driver (the leader) makes each proposal once while the
others train, the history is the one its store records with what each proposal read, and nothing a
process would propose differently stops it. Fake fitness in process (Worker threads), and one search from
the command line on 4 workers."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time

import pytest

from towerlab.config import SearchConfig
from towerlab.search import Outcome, Search, Store, load_space, run_search, serial
from towerlab.search.history import Generation, GenerationStats, Member
from towerlab.search.samplers import InFlight
from towerlab.search.samplers.random import RandomSampler
from towerlab.search.work.worker import Worker, WorkerOptions
from util import Ahead, Stopped, run_cli

pytest.importorskip("optuna")
pytest.importorskip("scipy")

SPACE = load_space(json.dumps({"model": "objective", "genes": {"x": {"low": 0.0, "high": 1.0},
                                                                "y": {"low": 0.0, "high": 1.0}}}))
TCH = "async-train-config"


def bowl(candidate) -> Outcome:
    g = candidate.genome
    return Outcome.ok(1 - (g["x"] - 0.3) ** 2 - (g["y"] - 0.7) ** 2, epochs=1, seconds=0.01)


def trainer(search):
    def train(assignment):
        time.sleep(0.02 + 0.03 * (assignment.candidate.seed % 3))  # results come back out of order
        return bowl(assignment.candidate)
    return train


def workers(path, search_id, names, train=trainer, **options):
    """Worker threads on the search until it is finished (training as `train` makes their objective): the
    workers, once joined."""
    made = [Worker(Store(path), name, "cpu", train, WorkerOptions(search_ids=[search_id], lease=30.0, **options))
            for name in names]
    threads = [threading.Thread(target=w.run) for w in made]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not any(t.is_alive() for t in threads)
    return made


def created(path, cfg):
    with Store(path) as store:
        return Search.resolve(cfg, SPACE).create(store, TCH, {"test": False})


def history_of(store, search_id):
    """Each stored generation's members, results and what it was proposed from."""
    return [(g.generation, [m["genome"] for m in g.members], g.final_results, g.proposed)
            for g in store.records.generations(search_id)]


def test_a_budget_alone_runs_the_default_search_one_candidate_a_generation(tmp_path):
    """--max-evaluations 24 with the default sampler: no --generations needed (it was refused: "more than 20
    generations of 1 can train"), and in one process (no workers) each proposal knows every outcome."""
    search = Search.resolve(SearchConfig(max_evaluations=24, remeasure=0, top=2, seed=1), SPACE)
    assert search.asynchronous and search.cfg.generations == 24 and search.shape.population == 1
    with Store(tmp_path / "s.db") as store:
        result = run_search(search.cfg, SPACE, serial(bowl), store, TCH)
        assert result.evaluations == 24 and result.ended == "max_evaluations"
        assert all(g.proposed["in_flight"] == [] for g in store.records.generations(result.search_id))
    assert not Search.resolve(SearchConfig(population=1, generations=3), SPACE).asynchronous  # generations of 1


def test_two_workers_propose_once_each_generation_and_every_proposal_is_its_inputs_again(tmp_path, monkeypatch):
    """Two workers on one search: one leads and proposes, each proposal once (they were proposed by every
    worker's driver, twice), and re-proposing any generation from the inputs it recorded (the outcomes
    told then, the genomes then in flight) gives its members again: the history is exact."""
    from towerlab.search.samplers.gp import GPSampler

    calls = []
    propose = GPSampler.propose
    monkeypatch.setattr(GPSampler, "propose", lambda self, *a, **k: calls.append(1) or propose(self, *a, **k))
    cfg = SearchConfig(max_evaluations=18, remeasure=0, top=2, seed=5)
    search = created(tmp_path / "s.db", cfg)
    made = workers(tmp_path / "s.db", search.id, ["w0", "w1"])
    with Store(tmp_path / "s.db") as store:
        stored = history_of(store, search.id)
        assert store.records.search(search.id).finished is not None
    assert len(stored) == 18 == len(calls) and sum(w.trained for w in made) == 18
    assert {p["by"] for _, _, _, p in stored} <= {"w0", "w1"}
    assert max(len(p["in_flight"]) for _, _, _, p in stored) >= 2  # proposed while others trained
    sampler = Search.resolve(cfg, SPACE).new_sampler()
    members = {g: [Member(**m, score=m["fitness"]) for m in results] for g, _, results, _ in stored}
    for g, genomes, _, proposed in stored[10:]:  # the model's proposals
        told = [Generation(n, tuple(members[n]), GenerationStats(n, 1, 1, 0, 0, None, None, None, 0.0))
                for n in range(g) if n not in proposed["in_flight"]]
        flying = InFlight(tuple(genomes_ for n in proposed["in_flight"] for genomes_ in stored[n][1]),
                          len(proposed["in_flight"]), len(proposed["in_flight"]))
        again = sampler.propose_quickly if proposed["quickly"] else sampler.propose
        assert again(told, flying if proposed["in_flight"] else None) == genomes


def last_two_wait(waited: list, timeout: float):
    """A trainer of 8 trainings whose last two (generations 6 and 7) end once a re-measure was trained, or
    after `timeout` s: whether each saw one, in `waited`."""
    remeasured = threading.Event()

    def last_wait(search):
        def train(assignment):
            c = assignment.candidate
            if c.replicate:
                remeasured.set()
            elif c.generation >= 6:
                waited.append(remeasured.wait(timeout=timeout))
            return bowl(c)
        return train
    return last_wait


def test_under_a_budget_in_epochs_idle_workers_re_measure_only_the_certain_top(tmp_path):
    """--budget-epochs counts every re-measure, so a network that a last training may still push out of the
    top is not re-measured ahead (its re-measures would pass the budget): while the last two trainings run,
    no re-measure is trained, though a worker is idle."""
    cfg = SearchConfig(sampler="random", budget_epochs=10, max_epochs=1, remeasure=1, top=2, seed=3)
    waited: list[bool] = []
    search = created(tmp_path / "s.db", cfg)
    workers(tmp_path / "s.db", search.id, ["w0", "w1", "w2"], last_two_wait(waited, 3))
    with Store(tmp_path / "s.db") as store:
        rows = store.records.evaluations(search.id)
    # the first of the two to end saw none (the other may: with one training left, the best is certain)
    assert sum(r.replicate == 0 for r in rows) == 8 and len(waited) == 2 and waited[0] is False
    assert sum(r.max_epochs or 1 for r in rows) <= 10


def test_idle_workers_re_measure_the_likely_top_while_the_last_trainings_run(tmp_path):
    """Once the budget is spent, a worker that frees up re-measures a network likely to be crowned while the
    search's last two trainings still run, though either may push it out of the top 2 (only networks certain
    to stay were re-measured ahead: none while two trainings ran, so crowning waited for both, and on 32
    workers, a round of 31 idle ones did too). The search's rows and its crowned top are those of the same
    search played in one process, which waited; a network pushed out keeps its re-measure as a row of its own."""
    cfg = SearchConfig(sampler="random", max_evaluations=8, remeasure=1, top=2, seed=3)
    waited: list[bool] = []
    search = created(tmp_path / "s.db", cfg)
    workers(tmp_path / "s.db", search.id, ["w0", "w1", "w2"], last_two_wait(waited, 20))
    assert waited == [True, True]

    def nothing(candidates, record):
        raise AssertionError(f"the replay trained {candidates}")

    def rows_and_top(path, search_id):
        with Store(path) as store:
            rows = sorted((r.genome_hash, r.replicate, r.generation, r.index, r.seed, r.fitness)
                          for r in store.records.evaluations(search_id))
            top = [(t.genome_hash, t.fitness, t.fitnesses, t.seeds) for t in Search.open(store, search_id).play(
                store, nothing).top]
        return [r for r in rows if r[1] == 0], [r for r in rows if r[1] > 0], top
    with Store(tmp_path / "alone.db") as store:
        alone = run_search(search.cfg, SPACE, serial(bowl), store, TCH)
    searched, remeasures, top = rows_and_top(tmp_path / "s.db", search.id)
    alone_searched, alone_remeasures, alone_top = rows_and_top(tmp_path / "alone.db", alone.search_id)
    assert searched == alone_searched and len(searched) == 8 and top == alone_top and len(top) == 2
    assert len(alone_remeasures) == 2 and set(alone_remeasures) <= set(remeasures)  # the top 2, re-measured once
    assert {r[0] for r in remeasures} >= {t[0] for t in top}


def queued(trainer: Ahead) -> list[tuple[str, int]]:
    return [(c.genome_hash, c.replicate) for c in trainer.queued]


def test_crown_ahead_queues_the_certain_top_then_the_likely_one_for_idle_workers_alone():
    """With 3 trainings in flight and the top 2 to crown, no network is certain (each may be pushed out): an
    idle worker gets the best's first re-measure, and so on best first, one task a worker, each once; once
    a single training is in flight, the best is certain and all of its re-measures go on, idle or not."""
    from towerlab.search.crowning import Crowning
    from towerlab.search.pruners import Ladder, make_pruner

    ladder = Ladder(make_pruner(SearchConfig(max_epochs=1)), "tch")
    trainer = Ahead()
    crowning = Crowning(2, ladder, lambda candidates, what: {}, trainer)
    members = tuple(Member(i, {"x": i / 10}, f"a{i}", "ok", f, None, 1, 1.0, i, "evaluated", score=f)
                    for i, f in enumerate([0.5, 0.9, 0.7, 0.1]))
    told = [Generation(0, members, GenerationStats(0, 4, 4, 0, 0, 0.9, 0.55, 0.1, 4.0))]
    crowning.crown_ahead(told, 2, 3, 5)
    assert queued(trainer) == []  # nothing certain, no idle worker
    crowning.crown_ahead(told, 2, 3, 5, idle=3)
    assert queued(trainer) == [("a1", 1), ("a1", 2), ("a2", 1)]
    crowning.crown_ahead(told, 2, 3, 5, idle=1)
    assert queued(trainer)[3:] == [("a2", 2)]
    crowning.crown_ahead(told, 2, 1, 5, idle=4)
    assert len(queued(trainer)) == 4  # each once

    fresh = Ahead()
    Crowning(2, ladder, lambda candidates, what: {}, fresh).crown_ahead(told, 2, 1, 5)
    assert queued(fresh) == [("a1", 1), ("a1", 2)]  # certain: the best stays in the top 2 whatever one training gives


class Restless(RandomSampler):
    """A sampler that proposes otherwise in every process that plays the search (as two thread counts' numerics
    did at the 85th generation of a search of LCBench): its genomes carry the number of its instance."""

    made = 0

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        Restless.made += 1
        self.instance = Restless.made

    def propose(self, history, in_flight=None):
        return [{**g, "x": round(g["x"], 3) + self.instance * 1e-6} for g in super().propose(history, in_flight)]


def test_a_process_that_would_propose_otherwise_never_stops_the_search(tmp_path, monkeypatch):
    """Every driver replayed every proposal and stopped the search where one differed ("other members for
    generation 85 than it recorded"); the job's record did too. Now a recorded generation is read, never
    proposed again: two workers and the record's replay, each of whose samplers would propose otherwise,
    end the search and read its one history."""
    from towerlab.search import SAMPLERS

    monkeypatch.setitem(SAMPLERS, "restless", "test_search_async:Restless")
    cfg = SearchConfig(sampler="restless", population=2, generations=6, remeasure=0, top=2, seed=2)
    search = created(tmp_path / "s.db", cfg)
    workers(tmp_path / "s.db", search.id, ["w0", "w1"])
    with Store(tmp_path / "s.db") as store:
        stored = [[m["genome"] for m in g.members] for g in store.records.generations(search.id)]
        assert store.records.search(search.id).finished is not None and len(stored) == 6

        def nothing(candidates, record):
            raise AssertionError(f"the record's replay trained {candidates}")

        played = Search.open(store, search.id).play(store, nothing)
    assert [[m.genome for m in g.members] for g in played.history] == stored


def test_a_generation_recorded_by_a_process_that_stopped_before_queueing_it_goes_on_the_queue_on_resume(
        tmp_path, monkeypatch):
    """The process that plays the search stops between recording a generation and putting its training on the
    queue: whoever plays the search next queues it as it reads the generation back (workers would otherwise wait
    for a training nobody was given)."""
    from towerlab.search.rounds import Rounds

    search = created(tmp_path / "s.db", SearchConfig(sampler="random", max_evaluations=20, remeasure=0, top=2, seed=3))
    queueing = Rounds.prefetch

    def stopping(rounds, generation):
        if generation == 12:
            raise Stopped
        queueing(rounds, generation)

    with Store(tmp_path / "s.db") as store:
        monkeypatch.setattr(Rounds, "prefetch", stopping)
        with pytest.raises(Stopped):
            search.run(store, serial(bowl))
        monkeypatch.setattr(Rounds, "prefetch", queueing)
        assert [g.generation for g in store.records.generations(search.id) if not g.complete] == [12]

        class Resumed(Ahead):  # queues what it is handed ahead, and stops the search at its first wait
            def __call__(self, candidates, record):
                raise Stopped

        resumed = Resumed()
        with pytest.raises(Stopped):
            Search.open(store, search.id).run(store, resumed)
    assert [(c.generation, c.index) for c in resumed.queued] == [(12, 0)]


def test_a_worker_waiting_for_a_proposal_gets_the_model_s_where_trainings_are_long(tmp_path):
    """The leader weighs a proposal against a training's length, as its search tells the outcomes: trainings of
    ten minutes (as recorded) leave time for the Gaussian process's proposal, so an idle worker gets it, not a
    quick one. The pacer never learnt the lengths of an asynchronous search's trainings, and gave every idle
    worker TPE's quick proposal: on LCBench with 8 workers, 19 of the first 48 proposals."""
    def ten_minutes(search):
        def train(assignment):
            time.sleep(0.02 + 0.03 * (assignment.candidate.seed % 3))
            outcome = bowl(assignment.candidate)
            return Outcome.ok(outcome.fitness, epochs=1, seconds=600.0)
        return train

    search = created(tmp_path / "s.db", SearchConfig(max_evaluations=16, remeasure=0, top=2, seed=6))
    workers(tmp_path / "s.db", search.id, ["w0", "w1", "w2"], ten_minutes)
    with Store(tmp_path / "s.db") as store:
        modelled = [g.proposed for g in store.records.generations(search.id) if g.generation >= 10]
    assert len(modelled) == 6
    assert any(p["workers"]["idle"] > p["waiting"] for p in modelled)  # a worker waited for each of these
    assert not any(p["quickly"] for p in modelled)


@pytest.mark.parametrize("seconds, names, after", [(0.001, ["w0", "w1", "w2"], 12), (0.02, ["w0", "w1"], 0)])
def test_trainings_shorter_than_a_proposal_get_the_model_s_proposals_not_quick_ones(tmp_path, seconds, names, after):
    """Trainings of a millisecond (as recorded: a surrogate's query) keep no worker busy whatever proposes: once
    the leader knows a training and a proposal, every candidate is the Gaussian process's, not TPE's quick one
    (which took 137 of 150 proposals a run of rbv2_xgboost on 2 workers, and the search's budget with them).
    Trainings of 20 ms (LCBench's surrogate through a function objective) are longer than a start-up draw
    (milliseconds) and shorter than the model's proposal: the leader took the draws' time for the model's,
    made every later proposal quickly, and never learnt the model's (a quick proposal tells nothing of it):
    TPE proposed every candidate of LCBench's runs on 2 workers. Now the start-up's draws are not counted,
    and the model proposes once before its time is known: no proposal is quick."""
    def short(search):
        def train(assignment):
            time.sleep(0.005)
            return Outcome.ok(bowl(assignment.candidate).fitness, epochs=1, seconds=seconds)
        return train

    search = created(tmp_path / "s.db", SearchConfig(max_evaluations=24, remeasure=0, top=2, seed=8))
    workers(tmp_path / "s.db", search.id, names, short)
    with Store(tmp_path / "s.db") as store:
        proposed = [g.proposed for g in store.records.generations(search.id)]
    assert len(proposed) == 24
    assert not any(p["quickly"] for p in proposed[after:])


def test_trainings_shorter_than_a_proposal_keep_at_most_one_spare_a_worker(tmp_path):
    """Trainings of 10 ms (as recorded) finish by the dozen while one proposal is made and noticed: the leader
    keeps one spare candidate a worker ready, not the dozens that would be proposed from ever fewer outcomes."""
    search = created(tmp_path / "s.db", SearchConfig(sampler="random", max_evaluations=30, remeasure=0, top=2, seed=7))
    workers(tmp_path / "s.db", search.id, ["w0", "w1"])
    with Store(tmp_path / "s.db") as store:
        paced = [g.proposed for g in store.records.generations(search.id)][1:]  # the first knows no training
    assert all(p["spare"] <= max(1, p["workers"]["busy"] + p["workers"]["idle"]) for p in paced)
    assert max(p["spare"] for p in paced) == 2


def test_the_model_proposes_only_while_enough_candidates_wait_for_the_workers_that_free_up_meanwhile():
    """On 32 workers of trainings of 3 s, the model's proposal takes 0.4 s: 6 workers finish meanwhile (32 x
    0.65 / 3, with the leader's look). With 2 candidates waiting and no worker idle, the model proposed, and 4
    of them waited for it (more than half the trainings started a third of a second late); now the next is
    proposed quickly until 6 wait. On 4 workers none frees up meanwhile: quick only for an idle worker, as
    before; and never where a proposal is short beside a training."""
    from types import SimpleNamespace

    from towerlab.search.work.driver import QueueTrainer

    def leader(busy, idle, waiting, training, proposal=0.4):
        queue = SimpleNamespace(pace=lambda search_id, within: (busy, idle, waiting))
        driver = SimpleNamespace(wake=threading.Event(), stopping=threading.Event(), lost=threading.Event(),
                                 lease=30.0, worker="w0")
        trainer = QueueTrainer(SimpleNamespace(queue=queue), SimpleNamespace(id=1), lambda c: 0.0, driver)
        trainer.trained([training] * 5)
        trainer.proposed(proposal)
        return trainer.pace()

    assert leader(32, 0, 2, 3.0).quickly and leader(32, 0, 5, 3.0).quickly
    assert not leader(32, 0, 6, 3.0).quickly
    assert not leader(4, 0, 0, 3.0).quickly and leader(3, 1, 0, 3.0).quickly
    assert not leader(32, 4, 0, 600.0).quickly


def test_a_worker_that_joins_trains_at_once_and_proposes_nothing_while_another_leads(tmp_path):
    """A worker joining a search in progress claims a task without replaying its history (its driver stands
    by while another leads: it replayed every generation first, 50 to 115 s at 100,000 trainings)."""
    cfg = SearchConfig(sampler="random", max_evaluations=60, remeasure=0, top=2, seed=3)
    search = created(tmp_path / "s.db", cfg)
    first = Worker(Store(tmp_path / "s.db"), "first", "cpu", trainer, WorkerOptions(search_ids=[search.id], lease=30.0))
    leading = threading.Thread(target=first.run)
    leading.start()
    with Store(tmp_path / "s.db") as store:
        while len(store.records.generations(search.id)) < 20 and leading.is_alive():
            time.sleep(0.05)
    late = workers(tmp_path / "s.db", search.id, ["late"])[0]
    leading.join(timeout=300)
    with Store(tmp_path / "s.db") as store:
        proposers = {g.proposed["by"] for g in store.records.generations(search.id)}
    assert late.trained > 0 and proposers == {"first"}


def test_the_lead_passes_to_another_worker_when_its_leader_stops(tmp_path):
    """The leader's worker leaves mid-search (its driver steps down): the other worker takes the lead from
    what the store holds and the search ends with every generation recorded once."""
    cfg = SearchConfig(sampler="random", max_evaluations=40, remeasure=0, top=2, seed=4)
    search = created(tmp_path / "s.db", cfg)
    stop = threading.Event()

    def leave():
        if stop.is_set():
            raise KeyboardInterrupt

    quitter = Worker(Store(tmp_path / "s.db"), "quitter", "cpu", trainer,
                     WorkerOptions(search_ids=[search.id], lease=30.0, check_stop=leave))

    def run_until_stopped():
        with pytest.raises(KeyboardInterrupt):
            quitter.run()

    gone = threading.Thread(target=run_until_stopped)
    gone.start()
    with Store(tmp_path / "s.db") as store:
        while store.queue.leader(search.id) != "quitter":
            time.sleep(0.02)
        stayer = threading.Thread(target=workers, args=(tmp_path / "s.db", search.id, ["stayer"]))
        stayer.start()
        while len(store.records.generations(search.id)) < 10:
            time.sleep(0.02)
        stop.set()
        gone.join(timeout=60)
        stayer.join(timeout=300)
        generations = store.records.generations(search.id)
        assert store.records.search(search.id).finished is not None
    assert [g.generation for g in generations] == list(range(40))
    assert {g.proposed["by"] for g in generations if g.proposed} == {"quitter", "stayer"}


FUNCTION = '''import os, time
from pathlib import Path

HERE = Path(os.environ["BARRIER"])


def f(x, y, seed):
    """The first four trainings wait for one another (at most 60 s): each returns how many ran at once."""
    HERE.mkdir(exist_ok=True)
    (HERE / f"run-{seed}").touch()
    started = len(list(HERE.glob("start-*")))
    (HERE / f"start-{seed}").touch()
    deadline = time.monotonic() + 60
    while started < 4 and len(list(HERE.glob("run-*"))) < 4 and time.monotonic() < deadline:
        time.sleep(0.02)
    running = len(list(HERE.glob("run-*")))
    time.sleep(0.2)
    (HERE / f"run-{seed}").unlink()
    return {"value": -(x - 0.3) ** 2 - (y - 0.7) ** 2, "running": running}
'''


@pytest.mark.slow
def test_a_default_search_on_four_workers_trains_four_at_once(tmp_path):
    """The default sampler on 4 workers (`search run --devices 4`, a budget alone) has 4 trainings in flight
    (it had 2, whatever the number of workers), and `search show` says the workers' state."""
    (tmp_path / "f.py").write_text(FUNCTION)
    (tmp_path / "s.toml").write_text('[genes]\nx = {low = 0.0, high = 1.0}\ny = {low = 0.0, high = 1.0}\n')
    done = run_cli("search", "run", "--objective", "f.py:f", "--space", "s.toml", "--metric", "value",
                   "--devices", "4", "--max-evaluations", "12", "--remeasure", "0", "--no-progress",
                   "--out", str(tmp_path / "out"), cwd=tmp_path, env={"BARRIER": str(tmp_path / "barrier")})
    assert done.returncode == 0, done.stderr
    with Store(tmp_path / "out" / "search.db") as store:
        rows = store.records.evaluations(1)
        generations = store.records.generations(1)
    assert len(rows) == 12 and max(r.metrics["running"] for r in rows) == 4
    assert [g.proposed["in_flight"] for g in generations[:4]] == [[], [0], [0, 1], [0, 1, 2]]  # the start-up, at once
    shown = run_cli("search", "show", str(tmp_path / "out"))
    assert shown.returncode == 0 and "auto (chose gp" in shown.stdout


def test_a_refused_command_line_imports_no_optuna():
    """A setting refused in one line is refused before Optuna (and SciPy through it) is imported: that took
    2.3 s of CPU, 9.6 s on a busy machine."""
    code = ("import sys\nfrom towerlab.cli import main\n"
            "status = main(['search', 'run', '--sampler', 'gp', '--population', '1', '--generations', '2',"
            " '--max-evaluations', '5'])\n"
            "print(status, 'optuna' in sys.modules, 'scipy' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.stdout.split() == ["2", "False", "False"], done.stdout + done.stderr
    assert "--max-evaluations 5 is more than 2 generations of 1 can train" in done.stderr
