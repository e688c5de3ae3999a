"""How a network is fed and scored: uint8 images normalised on the device (`Normalizer`), and the
logits averaged over test-time views (`tta_logits`). The training loop and a trained `Classifier`
both use these, so a model predicts with the very numbers it was scored with.
"""

from __future__ import annotations

from typing import Callable

import torch


class Normalizer:
    """uint8 images -> normalised float, as one multiply-add: (x/255 - mean)/std = x*scale + shift."""

    def __init__(self, mean: tuple[float, ...], std: tuple[float, ...], device: torch.device,
                 channels_last: bool = False):
        m = torch.tensor(mean, dtype=torch.float32, device=device).view(1, -1, 1, 1)
        s = torch.tensor(std, dtype=torch.float32, device=device).view(1, -1, 1, 1)
        self.scale = 1.0 / (255.0 * s)
        self.shift = -m / s
        self.memory_format = torch.channels_last if channels_last else torch.contiguous_format

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.addcmul(self.shift, x.float(), self.scale)
        return x.contiguous(memory_format=self.memory_format)


def tta_logits(model: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, mode: str) -> torch.Tensor:
    """The logits of `model` averaged over test-time views of the normalised batch `x`, as airbench94
    weighs them: `flip`, the image and its mirror, 1/2 each; `flip-translate`, that pair with weight
    1/2 and the pairs of the image shifted by one pixel up-left and down-right (reflected borders)
    with 1/4 each, averaged in float32. `none`: the plain logits."""
    if mode == "none":
        return model(x)

    def mirrored(view: torch.Tensor) -> torch.Tensor:
        return 0.5 * (model(view).float() + model(view.flip(-1)).float())

    logits = mirrored(x)
    if mode == "flip":
        return logits
    h, w = x.shape[-2:]
    padded = torch.nn.functional.pad(x, (1, 1, 1, 1), mode="reflect")
    shifted = mirrored(padded[..., :h, :w]) + mirrored(padded[..., 2:, 2:])
    return 0.5 * logits + 0.25 * shifted
