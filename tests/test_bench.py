"""The benchmark's own plumbing (its figures are measured by bench/, never asserted here)."""

import hashlib
import json
import os
import signal
import subprocess
import sys
import tarfile
import time

import pytest

from util import REPO

from towerlab.errors import UserError


def _bench(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO / "bench" / "speed" / "run.py"), *args], capture_output=True, text=True,
                          cwd=REPO, timeout=120)


# The records, not the runs' folders beside them (git ignores those: a run's own files, kept for --reuse).
RUNS_FOLDERS = {"quick", "search-runs", "sampler-runs", "pruning-runs", "lcbench-runs", "rbv2-runs"}
RECORDS = sorted(path for path in (REPO / "bench" / "results").rglob("*.json")
                 if not RUNS_FOLDERS & set(path.relative_to(REPO / "bench" / "results").parts))


@pytest.mark.parametrize("path", RECORDS, ids=lambda path: str(path.relative_to(REPO / "bench" / "results")))
def test_every_record_holds_its_figures_in_one_shape(path):
    """A record's figures (where it has any: the oldest records predate them) are a list of objects, each
    with its `id`, its `value` and, where it has more to say, its `detail` object: one shape for every
    reader (bench/tables.py, the docs). Four records once held them as a dict keyed by id."""
    record = json.loads(path.read_text())
    figures = record.get("figures", [])
    assert isinstance(figures, list)
    for figure in figures:
        assert isinstance(figure, dict) and isinstance(figure.get("id"), str) and "value" in figure, figure
        assert isinstance(figure.get("detail", {}), dict), figure["id"]


@pytest.mark.parametrize("path", RECORDS, ids=lambda path: str(path.relative_to(REPO / "bench" / "results")))
def test_every_record_says_what_it_ran_on(path):
    """`machine`: what bench.common.machine.describe() gave, or, for the nine records written before every
    script recorded it, what the record's own fields and notes say, and why the rest is unknown."""
    machine = json.loads(path.read_text()).get("machine")
    assert isinstance(machine, dict) and machine or isinstance(machine, str) and machine.startswith("unknown: ")


def test_a_record_is_written_whole_with_its_machine_and_figures(tmp_path):
    """bench/common/record.py: every script's one writer. A record lands whole under its name (nothing
    else left in the folder); a write that fails midway leaves the record before it as it was."""
    from bench.common.record import figure, write_record

    record = {"machine": {"cpu_model": "test"}, "figures": [figure("a", 1.5, {"n": 3}), figure("b", None)]}
    path = write_record(tmp_path / "family", "r.json", record)
    assert path == tmp_path / "family" / "r.json" and json.loads(path.read_text()) == record
    assert [p.name for p in path.parent.iterdir()] == ["r.json"]

    class Unwritable:
        def __str__(self):
            raise RuntimeError("cannot be written")

    with pytest.raises(RuntimeError, match="cannot be written"):
        write_record(path.parent, "r.json", {**record, "more": [1, Unwritable()]})
    assert json.loads(path.read_text()) == record and [p.name for p in path.parent.iterdir()] == ["r.json"]


@pytest.mark.parametrize("record, says", [
    ({"figures": []}, "no 'machine'"),
    ({"machine": {"cpu_model": "test"}, "figures": {"a": 1}}, "'figures' is a list"),
    ({"machine": {"cpu_model": "test"}}, "'figures' is a list"),
    ({"machine": "unknown: not recorded", "figures": [{"value": 1}]}, "without its 'id'"),
    ({"machine": {"cpu_model": "test"}, "figures": [{"id": "a", "value": 1, "detail": 3}]}, "figure a: its 'detail'"),
    ({"machine": {"cpu_model": "test"}, "figures": [{"id": "a", "value": 1}, {"id": "a", "value": 2}]}, "figure a twice"),
])
def test_a_record_without_its_machine_or_its_figures_as_a_list_is_refused_before_writing(record, says, tmp_path):
    from bench.common.record import write_record

    with pytest.raises(ValueError, match=says):
        write_record(tmp_path, "r.json", record)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("suite, group, data", [("cpu", "mnist_tta", "mnist"), ("gpu", "lenet5_tta", "mnist"),
                                               ("gpu", "search", "mnist"), ("gpu", "cifar94", "cifar10")])
