"""Downloads of the official dataset files, checked against their published MD5 and written atomically.

stdlib only (urllib), so fetching needs nothing beyond Python. Each file is streamed into a temporary
file in its destination folder, verified, then moved into place with `os.replace`: an interrupted or
corrupt download never leaves a file under the official name. Mirrors are tried in order.

What is downloaded, from where and to where is each dataset's `source` in the catalog
(towerlab.catalog.datasets): mnist and cifar10 go directly into the data directory, fashion-mnist into
`<data_dir>/fashion-mnist/` because its IDX names clash with MNIST's. A download that fails removes
the folders it created.

`TOWERLAB_MIRROR=URL` replaces the official hosts with one mirror of your own: each file is fetched
from `URL/<dataset>/<official file name>` (e.g. `URL/mnist/train-images-idx3-ubyte.gz`), its MD5
still checked. CI points it at a port nobody listens on to walk the offline path.
"""

from __future__ import annotations

import dataclasses
import hashlib
import http.client
import os
import tempfile
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import BinaryIO, Callable

from towerlab.catalog import datasets
from towerlab.catalog.datasets import RemoteFile, Source
from towerlab.errors import UserError, did_you_mean

# Long enough for a slow mirror to start answering, short enough that an offline machine gives up soon.
TIMEOUT_S = 30.0
# The largest official file (CIFAR-10) is ~170 MB: a longer stream is not the file we asked for.
MAX_DOWNLOAD_BYTES = 512 * 2**20
_CHUNK = 1 << 20

Progress = Callable[[str, int, "int | None"], None]

MIRROR_ENV = "TOWERLAB_MIRROR"


def source_for(name: str) -> Source:
    """Where `name`'s files come from: its catalog entry's official hosts, or $TOWERLAB_MIRROR/<name>/."""
    source = datasets.CATALOG[name].source if name in datasets.CATALOG else None
    if source is None:
        raise UserError(f"nothing to download for dataset '{name}'{did_you_mean(name, datasets.downloadable())}: "
                        f"downloadable ones are {', '.join(datasets.downloadable())}")
    mirror = os.environ.get(MIRROR_ENV, "").strip()
    if not mirror:
        return source
    if urllib.parse.urlsplit(mirror).scheme not in ("http", "https", "file"):
        raise UserError(f"${MIRROR_ENV}={mirror!r} is not an http(s):// or file:// URL")
    return dataclasses.replace(source, mirrors=(f"{mirror.rstrip('/')}/{name}/",))


def target_dir(name: str, data_dir: str | os.PathLike) -> Path:
    """The folder `fetch` writes `name`'s files into."""
    subdir = source_for(name).subdir
    return Path(data_dir) / subdir if subdir else Path(data_dir)


def mirror_hosts(name: str) -> list[str]:
    return [urllib.parse.urlsplit(url).netloc or url for url in source_for(name).mirrors]


def fetch(name: str, data_dir: str | os.PathLike, progress: Progress | None = None) -> list[Path]:
    """Download `name`'s official files into the data directory and return their paths.

    Files already present with the right MD5 are kept. `progress(filename, bytes_done, bytes_total)`
    is called after every chunk; bytes_total is None when the server does not say.
    """
    source = source_for(name)
    dest = target_dir(name, data_dir)
    created = [p for p in (dest, *dest.parents) if not p.exists()]
    try:
        dest.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise UserError(f"cannot create {dest}: {err.strerror or err}: choose another --data-dir") from None
    paths = []
    try:
        for remote in source.files:
            path = dest / remote.filename
            if not (path.is_file() and _md5_of_file(path) == remote.md5):  # a stale or partial copy is replaced
                _download(name, source, remote, path, Path(data_dir), progress)
            paths.append(path)
    except BaseException:
        _remove_empty(created)
        raise
    return paths


