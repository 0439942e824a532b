"""Optimizers: 8-bit AdamW/Lion with block-quantized state (Triton kernels on GPUs, pure torch elsewhere)."""

from toolkit.optim.bnb_compat import convert_bnb_state_dict
from toolkit.optim.build import OPTIMIZER_NAMES, OptimizerSpec, build_optimizer, optimizer_spec
from toolkit.optim.eight_bit import AdamW8bit, Lion8bit
from toolkit.optim.lion import Lion

__all__ = ["AdamW8bit", "Lion", "Lion8bit", "OPTIMIZER_NAMES", "OptimizerSpec", "build_optimizer",
           "convert_bnb_state_dict", "optimizer_spec"]
