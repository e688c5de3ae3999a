"""A saved model at work: load_model predicts raw uint8 images as the run scored them; `towerlab
evaluate` gives back the run's recorded accuracy; `towerlab predict` labels an .npz."""

import numpy as np
import pytest
import torch

from towerlab import api
from towerlab.api import evaluate
from towerlab.cli import main
from towerlab.data.load import load_dataset
from towerlab.data.synthetic import SyntheticOptions
from towerlab.errors import UserError
from towerlab.models.files import load_model
from util import TINY, interrupt, summary


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A LeNet-5 trained with bf16 autocast and scored with flip test-time augmentation (so both must
    follow the model into predict)."""
    out = tmp_path_factory.mktemp("eval") / "run"
    assert main(["train", *TINY, "--model", "lenet5", "--steps", "12", "--batch-size", "64",
                 "--precision", "bf16", "--tta", "flip", "--out", str(out)]) == 0
    return out


def synthetic_test_split():
    ds = load_dataset("synthetic", val_size=500, log=print, synthetic=SyntheticOptions(train=2000, test=2000 // 6))
    return ds.x_test[:, 0].numpy(), ds.y_test.numpy()  # Keras layout: (N, 28, 28)


def test_load_model_predicts_raw_images_with_the_runs_accuracy(trained):
    model, record = load_model(trained)  # the run folder, or its model.pt
    assert not model.training and not model.network.training  # calling it never updates BatchNorm statistics
    x, y = synthetic_test_split()
    assert (model.precision, model.tta) == ("bf16", "flip") == (record["config"]["precision"], record["config"]["tta"])
    assert float((model.predict(x) == y).mean()) == summary(trained)["test_accuracy"]
    assert model.classifier is model.network.classifier  # the network's own attributes, as before
    probabilities = model.predict_proba(x[:7])
    assert probabilities.shape == (7, 10) and np.allclose(probabilities.sum(1), 1, atol=1e-5)
    # Raw pixels and the normalised float input the network takes give the same logits.
    raw = torch.from_numpy(x[:5, None])
    torch.testing.assert_close(model(raw), model(model.normalize(raw)))
    assert model.normalize(raw).dtype == torch.float32 and abs(float(model.normalize(raw).mean())) < 1.0


def test_evaluate_gives_back_the_recorded_test_accuracy(trained, capsys):
    result = evaluate(trained)
    recorded = summary(trained)["test_accuracy"]
    assert result["accuracy"] == recorded == result["recorded"]
    assert (result["dataset"], result["split"], result["n"]) == ("synthetic", "test", 333)
    assert result["loss"] == pytest.approx(summary(trained)["test_loss"], rel=1e-4)
    assert evaluate(trained, split="val")["accuracy"] == summary(trained)["val_accuracy"]
    assert main(["evaluate", str(trained)]) == 0
    assert f"test accuracy {recorded:.4f}" in capsys.readouterr().out


def test_predict_writes_predictions_and_the_accuracy_against_the_labels(trained, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    x, y = synthetic_test_split()
    np.savez(tmp_path / "images.npz", x=x, y=y)
    assert main(["predict", str(trained), "images.npz"]) == 0
    line = capsys.readouterr().out
    recorded = summary(trained)["test_accuracy"]
    assert f"accuracy {recorded:.4f} against its labels (y)" in line and "Predicted 333 images" in line
    with np.load(tmp_path / "images-predictions.npz") as written:
        assert written["predictions"].shape == (333,) and written["probabilities"].shape == (333, 10)
        assert float((written["predictions"] == y).mean()) == recorded
    np.savez(tmp_path / "unlabelled.npz", images=x[:10, :, :, None])  # (N, H, W, C), no labels
    assert main(["predict", str(trained), "unlabelled.npz", "--out", "p.npz"]) == 0
    assert "accuracy" not in capsys.readouterr().out
    with np.load(tmp_path / "p.npz") as written:
        assert written["predictions"].tolist() == load_model(trained)[0].predict(x[:10]).tolist()


def test_predict_writes_beside_its_input_by_default_and_where_out_says_otherwise(trained, tmp_path, capsys,
                                                                                  monkeypatch):
    (tmp_path / "data").mkdir()
    (tmp_path / "here").mkdir()
    x, y = synthetic_test_split()
    np.savez(tmp_path / "data" / "images.npz", x=x[:20], y=y[:20])
    monkeypatch.chdir(tmp_path / "here")
    assert main(["predict", str(trained), "../data/images.npz"]) == 0
    assert capsys.readouterr().out.startswith("Predicted 20 images of ../data/images.npz (x) -> "
                                              "../data/images-predictions.npz; ")
    assert sorted(p.name for p in (tmp_path / "data").iterdir()) == ["images-predictions.npz", "images.npz"]
    assert list((tmp_path / "here").iterdir()) == []  # nothing in the current folder
    assert main(["predict", str(trained), "../data/images.npz", "--out", "mine.npz"]) == 0  # as given: here
    with np.load(tmp_path / "here" / "mine.npz") as mine, np.load(tmp_path / "data" / "images-predictions.npz") as beside:
        assert mine["predictions"].tolist() == beside["predictions"].tolist()


@pytest.mark.parametrize("args, fragment", [
    (["evaluate", "nowhere"], "does not exist"),
    (["evaluate", "{run}", "--dataset", "imagenet"], "unknown dataset 'imagenet'"),
    (["evaluate", "{run}", "--dataset", "cifar10", "--data-dir", "{tmp}"], "cifar10 not found"),
    (["predict", "{run}", "missing.npz"], "no file missing.npz"),
    (["predict", "{run}", "{tmp}/wrong.npz"], "holds no images"),
    (["predict", "{run}", "{tmp}/small.npz"], "expected images of 28x28"),
])
def test_evaluate_and_predict_refuse_bad_input_in_one_line(args, fragment, trained, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("TOWERLAB_MIRROR", "http://127.0.0.1:9")
    np.savez(tmp_path / "wrong.npz", z=np.zeros(3))
    np.savez(tmp_path / "small.npz", x=np.zeros((2, 12, 12), np.uint8))
    assert main([a.format(run=trained, tmp=tmp_path) for a in args]) == 2
    err = capsys.readouterr().err.splitlines()
    assert fragment in err[-1] and err[-1].startswith("towerlab: error: ")
    assert len(err) == 1 or err[0].startswith("cifar10 not found in")  # a download was tried first


NET_FILE = """
from torch import nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Flatten(), nn.Linear(28 * 28, 16), nn.ReLU(), nn.Linear(16, 10))

    def forward(self, x):
        return self.body(x)


