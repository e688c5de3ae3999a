"""The networks, and `build_model(name, input_shape, num_classes, **hp)`. No training code here.
(`whitenet`, the airbench94-class network, and its layers live in towerlab.whitenet.)

Every model takes (N, C, H, W) float input, normalised, and returns (N, num_classes) logits. They
are built for 1x28x28 (MNIST, Fashion-MNIST) and 3x32x32 (CIFAR-10) but accept any image size the
layers can reduce.
"""

from __future__ import annotations

import copy
import importlib
import math
import os
import sys
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from towerlab.config import CUSTOM_MODEL, MODELS, PRECISIONS, TTA
from towerlab.errors import UserError
from towerlab.readers import require_regular_file
from towerlab.whitenet import WhitenedConvNet

ACTIVATIONS: dict[str, Callable[[], nn.Module]] = {
    "relu": nn.ReLU, "elu": nn.ELU, "tanh": nn.Tanh, "sigmoid": nn.Sigmoid,
}


def _trunc_normal_(tensor: torch.Tensor, std: float) -> None:
    # TensorFlow's truncated_normal: redraw beyond two standard deviations.
    nn.init.trunc_normal_(tensor, mean=0.0, std=std, a=-2 * std, b=2 * std)


def _flat_size(features: nn.Module, input_shape: tuple[int, int, int]) -> int:
    with torch.no_grad():
        return features(torch.zeros(1, *input_shape)).numel()


