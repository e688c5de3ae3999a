"""The keeper of a trial's program: a small process of the standard library alone, between a worker and
the program it runs, so that every process the program starts ends with it, whoever dies first.

`towerlab.objective.process` starts it (`python -I -S keeper.py LOCK STDOUT STDERR WAITING -- PROGRAM...`),
in a session of its own, and speaks with it through a pipe each way: it answers `started PID` (or
`failed ERRNO TEXT`), then, once the program has ended and everything it left has been killed, `ended
STATUS` (a returncode: negative for a signal); the worker may ask it `end SIGNUM GRACE` (a timeout, a
stop, a Ctrl-C: SIGNUM to the program's group, then SIGKILL to every process of it GRACE seconds later).

- It makes itself a child subreaper (Linux's PR_SET_CHILD_SUBREAPER): a process the program leaves
  behind, even one started in a session of its own (`setsid`, a daemon's double fork), becomes the
  keeper's child when its parent dies, not PID 1's, and the keeper kills every one of them (all its
  descendants, found in /proc) before it says `ended`.
- The end of its pipe from the worker is the worker's life: when the worker dies (SIGKILL, the
  out-of-memory killer, its launcher killed and it with it), the keeper reads the pipe's end and kills
  the program and all it started at once.
- It holds an exclusive lock on the trial's folder (LOCK, an `flock`) from before the program starts to
  its own end, after the last process is gone: a trial tried again in the same folder (its worker was
  lost, and another took it over) waits there for the last one's processes to be gone, up to WAITING
  seconds, rather than run beside them.

Where the system has no subreapers, pidfds or /proc (not Linux), the program's own process group is still
ended with it, as before.
"""

from __future__ import annotations

import fcntl
import os
import select
import signal
import subprocess
import sys
import time
from typing import Optional

PR_SET_CHILD_SUBREAPER = 36
POLL = 0.05  # seconds between looks at the program without a pidfd
NO_PIDFD = "TOWERLAB_KEEPER_NO_PIDFD"  # "1": wait without a pidfd, as the worker does where it has none


def main(argv: list[str]) -> int:
    lock, out, err, waiting = argv[1], argv[2], argv[3], float(argv[4])
    program = argv[argv.index("--") + 1:]
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        # The worker says when to end the program; its death is the pipe's end. Not SIG_IGN, which the
        # program would inherit: a handler is reset to the default by exec.
        signal.signal(signum, _ignored)
    _subreaper()
    held = _lock(lock, waiting)
    if held is not None:
        _say(f"failed 0 {held}")
        return 1
    try:
        with open(out, "wb") as stdout, open(err, "wb") as stderr:
            env = {k: v for k, v in os.environ.items() if k != NO_PIDFD}  # the keeper's, not the program's
            child = subprocess.Popen(program, stdin=subprocess.DEVNULL, stdout=stdout, stderr=stderr, env=env,
                                     start_new_session=True)
    except OSError as exc:
        _say(f"failed {exc.errno or 0} {exc.strerror or exc}")
        return 1
    except ValueError as exc:  # a NUL in an argument
        _say(f"failed 0 {exc}")
        return 1
    _say(f"started {child.pid}")
    _follow(child)
    # Everything the program started is gone (the lock is let go as the keeper exits, not before).
    _kill_all(child.pid)
    child.wait()
    _reap_all()
    _say(f"ended {child.returncode}")
    return 0


def _follow(child: subprocess.Popen) -> None:
    """Wait for the program's leader to exit, or for the worker's word (`end SIGNUM GRACE`: then end it so)
    or death (the pipe's end: then at once)."""
    pidfd = _pidfd(child.pid)
    buffer = b""
    try:
        while not _exited(child.pid, pidfd):
            watched = [sys.stdin.fileno()] + ([pidfd] if pidfd is not None else [])
            ready, _, _ = select.select(watched, [], [], None if pidfd is not None else POLL)
            if sys.stdin.fileno() not in ready:
                continue
            data = os.read(sys.stdin.fileno(), 4096)
            if not data:  # the worker died
                return
            buffer += data
            while b"\n" in buffer:
                line, buffer = buffer.split(b"\n", 1)
                word = line.decode().split()
                if word and word[0] == "end":
                    _end(child.pid, int(word[1]), float(word[2]), pidfd)
    finally:
        if pidfd is not None:
            os.close(pidfd)


