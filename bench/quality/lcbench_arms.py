"""The methods bench/quality/lcbench.py compares on LCBench, each an arm `run(surrogate, seed, ledger)` that
searches until the ledger's epochs are spent (BudgetSpent) and returns what it measured of itself:
`sampler_seconds`, the CPU seconds its proposing took (asking and telling; for towerlab's arms the
whole search engine's, its SQLite store included).

The anchors ask one trial at a time and train it before the next is asked, as the anchors' own
defaults do. towerlab's arms drive towerlab's search core in this process (`towerlab_arm`): a
`Search` resolved from a `SearchConfig` and played with a `serial` trainer over an SQLite store in a
temporary folder: one worker, so that each candidate is proposed with nothing in flight, knowing every
outcome before it, as the anchors' are. An asynchronous search's history (the default's, and a pruned
one's without --population) depends on what was in flight at each proposal: on its workers it is
another history than this one, which `towerlab_api_arm` plays as a user runs it. A search in
generations (--population) is asked for each generation while the one before is in flight whoever
trains them (towerlab.search.samplers): its history is the same here as on 1 worker or on 100.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Any, Callable

from bench.quality.lcbench_problem import FULL, GENES, SPACE, BudgetSpent, Ledger, Surrogate

Arm = Callable[[Surrogate, int, Ledger], dict]


def _optuna() -> Any:
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    return optuna


def distributions() -> dict:
    optuna = _optuna()
    out: dict[str, Any] = {}
    for name, g in GENES.items():
        if isinstance(g["low"], int):
            out[name] = optuna.distributions.IntDistribution(g["low"], g["high"], log=g.get("log", False))
        else:
            out[name] = optuna.distributions.FloatDistribution(g["low"], g["high"], log=g.get("log", False))
    return out


class _Clock:
    """CPU seconds spent inside `with clock:` blocks."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def __enter__(self) -> None:
        self._start = time.process_time()

    def __exit__(self, *exc: object) -> None:
        self.seconds += time.process_time() - self._start


def optuna_full(make_sampler: Callable[[Any, int], Any]) -> Arm:
    """An Optuna sampler at full fidelity: ask one trial, train it 52 epochs, tell, until the budget."""

    def run(surrogate: Surrogate, seed: int, ledger: Ledger) -> dict:
        optuna, clock, space = _optuna(), _Clock(), distributions()
        study = optuna.create_study(direction="maximize", sampler=make_sampler(optuna, seed))
        try:
            while True:
                with clock:
                    trial = study.ask(space)
                accuracy = ledger.train(surrogate, trial.params, FULL)
                with clock:
                    study.tell(trial, accuracy)
        except BudgetSpent:
            return {"sampler_seconds": clock.seconds}

    return run


def optuna_pruned(make_pruner: Callable[[Any], Any]) -> Arm:
    """Optuna's TPE with a pruner: each trial reports its accuracy after every epoch and stops where the
    pruner says; it is charged the epochs it trained."""

    def run(surrogate: Surrogate, seed: int, ledger: Ledger) -> dict:
        optuna, clock, space = _optuna(), _Clock(), distributions()
        study = optuna.create_study(direction="maximize", sampler=optuna.samplers.TPESampler(seed=seed),
                                    pruner=make_pruner(optuna))
        pruned = 0
        try:
            while True:
                with clock:
                    trial = study.ask(space)
                curve = surrogate.curve(trial.params)
                for epoch in range(1, FULL + 1):
                    ledger.charge(1)
                    with clock:
                        trial.report(float(curve[epoch - 1]), epoch)
                        stop = epoch < FULL and trial.should_prune()
                    if stop:
                        pruned += 1
                        ledger.trainings += 1
                        with clock:
                            study.tell(trial, state=optuna.trial.TrialState.PRUNED)
                        break
                else:
                    ledger.full_trained(float(curve[-1]))
                    with clock:
                        study.tell(trial, float(curve[-1]))
        except BudgetSpent:
            return {"sampler_seconds": clock.seconds, "pruned": pruned}

    return run


