"""A trained network together with what it needs to be fed raw images: `load_model` returns one.

`model.pt` records the network, its input shape and class count, the training split's per-channel
mean and std, and the training config (its precision and test-time augmentation among it). A
`Classifier` applies them, so raw uint8 images give the predictions the run was scored with.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import nn

from towerlab.models.preprocessing import Normalizer, tta_logits
from towerlab.errors import UserError
from towerlab.data.readers import images_as_nchw

PREDICT_BATCH = 1024  # the training loop's evaluation batch: the same batches give the same numbers


class Classifier(nn.Module):
    """A trained network and its preprocessing.

    - `model(images)`: uint8 images (N, C, H, W), pixel values 0-255 as the datasets hold them, are
      normalised with the training split's mean and std, as in training; a float tensor is taken as
      input normalised already. Returns the logits (N, classes) the run evaluated with: in its
      precision, averaged over its test-time views (--tta).
    - `model.predict(images)` / `model.predict_proba(images)`: numpy (or CPU tensor) uint8 images in
      the Keras layout (N, H, W) or (N, H, W, C), or (N, C, H, W); class indices / probabilities out.
    - `model.network`: the bare network, which takes normalised float input; its attributes are
      also the Classifier's (`model.features`).
    - `model.class_names`: each class's name (an image folder's class folders), else its index.

    It comes in eval mode, so calling it leaves BatchNorm statistics and dropout alone;
    `model.train()` before fine-tuning it.
    """

    def __init__(self, network: nn.Module, input_shape: tuple[int, int, int], num_classes: int,
                 mean: tuple[float, ...] | None, std: tuple[float, ...] | None, *, precision: str = "fp32",
                 tta: str = "none", channels_last: bool = False, class_names: tuple[str, ...] | None = None):
        super().__init__()
        self.network = network
        channels, height, width = input_shape  # a list, as model.pt may hold it, or a tuple
        self.input_shape = (channels, height, width)
        self.num_classes = num_classes
        self.class_names = tuple(class_names) if class_names else tuple(str(k) for k in range(num_classes))
        self.mean = None if mean is None else tuple(float(m) for m in mean)
        self.std = None if std is None else tuple(float(s) for s in std)
        self.precision = precision
        self.tta = tta
        self.channels_last = channels_last
        if channels_last:
            network.to(memory_format=torch.channels_last)  # type: ignore[call-overload]  # torch's stubs lack it; as in training: the same kernels, the same numbers
        self.eval()

    def __getattr__(self, name: str) -> Any:
        """The network's own attributes (`model.features`, ...), as before load_model wrapped it."""
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(super().__getattr__("network"), name)

    @property
    def device(self) -> torch.device:
        return next(iter(self.network.parameters()), torch.zeros(0)).device

    def normalize(self, images: torch.Tensor) -> torch.Tensor:
        """uint8 (N, C, H, W) -> the network's float input, exactly as the training loop computes it."""
        if self.mean is None or self.std is None:
            raise UserError("this model file records no normalisation (mean and std): feed the network "
                            "normalised float input (model.network), or re-export it with towerlab train")
        if tuple(images.shape[1:]) != self.input_shape:
            raise UserError(f"images of shape {tuple(images.shape[1:])}, but the model takes {self.input_shape} "
                            "(C, H, W): predict() also accepts the Keras layout (N, H, W[, C])")
        return Normalizer(self.mean, self.std, images.device, self.channels_last)(images)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.uint8:
            x = self.normalize(x)
        autocast = torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=self.precision == "bf16")
        with autocast:
            return tta_logits(self.network, x, self.tta).float()

    def as_images(self, images: Any) -> torch.Tensor:
        """uint8 images in any layout `predict` accepts, as a CPU tensor (N, C, H, W)."""
        array = images.detach().cpu().numpy() if isinstance(images, torch.Tensor) else np.asarray(images)
        return torch.from_numpy(images_as_nchw(array, "images", self.input_shape))

    @torch.no_grad()
    def logits(self, images: Any, batch_size: int = PREDICT_BATCH) -> torch.Tensor:
        """Logits (N, classes) of uint8 images in any layout `predict` accepts, on the CPU."""
        x = self.as_images(images)
        was_training = self.training
        self.eval()
        try:
            return torch.cat([self(x[start:start + batch_size].to(self.device)).cpu()
                              for start in range(0, len(x), batch_size)])
        finally:
            self.train(was_training)

    def predict_proba(self, images: Any, batch_size: int = PREDICT_BATCH) -> np.ndarray:
        """Class probabilities (N, classes), float32."""
        return self.logits(images, batch_size).softmax(1).numpy()

    def predict(self, images: Any, batch_size: int = PREDICT_BATCH) -> np.ndarray:
        """The predicted class of each image (N,), int64."""
        return self.logits(images, batch_size).argmax(1).numpy()
