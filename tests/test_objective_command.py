"""A command of yours as a search's objective (towerlab.objective.command, towerlab.objective.process): the
arguments a program gets (and that no value reaches a shell), the environment it runs in, the protocol
its result is read by, how a failure reads, the timeout and Ctrl-C (every process of it ends), and what
is refused before any trial runs."""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from towerlab.distributed.signals import Interrupted, alive
from towerlab.errors import UserError
from towerlab.objective import CommandObjective, Goal, Trial
from towerlab.objective.stdout import read_stdout

PYTHON = shlex.quote(sys.executable)
# Writes what it was given to seen.json in its folder, prints a curve and a result among other lines.
PROGRAM = """
import json, os, sys
names = ("CUDA_VISIBLE_DEVICES", "TOWERLAB_SEED", "TOWERLAB_EPOCHS", "TOWERLAB_DEVICE", "TOWERLAB_FOLDER", "KEPT")
with open(os.path.join(os.environ["TOWERLAB_FOLDER"], "seen.json"), "w") as f:
    json.dump({"argv": sys.argv[1:], "env": {name: os.environ.get(name) for name in names}}, f)
print("starting")
print(json.dumps({"epoch": 0, "loss": 2.0}))
print(json.dumps({"note": "a line without an epoch is not a point"}))
print(json.dumps({"epoch": 1, "loss": 1.0}))
print("the next line is the result")
print(json.dumps({"accuracy": 0.5 + float(sys.argv[2]), "loss": 1.0}))
print("done", file=sys.stderr)
"""


def trial(folder: Path, genes: dict, device: str = "cpu", stop=None) -> Trial:
    return Trial(genes, 7, 3, device, folder / "trial", stop)


def seen(folder: Path) -> dict:
    return json.loads((folder / "trial" / "seen.json").read_text())


@pytest.fixture
def program(tmp_path) -> str:
    path = tmp_path / "prog.py"
    path.write_text(PROGRAM)
    return f"{PYTHON} {shlex.quote(str(path))}"


def test_a_command_gets_its_arguments_and_its_result_is_its_last_json_line(tmp_path, program, monkeypatch):
    monkeypatch.setenv("KEPT", "inherited")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    objective = CommandObjective(f"{program} --lr {{lr}} --name {{name}} --seed {{seed}} --epochs {{epochs}} "
                                 "--out={folder}/ckpt --device {device} --flag {flag} {{literal}}",
                                 ["lr", "name", "flag"], Goal("accuracy"))
    result = objective.run(trial(tmp_path, {"lr": 1e-05, "name": "wide net", "flag": True}))
    assert (result.status, result.metrics, result.fitness) == ("ok", {"accuracy": 0.50001, "loss": 1.0}, 0.50001)
    assert result.curve == ({"epoch": 0, "loss": 2.0}, {"epoch": 1, "loss": 1.0})
    folder = tmp_path / "trial"
    assert seen(tmp_path)["argv"] == ["--lr", "1e-05", "--name", "wide net", "--seed", "7", "--epochs", "3",
                                      f"--out={folder}/ckpt", "--device", "cpu", "--flag", "true", "{literal}"]
    assert seen(tmp_path)["env"] == {"CUDA_VISIBLE_DEVICES": "", "TOWERLAB_SEED": "7", "TOWERLAB_EPOCHS": "3",
                                     "TOWERLAB_DEVICE": "cpu", "TOWERLAB_FOLDER": str(folder), "KEPT": "inherited"}
    assert (folder / "stdout.txt").read_text().splitlines()[0] == "starting"
    assert (folder / "stderr.txt").read_text() == "done\n"


@pytest.mark.parametrize("device, ours, visible, given", [
    ("cuda:1", None, "1", "cuda"), ("cuda", None, "0", "cuda"), ("cuda:1", "4,5", "5", "cuda"),
    ("cuda:0", "GPU-3f2a", "GPU-3f2a", "cuda"), ("cpu", "4,5", "", "cpu"),
])
def test_the_device_is_given_as_programs_expect_it(tmp_path, program, monkeypatch, device, ours, visible, given):
    if ours is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", ours)
    CommandObjective(f"{program} --lr {{lr}} --device {{device}}", ["lr"]).run(trial(tmp_path, {"lr": 0}, device))
    assert seen(tmp_path)["env"]["CUDA_VISIBLE_DEVICES"] == visible
    assert seen(tmp_path)["env"]["TOWERLAB_DEVICE"] == given and seen(tmp_path)["argv"][-1] == given


@pytest.mark.parametrize("value", ["1; touch injected", "$(touch injected)", "`touch injected`", "x' && touch 'injected",
                                   "a\nb | touch injected"])
def test_a_value_is_one_argument_and_never_reaches_a_shell(tmp_path, program, monkeypatch, value):
    monkeypatch.chdir(tmp_path)
    result = CommandObjective(f"{program} --lr {{lr}} --name {{name}}", ["lr", "name"], Goal("accuracy")).run(
        trial(tmp_path, {"lr": 0, "name": value}))
    assert result.status == "ok"
    assert seen(tmp_path)["argv"] == ["--lr", "0", "--name", value]
    assert not (tmp_path / "injected").exists() and not (tmp_path / "trial" / "injected").exists()


