"""Schema fields: a default with its documentation, allowed values and lower bound as metadata."""

from __future__ import annotations

import copy
from dataclasses import field
from typing import Any


def opt(default: Any, doc: str, choices: tuple | None = None, minimum: float | None = None) -> Any:
    """A schema field with its documentation and optional allowed values / lower bound."""
    meta = {"doc": doc}
    if choices is not None:
        meta["choices"] = tuple(choices)
    if minimum is not None:
        meta["min"] = minimum
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: copy.deepcopy(default), metadata=meta)
    return field(default=default, metadata=meta)
