"""What a search job shows and writes: while its workers work, `Watch` follows the store (a line per
generation as it completes, generations.jsonl, the first training's estimate, a progress bar on a
terminal and otherwise a status line at least every `STATUS_EVERY` seconds); at the end, `write_record`
writes best.json, the plots and summary.json from the store, whoever trained what. The output folder
holds config.json, search.db (unless --store points elsewhere), generations.jsonl, best.json,
fitness.png, accuracy_time.png, summary.json and, with --export-best, model.pt."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

import towerlab
from towerlab import atomic
from towerlab.checks import dataset_label
from towerlab.data.load import Dataset
from towerlab.distributed.signals import StopFlag
from towerlab.errors import UserError
from towerlab.objective.candidate import CandidateModel, Rung, candidate_config, retrain_command, train_candidate
from towerlab.jobs.search.first_results import FIRST_RESULTS, stop_if_failed_alike
from towerlab.models.files import save_model
from towerlab.plots import plot_accuracy_time, plot_fitness, pyplot
from towerlab.report import Reporter, format_cost, format_estimate, format_generation, format_top, require_tensorboard
from towerlab.search import Search, SearchResult, evaluation_records
from towerlab.search.history import GenerationStats, repeated_remeasures
from towerlab.search.testing import top_tests
from towerlab.search.views.show import numerics_text, numerics_used, workers_now
from towerlab.search.store import Store

STATUS_EVERY = 30.0  # seconds without a line after which a job without a progress bar says where it stands


class Watch:
    """Follows a search in its store for the job's console and generations.jsonl (see the module's
    docstring). `step()` looks once; it returns whether anything was done since the last look."""

    def __init__(self, store: Store, search: Search, out: Path, reporter: Reporter, workers: int,
                 resumed: bool, tensorboard: bool = False) -> None:
        self.store, self.search, self.out, self.reporter, self.workers = store, search, out, reporter, workers
        self.log = out / "generations.jsonl"
        if resumed:
            self.log.unlink(missing_ok=True)  # rewritten from the store as the generations are shown again
        self.shown = 0  # generations shown
        self.before = store.records.newest_evaluation()  # this start's evaluations come after
        self.first: Optional[float] = None
        self.trained = 0
        self.testing = False
        self.plots_ready = False  # matplotlib imported (for the record's plots)
        self.last_line = time.monotonic()
        self.started = time.monotonic()
        self.replayed = {g.generation for g in store.records.generations(search.stored_id) if g.complete}
        if reporter.progress:
            reporter.start_progress(search.plan["search"], 0, unit="net")
        # --tensorboard: every evaluation as it lands (search/...) and every generation (generation/...), in
        # <out>/tb; a resumed search writes them all again, from its first training.
        self.tb = require_tensorboard()(log_dir=str(out / "tb")) if tensorboard else None
        self.plotted: set[int] = set()
        self.best: Optional[float] = None
        self.judged = not search.own or search.plan["search"] <= FIRST_RESULTS  # stopped on its first results?
        # the judge's evidence, read as the generations are shown (a resume shows them all again), and what it
        # decided on them, said again when that changes
        self.evidence = search.evidence()
        self.pruning = None if self.evidence is None else self.evidence.judge().decided

    def step(self) -> bool:
        try:  # `rm -rf` mid-search: one line here, not a traceback at a write into the folder
            if self.out.is_dir():
                return self._step()
        except FileNotFoundError:
            if self.out.is_dir():
                raise
        inside = self.store.url is None and Path(self.store.path).absolute().is_relative_to(self.out.absolute())
        raise UserError(f"the search's folder {self.out} was deleted while the search ran: its record cannot be "
                        "written, " + ("and its store went with it" if inside else
                                       f"and its store, {self.store.path}, keeps what was trained"))

    def _step(self) -> bool:
        trained = self.store.records.count_evaluations(self.search.stored_id, after=self.before)
        new = trained - self.trained
        if new:
            self.trained = trained
            self.reporter.advance(new)
        if not self.judged and self.trained >= FIRST_RESULTS:
            self.judged = True  # the first results of this start, all failed alike, stop the search
            stop_if_failed_alike(self.store, self.search, self.before, self.out)
        if self.first is None and new:
            row = next((e for e in self.store.records.evaluations(self.search.stored_id, after=self.before)
                        if e.status == "ok" and e.replicate == 0), None)
            if row is not None:
                self.first = row.seconds
                self._line(format_estimate(row.seconds, row.epochs, self.search.plan, self.workers))
        if self.tb is not None and (new or not self.plotted):
            self._plot_evaluations()
        for gen in self.store.records.generations(self.search.stored_id, since=self.shown):
            if not gen.complete:
                break
            stats = self.search.shown(GenerationStats(**gen.final_stats, replayed=gen.generation in self.replayed))
            self._line(format_generation(stats, self.search.generations))
            if self.evidence is not None:
                self.evidence.add(self.store.records.own_history(self.search.stored_id, stats.generation,
                                                                 stats.generation + 1))
                judged = self.evidence.judge()
                if judged.decided != self.pruning:  # the pruner's judge decides anew
                    self.pruning = judged.decided
                    self._line(f"Pruning, judged on the generations so far: {judged.text()}")
            if self.tb is not None:
                for key in ("best", "mean", "worst", "evaluated", "cached", "failed", "seconds"):
                    if getattr(stats, key) is not None:
                        self.tb.add_scalar(f"generation/{key}", getattr(stats, key), stats.generation + 1)
                self.tb.flush()
            with open(self.log, "a", encoding="utf-8") as f:
                f.write(atomic.json_text(stats.record(), sort_keys=True) + "\n")
            self.shown += 1
        if not self.testing:
            tests = self.store.queue.tasks(self.search.stored_id, "test")
            if tests:
                self.testing = True
                todo = sum(t.state != "done" for t in tests)
                where = (f"; {todo} of {self.workers} workers train them, the others have nothing left"
                         if 0 < todo < self.workers else "")
                self._line(f"Testing the top {len(tests)} networks (retraining {todo} with their seeds, each on one "
                           f"worker as it was evaluated{where})")
        if not self.plots_ready:
            counts = self.store.queue.queue_counts(self.search.stored_id)
            if counts["done"] and not counts["open"] and counts["claimed"] < self.workers:
                pyplot()  # the record's plots need it: imported now, while a worker has nothing to train
                self.plots_ready = True
        if new and self.reporter.bar is not None:  # beside the bar: what the workers do
            self.reporter.bar.set_postfix_str(f"workers {workers_now(self.store, self.search)}", refresh=False)
        if not self.reporter.progress and time.monotonic() - self.last_line > STATUS_EVERY:
            self._line(self.status())
        return new > 0

    def _plot_evaluations(self) -> None:
        """TensorBoard points of the evaluations not plotted yet, in their numbering's order: each one's metric
        and the best so far, against the trainings made, and your objective's curve (`curve/ID/METRIC`)."""
        assert self.tb is not None
        after = max(0, max(self.plotted, default=0) - 256)
        search, goal, metric = self.search, self.search.goal, self.search.goal.metric
        for row in self.store.records.evaluations(search.stored_id, after=after):
            if row.id in self.plotted:
                continue
            self.plotted.add(row.id)
            step = len(self.plotted)
            if row.status == "ok" and row.fitness is not None:
                kind = "search" if row.replicate == 0 else "remeasure"
                self.tb.add_scalar(f"{kind}/{metric}", goal.value(row.fitness), step)
                if row.replicate == 0:
                    self.best = row.fitness if self.best is None else max(self.best, row.fitness)
                    self.tb.add_scalar(f"search/best_{metric}", goal.value(self.best), step)
            self.tb.add_scalar("search/train_seconds", row.seconds, step)
            for point in (row.curve or []) if search.own else []:  # your curve: one chart per metric and training
                for name, value in point.items():
                    if name != "epoch" and isinstance(value, (int, float)) and math.isfinite(value):
                        self.tb.add_scalar(f"curve/{row.id}/{name}", value, point["epoch"])
        self.tb.flush()

    def status(self) -> str:
        """Where the search stands: its generation (or the top's re-measures and tests), queue and workers."""
        counts = self.store.queue.queue_counts(self.search.stored_id)
        generations = self.search.generations
        stage = (f"Generation {self.shown + 1}/{generations}" if self.shown < generations else
                 f"{'Testing' if self.testing else 'Re-measuring'} the top after generation {generations}/{generations}")
        return (f"{stage}: {self.trained} training(s) done since this start, {counts['claimed']} in progress, "
                f"{counts['open']} waiting; workers {workers_now(self.store, self.search)} "
                f"({time.monotonic() - self.started:.0f} s)")

    def _line(self, text: str) -> None:
        self.reporter.line(text)
        self.last_line = time.monotonic()

    def close(self) -> None:
        self.reporter.end_progress()
        if self.tb is not None:
            self.tb.close()


