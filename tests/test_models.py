import math

import pytest
import torch
import torch.nn.functional as F

from towerlab.errors import UserError
from towerlab.models import build_model
from towerlab.models.files import load_model, model_record
from towerlab.models.mlp import MLP
from towerlab.models.seeds import tf_local_response_norm

SHAPES = [(1, 28, 28), (3, 32, 32)]
SMALL_OPTIONS = {"mlp": {"layers": 2, "neurons": 32}, "cnn": {"blocks": 2, "filters": 8, "dense": 16},
                 "whitenet": {"width1": 8, "width2": 16, "width3": 16}}


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("name", ["lenet5", "cifarnet", "convnet", "mlp", "cnn", "whitenet"])
def test_every_model_gives_logits_for_both_input_shapes(name, shape):
    torch.manual_seed(0)
    model = build_model(name, shape, 10, **SMALL_OPTIONS.get(name, {})).eval()
    out = model(torch.randn(3, *shape))
    assert out.shape == (3, 10)
    assert torch.isfinite(out).all()


def test_lenet5_layers_and_init_follow_the_seeds():
    torch.manual_seed(0)
    model = build_model("lenet5", (1, 28, 28))
    convs = [m for m in model.modules() if isinstance(m, torch.nn.Conv2d)]
    fcs = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert [(c.in_channels, c.out_channels, c.kernel_size) for c in convs] == [(1, 6, (5, 5)), (6, 16, (5, 5))]
    assert [(f.in_features, f.out_features) for f in fcs] == [(400, 120), (120, 84), (84, 10)]
    weights = torch.cat([m.weight.flatten() for m in convs + fcs])
    assert weights.abs().max() <= 0.2 + 1e-6  # truncated at two standard deviations
    assert 0.07 < weights.std().item() < 0.1  # a N(0, 0.1) cut at +-2 sigma has std 0.088
    assert all((m.bias == 0).all() for m in convs + fcs)


def test_lrn_matches_tensorflow_formula():
    # tf.nn.lrn: x / (bias + alpha * sum_{c-4..c+4} x^2) ** beta, alpha = 0.001 / 9
    x = torch.randn(2, 64, 5, 5) * 3
    squares = F.pad(x.pow(2), (0, 0, 0, 0, 4, 4))
    window = torch.stack([squares[:, c:c + 9].sum(1) for c in range(64)], 1)
    expected = x / (1.0 + (0.001 / 9) * window) ** 0.75
    torch.testing.assert_close(tf_local_response_norm()(x), expected, rtol=1e-5, atol=1e-6)


def test_cifarnet_layer_table():
    model = build_model("cifarnet", (3, 32, 32))
    convs = [m for m in model.modules() if isinstance(m, torch.nn.Conv2d)]
    fcs = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert [c.out_channels for c in convs] == [64, 64]
    assert [f.out_features for f in fcs] == [384, 192, 10]
    assert fcs[0].in_features == 64 * 8 * 8  # two stride-2 "SAME" pools: 32 -> 16 -> 8
    assert sum(isinstance(m, torch.nn.LocalResponseNorm) for m in model.modules()) == 2


def test_convnet_has_relu_on_fully_connected_layers_and_dropout():
    model = build_model("convnet", (1, 28, 28))
    names = [type(m).__name__ for m in model.classifier]
    assert names == ["Linear", "ReLU", "Dropout", "Linear", "ReLU", "Dropout", "Linear"]
    assert model.classifier[2].p == 0.25
    assert [m.out_features for m in model.classifier if isinstance(m, torch.nn.Linear)] == [2048, 1024, 10]


def test_mlp_structure():
    model = MLP((1, 28, 28), layers=3, neurons=64, activation="tanh")
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert [(m.in_features, m.out_features) for m in linears] == [(784, 64), (64, 64), (64, 64), (64, 10)]
    assert sum(isinstance(m, torch.nn.Dropout) and m.p == 0.2 for m in model.modules()) == 3
    assert sum(isinstance(m, torch.nn.Tanh) for m in model.modules()) == 3


@pytest.mark.parametrize("name, options, fragment", [
    ("resnet", {}, "unknown model 'resnet'"),
    ("lenet5", {"neurons": 3}, "model lenet5 has no option neurons"),
    ("mlp", {"activation": "swish"}, "unknown activation 'swish'"),
    ("mlp", {"layers": 0}, "layers must be a positive integer"),
    ("cnn", {"kernel_size": 4}, "odd positive integer"),
    ("cnn", {"blocks": 6}, "below one pixel"),
])
def test_bad_model_settings_are_user_errors(name, options, fragment):
    with pytest.raises(UserError, match=fragment):
        build_model(name, (1, 28, 28), **options)


def test_model_file_round_trip(tmp_path):
    torch.manual_seed(1)
    model = build_model("mlp", (1, 28, 28), layers=1, neurons=16).eval()
    path = tmp_path / "model.pt"
    torch.save(model_record(model, "mlp", (1, 28, 28), 10, {"layers": 1, "neurons": 16}), path)
    loaded, record = load_model(path)
    x = torch.randn(4, 1, 28, 28)
    torch.testing.assert_close(loaded.eval()(x), model(x))
    assert record["name"] == "mlp" and math.prod(record["input_shape"]) == 784


def test_model_file_refuses_foreign_and_code_carrying_files(tmp_path):
    evil = tmp_path / "evil.pt"
    marker = tmp_path / "pwned"

    class Payload:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    torch.save({"x": Payload()}, evil)
    with pytest.raises(UserError, match="not a readable towerlab model"):
        load_model(evil)
    assert not marker.exists()
    other = tmp_path / "other.pt"
    torch.save({"weights": torch.zeros(2)}, other)
    with pytest.raises(UserError, match="not a towerlab model"):
        load_model(other)
    with pytest.raises(UserError, match="no model file"):
        load_model(tmp_path / "missing.pt")
