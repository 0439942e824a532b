"""Schema fields: a default with its documentation, allowed values, bounds and resume safety as metadata."""

from __future__ import annotations

import copy
from dataclasses import field
from typing import Any


def opt(default: Any, doc: str, choices: tuple | None = None, minimum: float | None = None,
        maximum: float | None = None, resume_safe: bool = False, path: str | None = None) -> Any:
    """A schema field with its documentation and optional allowed values / lower and upper bounds (inclusive).

    resume_safe: a resumed run may change it, because it alters cadence, output or where the run goes, not
    what it learns; any other change between a checkpoint's config and the current one refuses the resume.
    path: "local" or "existing", a file or folder made absolute where the config is read (config/local_paths.py)."""
    meta: dict[str, Any] = {"doc": doc}
    if choices is not None:
        meta["choices"] = tuple(choices)
    if minimum is not None:
        meta["min"] = minimum
    if maximum is not None:
        meta["max"] = maximum
    if resume_safe:
        meta["resume_safe"] = True
    if path is not None:
        meta["path"] = path
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: copy.deepcopy(default), metadata=meta)
    return field(default=default, metadata=meta)
