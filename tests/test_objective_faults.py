"""Nothing a trial prints or does may kill the search (issue 74, items 8-13, 16, 20): what a trial of your own
function or command gives back is read within bounds (size, depth, range, time), anything it prints, raises or
does fails that trial alone with its reason, and every process it started ends with it, whoever dies first."""

from __future__ import annotations

import asyncio
import itertools
import os
import shlex
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

import towerlab.objective.stdout as stdout_module
import towerlab.objective.result as result_module
from towerlab.distributed.signals import alive
from towerlab.errors import UserError
from towerlab.objective import CommandObjective, FunctionObjective, Goal, Trial

PYTHON = shlex.quote(sys.executable)
_NAMES = itertools.count()


def function(folder: Path, text: str) -> str:
    path = folder / f"faulty_{next(_NAMES)}.py"
    path.write_text(textwrap.dedent(text))
    return f"{path}:train"


def trial(folder: Path, genes: dict | None = None, stop=None) -> Trial:
    return Trial(genes or {}, 7, 3, "cpu", folder / "trial", stop)


def printing(folder: Path, body: str, goal: Goal = Goal(), **given) -> CommandObjective:
    """A command whose program is `body` (Python), run from a file."""
    path = folder / f"prog_{next(_NAMES)}.py"
    path.write_text(textwrap.dedent(body))
    return CommandObjective(f"{PYTHON} {shlex.quote(str(path))}", [], goal, **given)


def gone(pid: int) -> bool:
    for _ in range(400):
        if not alive(pid):
            return True
        time.sleep(0.05)
    return False


def written(path: Path) -> str:
    for _ in range(1200):
        if path.exists() and path.read_text().strip():
            return path.read_text().strip()
        time.sleep(0.05)
    raise AssertionError(f"{path} was never written")


# -- item 8: what a trial gives back fails that trial alone --------------------------------------------------


def test_a_json_line_nested_past_what_python_reads_fails_its_trial(tmp_path):
    result = printing(tmp_path, "print('[' * 1500 + ']' * 1500)\nprint('{\"value\": ' + '[' * 1500 + ']' * 1500 + '}')\n"
                      ).run(trial(tmp_path))
    assert (result.status, result.reason) == ("failed", "line 2 of its stdout is JSON nested deeper than towerlab "
                                                        "reads: a result is one object of numbers")


@pytest.mark.parametrize("body", ["print('1' + '0' * 400)", "print('{\"value\": 1' + '0' * 400 + '}')"])
def test_an_integer_beyond_a_float_is_an_infinite_metric(tmp_path, body):
    result = printing(tmp_path, body).run(trial(tmp_path))
    assert (result.status, result.reason) == ("failed", "its value is inf (an integer beyond a float's range)")


def test_a_function_returning_an_integer_beyond_a_float_fails_its_trial(tmp_path):
    spec = function(tmp_path, "def train():\n    return {'value': 10 ** 400, 'loss': -10 ** 400, 'x': 2}\n")
    result = FunctionObjective(spec, []).run(trial(tmp_path))
    assert (result.status, result.reason) == ("failed", "its value is inf (an integer beyond a float's range)")
    assert result.metrics == {"value": None, "loss": None, "x": 2.0}  # a failed trial keeps what it gave


def test_a_program_killed_by_a_real_time_signal_fails_its_trial(tmp_path):
    result = printing(tmp_path, "import os\nos.kill(os.getpid(), 40)\n").run(trial(tmp_path))
    assert (result.status, result.reason) == ("failed", "killed by signal 40")


def test_a_nul_in_a_string_gene_is_refused_when_the_space_is_read_and_fails_a_trial_that_gets_one(tmp_path):
    from towerlab.search import load_space

    (tmp_path / "space.toml").write_text('[genes]\nname = ["a\\u0000b", "c"]\n')
    with pytest.raises(UserError, match=r"gene 'name' has value 'a\\x00b', which holds a NUL character"):
        load_space(tmp_path / "space.toml", objective=True)
    result = CommandObjective("echo {name}", ["name"]).run(trial(tmp_path, {"name": "a\x00b"}))  # an edited genome
    assert (result.status, result.reason) == ("failed", "cannot start 'echo': embedded null byte")


