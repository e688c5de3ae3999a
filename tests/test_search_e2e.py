"""The search with real training: parallel workers, outputs, resume and bad input."""

import contextlib
import json
import sqlite3

import pytest

import torch

from towerlab.cli import main
from towerlab.config import SearchConfig
from towerlab.distributed.env import device_name
from towerlab.objective.candidate import train_config_hash
from towerlab.models.files import load_model
from towerlab.search import evaluation_records
from util import ONE_CPU, search_rows

SPACE = """
model = "mlp"
[genes]
neurons = [16, 32, 64]
layers = [1, 2]
activation = ["relu", "tanh", "sigmoid"]
optimizer = ["adam", "sgd", "rmsprop"]
"""
# 6,000 synthetic images, 1,000 of them for validation; one epoch per candidate; 1 thread each,
# so that one worker and two workers do the very same arithmetic.
BASE = [*ONE_CPU, "--dataset", "synthetic", "--val-size", "1000", "--max-epochs", "1", "--threads", "1", "--no-progress"]


@pytest.fixture()
def space_file(tmp_path):
    path = tmp_path / "space.toml"
    path.write_text(SPACE)
    return str(path)


def _history(out):
    summary = json.loads((out / "summary.json").read_text())
    stats = [{k: v for k, v in s.items() if "seconds" not in k} for s in summary["generation_stats"]]
    top = [(t["genome"], t["val_accuracy"], t["test_accuracy"]) for t in summary["top"]]
    return stats, top, summary


@pytest.mark.slow
def test_two_workers_give_the_history_of_one_worker(tmp_path, space_file):
    args = ["evolve", *BASE, "--space", space_file, "--population", "6", "--generations", "3", "--seed", "7",
            "--remeasure", "2"]
    assert main([*args, "--out", str(tmp_path / "one")]) == 0
    assert main([*args, "--devices", "2", "--out", str(tmp_path / "two")]) == 0
    one, two = _history(tmp_path / "one"), _history(tmp_path / "two")
    assert one[:2] == two[:2]
    assert two[2]["workers"] == 2 and one[2]["workers"] == 1
    workers = {json.loads(line)["generation"] for line in (tmp_path / "two" / "generations.jsonl").read_text().splitlines()}
    assert workers == {1, 2, 3}  # numbered from 1, as the console numbers them
    summary = two[2]
    assert summary["evaluations"] + summary["cache_hits"] == 6 * 3
    # the winner ranks by its mean over 3 seeds (its evaluation's and 2 re-measures')
    best = summary["top"][0]
    assert summary["best_val_accuracy"] == best["val_accuracy"] == pytest.approx(sum(best["val_accuracies"]) / 3)
    assert best["val_accuracies"][0] <= max(s["best"] for s in one[0])  # its evaluation: a member's fitness


# Real-shaped work: MNIST-sized images and layers wide enough that torch splits their matrix
# products over threads (on 2 threads, such a candidate does not score what it scores on 1).
WIDE_SPACE = """
model = "mlp"
[genes]
neurons = [384, 768]
layers = [1, 2]
activation = ["relu", "tanh"]
optimizer = ["adam", "nadam"]
"""


@pytest.mark.slow
def test_a_search_with_default_settings_trains_the_same_rows_on_one_and_two_workers(tmp_path):
    """The promise of issue 43, with no --threads: a candidate trains on one thread whatever the
    number of workers (on 2 cores, 1 worker used to get 2 threads and 2 workers 1 each), so every
    stored training is bit for bit the same; and the threads are part of the cache key."""
    space = tmp_path / "wide.toml"
    space.write_text(WIDE_SPACE)
    args = ["evolve", "--device", "cpu", "--dataset", "synthetic", "--val-size", "600",
            "--max-epochs", "1", "--no-progress", "--space", str(space), "--population", "4", "--generations", "2",
            "--seed", "1", "--remeasure", "0", "--top", "1"]
    assert main([*args, "--devices", "1", "--out", str(tmp_path / "one")]) == 0
    assert main([*args, "--devices", "2", "--out", str(tmp_path / "two")]) == 0
    rows = search_rows(tmp_path / "one")
    assert len(rows) >= 4 and all(status == "ok" for *_, status, _, _ in rows)
    assert search_rows(tmp_path / "two") == rows
    records = evaluation_records(tmp_path / "two" / "search.db")
    assert {(r["device"], r["threads"], r["precision"], r["torch_version"]) for r in records} == {
        (device_name(torch.device("cpu")), 1, "fp32", torch.__version__)}
    assert json.loads((tmp_path / "two" / "summary.json").read_text())["numerics"] == [
        {"device": device_name(torch.device("cpu")), "threads": 1, "precision": "fp32", "torch": torch.__version__}]
    configs = [json.loads((tmp_path / name / "config.json").read_text())["run"] for name in ("one", "two")]
    assert [c["threads"] for c in configs] == [1, 1]
    # Two threads per candidate compute other sums: such a search keeps its rows apart in a store.
    assert train_config_hash(SearchConfig(), "cpu", 2) != train_config_hash(SearchConfig(), "cpu", 1)
    assert train_config_hash(SearchConfig(), "cuda", 2) == train_config_hash(SearchConfig(), "cuda", 1)


