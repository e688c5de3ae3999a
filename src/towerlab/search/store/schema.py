"""The search store's schema, version SCHEMA_VERSION, in the SQL that SQLite and PostgreSQL both read,
and the migrations of older stores to it: 1, before samplers; 2, before numerics; 3, before the queue; 4,
before each evaluation's provenance; 5, before an objective's metrics; 6, before a search's proposer and
each generation's inputs; 7, before a promotion continued its lower rung; each in one transaction. Each
backend keeps the version its own way and checks it when a store opens (`Backend.open_schema`: SQLite's
`PRAGMA user_version`, PostgreSQL's `towerlab_schema` table): an empty database gets today's tables, an
older store is migrated in place, a damaged, foreign or newer one is a UserError that names it and what
to do. Stores of versions 1 to 3 are SQLite files (their own migrations are
`towerlab.search.store.sqlite`'s); the migrations from 3, 4, 5, 6 and 7 speak what both databases read. The
tables:

searches     id, sampler (its name), config (SearchConfig JSON), space (JSON: name, model, genes),
             space_fingerprint, train_config_hash, created, finished (NULL while running or
             interrupted), summary (JSON counts and the top, when finished), setup (JSON: how its
             workers train: device kind, threads, the model, the data, and what a worker checks before
             it joins, `towerlab.objective.admission`; NULL before schema 4), token
             (what its creator named it by, so a retried creation makes one search), leader (the worker
             that proposes its generations and plays it, until `leader_until` on the database's clock: one
             at a time, `towerlab.search.work.driver`) and activity (what the leader is doing, as `search
             show` says it: JSON, {"doing": ..., "since": ...}; both NULL before schema 7).
evaluations  one row per training: genome_hash, train_config_hash (of a pruned search's lower rung,
             see `towerlab.search.rounds`), genome (JSON), status ('ok'|'failed'), fitness
             (validation accuracy; NULL unless ok), val_loss, test_accuracy (set by a test task),
             epochs (trained), max_epochs (the budget it trained under), replicate (0: the
             evaluation; 1..: a re-measure with a fresh seed), seconds, worker, reason (why it
             failed), search_id, generation, idx (-1 for a re-measure), seed, finished_at, numerics
             (JSON: what the result depends on besides its settings and seed, as the worker saw it:
             device, threads, precision, torch; NULL before schema 3), provenance (JSON: where it was
             trained: host, towerlab, torch, code (the training code's digest), device (its name), data
             (the data's digest); NULL before schema 5), metrics (JSON: an objective's numbers by name, the
             searched one among them, as it returned them; `fitness` is that one as higher-is-better, negated
             where it is minimized) and curve (JSON list: the points it reported on the way, each
             {"epoch": N, name: value, ...}), NULL for towerlab's own trainings and before schema 6, and
             continued (the epochs it did not train again: a promotion that continued its lower rung's
             training, `towerlab.search.candidates.Outcome`; 0 before schema 8). Unique
             per (search_id, genome_hash, train_config_hash, replicate): writing a row a search already has is a no-op
             that returns the row.
generations  (search_id, generation) key, members (JSON list of {genome_hash, genome} in population
             order, written when the generation begins, with `watermark`, the newest evaluation id
             then, and `proposed`, what it was proposed from: JSON, {"in_flight": [the generations then
             in flight], "seconds": the proposal's, "by": the worker that proposed it, "workers": the busy
             and idle workers then, "spare": how many candidates the search kept ready beyond them};
             NULL before schema 7 and where nobody proposed it (a resumed search's first)), results (JSON
             per-member records) and stats (JSON), written with complete = 1 when it ends; started, finished.
tasks        the queue: one row per training a search needs and no evaluation serves (kind 'train':
             an evaluation, a higher rung, a re-measure; `starts`, the epochs of the lower rung a
             promotion continues, 0 before schema 8) or per retraining of a top network for its
             test accuracy (kind 'test'), unique per (search_id, kind, genome_hash,
             train_config_hash, replicate); state 'open', 'claimed' (by `worker`, until
             `lease_until` on the database's clock) or 'done'; attempts (claims so far), lost (why the
             last claimant lost it), result (a test task's outcome, JSON).
workers      every worker that joined: id (its name: host, pid, device and a random token), host
             (where its pid names it: the host name, its boot and PID namespace), pid, device, started,
             seen (its last claim or renewal), left_at, task (what it holds now).
"""

