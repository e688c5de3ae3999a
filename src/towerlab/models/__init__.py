"""The networks, one file per family (seeds.py, mlp.py, cnn.py, whitenet.py), and
`build_model(name, input_shape, num_classes, **options)`, which builds an entry of the model catalog
(`towerlab.catalog.models`). No training code here.
"""

from __future__ import annotations

from typing import Any

from towerlab.catalog.models import entry, not_taken
from towerlab.errors import UserError


def build_model(name: str, input_shape: tuple[int, int, int], num_classes: int = 10, **options: Any) -> Any:
    """A freshly initialised model. Unknown names and options are user errors."""
    model = entry(name)
    unknown = sorted(not_taken(model.builder, options))
    if unknown:
        allowed = ", ".join(model.options or ()) or "none"
        raise UserError(f"model {name} has no option {', '.join(unknown)} (its options: {allowed})")
    return model.builder(tuple(input_shape), num_classes, **options)
