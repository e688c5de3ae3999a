"""What the benchmark ran on, and how busy the machine was while it ran.

The machine is shared: other people's jobs take cores at random moments. Every timed sample is
therefore bracketed by `CpuWatch`, which records how many CPU-seconds the whole machine spent
(/proc/stat) against what our own child processes used (rusage): the difference is foreign load.
`wait_for_quiet` holds a sample back until the machine has been idle for a moment, and samples
taken under foreign load are flagged in the JSON so a reader can discount them.
"""

from __future__ import annotations

import os
import platform
import resource
import sys
import time
from dataclasses import dataclass

import torch

from towerlab.distributed.env import device_name

_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def cpu_model() -> str:
    return device_name(torch.device("cpu"))


def cpu_flags() -> list[str]:
    """The CPU features that decide which kernels torch picks (AVX-512, AMX, ...)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = line.split(":", 1)[1].split()
                    return sorted(f for f in flags if f.startswith(("avx", "amx", "fma")))
    except OSError:
        pass
    return []


def describe() -> dict:
    info = {
        "cpu_model": cpu_model(), "cpu_cores": os.cpu_count(), "cpu_flags": cpu_flags(),
        "memory_gb": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
        "platform": platform.platform(), "python": sys.version.split()[0],
        "torch": torch.__version__, "torch_threads_default": torch.get_num_threads(),
        "torch_parallel": torch.__config__.parallel_info().splitlines()[-1].strip(),
        "mkldnn_bf16": bool(getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: False)()),
        "cuda": torch.cuda.is_available(),
    }
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
        info["gpu_count"] = torch.cuda.device_count()
        info["cuda_version"] = torch.version.cuda
    return info


def _machine_ticks() -> tuple[int, int]:
    """(busy, total) jiffies of all CPUs since boot; (0, 0) where /proc/stat is missing."""
    try:
        with open("/proc/stat", encoding="utf-8") as f:
            values = [int(v) for v in f.readline().split()[1:]]
    except (OSError, ValueError):
        return 0, 0
    idle = values[3] + (values[4] if len(values) > 4 else 0)
    return sum(values[:8]) - idle, sum(values[:8])


def _own_cpu_seconds() -> float:
    own = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


@dataclass
class CpuUse:
    wall_seconds: float
    machine_cpu_seconds: float      # every process on the machine
    own_cpu_seconds: float          # this benchmark and the children it waited for
    capacity_cpu_seconds: float     # cores x wall

    @property
    def foreign_cpu_seconds(self) -> float:
        return max(0.0, self.machine_cpu_seconds - self.own_cpu_seconds)

    @property
    def foreign_cores(self) -> float:
        """Average number of cores someone else kept busy during the sample."""
        return self.foreign_cpu_seconds / self.wall_seconds if self.wall_seconds > 0 else 0.0

    def as_dict(self) -> dict:
        return {"wall_seconds": round(self.wall_seconds, 3),
                "machine_cpu_seconds": round(self.machine_cpu_seconds, 2),
                "own_cpu_seconds": round(self.own_cpu_seconds, 2),
                "foreign_cores": round(self.foreign_cores, 2)}


class CpuWatch:
    """with CpuWatch() as watch: ...; watch.use -> CpuUse. Children must have been waited for."""

    def __enter__(self) -> "CpuWatch":
        self._busy, self._total = _machine_ticks()
        self._own = _own_cpu_seconds()
        self._started = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        busy, total = _machine_ticks()
        self.use = CpuUse(wall_seconds=time.perf_counter() - self._started,
                          machine_cpu_seconds=(busy - self._busy) / _TICKS,
                          own_cpu_seconds=_own_cpu_seconds() - self._own,
                          capacity_cpu_seconds=(total - self._total) / _TICKS)


def busy_cores(interval: float = 0.5) -> float:
    """Cores busy (anyone's) over the next `interval` seconds."""
    busy0, _ = _machine_ticks()
    time.sleep(interval)
    busy1, _ = _machine_ticks()
    return (busy1 - busy0) / _TICKS / interval


def wait_for_quiet(max_busy_cores: float = 0.25, settle: float = 1.0, timeout: float = 60.0,
                   log=None) -> float:
    """Wait (at most `timeout` s) until the machine has had fewer than `max_busy_cores` busy for
    `settle` seconds; returns the seconds waited. Gives up silently: the sample is flagged instead."""
    started = time.perf_counter()
    warned = False
    while time.perf_counter() - started < timeout:
        if busy_cores(settle) < max_busy_cores:
            break
        if log and not warned:
            log("  (machine busy with other jobs: waiting for it to quieten)")
            warned = True
    return time.perf_counter() - started
