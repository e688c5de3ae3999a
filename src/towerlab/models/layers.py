"""Building blocks the families share: TensorFlow's truncated-normal initialiser and the size a
feature extractor flattens an input to."""

from __future__ import annotations

import torch
from torch import nn


def trunc_normal_(tensor: torch.Tensor, std: float) -> None:
    # TensorFlow's truncated_normal: redraw beyond two standard deviations.
    nn.init.trunc_normal_(tensor, mean=0.0, std=std, a=-2 * std, b=2 * std)


def flat_size(features: nn.Module, input_shape: tuple[int, int, int]) -> int:
    with torch.no_grad():
        return features(torch.zeros(1, *input_shape)).numel()
