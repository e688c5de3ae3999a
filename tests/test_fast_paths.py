"""The speed changes of issue 4 compute what the plain versions compute: LRN as a band-matrix
convolution with its own backward, crop+flip as one gather, LeNet-5 and CifarNet pooling before ReLU."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from towerlab.batches import augment
from towerlab.models import build_model, tf_local_response_norm


def test_lrn_matches_torch_forward_and_backward_in_both_memory_formats():
    torch.manual_seed(0)
    reference = nn.LocalResponseNorm(9, alpha=0.001, beta=0.75, k=1.0)
    for memory_format in (torch.contiguous_format, torch.channels_last):
        x = (torch.randn(3, 64, 5, 5, dtype=torch.float64) * 3).contiguous(memory_format=memory_format)
        x.requires_grad_()
        ours = tf_local_response_norm()(x)
        theirs = reference(x)
        weights = torch.randn_like(ours)
        (g_ours,) = torch.autograd.grad((ours * weights).sum(), x)
        (g_theirs,) = torch.autograd.grad((theirs * weights).sum(), x)
        torch.testing.assert_close(ours, theirs, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(g_ours, g_theirs, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("size,beta", [(9, 0.75), (5, 0.6)])  # 0.75 takes the square-root path
def test_lrn_gradcheck(size, beta):
    lrn = tf_local_response_norm()
    lrn.size, lrn.beta, lrn.alpha, lrn.k = size, beta, 0.01, 2.0
    x = torch.randn(2, 11, 3, 3, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lrn, (x,))


def _augment_by_indexing(x, generator, pad=4):
    n, c, h, w = x.shape
    padded = F.pad(x, (pad, pad, pad, pad))
    dy = torch.randint(0, 2 * pad + 1, (n,), generator=generator)
    dx = torch.randint(0, 2 * pad + 1, (n,), generator=generator)
    rows = (dy[:, None] + torch.arange(h)[None, :])[:, None, :, None]
    cols = (dx[:, None] + torch.arange(w)[None, :])[:, None, None, :]
    out = padded[torch.arange(n)[:, None, None, None], torch.arange(c)[None, :, None, None], rows, cols]
    flip = torch.rand(n, generator=generator) < 0.5
    return torch.where(flip[:, None, None, None], out.flip(3), out)


@pytest.mark.parametrize("shape", [(64, 3, 32, 32), (5, 1, 28, 28), (3, 2, 7, 9)])
def test_augment_gather_equals_cropping_by_indexing(shape):
    x = torch.randint(0, 256, shape, dtype=torch.uint8)
    ours = augment(x, torch.Generator().manual_seed(7))
    assert torch.equal(ours, _augment_by_indexing(x, torch.Generator().manual_seed(7)))


@pytest.mark.parametrize("name,shape,swap", [("lenet5", (1, 28, 28), ((1, 2), (4, 5))),
                                             ("cifarnet", (3, 32, 32), ((1, 2),))])
def test_pooling_before_relu_gives_the_same_numbers(name, shape, swap):
    torch.manual_seed(0)
    model = build_model(name, shape)
    layers = list(model.features)
    for i, j in swap:
        layers[i], layers[j] = layers[j], layers[i]
    seeds_order = nn.Sequential(*layers)
    x = torch.randn(4, *shape)
    if name == "lenet5":
        x = F.pad(x, model.pad)
    ours, theirs = model.features(x), seeds_order(x)
    assert torch.equal(ours, theirs)
    first_conv = model.features[0].weight
    (g_ours,) = torch.autograd.grad(ours.square().sum(), first_conv)
    (g_theirs,) = torch.autograd.grad(theirs.square().sum(), first_conv)
    assert torch.equal(g_ours, g_theirs)