def test_every_gene_as_one_json_argument(tmp_path):
    objective = CommandObjective(f"{PYTHON} -c 'import sys; print(sys.argv[1], file=sys.stderr); print(1)' {{genes}}",
                                 ["b", "a"])
    assert objective.run(trial(tmp_path, {"b": [1, 2], "a": "x"})).metrics == {"value": 1.0}
    assert (tmp_path / "trial" / "stderr.txt").read_text() == '{"a": "x", "b": [1, 2]}\n'


def test_a_failing_command_is_a_failed_trial_with_the_tail_of_its_stderr(tmp_path):
    script = "import sys\nfor n in range(1, 8):\n    print(f'line {n}\\x1b[31m', file=sys.stderr)\nsys.exit(3)\n"
    (tmp_path / "fail.py").write_text(script)
    result = CommandObjective(f"{PYTHON} {tmp_path / 'fail.py'}", []).run(trial(tmp_path, {}))
    assert result.status == "failed" and result.fitness is None
    assert result.reason == ("exit status 3; stderr ends: line 3\\x1b[31m | line 4\\x1b[31m | line 5\\x1b[31m | "
                             "line 6\\x1b[31m | line 7\\x1b[31m")


def test_a_program_killed_by_a_signal_or_printing_no_result_fails_its_trial(tmp_path):
    killed = CommandObjective(f"{PYTHON} -c 'import os, signal; os.kill(os.getpid(), signal.SIGKILL)'", [])
    assert killed.run(trial(tmp_path, {})).reason == "killed by SIGKILL"
    silent = CommandObjective(f"{PYTHON} -c 'import sys; print(\"accuracy 0.9\"); print(\"oops\", file=sys.stderr)'",
                              [])
    assert silent.run(trial(tmp_path, {})).reason == \
        "it printed no result (the last line of stdout that is a JSON object or a number); stderr ends: oops"
    missing = CommandObjective(f"{PYTHON} -c 'import json; print(json.dumps(dict(loss=0.5)))'", [], Goal("accuracy"))
    assert missing.run(trial(tmp_path, {})).reason.startswith("its result has no 'accuracy' (it has 'loss')")


def test_a_program_that_runs_past_its_timeout_is_ended_whole(tmp_path):
    objective = CommandObjective("sh -c 'sleep 60 & echo $! > {folder}/pid; wait'", [], timeout=1)
    result = objective.run(trial(tmp_path, {}))
    assert (result.status, result.reason) == ("failed", "timed out after 1 s, and was stopped")
    assert gone(int((tmp_path / "trial" / "pid").read_text()))


def test_what_a_program_leaves_running_ends_with_it(tmp_path):
    objective = CommandObjective("sh -c 'sleep 60 & echo $! > {folder}/pid; echo 0.5'", [])
    assert objective.run(trial(tmp_path, {})).metrics == {"value": 0.5}
    assert gone(int((tmp_path / "trial" / "pid").read_text()))


def gone(pid: int) -> bool:
    """Whether process `pid` has ended, waiting for a SIGKILL sent to it to take effect."""
    for _ in range(200):
        if not alive(pid):
            return True
        time.sleep(0.05)
    return False


def _pid_when_written(path: Path) -> int:
    for _ in range(600):
        if path.exists() and path.read_text().strip():
            return int(path.read_text())
        time.sleep(0.05)
    raise AssertionError(f"{path} was never written")


def test_a_worker_asked_to_stop_ends_the_program_and_says_so(tmp_path):
    pid_file = tmp_path / "trial" / "pid"
    objective = CommandObjective("sh -c 'sleep 60 & echo $! > {folder}/pid; wait'", [])
    with pytest.raises(Interrupted):
        objective.run(trial(tmp_path, {}, stop=lambda: signal.SIGTERM if pid_file.exists() else 0))
    assert gone(_pid_when_written(pid_file))


def test_ctrl_c_ends_the_program_too(tmp_path):
    # Python's own SIGINT handler, whatever this process inherited (a shell's background job ignores SIGINT)
    driver = ("import signal, sys\nfrom pathlib import Path\nfrom towerlab.objective import CommandObjective, Trial\n"
              "signal.signal(signal.SIGINT, signal.default_int_handler)\n"
              "objective = CommandObjective(\"sh -c 'sleep 60 & echo $! > {folder}/pid; wait'\", [])\n"
              "try:\n    objective.run(Trial({}, 0, 1, 'cpu', Path(sys.argv[1])))\n"
              "except KeyboardInterrupt:\n    sys.exit(130)\n")
    process = subprocess.Popen([sys.executable, "-c", driver, str(tmp_path / "trial")])
    pid = _pid_when_written(tmp_path / "trial" / "pid")
    process.send_signal(signal.SIGINT)
    assert process.wait(timeout=60) == 130
    assert gone(pid)


