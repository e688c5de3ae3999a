"""Conditional genes (`when` in a space file): read and refused as every space is, every sampler proposing
genomes of a nested conditional space (its active genes, no other), a grid counting a gene only where it is
active, and searches of a function and of a command where an inactive gene never reaches the objective nor
a stored row, shows empty in `search show --csv` and is exported to Optuna as a parameter the trial did
not suggest; auto's choice named in `search run`'s first lines and in `search show`. Fake fitness."""

from __future__ import annotations

import csv
import io
import itertools
import json
import shlex
import sqlite3
import sys
from pathlib import Path

import numpy as np
import pytest

from towerlab.cli import main
from towerlab.config import SearchConfig
from towerlab.errors import UserError
from towerlab.objective import CommandObjective, FunctionObjective
from towerlab.search import Outcome, Store, canonical, genome_hash, grid_genomes, run_search, serial
from towerlab.search.samplers.auto import described
from towerlab.search.samplers.ga import breed, mutate
from towerlab.search.space import Range, load_space, space_of

# The issue's space: a listed gene, a range for two of its values, a range and a listed gene for one each.
ISSUE = """[genes]
booster = ["gblinear", "gbtree", "dart"]
eta = {low = 0.001, high = 1.0, log = true, when = {booster = ["gbtree", "dart"]}}
rate_drop = {low = 0.0, high = 1.0, when = {booster = "dart"}}
updater = {values = ["shotgun", "coord_descent"], when = {booster = "gblinear"}}
"""
# Nested: skip is active for dart only where depth, itself conditional, is 3 or 4.
NESTED = """[genes]
booster = ["gblinear", "gbtree", "dart"]
eta = {low = 0.001, high = 1.0, log = true, points = 3, when = {booster = ["gbtree", "dart"]}}
depth = {low = 1, high = 4, when = {booster = ["gbtree", "dart"]}}
rate_drop = {low = 0.0, high = 1.0, step = 0.25, when = {booster = "dart"}}
skip = {values = [0.0, 0.5], when = {booster = "dart", depth = [3, 4]}}
updater = {values = ["shotgun", "coord_descent"], when = {booster = "gblinear"}}
alpha = {low = 0.0, high = 1.0, step = 0.5}
"""
ABSENT = object()
ONE_CPU = ["--threads", "1", "--device", "cpu", "--devices", "1", "--no-progress"]


def active(genome: dict) -> set[str]:
    """The genes NESTED's genome holds, written out by hand."""
    booster = genome["booster"]
    genes = {"booster", "alpha"} | ({"updater"} if booster == "gblinear" else {"eta", "depth"})
    if booster == "dart":
        genes |= {"rate_drop"} | ({"skip"} if genome.get("depth") in (3, 4) else set())
    return genes


def space_file(folder: Path, text: str = NESTED, name: str = "space.toml") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / name).write_text(text)
    return folder / name


def test_a_conditional_space_reads_as_written_and_as_recorded(tmp_path):
    space = load_space(str(space_file(tmp_path, ISSUE)), objective=True)
    assert space.when == {"eta": {"booster": ("gbtree", "dart")}, "rate_drop": {"booster": ("dart",)},
                          "updater": {"booster": ("gblinear",)}}
    assert space.genes["updater"] == ("shotgun", "coord_descent")
    assert space.contains({"booster": "dart", "eta": 0.5, "rate_drop": 0.25})
    assert not space.contains({"booster": "gblinear", "eta": 0.5, "updater": "shotgun"})  # eta: inactive
    assert not space.contains({"booster": "gbtree"})  # eta: active, missing
    # what a store records reads back to the same space; the conditions are part of its fingerprint
    recorded = space.to_dict()
    again = space_of({"model": recorded["model"], "genes": recorded["genes"]}, recorded["name"], "recorded")
    assert (again.when, again.genes, again.fingerprint) == (space.when, space.genes, space.fingerprint)
    dropped = ISSUE.replace(', when = {booster = "dart"}', "")
    unconditional = load_space(str(space_file(tmp_path, dropped, "b.toml")), objective=True)
    assert unconditional.fingerprint != space.fingerprint
    # {values = [...]} is a list written as a table: the same gene, the same fingerprint
    listed = load_space('{"model": "objective", "genes": {"a": [1, 2], "b": {"low": 0.0, "high": 1.0}}}')
    table = load_space('{"model": "objective", "genes": {"a": {"values": [1, 2]}, "b": {"low": 0.0, "high": 1.0}}}')
    assert (table.genes, table.fingerprint, table.when) == (listed.genes, listed.fingerprint, {})