from __future__ import annotations


from towerlab.errors import UserError
from towerlab.search.store.database import Transaction

SCHEMA_VERSION = 8


class NoStore(UserError):
    """The place names no store yet (no file, an empty database): a search that starts there makes one."""


# Version 3's tables, as SQLite stores of versions 1 to 3 hold them (`towerlab.search.store.sqlite.upgrade_from_1`
# rebuilds this one).
_SEARCH_COLUMNS = """
    sampler TEXT NOT NULL,
    config TEXT NOT NULL,
    space TEXT NOT NULL,
    space_fingerprint TEXT NOT NULL,
    train_config_hash TEXT NOT NULL,
    created TEXT NOT NULL,
    finished TEXT,
    summary TEXT"""
V3_SEARCHES = "CREATE TABLE searches (\n    id INTEGER PRIMARY KEY," + _SEARCH_COLUMNS + "\n)"
EVALUATION_INDEXES = """
CREATE INDEX evaluations_ok ON evaluations (genome_hash, train_config_hash, replicate) WHERE status = 'ok';
CREATE UNIQUE INDEX evaluations_search ON evaluations (search_id, genome_hash, train_config_hash, replicate)
"""

# Today's schema, in the SQL that SQLite and PostgreSQL both read (each backend supplies {id}); the same
# tables in both, described above.
SCHEMA = """
CREATE TABLE searches (
    id {id},""" + _SEARCH_COLUMNS + """,
    setup TEXT,
    token TEXT,
    leader TEXT,
    leader_until DOUBLE PRECISION,
    activity TEXT
);
CREATE UNIQUE INDEX searches_token ON searches (token);
CREATE TABLE evaluations (
    id {id},
    genome_hash TEXT NOT NULL,
    train_config_hash TEXT NOT NULL,
    genome TEXT NOT NULL,
    status TEXT NOT NULL CHECK (status IN ('ok', 'failed')),
    fitness DOUBLE PRECISION CHECK (status <> 'ok' OR fitness IS NOT NULL),
    val_loss DOUBLE PRECISION,
    test_accuracy DOUBLE PRECISION,
    epochs INTEGER NOT NULL,
    seconds DOUBLE PRECISION NOT NULL,
    worker TEXT NOT NULL,
    reason TEXT,
    search_id BIGINT NOT NULL REFERENCES searches (id),
    generation INTEGER NOT NULL,
    idx INTEGER NOT NULL,
    seed BIGINT NOT NULL,
    finished_at TEXT NOT NULL,
    max_epochs INTEGER,
    replicate INTEGER NOT NULL DEFAULT 0,
    numerics TEXT,
    provenance TEXT,
    metrics TEXT,
    curve TEXT,
    continued INTEGER NOT NULL DEFAULT 0
);""" + EVALUATION_INDEXES + """;
CREATE TABLE generations (
    search_id BIGINT NOT NULL REFERENCES searches (id),
    generation INTEGER NOT NULL,
    members TEXT NOT NULL,
    results TEXT,
    stats TEXT,
    complete INTEGER NOT NULL DEFAULT 0 CHECK (complete IN (0, 1)),
    started TEXT NOT NULL,
    finished TEXT,
    watermark BIGINT,
    proposed TEXT,
    PRIMARY KEY (search_id, generation)
);
""" 

# Added by version 4 (the store is the queue): the tasks workers claim, and the workers.
QUEUE = """
CREATE TABLE tasks (
    id {id},
    search_id BIGINT NOT NULL REFERENCES searches (id),
    kind TEXT NOT NULL CHECK (kind IN ('train', 'test')),
    genome_hash TEXT NOT NULL,
    train_config_hash TEXT NOT NULL,
    replicate INTEGER NOT NULL,
    generation INTEGER NOT NULL,
    idx INTEGER NOT NULL,
    genome TEXT NOT NULL,
    seed BIGINT NOT NULL,
    max_epochs INTEGER,
    priority DOUBLE PRECISION NOT NULL DEFAULT 0,
    state TEXT NOT NULL CHECK (state IN ('open', 'claimed', 'done')),
    worker TEXT,
    lease_until DOUBLE PRECISION,
    attempts INTEGER NOT NULL DEFAULT 0,
    lost TEXT,
    result TEXT,
    created DOUBLE PRECISION NOT NULL,
    claimed DOUBLE PRECISION,
    finished DOUBLE PRECISION,
    UNIQUE (search_id, kind, genome_hash, train_config_hash, replicate)
);
CREATE INDEX tasks_waiting ON tasks (search_id, state, priority);
CREATE TABLE workers (
    id TEXT PRIMARY KEY,
    host TEXT NOT NULL,
    pid INTEGER NOT NULL,
    device TEXT NOT NULL,
    started DOUBLE PRECISION NOT NULL,
    seen DOUBLE PRECISION NOT NULL,
    left_at DOUBLE PRECISION,
    task BIGINT
)
"""
TABLES = {"searches", "evaluations", "generations", "tasks", "workers"}
OLD_TABLES = {"searches", "evaluations", "generations"}  # a store of version 1 to 3


