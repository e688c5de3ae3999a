"""One `towerlab evolve`, `towerlab grid` or `towerlab search run` job: start the workers (alone,
spawned locally, or under torchrun), let rank 0 run the search against its SQLite store while every
rank trains candidates, then test the top networks and write the record.

The output folder holds config.json, search.db (unless --store points elsewhere),
generations.jsonl, best.json, fitness.png, accuracy_time.png, summary.json and, with
--export-best, model.pt.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import signal
import socket
import sys
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, Callable

import torch

import towerlab
from towerlab import atomic
from towerlab.config import CUSTOM_MODEL, RunConfig, SearchConfig, dataset_label
from towerlab.fields import replace, to_dict
from towerlab.distributed.env import check_capacity, local_processes, search_threads, search_workers, torchrun_restart, torchrun_world_size, under_torchrun
from towerlab.distributed.group import Context, kv_store, session
from towerlab.distributed.launch import start_method_for
from towerlab.distributed.signals import Interrupted, StopFlag
from towerlab.errors import UserError
from towerlab.jobs.candidate import (TRAINING_GENES, candidate_config, candidate_task, estimated_cost,
                                     model_function, outcome, retrain_command, train_candidate, train_config_hash)
from towerlab.jobs.common import (Job, check_writable_file, handed_over, load_data, require_out_under_torchrun,
                                  resolved_run, restarted_by_torchrun, save_model, start_job, worker_data,
                                  write_config)
from towerlab.models import not_taken
from towerlab.report import (Reporter, format_cost, format_estimate, format_generation, format_plan, format_top,
                             plot_accuracy_time, plot_fitness)
from towerlab.search import (Candidate, Space, evaluation_records, load_space, make_sampler, open_search,
                             planned_trainings, refuse_unused_settings, resolved_remeasure, run_search,
                             sampler_class)
from towerlab.search.pool import Pool, stale_seconds
from towerlab.search.store import Store

# The command of each kind of search job (`towerlab <command>`).
COMMANDS = {"evolve": "evolve", "grid": "grid", "search": "search run"}


def check_settings(cfg: SearchConfig, run: RunConfig) -> Space:
    """The search's space, once every setting the search would refuse has been: an unknown sampler, a
    setting it refuses or one only other samplers read (a UserError; before any folder or worker)."""
    space = load_space(cfg.space)
    make_sampler(cfg, space)
    if run.resume is None:  # a search started before this check keeps what it recorded
        refuse_unused_settings(cfg)
    return space


def start_search(kind: str, cfg: SearchConfig, run: RunConfig, *, data: Any = None, function: Any = None,
                 start_method: str | None = None) -> int:
    """Run the search job; returns its exit status. `data` (a towerlab.data.Dataset, arrays from
    Python) replaces loading `cfg.dataset`; `function` builds the networks of a space of model
    "custom" (see `towerlab.jobs.candidate.Model`); `start_method` as in `distributed.launch` (None:
    `distributed.start_method_for` the run's device)."""
    space = check_settings(cfg, run)
    cfg = resolved_remeasure(cfg, space)  # recorded as resolved: a resume re-measures as this start did
    check_function(space, function)
    require_out_under_torchrun(run)
    if cfg.store:
        check_writable_file(cfg.store, "--store")
    if not under_torchrun():
        run = replace(run, devices=search_workers(run.devices, run.device))
    run = resolved_run(run)
    start_method = start_method or start_method_for(run.device)
    out = search_out(kind, cfg, run, space)
    if run.resume is None and _restarted_by_torchrun(out, kind, cfg):
        run = replace(run, resume=str(out))  # torchrun restarted this job's workers: continue the search
    workers = 1 if under_torchrun() else run.devices * cfg.workers_per_device
    if not under_torchrun():
        # Recorded as resolved: a resume trains its candidates with as many threads.
        run = replace(run, threads=search_threads(run.threads, run.device, workers))
        check_capacity(workers, run.threads, f"--devices {run.devices} x --workers-per-device {cfg.workers_per_device}")
    return start_job(SearchJob(out=out, resume=run.resume is not None, processes=workers, start_method=start_method,
                               timeout=run.timeout, essential={0}, kind=kind, cfg=cfg, run=run, data=data,
                               function=function))


@dataclass(kw_only=True)
class SearchJob(Job):
    """The search job: rank 0 coordinates, every rank trains candidates (see `common.Job` for the hooks)."""

    kind: str
    cfg: SearchConfig
    run: RunConfig
    data: Any = None
    function: Any = None

    def run_here(self) -> int:
        return _process(0, torchrun_world_size(), None, self.kind, self.cfg, self.run, str(self.out), self.data,
                        function=self.function)

    def preflight(self) -> tuple:
        stale_seconds()  # a bad TOWERLAB_WORKER_STALE_SECONDS is refused before any worker starts
        # Every data problem (and the download, or the offline fallback) once, before any worker
        # starts; the workers get this data, so every one of them reads the very same.
        data = self.data if self.data is not None else _data(self.cfg, self.run)
        return (self.kind, self.cfg, self.run, str(self.out), *handed_over(data, self.start_method), self.function)

    @staticmethod
    def worker(rank: int, world_size: int, store_path: str, kind: str, cfg: SearchConfig, run: RunConfig,
               out: str, data: Any, fallback: bool | None, function: Any) -> None:
        status = _process(rank, world_size, store_path, kind, cfg, run, out, data, fallback, function)
        if status:
            sys.exit(status)

    def hint(self) -> str:
        return (f"Continue the search with: towerlab {COMMANDS[self.kind]} --resume {self.out}"
                if atomic.is_job_folder(self.out) else "")

    def name(self, rank: int) -> str:
        return "coordinator rank 0" if rank == 0 else f"worker rank {rank}"


def check_function(space: Space, function: Any) -> None:
    """A space of model "custom" goes with a model function given from Python, and only it; each
    gene of a space must be a training gene or a keyword its model function takes (a family's
    builder, or yours): refused before anything trains, in one line naming the gene."""
    if (space.model == CUSTOM_MODEL) != (function is not None):
        raise UserError(f"space {space.name} has model {CUSTOM_MODEL!r}: its networks come from a function of yours, "
                        "given from Python (towerlab.api.search(space, data, model=make))" if function is None else
                        f"model= (a function of yours) goes with a space of model {CUSTOM_MODEL!r} (a dict space "
                        f"without \"model\" gets it), not with space {space.name} of model {space.model}")
    if function is not None and (not callable(function) or isinstance(function, torch.nn.Module)):
        raise UserError(f"model= of a search must be a function (input_shape, num_classes, **genes) returning a new "
                        f"nn.Module, got {type(function).__name__}")
    builder = model_function(function or space.model)
    unknown = not_taken(builder, [gene for gene in space.genes if gene not in TRAINING_GENES])
    if unknown:
        name = getattr(builder, "__name__", "your function")
        raise UserError(f"gene {unknown[0]!r} is neither a training gene ({', '.join(TRAINING_GENES)}) nor a keyword "
                        f"argument of {name}(input_shape, num_classes, ...): add it to {name}, or rename the gene")


def search_out(kind: str, cfg: SearchConfig, run: RunConfig, space: Space | None = None) -> Path:
    """The job's output folder: --resume, else --out, else a new one under runs/."""
    return Path(run.resume or run.out or default_out(kind, cfg, space or load_space(cfg.space)))


def _restarted_by_torchrun(out: Path, kind: str, cfg: SearchConfig) -> bool:
    """Whether this is a torchrun restart of the very job that made `out` (same kind and settings)."""
    return restarted_by_torchrun(out, lambda stored: stored.get("kind") == kind
                                 and stored.get("search") == json.loads(json.dumps(to_dict(cfg))))


def default_out(kind: str, cfg: SearchConfig, space: Space) -> Path:
    return Path("runs") / f"{datetime.now():%Y%m%d-%H%M%S}-{kind}-{Path(space.name).stem}-{dataset_label(cfg.dataset)}"


def _data(cfg: SearchConfig, run: RunConfig, **how: Any) -> Any:
    return load_data(cfg.dataset, cfg.val_size, run, **how)


def _process(rank: int, world_size: int, store_path: str | None, kind: str, cfg: SearchConfig,
             run: RunConfig, out: str, data: Any = None, fallback: bool | None = None, function: Any = None) -> int:
    local = local_processes(run) * (1 if under_torchrun() else cfg.workers_per_device)
    torch.set_num_threads(search_threads(run.threads, run.device, local))
    with session(rank=rank, world_size=world_size, store_path=store_path, timeout=run.timeout,
                 backend="gloo", per_device=cfg.workers_per_device, device=run.device) as ctx, \
            (StopFlag() if ctx.is_main else contextlib.nullcontext()) as stop:
        # Only the coordinator turns Ctrl-C into an orderly stop (it owns the store); a worker just
        # dies, losing at most the candidate in flight, which the resumed search trains again.
        data = worker_data(ctx, functools.partial(_data, cfg, run), data, fallback).to(ctx.device)
        space = load_space(cfg.space)
        model = function or space.model
        worker = f"rank{ctx.rank}@{socket.gethostname()}:{ctx.device}"

        def work(task: dict) -> dict:
            fields, _ = train_candidate(cfg, model, task["genome"], task["seed"], data, ctx.device,
                                        test=task["kind"] == "test", stop=stop, max_epochs=task["max_epochs"])
            return {**fields, "worker": worker}

        def check_stop() -> None:
            # The coordinator also leaves on Ctrl-C / SIGTERM while it only waits for the workers' results.
            if stop is not None and stop.signum:
                raise Interrupted(stop.signum)

        # A fresh key namespace per torchrun attempt: its store outlives a restarted worker group.
        pool = (Pool(kv_store(), ctx.rank, ctx.world_size, work, check_stop=check_stop,
                     namespace=f"attempt{torchrun_restart()[1]}") if ctx.distributed else None)
        if not ctx.is_main:
            pool.serve()
            return 0
        try:
            _coordinate(kind, cfg, run, Path(out), space, model, ctx, pool.map if pool else _local_map(work), data,
                        stop)
        finally:
            if pool is not None:
                pool.shutdown()
    return 0


def _local_map(work: Callable[[dict], dict]) -> Callable:
    def run_here(tasks: list[dict], on_result: Callable[[int, dict], list[dict] | None]) -> None:
        queue = list(tasks)
        for index, task in enumerate(queue):  # the tasks a result adds are appended, and run too
            queue.extend(on_result(index, work(task)) or [])
    return run_here


def _coordinate(kind: str, cfg: SearchConfig, run: RunConfig, out: Path, space: Space, model: Any, ctx: Context,
                run_tasks: Callable, data: Any, stop: StopFlag | None = None) -> None:
    reporter = Reporter(None, progress=run.progress,
                        on_closed=lambda: stop.request(signal.SIGPIPE) if stop is not None else None)
    tch = train_config_hash(cfg, ctx.device.type, torch.get_num_threads(), data.source, model)  # _process's threads
    try:
        if cfg.store:
            store = Store(cfg.store)  # a foreign or broken file is refused before the folder is made
            out.mkdir(parents=True, exist_ok=True)
        else:
            out.mkdir(parents=True, exist_ok=True)
            store = Store(out / "search.db")
    except OSError as exc:
        raise UserError(f"cannot create the search store {cfg.store or out / 'search.db'}: "
                        f"{exc.strerror or exc}") from None
    with store:
        resuming = ""
        if run.resume:
            search_id = _stored_search_id(out)
            done = store.generations(search_id)
            resuming = (f"resuming search {search_id} of {store.path} ({sum(g.complete for g in done)} generation(s) "
                        f"complete, {len(store.evaluations(search_id))} training(s) kept): ")
        else:
            search_id = open_search(store, cfg, make_sampler(cfg, space), space, tch, None)
            _write_config(out, kind, cfg, run, ctx, store, search_id)
        reporter.line(f"towerlab {COMMANDS[kind]}: {resuming}{cfg.sampler} over space {space.name} "
                      f"({space.size_text}, model {space.model}) on {cfg.dataset}, {ctx.world_size} worker(s) on "
                      f"{ctx.device.type} -> {out}")

        plan = planned_trainings(cfg, space)
        reporter.line(format_plan(plan))
        first: list[dict] = []  # the first successful training of this start: the estimate's yardstick

        def train_candidates(candidates: list[Candidate], record: Any) -> None:
            reporter.start_progress(len(candidates), 0, unit="net")
            queue: list[Candidate] = []  # task i of the batch trains queue[i]

            def tasks(batch: list[Candidate]) -> list[dict]:
                # Largest first: the batch then ends on small candidates, not on a big one that
                # started last while the other workers sat idle.
                batch = sorted(batch, key=lambda c: -estimated_cost(cfg, model, c.genome, data.input_shape,
                                                                     data.num_classes, c.max_epochs))
                queue.extend(batch)
                return [candidate_task(c) for c in batch]

            def on_result(index: int, result: dict) -> list[dict]:
                record(queue[index], outcome(result))
                recorded.append(index)
                if not first and result.get("status") == "ok":
                    first.append(result)
                    reporter.line(format_estimate(result["seconds"], result["epochs"], plan, ctx.world_size))
                reporter.advance()
                more = record.more()  # a pruned rung's certain places go on at once: no worker waits
                reporter.grow(len(more))
                return tasks(more)

            try:
                run_tasks(tasks(candidates), on_result)
            finally:
                reporter.end_progress()

        generations = 1 if sampler_class(cfg.sampler).one_generation else cfg.generations
        stats_log = out / "generations.jsonl"
        if run.resume:
            stats_log.unlink(missing_ok=True)  # rewritten from the store as the generations replay

        def on_generation(stats: Any) -> None:
            reporter.line(format_generation(stats, generations))
            with open(stats_log, "a", encoding="utf-8") as f:
                f.write(atomic.json_text(stats.to_json(), sort_keys=True) + "\n")

        started = time.perf_counter()
        recorded: list[int] = []
        try:
            result = run_search(cfg, space, train_candidates, store, tch, on_generation, resume=search_id,
                                on_progress=reporter.line)
        except Interrupted:
            reporter.line(f"Interrupted: the {len(recorded)} evaluation(s) finished since this start are kept in "
                          f"{store.path}, with every earlier one")
            raise
        top, tested = _test_top(result, store, run_tasks, reporter, data.n_test > 0)
        if top:
            reporter.line(format_top(top))
        cost = _cost(store, result.search_id, tested)
        reporter.line(format_cost(cost))
        used = _numerics_used(store, result)
        if len(used) > 1:
            reporter.line(f"towerlab: warning: this search's results were computed on {len(used)} kinds of "
                          f"device or torch ({'; '.join(_numerics_text(n) for n in used)}): results that differ "
                          f"in their last digits are compared; `towerlab search show {out} --csv` says which is which")
        if data.source.get("fallback"):  # on the last lines, where it cannot scroll away
            reporter.line("Trained on the OFFLINE FALLBACK DATA, not the full dataset: not comparable with "
                          "MNIST results")
        # a CPU candidate's numbers depend on its threads: the retraining command names them
        cpu_threads = run.threads if ctx.device.type == "cpu" else None
        _write_results(kind, cfg, space, model, out, store, result, top, {"cost": cost, "numerics": used}, ctx,
                       time.perf_counter() - started, data.source, cpu_threads)
        if not top:
            raise UserError(_all_failed(result, out))
        if cfg.export_best:
            _export_best(cfg, model, top[0], data, ctx.device, out, reporter, stop)
    reporter.close()


def _stored_search_id(out: Path) -> int:
    """Which search of its store a resumed folder continues, as its config.json records it."""
    path = out / "config.json"
    try:
        search_id = json.loads(path.read_text(encoding="utf-8"))["search_id"]
    except (OSError, ValueError, KeyError, TypeError):
        search_id = None
    if type(search_id) is not int:
        raise UserError(f"{path} names no search of its store (search_id was edited or removed): resume cannot "
                        "tell which search to continue; start a new search")
    return search_id


def _all_failed(result: Any, out: Path) -> str:
    """The line that ends a search in which no candidate succeeded: the search failed, whatever it wrote."""
    genomes = {m.genome_hash: m for g in result.history for m in g.members}
    reason = next((m.reason for m in genomes.values() if m.reason), "unknown")
    return (f"all {len(genomes)} candidates failed (the first: {reason}), so there is no network to report: "
            f"`towerlab search show {out}` lists each failure")


def _test_top(result: Any, store: Store, run_tasks: Callable, reporter: Reporter,
              has_test: bool = True) -> tuple[list[dict], list[float]]:
    """Test accuracy, computed once and only for the top genomes: each is retrained with the seed of
    its evaluation (so it is the same network) and scored on the test set. A top genome's validation
    accuracy is the mean over its seeds (the evaluation's, then its re-measures'), listed with
    their spread; its test accuracy is the evaluation's network's. Returns the rows, and the seconds
    of each retraining made now (none for those the store had tested already)."""
    rows, evaluations, seconds = [], [], []
    for t in result.top:
        evaluation = store.lookup(t.genome_hash, t.train_config_hash, result.search_id)
        evaluations.append(evaluation)
        rows.append({"genome": t.genome, "genome_hash": t.genome_hash, "val_accuracy": t.fitness,
                     "val_accuracy_sd": t.spread, "val_accuracies": list(t.fitnesses), "seeds": list(t.seeds),
                     "val_loss": t.val_loss, "seed": t.seed, "epochs": t.epochs, "rung": t.rung,
                     "max_epochs": evaluation.max_epochs, "test_accuracy": evaluation.test_accuracy})
    todo = [i for i, row in enumerate(rows) if row["test_accuracy"] is None]
    if todo and not has_test:  # arrays given without test=: nothing to score a retraining on
        reporter.line("No test split: the top networks are not retrained for a test accuracy (give test= to have "
                      "them tested)")
        todo = []
    if todo:
        reporter.line(f"Testing the top {len(rows)} networks (retraining {len(todo)} with their seeds)")

        def on_result(index: int, outcome: dict) -> None:
            row, evaluation = rows[todo[index]], evaluations[todo[index]]
            seconds.append(outcome.get("seconds", 0.0))
            if outcome.get("status") != "ok" or outcome.get("test_accuracy") is None:
                reporter.line(f"towerlab: warning: retraining a top network failed ({outcome.get('reason')}); "
                              "its test accuracy stays unknown")
                return
            if outcome["fitness"] != evaluation.fitness:
                reporter.line(f"towerlab: warning: a retrained top network reached validation accuracy "
                              f"{outcome['fitness']:.4f}, not {evaluation.fitness:.4f} (non-deterministic kernels)")
            row["test_accuracy"] = outcome["test_accuracy"]
            store.set_test_accuracy(evaluation.id, row["test_accuracy"])

        run_tasks([{"kind": "test", "genome": rows[i]["genome"], "seed": rows[i]["seed"],
                    "max_epochs": rows[i]["max_epochs"]} for i in todo], on_result)
    return rows, seconds


def _cost(store: Store, search_id: int, tested: list[float]) -> dict:
    """The trainings the search made, by purpose, each with its seconds of training: the search's own
    (every rung of every candidate it trained), the re-measures of the networks it was about to
    crown, and the retrainings that gave the top networks their test accuracy (`tested`: those of
    this start; a resumed search whose top was tested already makes none)."""
    rows = store.evaluations(search_id)

    def part(seconds: list[float]) -> dict:
        return {"trainings": len(seconds), "train_seconds": math.fsum(seconds)}

    return {"search": part([e.seconds for e in rows if e.replicate == 0]),
            "remeasure": part([e.seconds for e in rows if e.replicate > 0]), "test": part(tested)}


def _write_config(out: Path, kind: str, cfg: SearchConfig, run: RunConfig, ctx: Context, store: Store,
                  search_id: int) -> None:
    write_config(out, {"kind": kind, "search": to_dict(cfg), "run": to_dict(run), "search_id": search_id,
                       "store": str(store.path), "workers": ctx.world_size, "device_type": ctx.device.type})


def _numerics_used(store: Store, result: Any) -> list[dict]:
    """The distinct numerics (device, threads, precision, torch) of the trainings this search made
    and of those the store served its top from (another search's, in a shared store); unknown
    ones (rows from before they were recorded) left out."""
    rows = [*store.evaluations(result.search_id),
            *(store.lookup(t.genome_hash, t.train_config_hash, result.search_id) for t in result.top)]
    used = {json.dumps(r.numerics, sort_keys=True) for r in rows if r is not None and r.numerics}
    return [json.loads(n) for n in sorted(used)]


def _numerics_text(numerics: dict) -> str:
    return (f"{numerics.get('device')}, {numerics.get('threads')} thread(s), {numerics.get('precision')}, "
            f"torch {numerics.get('torch')}")


def _write_results(kind: str, cfg: SearchConfig, space: Space, model: Any, out: Path, store: Store, result: Any,
                   top: list[dict], accounts: dict, ctx: Context, seconds: float, data_source: dict,
                   cpu_threads: int | None) -> None:
    """best.json, the plots and summary.json; `accounts`: the summary's fields about what the search
    cost and ran on ("cost", "numerics"); `cpu_threads`: a CPU candidate's threads (None on GPUs)."""
    best = top[0] if top else None
    if best is not None:
        atomic.write_json(out / "best.json", {
            "genome": best["genome"], "val_accuracy": best["val_accuracy"], "val_accuracy_sd": best["val_accuracy_sd"],
            "val_accuracies": best["val_accuracies"], "seeds": best["seeds"], "test_accuracy": best["test_accuracy"],
            "seed": best["seed"], "model": space.model, "dataset": cfg.dataset,
            "command": retrain_command(cfg, model, best["genome"], best["seed"], best["max_epochs"], cpu_threads)})
    stats = [g.stats.to_json() for g in result.history]
    title = f"{cfg.sampler}: {Path(space.name).stem} on {dataset_label(cfg.dataset)}"
    plot_fitness(stats, out / "fitness.png", title)
    plot_accuracy_time([r for r in evaluation_records(store) if r["search"] == result.search_id],
                       out / "accuracy_time.png", title)
    atomic.write_json(out / "summary.json", {
        "kind": kind, "sampler": cfg.sampler, "space": space.name, "model": space.model, "dataset": cfg.dataset,
        "data_source": data_source, "data_fallback": bool(data_source.get("fallback")),
        "best_genome": best["genome"] if best else None,
        "best_val_accuracy": best["val_accuracy"] if best else None,
        "best_val_accuracy_sd": best["val_accuracy_sd"] if best else None,
        "best_test_accuracy": best["test_accuracy"] if best else None,
        "top": top, "evaluations": result.evaluations, "cache_hits": result.cache_hits,
        "failures": result.failures, "generations": result.generations, "trainings": result.trainings,
        "train_seconds": result.train_seconds, **accounts, "seconds": seconds,
        "workers": ctx.world_size, "device_type": ctx.device.type, "search_id": result.search_id,
        "generation_stats": stats, "seed": cfg.seed, "torch_version": torch.__version__,
        "towerlab_version": towerlab.__version__})


def _export_best(cfg: SearchConfig, model: Any, best: dict, data: Any, device: torch.device, out: Path,
                 reporter: Reporter, stop: StopFlag | None = None) -> None:
    """model.pt of the winner: retrained exactly as it was evaluated (same seed, same budget, the
    weights of its best epoch), so the file is the network whose accuracies are reported."""
    reporter.line("Exporting the best network (retraining it) ...")
    fields, result = train_candidate(cfg, model, best["genome"], best["seed"], data, device, test=True,
                                     stop=stop, max_epochs=best["max_epochs"])
    if result is None or fields["status"] != "ok":
        raise UserError(f"retraining the best network failed ({fields.get('reason')}): model.pt not written")
    save_model(out / "model.pt", result.model,
               candidate_config(cfg, model, best["genome"], best["seed"], best["max_epochs"]), data)
    test = f", test {result.test_accuracy:.4f}" if result.test_accuracy is not None else ", no test split"
    reporter.line(f"Wrote {out / 'model.pt'} (validation {result.val_accuracy:.4f}{test})")