def test_results(result: SearchResult, store: Store, has_test: bool, reporter: Reporter) -> tuple[list[dict], list[float]]:
    """The top networks as the record lists them (`towerlab.search.testing`: the mean over their seeds, with
    its spread; the evaluation's network's test accuracy), and the seconds of every test retraining."""
    found = top_tests(store, result)
    rows = [{"genome": t.genome, "genome_hash": t.genome_hash, "val_accuracy": t.fitness,
             "val_accuracy_sd": t.spread, "val_accuracies": list(t.fitnesses), "seeds": list(t.seeds),
             "val_loss": t.val_loss, "seed": t.seed, "epochs": t.epochs, "rung": t.rung,
             "max_epochs": evaluation.max_epochs, "test_accuracy": evaluation.test_accuracy}
            for t, evaluation, _ in found]
    if not has_test and rows:  # arrays given without test=: nothing to score a retraining on
        reporter.line("No test split: the top networks are not retrained for a test accuracy (give test= to have "
                      "them tested)")
    for _, evaluation, task in found:
        outcome = None if task is None else task.result
        if task is None or outcome is None:
            continue
        if task.test_accuracy is None:
            reporter.line(f"towerlab: warning: retraining a top network failed ({outcome.get('reason')}); "
                          "its test accuracy stays unknown")
        elif outcome["fitness"] != evaluation.fitness:
            reporter.line(f"towerlab: warning: a retrained top network reached validation accuracy "
                          f"{outcome['fitness']:.4f}, not {evaluation.fitness:.4f} (non-deterministic kernels)")
    seconds = [task.result.get("seconds", 0.0) for task in store.queue.tasks(result.search_id, "test")
               if task.state == "done" and task.result]
    return rows, seconds


