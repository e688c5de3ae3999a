"""Where this process runs: the environment torchrun describes, and this machine's devices, threads
and memory. The ONLY module that reads torchrun's variables (RANK, WORLD_SIZE, LOCAL_RANK,
LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT, TORCHELASTIC_*). torch is imported where a device is
asked about, so reading the environment costs no torch import (`python -m towerlab` asks it last).
"""

from __future__ import annotations

import os
import platform
from typing import TYPE_CHECKING

from towerlab.checks import env_number
from towerlab.errors import UserError

if TYPE_CHECKING:
    import torch

    from towerlab.config import RunConfig


def _env_int(name: str, default: int, low: int = 0) -> int:
    return env_number(name, default, lambda value: value >= low, f"environment variable {name}={{text}} is not a "
                      f"whole number >= {low}: torchrun sets it; start under torchrun, or unset it")


def torchrun_variables_set() -> bool:
    """Whether RANK and WORLD_SIZE are both set, without judging their values (`under_torchrun`
    does): how a process that has run its job already tells whether it is a torchrun worker."""
    return all(os.environ.get(name, "").strip() for name in ("RANK", "WORLD_SIZE"))


def under_torchrun() -> bool:
    """Whether torchrun started this process (RANK and WORLD_SIZE set). A half-set environment
    (RANK without WORLD_SIZE, no MASTER_ADDR, a rank beyond the world) is refused in one line
    rather than running alone or failing deep inside the rendezvous."""
    present = [name for name in ("RANK", "WORLD_SIZE") if os.environ.get(name, "").strip()]
    if not present:
        return False
    if len(present) == 1:
        missing = "WORLD_SIZE" if present == ["RANK"] else "RANK"
        raise UserError(f"{present[0]} is set but {missing} is not: both come from torchrun; start under "
                        f"torchrun, or unset {present[0]} to run alone")
    rank, world_size = _env_int("RANK", 0), _env_int("WORLD_SIZE", 1, low=1)
    if rank >= world_size:
        raise UserError(f"RANK={rank} is not below WORLD_SIZE={world_size}: start under torchrun, or unset both")
    for name in ("MASTER_ADDR", "MASTER_PORT"):
        if not os.environ.get(name, "").strip():
            raise UserError(f"RANK and WORLD_SIZE are set but {name} is not: start under torchrun (it sets all "
                            "of them), or unset RANK and WORLD_SIZE to run alone")
    if not 0 < _env_int("MASTER_PORT", 0) < 65536:
        raise UserError(f"MASTER_PORT={os.environ['MASTER_PORT']!r} is not a port number (1-65535)")
    if _env_int("LOCAL_RANK", 0) >= _env_int("LOCAL_WORLD_SIZE", world_size, low=1):
        raise UserError("LOCAL_RANK is not below LOCAL_WORLD_SIZE: start under torchrun, or unset them")
    _env_int("TORCHELASTIC_RESTART_COUNT", 0)
    return True


def torchrun_world_size() -> int:
    return _env_int("WORLD_SIZE", 1, low=1)


def torchrun_ranks() -> tuple[int, int, int]:
    """(rank, local rank, world size) as torchrun set them; only under torchrun (`under_torchrun`)."""
    return _env_int("RANK", 0), _env_int("LOCAL_RANK", 0), torchrun_world_size()


def torchrun_restart() -> tuple[str | None, int]:
    """(the torchrun job's run id, how many times torchrun restarted this worker group); (None, 0)
    outside torchrun. The run id stays the same across the restarts of one `torchrun` command
    (`--standalone` makes a fresh one per command), so it tells "my own earlier attempt" apart from
    an older run that happens to use the same output folder."""
    if not under_torchrun():
        return None, 0
    return os.environ.get("TORCHELASTIC_RUN_ID"), _env_int("TORCHELASTIC_RESTART_COUNT", 0)


def device_type(device: str = "auto") -> str:
    """The device kind a run with `--device` `device` uses: "cuda" or "cpu"."""
    if device == "cpu":
        return "cpu"
    import torch

    if device == "cuda" and not torch.cuda.is_available():
        raise UserError("--device cuda, but CUDA is not available here (no GPU, or a CPU-only build of "
                        "torch): use --device cpu or auto")
    return "cuda" if torch.cuda.is_available() else "cpu"


