"""Named training recipes, chosen by measurement (docs/benchmarks.md has the runs behind each number).

A preset is data: the TrainConfig fields it sets, and the RunConfig fields (how many processes)
it runs with, on a CPU and on a GPU machine. Flags the user types still win over a preset's values.
No preset sets a thread count: what pays depends on the CPU and on what else runs on it, and the
default (the cores shared out over the local processes, idle threads sleeping) degrades gently on a
busy machine. A preset's bf16 applies on a CPU only where it has bf16 arithmetic (`cpu_bf16`).

    apply_preset("mnist-fast")  -> {"model": "lenet5", "batch_size": 256, ...}  (TrainConfig fields)
    run_options("mnist-fast")   -> {"devices": 1}                               (RunConfig fields)

`towerlab train --preset NAME` applies both; config.json records the resolved values.

Standard library only, like config.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from towerlab.errors import UserError, did_you_mean


@dataclass(frozen=True)
class Preset:
    name: str
    purpose: str
    train: dict                                   # TrainConfig field -> value
    run: dict = field(default_factory=dict)       # RunConfig field -> value, on a CPU machine
    gpu_train: dict = field(default_factory=dict)  # on a CUDA machine, these TrainConfig fields differ
    gpu_run: dict = field(default_factory=dict)    # ... and these RunConfig fields
    measured: str = ""                            # what it reached, where, and how it was chosen


# airbench94_muon's SGD side in towerlab's units: its head's rate 0.67 is for a loss summed over 2,000
# images and logits scaled by 1/256; towerlab's loss is their mean and its logits are scaled by 1/9, so
# the same steps take 0.67 x 2000 x (9/256)^2. Its weight decay, 2e-6 x 2000 for every SGD group
# divided by that group's rate, shrinks each such weight by 0.004 a step at the peak rate.
HEAD_LR = 0.67 * 2000 * (9 / 256) ** 2
DECAY_PER_STEP = 2e-6 * 2000

PRESETS: dict[str, Preset] = {p.name: p for p in (
    Preset(
        name="mnist-fast",
        purpose="LeNet-5 to 99% MNIST test accuracy in the fewest training seconds",
        train={"model": "lenet5", "dataset": "mnist", "batch_size": 256, "lr": 0.012, "optimizer": "adam",
               "schedule": "onecycle", "steps": 537, "precision": "bf16", "label_smoothing": 0.1},
        run={"devices": 1},
        gpu_run={"devices": 1, "step": "compiled"},
        measured=(
            "On one GPU the step is compiled (torch.compile, recorded as one CUDA graph): on an NVIDIA "
            "H200, 99.03 / 99.07 / 99.06% test accuracy (seeds 0-2) in 0.213 s of training (median), "
            "against 0.295 s with the uncompiled graph step; compiling costs about 19 s of setup the "
            "first time and 5-6 s once torch's compiler cache holds it "
            "(bench/results/gpu/gpu-mnist-fast-2026-11-26.json). "
            "Batch 256, 537 steps = 2.5 epochs of the 55,000 training images, one-cycle Adam peaking at "
            "0.012, label smoothing 0.1, bf16 autocast. Final test accuracy 99.10 / 99.08 / 99.04 / 99.05% "
            "(seeds 0-3); 2 epochs missed 99% in 5 of 8 runs (peak lr 0.012 and 0.016), 3 epochs gave no "
            "more margin (99.01-99.19%). No --target-accuracy: validation accuracy (5,000 images) first "
            "reached 99% while the test accuracy was still 98.90-98.99% in 3 of 4 runs; the annealed end "
            "of the schedule is what makes 99% reliable. On the 2-core Xeon one process with 2 threads "
            "trained it in 4.50 s (99.08-99.11% test), 6.9x faster than the plain PyTorch loop, and "
            "1.30x faster than 2 processes x 128 (DDP's fixed ~2.5 ms per step); medians of 3 "
            "alternating rounds. But 2 OpenMP threads slow down 4-8x while another job takes a core, "
            "where --devices 2 --threads 1 --batch-size 128 (the same numbers) degrades gently."),
    ),
    Preset(
        name="cifar-fast",
        purpose="CifarNet to 80% CIFAR-10 test accuracy in the fewest training seconds",
        train={"model": "cifarnet", "dataset": "cifar10", "batch_size": 256, "lr": 0.004, "optimizer": "adam",
               "schedule": "onecycle", "epochs": 16, "precision": "bf16", "augment": True,
               "label_smoothing": 0.1},
        run={"devices": 2},
        gpu_train={"batch_size": 512},
        gpu_run={"devices": 1},
        measured=(
            "Global batch 512 (2 CPU processes x 256, or one GPU x 512), 16 epochs of the 45,000 "
            "training images with on-device crop+flip, one-cycle Adam peaking at 0.004, label smoothing "
            "0.1, bf16 autocast: 80.81% test accuracy (seed 0, 2 CPU processes, 585 training seconds); "
            "80.02% without label smoothing. Few, large steps, for a GPU; its GPU time is not measured "
            "yet (python bench/speed/run.py --suite gpu)."),
    ),
    Preset(
        name="cifar-94",
        purpose="whitenet to 94% CIFAR-10 test accuracy: airbench94_muon's one-GPU recipe (K. Jordan, "
                "github.com/KellerJordan/cifar10-airbench)",
        train={"model": "whitenet", "dataset": "cifar10", "batch_size": 1000, "epochs": 8, "val_size": 0,
               "optimizer": "muon", "muon_lr": 0.24, "muon_momentum": 0.6, "muon_ns_steps": 3,
               "muon_normalize": True, "lr": HEAD_LR, "momentum": 0.85, "nesterov": True,
               "weight_decay": DECAY_PER_STEP / HEAD_LR, "norm_lr_scale": 64.0, "whiten_bias_epochs": 3,
               "schedule": "decay", "label_smoothing": 0.2, "augment": True, "translate": 2,
               "tta": "flip-translate", "precision": "bf16"},
        run={"devices": 2},
        gpu_train={"batch_size": 2000},
        gpu_run={"devices": 1, "step": "compiled"},
        measured=(
            "airbench94_muon.py's recipe in towerlab's units, not yet timed on a GPU (bench/gpu/session.sh "
            "runs it beside airbench94_muon.py); on 2 CPU processes, seed 0 reached 93.99% test accuracy "
            "(bench/results/gpu/cifar94-cpu-muon-seed0-2026-11-27.json; one seed, not a figure). Global batch 2000 (one GPU x 2000, or 2 CPU processes x "
            "1000: BatchNorm statistics and augmentation do not depend on the split), 8 epochs of all "
            "50,000 training images (200 steps); Muon on the convolution filters (rate 0.24, Nesterov "
            "momentum 0.6, 3 Newton-Schulz steps, each filter rescaled to norm sqrt(out) first), Nesterov "
            "SGD with momentum 0.85 on the rest: its head rate 0.67 for a summed loss, 2000 x (9/256)^2 = "
            "1.656 for towerlab's mean loss and 1/9 logit scale (airbench94_muon scales by 1/256), its "
            "BatchNorm biases at 64x that (its 0.053), weight decay 0.004 a step at the peak, decaying "
            "with the rate; the whitening bias at the BatchNorm biases' rate, falling to 0 over the first "
            "3 epochs and frozen after; every rate falling linearly to 0 (--schedule decay); label "
            "smoothing 0.2, flip + 2-pixel translate, flip-translate test-time augmentation, bf16; the "
            "compiled step on one GPU. The SGD recipe it replaces (airbench94's: 480 steps of 1,024, "
            "Lookahead) reached 94.05% mean test accuracy over 5 seeds in 2.25 s on one NVIDIA H200, where "
            "airbench94_muon.py gave 93.99% in 1.54 s beside it (bench/results/gpu/gpu-cifar94-2026-11-26.json)."),
    ),
)}


def names() -> list[str]:
    return sorted(PRESETS)


def get(name: str) -> Preset:
    try:
        return PRESETS[name]
    except KeyError:
        raise UserError(f"unknown preset {name!r}{did_you_mean(name, names())}: choose one of "
                        f"{', '.join(names())}") from None


def cpu_bf16(cpuinfo: str = "/proc/cpuinfo") -> bool:
    """Whether this CPU computes in bf16 natively (AMX, or AVX-512 BF16), where bf16 autocast pays:
    on a 2-core AMD EPYC with AVX-512 BF16 and no AMX, mnist-fast trained 1.23-1.52x faster in bf16
    than in fp32, on a Xeon with AMX LeNet-5 1.2x and CifarNet 2.3x (docs/benchmarks.md). Without
    either, bf16 is emulated: fp32. False where the file is unreadable (not Linux)."""
    try:
        with open(cpuinfo, encoding="utf-8", errors="replace") as stream:
            flags = next((line.split(":", 1)[1].split() for line in stream if line.startswith("flags")), [])
    except OSError:
        return False
    return bool({"amx_bf16", "avx512_bf16"} & set(flags))


def apply_preset(name: str, device_type: str = "cpu") -> dict:
    """The TrainConfig field overrides of preset `name` on `device_type` ("cpu" or "cuda"), as a
    fresh dict the caller may change. A preset's bf16 becomes fp32 on a CPU without bf16 arithmetic."""
    preset = get(name)
    settings = {**preset.train, **(preset.gpu_train if device_type == "cuda" else {})}
    if device_type == "cpu" and settings.get("precision") == "bf16" and not cpu_bf16():
        settings["precision"] = "fp32"
    return settings


def run_options(name: str, device_type: str = "cpu") -> dict:
    """The RunConfig field overrides of preset `name` on `device_type` (processes, compile)."""
    preset = get(name)
    return dict(preset.gpu_run) if device_type == "cuda" else dict(preset.run)
