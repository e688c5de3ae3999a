"""`cnn`: a searchable ConvNet of conv-BN-ReLU-maxpool blocks."""

from __future__ import annotations

import torch
from torch import nn

from towerlab.errors import UserError
from towerlab.models.layers import flat_size
from towerlab.catalog.model_options import require_fraction, require_positive_int


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
        if isinstance(kernel_size, bool) or not isinstance(kernel_size, int) or kernel_size < 1 or kernel_size % 2 == 0:
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
            nn.Linear(flat_size(self.features, input_shape), dense), nn.ReLU(), nn.Dropout(dropout),
            nn.Linear(dense, num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))