class Custom(BaseException):
    pass


@pytest.mark.parametrize("raised, said", [("asyncio.CancelledError('nope')", "CancelledError: nope"),
                                          ("Custom('mine')", "Custom: mine"), ("GeneratorExit()", "GeneratorExit")])
def test_a_base_exception_fails_its_trial_and_a_keyboard_interrupt_stops_the_search(tmp_path, raised, said):
    spec = function(tmp_path, f"""
        import asyncio
        from test_objective_faults import Custom
        def train(x):
            if x:
                raise KeyboardInterrupt
            raise {raised}
        """)
    sys.path.insert(0, str(Path(__file__).parent))
    objective = FunctionObjective(spec, ["x"])
    result = objective.run(trial(tmp_path, {"x": 0}))
    assert result.status == "failed" and result.reason.endswith(f".py:7: {said}"), result.reason
    with pytest.raises(KeyboardInterrupt):
        objective.run(trial(tmp_path, {"x": 1}))
    assert asyncio  # the module the function imports


def test_a_result_whose_methods_raise_fails_its_trial(tmp_path):
    spec = function(tmp_path, """
        class Broken:
            def __float__(self):
                raise RuntimeError("no")
            def __repr__(self):
                raise RuntimeError("no repr either")
        class Keys(dict):
            def items(self):
                raise RuntimeError("no items")
        def train(kind):
            return {"value": Broken()} if kind == "value" else Keys(value=1.0) if kind == "keys" else {1: 0.5}
        """)
    objective = FunctionObjective(spec, ["kind"])
    assert objective.run(trial(tmp_path, {"kind": "value"})).reason == \
        "its result's 'value' is Broken (whose repr fails), not a number"
    assert objective.run(trial(tmp_path, {"kind": "keys"})).reason == \
        "its result could not be read: RuntimeError: no items"
    assert objective.run(trial(tmp_path, {"kind": "int"})).reason == \
        "its result names a metric int 1: name each by a string of at most 200 characters"


# -- item 10: stdout read within bounds ------------------------------------------------------------------------


def test_a_json_line_over_the_bound_fails_its_trial_and_a_long_line_of_output_is_passed_over(tmp_path, monkeypatch):
    monkeypatch.setattr(stdout_module, "MAX_LINE", 1000)
    long_output = printing(tmp_path, "print('x' * 5000)\nprint('{\"value\": 0.5}')\n").run(trial(tmp_path))
    assert (long_output.status, long_output.metrics) == ("ok", {"value": 0.5})
    long_json = printing(tmp_path, "print('{\"value\": 0.5, \"pad\": \"' + 'x' * 5000 + '\"}')\n").run(trial(tmp_path))
    assert (long_json.status, long_json.reason) == (
        "failed", "line 1 of its stdout is a JSON line of more than 0 MiB: a result, or a point of its curve, is one "
                  "short line")


def test_a_curve_of_more_points_than_the_bound_fails_its_trial(tmp_path, monkeypatch):
    monkeypatch.setattr(stdout_module, "MAX_CURVE", 50)
    monkeypatch.setattr(result_module, "MAX_CURVE", 50)
    many = printing(tmp_path, "import json\nfor e in range(60):\n    print(json.dumps({'epoch': e, 'loss': 1}))\n"
                              "print(0.5)\n").run(trial(tmp_path))
    assert many.status == "failed" and many.reason.startswith("its stdout holds more than 50 points of a curve")
    spec = function(tmp_path, "def train(report):\n    for e in range(60):\n        report(e, loss=1.0)\n    return 1.0\n")
    reported = FunctionObjective(spec, []).run(trial(tmp_path))
    assert reported.status == "failed" and "more than 50 points of a curve in one trial" in reported.reason


