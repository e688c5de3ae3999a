"""A private PostgreSQL server for the tests: `initdb` into a temporary folder, started on a free loopback
port, stopped afterwards; never a server left over from elsewhere. As root, the server runs as the
`postgres` user (PostgreSQL refuses to run as root). Where no server can be started (no PostgreSQL
installed, no psycopg), the tests that need one skip and say why."""

from __future__ import annotations

import contextlib
import glob
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import time
import uuid
from pathlib import Path


def _bindir() -> Path | None:
    found = shutil.which("initdb")
    if found:
        return Path(found).parent
    versions = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=lambda p: int(Path(p).parts[-3]))
    return Path(versions[-1]).parent if versions else None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """One PostgreSQL cluster of our own. `database()` makes a new empty database and returns its URL."""

    def __init__(self) -> None:
        bindir = _bindir()
        if bindir is None:
            raise RuntimeError("no PostgreSQL server is installed (initdb not found; apt-get install postgresql)")
        try:
            import psycopg  # noqa: F401 - the driver the stores use
        except ImportError:
            raise RuntimeError("psycopg is not installed (pip install 'towerlab[postgresql]')") from None
        self.bindir = bindir
        self.user = None if os.geteuid() != 0 else "postgres"
        self.folder = Path(tempfile.mkdtemp(prefix="towerlab-pg-"))
        self.data = self.folder / "data"
        self.port = _free_port()
        if self.user is not None:
            entry = pwd.getpwnam(self.user)
            os.chown(self.folder, entry.pw_uid, entry.pw_gid)
        self.version = self._run("postgres", "--version").stdout.strip()
        self._run("initdb", "-D", str(self.data), "-A", "trust", "-U", "postgres", "--no-sync", "-E", "UTF8")
        self.start()

    def _run(self, tool: str, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        command = [str(self.bindir / tool), *args]
        if self.user is not None:
            command = ["runuser", "-u", self.user, "--", *command]
        done = subprocess.run(command, capture_output=True, text=True, timeout=120)
        if check and done.returncode != 0:
            raise RuntimeError(f"{tool} failed: {done.stderr.strip() or done.stdout.strip()}")
        return done

    def start(self) -> None:
        options = f"-p {self.port} -k {self.folder} -c listen_addresses=127.0.0.1 -c fsync=off -c max_connections=200"
        self._run("pg_ctl", "-D", str(self.data), "-o", options, "-l", str(self.folder / "log"), "-w", "start")

    def stop(self, mode: str = "fast") -> None:
        self._run("pg_ctl", "-D", str(self.data), "-m", mode, "-w", "stop", check=False)

    def restart(self) -> None:
        self.stop()
        self.start()

    def url(self, database: str = "postgres") -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/{database}"

    def database(self) -> str:
        import psycopg

        name = "t" + uuid.uuid4().hex[:12]
        with psycopg.connect(self.url(), autocommit=True) as db:
            db.execute(f"CREATE DATABASE {name}")
        return self.url(name)

    def password_database(self, password: str) -> str:
        """A new database owned by a new user who must give `password` (scram-sha-256, where every other
        user is trusted); its URL without the password."""
        import psycopg
        import psycopg.sql

        name = "p" + uuid.uuid4().hex[:12]
        with psycopg.connect(self.url(), autocommit=True) as db:
            db.execute(psycopg.sql.SQL("CREATE USER {} PASSWORD {}").format(psycopg.sql.Identifier(name),
                                                                            psycopg.sql.Literal(password)))
            db.execute(f"CREATE DATABASE {name} OWNER {name}")
        hba = self.data / "pg_hba.conf"
        rule = f"host all {name} 127.0.0.1/32 scram-sha-256\n"
        hba.write_text(rule + hba.read_text())
        self._run("pg_ctl", "-D", str(self.data), "reload")
        url = f"postgresql://{name}@127.0.0.1:{self.port}/{name}"
        for _ in range(100):  # the server reads pg_hba.conf again a moment after the signal
            try:
                psycopg.connect(url, password="", connect_timeout=5).close()
            except psycopg.OperationalError:
                return url
            time.sleep(0.05)
        raise RuntimeError("the server never asked for the new user's password (pg_hba.conf not reloaded)")

    def close(self) -> None:
        self.stop("immediate")
        with contextlib.suppress(OSError):
            shutil.rmtree(self.folder)
