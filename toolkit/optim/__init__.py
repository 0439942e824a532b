"""Optimizers: 8-bit AdamW/Lion with block-quantized state (Triton kernels on GPUs, pure torch elsewhere).

The names are imported when first used (PEP 562): `toolkit.optim.specs`, which config validation reads, must not
pull torch in through this package.
"""

from importlib import import_module

_WHERE = {"convert_bnb_state_dict": "bnb_compat", "build_optimizer": "build", "AdamW8bit": "eight_bit",
          "Lion8bit": "eight_bit", "Lion": "lion", "OPTIMIZER_NAMES": "specs", "OptimizerSpec": "specs",
          "optimizer_spec": "specs"}

__all__ = sorted(_WHERE)


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module 'toolkit.optim' has no attribute {name!r}")
    value = getattr(import_module(f"toolkit.optim.{_WHERE[name]}"), name)
    globals()[name] = value
    return value
