"""What a store's name means (`search.location.store_location`) and how a URL's password is kept out of every
line: SQLAlchemy's and Optuna's spellings of an SQLite file or a PostgreSQL URL are taken as meant, another
database is refused in one line (each became a local folder named after the URL); a password typed with
'/', '#', '?' or a space never reaches an error line (it was printed whole); a password typed on the
command line gets one warning line. No server needed: the PostgreSQL side is in test_search_postgres.py."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from towerlab.cli import main
from towerlab.errors import UserError
from towerlab.search.store.location import redacted, shows_a_password, store_location, with_password
from util import SEARCH_BASE, run_cli, small_space_file


@pytest.mark.parametrize("url, shown", [
    ("postgresql://u:pw@h:5432/db", "postgresql://u:***@h:5432/db"),
    ("postgresql://u:se/cret@h/db", "postgresql://u:***@h/db"),
    ("postgresql://u:se#cret@h/db", "postgresql://u:***@h/db"),
    ("postgresql://u:se?cret@h/db", "postgresql://u:***@h/db"),
    ("postgresql://u:se cret@h/db", "postgresql://u:***@h/db"),
    ("postgresql://u:p@ss@h/db", "postgresql://u:***@h/db"),
    ("postgresql://h/db?sslmode=require&password=pw&user=u", "postgresql://h/db?sslmode=require&password=***&user=u"),
    ("postgresql://u@h:5432/db", "postgresql://u@h:5432/db"),
    ("postgresql://u:pw@[::1]:5432/db", "postgresql://u:***@[::1]:5432/db"),
])
def test_a_password_is_redacted_whatever_it_holds(url, shown):
    assert redacted(url) == shown
    assert shows_a_password(url) == (shown != url)
    assert not shows_a_password(shown)  # a recorded URL, *** for its password


@pytest.mark.parametrize("recorded, opened", [
    ("postgresql://u:***@h/db", "postgresql://u@h/db"),
    ("postgresql://h/db?password=***&user=u", "postgresql://h/db?user=u"),
    ("postgresql://h/db?user=u&password=***", "postgresql://h/db?user=u"),
    ("postgresql://u@h/db", "postgresql://u@h/db"),
])
def test_a_recorded_url_opens_without_its_stars_so_libpq_finds_the_password(recorded, opened, monkeypatch):
    """config.json keeps `:***@`; opened as it stands, "***" was the password and $PGPASSWORD and
    ~/.pgpass were never read ("password authentication failed")."""
    monkeypatch.delenv("TOWERLAB_STORE", raising=False)
    assert with_password(recorded) == opened
    monkeypatch.setenv("TOWERLAB_STORE", recorded.replace("***", "real"))
    assert with_password(recorded) == recorded.replace("***", "real")


@pytest.mark.parametrize("given, meant", [
    ("sqlite:///a/b.db", "a/b.db"),
    ("sqlite:////tmp/b.db", "/tmp/b.db"),
    ("file:///tmp/b.db", "/tmp/b.db"),
    ("file:b%20c.db", "b c.db"),
    ("postgresql+psycopg://u@h/db", "postgresql://u@h/db"),
    ("postgres+psycopg2://u@h/db", "postgres://u@h/db"),
    ("postgresql://u:a/b#c d@h/db", "postgresql://u:a%2Fb%23c%20d@h/db"),  # the password whole, not a host
    ("postgresql://u:a%2Fb@h/db", "postgresql://u:a%2Fb@h/db"),
    ("runs/search", "runs/search"),
])
def test_a_store_named_as_sqlalchemy_names_it_is_what_it_means(given, meant):
    assert store_location(given) == meant


@pytest.mark.parametrize("given, why", [
    ("mysql://u:pw@h/db", "not in mysql"),
    ("mariadb+pymysql://h/db", "not in mariadb"),
    ("sqlite://", "in memory"),
    ("sqlite:///:memory:", "in memory"),
    ("sqlite://host/a.db", "three slashes"),
    ("file://elsewhere/a.db", "another machine"),
    ("file:a.db?mode=ro", "without URL options"),
])
def test_a_store_towerlab_cannot_keep_a_search_in_is_refused(given, why):
    with pytest.raises(UserError, match=why) as caught:
        store_location(given)
    assert "pw" not in str(caught.value)


@pytest.mark.slow
def test_the_command_line_takes_an_sqlite_url_as_its_file_and_refuses_another_database(tmp_path, capsys, monkeypatch):
    """`--store sqlite:///x/a.db` became the folder ./sqlite:/x/a.db; `--store mysql://...` a local file
    the user believed was on a server. (The refusals run in this process: each fails before it starts.)"""
    space = small_space_file(tmp_path)
    done = run_cli("search", "run", "--sampler", "random", "--population", "2", "--generations", "1", "--top", "1",
                   *SEARCH_BASE, "--space", space, "--store", "sqlite:///stores/a.db", "--out", str(tmp_path / "s"),
                   cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "stores" / "a.db").is_file() and not (tmp_path / "sqlite:").exists()
    shown = run_cli("search", "show", f"sqlite:///{tmp_path / 'stores' / 'a.db'}")
    assert shown.returncode == 0 and "finished" in shown.stdout, shown.stderr
    monkeypatch.chdir(tmp_path)
    for command in (["search", "run", *SEARCH_BASE, "--space", space, "--store", "mysql://u:pw@h/db",
                     "--out", str(tmp_path / "m")],
                    ["search", "show", "mysql://u:pw@h/db"], ["search", "worker", "mysql://u:pw@h/db"],
                    ["search", "export", "postgresql+mysql:/x", "--optuna", "sqlite:///o.db"]):
        status = main(command)
        err = capsys.readouterr().err
        if command[1] == "export":  # postgresql+mysql:/x is no URL at all: a file that is not there
            assert status == 2 and "no search store" in err, err
            continue
        lines = [line for line in err.splitlines() if "warning" not in line]
        assert status == 2 and len(lines) == 1 and "not in mysql" in lines[0], err
        assert "pw" not in err.replace("password", "")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s", "space.toml", "stores"]


@pytest.mark.parametrize("password", ["Zqv1/Xjw2", "Zqv1#Xjw2", "Zqv1?Xjw2", "Zqv1 Xjw2", "Zqv1@Xjw2/8"])
def test_a_password_with_odd_characters_never_reaches_an_error_line(tmp_path, password, capsys):
    """A password typed `se#cret` was printed whole, and with `se/cret` the whole URL. (The command line
    in this process: each command fails before it trains, and what it prints is all that is checked.)"""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nobody listens there once the socket closes
    url = f"postgresql://towerlab:{password}@127.0.0.1:{port}/db"
    for command in (["search", "show", url], ["search", "worker", url, "--device", "cpu"],
                    ["search", "run", *SEARCH_BASE, "--space", small_space_file(tmp_path), "--store", url,
                     "--out", str(tmp_path / "s")]):
        status = main(command)
        out, err = capsys.readouterr()
        assert status == 2, err
        lines = err.splitlines()
        assert lines[0].startswith("towerlab: warning: the password in a URL on the command line"), lines
        assert len(lines) == 2 and lines[1].startswith("towerlab: error:"), lines
        assert "Zqv1" not in out + err and "Xjw2" not in out + err, err
        assert not Path(tmp_path / "s").exists()
