"""YAML-driven LoRA training toolkit for diffusion models and LLMs, with first-class AMD support."""

__version__ = "0.1.0"
