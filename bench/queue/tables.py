"""The queue family's tables (docs/distributed-search.md, docs/benchmarks.md), each number read from its
record."""

from __future__ import annotations

from bench.common.tables import Cell, Ref, Table, figure_ref, lookup

QUEUE = "queue/queue-2026-11-26.json"
QUEUE_TABLE = Table(
    ("worker processes", "towerlab, SQLite (tasks/s)", "towerlab, PostgreSQL (tasks/s)",
     "Optuna 5, PostgreSQL RDBStorage (trials/s)", "towerlab over Optuna, PostgreSQL"),
    tuple(
        (str(n), Ref(QUEUE, f"figures/queue_vs_optuna_postgresql/detail/rows/{i}/towerlab_sqlite", "num"),
         Ref(QUEUE, f"figures/queue_vs_optuna_postgresql/detail/rows/{i}/towerlab_postgresql", "num"),
         Ref(QUEUE, f"figures/queue_vs_optuna_postgresql/detail/rows/{i}/optuna_postgresql", "num"),
         Ref(QUEUE, f"figures/queue_vs_optuna_postgresql/detail/rows/{i}/ratio_postgresql", "x"))
        for i, n in enumerate(r["processes"] for r in lookup(QUEUE, "figures/queue_vs_optuna_postgresql/detail/rows"))
    ),
)

WORKERS, SAME_WORK = "queue/search-workers-2026-11-26.json", "queue/optuna-same-work-2026-11-26.json"
SEARCH_WORKERS = Table(
    ("a real search on the 2-core CPU machine (MNIST, one-epoch MLPs)", "measured", "aim"),
    (
        ("evaluations a minute, 1 CPU worker (random sampler, 24 evaluations, the top one tested)",
         Ref(WORKERS, "figures/search_two_workers/detail/one_per_minute", "num"), ""),
        ("the same on 2 CPU workers", Ref(WORKERS, "figures/search_two_workers/detail/two_per_minute", "num"), ""),
        ("2 workers over 1", Ref(WORKERS, "figures/search_two_workers/value", "x"), "1.80x"),
        ("a search on 2 workers: the command's start to its first candidate",
         Ref(SAME_WORK, "figures/search_first_candidate_seconds/value", "s"), ""),
        ("`towerlab search worker` joining a running search: its start to its first candidate",
         Ref(WORKERS, "figures/worker_join_seconds/value", "s"), ""),
        ("24 given MLPs on 2 processes: a plain PyTorch + Optuna script's wall time over towerlab's",
         Ref(SAME_WORK, "figures/search_vs_optuna_same_work/value", "x"), "1.30x"),
        ("towerlab's workers: the share of their time spent training, command start to record",
         Ref(SAME_WORK, "figures/workers_busy/value", "pct"), "95.00%"),
    ),
)

OVERHEAD = "queue/objective-overhead-2026-11-28.json"


def _overhead_row(what: str, prefix: str, cpu: str = "") -> tuple[Cell, ...]:
    """A side's trials a second over the first window and once the history holds 100,000, their ratio,
    and, where `cpu` names its figures, the CPU milliseconds a trial took over each window."""
    rates = (what, figure_ref(OVERHEAD, f"{prefix}_start", "num"), figure_ref(OVERHEAD, f"{prefix}_100k", "num"),
             Ref(OVERHEAD, f"figures/{prefix}_100k/value", "x", over=f"figures/{prefix}_start/value"))
    if not cpu:
        return (*rates, "", "")
    return (*rates, figure_ref(OVERHEAD, f"{cpu}_start", "p2"), figure_ref(OVERHEAD, f"{cpu}_100k", "p2"))


def _towerlab_overhead(what: str, side: str) -> tuple[Cell, ...]:
    return _overhead_row(what, f"objective_trials_per_s_{side}", f"objective_cpu_ms_per_trial_{side}")


OBJECTIVE_OVERHEAD = Table(
    ("a trivial objective, random sampler, the shared 2-core CPU machine", "trials/s, the first 2,000",
     "trials/s once the history holds 100,000", "the second over the first", "CPU ms a trial, the first 2,000",
     "CPU ms a trial at 100,000"),
    (
        _towerlab_overhead("towerlab, SQLite, 1 worker", "sqlite_1w"),
        _towerlab_overhead("towerlab, SQLite, 4 workers", "sqlite_4w"),
        _towerlab_overhead("towerlab, PostgreSQL, 1 worker", "postgresql_1w"),
        _towerlab_overhead("towerlab, PostgreSQL, 4 workers", "postgresql_4w"),
        _overhead_row("Optuna 5 in memory, 1 thread", "optuna_inmemory_trials_per_s_1w"),
        _overhead_row("Optuna 5 in memory, 4 threads (`n_jobs=4`)", "optuna_inmemory_trials_per_s_4w"),
        _overhead_row("Optuna 5 RDBStorage, SQLite, 1 process", "optuna_rdb_sqlite_trials_per_s_1w"),
        _overhead_row("Optuna 5 RDBStorage, SQLite, 4 processes", "optuna_rdb_sqlite_trials_per_s_4w"),
        _overhead_row("Optuna 5 RDBStorage, PostgreSQL, 1 process", "optuna_rdb_postgresql_trials_per_s_1w"),
        _overhead_row("Optuna 5 RDBStorage, PostgreSQL, 4 processes", "optuna_rdb_postgresql_trials_per_s_4w"),
    ),
)

