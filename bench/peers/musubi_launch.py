"""Runs one musubi-tuner script (its caching scripts, its trainer) with musubi's fixed model configurations set to the
shapes of the files the bench wrote (bench/peers/musubi_files.py), in the peer's own process:

    python bench/peers/musubi_launch.py SHAPES.json SCRIPT.py [script arguments...]

musubi builds the Wan DiT from wan/configs (t2v-1.3B: 30 blocks of 1536; t2v-A14B: 40 of 5120), the VAE from
wan/modules/vae.py's _video_vae (96 wide) and the text encoder from wan/modules/t5.py's umt5_xxl (24 layers of 4096);
it has no option to read another shape. Qwen-Image likewise: its DiT (60 blocks), VAE (96 wide) and Qwen2.5-VL-7B
text encoder are literals in qwen_image/. The real-shaped bench DiT matches its configuration already (the values set
are the same); the bench's VAE and text encoder are narrow stand-ins, as in the toolkit's rows, and run only while
caching. Nothing else in musubi changes: the script then runs as `python SCRIPT.py ...` would.

On a machine without CUDA (the bench's --tiny check on a CPU) torch.cuda.current_device() answers 0: musubi's T5
module calls it for a default argument when imported."""

from __future__ import annotations

import functools
import json
import runpy
import sys

import torch


def configure(shapes: dict) -> None:
    if shapes["family"] == "qwen_image":
        configure_qwen_image(shapes)
        return
    from musubi_tuner.wan import configs
    from musubi_tuner.wan.modules import t5, vae

    for config in configs.WAN_CONFIGS.values():
        if config.in_dim == shapes["dit"]["in_dim"]:  # text-to-video configurations (16 channels in)
            config.update(shapes["dit"])
    vae._video_vae = functools.partial(vae._video_vae, **{k: v for k, v in shapes["vae"].items()})
    t5_shape = dict(shapes["t5"])
    max_dist = t5_shape.pop("max_dist")
    t5.T5RelativeEmbedding.__init__.__defaults__ = (max_dist,)
    t5.umt5_xxl = lambda **kwargs: t5._t5("umt5-xxl", **{**t5_shape, "shared_pos": False, "dropout": 0.0, **kwargs})


def configure_qwen_image(shapes: dict) -> None:
    """Qwen-Image: the DiT (qwen_image_model.create_model: 60 blocks of 24 x 128), the VAE and Qwen2.5-VL-7B
    (qwen_image_utils: a config literal each) built in the files' shapes."""
    from musubi_tuner.qwen_image import qwen_image_model, qwen_image_utils

    qwen_image_model.QwenImageTransformer2DModel = shaped(qwen_image_model.QwenImageTransformer2DModel, shapes["dit"])
    qwen_image_utils.AutoencoderKLQwenImage = shaped(qwen_image_utils.AutoencoderKLQwenImage, shapes["vae"])
    config_class = qwen_image_utils.Qwen2_5_VLConfig
    text, vision = shapes["text"], shapes["vision"]
    tokens = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")

    def vl_config(**config):
        for part in (config, config.setdefault("text_config", {})):
            part.update({k: v for k, v in text.items() if k != "mrope_section" and k not in tokens})
            part["rope_scaling"] = {**part.get("rope_scaling", {}), "mrope_section": text["mrope_section"]}
            part["layer_types"] = ["full_attention"] * text["num_hidden_layers"]
            part["max_window_layers"] = text["num_hidden_layers"]
        config.update({k: text[k] for k in tokens})
        config["vision_config"] = {**config.get("vision_config", {}), **vision}
        return config_class(**config)

    qwen_image_utils.Qwen2_5_VLConfig = vl_config


def shaped(cls, shape: dict):
    """`cls` built with `shape` over whatever arguments musubi passes (same name, so its class-name checks hold)."""
    return type(cls.__name__, (cls,), {"__init__": lambda self, *a, **kw: cls.__init__(self, *a, **{**kw, **shape})})


def main() -> None:
    shapes_file, script, *args = sys.argv[1:]
    if not torch.cuda.is_available():
        torch.cuda.current_device = lambda: 0
    with open(shapes_file) as handle:
        configure(json.load(handle))
    sys.argv = [script, *args]
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
