"""Config files: --config FILE under the flags, a run's config.json repeats the run, presets as files."""

import json

import pytest

from towerlab.cli import build_parser, main
from towerlab.commands import resolve_search, resolve_train
from towerlab.errors import UserError
from towerlab.settings import config_toml, read_config_file, tomllib
from util import ONE_CPU, TINY, max_difference, weights


def parse(*flags):
    return build_parser().parse_args(list(flags))


def test_a_config_file_sets_what_the_flags_leave_and_the_flags_win(tmp_path):
    (tmp_path / "run.toml").write_text('model = "mlp"\nbatch-size = 64\nlr = 1\nsteps = 9\ndevices = 1\n'
                                       'model_opt = {layers = 1, neurons = 16}\n\n[run]\nthreads = 1\n')
    cfg, run = resolve_train(parse("train", "--config", str(tmp_path / "run.toml"), "--batch-size", "32"))
    assert (cfg.model, cfg.batch_size, cfg.lr, cfg.steps, cfg.model_options) == ("mlp", 32, 1.0, 9,
                                                                               {"layers": 1, "neurons": 16})
    assert (run.devices, run.threads) == (1, 1)


def test_a_preset_named_in_a_file_lies_under_the_file(tmp_path):
    (tmp_path / "fast.toml").write_text('preset = "mnist-fast"\nbatch_size = 128\n')
    cfg, run = resolve_train(parse("train", "--config", str(tmp_path / "fast.toml"), "--seed", "2"))
    assert (cfg.steps, cfg.lr, cfg.batch_size, cfg.seed, run.preset) == (537, 0.012, 128, 2, "mnist-fast")