def cost(store: Store, search: Search, tested: list[float]) -> dict:
    """The trainings the search made, by purpose, each with its seconds of training and the epochs it was given
    (--budget-epochs' count): the search's own (every rung of each candidate, a continued promotion the epochs it
    added), the re-measures of the networks it was about to crown, and the retrainings for the top's test accuracy."""
    rows = store.records.evaluations(search.stored_id)
    tests = [t.candidate.max_epochs or search.cfg.max_epochs for t in store.queue.tasks(search.stored_id, "test")
             if t.state == "done" and t.result]

    def part(seconds: list[float], epochs: list[Optional[int]]) -> dict:
        return {"trainings": len(seconds), "train_seconds": math.fsum(seconds),
                "epochs": sum(e or search.cfg.max_epochs for e in epochs)}

    searched, remeasured = [e for e in rows if e.replicate == 0], [e for e in rows if e.replicate > 0]
    given: list[Optional[int]] = [(e.max_epochs or search.cfg.max_epochs) - e.continued for e in searched]
    return {"search": part([e.seconds for e in searched], given),
            "remeasure": part([e.seconds for e in remeasured], [e.max_epochs for e in remeasured]),
            "test": part(tested, list(tests))}


def all_failed(result: SearchResult, out: Path) -> str:
    """The line that ends a search in which no candidate succeeded: the search failed, whatever it wrote."""
    genomes = {m.genome_hash: m for g in result.history for m in g.members}
    reason = next((m.reason for m in genomes.values() if m.reason), "unknown")
    return (f"all {len(genomes)} candidates failed (the first: {reason}), so there is no winner to report: "
            f"`towerlab search show {out} --csv` gives each failure's reason")


