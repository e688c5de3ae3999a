"""The seeds' networks: LeNet-5, the TensorFlow CIFAR-10 tutorial's CifarNet (with its local response
normalisation) and the 64-256-512 ConvNet. No options besides the ConvNet's dropout.

Every model takes (N, C, H, W) float input, normalised, and returns (N, num_classes) logits. They
are built for 1x28x28 (MNIST, Fashion-MNIST) and 3x32x32 (CIFAR-10) but accept any image size the
layers can reduce.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from towerlab.models.layers import flat_size, trunc_normal_
from towerlab.catalog.model_options import require_fraction


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
            nn.Linear(flat_size(self.features, padded), 120), nn.ReLU(),
            nn.Linear(120, 84), nn.ReLU(),
            nn.Linear(84, num_classes),
        )
        for module in self.modules():
            if isinstance(module, (nn.Conv2d, nn.Linear)):
                trunc_normal_(module.weight, 0.1)
                nn.init.zeros_(module.bias)  # type: ignore[arg-type]  # built with a bias

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
    def forward(ctx: Any, x: torch.Tensor, size: int, alpha: float, beta: float, k: float) -> torch.Tensor:
        band = _channel_band(x.shape[1], size // 2, x)
        d = F.conv2d(x * x, band).to(x.dtype).mul_(alpha / size).add_(k)
        p = _inverse_power(d, beta)
        ctx.save_for_backward(x, d, p)
        ctx.radius, ctx.scale = size // 2, -beta * alpha / size
        return x * p

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None, None]:
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
            nn.Linear(flat_size(self.features, input_shape), 384), nn.ReLU(),  # local3
            nn.Linear(384, 192), nn.ReLU(),                                     # local4
            nn.Linear(192, num_classes),                                        # softmax_linear
        )
        conv1, conv2 = self.features[0], self.features[4]
        local3, local4, logits = self.classifier[0], self.classifier[2], self.classifier[4]
        for layer, std, bias in ((conv1, 5e-2, 0.0), (conv2, 5e-2, 0.1), (local3, 0.04, 0.1),
                                 (local4, 0.04, 0.1), (logits, 1 / 192.0, 0.0)):
            trunc_normal_(layer.weight, std)  # type: ignore[arg-type]  # a Conv2d or Linear, as indexed above
            nn.init.constant_(layer.bias, bias)  # type: ignore[arg-type]  # the same layer's bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))


class ConvNet(nn.Module):
    """The seeds' 64-256-512 ConvNet. The original had no activation on its fully connected
    layers, which makes fc2048 -> fc1024 -> fc10 one linear map; we add ReLU there."""

    def __init__(self, input_shape: tuple[int, int, int], num_classes: int = 10, dropout: float = 0.25):
        super().__init__()
        require_fraction("dropout", dropout)  # nn.Dropout refuses 2 with a traceback, and takes nan
        self.features = nn.Sequential(
            nn.Conv2d(input_shape[0], 64, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(64, 256, 3, padding=1), nn.ReLU(),
            nn.Conv2d(256, 512, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Flatten(),
        )
        self.classifier = nn.Sequential(
            nn.Linear(flat_size(self.features, input_shape), 2048), nn.ReLU(), nn.Dropout(dropout),
            nn.Linear(2048, 1024), nn.ReLU(), nn.Dropout(dropout),
            nn.Linear(1024, num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))
