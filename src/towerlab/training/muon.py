"""Muon on convolution filters, as airbench94_muon uses it (K. Jordan, github.com/KellerJordan/cifar10-airbench).

Muon (K. Jordan et al., "Muon: an optimizer for hidden layers", 2024) takes a momentum step, then
replaces the update matrix by an orthogonal one of the same shape (a few Newton-Schulz iterations,
in bf16) before scaling it by the learning rate. The eager step uses PyTorch's own
`torch.optim.Muon` (torch 2.9 and later; `_Muon2d` below, the same arithmetic, on an older torch).
It takes 2-D parameters only, so each filter (out, in, kh, kw) is handed to it as a 2-D view of its
own memory: (out, in*kh*kw), or for a channels-last filter (out, kh*kw*in), the same matrix with
its columns permuted, which the orthogonalisation permutes alike. The step program (update.py)
computes the same with `orthogonalize` and `matrix` from here, on the same views.

airbench94_muon's Muon differs from torch's in two ways that change nothing or are an option here:
its momentum buffer sums the gradients where torch's averages them (a factor 1 - momentum, which
the orthogonalisation's normalisation removes), and it rescales each filter to norm sqrt(out)
before its update (`--muon-normalize`, `normalize_`). Its learning rate is not adjusted to the
matrix's shape: torch's default adjustment (sqrt(max(1, rows / cols))) is 1 for every filter of
whitenet, whose rows (output channels) are fewer than its columns.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Optional, Sequence

import torch

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # torch.optim.Muon's and airbench94_muon's quintic
EPS = 1e-7                                    # torch.optim.Muon's


def _channels_last(t: torch.Tensor) -> bool:
    return t.dim() == 4 and not t.is_contiguous() and t.is_contiguous(memory_format=torch.channels_last)


def matrix(t: torch.Tensor, like: Optional[torch.Tensor] = None) -> torch.Tensor:
    """`t` (out, ...) as a 2-D (out, rest) matrix whose columns run in the memory order of `like`
    (default: `t`): a view of `t` where its own layout is that one (a parameter, its optimizer state),
    a copy otherwise (a gradient laid out otherwise)."""
    like = t if like is None else like
    if _channels_last(like):
        return t.permute(0, 2, 3, 1).reshape(t.shape[0], -1)
    return t.reshape(t.shape[0], -1)


def orthogonalize(update: torch.Tensor, steps: int, eps: float = EPS) -> torch.Tensor:
    """torch.optim.Muon's Newton-Schulz iteration, op for op (so both give the same bits): the 2-D
    `update` in bf16, scaled to norm 1, then `steps` quintic iterations towards the nearest
    orthogonal matrix (singular values end near 1, between about 0.5 and 1.5)."""
    a, b, c = NS_COEFFICIENTS
    x = update.bfloat16()
    tall = update.size(0) > update.size(1)
    if tall:
        x = x.T
    x.div_(x.norm().clamp(min=eps))
    for _ in range(steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if tall else x


def lr_ratio(shape: Sequence[int]) -> float:
    """torch.optim.Muon's default ("original") learning-rate adjustment of a (rows, cols) matrix."""
    return math.sqrt(max(1.0, shape[0] / shape[1]))


@torch.no_grad()
def normalize_(filters: Sequence[torch.Tensor]) -> None:
    """airbench94_muon's rescaling before each update: every filter tensor to norm sqrt(out)."""
    for p in filters:
        p.mul_(math.sqrt(p.shape[0]) / p.norm())


class _Muon2d(torch.optim.Optimizer):
    """torch.optim.Muon's algorithm (2-D parameters, Nesterov momentum as a moving average, decoupled
    weight decay, the "original" learning-rate adjustment), for a torch without it (before 2.9). The
    tests hold it to torch.optim.Muon where both exist."""

    def __init__(self, params: Any, lr: float = 1e-3, weight_decay: float = 0.1, momentum: float = 0.95,
                 nesterov: bool = True, ns_steps: int = 5) -> None:
        super().__init__(params, {"lr": lr, "weight_decay": weight_decay, "momentum": momentum,
                                  "nesterov": nesterov, "ns_steps": ns_steps})

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, momentum = group["lr"], group["momentum"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p.grad, memory_format=torch.preserve_format)
                buf = state["momentum_buffer"]
                buf.lerp_(p.grad, 1 - momentum)
                update = p.grad.lerp(buf, momentum) if group["nesterov"] else buf
                update = orthogonalize(update, group["ns_steps"])
                p.mul_(1 - lr * group["weight_decay"])
                p.add_(update, alpha=-lr * lr_ratio(p.shape))
        return loss


MuonBase: type[torch.optim.Optimizer] = getattr(torch.optim, "Muon", _Muon2d)


class FilterMuon(MuonBase):  # type: ignore[misc, valid-type]  # torch.optim.Muon, or _Muon2d before torch 2.9
    """Muon over convolution filters (see the module's docstring): each filter reaches the optimizer
    as a 2-D view of its memory, and its gradient as the matching matrix before each step; with
    `normalize`, each filter is first rescaled to norm sqrt(out) (airbench94_muon). Nesterov
    momentum, no weight decay."""

    def __init__(self, filters: Sequence[torch.Tensor], lr: float, momentum: float, ns_steps: int,
                 normalize: bool) -> None:
        self.filters = list(filters)
        self.views = [matrix(p.detach()).requires_grad_() for p in self.filters]
        self.normalize = normalize
        super().__init__(self.views, lr=lr, weight_decay=0.0, momentum=momentum, nesterov=True, ns_steps=ns_steps)

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        for p, view in zip(self.filters, self.views):
            view.grad = None if p.grad is None else matrix(p.grad, p)
        if self.normalize:
            normalize_([p for p in self.filters if p.grad is not None])
        return super().step(closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)
        for p in self.filters:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()