def _remove_empty(folders: list[Path]) -> None:
    """Remove the folders a failed fetch created (deepest first), where it left nothing in them."""
    for folder in folders:
        try:
            folder.rmdir()
        except OSError:
            return  # not empty (an earlier file of this fetch, or someone else's), or gone


def _download(name: str, source: Source, remote: RemoteFile, path: Path, data_dir: Path,
              progress: Progress | None) -> None:
    network_failures, bad_checksums = [], []
    for base in source.mirrors:
        url = base + remote.filename
        host = urllib.parse.urlsplit(url).netloc or base
        got_md5, failure = _download_verified(url, path, remote, progress)
        if failure is None and got_md5 == remote.md5:
            return
        if failure is None:
            bad_checksums.append(f"{host} gave md5 {got_md5}")
        else:
            network_failures.append(f"{host} ({failure})")
    if bad_checksums:
        raise UserError(f"{remote.filename} for {name} has the wrong checksum ({'; '.join(bad_checksums)}, "
                        f"expected {remote.md5}; a corrupt mirror or a proxy page?): try again later or put the "
                        f"official files in {path.parent} by hand")
    by_hand = f"put the files in {path.parent} by hand"
    npz = datasets.CATALOG[name].npz_names
    raise UserError(f"could not download {name} from {', '.join(network_failures)} (offline?): {by_hand}"
                    + (f" or copy a {npz[0]} into {data_dir}" if npz else ""))


def _download_verified(url: str, path: Path, remote: RemoteFile,
                       progress: Progress | None) -> tuple[str | None, str | None]:
    """Stream `url` next to `path` and move it there if its MD5 matches.

    Returns (md5 of what arrived, None) or (None, why the mirror failed). Local write errors raise.
    """
    try:
        handle, tmp_name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".part")
    except OSError as err:
        raise UserError(f"cannot write in {path.parent}: {err.strerror or err}: "
                        "choose another --data-dir") from None
    tmp = Path(tmp_name)
    try:
        with os.fdopen(handle, "wb") as out:
            digest, failure = _stream(url, out, tmp, remote.filename, progress)
        if failure is None and digest == remote.md5:
            os.replace(tmp, path)
        return digest, failure
    finally:
        tmp.unlink(missing_ok=True)  # a no-op after the replace; otherwise no partial file stays behind


def _stream(url: str, out: BinaryIO, tmp: Path, filename: str, progress: Progress | None) -> tuple[str | None, str | None]:
    md5 = hashlib.md5(usedforsecurity=False)
    done = 0
    try:
        with urllib.request.urlopen(url, timeout=TIMEOUT_S) as response:
            length = response.headers.get("Content-Length", "")
            total = int(length) if length.isdigit() else None
            while chunk := response.read(_CHUNK):
                done += len(chunk)
                if done > MAX_DOWNLOAD_BYTES:
                    return None, f"more than {MAX_DOWNLOAD_BYTES} bytes, not the expected file"
                md5.update(chunk)
                try:
                    out.write(chunk)
                except OSError as err:
                    raise UserError(f"cannot write {tmp}: {err.strerror or err}: free some space or choose "
                                    "another --data-dir") from None
                if progress is not None:
                    progress(filename, done, total)
            if total is not None and done != total:
                return None, f"connection closed after {done} of {total} bytes"
    except urllib.error.HTTPError as err:
        return None, f"HTTP {err.code}"
    except urllib.error.URLError as err:
        return None, str(err.reason)
    except (http.client.HTTPException, OSError, ValueError) as err:  # timeouts and resets are OSErrors
        return None, f"{type(err).__name__}: {err}"
    return md5.hexdigest(), None


def _md5_of_file(path: Path) -> str:
    md5 = hashlib.md5(usedforsecurity=False)
    try:
        with open(path, "rb") as stream:
            while chunk := stream.read(_CHUNK):
                md5.update(chunk)
    except OSError as err:
        raise UserError(f"cannot read {path}: {err.strerror or err}: fix its permissions or delete it") from None
    return md5.hexdigest()
