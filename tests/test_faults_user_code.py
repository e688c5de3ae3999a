"""Code of yours that fails (issue 50): a model function that raises or calls sys.exit(), in train,
a search, evaluate and predict; an optuna.py beside your model file; genes and options named like
a model function's positional parameters."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from towerlab.cli import main
from util import SEARCH_BASE, TINY, run_cli

def one_line(err: str, fragment: str) -> None:
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("towerlab: error: ") and fragment in lines[0], err



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
