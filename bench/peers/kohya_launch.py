"""Runs one kohya sd-scripts script with its fixed Flux.1 shapes set to those of the pipeline the bench wrote
(bench/peers/kohya_files.py's write_flux_pipeline), in the peer's own process:

    python bench/peers/kohya_launch.py SHAPES.json SCRIPT.py [script arguments...]

kohya builds Flux.1 from flux_models.configs["dev"] (3072 wide: only the block counts come from the file), the
AutoEncoder from the same spec's ae_params with GroupNorms of 32 groups, and CLIP-L and T5-XXL from config literals
in flux_utils.load_clip_l / load_t5xxl; it has no option to read another shape. The loss parity trains the bench's
tiny pipeline, so these are set to the pipeline's: the Flux params, the AE params and its group count, and each text
encoder's config (the pipeline's config.json, read by kohya's transformers 4). Nothing else changes: kohya's loaders
read the files (and log what they left out, which kohya.py checks), and the script runs as `python SCRIPT.py ...`."""

from __future__ import annotations

import json
import runpy
import sys
import types
from dataclasses import replace

import torch


def torch_nn_with_groups(groups: int) -> types.ModuleType:
    """torch.nn as flux_models sees it, but for GroupNorm, which has `groups` groups whatever kohya asks for."""

    class GroupNorm(torch.nn.GroupNorm):
        def __init__(self, num_groups: int, num_channels: int, eps: float = 1e-5, affine: bool = True, **kwargs):
            super().__init__(groups, num_channels, eps=eps, affine=affine, **kwargs)

    nn = types.ModuleType("torch.nn")
    nn.__getattr__ = lambda name: getattr(torch.nn, name)  # PEP 562: everything else is torch.nn's
    nn.GroupNorm = GroupNorm
    return nn


def configure(shapes: dict) -> None:
    from library import flux_models, flux_utils
    from transformers import CLIPTextConfig, T5Config

    spec = flux_models.configs["dev"]
    flux_models.configs["dev"] = replace(spec, params=replace(spec.params, **shapes["flux"]),
                                         ae_params=replace(spec.ae_params, **shapes["ae"]))
    flux_models.nn = torch_nn_with_groups(shapes["ae_groups"])
    # load_clip_l builds CLIPTextModel._from_config(CLIPConfig(**its literal)), load_t5xxl T5EncoderModel from
    # T5Config(**its literal): both names answer with the pipeline's config instead
    flux_utils.CLIPConfig = lambda **_: CLIPTextConfig.from_dict(shapes["clip_l"])
    flux_utils.T5Config = lambda **_: T5Config.from_dict(shapes["t5xxl"])


def main() -> None:
    shapes_file, script, *args = sys.argv[1:]
    with open(shapes_file) as handle:
        configure(json.load(handle))
    sys.argv = [script, *args]
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
