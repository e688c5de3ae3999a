"""`mlp`: the search's original network, a stack of fully connected layers."""

from __future__ import annotations

import math
from typing import Callable

import torch
from torch import nn

from towerlab.errors import UserError, did_you_mean
from towerlab.catalog.model_options import MAX_LAYERS, require_fraction, require_positive_int

ACTIVATIONS: dict[str, Callable[[], nn.Module]] = {
    "relu": nn.ReLU, "elu": nn.ELU, "tanh": nn.Tanh, "sigmoid": nn.Sigmoid,
}


class MLP(nn.Module):
    """`layers` hidden layers of `neurons` units, each followed by dropout 0.2 (the search's network)."""

    def __init__(self, input_shape: tuple[int, int, int], num_classes: int = 10, *, layers: int = 2,
                 neurons: int = 512, activation: str = "relu", dropout: float = 0.2):
        super().__init__()
        if activation not in ACTIVATIONS:
            raise UserError(f"unknown activation {activation!r}{did_you_mean(activation, ACTIVATIONS)}: choose one "
                            f"of {', '.join(ACTIVATIONS)}")
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