def test_a_candidates_curve_is_its_validation_accuracy_after_each_epoch():
    from towerlab.objective.candidate import curve_of

    history = [{"epoch": 1, "step": 5, "val_loss": 0.9, "val_accuracy": 0.5},  # an extra evaluation mid-epoch
               {"epoch": 1, "step": 10, "val_loss": 0.8, "val_accuracy": 0.6},
               {"epoch": 2, "step": 20, "val_loss": float("nan"), "val_accuracy": 0.7}]
    assert curve_of(history) == [{"epoch": 1, "val_accuracy": 0.6, "val_loss": 0.8},
                                 {"epoch": 2, "val_accuracy": 0.7, "val_loss": None}]
    assert curve_of([]) is None and curve_of([{"epoch": 1, "val_accuracy": None, "val_loss": None}]) is None


def test_a_candidates_cost_is_its_forward_flops_times_its_epochs():
    from towerlab.objective.candidate import estimated_cost

    genome = {"neurons": 64, "layers": 3, "activation": "relu"}  # 784 -> 64 -> 64 -> 64 -> 10, 2 FLOPs a weight
    flops = 2 * (784 * 64 + 64 * 64 + 64 * 64 + 64 * 10)
    assert estimated_cost(SearchConfig(), "mlp", genome, (1, 28, 28), 10, 3) == flops * 3
    assert estimated_cost(SearchConfig(), "mlp", {**genome, "layers": 0}, (1, 28, 28), 10, 3) == 0.0  # cannot build


def test_counting_a_candidates_flops_hooks_nothing_that_other_threads_run():
    """A search worker's leader thread counts candidates while its main thread trains: the count must not
    reach the modules the other thread runs (torch's FlopCounterMode registers global module hooks)."""
    import threading

    from torch.nn.modules import module
    from towerlab.objective.candidate import estimated_cost

    inside, release, costs = threading.Event(), threading.Event(), []

    def blocking_model(input_shape, num_classes):
        class Waits(torch.nn.Linear):
            def forward(self, x):
                inside.set()
                release.wait(10)
                return super().forward(x)
        return torch.nn.Sequential(torch.nn.Flatten(), Waits(784, num_classes))

    counting = threading.Thread(target=lambda: costs.append(
        estimated_cost(SearchConfig(), blocking_model, {}, (1, 28, 28), 10, 1)))
    counting.start()
    assert inside.wait(10)
    global_hooks = len(module._global_forward_pre_hooks) + len(module._global_forward_hooks)
    release.set()
    counting.join()
    assert global_hooks == 0 and costs == [2 * 784 * 10]