def _end(leader: int, signum: int, grace: float, pidfd: Optional[int]) -> None:
    """`signum` to the program's group, GRACE seconds for its leader to exit, then SIGKILL to everything."""
    _signal_group(leader, signum)
    until = time.monotonic() + grace
    while time.monotonic() < until and not _exited(leader, pidfd, min(POLL, max(0.0, until - time.monotonic()))):
        pass
    _kill_all(leader)


def _exited(pid: int, pidfd: Optional[int], wait: float = 0.0) -> bool:
    """Whether the program's leader has exited (it is not reaped: its group's id stays its own)."""
    if pidfd is not None:
        return bool(select.select([pidfd], [], [], wait)[0])
    until = time.monotonic() + wait
    while True:
        if os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None:
            return True
        if time.monotonic() >= until:
            return False
        time.sleep(min(POLL, max(0.0, until - time.monotonic())))


def _signal_group(leader: int, signum: int) -> None:
    try:
        os.killpg(leader, signum)
    except (ProcessLookupError, PermissionError):
        pass  # no process of the group is left


def _kill_all(leader: int) -> None:
    """SIGKILL to the program's group and to every descendant of the keeper (those the program left in
    other sessions came to it as their parents died), again until none is left."""
    _signal_group(leader, signal.SIGKILL)
    for _ in range(1000):
        found = _descendants(os.getpid())
        alive = [pid for pid in found if pid != leader]
        if not alive:
            return
        for pid in alive:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        _reap_all(keep=leader)
        time.sleep(0.01)


def _descendants(root: int) -> list[int]:
    """Every live process under `root` (from /proc's parent ids; none where there is no /proc)."""
    parents: dict[int, int] = {}
    try:
        names = os.listdir("/proc")
    except OSError:
        return []
    for name in names:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                fields = f.read().rpartition(b")")[2].split()
        except OSError:
            continue  # gone meanwhile
        if fields and fields[0] != b"Z":
            parents[int(name)] = int(fields[1])
    found: list[int] = []
    frontier = {root}
    while frontier:
        below = [pid for pid, parent in parents.items() if parent in frontier]
        found += below
        frontier = set(below)
    return found


def _reap_all(keep: Optional[int] = None) -> None:
    """Reap the keeper's children that have ended (but the program's leader, `keep`, while its group is killed)."""
    for pid in _children():
        if pid == keep:
            continue
        try:
            os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            pass
    if keep is None:
        while True:
            try:
                if os.waitpid(-1, os.WNOHANG) == (0, 0):
                    return
            except ChildProcessError:
                return


def _children() -> list[int]:
    try:
        with open(f"/proc/{os.getpid()}/task/{os.getpid()}/children", encoding="ascii") as f:
            return [int(pid) for pid in f.read().split()]
    except OSError:
        return []


def _pidfd(pid: int) -> Optional[int]:
    if os.environ.get(NO_PIDFD) == "1":  # the worker has none: the same way here (a test's)
        return None
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):  # not Linux, or a kernel before 5.3
        return None


def _subreaper() -> None:
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: the program's group is still ended with it
        pass


def _lock(path: str, waiting: float) -> Optional[str]:
    """Hold the trial folder's lock (kept open for the keeper's life); None once held, else why not."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    except OSError as exc:
        return f"cannot open its folder's lock {path}: {exc.strerror or exc}"
    until = time.monotonic() + waiting
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return None
        except BlockingIOError:
            if time.monotonic() >= until:
                return (f"its folder is still held by the processes of an earlier try of this trial after "
                        f"{waiting:g} s (a lost worker's)")
            time.sleep(0.1)


def _ignored(_signum: int, _frame: object) -> None:
    pass


def _say(line: str) -> None:
    try:
        os.write(sys.stdout.fileno(), (line + "\n").encode())
    except OSError:  # the worker is gone: nobody to tell
        pass


if __name__ == "__main__":
    sys.exit(main(sys.argv))