def test_a_figure_group_needs_only_the_data_it_reads(suite, group, data, tmp_path):
    (tmp_path / f"{data}.npz").write_bytes(b"")  # the dry run only checks that the file is there
    done = _bench("--suite", suite, "--only", group, "--dry-run", "--data-dir", str(tmp_path))
    assert done.returncode == 0, done.stderr
    assert "all accepted by towerlab's parser" in done.stdout


def test_a_group_whose_data_is_missing_is_refused_naming_the_file(tmp_path):
    (tmp_path / "mnist.npz").write_bytes(b"")
    done = _bench("--suite", "gpu", "--only", "lenet5_tta", "cifarnet_tta", "--dry-run", "--data-dir", str(tmp_path))
    assert done.returncode == 2
    assert "cifar10.npz not found" in done.stderr and "cifarnet_tta" in done.stderr and "lenet5_tta" not in done.stderr


@pytest.mark.parametrize("flags", [["--no-pruning"], ["--sampler", "tpe", "--no-pruning", "--prune-places", "new"]])
def test_pruning_bench_refuses_no_pruning_without_another_sampler_or_with_places(flags, tmp_path):
    done = subprocess.run([sys.executable, str(REPO / "bench" / "quality" / "pruning.py"), *flags, "--out-dir", str(tmp_path)],
                          capture_output=True, text=True, cwd=REPO, timeout=120)
    assert done.returncode == 2
    assert "--no-pruning runs another sampler unpruned beside the unpruned GA" in done.stderr
    assert list(tmp_path.iterdir()) == []


def _pruning_record(seed: int, best: float) -> dict:
    """A record as bench/quality/pruning.py --smoke writes it, older form (no waiting, pick or retraining),
    its unpruned GA at half `best` after 10 s of training and at `best` after 30 s, of 40 s in all."""
    side = {"command": ["towerlab", "evolve"], "best": best, "trained_to_the_end": 2, "train_seconds": 40.0,
            "trainings": 2, "evaluations": 2, "wall_seconds": 25.0, "parts": 1, "best_test_accuracy": 0.5}
    return {"date": "2026-11-23 10:00:00", "dataset": "synthetic",
            "budget": {"population": 6, "generations": 2, "max_epochs": 3, "patience": 3},
            "seeds": [{"seed": seed, "noise": 0.01, "unpruned": side, "pruned": side,
                       "curves": {"unpruned": [[10.0, best / 2, 1], [30.0, best, 2]], "pruned": []}}]}


@pytest.mark.parametrize("seeds, dataset, message", [(["1"], [], "no seed 1 in it (it has 0)"),
                                                     (["0"], ["--dataset", "mnist"], "its unpruned GA ran on synthetic")])
def test_pruning_bench_refuses_a_recorded_unpruned_side_that_does_not_fit_before_running(seeds, dataset, message,
                                                                                         tmp_path):
    path = tmp_path / "record.json"
    path.write_text(json.dumps(_pruning_record(0, 0.9)))
    smoke = [] if dataset else ["--smoke"]
    done = subprocess.run([sys.executable, str(REPO / "bench" / "quality" / "pruning.py"), *smoke, *dataset, "--seeds", *seeds,
                           "--sampler", "random", "--no-pruning", "--unpruned-from", str(path),
                           "--out-dir", str(tmp_path / "out")], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1].startswith(f"pruning.py: error: --unpruned-from {path}: ")
    assert message in done.stderr and not (tmp_path / "out").exists()


