"""A function of yours as a search's objective (towerlab.objective.function) and the result protocol every
objective shares (towerlab.objective.result): what a trial gives the function, what it gives back, how a
failure reads, and what is refused before any trial runs."""

from __future__ import annotations

import itertools
import math
from pathlib import Path

import numpy as np
import pytest

from towerlab.errors import UserError
from towerlab.objective import FunctionObjective, Goal, Trial, setup
from towerlab.objective.result import number

_NAMES = itertools.count()


def objective_file(folder: Path, text: str, stem: str = "objective") -> str:
    """FILE.py:train for `text`, in a file whose name no other test of this process has loaded."""
    path = folder / f"{stem}_{next(_NAMES)}.py"
    path.write_text(text)
    return f"{path}:train"


def trial(folder: Path, genes: dict, **given) -> Trial:
    return Trial(genes, given.get("seed", 7), given.get("epochs", 3), given.get("device", "cpu"), folder / "trial")


TRAIN = """
def train(lr, depth, seed, epochs, device, folder, report):
    for epoch in range(epochs):
        report(epoch, loss=1.0 / (epoch + 1), lr=lr)
    (folder / "checkpoint.txt").write_text(f"{device} {seed}")
    return {"accuracy": lr * depth + epochs / 100, "loss": 0.25}
"""


def test_a_function_gets_its_genes_and_what_the_search_gives(tmp_path):
    objective = FunctionObjective(objective_file(tmp_path, TRAIN), ["lr", "depth"], Goal("accuracy"))
    result = objective.run(trial(tmp_path, {"lr": 0.5, "depth": 3}, seed=11, epochs=2, device="cuda:1"))
    assert result.status == "ok"
    assert result.metrics == {"accuracy": 1.52, "loss": 0.25}
    assert result.fitness == 1.52
    assert result.curve == ({"epoch": 0, "loss": 1.0, "lr": 0.5}, {"epoch": 1, "loss": 0.5, "lr": 0.5})
    assert (tmp_path / "trial" / "checkpoint.txt").read_text() == "cuda:1 11"
    assert objective.given == ("seed", "epochs", "device", "folder", "report")
    assert setup(objective)["metric"] == "accuracy" and setup(objective)["direction"] == "maximize"


def test_a_minimized_metric_is_ranked_by_its_negation_and_kept_as_returned(tmp_path):
    spec = objective_file(tmp_path, "def train(x):\n    return {'loss': (x - 2) ** 2, 'x': x}\n")
    result = FunctionObjective(spec, ["x"], Goal("loss", "minimize")).run(trial(tmp_path, {"x": 5}))
    assert (result.status, result.metrics, result.fitness) == ("ok", {"loss": 9.0, "x": 5.0}, -9.0)


def test_a_bare_number_is_the_metric_whatever_its_name(tmp_path):
    spec = objective_file(tmp_path, "import numpy as np\ndef train(x):\n    return np.float32(x) / 4\n")
    assert FunctionObjective(spec, ["x"]).run(trial(tmp_path, {"x": 1})).metrics == {"value": 0.25}
    result = FunctionObjective(spec, ["x"], Goal("accuracy")).run(trial(tmp_path, {"x": 3}))
    assert (result.metrics, result.fitness) == ({"accuracy": 0.75}, 0.75)


def test_only_the_names_a_function_takes_are_given(tmp_path):
    spec = objective_file(tmp_path, "def train(epochs, **genes):\n    return sum(genes.values()) + epochs\n")
    objective = FunctionObjective(spec, ["a", "b"])
    assert objective.given == ("epochs",)
    assert objective.run(trial(tmp_path, {"a": 1, "b": 2}, epochs=5)).metrics == {"value": 8.0}


def test_an_exception_fails_the_trial_with_its_type_message_and_line(tmp_path):
    spec = objective_file(tmp_path, "def train(lr, report):\n    report(0, loss=2.0)\n"
                                    "    raise ValueError(f'lr {lr} is too high')\n")
    result = FunctionObjective(spec, ["lr"]).run(trial(tmp_path, {"lr": 3}))
    assert result.status == "failed" and result.fitness is None
    assert result.reason == f"your train failed with these genes at {Path(spec.rpartition(':')[0]).name}:3: " \
                            "ValueError: lr 3 is too high"
    assert result.curve == ({"epoch": 0, "loss": 2.0},)


def test_sys_exit_fails_the_trial_and_a_keyboard_interrupt_stops_everything(tmp_path):
    spec = objective_file(tmp_path, "import sys\ndef train(code):\n    if code == 'int':\n        raise KeyboardInterrupt\n"
                                    "    sys.exit(code)\n")
    objective = FunctionObjective(spec, ["code"])
    assert objective.run(trial(tmp_path, {"code": 3})).reason.endswith("it called sys.exit(3)")
    with pytest.raises(KeyboardInterrupt):
        objective.run(trial(tmp_path, {"code": "int"}))