def dehb(surrogate: Surrogate, seed: int, ledger: Ledger) -> dict:
    """DEHB (min fidelity 1, max 52, eta 3) through its ask and tell, one job at a time; a job's
    fidelity is rounded to whole epochs (52/3^k: 2, 6, 17, 52), and each is a training from scratch."""
    import ConfigSpace as CS
    from dehb import DEHB

    cs = CS.ConfigurationSpace(seed=seed)
    for name, g in GENES.items():
        kind = CS.UniformIntegerHyperparameter if isinstance(g["low"], int) else CS.UniformFloatHyperparameter
        cs.add_hyperparameter(kind(name, g["low"], g["high"], log=g.get("log", False)))
    clock = _Clock()
    with tempfile.TemporaryDirectory() as out:
        with clock:
            optimizer = DEHB(cs=cs, dimensions=len(GENES), min_fidelity=1, max_fidelity=FULL, eta=3, n_workers=1,
                             seed=seed, output_path=out, save_freq="end", log_level="ERROR")
        try:
            while True:
                with clock:
                    job = optimizer.ask()
                config = {name: job["config"][name] for name in GENES}
                epochs = max(1, round(job["fidelity"]))
                accuracy = ledger.train(surrogate, config, epochs)
                with clock:
                    optimizer.tell(job, {"fitness": -accuracy, "cost": epochs})
        except BudgetSpent:
            return {"sampler_seconds": clock.seconds}


def towerlab_arm(settings: dict, gp: dict | None = None) -> Arm:
    """towerlab's search with `settings` (SearchConfig's fields and its sampler's own; the rest at their
    defaults), its candidates trained by the surrogate: `fitness(candidate)` trains the candidate's
    epochs (a pruned rung's, else the full 52; a promotion continues from its lower rung's, as
    `candidate.starts` says, and is charged the rest), charged to the ledger, which ends the search when the
    budget is spent (as --budget-epochs will). One function, so that once a user's objective can enter
    a search it is `towerlab.api.search(objective=..., budget_epochs=...)` over the real workers.
    `gp`: constants of towerlab.search.samplers.gp set for the run (an earlier default's: STARTUP, the random
    trials before the model proposes; RELAXED, the int ranges the Gaussian process takes as float ones)."""
    from towerlab.config import SearchConfig
    from towerlab.search import Candidate, Outcome, Search, serial
    from towerlab.search.store import Store

    def run(surrogate: Surrogate, seed: int, ledger: Ledger) -> dict:
        from towerlab.search.samplers import gp as module

        before = {name: getattr(module, name) for name in gp or {}}
        vars(module).update(gp or {})
        try:
            return _play(settings, surrogate, seed, ledger)
        finally:
            vars(module).update(before)

    def _play(settings: dict, surrogate: Surrogate, seed: int, ledger: Ledger) -> dict:
        def fitness(candidate: Candidate) -> Outcome:
            epochs = candidate.max_epochs or FULL
            with training:
                try:
                    accuracy = ledger.train(surrogate, candidate.genome, epochs, candidate.starts)
                except Exception as e:  # the surrogate never fails a training: the bench's own bug
                    raise SurrogateFailed(f"{type(e).__name__}: {e}") from e
            # its learning curve, as towerlab's own training reports one: what a pruned search's judge reads
            curve = [{"epoch": e + 1, search.goal.metric: float(v) / 100}
                     for e, v in enumerate(surrogate.curve(candidate.genome)[:epochs])]
            return Outcome.ok(fitness=accuracy / 100, epochs=epochs, curve=curve, continued=candidate.starts)

        training, started = _Clock(), time.process_time()
        cfg = SearchConfig(**{"max_epochs": FULL, "generations": 10_000, "seed": seed, "budget_epochs": ledger.budget,
                              **settings})
        search = Search.resolve(cfg, SPACE)
        with tempfile.TemporaryDirectory() as folder, Store(Path(folder) / "search.db") as store:
            stored = search.create(store, f"lcbench-{surrogate.task}")
            try:
                stored.run(store, serial(fitness))
            except BudgetSpent:
                pass
            genomes = [r.genome for r in sorted(store.records.evaluations(stored.id), key=lambda r: (r.generation, r.index))
                       if r.replicate == 0]
        return {"sampler_seconds": time.process_time() - started - training.seconds, "genomes": genomes,
                "resolved": {k: v for k, v in vars(search.cfg).items() if k in ("sampler", "population", "settings")}}

    return run