@pytest.mark.parametrize("genes, said", [
    ('a = [1, 2]\nb = {values = [1], when = {c = 1}}', "gene 'b': its condition names gene 'c', which the space does "
                                                      "not have (its genes: a, b)"),
    ('a = ["x", "y"]\nb = {values = [1], when = {a = "z"}}', "its condition a = 'z' names a value 'a' does not take "
                                                            "(it takes 'x', 'y')"),
    ('a = {values = [1, 2], when = {c = 1}}\nb = {values = [1, 2], when = {a = 1}}\nc = {values = [1], when = {b = 2}}',
     "genes a -> c -> b -> a depend on each other in a circle"),
    ('a = {low = 0.0, high = 1.0}\nb = {values = [1], when = {a = 0.5}}', "its condition names 'a', a float range "
                                                                          "without step"),
    ('a = [1, 2]\nb = {values = [1], when = {a = 1}}\nc = {values = [1], when = {a = 2, b = 1}}',
     "gene 'c' is never active: its conditions cannot hold together"),
    ('a = [1, 2]\nb = {values = [1], low = 0, when = {a = 1}}', "a list of values takes only values and when, not low"),
])
def test_a_bad_condition_is_refused_in_one_line_and_nothing_is_written(tmp_path, capsys, monkeypatch, genes, said):
    monkeypatch.chdir(tmp_path)
    space_file(tmp_path, f"[genes]\n{genes}\n")
    (tmp_path / "f.py").write_text("def train(**genes):\n    return 1.0\n")
    assert main(["search", "run", "--space", "space.toml", "--objective", "f.py:train", *ONE_CPU, "--out", "out"]) == 2
    err = capsys.readouterr().err
    assert said in err and err.count("\n") == 1, err
    assert not (tmp_path / "out").exists()


def test_the_grid_counts_a_gene_only_where_it_is_active(tmp_path):
    space = load_space(str(space_file(tmp_path)), objective=True)
    # gblinear: 2 updaters x 3 alphas; gbtree: 3 etas x 4 depths x 3; dart: 3 etas x 5 rates x 3 x (2 depths + 2 x 2 skips)
    assert space.grid_size() == 6 + 36 + 270 == 312
    every = grid_genomes(space, None, 0)
    assert len(every) == len({genome_hash(g) for g in every}) == 312
    assert all(set(g) == active(g) and space.contains(g) for g in every)
    # the same count by brute force: every gene's values, inactive ones dropped, duplicates merged
    def grid_values(gene):
        return [gene.grid_value_at(i) for i in range(gene.grid_count)] if isinstance(gene, Range) else list(gene)

    brute = set()
    for picks in itertools.product(*([ABSENT, *grid_values(gene)] for gene in space.genes.values())):
        genome = {name: value for name, value in zip(space.genes, picks) if value is not ABSENT}
        if "booster" in genome and set(genome) == active(genome):
            brute.add(canonical(genome))
    assert brute == {canonical(g) for g in every}
    limited = grid_genomes(space, 7, 3)
    assert len({genome_hash(g) for g in limited}) == 7 and all(space.contains(g) for g in limited)
    # a finite conditional space: every genome once, each at its position
    finite = space_of({"model": "objective", "genes": {n: g for n, g in space.to_dict()["genes"].items() if n != "eta"}},
                      "finite", "finite")
    genomes = list(finite.all_genomes())
    assert len(genomes) == finite.size == 6 + 12 + 90 == len({genome_hash(g) for g in genomes})
    assert all(finite.genome_at(i) == g for i, g in enumerate(genomes))


