"""A preset as `towerlab train` flags: `--preset NAME` plus the benchmark's own overrides."""

from __future__ import annotations

from measure import flags


def preset_flags(name: str, **overrides: object) -> list[str]:
    """towerlab resolves the preset for the device type it finds; flags typed here win over it."""
    return ["--preset", name, *flags(overrides)]