def towerlab_api_arm(settings: dict) -> Arm:
    """towerlab's search run as a user runs it: `towerlab.api.search(GENES, objective=...,
    budget_epochs=..., max_epochs=52, seed=..., generations=10_000)`, every other setting at its
    default, on its default workers (2 CPU processes here, forked, each playing the search through
    the store). The objective is the surrogate queried at the `epochs` the search gives it, continuing a
    promotion from `start` (it reports the epochs after it).
    --generations is the only setting raised: its default (10) would end the search long before
    the budget. The trace is read back from the store: every row in the order it finished, charged
    the epochs it was given less those it continued."""

    def run(surrogate: Surrogate, seed: int, ledger: Ledger) -> dict:
        from towerlab import api
        from towerlab.search.store import Store

        def objective(epochs: int, start: int, report: Callable[..., None], **genes: Any) -> float:  # runs in the
            # workers, forked with the surrogate; a promotion continues its lower rung's training from `start`
            for epoch, value in enumerate(surrogate.curve(genes)[:epochs], 1):
                if epoch > start:
                    report(epoch, value=float(value) / 100)
            return surrogate.at(genes, epochs) / 100

        started = time.time()
        with tempfile.TemporaryDirectory() as folder:
            found = api.search(GENES, objective=objective, budget_epochs=ledger.budget, max_epochs=FULL, seed=seed,
                               generations=10_000, out=str(Path(folder) / "search"), progress=False,
                               **settings)
            with Store(found.out) as store:
                rows = store.records.evaluations()
        for row in rows:
            ledger.spent += (row.max_epochs or FULL) - row.continued
            ledger.trainings += 1
            if (row.max_epochs or FULL) == FULL and row.status == "ok" and row.fitness is not None:
                ledger.trace.append((ledger.spent, 100 * row.fitness))
        members = sorted((r.generation, r.index, r.genome) for r in rows if r.replicate == 0)
        return {"sampler_seconds": None, "search_wall_seconds": time.time() - started,
                "workers": found.config["run"].get("devices"), "genomes": [g for *_, g in members],
                "resolved": {k: found.config["search"].get(k) for k in ("sampler", "population")}}

    return run


def anchor(method: str) -> Arm:
    """An anchor of bench/quality/anchors.py (SMAC3's facades: "smac-hpo", "smac-bb"; "hebo") on the LCBench space,
    asked one trial at a time, each trained 52 epochs, as many as the budget holds (100). Run from
    .venv-anchors (docs/benchmarks.md): SMAC3 needs ConfigSpace 1.x, HEBO numpy < 1.25."""

    def run(surrogate: Surrogate, seed: int, ledger: Ledger) -> dict:
        from bench.quality import anchors

        def evaluate(config: dict) -> float:
            return ledger.train(surrogate, config, FULL)

        trials = ledger.budget // FULL
        if method == "hebo":
            return anchors.hebo_run(SPACE, evaluate, trials, seed)
        return anchors.smac_run(SPACE, method.removeprefix("smac-"), evaluate, trials, seed)

    return run


class SurrogateFailed(BaseException):
    """A query of the surrogate raised: it stops the run (towerlab's serial trainer would record an
    Exception as a failed candidate and go on)."""


def _tpe(optuna: Any, seed: int) -> Any:
    return optuna.samplers.TPESampler(seed=seed)


def _gp(optuna: Any, seed: int) -> Any:
    return optuna.samplers.GPSampler(seed=seed)


def _random(optuna: Any, seed: int) -> Any:
    return optuna.samplers.RandomSampler(seed=seed)


