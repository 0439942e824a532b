"""Model families behind one adapter contract (base.py), looked up in the family table (config/families.py)."""

from __future__ import annotations

import importlib

from omegaconf import DictConfig

from toolkit.config.families import family_spec
from toolkit.models.base import ModelAdapter, Runtime


def build_adapter(cfg: DictConfig, runtime: Runtime) -> ModelAdapter:
    """The family's adapter, imported on use so an LLM run never imports diffusers."""
    module_name, class_name = family_spec(cfg.model.family).adapter.split(":")
    adapter_cls = getattr(importlib.import_module(module_name), class_name)
    return adapter_cls(cfg, runtime)