AFTER_FIXES = "queue/objective-overhead-after-fixes-2026-11-28.json"


def _store_row(what: str, fid: str, fmt: str, field: str = "value") -> tuple[Cell, ...]:
    """A figure of the grown search on SQLite (the main run, and the run after the fixes) and PostgreSQL."""
    return (what, figure_ref(OVERHEAD, f"{fid.format('sqlite')}", fmt, field),
            figure_ref(AFTER_FIXES, f"{fid.format('sqlite')}", fmt, field), figure_ref(OVERHEAD, f"{fid.format('postgresql')}", fmt, field))


OBJECTIVE_OVERHEAD_STORE = Table(
    ("towerlab, a search of 102,000 trials", "SQLite, the run above", "SQLite, after the fixes",
     "PostgreSQL, the run above"),
    (
        _store_row("`towerlab search show DIR` (median of 3)", "search_show_seconds_{}_100k", "s"),
        _store_row("`towerlab search show DIR --csv` (median of 3)", "search_show_csv_seconds_{}_100k", "s"),
        _store_row("peak RSS of the worker whose driver thread played the search, MB", "driver_peak_rss_mb_{}_100k", "int"),
        _store_row("peak RSS of the job's own process (it follows the store, then plays the search once more for "
                   "its record), MB", "driver_peak_rss_mb_{}_100k", "int", "detail/job_mb"),
        ("the grown search resumed on 4 workers: seconds to its first new trial (each replays the history)",
         figure_ref(OVERHEAD, "objective_trials_per_s_sqlite_4w_100k", "s", "detail/resume_to_first_trial_seconds"),
         "not run", figure_ref(OVERHEAD, "objective_trials_per_s_postgresql_4w_100k", "s",
                         "detail/resume_to_first_trial_seconds")),
    ),
)

BEFORE_20K, AFTER_20K = "queue/objective-overhead-before-fixes-20k-2026-11-28.json", "queue/objective-overhead-after-fixes-20k-2026-11-28.json"


def _fixes_row(what: str, fid: str, fmt: str, field: str = "value") -> tuple[Cell, ...]:
    return (what, figure_ref(BEFORE_20K, fid, fmt, field), figure_ref(AFTER_20K, fid, fmt, field))


OBJECTIVE_OVERHEAD_FIXES = Table(
    ("towerlab, SQLite, 1 worker, a search of 22,000 trials", "before the fixes (d8dd5d4)", "after them"),
    (
        _fixes_row("CPU ms a trial, the first 2,000 trials", "objective_cpu_ms_per_trial_sqlite_1w_start", "p2"),
        _fixes_row("CPU ms a trial, 2,000 trials once the search holds 20,000", "objective_cpu_ms_per_trial_sqlite_1w_20k",
                   "p2"),
        _fixes_row("trials/s, the first 2,000 trials", "objective_trials_per_s_sqlite_1w_start", "num"),
        _fixes_row("trials/s, 2,000 trials once the search holds 20,000", "objective_trials_per_s_sqlite_1w_20k", "num"),
        _fixes_row("`towerlab search show DIR` (median of 3)", "search_show_seconds_sqlite_20k", "s"),
        _fixes_row("peak RSS of the worker whose driver thread played the search, MB", "driver_peak_rss_mb_sqlite_20k",
                   "int"),
    ),
)

BUSY = "queue/search-busy-2026-12-07-b.json"
_BUSY_ARMS = {"busy_default": "towerlab's default (`search run`, a budget alone)",
              "busy_optuna_gp": "Optuna GPSampler, a `python` process a worker on one journal file",
              "busy_optuna_tpe": "Optuna TPESampler (constant liar), a `python` process a worker on one journal file",
              "busy_optuna_gp_forked": "Optuna GPSampler, the processes forked from one that imported Optuna",
              "busy_optuna_tpe_forked": "Optuna TPESampler (constant liar), the processes forked from one that "
                                        "imported Optuna"}


def _busy_row(f: dict) -> tuple[Cell, ...]:
    ours = f["id"].startswith("busy_default")

    def cell(field: str, fmt: str) -> Ref:
        return Ref(BUSY, f"figures/{f['id']}/{field}", fmt)
    return (_BUSY_ARMS[f["id"].rpartition("_w")[0]], cell("detail/workers", "int"), cell("value", "r3"),
            cell("detail/busy_used", "r3") if ours else "", cell("detail/busy_while_budget", "r3"),
            cell("detail/ideal", "r3"), cell("detail/wall_seconds", "s0"),
            cell("detail/quick_proposals", "int") if ours else "")


SEARCH_BUSY = Table(
    ("200 trainings of 3 s +- 50%", "workers", "busy", "busy, the trainings its result reads",
     "busy while budget is left", "ideal (the tail alone)", "wall s", "quick proposals"),
    tuple(_busy_row(f) for f in lookup(BUSY, "figures")),
)

TABLES: dict[str, Table] = {"queue": QUEUE_TABLE, "search-workers": SEARCH_WORKERS, "search-busy": SEARCH_BUSY,
                           "objective-overhead": OBJECTIVE_OVERHEAD,
                           "objective-overhead-store": OBJECTIVE_OVERHEAD_STORE,
                           "objective-overhead-fixes": OBJECTIVE_OVERHEAD_FIXES}