@pytest.mark.parametrize("returned, reason", [
    ("float('nan')", "its value is nan"),
    ("{'value': float('inf')}", "its value is inf"),
    ("{'accuracy': 0.9}", "its result has no 'value' (it has 'accuracy'): name the metric to search (--metric)"),
    ("None", "it returned NoneType None: return a number or a dict of numbers"),
    ("'0.9'", "it returned str '0.9': return a number or a dict of numbers"),
    ("True", "it returned bool True: return a number or a dict of numbers"),
    ("{'value': 1.0, 'note': 'fast'}", "its result's 'note' is str 'fast', not a number"),
])
def test_a_result_that_is_no_number_fails_the_trial_saying_why(tmp_path, returned, reason):
    spec = objective_file(tmp_path, f"def train():\n    return {returned}\n")
    result = FunctionObjective(spec, []).run(trial(tmp_path, {}))
    assert (result.status, result.reason) == ("failed", reason)


def test_a_non_finite_metric_other_than_the_searched_one_is_kept_as_none(tmp_path):
    spec = objective_file(tmp_path, "def train():\n    return {'value': 0.5, 'loss': float('nan')}\n")
    assert FunctionObjective(spec, []).run(trial(tmp_path, {})).metrics == {"value": 0.5, "loss": None}


def test_a_bad_report_fails_the_trial(tmp_path):
    spec = objective_file(tmp_path, "def train(report):\n    report(1.5, loss=0.1)\n    return 1.0\n")
    result = FunctionObjective(spec, []).run(trial(tmp_path, {}))
    assert result.status == "failed" and "the epoch must be a whole number from 0, got float 1.5" in result.reason


@pytest.mark.parametrize("text, genes, message", [
    ("def train(lr):\n    return lr\n", ["lr", "depth"],
     "takes no gene 'depth' (its parameters: lr): add it as a parameter, or take **genes"),
    ("def train(lr, width):\n    return lr\n", ["lr"],
     "its parameter 'width' is neither a gene of the space (lr) nor what the search gives (seed, epochs, device, "
     "folder, start, report): give it a default, or add the gene to the space"),
    ("def train(lr, seed):\n    return lr\n", ["lr", "seed"],
     "the space's gene 'seed' has the name of what the search gives every trial (seed, epochs, device, folder, "
     "start, report): rename the gene"),
    ("def train(lr, /):\n    return lr\n", ["lr"],
     "its parameter 'lr' is positional-only, and a trial gives everything by name: make it a keyword parameter"),
    ("def train(lr, dept):\n    return lr\n", ["lr", "depth"], "takes no gene 'depth' (did you mean 'dept'?)"),
])
def test_a_function_that_cannot_take_the_space_is_refused_in_one_line(tmp_path, text, genes, message):
    spec = objective_file(tmp_path, text)
    with pytest.raises(UserError) as refused:
        FunctionObjective(spec, genes)
    assert str(refused.value).startswith(f"--objective {spec}")
    assert message in str(refused.value) and "\n" not in str(refused.value)


def test_a_function_that_does_not_exist_is_refused(tmp_path):
    spec = objective_file(tmp_path, "def fit(lr):\n    return lr\n")
    with pytest.raises(UserError, match=r"^--objective .*: .* defines no train$"):
        FunctionObjective(spec, ["lr"])
    with pytest.raises(UserError, match=r"^--objective nowhere.py:train: no file nowhere.py$"):
        FunctionObjective("nowhere.py:train", ["lr"])


def test_a_function_from_python_runs_and_is_named(tmp_path):
    def fit(lr, folder):
        return {"value": lr * 2, "files": len(list(folder.iterdir()))}

    objective = FunctionObjective(fit, ["lr"])
    assert objective.spec.endswith("fit") and objective.run(trial(tmp_path, {"lr": 0.25})).metrics == \
        {"value": 0.5, "files": 0.0}
    with pytest.raises(UserError, match="^your objective .*fit takes no gene 'depth'"):
        FunctionObjective(fit, ["lr", "depth"])


def test_what_counts_as_a_number():
    torch = pytest.importorskip("torch")
    found = [number(v) for v in (3, 0.5, np.float32(0.25), np.int64(2), np.array([1.5]), torch.tensor(0.75),
                                 True, np.bool_(True), np.array([1, 2]), torch.tensor([1.0, 2.0]), "1", None)]
    assert found == [3.0, 0.5, 0.25, 2.0, 1.5, 0.75, None, None, None, None, None, None]
    assert math.isnan(number(float("nan")))


@pytest.mark.parametrize("goal, message", [
    (dict(metric=""), "--metric '': give the name of the result's metric to search"),
    (dict(direction="max"), "--direction 'max': choose maximize or minimize"),
])
def test_a_goal_is_checked(goal, message):
    with pytest.raises(UserError, match=f"^{message}"):
        Goal(**goal)
