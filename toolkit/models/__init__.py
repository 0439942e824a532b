"""Model families behind one adapter interface, looked up by exact name."""

from __future__ import annotations

import importlib

from omegaconf import DictConfig

from toolkit.errors import UserError
from toolkit.models.base import ModelAdapter, Runtime

# family -> "module:class", imported on use so an LLM run never imports diffusers.
ADAPTERS: dict[str, str] = {
    "llm": "toolkit.models.llm:LLMAdapter",
    "sd": "toolkit.models.diffusion_sd:StableDiffusionAdapter",
    "sdxl": "toolkit.models.diffusion_sd:StableDiffusionXLAdapter",
    "flux": "toolkit.models.diffusion_flow:FluxAdapter",
    "sd3": "toolkit.models.diffusion_flow:SD3Adapter",
    "wan21": "toolkit.models.diffusion_wan:WanAdapter",
    "wan22": "toolkit.models.diffusion_wan:Wan22Adapter",
}


def build_adapter(cfg: DictConfig, runtime: Runtime) -> ModelAdapter:
    family = cfg.model.family
    if family not in ADAPTERS:
        raise UserError(f"model.family '{family}' is not available in this version of the toolkit; "
                        f"available: {', '.join(ADAPTERS)}")
    module_name, class_name = ADAPTERS[family].split(":")
    adapter_cls = getattr(importlib.import_module(module_name), class_name)
    return adapter_cls(cfg, runtime)