def resolve_devices(devices: int | None, device: str = "auto") -> int:
    """How many local replicas `--devices` asks for on this machine: every GPU, or two CPU processes
    (one on a one-core machine) when it is None; more GPUs than present is a user error."""
    kind = device_type(device)
    if kind == "cuda":
        import torch

        present = torch.cuda.device_count()
        if devices is not None and devices > present:
            raise UserError(f"--devices {devices} asks for more GPUs than the {present} present: use "
                            f"--devices {present} or fewer, or --device cpu for {devices} CPU processes")
        return present if devices is None else devices
    return min(2, os.cpu_count() or 1) if devices is None else devices


def default_threads(processes: int) -> int:
    return max(1, (os.cpu_count() or 1) // max(1, processes))


def search_workers(devices: int | None, device: str = "auto") -> int:
    """How many local workers `--devices` gives a search: as for training on GPUs; on a CPU, one per
    core (each trains its candidates on `search_threads`' one thread), as many as memory holds."""
    if devices is not None or device_type(device) == "cuda":
        return resolve_devices(devices, device)
    return max(1, min(os.cpu_count() or 1, machine_memory() // PROCESS_BYTES))


def search_threads(threads: int | None, device: str, workers: int) -> int:
    """CPU threads per search worker. On a CPU, `--threads` or 1: never the cores shared out among
    the workers, because a float sum's order follows the thread count, so a candidate trained on 2
    threads need not score what it scores on 1 (measured: 0.9716 against 0.9706 after one MNIST
    epoch), and a search's history would then depend on how many workers ran it. On a GPU the
    threads only feed the device: cores / workers, as for training."""
    if threads is not None:
        return threads
    return 1 if device_type(device) == "cpu" else default_threads(workers)


def cpu_capability() -> str:
    """The CPU kernels torch runs here (AVX512, AVX2, DEFAULT, ...; $ATEN_CPU_CAPABILITY lowers them), whose
    sums round otherwise: `ATEN_CPU_CAPABILITY=default` changes a loss's last digits."""
    import torch

    return str(torch.backends.cpu.get_cpu_capability())


def device_name(device: torch.device) -> str:
    """The device's model (the GPU's name; the CPU's, from /proc/cpuinfo where there is one), which
    picks the kernels and so, in the last bits, the results."""
    if device.type == "cuda":
        import torch

        return torch.cuda.get_device_name(device)
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as stream:
            name = next((line.split(":", 1)[1].strip() for line in stream if line.startswith("model name")), "")
    except OSError:
        name = ""
    return name or platform.processor() or platform.machine()


OVERSUBSCRIPTION = 8  # busy threads per core beyond which each one only slows the others down
PROCESS_BYTES = 2**29  # what one process holds at least: torch itself (~220 MiB), its data, a model


def machine_memory() -> int:
    """Bytes of physical memory on this machine."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def check_capacity(processes: int, threads: int, what: str) -> None:
    """Refuse to start more local processes, or threads, than this machine can hold (a few per core,
    and the memory each process needs at least), in one line, before anything starts. `what` names
    the flags that asked for the processes."""
    cores = os.cpu_count() or 1
    memory = machine_memory()
    most = max(1, min(OVERSUBSCRIPTION * cores, memory // PROCESS_BYTES))
    if processes > most:
        raise UserError(f"{what} asks for {processes} processes on this machine, which holds at most {most} "
                        f"({cores} cores, {memory / 2**30:.0f} GiB of memory): ask for {most} or fewer")
    if processes * threads > OVERSUBSCRIPTION * cores:
        raise UserError(f"--threads {threads} in each of {processes} process(es) makes {processes * threads} threads "
                        f"on {cores} cores: at most {OVERSUBSCRIPTION * cores} in all can make progress; use fewer")


def sharing_cores(processes: int, device: str, what: str) -> str | None:
    """The warning for CPU processes that outnumber the cores (None where they do not): legal (the
    numbers do not depend on it), but the processes take turns on the cores."""
    cores = os.cpu_count() or 1
    if device != "cpu" or processes <= cores:
        return None
    return (f"towerlab: warning: {what} starts {processes} CPU processes on this machine's {cores} core(s): they "
            f"take turns on them, so a step is slower than on {cores} process(es) with a larger --batch-size for "
            "the same global batch")


def local_processes(run: RunConfig) -> int:
    """Processes of this job on this machine: torchrun says so, otherwise --devices."""
    if under_torchrun():
        return _env_int("LOCAL_WORLD_SIZE", 1, low=1)
    return resolve_devices(run.devices, run.device)
