"""`whitenet`: a ConvNet for 3x32x32 images of the airbench94 class, and its two special layers.

The design and its constants are K. Jordan's, "94% on CIFAR-10 in 3.29 Seconds on a Single GPU"
(arXiv 2404.00498, 2024), cited below as [airbench]:

- no residual connections: a 2x2 patch-whitening convolution, GELU, then three stages of
  conv 3x3 -> max-pool 2 -> BatchNorm -> GELU followed by (depth - 1) x [conv 3x3 -> BatchNorm ->
  GELU]; widths 64, 256, 256 and depth 2 in [airbench];
- the first layer is not learned: its filters whiten 2x2 patches of the training images (the
  eigenvectors of their covariance, scaled by 1 / sqrt(eigenvalue + 5e-4)), and their negatives,
  so a following GELU keeps both signs; only its bias learns;
- convolutions start as identities on their first in_channels filters (Dirac init), the rest
  PyTorch's default;
- BatchNorm learns only its shift (scale fixed at 1), with momentum 0.6 in [airbench]'s convention
  (PyTorch's 0.4) and eps 1e-12;
- a global max-pool, a linear head without bias, logits scaled by 1/9.

The whitening needs data, so it is not part of `__init__`: its catalog entry's hooks (`HOOKS`) have
`train` call `fit_whitening` with the same training images on every rank before the first step (a
checkpoint or model file carries the result as the buffer `whiten_weight`).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from towerlab.errors import UserError
from towerlab.catalog.models import Hooks
from towerlab.catalog.model_options import MAX_LAYERS, require_positive_int

WHITEN_KERNEL = 2
WHITEN_EPS = 5e-4     # added to the patch covariance's eigenvalues [airbench]
WHITEN_IMAGES = 5000  # training images `train` estimates the covariance from [airbench]
LOGIT_SCALE = 1 / 9   # [airbench]'s output scaling


class _SumOverRanks(torch.autograd.Function):
    """All-reduce (sum) whose gradient is the all-reduced gradient: d(sum_r x_r)/dx_r = 1 on every rank."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
        ctx.group = group
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class GlobalBatchNorm(nn.BatchNorm2d):
    """BatchNorm whose training statistics cover the global batch.

    With `group` set (a process group; `share_batch_statistics` does it), the per-channel sums are
    all-reduced over the replicas in the forward pass, and autograd all-reduces their gradients in
    the backward, so R replicas x batch B normalise exactly as one replica x R*B, and the running
    statistics stay equal on every rank. Alone it is `nn.BatchNorm2d`. The scale is fixed at 1;
    only the shift learns.
    """

    # Always kept here (track_running_stats), with a momentum: not the Optionals of nn.BatchNorm2d.
    running_mean: torch.Tensor
    running_var: torch.Tensor
    num_batches_tracked: torch.Tensor
    momentum: float

    def __init__(self, channels: int, momentum: float = 0.4, eps: float = 1e-12):
        super().__init__(channels, eps=eps, momentum=momentum)
        self.weight.requires_grad_(False)
        self.group: dist.ProcessGroup | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.group is None:
            return super().forward(x)
        xf = x.float()
        count = torch.full((1,), float(x.numel() // x.shape[1]), device=x.device)
        sums = torch.cat([xf.sum((0, 2, 3)), (xf * xf).sum((0, 2, 3)), count])
        sums = _SumOverRanks.apply(sums, self.group)
        channels = x.shape[1]
        n = sums[-1]
        mean = sums[:channels] / n
        var = (sums[channels:2 * channels] / n - mean * mean).clamp_min(0)
        with torch.no_grad():
            self.num_batches_tracked.add_(1)
            self.running_mean.lerp_(mean.detach(), self.momentum)
            self.running_var.lerp_(var.detach() * (n / (n - 1)), self.momentum)
        shape = (1, channels, 1, 1)
        y = (xf - mean.view(shape)) * torch.rsqrt(var.view(shape) + self.eps) * self.weight.view(shape)
        return (y + self.bias.view(shape)).to(x.dtype)


def share_batch_statistics(module: nn.Module, group: dist.ProcessGroup | None) -> None:
    """Make every GlobalBatchNorm of `module` reduce its statistics over `group` (None: this replica)."""
    for m in module.modules():
        if isinstance(m, GlobalBatchNorm):
            m.group = group


def _identity_init(conv: nn.Conv2d) -> nn.Conv2d:
    """Dirac init of the first in_channels filters [airbench]: the layer starts by passing its input on."""
    with torch.no_grad():
        nn.init.dirac_(conv.weight[:conv.in_channels])
    return conv


def _conv3x3(channels_in: int, channels_out: int) -> nn.Conv2d:
    return _identity_init(nn.Conv2d(channels_in, channels_out, 3, padding=1, bias=False))


def patch_whitening(images: torch.Tensor, kernel: int, eps: float) -> torch.Tensor:
    """(C*k*k, C, k, k) filters whose outputs on `images` (N, C, H, W, float) have identity
    covariance, up to `eps` added to the eigenvalues: the covariance of all k x k patches (summed in
    float64, on the images' device), eigendecomposed, its eigenvectors divided by sqrt(eigenvalue + eps)."""
    c = images.shape[1]
    dims = c * kernel * kernel
    total = torch.zeros(dims, dtype=torch.float64, device=images.device)
    gram = torch.zeros(dims, dims, dtype=torch.float64, device=images.device)
    count = 0
    for chunk in images.split(500):
        patches = F.unfold(chunk.double(), kernel).transpose(1, 2).reshape(-1, dims)
        total += patches.sum(0)
        gram += patches.T @ patches
        count += patches.shape[0]
    mean = total / count
    # A 12x12 eigenproblem: on the CPU, where it needs no solver start-up on a GPU.
    covariance = (gram / count - torch.outer(mean, mean)).cpu()
    eigenvalues, eigenvectors = torch.linalg.eigh(covariance)
    filters = eigenvectors.T / torch.sqrt(eigenvalues.clamp_min(0) + eps)[:, None]
    return filters.reshape(dims, c, kernel, kernel).float().to(images.device)


class WhitenedConvNet(nn.Module):
    """See the module docstring. Options: `width1`, `width2`, `width3` (channels of the three stages)
    and `depth` (convolutions per stage)."""

    def __init__(self, input_shape: tuple[int, int, int], num_classes: int = 10, *, width1: int = 64,
                 width2: int = 256, width3: int = 256, depth: int = 2):
        super().__init__()
        self.whiten_weight: torch.Tensor  # a buffer: set from the training images (fit_whitening)
        for name, value in (("width1", width1), ("width2", width2), ("width3", width3)):
            require_positive_int(name, value)
        require_positive_int("depth", depth, MAX_LAYERS)
        channels, height, width = input_shape
        if (min(height, width) - WHITEN_KERNEL + 1) >> 3 < 1:
            raise UserError(f"whitenet pools its input three times: a {height}x{width} image is too small "
                            "(at least 9x9)")
        whitened = channels * WHITEN_KERNEL ** 2
        self.register_buffer("whiten_weight", torch.zeros(2 * whitened, channels, WHITEN_KERNEL, WHITEN_KERNEL))
        self.whiten_bias = nn.Parameter(torch.zeros(2 * whitened))
        layers: list[nn.Module] = [nn.GELU()]
        width_in = 2 * whitened
        for width_out in (width1, width2, width3):
            layers += [_conv3x3(width_in, width_out), nn.MaxPool2d(2), GlobalBatchNorm(width_out), nn.GELU()]
            for _ in range(depth - 1):
                layers += [_conv3x3(width_out, width_out), GlobalBatchNorm(width_out), nn.GELU()]
            width_in = width_out
        self.stages = nn.Sequential(*layers)
        self.head = nn.Linear(width3, num_classes, bias=False)

    @torch.no_grad()
    def fit_whitening(self, images: torch.Tensor) -> None:
        """Set the first layer from normalised training images (N, C, H, W): the filters that whiten
        their 2x2 patches, and their negatives."""
        filters = patch_whitening(images, WHITEN_KERNEL, WHITEN_EPS)
        self.whiten_weight.copy_(torch.cat([filters, -filters]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.conv2d(x, self.whiten_weight, self.whiten_bias)
        x = self.stages(x).amax(dim=(2, 3))
        return self.head(x) * LOGIT_SCALE


def whitening_bias(network: WhitenedConvNet) -> nn.Parameter:
    """The whitening layer's bias: [airbench] trains it for the first 3 epochs only."""
    return network.whiten_bias


HOOKS = Hooks(fit_images=WHITEN_IMAGES, fit=WhitenedConvNet.fit_whitening,
              share_batch_statistics=share_batch_statistics, whitening_bias=whitening_bias)