@pytest.mark.slow
def test_pruning_bench_reads_the_unpruned_ga_from_a_record_and_runs_only_the_other_side(tmp_path):
    """--unpruned-from: the GA side's curve, figures and noise come from the record; no GA runs; the
    other sampler's times are measured against the recorded curve."""
    path = tmp_path / "record.json"
    path.write_text(json.dumps(_pruning_record(0, 0.05)))  # a best any network reaches: its time is measured
    out = tmp_path / "out"
    done = subprocess.run([sys.executable, str(REPO / "bench" / "quality" / "pruning.py"), "--smoke", "--sampler", "random",
                           "--no-pruning", "--retrain", "0", "--unpruned-from", str(path), "--data-dir",
                           str(tmp_path), "--out-dir", str(out)], capture_output=True, text=True, cwd=REPO, timeout=300)
    assert done.returncode == 0, done.stderr
    assert [p.name for p in (out / "pruning-runs").iterdir()] == ["synthetic-unpruned-random-s0"]
    (saved,) = out.glob("pruning-unpruned-random-synthetic-*.json")
    record = json.loads(saved.read_text())
    assert record["unpruned_from"] == {"record": "record.json", "date": "2026-11-23 10:00:00"}
    (row,) = record["seeds"]
    assert row["target"] == 0.05 and row["noise"] == 0.01 and row["unpruned"]["train_seconds"] == 40.0
    assert row["seconds_to_target"]["unpruned"] == 30.0 and row["seconds_to_within_noise"]["unpruned"] == 30.0
    ran = row["pruned"]
    assert ran["command"][:3] == ["towerlab", "search", "run"] and "--sampler" in ran["command"]
    assert row["ratio"] == pytest.approx(row["seconds_to_target"]["pruned"] / 30.0)
    assert row["within_noise_of_unpruned_training"] == pytest.approx(row["seconds_to_within_noise"]["pruned"] / 40.0)
    assert row["unpruned_best_at_pruned_training"] == (0.05 if ran["train_seconds"] >= 30 else
                                                       0.025 if ran["train_seconds"] >= 10 else None)
    assert "the unpruned GA read from" in done.stdout


def test_pruning_bench_refuses_fewer_than_one_generation_before_running(tmp_path):
    done = subprocess.run([sys.executable, str(REPO / "bench" / "quality" / "pruning.py"), "--smoke", "--generations", "0",
                           "--out-dir", str(tmp_path)], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1] == "pruning.py: error: --generations 0: a search has at least 1 generation"
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_pruning_bench_gives_the_second_side_its_own_generations(tmp_path):
    """--generations N: the pruned search runs N generations (one --generations in its command), the
    GA side keeps the budget's, and the folder, the record's name and its pruning settings say N."""
    path = tmp_path / "record.json"
    path.write_text(json.dumps(_pruning_record(0, 0.05)))
    out = tmp_path / "out"
    done = subprocess.run([sys.executable, str(REPO / "bench" / "quality" / "pruning.py"), "--smoke", "--sampler", "random",
                           "--generations", "3", "--retrain", "0", "--unpruned-from", str(path), "--data-dir",
                           str(tmp_path), "--out-dir", str(out)], capture_output=True, text=True, cwd=REPO, timeout=300)
    assert done.returncode == 0, done.stderr
    folder = out / "pruning-runs" / "synthetic-pruned-random-g3-s0"
    assert list((out / "pruning-runs").iterdir()) == [folder]
    (saved,) = out.glob("pruning-random-g3-synthetic-*.json")
    record = json.loads(saved.read_text())
    assert record["budget"]["generations"] == 2
    assert record["pruning"] == {"min_epochs": 1, "prune_factor": 3, "sampler": "random", "generations": 3}
    command = record["seeds"][0]["pruned"]["command"]
    assert command.count("--generations") == 1 and command[command.index("--generations") + 1] == "3"
    assert json.loads((folder / "summary.json").read_text())["generations"] == 3