def test_stdout_beyond_its_bounds_in_all_fails_its_trial(tmp_path, monkeypatch):
    monkeypatch.setattr(stdout_module, "MAX_JSON", 2000)
    json_lines = printing(tmp_path, "for n in range(300):\n    print('{\"n\": %d}' % n)\n").run(trial(tmp_path))
    assert json_lines.reason.startswith("its stdout holds more than 0 MiB of JSON lines")
    monkeypatch.setattr(stdout_module, "MAX_STDOUT", 10_000)
    log = printing(tmp_path, "print('x' * 20000)\nprint(0.5)\n").run(trial(tmp_path))
    assert log.status == "failed" and log.reason.startswith("its stdout holds 0.0 GiB, more than towerlab reads")


def test_a_curve_point_is_a_whole_epoch_from_0_with_numbers_and_a_key_given_twice_fails(tmp_path):
    curve = printing(tmp_path, """
        print('{"epoch": "one", "loss": 1}')
        print('{"epoch": -1, "loss": 1}')
        print('{"epoch": 1.5, "loss": 1}')
        print('{"epoch": 1, "loss": NaN, "phase": "train", "acc": 0.5}')
        print('{"epoch": 2.0, "loss": 0.25}')
        print('{"value": 0.5}')
        """).run(trial(tmp_path))
    assert curve.status == "ok" and curve.curve == ({"epoch": 1, "loss": None, "acc": 0.5}, {"epoch": 2, "loss": 0.25})
    twice = printing(tmp_path, "print('{\"value\": 0.5, \"value\": 0.9}')\n").run(trial(tmp_path))
    assert (twice.status, twice.reason) == ("failed", "line 1 of its stdout gives the key 'value' twice: give each once")


def test_a_failed_trial_keeps_the_metrics_it_gave(tmp_path):
    result = printing(tmp_path, "print('{\"val_acc\": 0.75, \"loss\": 0.5}')\n", Goal("accuracy")).run(trial(tmp_path))
    assert result.status == "failed" and result.metrics == {"val_acc": 0.75, "loss": 0.5}


# -- item 11: every process of a trial ends with it, whoever dies first ------------------------------------------

DRIVER = """
import sys
from pathlib import Path
from towerlab.objective import CommandObjective, Trial
objective = CommandObjective(sys.argv[1], [])
print(objective.run(Trial({}, 0, 1, 'cpu', Path(sys.argv[2]))).reason, flush=True)
"""
# A program that starts a child in a session of its own (setsid), writes both pids, and hangs.
HANG = ("sh -c 'setsid sleep 300 & echo $! > {folder}/escaped; sleep 300 & echo $! > {folder}/child; "
        "echo $$ > {folder}/leader; wait'")


def test_a_killed_worker_leaves_no_process_of_its_trial_running(tmp_path):
    """The worker (here a Python process running one trial) killed with SIGKILL, as the out-of-memory killer
    does: the program, its child and the child it started in a session of its own all end."""
    worker = subprocess.Popen([sys.executable, "-c", DRIVER, HANG, str(tmp_path / "trial")])
    pids = [int(written(tmp_path / "trial" / name)) for name in ("leader", "child", "escaped")]
    assert all(alive(pid) for pid in pids)
    worker.kill()
    worker.wait()
    assert all(gone(pid) for pid in pids)


def test_a_session_of_its_own_ends_with_a_program_that_exits(tmp_path):
    # it exits once its child is in a session of its own (the child writes its pid from there)
    objective = CommandObjective("sh -c 'setsid sh -c \"echo \\$\\$ > {folder}/escaped; exec sleep 300\" & "
                                 "while [ ! -s {folder}/escaped ]; do sleep 0.05; done; echo 0.5'", [])
    assert objective.run(trial(tmp_path)).metrics == {"value": 0.5}
    assert gone(int((tmp_path / "trial" / "escaped").read_text()))


