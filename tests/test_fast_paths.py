"""The speed changes of issue 4 compute what the plain versions compute: LRN as a band-matrix
convolution with its own backward, crop+flip as one gather, LeNet-5 and CifarNet pooling before ReLU."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from towerlab.training.batches import crop_flip, hashed_words
from towerlab.models import build_model
from towerlab.models.seeds import tf_local_response_norm


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


def _crop_flip_by_indexing(x, index, salt, pad=4):
    n, c, h, w = x.shape
    padded = F.pad(x, (pad, pad, pad, pad))
    word = hashed_words(index, salt)
    dy, dx, flip = word % 9, (word // 9) % 9, (word // 81) % 2 == 1
    rows = (dy[:, None] + torch.arange(h)[None, :])[:, None, :, None]
    cols = (dx[:, None] + torch.arange(w)[None, :])[:, None, None, :]
    out = padded[torch.arange(n)[:, None, None, None], torch.arange(c)[None, :, None, None], rows, cols]
    return torch.where(flip[:, None, None, None], out.flip(3), out)


@pytest.mark.parametrize("shape", [(64, 3, 32, 32), (5, 1, 28, 28), (3, 2, 7, 9)])
def test_crop_flip_gather_equals_cropping_by_indexing(shape):
    x = torch.randint(0, 256, shape, dtype=torch.uint8)
    index = torch.randperm(10_000)[:shape[0]]
    ours = crop_flip(x, index, 12345)
    assert torch.equal(ours, _crop_flip_by_indexing(x, index, 12345))
    # A salt given as a device tensor (the step program's) draws the same.
    assert torch.equal(crop_flip(x, index, torch.tensor(12345)), ours)


def test_crop_flip_draws_every_shift_and_both_flips():
    word = hashed_words(torch.arange(4000), 99)
    shifts = set(zip((word % 9).tolist(), ((word // 9) % 9).tolist()))
    flips = int(((word // 81) % 2).sum())
    assert len(shifts) == 81 and 1800 < flips < 2200


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