@pytest.mark.slow
def test_cifar94_smoke_budget_runs_on_a_cpu_and_records_the_spread_beside_the_record(tmp_path):
    done = subprocess.run([sys.executable, str(REPO / "bench" / "gpu" / "cifar94.py"), "--budget", "smoke",
                           "--out-dir", str(tmp_path)], capture_output=True, text=True, cwd=REPO, timeout=300)
    assert done.returncode == 0, done.stderr
    (path,) = tmp_path.glob("cifar94-smoke-*.json")
    figure = json.loads(path.read_text())["figures"][0]
    runs = figure["samples"]["towerlab"]
    assert [r["command"][r["command"].index("--seed") + 1] for r in runs] == ["0", "1"]
    accuracies = [r["summary"]["test_accuracy"] for r in runs]
    assert figure["detail"]["test_accuracy"]["mean"] == pytest.approx(sum(accuracies) / 2)
    assert figure["detail"]["val_accuracy"]["n"] == 2 and figure["met"] is None  # a smoke run judges nothing
    assert "1.40 s" in figure["detail"]["record"]["measured_here"]
    assert "tunes on the test set" in done.stdout


# A stand-in for airbench94_muon.py: it reads the data cifar94.py writes for it and prints its table's
# rows as the real one does (a warm-up run, then one `eval` row per run).
FAKE_AIRBENCH = """
import torch
train, test = torch.load("cifar10/train.pt"), torch.load("cifar10/test.pt")
assert tuple(train["images"].shape) == (40, 32, 32, 3) and train["images"].dtype == torch.uint8
assert test["labels"].dtype == torch.int64 and len(train["classes"]) == 10
def row(*cells):
    print("|" + "|".join(f"  {c}  " for c in cells) + "|")
row("warmup", "eval", "", "", "0.1000", "9.0000")
for run in range(200):
    row(run, 0, "0.5000", "0.6000", "", "1.0000")
    row("", "eval", "", "", f"{0.93 + run / 100:.4f}", f"{1.5 + run / 10:.4f}")
"""


@pytest.mark.slow
def test_cifar94_runs_airbench_first_with_its_runs_cut_and_judges_against_its_median(tmp_path):
    import numpy as np

    rng = np.random.default_rng(0)
    np.savez(tmp_path / "cifar10.npz", x_train=rng.integers(0, 256, (40, 32, 32, 3), dtype=np.uint8),
             y_train=rng.integers(0, 10, 40, dtype=np.uint8), x_test=rng.integers(0, 256, (20, 32, 32, 3), dtype=np.uint8),
             y_test=rng.integers(0, 10, 20, dtype=np.uint8))
    (tmp_path / "airbench94_muon.py").write_text(FAKE_AIRBENCH)
    done = subprocess.run([sys.executable, str(REPO / "bench" / "gpu" / "cifar94.py"), "--budget", "smoke", "--airbench",
                           str(tmp_path / "airbench94_muon.py"), "--airbench-runs", "3", "--data-dir", str(tmp_path),
                           "--out-dir", str(tmp_path / "out")], capture_output=True, text=True, cwd=REPO, timeout=300)
    assert done.returncode == 0, done.stderr
    (path,) = (tmp_path / "out").glob("cifar94-smoke-*.json")
    record = json.loads(path.read_text())
    detail = record["figures"][0]["detail"]
    assert [r["accuracy"] for r in detail["airbench94_muon"]["runs"]] == [0.93, 0.94, 0.95]  # warm-up left out
    assert detail["airbench94_muon_accuracy"] == pytest.approx(0.94)
    assert detail["airbench94_muon_seconds"] == pytest.approx(1.6)  # the median of 1.5, 1.6, 1.7
    assert record["figures"][0]["target_value"] == pytest.approx(1.6)
    assert "AIRBENCH" in record["command"] and str(tmp_path) not in " ".join(record["command"])
    assert "airbench94_muon      0.9400 mean test accuracy, median 1.600 s, 3 runs" in done.stdout