def not_a_network():
    return 3
"""


@pytest.fixture(scope="module")
def trained_own(tmp_path_factory):
    """A run trained from Python with a network of one's own, defined in the file mynet.py."""
    import importlib.util

    folder = tmp_path_factory.mktemp("own")
    (folder / "mynet.py").write_text(NET_FILE)
    spec = importlib.util.spec_from_file_location("mynet", folder / "mynet.py")
    mynet = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mynet)
    api.train(mynet.Net, "synthetic", synthetic_train=2000, val_size=500, devices=1, device="cpu", steps=5,
              progress=False, display_step=1000, out=str(folder / "run"))
    return folder


def test_evaluate_and_predict_take_a_network_of_ones_own_with_module(trained_own, capsys, monkeypatch):
    monkeypatch.chdir(trained_own)
    recorded = summary(trained_own / "run")["test_accuracy"]
    x, y = synthetic_test_split()
    np.savez(trained_own / "images.npz", x=x, y=y)
    for command in (["evaluate", "run"], ["predict", "run", "images.npz"]):
        assert main([*command]) == 2  # without it: the remedy is the flag, not Python
        assert capsys.readouterr().err == ("towerlab: error: run/model.pt holds a network of your own (mynet.Net): "
                                           "give the file that defines it, --module FILE.py:Net\n")
    with pytest.raises(UserError, match=r"\(mynet.Net\): rebuild it with load_model\(path, module=YourModule\(\)\)"):
        load_model("run")  # from Python, the remedy is Python's
    assert main(["evaluate", "run", "--module", "mynet.py:Net"]) == 0
    assert f"test accuracy {recorded:.4f}" in capsys.readouterr().out
    assert main(["predict", "run", "images.npz", "--module", str(trained_own / "mynet.py") + ":Net"]) == 0
    assert f"accuracy {recorded:.4f} against its labels (y)" in capsys.readouterr().out