def statements(script: str) -> list[str]:
    return [s for s in script.split(";") if s.strip()]


def create_tables(tx: Transaction) -> None:
    """An empty store of this schema (the caller records its version)."""
    for statement in statements(SCHEMA + ";" + QUEUE):
        tx.run(statement)
    tx.run(TASKS_STARTS)


TASKS_STARTS = "ALTER TABLE tasks ADD COLUMN starts INTEGER NOT NULL DEFAULT 0"  # version 8's, on version 4's queue


def upgrade_from_3(tx: Transaction) -> None:
    """Version 3 to 4 (the store is the queue): a search records how its workers train (`setup`) and the
    token its creator gave it; a generation the newest evaluation id other searches may serve it from
    (`watermark`: NULL in older generations, which may take any); the tasks and workers tables."""
    tx.run("ALTER TABLE searches ADD COLUMN setup TEXT")
    tx.run("ALTER TABLE searches ADD COLUMN token TEXT")
    tx.run("CREATE UNIQUE INDEX searches_token ON searches (token)")
    tx.run("ALTER TABLE generations ADD COLUMN watermark BIGINT")
    for statement in statements(QUEUE):
        tx.run(statement)


def upgrade_from_4(tx: Transaction) -> None:
    """Version 4 to 5: evaluations gain their provenance (JSON: host, versions, device, data digest),
    NULL (unknown) in the rows written before."""
    tx.run("ALTER TABLE evaluations ADD COLUMN provenance TEXT")


def upgrade_from_5(tx: Transaction) -> None:
    """Version 5 to 6: evaluations gain an objective's metrics and curve (JSON), NULL in the rows written
    before (towerlab's own trainings: their metric is the fitness, validation accuracy)."""
    tx.run("ALTER TABLE evaluations ADD COLUMN metrics TEXT")
    tx.run("ALTER TABLE evaluations ADD COLUMN curve TEXT")


def upgrade_from_6(tx: Transaction) -> None:
    """Version 6 to 7: a search gains its leader (the worker proposing for it, under a lease) and what it is
    doing; a generation what it was proposed from. NULL in what was written before: an older search's next
    leader takes the lease as a lapsed one, and its recorded generations are read as they are."""
    tx.run("ALTER TABLE searches ADD COLUMN leader TEXT")
    tx.run("ALTER TABLE searches ADD COLUMN leader_until DOUBLE PRECISION")
    tx.run("ALTER TABLE searches ADD COLUMN activity TEXT")
    tx.run("ALTER TABLE generations ADD COLUMN proposed TEXT")


def upgrade_from_7(tx: Transaction) -> None:
    """Version 7 to 8: a task gains the epochs its training continues from (`starts`), an evaluation the epochs
    it did not train again (`continued`); 0 in what was written before, where every training started from
    scratch."""
    tx.run("ALTER TABLE evaluations ADD COLUMN continued INTEGER NOT NULL DEFAULT 0")
    tx.run(TASKS_STARTS)


def upgrade_from_2(tx: Transaction) -> None:
    """Version 2 (before numerics): evaluations gain the column, NULL (unknown) in their rows."""
    tx.run("ALTER TABLE evaluations ADD COLUMN numerics TEXT")


def refuse_newer(version: int, where: object) -> None:
    if version > SCHEMA_VERSION:
        raise UserError(f"search store {where} has schema version {version}, newer than this towerlab reads "
                        f"({SCHEMA_VERSION}): upgrade towerlab to open it")