@pytest.mark.slow
def test_a_pruned_search_on_two_workers_trains_what_one_worker_trains(tmp_path, space_file, capsys):
    """Two workers take a rung's certain places for the next rung while the rung still runs (the
    driver puts them on the queue as results come in): the same trainings, the same history as one worker,
    at the rungs the pruner's judge uses."""
    import sqlite3

    args = ["evolve", *BASE, "--space", space_file, "--population", "8", "--generations", "2", "--seed", "7",
            "--max-epochs", "3", "--min-epochs", "1", "--prune-factor", "2"]
    assert main([*args, "--out", str(tmp_path / "one")]) == 0
    assert ("Pruning where a rung ranks as the last does, judged on the generations before: rung 1 (1 epoch): "
            "0 of the 8 genomes it takes to judge, skipped\n") in capsys.readouterr().out  # a new search: none yet
    assert main([*args, "--devices", "2", "--out", str(tmp_path / "two")]) == 0
    one, two = _history(tmp_path / "one"), _history(tmp_path / "two")
    assert one[:2] == two[:2]

    def trainings(out):
        with sqlite3.connect(out / "search.db") as db:
            rows = sorted(db.execute("SELECT generation, idx, replicate, max_epochs, status, fitness, continued"
                                     " FROM evaluations"))
        db.close()
        return rows

    rows = trainings(tmp_path / "two")
    assert rows == trainings(tmp_path / "one")
    # the first generation trains every member to the end; the second prunes at 1 epoch where the first's
    # curves showed it ranks as the last (the pruner's judge: test_search_judge.py)
    from towerlab.search import Search, Store
    from towerlab.search.judge import Evidence

    with Store(tmp_path / "two" / "search.db") as store:
        search = Search.open(store, 1)
        evidence = Evidence(search.ladder.epochs, search.ladder.hashes, search.goal)
        evidence.add(store.records.own_history(1, 0, 1))
        judged = search.judgement(store)  # on both generations
    assert {epochs for generation, _, _, epochs, *_ in rows if generation == 0} == {3}
    # towerlab's own training reports its curve, the judge's evidence: the validation accuracy after each epoch
    with sqlite3.connect(tmp_path / "two" / "search.db") as db:
        curves = db.execute("SELECT fitness, curve FROM evaluations WHERE status = 'ok' AND generation = 0").fetchall()
    db.close()
    assert curves and all([p["epoch"] for p in json.loads(c)] == [1, 2, 3]
                          and f in [p["val_accuracy"] for p in json.loads(c)] for f, c in curves)
    assert {epochs for generation, _, _, epochs, *_ in rows if generation == 1} <= \
        {search.ladder.epochs[r] for r in evidence.judge().used}
    pruning = json.loads((tmp_path / "two" / "summary.json").read_text())["pruning"]
    assert judged is not None and pruning == judged.to_json() and [(p["rung"], p["epochs"]) for p in pruning] == [(0, 1)]
    assert pruning[0]["pairs"] > 0 and set(pruning[0]) == {"rung", "epochs", "correlation", "pairs",
                                                                "better_half_correlation", "used", "probed"}
    assert not pruning[0]["probed"]  # its curves are the evidence


RANKED = """
model = "mlp"
[genes]
neurons = [8, 16, 32, 64]
layers = [1]
optimizer = ["adam", "sgd"]
lr = [0.00001, 0.00003, 0.0001, 0.0003, 0.001, 0.003, 0.01]
"""  # learning rates far apart: 1 epoch ranks as 3 do, and the judge prunes there from the third generation


@pytest.mark.slow
def test_a_pruned_search_s_promotions_continue_their_checkpoints_on_one_worker_or_two(tmp_path):
    """Issue 73: towerlab's own training continues a promotion from the checkpoint its lower rung left in the
    trial folder (test_search_continued.py: to what a restart gives), its row says so, the budget counts its
    epochs once, and one worker or two write the same rows."""
    import sqlite3

    (tmp_path / "space.toml").write_text(RANKED)
    args = ["search", "run", "--sampler", "random", *BASE, "--space", str(tmp_path / "space.toml"), "--population",
            "8", "--generations", "3", "--seed", "7", "--max-epochs", "3", "--min-epochs", "1", "--prune-factor", "2",
            "--remeasure", "0"]
    for out, devices in (("one", "1"), ("two", "2")):
        assert main([*args, "--devices", devices, "--out", str(tmp_path / out)]) == 0

    def rows(out):
        with contextlib.closing(sqlite3.connect(tmp_path / out / "search.db")) as db:
            return sorted(db.execute("SELECT generation, idx, max_epochs, seed, genome_hash, fitness, continued"
                                     " FROM evaluations"))

    assert rows("one") == rows("two")
    promoted = [(g, i, seed, h) for g, i, epochs, seed, h, _, c in rows("one") if c == 1 and epochs == 3]
    assert len(promoted) >= 2 and all(c == 0 for *_, epochs, _, _, _, c in rows("one") if epochs == 1)
    assert all((g, i, 1) in {r[:3] for r in rows("one")} for g, i, _, _ in promoted)
    trials = next((tmp_path / "one" / "trials").glob("search-1-*"))
    for *_, seed, h in promoted:  # the last rung keeps no checkpoint: nothing will continue it
        assert (trials / f"{h[:12]}-seed{seed}").is_dir() and not list((trials / f"{h[:12]}-seed{seed}").iterdir())
    cost = json.loads((tmp_path / "one" / "summary.json").read_text())["cost"]["search"]
    assert cost["epochs"] == sum(epochs - c for _, _, epochs, *_, c in rows("one"))


