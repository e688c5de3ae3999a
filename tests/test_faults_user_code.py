"""Code of yours that fails (issue 50): a model function that raises or calls sys.exit(), in train,
a search, evaluate and predict; an optuna.py beside your model file; genes and options named like
a model function's positional parameters."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from towerlab.cli import main
from util import SEARCH_BASE, TINY, run_cli

MODEL = '''
import sys
from torch import nn


class Net(nn.Sequential):
    def forward(self, x):
        if self.training and EXIT_IN_FORWARD:
            sys.exit(3)
        if not self.training and RAISE_IN_EVAL:
            raise RuntimeError("no predictions today")
        return super().forward(x)


def make(input_shape, num_classes, width=8):
    if width == 13:
        sys.exit()
    if width == 14:
        raise ValueError("width 14 is unlucky")
    c, h, w = input_shape
    return Net(nn.Flatten(), nn.Linear(c * h * w, width), nn.ReLU(), nn.Linear(width, num_classes))


EXIT_IN_FORWARD = RAISE_IN_EVAL = False
'''


def one_line(err: str, fragment: str) -> None:
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("towerlab: error: ") and fragment in lines[0], err


@pytest.fixture
def model_file(tmp_path) -> Path:
    path = tmp_path / "mynet.py"
    path.write_text(MODEL)
    return path


@pytest.mark.parametrize("width, fragment", [
    (13, "your make failed building the network at mynet.py:17: it called sys.exit()"),
    (14, "your make failed building the network at mynet.py:19: ValueError: width 14 is unlucky"),
])
@pytest.mark.parametrize("devices", ["1", "2"])
def test_a_model_function_that_exits_or_raises_ends_train_with_one_line(width, fragment, devices, model_file,
                                                                         tmp_path):
    """sys.exit() ended `train` with exit status 0 and no word; a ValueError was a traceback."""
    out = tmp_path / "run"
    result = run_cli("train", *TINY, "--devices", devices, "--steps", "2", "--model", f"{model_file}:make",
                     "--model-opt", f"width={width}", "--out", str(out), cwd=tmp_path, timeout=180)
    assert result.returncode == 2, result.stderr
    one_line(result.stderr, fragment)
    assert not out.exists()


@pytest.mark.slow
def test_sys_exit_in_a_forward_during_training_is_a_failure(model_file, tmp_path):
    model_file.write_text(MODEL.replace("EXIT_IN_FORWARD = RAISE", "EXIT_IN_FORWARD = True\nRAISE"))
    result = run_cli("train", *TINY, "--steps", "2", "--model", f"{model_file}:make", "--out", str(tmp_path / "run"),
                     cwd=tmp_path, timeout=180)
    assert result.returncode == 2
    assert result.stderr.splitlines()[-1] == ("towerlab: error: the training stopped: code of yours that it ran (the "
                                              "network's forward, or what it calls) called sys.exit(3)")
    assert not (tmp_path / "run" / "summary.json").exists()


@pytest.mark.slow
def test_a_search_records_a_model_function_that_exits_as_a_failed_candidate(model_file, tmp_path):
    space = tmp_path / "space.toml"
    space.write_text('model = "custom"\n[genes]\nwidth = [8, 13, 14]\n')
    out = tmp_path / "grid"
    result = run_cli("grid", *SEARCH_BASE, "--space", str(space), "--remeasure", "0", "--model", f"{model_file}:make",
                     "--out", str(out), cwd=tmp_path, timeout=240)
    assert result.returncode == 0, result.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert (summary["evaluations"], summary["failures"]) == (3, 2)
    from towerlab.search import evaluation_records

    reasons = {r["genome"]["width"]: r["reason"] for r in evaluation_records(out / "search.db")}
    assert reasons[8] is None
    assert reasons[13] == "UserError: your make failed building the network at mynet.py:17: it called sys.exit()"
    assert reasons[14].endswith("at mynet.py:19: ValueError: width 14 is unlucky")


def test_evaluate_and_predict_say_in_one_line_what_a_network_of_yours_raised(model_file, tmp_path, capsys):
    run = tmp_path / "run"
    assert main(["train", *TINY, "--steps", "2", "--model", f"{model_file}:make", "--out", str(run)]) == 0
    broken = tmp_path / "broken.py"
    broken.write_text(MODEL.replace("width == 14", "width == 8"))
    assert main(["evaluate", str(run), "--module", f"{broken}:make"]) == 2
    one_line(capsys.readouterr().err, "your make failed building the network at broken.py:19: ValueError")
    moody = tmp_path / "moody.py"  # builds the same network, whose forward fails outside training
    moody.write_text(MODEL.replace("EXIT_IN_FORWARD = RAISE_IN_EVAL = False", "EXIT_IN_FORWARD, RAISE_IN_EVAL = False, True"))
    images = tmp_path / "x.npz"
    np.savez(images, x=np.zeros((2, 28, 28), np.uint8))
    assert main(["predict", str(run), str(images), "--module", f"{moody}:make", "--out", str(tmp_path / "p.npz")]) == 2
    one_line(capsys.readouterr().err, "your Net failed on the images at moody.py:11: RuntimeError: no predictions today")
    assert not (tmp_path / "p.npz").exists()


@pytest.mark.slow
def test_an_optuna_py_beside_the_model_file_is_not_towerlabs_optuna(model_file, tmp_path):
    """The model file's folder went first on sys.path, so towerlab's own `import optuna` took the file."""
    (model_file.parent / "optuna.py").write_text("import pathlib\npathlib.Path(__file__).with_name('HIJACKED')"
                                                 ".write_text('')\nraise SystemExit('not optuna')\n")
    space = tmp_path / "space.toml"
    space.write_text('model = "custom"\n[genes]\nwidth = [8, 9]\n')
    elsewhere = tmp_path / "cwd"
    elsewhere.mkdir()
    result = run_cli("search", "run", "--sampler", "tpe", *SEARCH_BASE, "--space", str(space), "--population", "2",
                     "--generations", "1", "--remeasure", "0", "--model", f"{model_file}:make",
                     "--out", str(tmp_path / "s"), cwd=elsewhere, timeout=240)
    assert result.returncode == 0, result.stderr
    assert not (tmp_path / "HIJACKED").exists()


def test_a_model_file_still_imports_its_neighbours(tmp_path, capsys):
    (tmp_path / "blocks_of_mine.py").write_text("WIDTH = 5\n")
    (tmp_path / "net.py").write_text(MODEL.replace("def make(input_shape, num_classes, width=8):",
                                                   "from blocks_of_mine import WIDTH\n\n\n"
                                                   "def make(input_shape, num_classes, width=WIDTH):"))
    assert main(["train", *TINY, "--steps", "1", "--model", f"{tmp_path / 'net.py'}:make",
                 "--out", str(tmp_path / "run")]) == 0


KWARGS_MODEL = '''
from torch import nn


def make(input_shape, num_classes, **genes):
    c, h, w = input_shape
    return nn.Sequential(nn.Flatten(), nn.Linear(c * h * w, genes.get("width", 8)), nn.Linear(genes.get("width", 8),
                         num_classes))
'''


@pytest.mark.parametrize("gene", ["num_classes", "input_shape"])
def test_a_gene_named_like_a_positional_parameter_of_a_kwargs_function_is_refused_up_front(gene, tmp_path, capsys):
    (tmp_path / "kw.py").write_text(KWARGS_MODEL)
    space = tmp_path / "space.toml"
    space.write_text(f'model = "custom"\n[genes]\nwidth = [8]\n{gene} = [3]\n')
    out = tmp_path / "grid"
    assert main(["grid", *SEARCH_BASE, "--space", str(space), "--model", f"{tmp_path / 'kw.py'}:make",
                 "--out", str(out)]) == 2
    one_line(capsys.readouterr().err, f"gene {gene!r} is neither a training gene")
    assert not out.exists()
    assert main(["train", *TINY, "--steps", "1", "--model", f"{tmp_path / 'kw.py'}:make", "--model-opt", f"{gene}=3",
                 "--out", str(out)]) == 2
    one_line(capsys.readouterr().err, f"--model-opt {gene}: make gets {gene} as a positional parameter")
    assert not out.exists()