@dataclass(frozen=True)
class RecordOptions:
    """What a search's record says of the job that ran it, besides its search and store: its `kind`
    (evolve, grid, search), its folder `out`, the `model` its networks are built with, the `data` they
    trained on (its source; whether it has a test split), its `workers`, a CPU candidate's threads
    (`cpu_threads`; None on GPUs), and its `seconds`."""

    kind: str
    out: Path
    model: Optional[CandidateModel]  # None, with no data: a search of your own objective
    data: Optional[Dataset]
    workers: int
    cpu_threads: Optional[int]
    seconds: float


def own_top(search: Search, store: Store, result: SearchResult) -> list[dict]:
    """The top of a search of your own objective as its record lists it: each crowned genome's metric (`value`,
    the mean over its seeds, as your objective returned it), its spread and values, and every metric its
    evaluation returned."""
    return [{"genome": t.genome, "genome_hash": t.genome_hash, "value": search.goal.value(t.fitness),
             "value_sd": t.spread, "values": list(map(search.goal.value, t.fitnesses)), "seeds": list(t.seeds),
             "metrics": evaluation.metrics, "seed": t.seed, "epochs": t.epochs, "rung": t.rung,
             "max_epochs": evaluation.max_epochs}
            for t, evaluation, _ in top_tests(store, result)]