@pytest.mark.parametrize("sampler", ["random", "ga", "grid", "tpe", "gp", "auto"])
def test_every_sampler_proposes_genomes_of_a_nested_conditional_space(tmp_path, sampler):
    if sampler in ("tpe", "gp", "auto"):
        pytest.importorskip("optuna")
    space = load_space(str(space_file(tmp_path)), objective=True)
    seen: list[dict] = []

    def fitness(candidate):
        seen.append(dict(candidate.genome))
        g = candidate.genome
        return Outcome.ok(0.5 + g.get("eta", 0.2) / 4 + g.get("rate_drop", 0.1) / 8 + g["alpha"] / 10,
                          val_loss=0.1, epochs=1, seconds=0.1)

    shape = {"grid": {}, "gp": {"generations": 14}}.get(sampler, {"population": 4, "generations": 5})
    cfg = SearchConfig(space="space.toml", sampler=sampler, seed=2, remeasure=0, **shape)
    with Store(tmp_path / "store") as store:
        result = run_search(cfg, space, serial(fitness), store, "tch")
    members = [m.genome for g in result.history for m in g.members]
    assert len(members) == (312 if sampler == "grid" else 14 if sampler == "gp" else 20)
    assert all(set(g) == active(g) and space.contains(g) for g in [*members, *seen])
    assert len({g["booster"] for g in members}) >= 2 and any("skip" in g for g in members)  # nested: reached


def test_ga_breeds_and_mutates_across_branches_into_genomes_of_the_space(tmp_path):
    space = load_space(str(space_file(tmp_path)), objective=True)
    rng = np.random.default_rng(0)
    linear = {"booster": "gblinear", "updater": "shotgun", "alpha": 0.0}
    dart = {"booster": "dart", "eta": 0.1, "depth": 4, "rate_drop": 0.5, "skip": 0.5, "alpha": 1.0}
    tree = {"booster": "gbtree", "eta": 0.2, "depth": 3, "alpha": 0.5}
    children = [breed(rng, a, b, space) for a, b in [(linear, dart), (dart, tree), (tree, linear)] * 100]
    assert all(set(c) == active(c) and space.contains(c) for c in children)
    assert {c["booster"] for c in children} == {"gblinear", "gbtree", "dart"}
    # dart from one parent, depth 3 from gbtree's: skip, in neither's branch with that depth, still decided
    assert any(c["booster"] == "dart" and c["depth"] == 3 and "skip" in c for c in children)
    # a gene inherited where its parent had it: a dart child of (dart, gbtree) has dart's rate_drop
    assert all(c["rate_drop"] == 0.5 for c in children[100:200] if c["booster"] == "dart")
    mutants = [mutate(rng, space, g) for g in (linear, dart, tree) for _ in range(100)]
    assert all(set(m) == active(m) and space.contains(m) for m in mutants)
    assert {m["booster"] for m in mutants[:100]} == {"gblinear", "gbtree", "dart"}  # a branch left, genes drawn


def test_optuna_is_asked_an_active_gene_only():
    optuna = pytest.importorskip("optuna")
    from towerlab.search.samplers.optuna_params import ask_genome
    from towerlab.search.samplers.tpe import distribution
    space = space_of({"model": "objective", "genes": {
        "booster": ["gblinear", "dart"], "rate": {"low": 0.0, "high": 1.0, "when": {"booster": "dart"}},
        "deep": [1, 2]}}, "s", "s")
    study = optuna.create_study(sampler=optuna.samplers.TPESampler(seed=1, n_startup_trials=4))
    distributions = {name: distribution(optuna, gene) for name, gene in space.genes.items()}
    for _ in range(12):
        trial, genome = ask_genome(study, space, distributions)
        assert set(trial.params) == set(genome) == ({"booster", "rate", "deep"} if genome["booster"] == "dart"
                                                    else {"booster", "deep"})
        study.tell(trial, genome.get("rate", 0.3))


