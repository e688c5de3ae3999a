"""The GPU family's tables (docs/benchmarks.md), each number read from its record."""

from __future__ import annotations

from bench.common.tables import Cell, Ref, Table, figure_ref

H100, H200 = "one H100", "one H200"
MNIST_GPU, CIFAR94_GPU, SEARCH_GPU = ("gpu/gpu-mnist-fast-2026-11-26.json", "gpu/gpu-cifar94-2026-11-26.json",
                                      "gpu/gpu-search-2026-11-26.json")


def _search_rate(side: str) -> Ref:
    return figure_ref(SEARCH_GPU, "search_rate_gpu", "int", f"detail/evaluations_per_min/{side}")


GPU = Table(
    ("figure", "measured (median)", "target", "met", "card"),
    (
        ("`mnist-fast` to 99.0% test accuracy, training seconds, compiled step (3 seeds, every one at 99%; "
         "the preset's step on one GPU)", figure_ref(MNIST_GPU, "lenet5_tta_compiled_gpu", "s"), "<= 0.25 s", "yes", H200),
        ("the same with the CUDA-graph step", figure_ref(MNIST_GPU, "lenet5_tta_gpu", "s"), "<= 0.25 s", "no", H200),
        ("`cifar-94` with its earlier SGD recipe (480 steps of 1,024), 5 seeds: mean test accuracy; training "
         "seconds; airbench94_muon's in the same call (5 runs: mean; median)",
         (Ref(CIFAR94_GPU, "figures/cifar94/detail/test_accuracy/mean", "pct"), "; ", figure_ref(CIFAR94_GPU, "cifar94", "s"),
          "; ", Ref(CIFAR94_GPU, "figures/cifar94/detail/airbench94_muon_accuracy", "pct"), "; ",
          Ref(CIFAR94_GPU, "figures/cifar94/detail/airbench94_muon_seconds", "s")),
         ">= 94.0% in <= airbench94_muon's seconds", "accuracy yes, time no", H200),
        ("search evaluations a minute over 3 generations (mlp, MNIST, 1 epoch): 1; 2; 4 workers per GPU; "
         "4 with the eager step",
         (_search_rate("per_device1"), "; ", _search_rate("per_device2"), "; ", _search_rate("per_device4"), "; ",
          _search_rate("per_device4_eager")),
         ">= 600", "no", H200),
        ("`mnist-fast` to 99.0% test accuracy, training seconds, eager step (3 seeds)",
         figure_ref("gpu/gpu-lenet5_tta-2026-11-25.json", "lenet5_tta_gpu", "s"), "<= 1.5 s", "no", H100),
        ("the same with the CUDA-graph step",
         figure_ref("gpu/gpu-lenet5_tta-graph-2026-11-25.json", "lenet5_tta_gpu", "s"), "<= 0.5 s", "yes", H100),
        ("`cifar-fast` to 80% test accuracy, training seconds, eager step (3 seeds)",
         figure_ref("gpu/gpu-cifarnet_tta-2026-11-25.json", "cifarnet_tta_gpu", "s"), "<= 10 s", "yes", H100),
        ("`cifar-94` as it was (5,000 images held out, 11 epochs, eager step), 5 seeds: mean test accuracy; "
         "training seconds",
         (Ref("gpu/gpu-cifar94-2026-11-25.json", "figures/cifar94/detail/test_accuracy/mean", "pct"), "; ",
          figure_ref("gpu/gpu-cifar94-2026-11-25.json", "cifar94", "s")), ">= 94.0% in <= 1.8 s", "no", H100),
        ("search evaluations a minute, `--workers-per-device 4` over 1, eager step",
         figure_ref("gpu/gpu-search-2026-11-25.json", "search_workers_gpu", "x"), ">= 2.5x", "yes", H100),
        ("search evaluations a minute in a second generation, graph step: 1 worker; 4 per GPU",
         (Ref("gpu/gpu-search-graph-generations-2026-11-25.json", "runs/workers_per_device1/generations/1/evaluations_per_min", "int"), "; ",
          Ref("gpu/gpu-search-graph-generations-2026-11-25.json", "runs/workers_per_device4/generations/1/evaluations_per_min", "int")),
         ">= 300", "yes, once the workers run", H100),
        ("examples/s, `--input resident` over `feed`, lenet5, batch 512",
         figure_ref("gpu/gpu-input_modes-2026-11-25.json", "input_modes_gpu", "x"), ">= 3x", "no", H100),
        ("`--strategy ps` step time over `ddp`, one GPU: lenet5; cifarnet (batch 512)",
         (figure_ref("gpu/gpu-ps_vs_ddp-2026-11-25.json", "ps_vs_ddp_gpu_lenet5", "x"), "; ",
          figure_ref("gpu/gpu-ps_vs_ddp-2026-11-25.json", "ps_vs_ddp_gpu_cifarnet", "x")), "reported", "", H100),
    ),
)


def _step(record: str, case: str, title: str) -> tuple[Cell, ...]:
    return (title,) + tuple(Ref(record, f"cases/{case}/modes/{mode}/ms", "ms") for mode in ("eager", "graph", "compiled"))


STEP = Table(
    ("one training step", "eager", "CUDA graph", "compiled"),
    (
        _step("gpu/gpu-step-lenet5-2026-11-26.json", "lenet5-b512-mnist-fast", "LeNet-5, batch 512, bf16 Adam (one H200)"),
        _step("gpu/step-gpu-modes-2026-11-25.json", "lenet5-b512-mnist-fast", "LeNet-5, batch 512, bf16 Adam"),
        _step("gpu/step-gpu-modes-b256-2026-11-25.json", "lenet5-b256-mnist-fast", "LeNet-5, batch 256 (`mnist-fast`)"),
        _step("gpu/step-gpu-modes-2026-11-25.json", "whitenet-b1024-cifar-94", "whitenet, batch 1024 (`cifar-94`)"),
    ),
)


TABLES: dict[str, Table] = {"gpu": GPU, "gpu-step": STEP}
