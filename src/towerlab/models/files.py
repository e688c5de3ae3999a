"""`model.pt`: what it records (`model_record`), writing it (`save_model`) and `load_model`, which
rebuilds the network from it."""

from __future__ import annotations

import io
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import torch
from torch import nn

from towerlab import atomic
from towerlab.config import CUSTOM_MODEL, PRECISIONS, TTA, TrainConfig
from towerlab.fields import to_dict
from towerlab.distributed.env import machine_memory
from towerlab.errors import UserError
from towerlab.catalog.models import uses_channels_last
from towerlab.models import build_model
from towerlab.models.classifier import Classifier
from towerlab.models.custom import NetworkSource, for_shape, function_file, instantiate
from towerlab.atomic import require_regular_file

if TYPE_CHECKING:
    from towerlab.data.load import Dataset


def model_record(model: nn.Module, name: str, input_shape: tuple[int, ...], num_classes: int,
                 options: dict, **extra: Any) -> dict:
    """What `model.pt` holds: enough to rebuild the network with `load_model`, plus the run's config."""
    return {"format": "towerlab-model", "version": 1, "name": name, "input_shape": list(input_shape),
            "num_classes": num_classes, "options": dict(options),
            "state_dict": {k: v.detach().cpu() for k, v in model.state_dict().items()}, **extra}


def save_model(path: Path, model: nn.Module, cfg: TrainConfig, data: Dataset, *,
               function: Callable[..., nn.Module] | None = None) -> None:
    """model.pt: the network and what rebuilds it and feeds it (input shape, classes and their names
    where the data has them, the training split's mean and std), with the TrainConfig that trained
    it; written atomically. A network of
    your own records its class, and the model function that built it (FILE.py:FUNCTION), where a
    file defines it: evaluate and predict name it when they need it again."""
    buffer = io.BytesIO()
    custom = cfg.model == CUSTOM_MODEL
    extra: dict[str, Any] = {"module_class": f"{type(model).__module__}.{type(model).__qualname__}"} if custom else {}
    spec = function_file(function) if custom else None
    if spec:
        extra["model_function"] = spec
    if data.class_names:
        extra["class_names"] = list(data.class_names)
    torch.save(model_record(model, cfg.model, data.input_shape, data.num_classes, cfg.model_options,
                            config=to_dict(cfg), mean=list(data.mean), std=list(data.std), **extra), buffer)
    atomic.write_bytes(path, buffer.getvalue())




class ModuleNeeded(UserError):
    """A model file holds a network of your own, and no module was given to rebuild it in. The
    command line says how to give one there (--module). `function`: the model function that built
    it (FILE.py:FUNCTION), where the file records one."""

    def __init__(self, path: str | Path, module_class: str, function: str | None = None):
        self.path, self.module_class, self.function = path, module_class, function
        if function:
            name = function.rpartition(":")[2]
            super().__init__(f"{path} holds a network built by a model function of yours ({function}): rebuild it "
                             f"with load_model(path, module={name})")
        else:
            super().__init__(f"{path} holds a module of your own ({module_class}): rebuild it with "
                             "load_model(path, module=YourModule())")