def test_a_trial_tried_again_in_its_folder_waits_for_the_last_try_s_processes(tmp_path, monkeypatch):
    """Two tries of one trial in one folder: a lost worker's, and its replacement's. While every process of the
    first lives the second does not start (after WAITING seconds it fails, saying why); once its worker is
    killed, the second starts only when the first's processes are gone."""
    import towerlab.objective.process as process

    log = tmp_path / "log"
    first = f"sh -c 'sleep 300 & echo $! > {log}.sleep; echo first >> {log}; wait'"
    worker = subprocess.Popen([sys.executable, "-c", DRIVER, first, str(tmp_path / "trial")])
    try:
        written(log)
        monkeypatch.setattr(process, "WAITING", 0.5)
        refused = CommandObjective("echo 2", []).run(trial(tmp_path))
        assert (refused.status, refused.reason) == ("failed", "cannot start 'echo': its folder is still held by the "
                                                              "processes of an earlier try of this trial after 0.5 s "
                                                              "(a lost worker's)")
    finally:
        worker.kill()
        worker.wait()
    monkeypatch.setattr(process, "WAITING", 60.0)
    second = f"sh -c 'kill -0 $(cat {log}.sleep) 2>/dev/null && echo first-alive >> {log}; echo second >> {log}; echo 2'"
    assert CommandObjective(second, []).run(trial(tmp_path)).metrics == {"value": 2.0}
    assert log.read_text().split() == ["first", "second"]


def test_a_stop_whose_signal_kills_the_keeper_as_it_starts_stops_the_trial_rather_than_fail_it(tmp_path, monkeypatch):
    """A stop's signal sent to the worker's process group reaches a keeper being started before it is in a
    session of its own, and it dies without a word: a search killed with SIGTERM recorded that trial failed
    ("its keeper process ended before it started it"), and its resume did not train it. Where the worker is
    told to stop, the trial stops as on any stop; where it is not, it still fails, saying so."""
    import towerlab.objective.process as process
    from towerlab.distributed.signals import Interrupted

    keeper = tmp_path / "keeper.py"
    keeper.write_text("import os, signal\nos.kill(os.getpid(), signal.SIGTERM)\n")  # dies as the stop's signal kills it
    monkeypatch.setattr(process, "KEEPER", keeper)
    objective = CommandObjective("echo 2", [])
    with pytest.raises(Interrupted) as stopped:
        objective.run(trial(tmp_path, stop=lambda: signal.SIGTERM))
    assert stopped.value.exit_status == 143
    for stop in (None, lambda: 0):
        lost = objective.run(trial(tmp_path, stop=stop))
        assert (lost.status, lost.reason) == ("failed", "cannot start 'echo': its keeper process ended before it "
                                                        "started it")


# -- item 13: os._exit in a function -------------------------------------------------------------------------


@pytest.mark.parametrize("status", [0, 3])
def test_os_exit_in_a_function_fails_its_trial_and_the_worker_goes_on(tmp_path, status):
    spec = function(tmp_path, f"""
        import os, threading
        def train(thread):
            if thread:
                t = threading.Thread(target=os._exit, args=({status},))
                t.start()
                t.join()
                return 1.0
            os._exit({status})
        """)
    objective = FunctionObjective(spec, ["thread"])
    result = objective.run(trial(tmp_path, {"thread": False}))
    assert result.status == "failed" and result.reason.startswith("your train ended its worker's process at faulty_")
    assert result.reason.endswith(f".py:9: it called os._exit({status})")
    threaded = objective.run(trial(tmp_path, {"thread": True}))
    assert threaded.reason == f"your train ended its worker's process: it called os._exit({status}) (from a thread of " \
                              "its own)"
    assert os._exit.__module__ == "posix"  # put back as the trial ended


def test_a_process_a_trial_forks_still_exits_as_asked(tmp_path):
    spec = function(tmp_path, """
        import os
        def train():
            pid = os.fork()
            if pid == 0:
                os._exit(7)
            return float(os.waitpid(pid, 0)[1] >> 8)
        """)
    assert FunctionObjective(spec, []).run(trial(tmp_path)).metrics == {"value": 7.0}