def test_grid_writes_its_record_and_exports_the_winner(tmp_path, space_file, capsys):
    out = tmp_path / "grid"
    assert main(["grid", *BASE, "--space", space_file, "--limit", "4", "--top", "2", "--export-best",
                 "--remeasure", "2", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "Generation 1/1: evaluated 4, cached 0, failed 0" in printed and "Top 2 networks" in printed
    assert ("Budget: at most 4 trainings for the search, then about 4 to re-measure the networks about to be "
            "crowned (more when that reorders them) and at most 2 to test the top (none where each was tested as "
            "it trained): about 10 epochs of training") in printed
    assert "The first training took " in printed and "epochs on 1 worker(s) take about " in printed
    summary = json.loads((out / "summary.json").read_text())
    for key in ("best_genome", "best_val_accuracy", "best_test_accuracy", "evaluations", "cache_hits", "failures",
                "generations", "seconds", "workers"):
        assert key in summary
    assert (summary["evaluations"], summary["cache_hits"], summary["failures"], summary["generations"]) == (4, 0, 0, 1)
    assert len(summary["top"]) == 2 and summary["top"][0]["val_accuracy"] >= summary["top"][1]["val_accuracy"]
    assert summary["best_val_accuracy"] > 0.5 and summary["best_test_accuracy"] > 0.5
    # what it cost, by purpose: 4 trainings for the search; 2 fresh seeds for each network about to
    # be crowned (at least the top 2); the top networks not tested as they trained retrained for it
    # (ranked by their means, one may have been outside the top when it trained)
    cost = summary["cost"]
    remeasured = sum(1 for row in search_rows(out) if row[2] > 0)
    with sqlite3.connect(out / "search.db") as db:
        retrained = db.execute("SELECT COUNT(*) FROM tasks WHERE kind = 'test'").fetchone()[0]
    db.close()
    assert (cost["search"]["trainings"], cost["remeasure"]["trainings"], cost["test"]["trainings"]) == (
        4, remeasured, retrained)
    assert retrained <= 2 and all(t["test_accuracy"] is not None for t in summary["top"])
    assert remeasured >= 4 and cost["search"]["trainings"] + remeasured == summary["trainings"]
    assert cost["search"]["train_seconds"] > 0 and cost["remeasure"]["train_seconds"] > 0
    assert f"Trainings: 4 for the search ({cost['search']['train_seconds']:.1f} s), {remeasured} for re-measuring" in printed
    best = json.loads((out / "best.json").read_text())
    assert best["genome"] == summary["best_genome"] and best["command"].startswith("towerlab train --model mlp")
    assert (out / "fitness.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    model, record = load_model(out / "model.pt")
    assert record["options"]["neurons"] == summary["best_genome"]["neurons"]
    # `search show` reads it all back from the store
    assert main(["search", "show", str(out)]) == 0
    shown = capsys.readouterr().out
    assert "4 evaluations, 0 cache hits, 0 failures" in shown and f"{summary['best_test_accuracy']:.4f}" in shown


def test_retraining_the_winner_from_best_json_reproduces_its_accuracy(tmp_path, space_file):
    out = tmp_path / "grid"
    assert main(["grid", *BASE, "--space", space_file, "--limit", "2", "--remeasure", "2", "--out", str(out)]) == 0
    best = json.loads((out / "best.json").read_text())
    command = best["command"].split()[2:]
    # a CPU search's candidates train on 1 thread each: the command says so, and reproduces by itself
    assert command[-6:] == ["--devices", "1", "--device", "cpu", "--threads", "1"]
    assert main(["train", *command, "--no-progress", "--out", str(tmp_path / "again")]) == 0
    again = json.loads((tmp_path / "again" / "summary.json").read_text())
    # the command trains the evaluation's network (its seed is the first); the winner ranks by its mean
    assert best["seed"] == best["seeds"][0] and len(best["seeds"]) == 3
    assert again["val_accuracy"] == best["val_accuracies"][0] and again["test_accuracy"] == best["test_accuracy"]
    assert best["val_accuracy"] == pytest.approx(sum(best["val_accuracies"]) / 3)


@pytest.mark.slow
def test_the_top_is_tested_as_it_trains_and_only_the_rest_is_retrained(tmp_path, space_file):
    """A network that ends its training among the best so far is scored on the test split then, so the
    top needs no retraining at the end; a top network that this search did not train (the store's
    cache served it) is retrained for it, as before."""
    store = str(tmp_path / "shared.db")
    args = ["evolve", *BASE, "--space", space_file, "--population", "6", "--generations", "2", "--seed", "5",
            "--remeasure", "0", "--devices", "2", "--store", store]
    assert main([*args, "--top", "1", "--out", str(tmp_path / "first")]) == 0
    first = json.loads((tmp_path / "first" / "summary.json").read_text())
    assert first["cost"]["test"]["trainings"] == 0 and first["best_test_accuracy"] is not None
    with sqlite3.connect(store) as db:
        kinds = db.execute("SELECT kind, COUNT(*) FROM tasks GROUP BY kind").fetchall()
        # the test accuracy each training took, where it took one: the winner's is the one reported
        taken = {json.loads(r)["fitness"]: json.loads(r)["test_accuracy"] for (r,) in db.execute(
            "SELECT result FROM tasks WHERE kind = 'train'") if json.loads(r)["test_accuracy"] is not None}
    db.close()
    assert dict(kinds) == {"train": first["evaluations"]}
    assert taken[first["best_val_accuracy"]] == first["best_test_accuracy"]
    assert 1 <= len(taken) < first["evaluations"]  # only those entering the top when they ended
    # a second search of the same genomes: the cache serves all of them, and the top 3's two untested
    # networks are retrained for their test accuracy
    assert main([*args, "--top", "3", "--out", str(tmp_path / "second")]) == 0
    second = json.loads((tmp_path / "second" / "summary.json").read_text())
    assert (second["evaluations"], second["cost"]["test"]["trainings"]) == (0, 2)
    assert all(t["test_accuracy"] is not None for t in second["top"])
    assert second["top"][0]["test_accuracy"] == first["best_test_accuracy"]


def test_a_search_sharing_a_store_trains_nothing_twice(tmp_path, space_file, capsys):
    store = str(tmp_path / "shared.db")
    args = ["grid", *BASE, "--space", space_file, "--limit", "3", "--store", store]
    assert main([*args, "--out", str(tmp_path / "first")]) == 0
    assert main([*args, "--out", str(tmp_path / "second")]) == 0
    second = json.loads((tmp_path / "second" / "summary.json").read_text())
    assert (second["evaluations"], second["cache_hits"]) == (0, 3)
    # a folder shows its own search of the store its config names (the second's: no training of its own),
    # the store file every search of it
    shown = []
    capsys.readouterr()
    for path in (tmp_path / "first", tmp_path / "second", store):
        assert main(["search", "show", str(path), "--csv"]) == 0
        shown.append(capsys.readouterr().out)
    rows = shown[0].splitlines()
    assert shown[0] == shown[2] and rows[0].startswith("id,search,sampler")
    assert shown[1].startswith("id,search,sampler") and len(shown[1].splitlines()) == 1  # a header, no row
    assert len(rows) > 3 and {row.split(",")[1] for row in rows[1:]} == {"1"}  # only the first search trained


def test_resume_extends_a_finished_search_with_more_generations(tmp_path, space_file, capsys):
    out = tmp_path / "evo"
    args = ["evolve", *BASE, "--space", space_file, "--population", "4", "--seed", "3"]
    assert main([*args, "--generations", "2", "--out", str(out)]) == 0
    first = json.loads((out / "summary.json").read_text())
    trained = first["cost"]["search"]["trainings"] + first["cost"]["remeasure"]["trainings"]
    capsys.readouterr()
    assert main(["evolve", "--resume", str(out), "--generations", "3"]) == 0
    # its first line says what it continues; re-measuring stays as the first start resolved it
    assert capsys.readouterr().out.startswith(f"towerlab evolve: resuming search 1 of {out / 'search.db'} "
                                              f"(2 generation(s) complete, {trained} training(s) kept): ga over")
    assert json.loads((out / "config.json").read_text())["search"]["remeasure"] == 0  # 8 trainings, top 4
    extended = json.loads((out / "summary.json").read_text())
    assert extended["generations"] == 3
    assert extended["generation_stats"][:2] == first["generation_stats"][:2]  # replayed, not retrained
    assert len((out / "generations.jsonl").read_text().splitlines()) == 3


def test_a_search_served_results_computed_elsewhere_says_so(tmp_path, space_file, capsys):
    """A shared store's rows from another machine (here: rewritten as if) are served as cached, and
    the search says, on its console and in its summary, that its results come from two kinds."""
    import sqlite3

    store = tmp_path / "shared.db"
    spaces = []
    for activations in ('"relu", "tanh"', '"relu", "tanh", "sigmoid"'):  # the second holds the first
        spaces.append(tmp_path / f"space{len(spaces)}.toml")
        spaces[-1].write_text(f'model = "mlp"\n[genes]\nneurons = [16]\nactivation = [{activations}]\n')
    args = ["grid", *BASE, "--store", str(store), "--remeasure", "0", "--top", "3"]
    assert main([*args, "--space", str(spaces[0]), "--out", str(tmp_path / "first")]) == 0
    elsewhere = {"device": "Another CPU", "threads": 1, "precision": "fp32", "torch": "2.4.0"}
    with sqlite3.connect(store) as db:
        db.execute("UPDATE evaluations SET numerics = ?", (json.dumps(elsewhere),))
    db.close()
    capsys.readouterr()
    assert main([*args, "--space", str(spaces[1]), "--out", str(tmp_path / "second")]) == 0
    printed = capsys.readouterr().out
    second = json.loads((tmp_path / "second" / "summary.json").read_text())
    assert second["cache_hits"] == 2 and second["evaluations"] == 1
    assert elsewhere in second["numerics"] and len(second["numerics"]) == 2
    assert "warning: this search's results were computed on 2 kinds of device or torch" in printed
    assert "Another CPU, 1 thread(s), fp32, torch 2.4.0" in printed


@pytest.mark.parametrize("args, fragment", [
    (["--population", "0"], "--population must be at least 1"),
    (["--population", "1"], "the ga sampler breeds each child from two parents: --population must be at least 2"),
    (["--retain", "1.5"], "--retain is a probability"),
    (["--random-select", "-0.1"], "--random-select is a probability"),
    (["--mutate-chance", "2"], "--mutate-chance is a probability"),
    (["--space", "nosuch"], "nosuch"),
    (["--elite", "30"], "--elite must be between 0 and --population"),
])
def test_bad_search_settings(args, fragment, tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["evolve", *BASE, *args, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert fragment in err and err.count("\n") == 1
    assert not out.exists()


@pytest.mark.parametrize("command, args, fragment", [
    ("evolve", ["--limit", "5"], "--limit does nothing in a ga search: only the grid sampler reads it (drop --limit)"),
    ("grid", ["--population", "5"], "--population does nothing in a grid search: only the auto, ga, gp, random and tpe samplers"),
    ("grid", ["--mutate-chance", "0.5"], "--mutate-chance does nothing in a grid search: only the ga sampler reads it"),
])
def test_settings_of_another_sampler_are_refused(command, args, fragment, tmp_path, capsys):
    out = tmp_path / "run"
    assert main([command, *BASE, *args, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert fragment in err and err.count("\n") == 1
    assert not out.exists()


def test_bad_space_file_and_foreign_store(tmp_path, capsys):
    bad = tmp_path / "bad.toml"
    bad.write_text('model = "mlp"\n[genes]\nneurons = []\n')
    assert main(["evolve", *BASE, "--space", str(bad), "--out", str(tmp_path / "a")]) == 2
    assert "bad.toml" in capsys.readouterr().err
    foreign = tmp_path / "foreign.db"
    foreign.write_text("not a database at all")
    assert main(["grid", *BASE, "--store", str(foreign), "--out", str(tmp_path / "b")]) == 2
    assert "foreign.db" in capsys.readouterr().err
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_resuming_with_another_space_is_refused(tmp_path, space_file, capsys):
    out = tmp_path / "evo"
    assert main(["evolve", *BASE, "--space", space_file, "--population", "2", "--generations", "1",
                 "--out", str(out)]) == 0
    assert main(["evolve", "--resume", str(out), "--space", "cnn"]) == 2
    assert "--space differ" in capsys.readouterr().err
