"""Model families behind one adapter contract (base.py), looked up in the family table (config/families.py)."""

from __future__ import annotations

import importlib

from omegaconf import DictConfig

from toolkit.config.families import family_spec
from toolkit.models.base import ModelAdapter, Runtime


def adapter_class(family: str) -> type[ModelAdapter]:
    """The family's adapter class, imported on use so an LLM run never imports diffusers."""
    module_name, class_name = family_spec(family).adapter.split(":")
    return getattr(importlib.import_module(module_name), class_name)


def build_adapter(cfg: DictConfig, runtime: Runtime) -> ModelAdapter:
    """The adapter of the run's family (`cfg`: the run's settings)."""
    return adapter_class(cfg.model.family)(cfg, runtime)
