"""A preset as `towerlab train` flags, until the CLI has `--preset NAME` (see bench/README.md)."""

from __future__ import annotations

from measure import flags
from towerlab.presets import apply_preset, run_options


def preset_options(name: str, device: str = "cpu", **overrides: object) -> dict:
    """The preset's TrainConfig and RunConfig fields on `device`, with `overrides` on top (None
    drops a field)."""
    options = {**apply_preset(name, device), **run_options(name, device), **overrides}
    return {k: v for k, v in options.items() if v is not None}


def preset_flags(name: str, device: str = "cpu", **overrides: object) -> list[str]:
    return flags(preset_options(name, device, **overrides))