@pytest.mark.parametrize("spec, message", [
    ("mynet.py", "--module mynet.py: give FILE.py:NAME, the file that defines it"),
    ("nowhere.py:Net", "--module nowhere.py:Net: no file nowhere.py"),
    ("mynet.py:Nope", "--module mynet.py:Nope: mynet.py defines no Nope"),
    ("mynet.py:not_a_network", "your model factory returned int, not an nn.Module"),
    ("notes.txt:Net", "--module notes.txt:Net: notes.txt is not a Python file (FILE.py)"),
])
def test_a_module_flag_that_gives_no_network_is_one_line(spec, message, trained_own, capsys, monkeypatch):
    monkeypatch.chdir(trained_own)
    (trained_own / "notes.txt").write_text("not Python")
    assert main(["evaluate", "run", "--module", spec]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("towerlab: error: ") and message in err


MODEL_FUNCTION_FILE = '''
from torch import nn


def make(input_shape, num_classes, width=16):
    c, h, w = input_shape
    return nn.Sequential(nn.Flatten(), nn.Linear(c * h * w, width), nn.ReLU(), nn.Linear(width, num_classes))
'''


def test_train_takes_a_model_function_from_a_file_and_evaluate_and_resume_take_it_again(tmp_path, capsys,
                                                                                         monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "mynet.py").write_text(MODEL_FUNCTION_FILE)
    args = [*TINY, "--model", "mynet.py:make", "--model-opt", "width=12", "--epochs", "3", "--batch-size", "100"]
    interrupt(args, tmp_path / "run", monkeypatch)  # stopped at step 23 of 45, a checkpoint kept
    capsys.readouterr()
    assert main(["train", "--resume", "run"]) == 2  # the function is given again on resume; without it, one line
    err = capsys.readouterr().err
    assert "--model FILE.py:FUNCTION (give it again on --resume)" in err and err.count("\n") == 1
    assert main(["train", "--resume", "run", "--model", "mynet.py:make"]) == 0
    record = summary(tmp_path / "run")
    assert (record["model"], record["steps"]) == ("custom", 45)
    network = torch.load(tmp_path / "run" / "model.pt", weights_only=True)["state_dict"]
    # make's network, built for the data's shape and classes, with the width --model-opt gave it
    assert network["1.weight"].shape == (12, 28 * 28)
    capsys.readouterr()
    assert main(["evaluate", "run", "--module", "mynet.py:make"]) == 0  # rebuilt with the options model.pt records
    assert f"test accuracy {record['test_accuracy']:.4f}" in capsys.readouterr().out
    for extra, fragment in [(["--model", "mynet.py:nope"], "--model mynet.py:nope: mynet.py defines no nope"),
                            (["--model", "none.py:make"], "--model none.py:make: no file none.py"),
                            (["--model", "mynet.py:make", "--model-opt", "depth=2"],
                             "--model-opt depth: make(input_shape, num_classes, ...) takes no keyword argument "
                             "'depth' (it takes: width)")]:
        assert main(["train", *TINY, *extra, "--out", "x"]) == 2
        err = capsys.readouterr().err
        assert fragment in err and err.count("\n") == 1 and not (tmp_path / "x").exists()


def test_evaluate_and_predict_of_a_model_function_run_name_the_function_it_was_trained_with(tmp_path, capsys,
                                                                                            monkeypatch):
    """model.pt records the model function (FILE.py:FUNCTION): the hint is the very flag to give, from
    any folder, and the banner names the function, not "custom"."""
    (tmp_path / "nets").mkdir()
    (tmp_path / "nets" / "mynet.py").write_text(MODEL_FUNCTION_FILE)
    monkeypatch.chdir(tmp_path / "nets")
    assert main(["train", *TINY, "--model", "mynet.py:make", "--model-opt", "width=12", "--steps", "6",
                 "--batch-size", "100", "--out", str(tmp_path / "run")]) == 0
    assert capsys.readouterr().out.startswith("towerlab: mynet.py:make on synthetic ")
    recorded = summary(tmp_path / "run")["test_accuracy"]
    x, y = synthetic_test_split()
    np.savez(tmp_path / "images.npz", x=x, y=y)
    monkeypatch.chdir(tmp_path)  # elsewhere than the file
    spec = str(tmp_path / "nets" / "mynet.py") + ":make"
    for command in (["evaluate", "run"], ["predict", "run", "images.npz"]):
        assert main(command) == 2
        err = capsys.readouterr().err
        assert err == (f"towerlab: error: run/model.pt holds a network built by a model function of yours: give the "
                       f"file that defines it, --module {spec}\n")
        flag = err.split()[-2:]  # the hint, followed to the letter
        assert flag == ["--module", spec] and main([*command, *flag]) == 0
        assert f"ccuracy {recorded:.4f}" in capsys.readouterr().out
    with pytest.raises(UserError, match=r"model function of yours \(.*mynet.py:make\): .*load_model\(path, module=make\)"):
        load_model("run")
