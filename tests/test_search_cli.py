"""`towerlab search run --sampler`, `towerlab search show --csv / --json / --plot`, and the settings
the search commands refuse, with real (tiny, synthetic) training."""

import csv
import dataclasses
import io
import json
import re

import pytest

from towerlab.cli import build_parser, main
from towerlab.commands import resolve_search
from towerlab.config import SearchConfig
from towerlab.search import Outcome, Space, Store, run_search, serial
from util import SEARCH_BASE, small_space_file

BASE = SEARCH_BASE


@pytest.fixture()
def space_file(tmp_path):
    return small_space_file(tmp_path)


def test_search_run_with_a_sampler_writes_its_record_and_every_evaluation_comes_out(tmp_path, space_file, capsys):
    out = tmp_path / "random"
    assert main(["search", "run", "--sampler", "random", *BASE, "--space", space_file, "--population", "3",
                 "--max-evaluations", "5", "--top", "2", "--out", str(out)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["sampler"] == "random" and summary["kind"] == "search"
    assert (summary["evaluations"], summary["generations"]) == (5, 2)
    # no re-measures: 1 fresh seed for each of the top 2 would cost 2, more than a quarter of 5
    assert summary["trainings"] == 5
    assert json.loads((out / "config.json").read_text())["search"]["remeasure"] == 0
    best = json.loads((out / "best.json").read_text())
    assert len(best["val_accuracies"]) == 1 and best["val_accuracy_sd"] is None
    assert (out / "accuracy_time.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    capsys.readouterr()

    assert main(["search", "show", str(out), "--csv"]) == 0
    rows = list(csv.DictReader(io.StringIO(capsys.readouterr().out)))
    assert len(rows) == 5 and {r["sampler"] for r in rows} == {"random"}
    assert [r["replicate"] for r in rows].count("0") == 5 and {r["rung"] for r in rows} == {"0"}
    assert {"gene_neurons", "gene_layers", "gene_activation", "val_accuracy", "seconds", "worker", "device", "threads",
            "precision", "torch_version", "host", "towerlab_version", "code_digest", "data_digest"} <= set(rows[0])
    assert all(r["data_digest"].startswith("sha256:") and r["towerlab_version"] for r in rows)
    assert {(r["threads"], r["precision"]) for r in rows} == {("1", "fp32")}
    # a worker is named by its host, its process, its device and the token of what started it
    assert all(float(r["seconds"]) > 0 and re.fullmatch(r".+:\d+:cpu:[0-9a-f]{6}", r["worker"]) for r in rows)

    assert main(["search", "show", str(out), "--json", "--plot", str(tmp_path / "all.png")]) == 0
    records = json.loads(capsys.readouterr().out)
    assert [r["val_accuracy"] for r in records] == [float(r["val_accuracy"]) for r in rows]
    assert records[0]["genome"]["neurons"] == int(rows[0]["gene_neurons"])
    assert (tmp_path / "all.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    assert main(["search", "show", str(out)]) == 0
    text = capsys.readouterr().out
    assert "search 1: random over space" in text and "at most 5 evaluations" in text and "   1 " in text
    # one numbering of generations everywhere, from 1: the console, the records (CSV numbered from 0)
    lines = [json.loads(line) for line in (out / "generations.jsonl").read_text().splitlines()]
    assert sorted({int(r["generation"]) for r in rows}) == [g["generation"] for g in lines] == [
        g["generation"] for g in summary["generation_stats"]] == [1, 2]

    # a folder holds the sampler it was started with
    assert main(["evolve", "--resume", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"holds a random search: resume it with towerlab search run --resume {out}" in err
    assert main(["search", "run", "--resume", str(out), "--max-evaluations", "6"]) == 0
    assert json.loads((out / "summary.json").read_text())["evaluations"] == 6


@pytest.mark.parametrize("args, fragment", [
    (["--population", "10000000000"], "--population 10000000000 is more than a generation can hold: at most 1000000"),
    (["--limit", "2000000"], "--limit 2000000 is more than a generation can hold"),
    (["--sampler", "annealing"], "unknown sampler 'annealing': choose one of auto, ga, gp, grid, random, tpe"),
    (["--max-evaluations", "0"], "--max-evaluations must be positive"),
    (["--remeasure", "1000"], "--remeasure must be between 0 and 100"),
    (["--min-epochs", "3", "--max-epochs", "3"], "--min-epochs (3) must be below --max-epochs (3)"),
    (["--sampler", "ga", "--population", "4", "--elite", "5"], "--elite must be between 0 and --population (4)"),
    (["--sampler", "ga", "--elite", "25"], "--elite must be between 0 and --population (20)"),
    # a setting only other samplers read would be ignored
    (["--sampler", "tpe", "--elite", "2"], "--elite does nothing in a tpe search: only the ga sampler reads it"),
    (["--sampler", "random", "--limit", "3"], "--limit does nothing in a random search: only the grid sampler reads it"),
    # pruning's factor without its first rung: the search would not be pruned
    (["--prune-factor", "4"], "--prune-factor 4 does nothing without --min-epochs: the search is not pruned"),
    # in generations of 4, 10 generations cannot reach 100 trainings (without --generations, a budget alone does)
    (["--sampler", "tpe", "--population", "4", "--generations", "10", "--max-evaluations", "100"],
     "--max-evaluations 100 is more than 10 generations of 4 can train: pass --generations 25 (or more) with it"),
])
def test_bad_search_settings_are_one_line_and_leave_nothing(args, fragment, tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["search", "run", *BASE, *args, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert fragment in err and err.count("\n") == 1
    assert not out.exists()


def test_a_config_json_from_before_samplers_resumes_as_it_ran(tmp_path):
    folder = tmp_path / "evo"
    folder.mkdir()
    old = {k: v for k, v in SearchConfig(sampler="ga", population=6).__dict__.items()
           if k not in ("sampler", "remeasure", "max_evaluations", "min_epochs", "prune_factor")}
    (folder / "config.json").write_text(json.dumps({"kind": "evolve", "search": old, "run": {}}))
    cfg, run = resolve_search(build_parser().parse_args(["evolve", "--resume", str(folder), "--generations", "12"]))
    assert (cfg.sampler, cfg.remeasure, cfg.min_epochs, cfg.max_evaluations, cfg.prune_places) == \
        ("ga", 0, None, None, "all")
    assert (cfg.population, cfg.generations, run.out) == (6, 12, str(folder))


def test_a_large_generation_says_what_it_is_doing(tmp_path):
    space = Space("small", "mlp", {"neurons": (16, 32, 64), "layers": (1, 2)})
    lines = []
    with Store(tmp_path / "s.db") as store:
        result = run_search(SearchConfig(sampler="ga", population=10_000, generations=1, remeasure=0), space,
                            serial(lambda c: Outcome.ok(0.5)), store, "tch", on_progress=lines.append)
    assert lines == ["Generation 1: proposing 10000 candidates and looking them up in the store ..."]
    assert result.evaluations == 6 and result.cache_hits == 10_000 - 6


def test_a_grid_too_large_to_hold_is_refused_before_any_folder(tmp_path, capsys):
    space = tmp_path / "big.toml"
    space.write_text('model = "mlp"\n[genes]\nneurons = [%s]\nlayers = [%s]\n'
                     % (", ".join(map(str, range(1, 1001))), ", ".join(map(str, range(1, 1002)))))
    assert main(["grid", *BASE, "--space", str(space), "--out", str(tmp_path / "grid")]) == 2
    err = capsys.readouterr().err
    assert "has 1001000 genomes: grid a random subset with --limit N (N up to 1000000)" in err
    assert err.count("\n") == 1 and not (tmp_path / "grid").exists()


def test_a_limited_grid_of_ranges_too_large_to_list_trains_at_once(tmp_path, capsys):
    """issue 50: 10**24 genomes (two float ranges of 10**12 points) and an int range to 10**18."""
    space = tmp_path / "huge.toml"
    space.write_text('model = "mlp"\n[genes]\nneurons = [16]\nlayers = {low = 1, high = 1000000000000000000}\n'
                     'lr = {low = 1e-4, high = 0.1, log = true, points = 1000000000000}\n'
                     'label_smoothing = {low = 0.0, high = 0.2, points = 1000000000000}\n')
    out = tmp_path / "grid"
    # the genome drawn asks for more than 1000 mlp layers: a failed candidate, recorded, so the search ends with 2
    assert main(["grid", *BASE, "--space", str(space), "--limit", "1", "--remeasure", "0", "--out", str(out)]) == 2
    summary = json.loads((out / "summary.json").read_text())
    assert (summary["evaluations"], summary["failures"]) == (1, 1)
    assert "all 1 candidates failed (the first: UserError: model option layers must be at most 1000" in \
        capsys.readouterr().err
    assert main(["grid", *BASE, "--space", str(space), "--out", str(tmp_path / "all")]) == 2
    err = capsys.readouterr().err
    assert "genomes: grid a random subset with --limit N" in err.splitlines()[-1] and not (tmp_path / "all").exists()


@pytest.mark.parametrize("command, hidden, shown", [
    (["grid"], ["--population", "--elite", "GeneticSettings"], ["--limit", "--generations"]),
    (["evolve"], ["--limit", "GridSettings"], ["--population", "--elite"]),
    (["search", "run"], [], ["--population", "--limit", "--elite"]),
])
def test_a_search_commands_help_lists_only_the_flags_its_sampler_reads(command, hidden, shown, capsys):
    """issue 50: `grid --help` listed --population, which grid refuses."""
    with pytest.raises(SystemExit) as done:
        main([*command, "--help"])
    assert done.value.code == 0
    text = capsys.readouterr().out
    def listed(flag):  # as a flag of its own, in the usage or the list (not named in another's help)
        return re.search(rf"(^\s+|\[){re.escape(flag)}\b", text, re.M) is not None or f"\n{flag}:" in text

    assert [flag for flag in hidden if listed(flag)] == [] and all(listed(flag) for flag in shown)
    if hidden:  # still understood, and refused in the line that says which sampler reads it
        assert main([*command, hidden[0], "5", *BASE, "--out", "never"]) == 2
        assert "does nothing in a" in capsys.readouterr().err


def test_a_cpu_search_runs_a_worker_per_core_each_training_on_one_thread(monkeypatch):
    from towerlab.distributed import env
    from towerlab.distributed.env import search_threads, search_workers

    monkeypatch.setattr(env.os, "cpu_count", lambda: 16)
    monkeypatch.setattr(env, "machine_memory", lambda: 64 * 2**30)
    assert (search_workers(None, "cpu"), search_workers(3, "cpu")) == (16, 3)
    monkeypatch.setattr(env, "machine_memory", lambda: 4 * 2**30)  # 512 MiB a process at least
    assert search_workers(None, "cpu") == 8
    # one thread per candidate, however many workers share the cores; --threads as given
    assert search_threads(None, "cpu", 16) == search_threads(None, "cpu", 1) == 1
    assert search_threads(4, "cpu", 16) == 4


@pytest.mark.parametrize("settings, remeasure", [
    ({"sampler": "ga"}, 2),  # 200 trainings; 2 seeds for the top 5 and 9 elites cost 28
    ({"sampler": "tpe"}, 2),  # 40 trainings; 2 seeds for the top 5 cost 10
    ({"sampler": "tpe", "max_evaluations": 8, "top": 2}, 1),  # 2 seeds would cost 4 of 8
    ({"sampler": "random", "population": 8, "generations": 1, "top": 4}, 0),  # 1 seed would cost 4 of 8
    ({"sampler": "grid", "limit": 4}, 0),  # the top is the whole search: 1 seed each would cost 4 of 4
    ({"sampler": "grid", "limit": 4, "remeasure": 3}, 3),  # as given
])
def test_default_re_measuring_costs_at_most_a_quarter_of_the_searchs_trainings(settings, remeasure):
    from towerlab.search import Search, load_space

    search = Search.resolve(SearchConfig(**settings), load_space("mlp"))
    assert search.cfg.remeasure == remeasure
    if "remeasure" not in settings:  # the default: re-measures cost at most a quarter of the search
        assert search.plan["remeasure"] <= search.plan["search"] / 4


def test_the_budget_counts_the_promotions_of_the_generations_max_evaluations_reaches():
    from towerlab.search import Search, load_space

    # tpe's 4 a generation: 12 trainings are 3 generations of the 10, each promoting ceil(4 / 3) = 2 to 3 epochs
    cfg = SearchConfig(sampler="tpe", population=4, max_evaluations=12, min_epochs=1, max_epochs=3, remeasure=0, top=2)
    plan = Search.resolve(cfg, load_space("mlp")).plan
    assert (plan["search"], plan["rungs"], plan["test"]) == (12, 6, 2)
    # the epochs: the most of either choice of rungs, pruned at the first (12 x 1 + 6 x 3) or not (12 x 3)
    assert plan["epochs"] == max(12 * 1 + 6 * 3, 12 * 3) + 2 * 3
    # without --population, asynchronously: each candidate is promoted against the trainings before it, and
    # the first ones, with none before them, all are: at most one promotion a candidate
    plan = Search.resolve(dataclasses.replace(cfg, population=None), load_space("mlp")).plan
    assert (plan["search"], plan["rungs"], plan["test"]) == (12, 12, 2)
    assert plan["epochs"] == 12 * 1 + 12 * 3 + 2 * 3


def test_under_a_budget_in_epochs_the_plan_says_that_budget_not_every_first_rungs_promotions():
    from towerlab.search import Search, load_space

    # LCBench's shape: 5,200 epochs of trainings up to 52, pruned from 1. Every first rung that budget
    # holds, each promoted to every rung above, made the plan say 338,104 epochs; the budget charges every
    # training but the tests and begins no member once it is spent
    cfg = SearchConfig(budget_epochs=5200, min_epochs=1, max_epochs=52, remeasure=0, top=2, generations=10000)
    plan = Search.resolve(cfg, load_space("mlp")).plan
    assert plan["search"] == 5200 and plan["test"] == 2
    assert plan["epochs"] == 5200 + 2 * 52
    # a budget the search cannot reach leaves the plan's own bound
    small = Search.resolve(dataclasses.replace(cfg, max_evaluations=12), load_space("mlp")).plan
    assert small["epochs"] < 5200 and small["epochs"] == Search.resolve(
        dataclasses.replace(cfg, max_evaluations=12, budget_epochs=None), load_space("mlp")).plan["epochs"]


def test_a_typed_space_searches_from_the_command_line(tmp_path, capsys):
    pytest.importorskip("optuna")
    space = tmp_path / "typed.toml"
    space.write_text('model = "mlp"\n[genes]\nneurons = {low = 8, high = 64, log = true}\n'
                     'lr = {low = 1e-4, high = 0.01, log = true}\nlayers = [1, 2]\n')
    out = tmp_path / "tpe"
    assert main(["search", "run", "--sampler", "tpe", *BASE, "--space", str(space), "--population", "2",
                 "--generations", "2", "--remeasure", "0", "--top", "1", "--out", str(out)]) == 0
    best = json.loads((out / "best.json").read_text())
    assert 8 <= best["genome"]["neurons"] <= 64 and type(best["genome"]["neurons"]) is int
    assert 1e-4 <= best["genome"]["lr"] <= 0.01 and type(best["genome"]["lr"]) is float
    assert "over space" in capsys.readouterr().out
    assert main(["search", "show", str(out)]) == 0
    assert "(model mlp, a space continuous in lr)" in capsys.readouterr().out

    assert main(["grid", *BASE, "--space", str(space), "--out", str(tmp_path / "grid")]) == 2
    err = capsys.readouterr().err
    assert "a grid cannot list float gene 'lr'" in err and err.count("\n") == 1 and not (tmp_path / "grid").exists()


MODEL_FILE = '''
from torch import nn


def make(input_shape, num_classes, width=8):
    c, h, w = input_shape
    return nn.Sequential(nn.Flatten(), nn.Linear(c * h * w, width), nn.ReLU(), nn.Linear(width, num_classes))
'''


def test_a_model_function_of_yours_searches_from_the_command_line(tmp_path, capsys):
    (tmp_path / "mynet.py").write_text(MODEL_FILE)
    space = tmp_path / "custom.toml"
    space.write_text('model = "custom"\n[genes]\nwidth = {low = 4, high = 32, log = true}\nlr = [0.001, 0.01]\n')
    out = tmp_path / "s"
    args = ["search", "run", "--sampler", "random", *BASE, "--space", str(space), "--population", "2",
            "--generations", "1", "--remeasure", "0", "--top", "1"]
    assert main([*args, "--model", f"{tmp_path / 'mynet.py'}:make", "--out", str(out)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert (summary["evaluations"], summary["failures"]) == (2, 0)
    assert 4 <= json.loads((out / "best.json").read_text())["genome"]["width"] <= 32
    capsys.readouterr()
    # the function is given again on resume; without it, one line
    assert main(["search", "run", "--resume", str(out)]) == 2
    err = capsys.readouterr().err
    assert "has model 'custom': its networks come from a function of yours" in err and err.count("\n") == 1
    assert main(["search", "run", "--resume", str(out), "--generations", "2", "--model",
                 f"{tmp_path / 'mynet.py'}:make"]) == 0
    assert json.loads((out / "summary.json").read_text())["evaluations"] == 4
    for spec, fragment in [(f"{tmp_path / 'mynet.py'}:nope", "defines no nope"),
                           (f"{tmp_path / 'none.py'}:make", "no file"), ("mynet:make", "give FILE.py:FUNCTION")]:
        assert main([*args, "--model", spec, "--out", str(tmp_path / "x")]) == 2
        err = capsys.readouterr().err
        assert fragment in err and err.count("\n") == 1 and not (tmp_path / "x").exists()
    (tmp_path / "narrow.py").write_text(MODEL_FILE.replace("width=8", "depth=1"))
    assert main([*args, "--model", f"{tmp_path / 'narrow.py'}:make", "--out", str(tmp_path / "x")]) == 2
    assert "gene 'width' is neither a training gene" in capsys.readouterr().err


def test_best_json_retrains_a_model_function_winner_through_its_file(tmp_path, capsys):
    (tmp_path / "mynet.py").write_text(MODEL_FILE)
    space = tmp_path / "custom.toml"
    space.write_text('model = "custom"\n[genes]\nwidth = [6, 12]\nlr = [0.001, 0.01]\n')
    out = tmp_path / "s"
    assert main(["search", "run", "--sampler", "random", *BASE, "--space", str(space), "--population", "2",
                 "--generations", "1", "--remeasure", "0", "--top", "1", "--model", f"{tmp_path / 'mynet.py'}:make",
                 "--out", str(out)]) == 0
    best = json.loads((out / "best.json").read_text())
    assert best["command"].startswith(f"towerlab train --model {tmp_path / 'mynet.py'}:make "
                                      f"--model-opt width={best['genome']['width']} ")
    assert best["command"].endswith(" --devices 1 --device cpu --threads 1")
    assert main([*best["command"].split()[1:], "--no-progress", "--out", str(tmp_path / "again")]) == 0
    again = json.loads((tmp_path / "again" / "summary.json").read_text())
    assert (again["model"], again["val_accuracy"], again["test_accuracy"]) == \
        ("custom", best["val_accuracy"], best["test_accuracy"])


def test_best_json_names_a_model_function_by_its_file_and_its_genes_as_options(tmp_path):
    from towerlab.objective.candidate import retrain_command
    from towerlab.models.custom import load_function

    (tmp_path / "mynet.py").write_text(MODEL_FILE)
    make = load_function(f"{tmp_path / 'mynet.py'}:make")
    cfg = SearchConfig(dataset="synthetic", max_epochs=1)

    def local(input_shape, num_classes):
        return make(input_shape, num_classes)

    assert retrain_command(cfg, make, {"lr": 0.01}, 3) == \
        f"towerlab train --model {tmp_path / 'mynet.py'}:make --dataset synthetic --batch-size 128 --epochs 1 " \
        "--lr 0.01 --seed 3 --patience 5 --devices 1"
    assert retrain_command(cfg, make, {"width": 12, "lr": 0.01}, 3) == \
        f"towerlab train --model {tmp_path / 'mynet.py'}:make --model-opt width=12 --dataset synthetic " \
        "--batch-size 128 --epochs 1 --lr 0.01 --seed 3 --patience 5 --devices 1"
    assert retrain_command(cfg, make, {"lr": 0.01}, 3, cpu_threads=2).endswith(
        "--seed 3 --patience 5 --devices 1 --device cpu --threads 2")
    assert retrain_command(cfg, local, {"lr": 0.01}, 3).startswith(
        "none: local was given from Python, not from a file; where FILE.py defines it: towerlab train --model "
        "FILE.py:local --dataset synthetic")


def test_best_json_command_is_quoted_for_a_shell_and_keeps_every_gene_type(tmp_path):
    """issue 50: best.json's command was joined with spaces (a gene act=$(id) ran id in a shell), and a
    string gene "3" came back from --model-opt as the int 3."""
    import shlex

    from towerlab.objective.candidate import retrain_command
    from towerlab.models.custom import load_function

    (tmp_path / "my net.py").write_text(MODEL_FILE.replace("width=8)", "width=8, **strings)"))
    make = load_function(f"{tmp_path / 'my net.py'}:make")
    genes = {"act": "$(id)", "tag": "3", "flag": "true", "quoted": '"x"', "spaced": " a", "width": 12, "on": True,
             "lr": 0.01}
    command = retrain_command(SearchConfig(dataset="synthetic", max_epochs=1), make, genes, 3)
    assert "'--model-opt' " not in command and "'act=$(id)'" in command and f"'{tmp_path / 'my net.py'}:make'" in command
    args = build_parser().parse_args(shlex.split(command)[1:])
    assert args.model == f"{tmp_path / 'my net.py'}:make"
    assert args.model_options == {k: v for k, v in genes.items() if k != "lr"}
    assert [type(v) for v in args.model_options.values()] == [str, str, str, str, str, int, bool]


def test_a_search_writes_tensorboard_curves_as_it_goes(tmp_path, space_file, capsys):
    """--tensorboard on a search: each evaluation's validation accuracy and the best so far, each
    generation's best, mean and worst, in <out>/tb, as the store's records say."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = tmp_path / "search"
    assert main(["search", "run", "--sampler", "random", *BASE, "--space", space_file, "--population", "3",
                 "--generations", "2", "--top", "1", "--remeasure", "0", "--tensorboard", "--out", str(out)]) == 0
    events = EventAccumulator(str(out / "tb")).Reload()
    summary = json.loads((out / "summary.json").read_text())
    accuracies = [e.value for e in events.Scalars("search/val_accuracy")]
    assert len(accuracies) == summary["trainings"] == 6
    assert [round(e.value, 6) for e in events.Scalars("search/best_val_accuracy")][-1] == \
        round(summary["best_val_accuracy"], 6) == round(max(accuracies), 6)
    assert [(e.step, round(e.value, 6)) for e in events.Scalars("generation/best")] == \
        [(s["generation"], round(s["best"], 6)) for s in summary["generation_stats"]]


def test_a_search_kept_in_towerlab_store_opens_from_its_folder(tmp_path, space_file, capsys, monkeypatch):
    """Issue 65, defects 16 and 19: a search started with only $TOWERLAB_STORE set (the docs' recipe) could not
    be opened from its folder (`no search store at runs/E/search.db`); `search show` took no $TOWERLAB_STORE
    and no --search; the folder of a search in a shared store showed every search of the store."""
    shared = tmp_path / "shared.db"
    monkeypatch.setenv("TOWERLAB_STORE", str(shared))
    for name, seed in (("A", "1"), ("B", "2")):
        assert main(["search", "run", "--sampler", "random", *BASE, "--space", space_file, "--population", "2",
                     "--max-evaluations", "2", "--seed", seed, "--out", str(tmp_path / name)]) == 0
    assert shared.is_file() and not (tmp_path / "A" / "search.db").exists()
    monkeypatch.delenv("TOWERLAB_STORE")
    capsys.readouterr()
    assert main(["search", "show", str(tmp_path / "B")]) == 0
    text = capsys.readouterr().out
    assert text.startswith("search 2: random over space") and "search 1:" not in text, text
    assert main(["search", "show", str(tmp_path / "A"), "--csv"]) == 0
    assert {r["search"] for r in csv.DictReader(io.StringIO(capsys.readouterr().out))} == {"1"}
    assert main(["search", "export", str(tmp_path / "A"), "--optuna", f"sqlite:///{tmp_path / 'studies.db'}"]) == 0
    assert "study A-1: 2 trials -> " in capsys.readouterr().out
    assert main(["search", "show"]) == 2
    assert capsys.readouterr().err == ("towerlab: error: give the search to show (a search's folder, its search.db "
                                       "or a postgresql:// URL), or set $TOWERLAB_STORE\n")
    monkeypatch.setenv("TOWERLAB_STORE", str(shared))
    assert main(["search", "show"]) == 0
    text = capsys.readouterr().out
    assert "search 1: random" in text and "search 2: random" in text
    assert main(["search", "show", "--search", "1"]) == 0
    text = capsys.readouterr().out
    assert text.startswith("search 1: random") and "search 2:" not in text
    assert main(["search", "show", "--search", "3"]) == 2
    assert f"store {shared} holds no search 3" in capsys.readouterr().err


def test_the_status_after_the_last_generation_names_no_generation_past_it(tmp_path, space_file, capsys):
    """Issue 65, defect 20: the status line read `Generation 3/2` while the top was re-measured and tested."""
    from towerlab.jobs.search.record import Watch
    from towerlab.report import Reporter
    from towerlab.search import Search

    out = tmp_path / "search"
    assert main(["search", "run", "--sampler", "random", *BASE, "--space", space_file, "--population", "2",
                 "--generations", "2", "--remeasure", "1", "--top", "1", "--out", str(out)]) == 0
    with Store(out / "search.db", create=False) as store:
        watch = Watch(store, Search.open(store, 1), out, Reporter(None, progress=False), workers=1, resumed=False)
        watch.step()
        assert watch.shown == 2 and " the top after generation 2/2: " in watch.status(), watch.status()


def test_a_training_of_towerlab_s_past_its_trial_timeout_fails_as_a_trial_of_yours_does(tmp_path, space_file, capsys):
    """--trial-timeout is every kind's rule (`towerlab.objective.deadline`): towerlab's own training is stopped
    by its worker's process and fails with a trial's reason; its worker goes on."""
    out = tmp_path / "late"
    assert main(["grid", *BASE, "--space", space_file, "--limit", "2", "--top", "1", "--remeasure", "0",
                 "--trial-timeout", "0.01", "--out", str(out)]) == 2
    assert "all 2 candidates failed (the first: timed out after 0.01 s, and was stopped)" in capsys.readouterr().err
    assert main(["search", "show", str(out), "--json"]) == 0
    records = json.loads(capsys.readouterr().out)
    assert [(r["status"], r["reason"], r["objective"]) for r in records] == \
        [("failed", "timed out after 0.01 s, and was stopped", "training")] * 2