@pytest.mark.parametrize("command, message", [
    ("python train.py --lr {lr} --depth {dept}", "--command: {dept} names neither a gene of the space (lr, depth) nor "
                                                 "what the search gives (seed, epochs, device, folder, start, genes) "
                                                 "(did you mean 'depth'?)"),
    ("python train.py --lr {lr}", "--command: the gene 'depth' reaches the program nowhere: add {depth} to the "
                                  "command, or {genes} (every gene as one JSON object)"),
    ("python train.py --lr {lr:.3f} --depth {depth}", "--command: the argument '{lr:.3f}' holds {lr:.3f}: a "
                                                      "placeholder is a name alone, as {lr}"),
    ("python train.py --lr {lr} --depth {depth} {0}", "holds {0}: a placeholder is a name alone, as {lr}"),
    ("python train.py --lr {lr --depth {depth}", "--command: the argument '{lr': "),
    ("python 'train.py --lr {lr} {depth}", "--command \"python 'train.py --lr {lr} {depth}\": No closing quotation"),
    ("", "--command: give the program to run and its arguments"),
    ("no-such-program-here --lr {lr} --depth {depth}", "--command: no program 'no-such-program-here' here"),
])
def test_a_command_a_trial_could_not_run_is_refused_in_one_line(command, message):
    with pytest.raises(UserError) as refused:
        CommandObjective(command, ["lr", "depth"])
    assert str(refused.value).startswith(message) or message in str(refused.value)
    assert "\n" not in str(refused.value)


def test_a_timeout_is_a_positive_number():
    with pytest.raises(UserError, match="^--trial-timeout 0: give a number of seconds above 0$"):
        CommandObjective("true", [], timeout=0)


def test_the_proof_of_a_command_is_its_text_and_the_files_it_names(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("print(1)\n")
    (tmp_path / "run.yaml").write_text("lr: 1\n")
    command = "python train.py --config=run.yaml --lr {lr} --out {folder}/x missing.txt"
    proof = CommandObjective(command, ["lr"]).proof()
    assert sorted(proof.parts) == ["./run.yaml", "./train.py", "the command"]
    (tmp_path / "run.yaml").write_text("lr: 2\n")
    changed = CommandObjective(command, ["lr"]).proof()
    assert changed.difference(proof.parts).startswith("./run.yaml differs (")
    assert changed.digest != proof.digest
    other = CommandObjective(command.replace("--lr", "--rate"), ["lr"]).proof()
    assert other.difference(changed.parts).startswith("the command differs (")


def test_the_result_lines(tmp_path):
    path = tmp_path / "out.txt"
    path.write_text('{"epoch": 0, "x": 1}\n0.5\n[1, 2]\n{"value": 0.75}\nnot json {"value": 1}\n"0.9"\n')
    assert read_stdout(path) == ({"value": 0.75}, ({"epoch": 0, "x": 1},))
    path.write_text('{"epoch": 3, "loss": 1}\nNaN\n')
    assert read_stdout(path)[1] == ({"epoch": 3, "loss": 1},)
    path.write_text("")
    assert read_stdout(path) == (None, ())


def test_a_program_that_cannot_start_fails_its_trial(tmp_path):
    (tmp_path / "script.sh").write_text("#!/bin/sh\necho 1\n")  # not executable
    result = CommandObjective("{program} --fast", ["program"]).run(trial(tmp_path, {"program": str(tmp_path / "script.sh")}))
    assert (result.status, result.reason) == ("failed", f"cannot start {str(tmp_path / 'script.sh')!r}: "
                                                        f"{os.strerror(13)}")


def test_without_a_pidfd_the_program_is_waited_for_and_ended_the_same(tmp_path, monkeypatch):
    monkeypatch.delattr(os, "pidfd_open")  # not Linux, or a kernel before 5.3: waitid(WNOWAIT) instead
    exits = CommandObjective("sh -c 'sleep 60 & echo $! > {folder}/pid; echo 0.25'", [])
    assert exits.run(trial(tmp_path, {})).metrics == {"value": 0.25}
    assert gone(int((tmp_path / "trial" / "pid").read_text()))
    runs_on = CommandObjective("sh -c 'sleep 60 & echo $! > {folder}/pid; wait'", [], timeout=0.5)
    assert runs_on.run(trial(tmp_path, {})).reason == "timed out after 0.5 s, and was stopped"
    assert gone(int((tmp_path / "trial" / "pid").read_text()))


def test_a_program_that_ignores_sigterm_is_killed_after_the_grace(tmp_path, monkeypatch):
    import towerlab.objective.process as process

    monkeypatch.setattr(process, "GRACE", 0.3)
    objective = CommandObjective("sh -c 'trap \"\" TERM; sleep 60 & echo $! > {folder}/pid; wait'", [], timeout=0.5)
    assert objective.run(trial(tmp_path, {})).reason == "timed out after 0.5 s, and was stopped"
    assert gone(int((tmp_path / "trial" / "pid").read_text()))