def test_an_objective_is_refused_a_conditional_gene_it_cannot_go_without(tmp_path):
    (tmp_path / "needs.py").write_text("def train(booster, rate_drop):\n    return 1.0\n")
    with pytest.raises(UserError, match="its parameter 'rate_drop' has no default, and the gene is conditional"):
        FunctionObjective(f"{tmp_path / 'needs.py'}:train", ["booster", "rate_drop"], conditional=["rate_drop"])
    with pytest.raises(UserError, match="names the conditional gene 'rate_drop', which a trial leaves out where it "
                                        "is inactive, and {booster} with it"):
        CommandObjective("echo --set={booster}:{rate_drop}", ["booster", "rate_drop"], conditional=["rate_drop"])


def test_auto_says_which_sampler_it_chose_and_why(tmp_path):
    numeric = load_space('{"model": "objective", "genes": {"x": {"low": 0.0, "high": 1.0}, "n": {"low": 1, "high": 9}}}')
    conditional = load_space('{"model": "objective", "genes": {"x": {"low": 0, "high": 2}, '
                             '"y": {"low": 0.0, "high": 1.0, "when": {"x": [1, 2]}}}}')
    auto = SearchConfig(sampler="auto")
    gaussian = "auto (chose gp: every gene is a numeric range: a Gaussian process, TPE after 250 outcomes)"
    assert described(auto, numeric) == gaussian
    # pruned too: on LCBench, TPE's regret was 2 to 20 times gp's (docs/benchmarks.md)
    assert described(SearchConfig(sampler="auto", min_epochs=1, max_epochs=3), numeric) == gaussian
    mixed = ("auto (chose gp: gene 'x' is a numeric range in every trial: a Gaussian process (listed genes its "
             "categories, conditional ones where they are active), TPE after 250 outcomes)")
    assert described(auto, conditional) == mixed
    assert described(auto, load_space(str(space_file(tmp_path)), objective=True)) == mixed.replace("'x'", "'alpha'")
    # no range that every trial holds: the Gaussian process would model categories alone
    assert described(auto, load_space(str(space_file(tmp_path, ISSUE)), objective=True)) == (
        "auto (chose tpe: gene 'booster' is a list of values, which TPE models value by value, and no range is in "
        "every trial)")
    assert described(auto, load_space("mlp")) == ("auto (chose tpe: gene 'neurons' is a list of values, which TPE "
                                                  "models value by value)")
    assert described(SearchConfig(sampler="gp"), numeric) == "gp"


FUNCTION = """import json


def train(booster, alpha, eta=None, depth=None, rate_drop=None, skip=None, updater=None, **more):
    given = dict(booster=booster, alpha=alpha, eta=eta, depth=depth, rate_drop=rate_drop, skip=skip, updater=updater)
    with open({log!r}, "a") as f:
        f.write(json.dumps({{"given": sorted(k for k, v in given.items() if v is not None), "more": sorted(more)}}) + "\\n")
    return (eta or 0.3) + (rate_drop or 0.2) + alpha
"""
PROGRAM = """import json, sys
with open({log!r}, "a") as f:
    f.write(json.dumps(sys.argv[1:]) + "\\n")
print(1.0)
"""


def stored_genomes(out: Path) -> list[dict]:
    with sqlite3.connect(out / "search.db") as db:
        return [json.loads(g) for (g,) in db.execute("SELECT genome FROM evaluations")]