# name -> (what it is, the arm). The anchors first, then towerlab's.
ARMS: dict[str, tuple[str, Arm]] = {
    "random": ("random search (Optuna's RandomSampler)", optuna_full(_random)),
    "tpe": ("Optuna TPE, full fidelity", optuna_full(_tpe)),
    "tpe-hyperband": ("TPE + HyperbandPruner (1 to 52 epochs, factor 3)",
                      optuna_pruned(lambda o: o.pruners.HyperbandPruner(min_resource=1, max_resource=FULL,
                                                                        reduction_factor=3))),
    "tpe-sha": ("TPE + SuccessiveHalvingPruner (Optuna's defaults)",
                optuna_pruned(lambda o: o.pruners.SuccessiveHalvingPruner())),
    "gp": ("Optuna GPSampler, full fidelity", optuna_full(_gp)),
    "dehb": ("DEHB (min 1, max 52, eta 3)", dehb),
    "smac-hpo": ("SMAC3 HyperparameterOptimizationFacade (random forest), full fidelity", anchor("smac-hpo")),
    "smac-bb": ("SMAC3 BlackBoxFacade (Gaussian process), full fidelity", anchor("smac-bb")),
    "hebo": ("HEBO, full fidelity", anchor("hebo")),
    "ga": ("the original's GA (towerlab's ga sampler, population 20)", towerlab_arm({"sampler": "ga", "population": 20})),
    "towerlab-tpe": ("towerlab tpe, population 4, overlapping (the default before this change)",
                     towerlab_arm({"sampler": "tpe"})),
    "towerlab": ("towerlab's default search (towerlab.api.search on its default 2 workers)", towerlab_api_arm({})),
    "towerlab-serial": ("towerlab's default search, played in one process", towerlab_arm({})),
    "towerlab-m1-api": ("towerlab's default search pruned from 1 epoch (towerlab.api.search with min_epochs=1 on its "
                        "default 2 workers)", towerlab_api_arm({"min_epochs": 1})),
    "towerlab-m4-api": ("towerlab's default search pruned from 4 epochs (towerlab.api.search with min_epochs=4 on its "
                        "default 2 workers)", towerlab_api_arm({"min_epochs": 4})),
    "towerlab-m1": ("towerlab's default search pruned from 1 epoch (--min-epochs 1, its judge deciding the rungs), "
                    "played in one process", towerlab_arm({"min_epochs": 1})),
    "towerlab-m4": ("towerlab's default search pruned from 4 epochs (--min-epochs 4, its judge deciding the rungs), "
                    "played in one process", towerlab_arm({"min_epochs": 4})),
    "towerlab-m1-gp": ("gp pruned from 1 epoch (--sampler gp --min-epochs 1, its judge deciding the rungs), played in "
                       "one process", towerlab_arm({"min_epochs": 1, "sampler": "gp", "generations": 1000})),
    "towerlab-m4-gp": ("gp pruned from 4 epochs (--sampler gp --min-epochs 4, its judge deciding the rungs), played in "
                       "one process", towerlab_arm({"min_epochs": 4, "sampler": "gp", "generations": 1000})),
    "towerlab-p2": ("towerlab's default with 2 a generation, played in one process", towerlab_arm({"population": 2})),
    # 2 a generation, and GPSampler's own start-up rule (10 complete trials, with a generation in flight: 12 random)
    "towerlab-before": ("towerlab's default before its start-up counted the trials in flight (2 a generation, the "
                        "model from the 13th training), played in one process",
                        towerlab_arm({"population": 2}, gp={"STARTUP": 12})),
    # every int range modelled value by value, as gp did before b4405be (an int range of more than 32 values a float one)
    "towerlab-serial-int": ("towerlab's default with gp modelling every int range value by value (as before it took "
                            "one of more than 32 values as a float range), played in one process",
                            towerlab_arm({}, gp={"RELAXED": 10**9})),
}
OWN_WORKERS = ("towerlab", "towerlab-m1-api", "towerlab-m4-api")  # arms whose search starts its own worker processes
ANCHORS = ("random", "tpe", "tpe-hyperband", "tpe-sha", "gp", "dehb", "ga", "smac-hpo", "smac-bb", "hebo")
RECORDED = (*ANCHORS, "towerlab-tpe", "towerlab-before", "towerlab-p2", "towerlab-serial", "towerlab")
