"""Downloads against a local http.server the test starts itself; no network is used."""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import http.server
import re
import socket
import threading

import pytest

from towerlab.catalog import datasets
from towerlab.data import fetch
from towerlab.errors import UserError


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


@pytest.fixture
def server(tmp_path, monkeypatch):
    """Serves tmp_path/served at the returned base URL."""
    monkeypatch.setenv("no_proxy", "*")  # a proxy from the environment must not intercept 127.0.0.1
    served = tmp_path / "served"
    served.mkdir()
    handler = functools.partial(_QuietHandler, directory=str(served))
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}/", served
    httpd.shutdown()
    httpd.server_close()
    thread.join()


@pytest.fixture
def closed_url():
    """A local port nobody listens on: connecting fails at once."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"http://127.0.0.1:{port}/"


def serve(served, files: dict[str, bytes]) -> tuple[datasets.RemoteFile, ...]:
    remotes = []
    for name, data in files.items():
        (served / name).write_bytes(data)
        remotes.append(datasets.RemoteFile(name, hashlib.md5(data).hexdigest()))
    return tuple(remotes)


def use_source(monkeypatch, mirrors, remotes, name="mnist", subdir=""):
    monkeypatch.setitem(datasets.CATALOG, name, dataclasses.replace(
        datasets.entry(name), source=datasets.Source(subdir, tuple(mirrors), tuple(remotes))))


FILES = {"a.gz": b"first file" * 1000, "b.gz": b"second"}


def test_fetch_downloads_verifies_and_reports_progress(tmp_path, server, monkeypatch):
    url, served = server
    use_source(monkeypatch, [url], serve(served, FILES))
    calls = []
    dest = tmp_path / "data"
    paths = fetch.fetch("mnist", dest, progress=lambda *a: calls.append(a))
    assert paths == [dest / "a.gz", dest / "b.gz"]
    assert [p.read_bytes() for p in paths] == list(FILES.values())
    assert calls[-1] == ("b.gz", 6, 6) and ("a.gz", 10000, 10000) in calls
    assert sorted(p.name for p in dest.iterdir()) == ["a.gz", "b.gz"]  # no temporary files left


def test_the_fetch_command_downloads_and_lists_the_files(tmp_path, server, monkeypatch, capsys):
    from towerlab.cli import main

    url, served = server
    use_source(monkeypatch, [url], serve(served, FILES))
    assert main(["data", "fetch", "mnist", "--data-dir", str(tmp_path / "data")]) == 0
    assert capsys.readouterr().out.splitlines() == ["a.gz: 10,000 bytes downloaded", "b.gz: 6 bytes downloaded",
                                                    str(tmp_path / "data" / "a.gz"), str(tmp_path / "data" / "b.gz")]


def test_fetch_keeps_good_files_and_replaces_corrupt_ones(tmp_path, server, closed_url, monkeypatch):
    url, served = server
    remotes = serve(served, FILES)
    (tmp_path / "a.gz").write_bytes(FILES["a.gz"])
    (tmp_path / "b.gz").write_bytes(b"stale partial")
    use_source(monkeypatch, [url], remotes)
    fetch.fetch("mnist", tmp_path)
    assert (tmp_path / "b.gz").read_bytes() == FILES["b.gz"]
    use_source(monkeypatch, [closed_url], remotes)  # everything present: the network is not touched
    assert fetch.fetch("mnist", tmp_path) == [tmp_path / "a.gz", tmp_path / "b.gz"]


def test_fetch_tries_the_next_mirror(tmp_path, server, closed_url, monkeypatch):
    url, served = server
    use_source(monkeypatch, [closed_url, url + "missing/", url], serve(served, FILES))
    fetch.fetch("mnist", tmp_path)
    assert (tmp_path / "a.gz").read_bytes() == FILES["a.gz"]


def test_fetch_checksum_mismatch_leaves_nothing(tmp_path, server, monkeypatch):
    url, served = server
    (served / "a.gz").write_bytes(b"<html>captive portal</html>")
    use_source(monkeypatch, [url], [datasets.RemoteFile("a.gz", "0" * 32)])
    dest = tmp_path / "data"
    with pytest.raises(UserError, match=r"a.gz for mnist has the wrong checksum \(127\.0\.0\.1:\d+ gave md5 "
                                        r"[0-9a-f]{32}, expected 0{32}") as err:
        fetch.fetch("mnist", dest)
    assert str(dest) in str(err.value)
    assert not dest.exists()  # the folder the failed fetch created is gone again


def test_fetch_unreachable_gives_one_clean_error(tmp_path, server, closed_url, monkeypatch):
    url, _ = server
    use_source(monkeypatch, [closed_url, url], [datasets.RemoteFile("nowhere.gz", "0" * 32)])
    dest = tmp_path / "data"
    with pytest.raises(UserError) as err:
        fetch.fetch("mnist", dest)
    message = str(err.value)
    assert "\n" not in message
    host = r"127\.0\.0\.1:\d+"
    assert re.search(rf"could not download mnist from {host} \(.*refused.*\), {host} \(HTTP 404\)", message), message
    assert f"put the files in {dest} by hand or copy a mnist.npz into {dest}" in message
    assert not dest.exists()  # the folder the failed fetch created is gone again


def test_a_failed_fetch_removes_the_folders_it_made_and_nothing_else(tmp_path, closed_url, monkeypatch):
    use_source(monkeypatch, [closed_url], [datasets.RemoteFile("a.gz", "0" * 32)], name="fashion-mnist",
               subdir="fashion-mnist")
    data_dir = tmp_path / "data"
    (data_dir / "mine").mkdir(parents=True)
    with pytest.raises(UserError, match="could not download fashion-mnist"):
        fetch.fetch("fashion-mnist", data_dir)
    assert sorted(p.name for p in data_dir.iterdir()) == ["mine"]  # no empty fashion-mnist/ left behind


def test_the_mirror_setting_replaces_the_official_hosts(tmp_path, server, monkeypatch):
    url, served = server
    (served / "mnist").mkdir()
    remotes = serve(served / "mnist", FILES)
    use_source(monkeypatch, ["http://never.invalid/"], remotes)
    monkeypatch.setenv("TOWERLAB_MIRROR", url.rstrip("/"))
    assert fetch.mirror_hosts("mnist") == [url.split("/")[2]]
    paths = fetch.fetch("mnist", tmp_path / "d")
    assert [p.read_bytes() for p in paths] == list(FILES.values())
    monkeypatch.setenv("TOWERLAB_MIRROR", "ftp://example.org")
    with pytest.raises(UserError, match="TOWERLAB_MIRROR"):
        fetch.fetch("mnist", tmp_path / "e")


def test_fetch_refuses_an_endless_stream(tmp_path, server, monkeypatch):
    url, served = server
    use_source(monkeypatch, [url], serve(served, {"a.gz": bytes(5000)}))
    monkeypatch.setattr(fetch, "MAX_DOWNLOAD_BYTES", 1000)
    monkeypatch.setattr(fetch, "_CHUNK", 512)
    with pytest.raises(UserError, match="more than 1000 bytes"):
        fetch.fetch("mnist", tmp_path)
    assert list(tmp_path.iterdir()) == [tmp_path / "served"]


def test_fetch_unknown_and_generated_names():
    with pytest.raises(UserError, match="downloadable ones are mnist, fashion-mnist, cifar10"):
        fetch.fetch("synthetic", "/nonexistent")


def test_target_dirs_match_the_lookup(tmp_path):
    assert fetch.target_dir("mnist", tmp_path) == tmp_path
    assert fetch.target_dir("cifar10", tmp_path) == tmp_path
    assert fetch.target_dir("fashion-mnist", tmp_path) == tmp_path / "fashion-mnist"


def test_official_table():
    mnist = datasets.entry("mnist").source
    assert [f.filename for f in mnist.files] == ["train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz",
                                                 "t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz"]
    assert mnist.files[0].md5 == "f68b3c2dcbeaaa9fbdd348bbdeb94873"
    assert fetch.mirror_hosts("mnist") == ["ossci-datasets.s3.amazonaws.com", "storage.googleapis.com"]
    assert datasets.entry("fashion-mnist").source.files[3].md5 == "bb300cfdad3c16e7a12a480ee83cd310"
    assert datasets.entry("cifar10").source.files == (datasets.RemoteFile("cifar-10-python.tar.gz",
                                                                        "c58f30108f718f92721af3b95e74349a"),)
    for source in (datasets.entry(name).source for name in datasets.downloadable()):
        assert all(m.endswith("/") for m in source.mirrors)
        assert all(re.fullmatch(r"[0-9a-f]{32}", f.md5) for f in source.files)
