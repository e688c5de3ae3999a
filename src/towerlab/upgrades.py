"""Settings added since a job was recorded: what a record written before them ran with, so that a stored
search (a store's row, a config.json) is read in today's fields and resumes and replays as it ran.
Standard library only, like config.py."""

from __future__ import annotations

# What a search recorded before samplers existed ran with: no re-measuring, budget or pruning.
_BEFORE_SAMPLERS = {"remeasure": 0, "max_evaluations": None, "min_epochs": None, "prune_factor": 3}

# Settings added since, with the value every search recorded before them ran with: towerlab's own training
# (no objective of yours) and no budget in epochs.
_ADDED_SINCE = {"prune_places": "all", "image_size": None, "test_size": None, "objective": None, "trial_command": None,
                "metric": None, "direction": None, "trial_timeout": None, "budget_epochs": None}
# A sampler's own settings added since, with the value its searches recorded before them ran with.
_SAMPLER_ADDED_SINCE = {"tpe": {"overlap": False}}


def upgrade_search_config(data: dict, kind: str) -> dict:
    """A search's stored settings (a store's row, a config.json) in today's fields. One written before
    samplers existed gets the sampler its `kind` meant (evolve: ga, grid: grid); every one gets the
    settings it ran with where it lacks them, so that it resumes and replays as it ran."""
    if "sampler" not in data:
        data = {**_BEFORE_SAMPLERS, **data, "sampler": "ga" if kind == "evolve" else kind}
    return {**_ADDED_SINCE, **_SAMPLER_ADDED_SINCE.get(str(data.get("sampler")), {}), **data}


def upgrade_search_setup(setup: object, config: dict) -> object:
    """A search's stored setup (how its workers train) in today's keys: one of your own objective recorded
    before its setup said what names it ("spec") was named by its --objective or --command."""
    if isinstance(setup, dict) and isinstance(setup.get("objective"), dict) and "spec" not in setup:
        return {**setup, "spec": config.get("objective") or config.get("trial_command") or ""}
    return setup