# -- item 16: a function's timeout, enforced by its worker's process ---------------------------------------------


@pytest.mark.parametrize("body", ["time.sleep(60)", "while True:\n        pass",
                                  "while True:\n        try:\n            time.sleep(60)\n        except Exception:\n"
                                  "            pass"])
def test_a_function_past_its_timeout_fails_its_trial(tmp_path, body):
    spec = function(tmp_path, f"import time\ndef train(report):\n    report(1, loss=0.5)\n    {body}\n")
    result = FunctionObjective(spec, [], timeout=0.5).run(trial(tmp_path))
    assert (result.status, result.reason, result.curve) == ("failed", "timed out after 0.5 s, and was stopped",
                                                            ({"epoch": 1, "loss": 0.5},))
    assert signal.getsignal(signal.SIGALRM) is signal.SIG_DFL and signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)


def test_a_trial_that_swallows_its_timeout_and_then_ends_still_fails_as_timed_out(tmp_path):
    """The raise at the deadline can be lost: met inside a finalizer (a __del__, whose exceptions Python prints and
    ignores: a towerlab training once finished at --trial-timeout 0.01 that way, now and then) or caught by the
    trial. A trial that runs past its timeout fails all the same, as its deadline ends."""
    spec = function(tmp_path, "import time\ndef train():\n    end = time.monotonic() + 1.0\n"
                              "    while time.monotonic() < end:\n        try:\n            time.sleep(0.05)\n"
                              "        except BaseException:\n            pass\n    return 1.0\n")
    result = FunctionObjective(spec, [], timeout=0.2).run(trial(tmp_path))
    assert (result.status, result.reason) == ("failed", "timed out after 0.2 s, and was stopped")
    assert signal.getsignal(signal.SIGALRM) is signal.SIG_DFL and signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)


def test_a_function_that_will_not_stop_ends_its_worker_saying_why(tmp_path):
    """A trial that catches even its timeout: GRACE seconds later its worker's process ends, and says why."""
    spec = function(tmp_path, "import time\ndef train():\n    while True:\n        try:\n            time.sleep(60)\n"
                              "        except BaseException:\n            pass\n")
    driver = ("import sys, towerlab.objective.deadline as d\nfrom pathlib import Path\n"
              "from towerlab.objective import FunctionObjective, Trial\nd.GRACE = 0.5\n"
              "FunctionObjective(sys.argv[1], [], timeout=0.5).run(Trial({}, 0, 1, 'cpu', Path(sys.argv[2])))\n")
    done = subprocess.run([sys.executable, "-c", driver, spec, str(tmp_path / "trial")], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 1
    assert done.stderr.startswith("towerlab: error: a trial ran past its timeout (0.5 s) and did not stop within "
                                  "0.5 s (stuck in native code, or catching every exception): ending its worker")


def test_a_trial_timeout_is_a_positive_number(tmp_path):
    spec = function(tmp_path, "def train():\n    return 1.0\n")
    with pytest.raises(UserError, match=r"^--trial-timeout -1: give a number of seconds above 0$"):
        FunctionObjective(spec, [], timeout=-1)


# -- item 15: which failures are alike -----------------------------------------------------------------------


@pytest.mark.parametrize("reason, way", [
    ("exit status 2; stderr ends: usage: tr.py [-h] | tr.py: error: unrecognized arguments: --hiden 64",
     "exit status 2"),
    ("its result has no 'accuracy' (it has 'val_acc', 'loss'): name the metric to search (--metric)",
     "its result has no 'accuracy' (it has 'val_acc', 'loss'): name the metric to search (--metric)"),
    ("your train failed with these genes at train.py:12: ValueError: width 64 is odd",
     "your train failed with these genes at train.py:12: ValueError"),
    ("timed out after 8 s, and was stopped", None), ("its loss is nan", None), (None, None),
])
def test_what_a_failure_says_whatever_its_genes(reason, way):
    from towerlab.objective.result import failure_way

    assert failure_way(reason) == way
