"""A sampler with a setting of its own is one file (tests/stride_sampler.py) plus its line in the
registry: its setting is then a flag and a config key of every search command, checked, recorded
with the search and kept on resume, and refused in a search by another sampler. Fake fitness, no torch."""

import json

import pytest

from towerlab.cli import build_parser, main
from towerlab.commands import resolve_search
from towerlab.config import SearchConfig
from towerlab.fields import to_dict
from towerlab.errors import UserError
from towerlab.search import SAMPLERS, Outcome, Space, Store, run_search, serial, settings_classes
from towerlab.settings import read_config_file

SPACE = Space("line", "mlp", {"neurons": tuple(range(1, 13))})  # genome i has neurons i + 1


@pytest.fixture(autouse=True)
def registered(monkeypatch):
    monkeypatch.setitem(SAMPLERS, "stride", "stride_sampler:StrideSampler")  # the registry line


def fitness(candidate):
    return Outcome.ok(candidate.genome["neurons"] / 100, epochs=1, seconds=0.1)


def search(path, cfg, **kw):
    with Store(path) as store:
        return run_search(cfg, SPACE, serial(fitness), store, "tch", **kw)


def test_a_search_with_the_new_sampler_reads_its_setting_and_records_it(tmp_path):
    cfg = SearchConfig(sampler="stride", stride=3, population=2, generations=3, remeasure=0, top=2)
    result = search(tmp_path / "s.db", cfg)
    assert [[m.genome["neurons"] for m in g.members] for g in result.history] == [[1, 4], [7, 10]]
    assert [t.genome["neurons"] for t in result.top] == [10, 7] and result.evaluations == 4
    with Store(tmp_path / "s.db") as store:
        assert store.records.searches()[0].config["stride"] == 3
    default = search(tmp_path / "d.db", SearchConfig(sampler="stride", population=2, generations=1, remeasure=0))
    assert [m.genome["neurons"] for m in default.history[0].members] == [1, 3]  # its default stride, 2
    with pytest.raises(UserError, match="holds a search with --stride 3, not 2: resume with the same setting"):
        search(tmp_path / "s.db", SearchConfig(sampler="stride", stride=2, population=2, generations=3, remeasure=0),
               resume=True)


def test_its_setting_is_a_flag_and_a_config_key_of_every_search_command(tmp_path, capsys):
    cfg, _ = resolve_search(build_parser().parse_args(["search", "run", "--sampler", "stride", "--stride", "4"]))
    assert (cfg.sampler, cfg.settings) == ("stride", {"stride": 4})
    default, _ = resolve_search(build_parser().parse_args(["search", "run", "--sampler", "stride"]))
    assert default.settings == {"stride": 2}  # resolved: what the search records
    assert read_config_file({"search": {"stride": 5}}, "search")[0] == {"stride": 5}
    with pytest.raises(SystemExit):
        main(["search", "run", "--help"])
    assert "--stride INT" in capsys.readouterr().out
    with pytest.raises(SystemExit):  # a flag of evolve too (refused there in one line), not in its help
        main(["evolve", "--help"])
    assert "--stride" not in capsys.readouterr().out


@pytest.mark.parametrize("args, fragment", [
    (["search", "run", "--sampler", "stride", "--stride", "0"], "--stride must be at least 1, got 0"),
    (["evolve", "--stride", "3"], "--stride does nothing in a ga search: only the stride sampler reads it"),
    (["search", "run", "--sampler", "stride", "--elite", "2"],
     "--elite does nothing in a stride search: only the ga sampler reads it"),
    (["search", "run", "--sampler", "stride", "--strid", "3"],
     "unrecognized arguments: --strid 3 (did you mean --stride?)"),
])
def test_its_setting_is_checked_and_refused_elsewhere(args, fragment, tmp_path, capsys):
    out = tmp_path / "run"
    assert main([*args, "--space", "mlp", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert fragment in err and err.count("\n") == 1
    assert not out.exists()


def test_a_setting_name_two_samplers_declare_is_refused(monkeypatch):
    from stride_sampler import StrideSampler, StrideSettings

    monkeypatch.setitem(SAMPLERS, "stride2", "stride_sampler:StrideTwice")
    monkeypatch.setattr("stride_sampler.StrideTwice", type("StrideTwice", (StrideSampler,), {
        "Settings": type("Twice", (StrideSettings,), {})}), raising=False)
    with pytest.raises(RuntimeError, match="sampler stride2 declares the setting stride, which the stride sampler "
                                           "declares as well"):
        settings_classes()


def test_a_config_json_records_the_setting_among_the_others(tmp_path):
    cfg, _ = resolve_search(build_parser().parse_args(["search", "run", "--sampler", "stride", "--stride", "4"]))
    record = json.loads(json.dumps(to_dict(cfg)))
    assert record["stride"] == 4 and "settings" not in record and "elite" not in record