@pytest.mark.parametrize("text, fragment", [
    ("epochz = 3\n", "unknown run.toml key(s) epochz"),
    ('epochs = "3"\n', "run.toml key epochs must be a whole number"),
    ("epochs = \n", "is not valid TOML"),
    ("[train]\nlr = true\n", "run.toml [train] key lr must be a number"),
    ("[search]\npopulation = 4\n", "holds search settings"),
    ("train = 3\n", "train must be a table"),
])
def test_a_bad_config_file_is_one_line_naming_the_file(text, fragment, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "run.toml").write_text(text)
    assert main(["train", *TINY, "--config", "run.toml", "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert fragment in err and err.count("\n") == 1
    assert not (tmp_path / "out").exists()


DEEP = 100_000


@pytest.mark.parametrize("name, text, fragment", [
    ("run.toml", "x = " + "[" * DEEP + "]" * DEEP + "\n", "nests its values too deeply"),
    ("run.toml", "x = " + "{a = " * DEEP + "1" + "}" * DEEP + "\n", "nests its values too deeply"),
    ("run.json", '{"x": ' + "[" * DEEP + "]" * DEEP + "}", "nests its values too deeply"),
    ("run.toml", "batch-size = 64\nbatch_size = 32\n", "run.toml keys batch-size and batch_size both set batch_size"),
    ("run.toml", "[train]\nmodel_options = {layers = 1}\nmodel-opt = {layers = 2}\n",
     "run.toml [train] keys model_options and model-opt both set model_options"),
    ("run.toml", "lr = 0.1\n[train]\nlr = 0.2\n", "run.toml sets lr at the top level and under [train]"),
    ("run.json", '{"lr": 0.1, "steps": 2, "lr": 0.2}', "config file run.json gives the key 'lr' twice in one object"),
    ("run.json", '{"train": {"steps": 2, "steps": 3}}', "gives the key 'steps' twice"),
])
def test_a_config_file_too_deep_or_setting_a_key_twice_is_one_line(name, text, fragment, tmp_path, capsys,
                                                                   monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / name).write_text(text)
    assert main(["train", *TINY, "--config", name, "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert fragment in err and err.count("\n") == 1
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("name, text", [("run.toml", 'model = "mlp"\nlr = 0.5\n'),
                                        ("run.json", '{"model": "mlp", "lr": 0.5}')])
def test_a_config_file_that_begins_with_a_byte_order_mark_is_read(name, text, tmp_path):
    """issue 50: a UTF-8 BOM (Notepad writes one) made a TOML file "invalid"."""
    (tmp_path / name).write_bytes(b"\xef\xbb\xbf" + text.encode())
    cfg, _ = resolve_train(parse("train", "--config", str(tmp_path / name)))
    assert (cfg.model, cfg.lr) == ("mlp", 0.5)


@pytest.mark.parametrize("text", ['resume = "{first}"\n', '[run]\nresume = "{first}"\n'])
def test_resume_in_a_config_file_is_refused_and_the_run_it_names_is_untouched(text, tmp_path, capsys):
    # A config file holds a job's settings; continuing a job is --resume's, whose guards
    # (--out must be its folder, no other settings) a file would get past.
    first = tmp_path / "first"
    assert main(["train", *TINY, "--steps", "2", "--out", str(first)]) == 0
    before = {p.name: p.read_bytes() for p in first.iterdir()}
    capsys.readouterr()
    (tmp_path / "run.toml").write_text(text.format(first=first))
    for command in (["train", *TINY], ["grid", "--space", "mlp", *ONE_CPU]):
        assert main([*command, "--config", str(tmp_path / "run.toml"), "--out", str(tmp_path / "second")]) == 2
        err = capsys.readouterr().err
        assert "resume is not a config file setting: continue a job with --resume FOLDER" in err, err
        assert err.count("\n") == 1
    assert not (tmp_path / "second").exists() and {p.name: p.read_bytes() for p in first.iterdir()} == before


def test_a_runs_config_json_repeats_the_run_into_a_new_folder(tmp_path):
    first, again = tmp_path / "first", tmp_path / "again"
    assert main(["train", *TINY, "--model", "lenet5", "--steps", "5", "--batch-size", "32", "--lr", "0.003",
                 "--seed", "4", "--out", str(first)]) == 0
    # Only the record: no flag repeats any setting. Its out is not taken over (that folder holds files).
    assert main(["train", "--config", str(first / "config.json"), "--out", str(again)]) == 0
    assert max_difference(weights(first), weights(again)) == 0.0
    a, b = (json.loads((d / "config.json").read_text()) for d in (first, again))
    assert a["train"] == b["train"] and {**a["run"], "out": None} == {**b["run"], "out": None}


def test_print_config_writes_a_file_that_resolves_to_the_same_settings(tmp_path, capsys):
    assert main(["train", "--preset", "mnist-fast", "--seed", "3", "--print-config"]) == 0
    text = capsys.readouterr().out
    assert tomllib.loads(text)["train"]["steps"] == 537
    (tmp_path / "mnist-fast.toml").write_text(text)
    assert resolve_train(parse("train", "--config", str(tmp_path / "mnist-fast.toml"))) == \
        resolve_train(parse("train", "--preset", "mnist-fast", "--seed", "3"))
    assert not list(tmp_path.glob("runs*"))


def test_evolve_takes_a_config_file_too(tmp_path, capsys):
    (tmp_path / "search.toml").write_text('[search]\npopulation = 4\ngenerations = 2\n[run]\ndevices = 1\n')
    cfg, run = resolve_search(parse("evolve", "--config", str(tmp_path / "search.toml"), "--generations", "3"))
    assert (cfg.population, cfg.generations, run.devices) == (4, 3, 1)
    assert main(["evolve", "--config", str(tmp_path / "search.toml"), "--print-config"]) == 0
    assert tomllib.loads(capsys.readouterr().out)["search"]["population"] == 4


@pytest.mark.parametrize("command", [["evolve"], ["grid"], ["search", "run", "--sampler", "tpe"]])
def test_a_search_prints_only_what_it_reads_and_the_file_resolves_to_it(command, tmp_path, capsys):
    assert main([*command, "--seed", "5", "--print-config"]) == 0
    text = capsys.readouterr().out
    printed = tomllib.loads(text)
    sampler = printed["search"]["sampler"]
    assert ("retain" in printed["search"]) == (sampler == "ga") and ("elite" in printed["search"]) == (sampler == "ga")
    assert not {"strategy", "input", "display_step", "compile"} & set(printed["run"])
    assert "tensorboard" in printed["run"]  # a search writes its trainings and generations there
    (tmp_path / "search.toml").write_text(text)
    assert resolve_search(parse(*command, "--config", str(tmp_path / "search.toml"))) == \
        resolve_search(parse(*command, "--seed", "5"))


@pytest.mark.parametrize("command, fragment", [
    (["evolve", "--limit", "5"], "--limit does nothing in a ga search: only the grid sampler reads it"),
    (["search", "run", "--sampler", "tpe", "--population", "4", "--generations", "10",
      "--max-evaluations", "100"],
     "--max-evaluations 100 is more than"),
    (["grid", "--space", "no-such-space"], "no-such-space"),
])
def test_print_config_refuses_what_the_search_would_refuse(command, fragment, capsys):
    assert main([*command, "--print-config"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and fragment in err and err.count("\n") == 1


def test_config_toml_writes_every_kind_of_value():
    text = config_toml(train={"name": 'a "quoted"\nline', "lr": 1e-05, "on": False, "n": 3, "skip": None,
                              "opts": {"layers": 2, "act": "relu"}})
    assert tomllib.loads(text) == {"train": {"name": 'a "quoted"\nline', "lr": 1e-05, "on": False, "n": 3,
                                             "opts": {"layers": 2, "act": "relu"}}}


def test_a_dict_is_a_config_too_and_config_with_resume_is_refused():
    assert read_config_file({"epochs": 2, "run": {"devices": 1}}, "train") == ({"epochs": 2}, {"devices": 1})
    with pytest.raises(UserError, match="--config does not go with --resume"):
        resolve_train(parse("train", "--resume", "x", "--config", "y"))
