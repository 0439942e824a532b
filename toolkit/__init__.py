"""YAML-driven LoRA training toolkit for diffusion models and LLMs, with first-class AMD support."""

import time

__version__ = "0.1.0"
STARTED = time.time()  # when the toolkit was first imported: about when its process started (the first-step log)