def write_record(search: Search, store: Store, result: SearchResult, reporter: Reporter,
                 job: RecordOptions) -> list[dict]:
    """Print the top and the cost, and write best.json, the plots and summary.json; the top's rows."""
    cfg, space, out, data = search.cfg, search.space, job.out, job.data
    tested: list[float] = []
    if data is None:  # a search of your own objective: no test split
        top = own_top(search, store, result)
        goal = f"{search.goal.metric}, {search.goal.direction}d"
        reporter.line(format_top(top, goal) if top else f"No trial gave its {search.goal.metric}")
    else:
        top, tested = test_results(result, store, data.n_test > 0, reporter)
        if top:
            reporter.line(format_top(top))
    spent = cost(store, search, tested)
    reporter.line(format_cost(spent))
    if repeated := repeated_remeasures(result.top):
        reporter.line(f"towerlab: note: each of the top's {repeated} re-measures gave its network's value again: this "
                      f"objective answers the same whatever the seed, so --remeasure 0 would have saved them")
    used = numerics_used(store, result)
    if len(used) > 1:
        reporter.line(f"towerlab: warning: this search's results were computed on {len(used)} kinds of "
                      f"device or torch ({'; '.join(numerics_text(n) for n in used)}): results that differ "
                      f"in their last digits are compared; `towerlab search show {out} --csv` says which is which")
    if data is not None and data.source.get("fallback"):  # on the last lines, where it cannot scroll away
        reporter.line("Trained on the OFFLINE FALLBACK DATA, not the full dataset: not comparable with "
                      "MNIST results")
    best = top[0] if top else None
    stats = [search.shown(g.stats).record() for g in result.history]
    records = [r for r in evaluation_records(store) if r["search"] == result.search_id]
    common = {"kind": job.kind, "sampler": cfg.sampler, "space": space.name,
              "best_genome": best["genome"] if best else None, "top": top, "evaluations": result.evaluations,
              "cache_hits": result.cache_hits, "failures": result.failures, "generations": result.generations,
              "trainings": result.trainings, "train_seconds": result.train_seconds, "cost": spent,
              "ended_by": result.ended, "numerics": used, "seconds": job.seconds, "workers": job.workers,
              "device_type": search.recorded("device"), "search_id": result.search_id, "generation_stats": stats,
              "seed": cfg.seed, "torch_version": torch.__version__, "towerlab_version": towerlab.__version__,
              "pruning": None if (judged := search.judgement(store)) is None else judged.to_json()}
    if data is None:
        goal_of = {"metric": search.goal.metric, "direction": search.goal.direction, "objective": search.aim.spec}
        if best is not None:
            kept = ("genome", "value", "value_sd", "values", "seeds", "seed", "metrics")
            atomic.write_json(out / "best.json", {**{k: best[k] for k in kept}, **goal_of})
        title = f"{cfg.sampler}: {Path(space.name).stem}, {goal}"
        summary = {**common, **goal_of, "best_value": best["value"] if best else None,
                   "best_value_sd": best["value_sd"] if best else None,
                   "best_metrics": best["metrics"] if best else None}
    else:
        if best is not None:
            assert job.model is not None, "towerlab's training builds its networks with a model"
            atomic.write_json(out / "best.json", {
                "genome": best["genome"], "val_accuracy": best["val_accuracy"],
                "val_accuracy_sd": best["val_accuracy_sd"], "val_accuracies": best["val_accuracies"],
                "seeds": best["seeds"], "test_accuracy": best["test_accuracy"], "seed": best["seed"],
                "model": space.model, "dataset": cfg.dataset,
                "command": retrain_command(cfg, job.model, best["genome"], best["seed"], best["max_epochs"],
                                           job.cpu_threads)})
        title = f"{cfg.sampler}: {Path(space.name).stem} on {dataset_label(cfg.dataset)}"
        summary = {**common, "model": space.model, "dataset": cfg.dataset, "data_source": data.source,
                   "data_fallback": bool(data.source.get("fallback")),
                   "best_val_accuracy": best["val_accuracy"] if best else None,
                   "best_val_accuracy_sd": best["val_accuracy_sd"] if best else None,
                   "best_test_accuracy": best["test_accuracy"] if best else None}
    plot_fitness(stats, out / "fitness.png", title, search.metric_label)
    plot_accuracy_time(records, out / "accuracy_time.png", title)
    atomic.write_json(out / "summary.json", summary)
    if not top:
        raise UserError(all_failed(result, out))
    return top


def export_best(search: Search, model: CandidateModel, best: dict, data: Dataset, device: torch.device,
                out: Path, reporter: Reporter, stop: Optional[StopFlag] = None) -> None:
    """model.pt of the winner: retrained exactly as it was evaluated (same seed, same budget, the
    weights of its best epoch), so the file is the network whose accuracies are reported."""
    cfg = search.cfg
    reporter.line("Exporting the best network (retraining it) ...")
    outcome, result = train_candidate(cfg, model, best["genome"], best["seed"], data, device, test_from=-math.inf,
                                      stop=stop, rung=Rung(best["max_epochs"]))
    if result is None or outcome.status != "ok":
        raise UserError(f"retraining the best network failed ({outcome.reason}): model.pt not written")
    assert result.model is not None, "a training returns its network"
    save_model(out / "model.pt", result.model,
               candidate_config(cfg, model, best["genome"], best["seed"], best["max_epochs"]), data)
    test = f", test {result.test_accuracy:.4f}" if result.test_accuracy is not None else ", no test split"
    reporter.line(f"Wrote {out / 'model.pt'} (validation {result.val_accuracy:.4f}{test})")
