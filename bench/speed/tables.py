"""The training-speed family's tables (docs/benchmarks.md), each number read from its record."""

from __future__ import annotations

from bench.common.tables import Ref, Table, figure_ref, lookup

CPU1, CPU2 = "speed/cpu-2026-11-22-run1.json", "speed/cpu-2026-11-22-run2.json"

CPU_SUITE = Table(
    ("figure", "run 1", "run 2", "target"),
    tuple(
        (title, figure_ref(CPU1, fid, "x"), figure_ref(CPU2, fid, "x"), target)
        for fid, title, target in (
            ("mnist_tta", "training seconds to 99.0% MNIST test accuracy, the baseline over `--preset mnist-fast`", ">= 4x"),
            ("scaling_lenet5", "examples/s, `--devices 2` over `--devices 1` (1 thread each), lenet5, batch 512 per replica", ">= 1.7x"),
            ("scaling_cifarnet", "the same, cifarnet, batch 128 per replica", ">= 1.7x"),
            ("ps_vs_ddp_lenet5", "`--strategy ps` step time over `ddp`, 2 x 128, lenet5", "reported"),
            ("ps_vs_ddp_cifarnet", "the same, cifarnet", "reported"),
            ("input_modes_cpu", "examples/s, `--input resident` over `feed`, lenet5, batch 512", "reported (3x is a GPU's target)"),
            ("mnist_fast_layout", "`mnist-fast` training seconds, 2 processes x 1 thread over 1 process x 2 threads", "reported"),
            ("search_2_vs_1", "search evaluations a minute, MNIST mlp space, 2 workers over 1", ">= 1.8x"),
        )
    ) + (
        ("`mnist-fast` training seconds with one core taken by another process, over quiet (passive OpenMP waiting)",
         "", figure_ref("speed/busy-core/cpu-2026-11-22.json", "busy_core", "x"), "<= 1.5x (a 2-core AMD EPYC)"),
    ),
)

CHANGES = Table(
    ("change", "before", "after", "speed-up"),
    tuple(
        (change["what"], Ref(CPU2, f"changes/results/{change['id']}/before_ms", "ms"),
         Ref(CPU2, f"changes/results/{change['id']}/after_ms", "ms"), Ref(CPU2, f"changes/results/{change['id']}/speedup", "x"))
        for change in lookup(CPU2, "changes/results")
    ),
)

SEEDS = "speed/seeds-cpu-2026-11-22.json"
SEED_EXAMPLES = Table(
    ("example", "validation accuracy", "test accuracy", "training time", "examples/s"),
    tuple(
        (title, Ref(SEEDS, f"examples/{key}/val_accuracy", "pct"), Ref(SEEDS, f"examples/{key}/test_accuracy", "pct"),
         Ref(SEEDS, f"examples/{key}/train_seconds", "s0"), Ref(SEEDS, f"examples/{key}/examples_per_sec", "int"))
        for key, title in (
            ("lenet5_4_replicas", "LeNet-5, 4 replicas x 512, 20 epochs"),
            ("lenet5_1_replica", "LeNet-5, 1 replica x 512, 20 epochs"),
            ("convnet_2_replicas", "the 64-256-512 ConvNet, 2 replicas x 1024, cut to 6 steps"),
            ("cifarnet_towers_ps", "CifarNet in towers (`--strategy ps --preset cifar-fast`)"),
        )
    ),
)


FOLDER_CIFAR, FOLDER_LARGE, FOLDER_LARGE_CUT = ("speed/image-folder-cifar-2026-11-27.json", "speed/image-folder-large-2026-11-27.json",
                                                 "speed/image-folder-large-cut-2026-11-27.json")
IMAGE_FOLDERS = Table(
    ("image folders on the shared 2-core CPU machine (under `nice`)", "measured", "aim"),
    (
        ("CIFAR-10's 60,000 images as PNG files, first use: list, read and hash every file, decode on both "
         "cores, channel statistics; wall seconds, CPU seconds (median of 3)",
         (figure_ref(FOLDER_CIFAR, "decode_seconds", "s"), "; ", figure_ref(FOLDER_CIFAR, "decode_cpu_seconds", "s")), ""),
        ("the decode's rate: images per CPU-second, that is per core",
         figure_ref(FOLDER_CIFAR, "decode_rate_per_core", "int"), ""),
        ("a later use: list and stat every file, open the cache memory-mapped; wall seconds, CPU seconds (median of 15)",
         (figure_ref(FOLDER_CIFAR, "reopen_seconds", "s"), "; ", figure_ref(FOLDER_CIFAR, "reopen_cpu_seconds", "s")), ""),
        ("the decode's time over the reopening's: wall; CPU",
         (figure_ref(FOLDER_CIFAR, "reopen_speedup", "x"), "; ", figure_ref(FOLDER_CIFAR, "reopen_speedup_cpu", "x")), ">= 20x"),
        ("40,000 JPEG files of 256x256 pixels (39,400 in train/, 300 in val/, 300 in test/): the size of their cache",
         figure_ref(FOLDER_LARGE, "cache_bytes", "gib"), ""),
        ("peak RSS of an MLP (1 layer of 8) trained one epoch over that cache (1 process, 2 threads, batch 64)",
         figure_ref(FOLDER_LARGE, "peak_rss_bytes", "gib"), ""),
        ("the cache over that peak RSS", figure_ref(FOLDER_LARGE, "cache_over_rss", "x"), "several times"),
        ("the same training with each batch's pages left mapped: peak RSS",
         figure_ref(FOLDER_LARGE, "peak_rss_bytes_pages_kept", "gib"), ""),
        ("the same 40,000 images in class folders alone (8,000 cut for testing, 5,000 for validation): peak RSS; "
         "its evaluation batches of 1,024 images are 0.8 GB of floats",
         figure_ref(FOLDER_LARGE_CUT, "peak_rss_bytes", "gib"), ""),
    ),
)

TABLES: dict[str, Table] = {"cpu-suite": CPU_SUITE, "changes": CHANGES, "seed-examples": SEED_EXAMPLES,
                           "image-folders": IMAGE_FOLDERS}