class LeNet5(nn.Module):
    """LeCun et al. 1998, as in the seeds: 28x28 digits are zero-padded to 32x32."""

    def __init__(self, input_shape: tuple[int, int, int], num_classes: int = 10):
        super().__init__()
        channels, height, width = input_shape
        self.pad = (max(0, (32 - width) // 2), max(0, (32 - width + 1) // 2),
                    max(0, (32 - height) // 2), max(0, (32 - height + 1) // 2))
        # Pool before ReLU: the two commute (ReLU is monotonic, and max-pooling picks the same
        # element either way), so forward and gradients are the seeds', but ReLU and its backward
        # touch a quarter of the elements.
        self.features = nn.Sequential(
            nn.Conv2d(channels, 6, 5), nn.MaxPool2d(2), nn.ReLU(),
            nn.Conv2d(6, 16, 5), nn.MaxPool2d(2), nn.ReLU(), nn.Flatten(),
        )
        padded = (channels, height + self.pad[2] + self.pad[3], width + self.pad[0] + self.pad[1])
        self.classifier = nn.Sequential(
            nn.Linear(_flat_size(self.features, padded), 120), nn.ReLU(),
            nn.Linear(120, 84), nn.ReLU(),
            nn.Linear(84, num_classes),
        )
        for module in self.modules():
            if isinstance(module, (nn.Conv2d, nn.Linear)):
                _trunc_normal_(module.weight, 0.1)
                nn.init.zeros_(module.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if any(self.pad):
            x = F.pad(x, self.pad)
        return self.classifier(self.features(x))


def _channel_band(channels: int, radius: int, like: torch.Tensor) -> torch.Tensor:
    """(C, C, 1, 1) 0/1 weights: output channel o sums input channels o-radius .. o+radius."""
    index = torch.arange(channels, device=like.device)
    band = (index[:, None] - index[None, :]).abs() <= radius
    return band.to(like.dtype).view(channels, channels, 1, 1)


def _inverse_power(d: torch.Tensor, beta: float) -> torch.Tensor:
    # d ** -0.75 as two square roots: pow with a fractional exponent is exp(log()), the slowest
    # elementwise op of the step.
    if beta == 0.75:
        return torch.rsqrt(d * torch.sqrt(d))
    return d.pow(-beta)


class _LRNFunction(torch.autograd.Function):
    """y = x * d ** -beta with d = k + alpha/size * (window sum of x^2 over channels).

    Written out because autograd's version saves more and runs pow twice. With p = d ** -beta:
    dL/dx = g * p + 2x * band(g * x * (-beta * alpha/size) * p / d)  (the band is symmetric).
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, size: int, alpha: float, beta: float, k: float) -> torch.Tensor:  # noqa: ANN001
        band = _channel_band(x.shape[1], size // 2, x)
        d = F.conv2d(x * x, band).to(x.dtype).mul_(alpha / size).add_(k)
        p = _inverse_power(d, beta)
        ctx.save_for_backward(x, d, p)
        ctx.radius, ctx.scale = size // 2, -beta * alpha / size
        return x * p

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # noqa: ANN001, ANN205
        x, d, p = ctx.saved_tensors
        inner = (grad * x).mul_(p).div_(d).mul_(ctx.scale)
        window = F.conv2d(inner, _channel_band(x.shape[1], ctx.radius, inner))
        return torch.addcmul(grad * p, x, window.to(x.dtype), value=2.0), None, None, None, None


class ChannelWindowLRN(nn.LocalResponseNorm):
    """`nn.LocalResponseNorm` (same formula, windows cut at the edges), with the channel-window sum
    of squares computed as a 1x1 convolution with a 0/1 band matrix instead of torch's zero-padded
    `avg_pool3d`, and a hand-written backward. torch's version took about 70% of CifarNet's CPU
    step; this one is a small matrix product per pixel plus a few elementwise passes."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 4:
            return super().forward(x)
        return _LRNFunction.apply(x, self.size, self.alpha, self.beta, self.k)


def tf_local_response_norm() -> nn.LocalResponseNorm:
    """TensorFlow's tf.nn.lrn(depth_radius=4, bias=1, alpha=0.001/9, beta=0.75) of the CIFAR tutorial.

    TF divides by (bias + alpha * sum of squares over 2*radius+1 channels) ** beta. PyTorch divides
    its alpha by the window size, so PyTorch's alpha is TF's alpha times 9 = 0.001.
    """
    window = 2 * 4 + 1
    return ChannelWindowLRN(size=window, alpha=(0.001 / 9.0) * window, beta=0.75, k=1.0)


class CifarNet(nn.Module):
    """The TensorFlow CIFAR-10 tutorial network (the seeds' layer table), with its initialisers."""

    def __init__(self, input_shape: tuple[int, int, int], num_classes: int = 10):
        super().__init__()
        channels = input_shape[0]
        # "SAME" padding everywhere, as in the tutorial; pools are 3x3 with stride 2.
        self.features = nn.Sequential(
            nn.Conv2d(channels, 64, 5, padding=2),                             # conv1
            nn.MaxPool2d(3, stride=2, padding=1), nn.ReLU(),                   # pool1 (see LeNet5)
            tf_local_response_norm(),                                          # norm1
            nn.Conv2d(64, 64, 5, padding=2), nn.ReLU(),                        # conv2
            tf_local_response_norm(),                                          # norm2
            nn.MaxPool2d(3, stride=2, padding=1),                              # pool2
            nn.Flatten(),
        )
        self.classifier = nn.Sequential(
            nn.Linear(_flat_size(self.features, input_shape), 384), nn.ReLU(),  # local3
            nn.Linear(384, 192), nn.ReLU(),                                     # local4
            nn.Linear(192, num_classes),                                        # softmax_linear
        )
        conv1, conv2 = self.features[0], self.features[4]
        local3, local4, logits = self.classifier[0], self.classifier[2], self.classifier[4]
        for layer, std, bias in ((conv1, 5e-2, 0.0), (conv2, 5e-2, 0.1), (local3, 0.04, 0.1),
                                 (local4, 0.04, 0.1), (logits, 1 / 192.0, 0.0)):
            _trunc_normal_(layer.weight, std)
            nn.init.constant_(layer.bias, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))


class ConvNet(nn.Module):
    """The seeds' 64-256-512 ConvNet. The original had no activation on its fully connected
    layers, which makes fc2048 -> fc1024 -> fc10 one linear map; we add ReLU there."""

    def __init__(self, input_shape: tuple[int, int, int], num_classes: int = 10, dropout: float = 0.25):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(input_shape[0], 64, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(64, 256, 3, padding=1), nn.ReLU(),
            nn.Conv2d(256, 512, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Flatten(),
        )
        self.classifier = nn.Sequential(
            nn.Linear(_flat_size(self.features, input_shape), 2048), nn.ReLU(), nn.Dropout(dropout),
            nn.Linear(2048, 1024), nn.ReLU(), nn.Dropout(dropout),
            nn.Linear(1024, num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))


class MLP(nn.Module):
    """`layers` hidden layers of `neurons` units, each followed by dropout 0.2 (the search's network)."""

    def __init__(self, input_shape: tuple[int, int, int], num_classes: int = 10, *, layers: int = 2,
                 neurons: int = 512, activation: str = "relu", dropout: float = 0.2):
        super().__init__()
        if activation not in ACTIVATIONS:
            raise UserError(f"unknown activation {activation!r}: choose one of {', '.join(ACTIVATIONS)}")
        require_positive_int("layers", layers, MAX_LAYERS)
        require_positive_int("neurons", neurons)
        require_fraction("dropout", dropout)
        width = math.prod(input_shape)
        body: list[nn.Module] = [nn.Flatten()]
        for _ in range(layers):
            body += [nn.Linear(width, neurons), ACTIVATIONS[activation](), nn.Dropout(dropout)]
            width = neurons
        body.append(nn.Linear(width, num_classes))
        self.net = nn.Sequential(*body)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class CNN(nn.Module):
    """A searchable ConvNet: `blocks` of conv-BN-ReLU-maxpool (filters double per block), then a
    dense layer with dropout."""

    def __init__(self, input_shape: tuple[int, int, int], num_classes: int = 10, *, blocks: int = 2,
                 filters: int = 32, kernel_size: int = 3, dense: int = 256, dropout: float = 0.25):
        super().__init__()
        require_positive_int("blocks", blocks)
        require_positive_int("filters", filters)
        require_positive_int("dense", dense)
        require_fraction("dropout", dropout)
        if not isinstance(kernel_size, int) or kernel_size < 1 or kernel_size % 2 == 0:
            raise UserError(f"cnn kernel_size must be an odd positive integer, got {kernel_size!r}")
        if min(input_shape[1:]) >> blocks < 1:
            raise UserError(f"cnn with {blocks} blocks pools a {input_shape[1]}x{input_shape[2]} image "
                            "below one pixel: use fewer blocks")
        layers: list[nn.Module] = []
        channels = input_shape[0]
        for block in range(blocks):
            out = filters << block
            layers += [nn.Conv2d(channels, out, kernel_size, padding=kernel_size // 2, bias=False),
                       nn.BatchNorm2d(out), nn.ReLU(), nn.MaxPool2d(2)]
            channels = out
        layers.append(nn.Flatten())
        self.features = nn.Sequential(*layers)
        self.classifier = nn.Sequential(
            nn.Linear(_flat_size(self.features, input_shape), dense), nn.ReLU(), nn.Dropout(dropout),
            nn.Linear(dense, num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))


# The most layers a model option may ask for (mlp layers, whitenet depth per stage), checked before
# anything is built: far above any network that trains without residual connections, and low
# enough that building one, even on the meta device (a model.pt's skeleton, a search's cost
# estimate), takes seconds: 50,000 mlp layers took minutes and 1.65 GB there, then crashed torch.
MAX_LAYERS = 1000


def require_positive_int(name: str, value: Any, maximum: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise UserError(f"model option {name} must be a positive integer, got {value!r}")
    if maximum is not None and value > maximum:
        raise UserError(f"model option {name} must be at most {maximum}, got {value}")


def require_fraction(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 1:
        raise UserError(f"model option {name} must be a number in [0, 1), got {value!r}")


_REGISTRY: dict[str, Callable[..., nn.Module]] = {
    "lenet5": LeNet5, "cifarnet": CifarNet, "convnet": ConvNet, "mlp": MLP, "cnn": CNN,
    "whitenet": WhitenedConvNet,
}
assert tuple(_REGISTRY) == MODELS, "config.MODELS and the model registry must list the same names"

_OPTIONS = {"lenet5": (), "cifarnet": (), "convnet": ("dropout",),
            "mlp": ("layers", "neurons", "activation", "dropout"),
            "cnn": ("blocks", "filters", "kernel_size", "dense", "dropout"),
            "whitenet": ("width1", "width2", "width3", "depth")}


def build_model(name: str, input_shape: tuple[int, int, int], num_classes: int = 10, **hp: Any) -> nn.Module:
    """A freshly initialised model. Unknown names and options are user errors."""
    if name not in _REGISTRY:
        raise UserError(f"unknown model {name!r}: choose one of {', '.join(MODELS)}")
    unknown = sorted(set(hp) - set(_OPTIONS[name]))
    if unknown:
        allowed = ", ".join(_OPTIONS[name]) or "none"
        raise UserError(f"model {name} has no option {', '.join(unknown)} (its options: {allowed})")
    return _REGISTRY[name](tuple(input_shape), num_classes, **hp)


def uses_channels_last(name: str) -> bool:
    """Whether model `name` trains (and predicts) on channels-last (NHWC) activations: every
    convolutional model does, on GPUs and CPUs alike, since the cuDNN and oneDNN convolution and
    pooling kernels are fastest on it. On a 2-core Xeon, 1 thread, bf16 (bench/changes.py):
    LeNet-5's step 1.27x and CifarNet's 1.92x faster; in fp32, and for the cnn model, about 1.4x.
    Not a module of your own, which may reshape its activations with `view`."""
    return name not in ("mlp", CUSTOM_MODEL)


_LOADED: dict[str, str] = {}  # module name -> the file load_function imported it from


def load_function(spec: str, flag: str = "--model", what: str = "FUNCTION") -> Any:
    """What `FILE.py:NAME` names (a function, a network class, a network), imported from its file as a
    module of its folder, as `python FILE.py` would find its neighbours (and so that spawned workers,
    which get this process's sys.path, import it by name as well). `flag` and `what` word the errors:
    `--model FILE.py:FUNCTION` for a search's model function, `--module FILE.py:NAME` for a run's."""
    path_text, _, name = spec.rpartition(":")
    path = Path(path_text)
    if not path_text or not name.isidentifier() or (path.suffix != ".py" and not path.is_file()):
        raise UserError(f"{flag} {spec}: give FILE.py:{what}, the file that defines it and the name it has there "
                        f"(e.g. {flag} mynet.py:{'make' if what == 'FUNCTION' else 'Net'})")
    if not path.is_file():
        raise UserError(f"{flag} {spec}: no file {path_text}")
    if path.suffix != ".py":
        raise UserError(f"{flag} {spec}: {path_text} is not a Python file (FILE.py)")
    folder = str(path.resolve().parent)
    if folder in sys.path:
        sys.path.remove(folder)
    sys.path.insert(0, folder)  # first, over a folder an earlier call put there
    if _LOADED.get(path.stem, os.path.realpath(path)) != os.path.realpath(path):
        sys.modules.pop(path.stem, None)  # a file of the same name that this function loaded before
        importlib.invalidate_caches()
    try:
        module = importlib.import_module(path.stem)
    except Exception as exc:  # noqa: BLE001 - whatever the user's file raises, say so in one line
        raise UserError(f"{flag} {spec}: importing {path_text} failed: {type(exc).__name__}: "
                        f"{str(exc).splitlines()[0] if str(exc) else ''}") from None
    if os.path.realpath(getattr(module, "__file__", "") or "") != os.path.realpath(path):
        raise UserError(f"{flag} {spec}: the name {path.stem!r} is taken by another module "
                        f"({getattr(module, '__file__', 'built in')}): rename {path_text}")
    _LOADED[path.stem] = os.path.realpath(path)
    found = getattr(module, name, None)
    if not callable(found):
        raise UserError(f"{flag} {spec}: {path_text} defines no {name}")
    return found


def instantiate(source: nn.Module | Callable[[], nn.Module]) -> nn.Module:
    """A fresh network from a module of your own: a copy of an nn.Module (its current weights are the
    initial ones), or what a factory returns (called after the run's seed is set)."""
    if isinstance(source, nn.Module):
        try:
            return copy.deepcopy(source)
        except Exception as exc:  # noqa: BLE001 - whatever an attribute's copy raises, there is no copy
            raise UserError(f"your module cannot be copied ({type(exc).__name__}: {' '.join(str(exc).split())[:200]}),"
                            " and every replica starts from a copy: give a function that returns a new one "
                            "(model=YourModule, or model=lambda: YourModule(...))") from None
    if not callable(source):
        raise UserError(f"model must be a name, an nn.Module or a function returning one, got {type(source).__name__}")
    module = source()
    if not isinstance(module, nn.Module):
        raise UserError(f"your model factory returned {type(module).__name__}, not an nn.Module")
    return module


def model_record(model: nn.Module, name: str, input_shape: tuple[int, ...], num_classes: int,
                 options: dict, **extra: Any) -> dict:
    """What `model.pt` holds: enough to rebuild the network with `load_model`, plus the run's config."""
    return {"format": "towerlab-model", "version": 1, "name": name, "input_shape": list(input_shape),
            "num_classes": num_classes, "options": dict(options),
            "state_dict": {k: v.detach().cpu() for k, v in model.state_dict().items()}, **extra}


class ModuleNeeded(UserError):
    """A model file holds a network of your own, and no module was given to rebuild it in. The
    command line says how to give one there (--module)."""

    def __init__(self, path: str | Path, module_class: str):
        self.path, self.module_class = path, module_class
        super().__init__(f"{path} holds a module of your own ({module_class}): rebuild it with "
                         "load_model(path, module=YourModule())")


def load_model(path: str | Path, map_location: str | torch.device = "cpu", *,
               module: nn.Module | Callable[[], nn.Module] | None = None) -> tuple[Any, dict]:
    """Rebuild a saved network (`path`: a model.pt, or the run folder holding one): returns
    (a `towerlab.classifier.Classifier`, the file's record).

    The Classifier takes raw uint8 images (normalised inside, as in training) or normalised float
    input; its `.network` is the bare network. A model of your own (trained with
    `towerlab.api.train(model=...)`) is rebuilt in `module` (an instance or a factory), which must be
    given. Never executes code from the file (weights_only loading)."""
    from towerlab.classifier import Classifier

    if Path(path).is_dir():
        path = Path(path) / "model.pt"
    require_regular_file(path)
    try:
        record = torch.load(path, map_location=map_location, weights_only=True)
    except FileNotFoundError:
        raise UserError(f"no model file at {path}") from None
    except Exception as exc:  # noqa: BLE001 - any unpickling failure means a bad file
        raise UserError(f"{path} is not a readable towerlab model ({type(exc).__name__}): "
                        "re-export it with towerlab train") from None
    if not isinstance(record, dict) or record.get("format") != "towerlab-model":
        raise UserError(f"{path} is not a towerlab model file")
    name, shape, classes, options, state = (record.get(k) for k in
                                            ("name", "input_shape", "num_classes", "options", "state_dict"))
    if not (isinstance(name, str) and isinstance(shape, (list, tuple)) and len(shape) == 3
            and all(type(d) is int and d > 0 for d in shape) and type(classes) is int and classes > 0
            and isinstance(options, dict) and isinstance(state, dict)
            and all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in state.items())):
        raise UserError(f"{path} is an incomplete or damaged towerlab model file (name, input_shape, "
                        "num_classes, options and state_dict are required): re-export it with towerlab train")
    if name == CUSTOM_MODEL:
        if module is None:
            raise ModuleNeeded(path, str(record.get("module_class", "a custom class")))
        network = instantiate(module)
        _load_state(network, state, path)
    else:
        network = _rebuild(path, name, tuple(shape), classes, options, state)
    mean, std = record.get("mean"), record.get("std")
    stats_ok = all(isinstance(v, (list, tuple)) and len(v) == shape[0]
                   and all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in v) for v in (mean, std))
    config = record.get("config") if isinstance(record.get("config"), dict) else {}
    precision = config.get("precision") if config.get("precision") in PRECISIONS else "fp32"
    tta = config.get("tta") if config.get("tta") in TTA else "none"
    return Classifier(network, tuple(shape), classes, mean if stats_ok else None, std if stats_ok else None,
                      precision=precision, tta=tta, channels_last=uses_channels_last(name)), record


def _rebuild(path: str | Path, name: str, shape: tuple, classes: int, options: dict, state: dict) -> nn.Module:
    # Check the record against a skeleton on the meta device first, so a small file that claims a
    # huge network cannot make us allocate it.
    try:
        with torch.device("meta"):
            skeleton = build_model(name, shape, classes, **options)
    except UserError as exc:
        raise UserError(f"{path} describes an impossible {name}: {exc}") from None
    except (TypeError, ValueError, RuntimeError) as exc:
        raise UserError(f"{path} describes an impossible {name} ({type(exc).__name__}: "
                        f"{' '.join(str(exc).split())[:200]})") from None
    expected = {k: tuple(v.shape) for k, v in skeleton.state_dict().items()}
    if expected != {k: tuple(v.shape) for k, v in state.items()}:
        raise UserError(f"{path} does not match model {name}: its tensors are not those of {name} "
                        f"with options {options} and input {shape}")
    model = build_model(name, shape, classes, **options)
    model.load_state_dict(state)
    return model


def _load_state(network: nn.Module, state: dict, path: str | Path) -> None:
    expected = {k: tuple(v.shape) for k, v in network.state_dict().items()}
    if expected != {k: tuple(v.shape) for k, v in state.items()}:
        raise UserError(f"{path} does not match the module you gave: their tensors differ (names or shapes)")
    network.load_state_dict(state)
