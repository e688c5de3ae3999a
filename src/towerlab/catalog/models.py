"""The model catalog: one entry per model (`ModelEntry`), and what can be read of a builder without
building anything.

An entry names its builder, a function `builder(input_shape, num_classes, **options) -> nn.Module`
(a network class is one), as "module:name" (a leading dot: a module of `towerlab.models`), and is
imported when first used, so this module imports no torch: the search core reads a family's
gene rules here. A model's options are its builder's keyword parameters. `towerlab.models`
builds them (`build_model`).

Adding a model: one file in `towerlab/models/` with its builder (see models/mlp.py) and one line in
`CATALOG`, whose names are the command line's --model choices (`towerlab.config.MODELS` reads them;
this package sits beside config for that, importing nothing of towerlab's but errors).
A family whose options a search varies declares their values' rules (`genes`); the search takes
the training genes and these, and only these. Without `genes`, a space of the family may vary any
option, and the builder's signature refuses what it does not take before anything trains.
A model's `hooks` are what training calls on it besides forward: a data-dependent initialisation,
batch statistics shared across replicas (see whitenet.py).
"""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional

from towerlab.errors import UserError, did_you_mean
from towerlab.catalog.model_options import FRACTION, POSITIVE_INT, GeneRule


@dataclass(frozen=True)
class Hooks:
    """What training calls on a model besides forward. `fit(network, images)`: its data-dependent
    initialisation, from the leading `fit_images` normalised training images (the same on every
    rank); `share_batch_statistics(network, group)`: make its normalisation statistics cover the
    replicas of `group` (a process group; None: this replica alone); `whitening_bias(network)`: the
    bias of its data-fitted first layer, which --whiten-bias-epochs trains for the first epochs only
    (None: it has none)."""

    fit_images: int = 0
    fit: Optional[Callable[[Any, Any], None]] = None
    share_batch_statistics: Callable[[Any, Any], None] = lambda network, group: None
    whitening_bias: Optional[Callable[[Any], Any]] = None


@dataclass(frozen=True)
class ModelEntry:
    """A catalog entry: `path` of its builder; `genes`: the rules of the options a search varies
    (None: any option its builder takes); `channels_last`: whether it trains on NHWC activations
    (see `uses_channels_last`); `hooks_at`: "module:name" of its `Hooks` (None: it has none)."""

    path: str
    genes: Optional[Mapping[str, GeneRule]] = None
    channels_last: bool = True
    hooks_at: Optional[str] = None

    @property
    def builder(self) -> Callable[..., Any]:
        return _load(self.path)

    @property
    def options(self) -> tuple[str, ...] | None:
        """Its builder's keyword options (None: it takes any)."""
        return keyword_options(self.builder)

    @property
    def hooks(self) -> Hooks:
        return _load(self.hooks_at) if self.hooks_at else NO_HOOKS


NO_HOOKS = Hooks()
CATALOG: dict[str, ModelEntry] = {
    "lenet5": ModelEntry(".seeds:LeNet5"),
    "cifarnet": ModelEntry(".seeds:CifarNet"),
    "convnet": ModelEntry(".seeds:ConvNet"),
    "mlp": ModelEntry(".mlp:MLP", channels_last=False, genes={
        "neurons": POSITIVE_INT, "layers": POSITIVE_INT,
        "activation": GeneRule("choice", choices=("relu", "elu", "tanh", "sigmoid"))}),
    "cnn": ModelEntry(".cnn:CNN", genes={
        "blocks": GeneRule("int", low=1, high=4),
        "filters": POSITIVE_INT,  # of the first block; the model doubles them per block
        "kernel_size": GeneRule("int", low=1, odd=True), "dense": POSITIVE_INT, "dropout": FRACTION}),
    "whitenet": ModelEntry(".whitenet:WhitenedConvNet", hooks_at=".whitenet:HOOKS", genes={
        "width1": POSITIVE_INT, "width2": POSITIVE_INT, "width3": POSITIVE_INT,  # channels of the three stages
        "depth": GeneRule("int", low=1, high=4)}),  # convolutions per stage
}


def _load(path: str) -> Any:
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module, package="towerlab.models"), name)


def keyword_options(function: Callable[..., Any]) -> tuple[str, ...] | None:
    """The keyword options of a model function `function(input_shape, num_classes, ...)` (a network
    class is one): its parameters after the first two. None: it takes any (**kwargs), or it has no
    signature to read (a builtin or C callable)."""
    try:
        parameters = list(inspect.signature(function).parameters.values())
    except (TypeError, ValueError):
        return None
    if any(p.kind is p.VAR_KEYWORD for p in parameters):
        return None
    return tuple(p.name for p in parameters[2:] if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY))


def not_taken(function: Callable[..., Any], names: Any) -> list[str]:
    """Those of `names` (in their order) that model function `function` takes no keyword for: with
    **kwargs (or no signature to read), only the names of its two positional parameters, the data's
    shape and classes, which a keyword of that name would give twice (`input_shape`, `num_classes`)."""
    keywords = keyword_options(function)
    if keywords is None:
        return [name for name in names if name in _positional_names(function)]
    return [name for name in names if name not in keywords]


def _positional_names(function: Callable[..., Any]) -> tuple[str, ...]:
    """The names of the first two parameters of `function` that a keyword argument would also fill
    (a positional-only one leaves its name to **kwargs)."""
    try:
        parameters = list(inspect.signature(function).parameters.values())[:2]
    except (TypeError, ValueError):
        return ()
    return tuple(p.name for p in parameters if p.kind is p.POSITIONAL_OR_KEYWORD)


def entry(name: str) -> ModelEntry:
    if name not in CATALOG:
        raise UserError(f"unknown model {name!r}{did_you_mean(name, CATALOG)}: choose one of {', '.join(CATALOG)}")
    return CATALOG[name]


def hooks(name: str) -> Hooks:
    """Model `name`'s hooks; a module of your own (model "custom") has none."""
    return CATALOG[name].hooks if name in CATALOG else NO_HOOKS


def uses_channels_last(name: str) -> bool:
    """Whether model `name` trains (and predicts) on channels-last (NHWC) activations: every
    convolutional model does, on GPUs and CPUs alike, since the cuDNN and oneDNN convolution and
    pooling kernels are fastest on it. On a 2-core Xeon, 1 thread, bf16 (bench/speed/changes.py):
    LeNet-5's step 1.27x and CifarNet's 1.92x faster; in fp32, and for the cnn model, about 1.4x.
    Not a module of your own, which may reshape its activations with `view`."""
    return name in CATALOG and CATALOG[name].channels_last