def load_model(path: str | Path, map_location: str | torch.device = "cpu", *,
               module: NetworkSource | None = None) -> tuple[Classifier, dict]:
    """Rebuild a saved network (`path`: a model.pt, or the run folder holding one): returns
    (a `towerlab.models.classifier.Classifier`, the file's record).

    The Classifier takes raw uint8 images (normalised inside, as in training) or normalised float
    input; its `.network` is the bare network. A model of your own (trained with
    `towerlab.api.train(model=...)`) is rebuilt in `module` (an instance or a factory), which must be
    given; a model function (`towerlab train --model FILE.py:FUNCTION`) is called with the input
    shape, classes and options the file records. Never executes code from the file (weights_only
    loading)."""
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
    _check_tensors(path, state)
    if name == CUSTOM_MODEL:
        if module is None:
            function = record.get("model_function")
            raise ModuleNeeded(path, str(record.get("module_class", "a custom class")),
                               function if isinstance(function, str) and ":" in function else None)
        source = for_shape(module, shape, classes, options)
        _check_skeleton(path, _meta_network(source), state, "the module you gave")
        network = instantiate(source)
        _load_state(network, state, path)
    else:
        network = _rebuild(path, name, tuple(shape), classes, options, state)
    mean, std = record.get("mean"), record.get("std")
    stats_ok = all(isinstance(v, (list, tuple)) and len(v) == shape[0]
                   and all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in v) for v in (mean, std))
    stored = record.get("config")
    config: dict = stored if isinstance(stored, dict) else {}
    precision = str(config.get("precision")) if config.get("precision") in PRECISIONS else "fp32"
    tta = str(config.get("tta")) if config.get("tta") in TTA else "none"
    names = record.get("class_names")
    named = tuple(names) if isinstance(names, list) and len(names) == classes and all(isinstance(n, str) for n in names) \
        else None
    return Classifier(network, tuple(shape), classes, mean if stats_ok else None, std if stats_ok else None,
                      precision=precision, tta=tta, channels_last=uses_channels_last(name), class_names=named), record


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
    _check_skeleton(path, skeleton, state, f"model {name} with options {options} and input {shape}")
    model = build_model(name, shape, classes, **options)
    model.load_state_dict(state)
    return model


def _check_tensors(path: str | Path, state: dict) -> None:
    """Every tensor of the file dense, as a trained network's are: a sparse one cannot be loaded into
    a network, and an expanded view (stride 0) claims more elements than the file holds (3 KB that
    claimed 63 GB of weights), which the shape checks below would take at their word."""
    for key, tensor in state.items():
        if tensor.layout != torch.strided:
            raise UserError(f"{path} holds a {str(tensor.layout).removeprefix('torch.')} tensor ({key}); a "
                            "network's weights are dense: re-export it with towerlab train")
        if tensor.numel() * tensor.element_size() > tensor.untyped_storage().nbytes():
            raise UserError(f"{path}: tensor {key} claims {tensor.numel():,} elements over "
                            f"{tensor.untyped_storage().nbytes():,} bytes (an expanded view, not weights): "
                            "re-export it with towerlab train")


def _meta_network(source: NetworkSource) -> nn.Module | None:
    """Your network built on the meta device (nothing allocated), to check against the file before it
    is built for real; None where your code cannot be built there (then only the real one is)."""
    try:
        with torch.device("meta"):
            network = instantiate(source)
    except (Exception, SystemExit):  # noqa: BLE001 - the real build says what is wrong, if anything
        return None
    return network if all(t.is_meta for t in network.state_dict().values()) else None


def _check_skeleton(path: str | Path, skeleton: nn.Module | None, state: dict, what: str) -> None:
    """The network the file describes (`skeleton`, on the meta device) has the file's tensors, and this
    machine can hold it: bounded before it is built, as a training bounds its model (check_setup)."""
    if skeleton is None:
        return
    expected = {k: tuple(v.shape) for k, v in skeleton.state_dict().items()}
    if expected != {k: tuple(v.shape) for k, v in state.items()}:
        raise UserError(f"{path} does not match {what}: their tensors differ (names or shapes)")
    need = sum(t.numel() * t.element_size() for t in skeleton.state_dict().values())
    if need > machine_memory():
        raise UserError(f"{path} describes a network of {need / 2**30:,.0f} GiB, more than this machine's "
                        f"{machine_memory() / 2**30:.0f} GiB of memory")


def _load_state(network: nn.Module, state: dict, path: str | Path) -> None:
    expected = {k: tuple(v.shape) for k, v in network.state_dict().items()}
    if expected != {k: tuple(v.shape) for k, v in state.items()}:
        raise UserError(f"{path} does not match the module you gave: their tensors differ (names or shapes)")
    network.load_state_dict(state)
