"""Optuna's side of bench/queue/objective_overhead.py: the same trivial objective through Optuna 5's
`study.optimize` with its RandomSampler, in memory (grown by running, or prefilled) and on RDBStorage
(prefilled in bulk, then a window on each number of processes); each window's rate from its trials' ends
(`rate`, which towerlab's side shares)."""

from __future__ import annotations

import datetime
import multiprocessing
import time


def rate(stamps: list[float]) -> float:
    """Trials a second over a window: the trials after the first over the time from the first end to the last."""
    return (len(stamps) - 1) / (stamps[-1] - stamps[0])


def _objective(trial) -> float:
    return (trial.suggest_float("x", 0.0, 1.0) - 0.3) ** 2 + (trial.suggest_float("y", 0.0, 1.0) - 0.7) ** 2


def quiet():
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    return optuna


def _completed(study) -> list[float]:
    return sorted(t.datetime_complete.timestamp() for t in study.get_trials(deepcopy=False)
                  if t.datetime_complete is not None)


def _draws(trials: int, seed: int) -> list[tuple[float, float, float]]:
    """`trials` random (x, y, f(x, y)): a history of finished trials, as the random sampler would leave."""
    import random

    draw = random.Random(seed)
    points = [(draw.random(), draw.random()) for _ in range(trials)]
    return [(x, y, (x - 0.3) ** 2 + (y - 0.7) ** 2) for x, y in points]


def _prefill_memory(study, trials: int, seed: int) -> float:
    """Add `trials` finished trials to an in-memory study (`study.add_trials`): the seconds it took."""
    optuna = quiet()
    distributions = {"x": optuna.distributions.FloatDistribution(0.0, 1.0),
                     "y": optuna.distributions.FloatDistribution(0.0, 1.0)}
    made = [optuna.trial.create_trial(params={"x": x, "y": y}, distributions=distributions, value=value)
            for x, y, value in _draws(trials, seed)]
    clock = time.perf_counter()
    study.add_trials(made)
    return time.perf_counter() - clock


def _prefill_rdb(url: str, trials: int, seed: int) -> float:
    """Add `trials` finished trials to the one study at `url` by writing Optuna's tables in bulk (trials,
    trial_params, trial_values: the rows `study.add_trials` writes, which takes about 20 ms a trial on
    RDBStorage here, half an hour for 100,000): the seconds it took."""
    import sqlalchemy

    optuna = quiet()
    distribution = optuna.distributions.distribution_to_json(optuna.distributions.FloatDistribution(0.0, 1.0))
    engine = sqlalchemy.create_engine(url)
    tables = sqlalchemy.MetaData()
    tables.reflect(engine, only=["studies", "trials", "trial_params", "trial_values"])
    clock = time.perf_counter()
    with engine.begin() as db:
        study_id = db.execute(sqlalchemy.select(tables.tables["studies"].c.study_id)).scalar_one()
        now = datetime.datetime.now()
        rows = _draws(trials, seed)
        db.execute(tables.tables["trials"].insert(), [
            {"trial_id": i + 1, "number": i, "study_id": study_id, "state": "COMPLETE", "datetime_start": now,
             "datetime_complete": now} for i in range(trials)])
        db.execute(tables.tables["trial_params"].insert(), [
            {"trial_id": i + 1, "param_name": name, "param_value": value, "distribution_json": distribution}
            for i, (x, y, _) in enumerate(rows) for name, value in (("x", x), ("y", y))])
        db.execute(tables.tables["trial_values"].insert(), [
            {"trial_id": i + 1, "objective": 0, "value": value, "value_type": "FINITE"}
            for i, (_, _, value) in enumerate(rows)])
        if engine.dialect.name == "postgresql":  # the ids given here: the sequence goes on after them
            db.execute(sqlalchemy.text("SELECT setval(pg_get_serial_sequence('trials', 'trial_id'), :n)"),
                       {"n": trials})
    engine.dispose()
    return time.perf_counter() - clock


def in_child(function, *args) -> dict:
    """function(*args) in a forked process (its own peak RSS, no state left here): its dict, with the RSS."""
    context = multiprocessing.get_context("fork")
    answer = context.Queue()

    def run() -> None:
        import resource

        result = function(*args)
        result["peak_rss_mb"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)
        answer.put(result)

    process = context.Process(target=run)
    process.start()
    result = answer.get()
    process.join()
    return result


def optuna_memory(trials: int, window: int, threads: int, grow: bool) -> dict:
    """In memory: grown by running (`grow`) or prefilled, then a window on `threads` threads (n_jobs)."""
    optuna = quiet()
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    if grow:
        study.optimize(_objective, n_trials=trials + window, n_jobs=threads)
        stamps = _completed(study)
        return {"start": rate(stamps[:window]), "history": rate(stamps[trials:trials + window]),
                "trials": len(stamps)}
    study.optimize(_objective, n_trials=window, n_jobs=threads)
    start = rate(_completed(study))
    filled = _prefill_memory(study, trials, seed=1)
    before = len(study.trials)
    study.optimize(_objective, n_trials=window, n_jobs=threads)
    return {"start": start, "history": rate(_completed(study)[before:]), "prefill_seconds": filled,
            "trials": len(study.trials)}


def _optimize(url: str, trials: int, seconds: float) -> None:
    optuna = quiet()
    study = optuna.load_study(study_name="bench", storage=url, sampler=optuna.samplers.RandomSampler())
    study.optimize(_objective, n_trials=trials, timeout=seconds)


def _processes(url: str, processes: int, trials: int, seconds: float) -> list[float]:
    """`trials` more trials of the study at `url` on `processes` forked processes, each stopping after
    `seconds` (Optuna's `timeout`: a trial takes seconds once the study is large): the new trials' ends."""
    optuna = quiet()
    before = len(optuna.load_study(study_name="bench", storage=url).get_trials(deepcopy=False))
    context = multiprocessing.get_context("fork")
    share = [trials // processes + (i < trials % processes) for i in range(processes)]
    running = [context.Process(target=_optimize, args=(url, n, seconds)) for n in share]
    for p in running:
        p.start()
    for p in running:
        p.join()
    stamps = _completed(optuna.load_study(study_name="bench", storage=url))
    assert before + 1 < len(stamps) <= before + trials, (len(stamps), before, trials)
    return stamps[before:]


def optuna_rdb(fresh: str, url: str, trials: int, window: int, seconds: float, workers: list[int]) -> dict:
    """RDBStorage: a window on each number of processes in a fresh study (at `fresh`, one study after the
    other), then a study at `url` prefilled with `trials` finished trials and a window on each number of
    processes again, one after the other; a window ends after `window` trials or `seconds`."""
    optuna = quiet()
    result: dict = {}
    for processes in workers:
        optuna.create_study(study_name="bench", storage=fresh, sampler=optuna.samplers.RandomSampler(seed=0))
        stamps = _processes(fresh, processes, window, seconds)
        result[f"{processes}w"] = {"start": rate(stamps), "start_trials": len(stamps)}
        optuna.delete_study(study_name="bench", storage=fresh)
    optuna.create_study(study_name="bench", storage=url, sampler=optuna.samplers.RandomSampler(seed=0))
    result["prefill_seconds"] = _prefill_rdb(url, trials, seed=1)
    for processes in workers:
        stamps = _processes(url, processes, window, seconds)
        result[f"{processes}w"] |= {"history": rate(stamps), "history_trials": len(stamps)}
    return result
