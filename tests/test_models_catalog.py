"""The model catalog: one entry per model, the --model choices; a model added as one file and
one registry line trains by name, and a search varies its builder's options."""

import pytest

from towerlab import api, config
from towerlab.data.synthetic import make_synthetic
from towerlab.errors import UserError
from towerlab.catalog.models import CATALOG, ModelEntry
from towerlab.models import build_model
from towerlab.models.mlp import ACTIVATIONS

QUIET = {"display_step": 1000, "progress": False, "device": "cpu"}

# A family of one's own, written as a file of towerlab.models would be (see models/mlp.py).
TINY_FAMILY = '''
from torch import nn


class TinyNet(nn.Module):
    def __init__(self, input_shape, num_classes=10, *, hidden=8):
        super().__init__()
        channels, height, width = input_shape
        self.hidden = nn.Linear(channels * height * width, hidden)
        self.out = nn.Linear(hidden, num_classes)

    def forward(self, x):
        return self.out(self.hidden(x.flatten(1)).relu())
'''


@pytest.fixture
def tiny_family(tmp_path, monkeypatch):
    """Model "tiny" added the documented way: its file and its catalog line."""
    (tmp_path / "tinyfamily.py").write_text(TINY_FAMILY)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(CATALOG, "tiny", ModelEntry("tinyfamily:TinyNet", channels_last=False))
    return "tiny"


def arrays(n_train=1200, n_test=300):
    data = make_synthetic((1, 28, 28), n_train, n_test, seed=0)
    return data["x_train"][:, 0], data["y_train"], data["x_test"][:, 0], data["y_test"]


def test_the_models_of_config_are_the_catalogs_in_its_order(tiny_family):
    assert tuple(config.MODELS) == ("lenet5", "cifarnet", "convnet", "mlp", "cnn", "whitenet", "tiny")
    assert config.TrainConfig(model="tiny").model == "tiny"
    with pytest.raises(UserError, match="unknown model 'tiniest': choose one of lenet5, cifarnet, convnet, mlp, cnn, "
                                        "whitenet, tiny"):
        config.TrainConfig(model="tiniest")


def test_options_are_read_from_the_builders_signature():
    assert CATALOG["mlp"].options == ("layers", "neurons", "activation", "dropout")
    assert CATALOG["cnn"].options == ("blocks", "filters", "kernel_size", "dense", "dropout")
    assert CATALOG["convnet"].options == ("dropout",) and CATALOG["lenet5"].options == ()
    for name, entry in CATALOG.items():  # a search's declared genes are options the builder takes
        assert set(entry.genes or ()) <= set(entry.options), name
    assert CATALOG["mlp"].genes["activation"].choices == tuple(ACTIVATIONS)


def test_only_whitenet_has_hooks_and_only_mlp_trains_without_channels_last():
    hooked = {name for name, entry in CATALOG.items() if entry.hooks.fit is not None}
    assert hooked == {"whitenet"} and CATALOG["whitenet"].hooks.fit_images == 5000
    assert [name for name, entry in CATALOG.items() if not entry.channels_last] == ["mlp"]


def test_a_model_added_as_one_file_and_one_registry_line_trains_by_name(tiny_family, tmp_path):
    x, y, x_test, y_test = arrays()
    run = api.train(tiny_family, (x, y), test=(x_test, y_test), val_size=200, devices=1, epochs=1,
                    batch_size=50, lr=0.01, model_options={"hidden": 16}, out=str(tmp_path / "run"), **QUIET)
    assert run.config["train"]["model"] == "tiny" and run.model_options == {"hidden": 16}
    assert run.steps == 20 and run.test_accuracy > 0.5  # learnable synthetic data, chance is 0.1
    # model.pt names the model: load_model rebuilds it through the catalog, with its option
    assert run.model.network.hidden.out_features == 16
    assert float((run.model.predict(x_test) == y_test).mean()) == run.test_accuracy
    with pytest.raises(UserError, match=r"model tiny has no option width \(its options: hidden\)"):
        build_model("tiny", (1, 28, 28), 10, width=3)


def test_a_search_varies_an_added_models_options(tiny_family, tmp_path):
    x, y, x_test, y_test = arrays(600, 100)
    search = api.grid({"model": tiny_family, "genes": {"hidden": [2, 16]}}, (x, y), test=(x_test, y_test),
                      val_size=100, max_epochs=1, top=1, devices=1, progress=False, device="cpu",
                      out=str(tmp_path / "grid"))
    assert search.evaluations == 2 and search.generations[0]["evaluated"] == 2 and search.best["model"] == "tiny"
    hidden = search.best["genome"]["hidden"]
    assert hidden in (2, 16) and f"--model tiny --model-opt hidden={hidden} " in search.best["command"]
    assert 0 <= search.best["test_accuracy"] <= 1


@pytest.mark.parametrize("space, fragment", [
    ({"model": "lenet5", "genes": {"dropout": [0.1]}}, "gene 'dropout' is neither a training gene (optimizer, lr, "
     "batch_size, epochs, label_smoothing) nor a keyword argument of LeNet5(input_shape, num_classes, ...)"),
    ({"model": "tiny", "genes": {"width": [8]}}, "gene 'width' is neither a training gene"),
])
def test_a_gene_the_models_function_does_not_take_is_refused_before_anything_trains(
        space, fragment, tiny_family, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    x, y, _, _ = arrays(600, 100)
    with pytest.raises(UserError) as err:
        api.grid(space, (x, y), val_size=100, max_epochs=1, devices=1, progress=False, device="cpu")
    assert fragment in str(err.value) and "\n" not in str(err.value)
    assert [p.name for p in tmp_path.iterdir()] == ["tinyfamily.py"]