@pytest.mark.slow
def test_an_interrupted_search_run_is_continued_keeping_what_it_recorded(tmp_path):
    """bench/quality/search_runs.py: a run killed mid-search is continued by --reuse (towerlab --resume), not
    started over; its record says it ran in two parts."""
    out = tmp_path / "run"
    flags = ["--space", "mlp", "--dataset", "synthetic", "--population", "4", "--generations", "4", "--max-epochs",
             "2", "--remeasure", "0", "--device", "cpu", "--devices", "1", "--threads", "1", "--seed", "0"]
    call = (f"import sys; sys.path.insert(0, {str(REPO)!r}); from bench.quality import search_runs; import pathlib; "
            f"search_runs.run_search(['evolve'], {flags!r}, pathlib.Path({str(out)!r}), {str(tmp_path)!r})")
    first = subprocess.Popen([sys.executable, "-c", call], cwd=REPO, start_new_session=True,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    from bench.quality import search_runs
    from towerlab.search import evaluation_records

    def recorded() -> bool:
        try:
            return (out / "search.db").exists() and bool(evaluation_records(out / "search.db"))
        except UserError as e:  # the file made, its tables not yet
            assert "holds no search yet" in str(e)
            return False

    deadline = time.monotonic() + 120
    while not recorded():
        assert first.poll() is None and time.monotonic() < deadline
        time.sleep(0.1)
    os.killpg(first.pid, signal.SIGKILL)
    first.wait()
    kept = evaluation_records(out / "search.db")
    assert not (out / "summary.json").exists() and "wall_seconds" not in json.loads((out / "bench-run.json").read_text())

    run = search_runs.run_search(["evolve"], flags, out, str(tmp_path), reuse=True)
    assert run["parts"] == 2 and run["summary"]["generations"] == 4
    assert [(r["id"], r["val_accuracy"]) for r in run["records"][:len(kept)]] == \
        [(r["id"], r["val_accuracy"]) for r in kept]
    assert len(run["records"]) > len(kept)
    record = json.loads((out / "bench-run.json").read_text())
    assert len(record["parts"]) == 1 and record["wall_seconds"] >= record["parts"][0] >= 0


def test_the_best_curve_counts_every_rung_in_the_seconds_and_reads_a_budget_back():
    """bench/quality/search_runs.py: training seconds include every rung and re-measure; the best so far and the
    best within a training budget read only first measurements at the full epochs."""
    from bench.quality import search_runs

    def record(seconds, epochs, accuracy, replicate=0, status="ok"):
        return {"seconds": seconds, "max_epochs": epochs, "val_accuracy": accuracy, "replicate": replicate,
                "status": status}

    records = [record(10, 1, 0.99), record(30, 3, 0.5), record(100, 3, 0.6), record(40, 3, 0.7, replicate=1),
               record(5, 3, None, status="failed"), record(20, 3, 0.55)]
    curve = search_runs.best_so_far(records, 3)
    assert curve == [(40, 0.5, 1), (140, 0.6, 2), (185, 0.6, 3), (205, 0.6, 4)]
    assert search_runs.seconds_to_reach(curve, 0.6) == 140 and search_runs.seconds_to_reach(curve, 0.7) is None
    assert search_runs.best_by(curve, 39) is None
    assert search_runs.best_by(curve, 139) == 0.5 and search_runs.best_by(curve, 140) == 0.6


@pytest.mark.slow
def test_a_pick_retrained_with_the_searchs_seed_gets_the_searchs_accuracy_and_a_cache_is_read_back(tmp_path):
    """bench/quality/search_runs.retrain trains a network as the search trained it: with the seed the search
    gave it, the same validation accuracy, to the last digit. A cache holding the same pick, settings
    and seeds is read back; another seed trains again."""
    from bench.quality import search_runs

    out = tmp_path / "run"
    flags = ["--space", "mlp", "--dataset", "synthetic", "--population", "3", "--generations", "1", "--max-epochs",
             "2", "--remeasure", "0", "--device", "cpu", "--devices", "1", "--threads", "1", "--seed", "3"]
    run = search_runs.run_search(["evolve"], flags, out, str(tmp_path))
    search = json.loads((out / "config.json").read_text())["search"]
    settings = {k: search[k] for k in search_runs.TRAINING_SETTINGS}
    (best,) = [r for r in run["records"] if r["genome"] == run["summary"]["best_genome"]]
    cache = tmp_path / "retrain.json"
    (again,) = search_runs.retrain(best["genome"], settings, [best["seed"]], str(tmp_path), processes=1, cache=cache)
    assert again["val_accuracy"] == best["val_accuracy"] and again["seed"] == best["seed"]
    assert 0 < again["test_accuracy"] <= 1

    kept = json.loads(cache.read_text())
    kept["runs"][0]["val_accuracy"] = -1.0  # a value no training gives: only reading the cache returns it
    cache.write_text(json.dumps(kept))
    assert search_runs.retrain(best["genome"], settings, [best["seed"]], str(tmp_path), cache=cache)[0][
        "val_accuracy"] == -1.0
    (other,) = search_runs.retrain(best["genome"], settings, [best["seed"] + 1], str(tmp_path), processes=1,
                                   cache=cache)
    assert 0 <= other["val_accuracy"] <= 1 and json.loads(cache.read_text())["key"]["seeds"] == [best["seed"] + 1]


@pytest.mark.slow
def test_retrain_refuses_a_genome_it_cannot_read_and_reuse_trains_only_what_its_record_lacks(tmp_path):
    """bench/quality/retrain.py: a genome it cannot read is one line and exit 2, nothing written; with
    --reuse, a genome today's record holds (same settings, seeds, threads) is read back, and only
    the others are trained."""
    script = [sys.executable, str(REPO / "bench" / "quality" / "retrain.py"), "--dataset", "synthetic", "--val-size", "1000",
              "--max-epochs", "1", "--seeds", "1", "--devices", "1", "--data-dir", str(tmp_path), "--out-dir",
              str(tmp_path / "out")]
    done = subprocess.run([*script, "neurons=64,layers"], capture_output=True, text=True)
    assert done.returncode == 2 and "'neurons=64,layers' is not gene=value" in done.stderr
    assert not (tmp_path / "out").exists()

    first, second = "neurons=64,layers=1,activation=relu,optimizer=adam", "neurons=64,layers=2,activation=elu,optimizer=sgd"
    subprocess.run([*script, first], check=True, capture_output=True)
    (path,) = (tmp_path / "out").glob("retrain-synthetic-*.json")
    record = json.loads(path.read_text())
    record["genomes"][0]["runs"][0]["val_accuracy"] = -1.0  # no training gives it: only reading it back does
    path.write_text(json.dumps(record))
    subprocess.run([*script, "--reuse", first, second], check=True, capture_output=True)
    genomes = json.loads(path.read_text())["genomes"]
    assert genomes[0]["val"]["values"] == [-1.0] and 0 <= genomes[1]["val"]["values"][0] <= 1
    assert [g["genome"]["layers"] for g in genomes] == [1, 2]


def test_the_waits_of_a_runs_workers_are_counted_inside_and_between_generations():
    """bench/quality/search_runs.py: worker-seconds not trained inside each generation's span (start =
    finished_at - seconds) and between one generation's last training and the next one's first."""
    from bench.quality import search_runs

    def record(worker, generation, seconds, finished):
        return {"worker": worker, "generation": generation, "seconds": seconds,
                "finished_at": f"2026-11-24T05:00:{finished:02d}+00:00"}

    records = [record("a", 0, 10, 10), record("a", 0, 5, 20), record("b", 0, 12, 12),  # 2 x 20 s, 27 trained
               record("a", 1, 4, 40), record("b", 1, 3, 39), record("b", 1, 2, 41)]  # from 36 s: 2 x 5 s, 9
    assert search_runs.waiting(records) == {"workers": 2, "inside_generations": 14.0, "between_generations": 32.0}


@pytest.mark.parametrize("workers_runs, serial_runs, expected", [(30, 30, "api"), (10, 30, "serial"), (30, None, "api"),
                                                                 (None, 10, "serial")])
def test_lcbench_takes_the_default_and_the_pruned_default_from_their_workers_unless_one_process_ran_more(
        workers_runs, serial_runs, expected):
    """bench/quality/lcbench.py: the default's figures and the pruned default's are chosen by one rule: the arm on its
    workers (towerlab.api.search) unless the arm played in one process has more runs."""
    from bench.quality import lcbench

    def arm(runs, value):
        return {"runs": runs, "points": {"0.25": value, "0.5": value, "1.0": value},
                "per_seed": {p: {"0": value} for p in ("0.25", "0.5", "1.0")}, "sampler_seconds": None}

    arms = {}
    for api, serial in (("towerlab", "towerlab-serial"), ("towerlab-m1-api", "towerlab-m1")):
        if workers_runs is not None:
            arms[api] = arm(workers_runs, 0.1)
        if serial_runs is not None:
            arms[serial] = arm(serial_runs, 0.2)
    figures = {f["id"]: f for f in lcbench.figures({"arms": arms})}
    value = {"api": 0.1, "serial": 0.2}[expected]
    assert figures["lcbench_regret_default_50"]["value"] == value
    assert figures["lcbench_regret_pruned_m1_100"]["value"] == value
    assert "lcbench_regret_pruned_m4_100" not in figures


def test_rbv2_carries_every_arm_of_a_record_naming_the_record_that_measured_it():
    """bench/quality/rbv2_xgboost.py --carry: the arms the carried record took from an earlier one come along too,
    each naming the record that ran it; an arm run again now is the carried one's "ARM-before"."""
    from bench.quality import rbv2_xgboost

    carried = {"name": "r2", "arms": {"tpe": {"what": "TPE", "carried": "r1"}, "gp": {"what": "GP", "carried": "r1"},
                                      "towerlab": {"what": "default"}}}
    assert rbv2_xgboost._carried_arms(carried, {"gp"}) == {
        "tpe": {"what": "TPE", "carried": "r1"}, "gp-before": {"what": "GP: before, as r1 measured it", "carried": "r1"},
        "towerlab": {"what": "default", "carried": "r2"}}


@pytest.mark.slow
def test_the_image_folder_bench_records_the_peak_rss_of_both_sides(tmp_path):
    """bench/speed/image_folder.py large on a tiny folder: it writes the folder, decodes it, trains twice in
    fresh processes and records each side's peak RSS beside the cache's size (its numbers are the
    bench's, never asserted here)."""
    done = subprocess.run([sys.executable, str(REPO / "bench" / "speed" / "image_folder.py"), "large", "--images", "90",
                           "--side", "24", "--held", "9", "--folder", str(tmp_path / "folder"),
                           "--cache-dir", str(tmp_path / "cache"), "--out-dir", str(tmp_path), "--quiet-wait", "0"],
                          capture_output=True, text=True, cwd=REPO, timeout=600)
    assert done.returncode == 0, done.stderr
    (path,) = tmp_path.glob("image-folder-large-*.json")
    record = json.loads(path.read_text())
    figures = {f["id"]: f for f in record["figures"]}
    assert figures["cache_bytes"]["value"] == 90 * 3 * 24 * 24 + 128  # the .npy's header, then pixels
    assert {side: (run["release"], run["n_train"], run["n_val"], run["n_test"]) for side, run in record["runs"].items()} \
        == {"released": (True, 72, 9, 9), "kept": (False, 72, 9, 9)}
    assert all(figures[k]["value"] > 0 for k in ("peak_rss_bytes", "peak_rss_bytes_pages_kept"))


def _session(*args, env=None, tmp_path):
    return subprocess.run(["bash", str(REPO / "bench" / "gpu" / "session.sh"), *args], capture_output=True, text=True,
                          cwd=tmp_path, timeout=600, env={**os.environ, "PYTHON": sys.executable, **(env or {})})


@pytest.fixture
def session_data(tmp_path):
    """What `session.sh prepare` gets: a data folder (a tiny cifar10.npz, an empty mnist.npz: the dry
    runs only look for it) and a stand-in airbench94_muon.py; the digest of that cifar10.npz."""
    import numpy as np

    data = tmp_path / "data"
    data.mkdir()
    rng = np.random.default_rng(0)
    np.savez(data / "cifar10.npz", x_train=rng.integers(0, 256, (40, 32, 32, 3), dtype=np.uint8),
             y_train=rng.integers(0, 10, 40, dtype=np.uint8), x_test=rng.integers(0, 256, (20, 32, 32, 3), dtype=np.uint8),
             y_test=rng.integers(0, 10, 20, dtype=np.uint8))
    (data / "mnist.npz").write_bytes(b"")
    (tmp_path / "airbench94_muon.py").write_text(FAKE_AIRBENCH)
    return data, hashlib.sha256((data / "cifar10.npz").read_bytes()).hexdigest()


@pytest.mark.slow
def test_the_gpu_session_script_prepares_the_pieces_and_runs_every_part_dry_on_a_cpu(tmp_path, session_data):
    data, digest = session_data
    dest = tmp_path / "gpu"
    done = _session("prepare", str(data), str(tmp_path / "airbench94_muon.py"), str(dest), tmp_path=tmp_path)
    assert done.returncode == 0, done.stderr
    pieces = sorted(dest.glob("cifar10.npz.?"))
    assert [p.name[-1] for p in pieces] == ["0", "1", "2", "3"]
    assert b"".join(p.read_bytes() for p in pieces) == (data / "cifar10.npz").read_bytes()
    dry = {"GPU_SESSION_DRY": "1", "CIFAR_RUNS": "2", "CIFAR10_SHA256": digest}
    for part in ("mnist", "search", "cifar"):
        out = tmp_path / f"out-{part}"
        done = _session(part, str(dest), str(out), env=dry, tmp_path=tmp_path)
        assert done.returncode == 0, done.stdout + done.stderr
        assert sorted(p.name for p in out.iterdir()) == [f"{part}.tar.gz", "session.log"]  # 2 files come back
        log = (out / "session.log").read_text()
        assert ": exit 0 after" in log and ": exit 1" not in log and ": exit 124" not in log
        with tarfile.open(out / f"{part}.tar.gz") as tar:
            names = tar.getnames()
        assert "./machine.log" in names and any(n.endswith(".log") and "machine" not in n for n in names)
    assert (dest / "cifar10.npz").read_bytes() == (data / "cifar10.npz").read_bytes()  # joined there
    with tarfile.open(tmp_path / "out-cifar" / "cifar.tar.gz") as tar:
        record = json.load(tar.extractfile(next(n for n in tar.getnames() if "/cifar94/cifar94-" in n)))
        early = json.load(tar.extractfile(next(n for n in tar.getnames() if "airbench94_muon-" in n)))
    detail = record["figures"][0]["detail"]
    assert len(detail["airbench94_muon"]["runs"]) == 2 and detail["test_accuracy"]["n"] == 2
    assert detail["step"] == ["eager", "eager"] and set(detail["clocks"]) >= {"both", "airbench94_muon_only"}
    assert early["airbench94_muon"]["runs"] == detail["airbench94_muon"]["runs"]


@pytest.mark.slow
def test_the_gpu_session_cifar_part_names_missing_pieces_and_refuses_a_wrong_digest(tmp_path, session_data):
    data, digest = session_data
    dest = tmp_path / "gpu"
    assert _session("prepare", str(data), str(tmp_path / "airbench94_muon.py"), str(dest), tmp_path=tmp_path).returncode == 0
    (dest / "cifar10.npz.2").unlink()
    done = _session("cifar", str(dest), str(tmp_path / "out"), env={"GPU_SESSION_DRY": "1"}, tmp_path=tmp_path)
    assert done.returncode == 3 and "missing on this machine: .gpu/cifar10.npz.2" in done.stdout
    assert _session("prepare", str(data), str(tmp_path / "airbench94_muon.py"), str(dest), tmp_path=tmp_path).returncode == 0
    done = _session("cifar", str(dest), str(tmp_path / "out2"), env={"GPU_SESSION_DRY": "1", "CIFAR10_SHA256": "0" * 64},
                    tmp_path=tmp_path)
    assert done.returncode == 3 and "SHA-256 is not" in done.stdout and not (dest / "cifar10.npz").exists()
    assert _session("warm", str(dest), str(tmp_path / "out3"), tmp_path=tmp_path).returncode == 2
