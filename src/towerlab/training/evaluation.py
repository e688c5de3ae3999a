"""Scoring a network on a whole split during training: `loss_and_accuracy` (its loss and accuracy,
of the logits averaged over the test-time augmentation's views, each rank on its shard)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from towerlab.distributed.group import Context, sum_over_ranks
from towerlab.models.preprocessing import Normalizer, tta_logits
from towerlab.training.batches import eval_batches

EVAL_BATCH = 1024


def loss_and_accuracy(module: nn.Module, x: torch.Tensor, y: torch.Tensor, ctx: Context, normalize: Normalizer,
                      precision: str = "fp32", tta: str = "none") -> tuple[float, float]:
    """(mean loss, accuracy) over a whole split, of the logits averaged over the `tta` views; each
    rank scores its shard, the sums are reduced."""
    was_training = module.training
    module.eval()
    totals = torch.zeros(3, dtype=torch.float64, device=ctx.device)
    autocast = torch.autocast(ctx.device.type, dtype=torch.bfloat16, enabled=precision == "bf16")
    with torch.no_grad(), autocast:
        for xb, yb in eval_batches(x, y, ctx, EVAL_BATCH, normalize):
            logits = tta_logits(module, xb, tta).float()
            totals[0] += F.cross_entropy(logits, yb, reduction="sum")
            totals[1] += (logits.argmax(1) == yb).sum()
            totals[2] += yb.numel()
    module.train(was_training)
    loss_sum, correct, count = sum_over_ranks(ctx, totals).tolist()
    if count == 0:
        return float("nan"), float("nan")
    return loss_sum / count, correct / count