def test_a_function_never_gets_an_inactive_gene_and_the_views_show_it_empty(tmp_path, capsys, monkeypatch):
    optuna = pytest.importorskip("optuna")
    monkeypatch.chdir(tmp_path)
    space_file(tmp_path)
    log = tmp_path / "given.jsonl"
    (tmp_path / "fn.py").write_text(FUNCTION.format(log=str(log)))
    assert main(["search", "run", "--space", "space.toml", "--objective", "fn.py:train", "--max-evaluations", "12",
                 "--remeasure", "0", "--seed", "1", *ONE_CPU, "--out", "out"]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert first.startswith("towerlab search run: auto (chose gp: gene 'alpha' is a numeric range in every trial"), first
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    rows = stored_genomes(tmp_path / "out")
    assert len(calls) == len(rows) == 12  # one at a time, none repeated
    assert all(c["more"] == [] for c in calls)
    assert sorted(c["given"] for c in calls) == sorted(sorted(active(g)) for g in rows)
    assert all(set(g) == active(g) for g in rows) and {g["booster"] for g in rows} > {"dart"}

    assert main(["search", "show", "out"]) == 0
    assert "search 1: auto (chose gp: gene 'alpha' is a numeric range in every trial" in capsys.readouterr().out
    assert main(["search", "show", "out", "--csv"]) == 0
    table = list(csv.DictReader(io.StringIO(capsys.readouterr().out)))
    assert len(table) == len(rows)
    for row in table:
        assert (row["gene_rate_drop"] != "") == (row["gene_booster"] == "dart")
        assert (row["gene_updater"] != "") == (row["gene_booster"] == "gblinear")

    url = f"sqlite:///{tmp_path / 'study.db'}"
    assert main(["search", "export", "out", "--optuna", url]) == 0
    trials = optuna.load_study(study_name="out", storage=url).get_trials()
    assert len(trials) == len(rows)
    assert all(set(t.params) == set(t.distributions) == active(t.params) for t in trials)


def test_a_command_gets_no_argument_nor_flag_for_an_inactive_gene(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    space_file(tmp_path)
    log = tmp_path / "argv.jsonl"
    (tmp_path / "prog.py").write_text(PROGRAM.format(log=str(log)))
    command = shlex.join([sys.executable, "prog.py", "--booster", "{booster}", "--eta", "{eta}", "--depth={depth}",
                          "--rate-drop", "{rate_drop}", "-s", "{skip}", "--updater", "{updater}", "{alpha}",
                          "--seed", "{seed}"])
    assert main(["search", "run", "--space", "space.toml", "--command", command, "--sampler", "random",
                 "--population", "6", "--generations", "2", "--remeasure", "0", *ONE_CPU, "--out", "out"]) == 0
    capsys.readouterr()
    runs = [json.loads(line) for line in log.read_text().splitlines()]
    rows = stored_genomes(tmp_path / "out")
    assert len(runs) == len(rows) == 12
    flags = {"eta": "--eta", "rate_drop": "--rate-drop", "skip": "-s", "updater": "--updater"}
    expected = []
    for g in rows:
        assert set(g) == active(g)
        argv = ["--booster", g["booster"]]
        argv += ["--eta", json.dumps(g["eta"])] if "eta" in g else []
        argv += [f"--depth={g['depth']}"] if "depth" in g else []
        for name in ("rate_drop", "skip", "updater"):
            argv += [flags[name], g[name] if isinstance(g[name], str) else json.dumps(g[name])] if name in g else []
        expected.append([*argv, json.dumps(g["alpha"])])
    assert sorted(run[:-2] for run in runs) == sorted(expected)
    assert all(run[-2] == "--seed" for run in runs)


def test_gp_models_a_conditional_gene_where_it_is_active_rather_than_draw_it(tmp_path):
    """gp tells its Gaussian process every gene, a stand-in where a genome lacks one: the model learns where a
    conditional gene is best. Drawn at random, as GPSampler alone draws a gene not in every trial, the eta of
    its model's proposals would lie 0.3 from the best on average (its mean gap over the uniform draw: 0.34)."""
    pytest.importorskip("optuna")
    pytest.importorskip("scipy")
    space = space_of({"genes": {"booster": ["gblinear", "gbtree"], "alpha": {"low": 0.0, "high": 1.0},
                                "eta": {"low": 0.0, "high": 1.0, "when": {"booster": "gbtree"}}}},
                     "space", "test", objective=True)

    def fitness(candidate):
        g = candidate.genome
        tree = -((g["eta"] - 0.8) ** 2) if "eta" in g else -0.5
        return Outcome.ok(1 + tree - (g["alpha"] - 0.5) ** 2 / 4, val_loss=0.1, epochs=1, seconds=0.1)

    cfg = SearchConfig(sampler="gp", seed=0, remeasure=0, generations=30)
    with Store(tmp_path / "store") as store:
        result = run_search(cfg, space, serial(fitness), store, "tch")
    modelled = [m.genome for g in result.history[10:] for m in g.members]  # past the start-up's random 10
    gaps = [abs(g["eta"] - 0.8) for g in modelled if "eta" in g]
    assert len(gaps) >= 15 and sorted(gaps)[len(gaps) // 2] < 0.1
