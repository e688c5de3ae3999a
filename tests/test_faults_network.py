"""A PostgreSQL store's network gone silent mid-transaction (a cable cut, a machine gone, a firewall
that drops without a word): the worker's connection must end within a bound and the store say it was
lost, where it waited for a reply that never came (some 15 minutes of the kernel's retransmissions
with a request unanswered, for ever with a reply awaited). The cut is real: a private PostgreSQL
server and its client in a network namespace of their own (`unshare --net`), whose loopback traffic to
the server's port an nftables rule starts dropping mid-transaction."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

NET = ("unshare", "--net")

CLIENT = """
import os, subprocess, sys, threading
sys.path.insert(0, sys.argv[2])
subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
from postgres import Server
import towerlab.search.store.postgresql as pg
from towerlab.search.store.database import StoreLost
from towerlab.search.store import Store

# The bounds made short for the test (the shipped ones take some 25 s to see a cut), and one retry.
pg.KEEPALIVE_IDLE, pg.KEEPALIVE_INTERVAL, pg.KEEPALIVE_COUNT, pg.TCP_USER_TIMEOUT = 1, 1, 2, 3
os.environ["TOWERLAB_DB_RETRY_SECONDS"] = "1"
server = Server()
print(server.folder, flush=True)  # for the test to stop it, should this process be killed
rules = f"table inet cut {{ chain input {{ type filter hook input priority 0; tcp dport {server.port} drop; tcp sport {server.port} drop; }}; }}"

def cut():
    subprocess.run(["nft", "-f", "-"], input=rules, text=True, check=True)

def sending(tx):  # the cut falls between two statements: the second is sent and never acknowledged
    tx.rows("SELECT 1")
    cut()
    return tx.rows("SELECT 2")

def waiting(tx):  # the cut falls while the client waits for the reply to a statement the server has
    threading.Timer(1.0, cut).start()
    return tx.rows("SELECT pg_sleep(30)")

try:
    with Store(server.database()) as store:
        try:
            store.db.write({"sending": sending, "waiting": waiting}[sys.argv[1]])
            print("returned")
        except StoreLost as e:
            print("lost:", e)
finally:
    subprocess.run(["nft", "flush", "ruleset"])
    server.close()
"""


def _cut_works() -> str | None:
    for tool in ("unshare", "ip", "nft"):
        if shutil.which(tool) is None:
            return f"no {tool} command (nftables and iproute2 make the cut)"
    done = subprocess.run([*NET, "sh", "-c", "ip link set lo up && nft add table inet probe"], capture_output=True,
                          text=True)
    return None if done.returncode == 0 else f"no network namespace with nftables here: {done.stderr.strip()}"


@pytest.mark.slow
@pytest.mark.parametrize("moment", ["sending", "waiting"])
def test_a_store_whose_network_goes_silent_mid_transaction_is_lost_within_a_bound(moment):
    why = _cut_works()
    if why is not None:
        pytest.skip(why)
    tests = str(Path(__file__).parent)
    client = subprocess.Popen([*NET, sys.executable, "-c", textwrap.dedent(CLIENT), moment, tests],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = client.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        client.kill()
        out, err = client.communicate()
        _stop_server(out.splitlines()[0])
        pytest.fail(f"the transaction cut {moment} still waited after 120 s")
    lines = out.splitlines()
    assert client.returncode == 0 and len(lines) == 2, out + err
    assert lines[1].startswith("lost: lost the search store's database postgresql://postgres@127.0.0.1:"), lines


def _stop_server(folder: str) -> None:
    """Stop the private server of a client that was killed (its postmaster, by the pid file's first line)."""
    pid_file = Path(folder) / "data" / "postmaster.pid"
    with contextlib.suppress(OSError, ValueError):
        os.kill(int(pid_file.read_text().splitlines()[0]), signal.SIGKILL)
    shutil.rmtree(folder, ignore_errors=True)


def test_a_url_that_sets_its_own_keepalives_keeps_them():
    pytest.importorskip("psycopg")
    from towerlab.search.store.postgresql import silence_bounds

    url = "postgresql://u@db.example/search?keepalives_idle=60&tcp_user_timeout=0"
    assert silence_bounds(url) == {"keepalives": 1, "keepalives_interval": 5, "keepalives_count": 3}
