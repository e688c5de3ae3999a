"""A run without a terminal (no progress bar: a log, a batch job) is never silent for long: a
progress line after SILENCE_SECONDS without a line, and every set-up phase or evaluation that lasts
named while it lasts. Time comes from a fake clock or settings shrunk to nothing: no test waits for
real seconds, and none asserts a duration."""

from __future__ import annotations

import io
import re
import threading

import pytest

from towerlab import report
from towerlab.training import loop as training
from towerlab.cli import main
from towerlab.report import Reporter, phase
from util import TINY, TINY_DATA

STEPS = ["--steps", "6", "--batch-size", "100"]


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_run_without_a_bar_prints_a_progress_line_after_thirty_silent_seconds():
    clock, stream = FakeClock(), io.StringIO()
    reporter = Reporter(None, progress=False, stream=stream, clock=clock)
    reporter.start_progress(100, 10, lines=True)  # a resumed run: 10 steps done before
    for seconds in (10, 10, 9.5):  # 29.5 s: still quiet
        clock.now += seconds
        reporter.advance()
    assert stream.getvalue() == ""
    clock.now += 0.5
    reporter.advance()  # step 14, 30 s after the start: 4 steps in 30 s, 86 to go
    assert stream.getvalue() == "Progress: step 14/100 (14%), 7.5 s/step, about 11 min left\n"
    reporter.line("Epoch 1/2: ...")  # any line restarts the count
    clock.now += 29
    reporter.advance()
    assert stream.getvalue().count("Progress:") == 1
    clock.now += 1
    reporter.advance()
    assert stream.getvalue().splitlines()[-1] == "Progress: step 16/100 (16%), 10.0 s/step, about 14 min left"


def test_a_progress_line_is_for_runs_without_a_bar_and_only_where_asked():
    clock, stream = FakeClock(), io.StringIO()
    for reporter in (Reporter(None, progress=False, stream=stream, clock=clock),  # not asked (a search)
                     Reporter(None, enabled=False, progress=False, stream=stream, clock=clock)):  # rank 1
        reporter.start_progress(10, 0, lines=reporter.enabled is False)
        clock.now += 100
        reporter.advance()
    assert stream.getvalue() == ""


def test_a_long_phase_is_named_while_it_lasts_and_a_short_one_never(monkeypatch):
    said: list[str] = []
    heard = threading.Event()

    def say(text: str) -> None:
        said.append(text)
        heard.set()

    monkeypatch.setattr(report, "PHASE_NOTICE_SECONDS", 0.0)
    with phase("Setup: compiling the step", say):
        assert heard.wait(60)  # a hang guard: the watcher speaks while the phase lasts
    assert re.fullmatch(r"Setup: compiling the step \(\d+ s so far\)", said[0]), said
    monkeypatch.setattr(report, "PHASE_NOTICE_SECONDS", 3600.0)
    said.clear()
    with phase("Testing on 10 images", say):
        pass
    assert said == []


def test_training_without_a_terminal_says_where_it_is(monkeypatch, capsys, tmp_path):
    """SILENCE_SECONDS shrunk to nothing: every step is "silent long enough", so each one prints its line."""
    monkeypatch.setattr(report, "SILENCE_SECONDS", 0.0)
    monkeypatch.setattr(report, "PHASE_NOTICE_SECONDS", 1e9)  # no phase notices in this test
    assert main(["train", *TINY, *STEPS, "--out", str(tmp_path / "run")]) == 0
    lines = capsys.readouterr().out.splitlines()
    progress = [line for line in lines if line.startswith("Progress: ")]
    assert [line.split(",")[0] for line in progress] == \
        [f"Progress: step {s}/6 ({100 * s / 6:.0f}%)" for s in range(1, 7)], lines
    assert "about" in progress[0] and "about" not in progress[-1]  # nothing is left after the last step


@pytest.fixture
def phase_named(monkeypatch) -> threading.Event:
    """Set whenever a phase is named (PHASE_NOTICE_SECONDS shrunk to nothing, its repeats never), so
    that a phase made slow on purpose can wait for its name (a hang guard of 60 s, not a timing)."""
    monkeypatch.setattr(report, "PHASE_NOTICE_SECONDS", 0.0)
    monkeypatch.setattr(report, "SILENCE_SECONDS", 1e9)
    named = threading.Event()
    line = Reporter.line

    def spy(self: Reporter, text: str) -> None:
        line(self, text)
        if text.endswith(" s so far)"):
            named.set()

    monkeypatch.setattr(Reporter, "line", spy)
    from towerlab.jobs import train as job

    said = job.stdout_line  # the lines before the run's Reporter exists (reading the data)

    def spy_before(text: str) -> None:
        said(text)
        if text.endswith(" s so far)"):
            named.set()

    monkeypatch.setattr(job, "stdout_line", spy_before)
    return named


def until_named(named: threading.Event, then):
    def slow(*args, **kwargs):
        named.wait(60)
        named.clear()
        return then(*args, **kwargs)
    return slow


def test_training_names_its_reading_and_evaluations_while_they_last(phase_named, monkeypatch, capsys, tmp_path):
    from towerlab.jobs import train as job

    monkeypatch.setattr(job, "train_data", until_named(phase_named, job.train_data))
    monkeypatch.setattr(training, "loss_and_accuracy", until_named(phase_named, training.loss_and_accuracy))
    assert main(["train", *TINY, *STEPS, "--out", str(tmp_path / "run")]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^Setup: reading synthetic \(\d+ s so far\)$", out, re.MULTILINE), out
    assert re.search(r"^Validating on 500 images after step 6 \(\d+ s so far\)$", out, re.MULTILINE), out
    assert re.search(r"^Testing on 333 images \(\d+ s so far\)$", out, re.MULTILINE), out
    assert out.index("Validating on") < out.index("Step 6/6 (epoch") < out.index("Testing on") < out.index("Done:")


def test_training_names_the_compilation_of_its_step_while_it_lasts(phase_named, monkeypatch, capsys, tmp_path):
    """--step compiled, its compilation replaced by a wait for its name (then the program runs op by op)."""
    from towerlab.training.program import StepProgram

    def compile_slowly(self, mode, step):
        self.run = self.program

    monkeypatch.setattr(StepProgram, "_warm", until_named(phase_named, compile_slowly))
    assert main(["train", *TINY, *STEPS, "--step", "compiled", "--out", str(tmp_path / "run")]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^Setup: compiling the step with torch.compile, before the clock \(\d+ s so far\)$", out,
                     re.MULTILINE), out
    assert out.index("so far)") < out.index("warm-up steps, undone)") < out.index("Done:")


def test_more_cpu_processes_than_cores_is_one_warning_line(monkeypatch, capfd, tmp_path):
    monkeypatch.setattr("os.cpu_count", lambda: 1)
    args = ["train", *TINY_DATA, *STEPS, "--device", "cpu"]
    assert main([*args, "--devices", "2", "--out", str(tmp_path / "two")]) == 0
    err = capfd.readouterr().err.splitlines()
    assert err == ["towerlab: warning: --devices 2 starts 2 CPU processes on this machine's 1 core(s): they take "
                   "turns on them, so a step is slower than on 1 process(es) with a larger --batch-size for the "
                   "same global batch"], err
    assert main([*args, "--devices", "1", "--out", str(tmp_path / "one")]) == 0
    assert "warning" not in capfd.readouterr().err
