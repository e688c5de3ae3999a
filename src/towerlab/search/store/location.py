"""What a store's name means, the one place that decides it: a PostgreSQL URL or an SQLite file, in the
spellings SQLAlchemy and Optuna use as well (`store_location`); the store a search job uses (--store, else
$TOWERLAB_STORE, else its folder's search.db: `store_target`) and how its config.json records it
(`recorded_store`); the store a folder or a file means to `search worker`, `show` and `export` (a search
folder's search.db, or the store its config.json names: `store_path`); the file that `Store` opens for a
name (`opened`: a folder's search.db, made where asked). And a URL's password, kept out of every line and
record (`redacted`), warned of where it was typed on a command line, and found again for a URL recorded
without it (`with_password`: libpq reads $PGPASSWORD or ~/.pgpass). Standard library only, and the
store's schema error for a store that is not there (`NoStore`).
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from urllib.parse import quote, unquote, urlsplit

from towerlab.errors import UserError
from towerlab.job_files import job_record
from towerlab.search.store.schema import NoStore

POSTGRES_SCHEMES = ("postgresql", "postgres")
STORE_NAME = "search.db"  # the store's file name inside a search folder


def is_url(text: str) -> bool:
    """Whether a --store names a database server (postgresql://...) rather than a file."""
    return urlsplit(str(text)).scheme in POSTGRES_SCHEMES


_SCHEME = re.compile(r"([A-Za-z][A-Za-z0-9+.-]+):")
_PASSWORD_PARAMETER = re.compile(r"([?&]password=)([^&]*)", re.IGNORECASE)


def password_spans(url: str) -> list[tuple[int, int]]:
    """Where the passwords of a URL lie in it: the user information's after its first ':' up to the last
    '@' (a password may hold '/', '#', '?', '@' or a space, typed unencoded; hiding too much beats showing
    one), and the value of a `password=` parameter."""
    match = _SCHEME.match(url)
    if match is None or not url.startswith("//", match.end()):
        return []
    start = match.end() + 2
    spans = []
    at = url.rfind("@")
    colon = url.find(":", start, at) if at > start else -1
    if colon >= 0:
        spans.append((colon + 1, at))
    spans += [m.span(2) for m in _PASSWORD_PARAMETER.finditer(url, max(at, start))]
    return spans


def redacted(url: str) -> str:
    """`url` without its passwords (user:***@host, password=***), as every message and record shows it."""
    for begin, end in reversed(password_spans(url)):
        url = url[:begin] + "***" + url[end:]
    return url


def shows_a_password(word: str) -> bool:
    """Whether a command-line word (`URL`, or `--flag=URL`) holds a URL with a password in it, which
    every user of the machine can read in the process list."""
    value = word.partition("=")[2] if word.startswith("--") else word
    return any(value[begin:end] not in ("", "***") for begin, end in password_spans(value))


PASSWORD_WARNING = ("towerlab: warning: the password in a URL on the command line is visible to every user of "
                    "this machine (ps, /proc): put it in $PGPASSWORD or ~/.pgpass, or the whole URL in $TOWERLAB_STORE")


def store_location(text: str) -> str:
    """What a store's name (--store, $TOWERLAB_STORE, a command's STORE) means, as towerlab opens it: a
    postgresql:// URL, or the path of an SQLite file. The spellings of SQLAlchemy and Optuna for the same
    are taken as meant (postgresql+psycopg://..., sqlite:///PATH, file:PATH); a URL of another database,
    or one towerlab cannot keep a search in (in memory, with options), is refused in one line, where it
    became a local folder named after it."""
    match = _SCHEME.match(text)
    if match is None:
        return text
    scheme, rest = match.group(1).lower(), text[match.end():]
    base, plus, _driver = scheme.partition("+")
    shown = redacted(text)
    if base in POSTGRES_SCHEMES and rest.startswith("//"):
        url = f"{base}:{rest}" if plus else text
        spans = password_spans(url)
        if spans and spans[0][1] == url.rfind("@"):  # a password typed with '/', '#', '?', '@' or a space
            begin, end = spans[0]  # is meant whole, where libpq would read a host or a path in it
            url = url[:begin] + re.sub(r"[/#?@\s]", lambda m: quote(m.group(), safe=""), url[begin:end]) + url[end:]
        return url
    if base == "sqlite" and rest.startswith("//"):
        if rest == "//":
            return _sqlite_file("", shown)
        if not rest.startswith("///"):
            raise UserError(f"store {shown}: an SQLite URL names a file with three slashes, sqlite:///PATH "
                            "(or give the PATH itself)")
        return _sqlite_file(rest[3:], shown)
    if base == "file":
        parts = urlsplit(text)
        if parts.netloc not in ("", "localhost"):
            raise UserError(f"store {shown}: a file: URL of another machine ({parts.netloc}) is not a file here: "
                            "give a path on this machine, or a postgresql:// URL that every machine reaches")
        if parts.query or parts.fragment:
            raise UserError(f"store {shown}: towerlab opens its SQLite store itself, without URL options: give "
                            "the file's path")
        return _sqlite_file(unquote(parts.path), shown)
    if rest.startswith("//"):
        raise UserError(f"store {shown}: towerlab keeps a search in an SQLite file (a path) or a PostgreSQL "
                        f"database (postgresql://USER@HOST/DB), not in {base}")
    return text


def _sqlite_file(path: str, shown: str) -> str:
    if path in ("", ":memory:") or path.startswith("?"):
        raise UserError(f"store {shown}: an SQLite database in memory is gone when the command ends, so nothing "
                        "would be kept: give a file's path")
    if "?" in path:
        raise UserError(f"store {shown}: towerlab opens its SQLite store itself, without URL options: give the "
                        "file's path")
    return path


STORE_ENV = "TOWERLAB_STORE"  # the store a search or a worker uses when none is named


def with_password(url: str) -> str:
    """A recorded (redacted) URL with its password back, where $TOWERLAB_STORE is that URL with one;
    else without the *** that stands for it, so that libpq finds it in $PGPASSWORD or ~/.pgpass (a
    password "***" is no password)."""
    env = os.environ.get(STORE_ENV, "").strip()
    if env and is_url(url) and is_url(env) and redacted(env) == url:
        return env
    if not is_url(url):
        return url
    spans = password_spans(url)
    if spans and spans[0][1] == url.rfind("@") and url[spans[0][0]:spans[0][1]] == "***":
        url = url[:spans[0][0] - 1] + url[spans[0][1]:]  # user:***@host -> user@host
    return re.sub(r"([?&])password=\*\*\*(&|$)", lambda m: m.group(1) if m.group(2) else "", url, flags=re.IGNORECASE)


def store_target(given: str | None, out: Path) -> str:
    """The store of a search job whose folder is `out`: `given` (--store: a file, or a postgresql:// URL),
    else $TOWERLAB_STORE, else the folder's search.db. A recorded URL has no password (`recorded_store`):
    where $TOWERLAB_STORE is that same URL with one, it is taken from there."""
    named = given or os.environ.get(STORE_ENV, "").strip() or None
    return str(out / STORE_NAME) if named is None else with_password(store_location(named))


def recorded_store(target: str) -> str:
    """The store as config.json and the store record it: a URL without its password."""
    return redacted(target) if is_url(target) else target


def store_named(given: str | None, what: str) -> str:
    """The store a command that reads or joins one means (`search worker`, `search show`): `given` (its
    STORE or DIR), else $TOWERLAB_STORE, as a search job takes it; none is a UserError saying so (`what`:
    the command's own word for what it wants)."""
    named = given or os.environ.get(STORE_ENV, "").strip()
    if not named:
        raise UserError(f"give {what} (a search's folder, its search.db or a postgresql:// URL), or set ${STORE_ENV}")
    return named


def store_path(path: str | os.PathLike) -> str | Path:
    """The store a path means to `search worker`, `show` and `export`: a postgresql:// URL, or a file itself;
    a search folder's search.db, or the store its config.json names when the search kept its evaluations
    elsewhere (--store, or $TOWERLAB_STORE: a recorded URL gets its password from $TOWERLAB_STORE where that
    is the same URL)."""
    if isinstance(path, str):
        path = store_location(path)
    if is_url(str(path)):
        return with_password(str(path))
    path = Path(path)
    if not path.is_dir() or (path / STORE_NAME).exists():
        return path
    named = _record(path).get("store")
    if not isinstance(named, str) or not named:
        return path
    return with_password(named) if is_url(named) else Path(named)


def folder_search(path: str | os.PathLike) -> int | None:
    """The search a search's folder holds (its config.json's): in a store shared by searches, the folder
    means that one; None for a store itself (a file, a URL) or a folder that is no search's."""
    if isinstance(path, str) and is_url(store_location(path)):
        return None
    found = _record(Path(path)).get("search_id") if Path(path).is_dir() else None
    return found if isinstance(found, int) and not isinstance(found, bool) else None


def _record(folder: Path) -> dict:
    """What a search job's config.json says of its store (`store`: where its search was kept, whichever way
    it was named; a record older than that names only --store's, under `search`) and its `search_id`; {}
    where the folder holds no readable record."""
    try:
        record = job_record(folder)
    except (OSError, ValueError):
        return {}
    search = record.get("search")
    store = record.get("store") or (search.get("store") if isinstance(search, dict) else None)
    return {"store": store, "search_id": record.get("search_id")}


def opened(target: str | os.PathLike, create: bool) -> str | Path:
    """What `Store(target)` opens: a postgresql:// URL, or an SQLite file (a folder's search.db), its folder
    made where `create`; a file that is not there without `create` is NoStore."""
    if isinstance(target, str):
        target = store_location(target)
    if is_url(str(target)):
        return str(target)
    path = Path(target)
    if path.is_dir():
        path = path / STORE_NAME
    if not create and not path.is_file():
        raise NoStore(f"no search store at {path}: give the search.db of a search (or the folder holding it)")
    if create:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise UserError(f"cannot create the search store {path}: {exc.strerror or exc}") from None
    return path
