"""The network a run trains: checked before anything is written (`check_setup`, once per run), built
identically on every rank (`build`), and fit to its data where its first layer is computed from it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from towerlab.catalog import models as model_catalog
from towerlab.config import TrainConfig
from towerlab.distributed.env import machine_memory
from towerlab.distributed.group import Context, world_group
from towerlab.errors import UserError
from towerlab.models import build_model
from towerlab.models.custom import NetworkSource, instantiate
from towerlab.models.preprocessing import Normalizer
from towerlab.training.batches import steps_per_epoch

if TYPE_CHECKING:
    from towerlab.data.load import Dataset


def build(cfg: TrainConfig, input_shape: tuple[int, int, int], num_classes: int, ctx: Context,
          source: NetworkSource | None = None) -> nn.Module:
    """The model, identically initialised on every rank (seeded before it is built); its BatchNorm
    layers that can take their statistics over all replicas do. `source` is a module of your own or
    its factory (`cfg.model` "custom")."""
    torch.manual_seed(cfg.seed)
    module = build_model(cfg.model, input_shape, num_classes, **cfg.model_options) if source is None \
        else instantiate(source)
    module = module.to(ctx.device)
    if uses_channels_last(cfg):
        module = module.to(memory_format=torch.channels_last)  # type: ignore[call-overload]  # torch's stubs lack it
    model_catalog.hooks(cfg.model).share_batch_statistics(module, world_group(ctx))
    return module


def fit_to_data(cfg: TrainConfig, module: nn.Module, x_train: torch.Tensor, normalize: Normalizer) -> None:
    """A model whose first layer is computed from the training images (whitenet's patch whitening)
    gets them here, before the first step: the same leading images, so every rank computes the same
    layer."""
    hooks = model_catalog.hooks(cfg.model)
    if hooks.fit is not None:
        hooks.fit(module, normalize(x_train[:hooks.fit_images].to(normalize.scale.device)))


def uses_channels_last(cfg: TrainConfig) -> bool:
    return model_catalog.uses_channels_last(cfg.model)


def check_setup(cfg: TrainConfig, world_size: int, data: Dataset, source: NetworkSource | None = None) -> nn.Module:
    """Every mistake that would otherwise surface mid-run, found before anything is written: the
    model and its options (built on the meta device, so nothing is allocated; a model whose weights,
    gradients and optimizer state cannot fit in this machine's memory is refused), a module of your
    own (`source`: it must take a batch of the data's images and return one logit per class), and
    the batch size. Returns the network as checked (on the meta device, for a named model)."""
    if source is None:
        options = " ".join(f"{k}={v}" for k, v in cfg.model_options.items()) or "default options"
        try:
            with torch.device("meta"):
                module = build_model(cfg.model, data.input_shape, data.num_classes, **cfg.model_options)
        except RuntimeError as exc:  # sizes torch cannot even describe ("Storage size calculation overflowed")
            raise UserError(f"model {cfg.model} ({options}) cannot be built: {str(exc).splitlines()[0]}: use "
                            "smaller model options") from None
        need = 16 * sum(p.numel() for p in module.parameters())  # fp32 weights, gradients, 2 optimizer moments
        if need > machine_memory():
            raise UserError(f"model {cfg.model} ({options}) needs {need / 2**30:,.0f} GiB for its weights, gradients "
                            f"and optimizer state, more than this machine's {machine_memory() / 2**30:.0f} GiB: use "
                            "smaller model options")
    else:
        module = instantiate(source)
        check_module(module, data.input_shape, data.num_classes)
    check_optimizer(cfg, module)
    if cfg.translate >= min(data.input_shape[1:]):
        raise UserError(f"--translate {cfg.translate} shifts images by their whole size "
                        f"{data.input_shape[1]}x{data.input_shape[2]}: use fewer pixels")
    if steps_per_epoch(data.n_train, world_size, cfg.batch_size) == 0:
        raise UserError(f"--batch-size {cfg.batch_size} x {world_size} replica(s) is more than the "
                        f"{data.n_train} training examples: lower --batch-size or --devices")
    return module


def check_optimizer(cfg: TrainConfig, module: nn.Module) -> None:
    """What --optimizer muon and --whiten-bias-epochs need of the network: filters to step, a whitening bias."""
    if cfg.optimizer == "muon" and not any(p.dim() == 4 and p.requires_grad for p in module.parameters()):
        raise UserError(f"--optimizer muon steps convolution filters (4-D weights) with Muon and the rest with SGD: "
                        f"{cfg.model} has none to train, so use --optimizer sgd")
    if cfg.whiten_bias_epochs and model_catalog.hooks(cfg.model).whitening_bias is None:
        raise UserError(f"--whiten-bias-epochs trains the bias of a data-fitted whitening layer (whitenet's): "
                        f"{cfg.model} has none, so leave it at 0")


def check_module(module: nn.Module, input_shape: tuple[int, int, int], num_classes: int) -> None:
    """A module of your own, tried on two zero images where its parameters are."""
    device = next(module.parameters(), torch.zeros(0)).device
    try:
        with torch.no_grad():
            out = module.eval()(torch.zeros(2, *input_shape, device=device))
    except SystemExit as exc:  # sys.exit() in its forward: a failure of that code, not an end of towerlab
        raise UserError(f"your module fails on a batch of images of shape {tuple(input_shape)} (C, H, W): its "
                        f"forward called sys.exit({'' if exc.code is None else repr(exc.code)})") from None
    except Exception as exc:  # noqa: BLE001 - whatever the module raises, it cannot train on this data
        raise UserError(f"your module fails on a batch of images of shape {tuple(input_shape)} (C, H, W): "
                        f"{type(exc).__name__}: {' '.join(str(exc).split())[:200]}") from None
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != (2, num_classes):
        shape = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        raise UserError(f"your module returns {shape} for 2 images; it must return logits of shape "
                        f"(N, {num_classes}), one per class of the data")
    if not out.is_floating_point():  # the cross-entropy loss and its gradient need real numbers
        raise UserError(f"your module returns {str(out.dtype).removeprefix('torch.')} logits; they must be "
                        "floating point (the cross-entropy loss is computed on them)")
    if not any(p.requires_grad for p in module.parameters()):
        raise UserError("your module has no trainable parameters (none, or all with requires_grad=False): "
                        "training would change nothing")
