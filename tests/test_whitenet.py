"""whitenet (the airbench94-class ConvNet) and the training options that came with it: the patch
whitening, BatchNorm over the global batch, the per-example flip + translate, test-time augmentation,
the linear schedule, Lookahead; the replicas' invariant and an exact resume with all of them on."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F

import towerlab.jobs.train
from towerlab.models.preprocessing import Normalizer, tta_logits
from towerlab.training.batches import Augmentation, Batches, epoch_salt, flip_translate, hashed_words
from towerlab.cli import main
from towerlab.config import RunConfig, SearchConfig, TrainConfig
from towerlab.distributed.group import Context
from towerlab.errors import UserError
from towerlab.objective.candidate import candidate_config
from towerlab.training.lookahead import Lookahead
from towerlab.models import build_model
from towerlab.models.files import load_model
from towerlab.training.optim import Group, make_optimizer, make_scheduler, parameter_groups
from towerlab.models.whitenet import GlobalBatchNorm, patch_whitening
from util import ONE_CPU, StopAtRead, max_difference, summary, weights

TINY32 = ["--dataset", "synthetic", "--synthetic-shape", "3x32x32", "--synthetic-train", "600", "--val-size", "100",
          "--display-step", "1000", "--no-progress", "--threads", "1", *ONE_CPU]
SMALL = {"width1": 8, "width2": 16, "width3": 16}
SMALL_FLAGS = ["--model", "whitenet", *[a for k, v in SMALL.items() for a in ("--model-opt", f"{k}={v}")]]
# Every option airbench94's recipe uses, at small scale.
RECIPE = ["--optimizer", "sgd", "--lr", "0.3", "--momentum", "0.85", "--nesterov", "--weight-decay", "0.005",
          "--norm-lr-scale", "8", "--schedule", "linear", "--lookahead", "2", "--label-smoothing", "0.2",
          "--augment", "--translate", "2", "--tta", "flip-translate"]


def _correlated_images(n=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 3, 16, 16, generator=g) * torch.tensor([1.0, 2.0, 0.5]).view(1, 3, 1, 1)
    return x + 0.7 * x.roll(1, -1) + 0.3 * x.roll(1, 1)  # neighbouring pixels and channels correlate


# --- the model ---------------------------------------------------------------------------------


def test_whitenet_layers_follow_airbench94():
    model = build_model("whitenet", (3, 32, 32))
    convs = [m for m in model.stages if isinstance(m, torch.nn.Conv2d)]
    assert tuple(model.whiten_weight.shape) == (24, 3, 2, 2)  # 12 whitening filters and their negatives
    assert [(c.in_channels, c.out_channels) for c in convs] == [(24, 64), (64, 64), (64, 256), (256, 256),
                                                                (256, 256), (256, 256)]
    norms = [m for m in model.stages if isinstance(m, GlobalBatchNorm)]
    assert len(norms) == 6 and not any(n.weight.requires_grad for n in norms)
    assert norms[0].momentum == 0.4 and norms[0].eps == 1e-12
    assert (model.head.in_features, model.head.out_features, model.head.bias) == (256, 10, None)
    kinds = [type(m).__name__ for m in model.stages[:9]]
    assert kinds == ["GELU", "Conv2d", "MaxPool2d", "GlobalBatchNorm", "GELU", "Conv2d", "GlobalBatchNorm", "GELU",
                     "Conv2d"]
    # Dirac init: a stage's first convolution passes its input channels on unchanged.
    x = torch.randn(2, 24, 5, 5)
    torch.testing.assert_close(convs[0](x)[:, :24], x)
    deeper = build_model("whitenet", (3, 32, 32), width1=16, width2=32, width3=48, depth=3)
    assert sum(isinstance(m, torch.nn.Conv2d) for m in deeper.stages) == 9 and deeper.head.in_features == 48
    assert deeper(torch.randn(4, 3, 32, 32)).shape == (4, 10)
    assert build_model("whitenet", (1, 28, 28), **SMALL)(torch.randn(2, 1, 28, 28)).shape == (2, 10)


def test_a_translation_as_large_as_the_image_is_a_user_error(tmp_path, capsys):
    assert main(["train", *TINY32, *SMALL_FLAGS, "--augment", "--translate", "32", "--out", str(tmp_path)]) == 2
    assert "--translate 32 shifts images by their whole size 32x32" in capsys.readouterr().err


def test_whitenet_refuses_images_it_would_pool_away():
    with pytest.raises(UserError, match="too small"):
        build_model("whitenet", (3, 8, 8))
    with pytest.raises(UserError, match="depth must be a positive integer"):
        build_model("whitenet", (3, 32, 32), depth=0)


def test_whitening_filters_give_the_patches_identity_covariance():
    images = _correlated_images()
    model = build_model("whitenet", (3, 16, 16), **SMALL)
    model.fit_whitening(images)
    half = model.whiten_weight.shape[0] // 2
    torch.testing.assert_close(model.whiten_weight[half:], -model.whiten_weight[:half])
    out = F.conv2d(images.double(), model.whiten_weight[:half].double())
    covariance = torch.cov(out.permute(1, 0, 2, 3).reshape(half, -1))
    before = torch.cov(F.unfold(images.double(), 2).transpose(1, 2).reshape(-1, 12).T)
    assert (before - torch.eye(12, dtype=torch.float64)).abs().max() > 0.5  # far from white before
    # Identity up to eps / (eigenvalue + eps), eps = 5e-4 added to eigenvalues of order 0.1 .. 10.
    assert (covariance - torch.eye(half, dtype=torch.float64)).abs().max() < 1e-2
    assert (patch_whitening(images, 2, 0.0).shape, patch_whitening(images[:, :1], 2, 0.0).shape) == \
        ((12, 3, 2, 2), (4, 1, 2, 2))


# --- augmentation and test-time augmentation --------------------------------------------------


def translated(x, index, seed, epoch, shift):
    return flip_translate(x, index, Augmentation(seed, shift).salts(epoch), shift)


def words(seed, epoch, index):
    return hashed_words(index, epoch_salt(seed, epoch))


def test_flip_translate_equals_mirror_then_reflect_padded_shift():
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, 256, (64, 3, 7, 9), dtype=torch.uint8, generator=g)
    index = torch.randperm(1000, generator=g)[:64]
    out = translated(x, index, 5, 3, 2)
    flips = ((words(5, None, index) & 1) ^ 1).bool()  # epoch 3 is odd: the start is inverted
    drawn = words(5, 3, index)
    dy, dx = drawn % 5 - 2, (drawn // 5) % 5 - 2
    for k in range(64):
        image = x[k].flip(-1) if flips[k] else x[k]
        padded = F.pad(image.float()[None], (2, 2, 2, 2), mode="reflect")[0]
        top, left = 2 - int(dy[k]), 2 - int(dx[k])
        assert torch.equal(out[k], padded[:, top:top + 7, left:left + 9].to(torch.uint8)), k
    shifts = set(zip(dy.tolist(), dx.tolist()))
    assert len(shifts) > 15 and 10 < int(flips.sum()) < 54  # all shifts and both flips are drawn


def test_flip_translate_depends_only_on_seed_epoch_and_example():
    x = torch.randint(0, 256, (40, 3, 8, 8), dtype=torch.uint8, generator=torch.Generator().manual_seed(2))
    index = torch.arange(100, 140)
    whole = translated(x, index, 7, 4, 2)
    assert torch.equal(whole, translated(x, index, 7, 4, 2))
    # Split the batch as two replicas hold it (strided), or reorder it: each image augments alike.
    for part in (slice(0, None, 2), slice(1, None, 2)):
        assert torch.equal(translated(x[part], index[part], 7, 4, 2), whole[part])
    order = torch.randperm(40)
    assert torch.equal(translated(x[order], index[order], 7, 4, 2), whole[order])
    assert not torch.equal(translated(x, index, 8, 4, 2), whole)
    # The flip alternates between epochs; the shift is redrawn.
    base = words(7, None, index) & 1
    assert not torch.equal(words(7, 4, index), words(7, 5, index))
    flipped_now = torch.equal(translated(x, index, 7, 4, 0), torch.where(base.bool()[:, None, None, None],
                                                                            x.flip(-1), x))
    flipped_next = torch.equal(translated(x, index, 7, 5, 0), torch.where(base.bool()[:, None, None, None],
                                                                             x, x.flip(-1)))
    assert flipped_now and flipped_next


def test_translated_batches_of_two_replicas_interleave_into_one_replicas_and_resume_mid_epoch():
    x = torch.randint(0, 256, (300, 3, 8, 8), dtype=torch.uint8, generator=torch.Generator().manual_seed(3))
    y = torch.randint(0, 10, (300,))
    norm = Normalizer((0.5,) * 3, (0.25,) * 3, torch.device("cpu"))

    def batches(rank, world, batch):
        return Batches(x, y, Context(rank=rank, world_size=world), batch, 11, "resident", norm,
                       augment_images=True, translate=2)

    one = list(batches(0, 1, 40).epoch(2))
    halves = [list(batches(r, 2, 20).epoch(2)) for r in (0, 1)]
    for step, (xb, yb) in enumerate(one):
        assert torch.equal(xb[0::2], halves[0][step][0]) and torch.equal(xb[1::2], halves[1][step][0])
        assert torch.equal(yb[1::2], halves[1][step][1])
    resumed = list(batches(0, 1, 40).epoch(2, start_step=3))
    assert all(torch.equal(a[0], b[0]) for a, b in zip(resumed, one[3:], strict=True))
    assert not torch.equal(list(batches(0, 1, 40).epoch(3))[0][0], one[0][0])
    for mode in ("feed", "queue"):
        other = Batches(x, y, Context(), 40, 11, mode, norm, augment_images=True, translate=2).epoch(2)
        assert all(torch.equal(a[0], b[0]) for a, b in zip(other, one, strict=True))


def test_flip_tta_of_a_mirror_symmetric_image_is_the_plain_evaluation():
    model = build_model("whitenet", (3, 32, 32), **SMALL).eval()
    model.fit_whitening(torch.randn(16, 3, 32, 32))
    a = torch.randn(4, 3, 32, 32)
    symmetric = (a + a.flip(-1)) / 2
    with torch.no_grad():
        assert torch.equal(tta_logits(model, symmetric, "flip"), model(symmetric))
        assert not torch.allclose(tta_logits(model, a, "flip"), model(a))


def test_tta_views_and_weights_by_hand():
    x = torch.arange(9.0).view(1, 1, 3, 3)  # rows 0 1 2 / 3 4 5 / 6 7 8

    def pixels(v):
        return v.flatten(1)

    assert torch.equal(tta_logits(pixels, x, "none"), pixels(x))
    # The mirror averages each row: 1 1 1 / 4 4 4 / 7 7 7.
    assert tta_logits(pixels, x, "flip").tolist() == [[1.0, 1.0, 1.0, 4.0, 4.0, 4.0, 7.0, 7.0, 7.0]]
    # Shifted up-left with reflected borders: 4 3 4 / 1 0 1 / 4 3 4; down-right: 4 5 4 / 7 8 7 / 4 5 4; both
    # mirror-symmetric, they sum to 8 everywhere: 1/2 * (mirror average) + 1/4 * 8.
    assert tta_logits(pixels, x, "flip-translate").tolist() == [[2.5, 2.5, 2.5, 4.0, 4.0, 4.0, 5.5, 5.5, 5.5]]


# --- optimizer, schedule, Lookahead ------------------------------------------------------------


def test_linear_schedule_and_norm_lr_scale_by_hand():
    cfg = TrainConfig(model="whitenet", optimizer="sgd", lr=2.0, momentum=0.85, nesterov=True, weight_decay=0.01,
                      norm_lr_scale=64.0, schedule="linear")
    model = build_model("whitenet", (3, 32, 32), **SMALL)
    params = [p for p in model.parameters() if p.requires_grad]
    groups = parameter_groups(model, params, cfg)
    biases = {id(m.bias) for m in model.modules() if isinstance(m, GlobalBatchNorm)}
    assert {id(params[i]) for i in groups[1].positions} == biases
    assert len(groups[0].positions) + len(groups[1].positions) == len(params)
    optimizer = make_optimizer(cfg, params, groups, torch.device("cpu"))
    assert [(g["lr"], g["weight_decay"]) for g in optimizer.param_groups] == [(2.0, 0.01), (128.0, 0.01 / 64)]
    assert optimizer.defaults["nesterov"] and optimizer.defaults["momentum"] == 0.85
    scheduler = make_scheduler(cfg, optimizer, total_steps=100)
    factors = []
    for _ in range(100):
        factors.append(optimizer.param_groups[0]["lr"] / 2.0)
        optimizer.step()
        scheduler.step()
    # 0.2 at the start, the peak after int(0.23 * 100) = 23 steps, 0.07 after the last step.
    assert factors[0] == pytest.approx(0.2) and factors[23] == pytest.approx(1.0)
    assert factors[10] == pytest.approx(0.2 + 0.8 * 10 / 23) and factors[99] == pytest.approx(1 - 0.93 * 76 / 77)
    assert optimizer.param_groups[1]["lr"] == pytest.approx(128.0 * 0.07)
    assert [len(make_optimizer(TrainConfig(), params, [Group(list(range(len(params))))], torch.device("cpu"))
                .param_groups)] == [1]


def test_lookahead_by_hand_with_batchnorm_statistics():
    module = torch.nn.Sequential(torch.nn.Linear(1, 1, bias=False), torch.nn.BatchNorm1d(1))
    weight, running_mean = module[0].weight, module[1].running_mean
    with torch.no_grad():
        weight.fill_(0.0)
        running_mean.fill_(0.0)
    lookahead = Lookahead(module, every=2, decay=0.5, total_steps=4)
    seen = []
    for value in (1.0, 2.0, 3.0, 4.0):
        with torch.no_grad():  # stand-in for a training step
            weight.fill_(value)
            running_mean.fill_(10 * value)
        seen.append(lookahead.step())
        if value == 2.0:
            # d = 0.5 ** 2 * (2 / 4) ** 3 = 1/32: slow = 1/32 * 0 + 31/32 * 2, and the weights take it.
            assert weight.item() == 1.9375 and running_mean.item() == 19.375
    # Step 4: d = 0.25: slow = 0.25 * 1.9375 + 0.75 * 4; the last step leaves the slow weights.
    assert seen == [False, True, False, True]
    assert weight.item() == 3.484375 and running_mean.item() == 34.84375
    state = lookahead.state_dict()
    fresh = Lookahead(module, every=2, decay=0.5, total_steps=4)
    fresh.load_state_dict(state)
    assert fresh.steps == 4 and fresh.slow[0].item() == 3.484375


@pytest.mark.parametrize("changes, message", [
    ({"nesterov": True}, "--nesterov needs --optimizer sgd"),
    ({"translate": 2}, "add --augment"),
    ({"warmup": 0.1}, "--warmup needs --schedule"),
    ({"schedule": "linear", "warmup": 1.0}, "--warmup is a fraction"),
    ({"lookahead": -1}, "--lookahead must be 0"),
    ({"lookahead_decay": 1.5}, "--lookahead-decay"),
    ({"norm_lr_scale": 0.0}, "--norm-lr-scale must be positive"),
    ({"tta": "rotate"}, "unknown tta 'rotate'"),
])
def test_bad_training_options_are_user_errors(changes, message):
    with pytest.raises(UserError, match=message):
        TrainConfig(**changes)


# --- training end to end -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def whitenet_one_replica(tmp_path_factory):
    out = tmp_path_factory.mktemp("wn") / "one"
    assert main(["train", *TINY32, *SMALL_FLAGS, *RECIPE, "--steps", "6", "--batch-size", "64", "--out", str(out)]) == 0
    return out


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "ps"])
def test_two_whitenet_replicas_with_every_option_equal_one_with_twice_the_batch(
        strategy, whitenet_one_replica, tmp_path):
    out = tmp_path / strategy
    assert main(["train", *TINY32, *SMALL_FLAGS, *RECIPE, "--steps", "6", "--batch-size", "32", "--devices", "2",
                 "--strategy", strategy, "--out", str(out)]) == 0
    # BatchNorm statistics over both replicas, augmentation drawn per example: the same computation.
    assert max_difference(weights(out), weights(whitenet_one_replica)) < 1e-5
    one, two = summary(whitenet_one_replica), summary(out)
    assert two["val_loss"] == pytest.approx(one["val_loss"], abs=1e-5)
    assert (two["world_size"], two["global_batch_size"]) == (2, 64)


def test_whitenet_training_moves_the_weights_and_whitens_the_data(whitenet_one_replica, tmp_path):
    # Guards the invariant above against comparing untrained models.
    assert main(["train", *TINY32, *SMALL_FLAGS, *RECIPE, "--steps", "1", "--batch-size", "64",
                 "--out", str(tmp_path / "short")]) == 0
    assert max_difference(weights(tmp_path / "short"), weights(whitenet_one_replica)) > 1e-3
    model, record = load_model(whitenet_one_replica / "model.pt")
    cfg = TrainConfig(**record["config"])
    data = towerlab.jobs.train.train_data(cfg, RunConfig(), download=False)
    normalize = Normalizer(record["mean"], record["std"], torch.device("cpu"))
    images = normalize(data.x_train[:300]).double()
    half = model.whiten_weight.shape[0] // 2
    out = F.conv2d(images, model.whiten_weight[:half].double())
    covariance = torch.cov(out.permute(1, 0, 2, 3).reshape(half, -1))
    assert (covariance - torch.eye(half, dtype=torch.float64)).abs().max() < 0.05


def test_whitenet_interrupted_then_resumed_equals_uninterrupted(tmp_path, monkeypatch):
    # Lookahead's slow weights, the linear schedule, Nesterov momentum and the keyed augmentation: all
    # in the checkpoint or derived from the step.
    args = [*TINY32, *SMALL_FLAGS, *RECIPE, "--epochs", "2", "--batch-size", "50"]
    assert main(["train", *args, "--out", str(tmp_path / "whole")]) == 0
    StopAtRead.reads_before_stop = 13  # step 13 of 20: mid-way through the second epoch, between lookaheads
    monkeypatch.setattr(towerlab.jobs.train, "StopFlag", StopAtRead)
    assert main(["train", *args, "--out", str(tmp_path / "cut")]) == 130
    monkeypatch.undo()
    assert main(["train", "--resume", str(tmp_path / "cut")]) == 0
    assert max_difference(weights(tmp_path / "cut"), weights(tmp_path / "whole")) == 0.0
    assert summary(tmp_path / "cut")["test_accuracy"] == summary(tmp_path / "whole")["test_accuracy"]


# --- the search --------------------------------------------------------------------------------


def test_whitenet_candidates_train_with_the_cifar94_recipe():
    genome = {"width1": 32, "width2": 128, "width3": 256, "depth": 2, "epochs": 8, "lr": 2.0,
              "label_smoothing": 0.1}
    cfg = candidate_config(SearchConfig(dataset="cifar10"), "whitenet", genome, seed=4)
    assert cfg.model_options == {"width1": 32, "width2": 128, "width3": 256, "depth": 2}
    assert (cfg.epochs, cfg.lr, cfg.label_smoothing, cfg.seed, cfg.batch_size) == (8, 2.0, 0.1, 4, 2000)
    assert (cfg.optimizer, cfg.momentum, cfg.nesterov, cfg.schedule, cfg.lookahead) == ("muon", 0.85, True, "decay", 0)
    assert (cfg.muon_lr, cfg.muon_momentum, cfg.muon_ns_steps, cfg.muon_normalize) == (0.24, 0.6, 3, True)
    assert (cfg.augment, cfg.translate, cfg.tta, cfg.norm_lr_scale, cfg.whiten_bias_epochs) == (
        True, 2, "flip-translate", 64.0, 3)
    other = candidate_config(SearchConfig(dataset="cifar10"), "whitenet", {**genome, "optimizer": "adam"}, 4)
    del genome["lr"]
    adam = candidate_config(SearchConfig(dataset="cifar10"), "whitenet", {**genome, "optimizer": "adam"}, 4)
    assert (other.optimizer, other.nesterov, other.lr, adam.lr) == ("adam", False, 2.0, 0.001)
    assert (other.muon_lr, other.muon_normalize) == (TrainConfig().muon_lr, False)  # Muon's settings left behind
    plain = candidate_config(SearchConfig(dataset="cifar10"), "cnn", {"blocks": 2, "label_smoothing": 0.2}, 1)
    assert plain == dataclasses.replace(TrainConfig(model="cnn", dataset="cifar10", batch_size=64, seed=1,
                                                    patience=5, model_options={"blocks": 2}), label_smoothing=0.2)


def test_a_changed_recipe_changes_its_family_s_training_settings_and_no_other(monkeypatch):
    """A search store serves cached fitnesses by the training settings' hash: a family's recipe is part
    of it, so a store of whitenet candidates trained under an older cifar-94 is not served today, while
    an mlp or cnn store stays valid when cifar-94 changes."""
    from towerlab import presets
    from towerlab.objective import candidate

    cfg = SearchConfig(dataset="cifar10")
    before = {m: candidate.train_config_hash(cfg, "cpu", 1, m) for m in ("whitenet", "mlp", "cnn")}
    assert candidate.training_settings(cfg, "cpu", 1, "whitenet")["recipe"] == candidate.recipe("whitenet")
    preset = presets.PRESETS["cifar-94"]
    monkeypatch.setitem(presets.PRESETS, "cifar-94", dataclasses.replace(preset, train={**preset.train,
                                                                                        "weight_decay": 0.1}))
    after = {m: candidate.train_config_hash(cfg, "cpu", 1, m) for m in ("whitenet", "mlp", "cnn")}
    assert after["whitenet"] != before["whitenet"]
    assert (after["mlp"], after["cnn"]) == (before["mlp"], before["cnn"])

