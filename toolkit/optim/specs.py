"""The optimizer registry's facts, one OptimizerSpec per exact name: what train.optimizer_args may pass, whether the
state is light, eval mode, what the step reads. Free of torch, so that config validation (and its errors) stay fast;
build.py builds each.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass

from toolkit.errors import UserError

# Settings with their own train.* key; optimizer_args must not set them a second way.
_OWN_SETTINGS = {"lr": "train.lr", "betas": "train.betas", "eps": "train.eps", "weight_decay": "train.weight_decay"}


@dataclass(frozen=True)
class OptimizerSpec:
    accepts: frozenset[str]     # the keyword arguments train.optimizer_args may pass
    memory_light: bool          # state well under fp32 AdamW's two moments (suggested when memory runs out)
    needs_eval_mode: bool       # optimizer.eval() around eval, sampling and saving, train() after (schedule-free)
    description: str
    per_tensor: bool = True     # each tensor's step reads only its own gradient and state (device.shard_optimizer
                                # can give each process a share of the tensors); Prodigy's step size reads them all


_REGISTRY: dict[str, OptimizerSpec] = {
    "adamw": OptimizerSpec(frozenset({"amsgrad", "maximize"}), memory_light=False, needs_eval_mode=False,
                           description="torch AdamW with fp32 state, fused on the GPU"),
    "adamw8bit": OptimizerSpec(frozenset(), memory_light=True,
                               needs_eval_mode=False,
                               description="AdamW with 8-bit block-quantized state, the toolkit's or bitsandbytes'"),
    "lion8bit": OptimizerSpec(frozenset(), memory_light=True,
                              needs_eval_mode=False,
                              description="Lion with 8-bit block-quantized state, the toolkit's or bitsandbytes'"),
    "lion": OptimizerSpec(frozenset(), memory_light=False, needs_eval_mode=False,
                          description="Lion with one fp32 state tensor"),
    "adafactor": OptimizerSpec(frozenset({"clip_threshold", "decay_rate", "beta1", "scale_parameter"}),
                               memory_light=True, needs_eval_mode=False,
                               description="transformers Adafactor, factored second moments, fixed lr"),
    "prodigy": OptimizerSpec(frozenset({"beta3", "decouple", "use_bias_correction", "safeguard_warmup",
                                                  "d0", "d_coef", "growth_rate"}),
                             memory_light=False, needs_eval_mode=False, per_tensor=False,
                             description="prodigyopt Prodigy, which estimates the step size: lr 1.0 is usual, needs pip install prodigyopt"),
}
OPTIMIZER_NAMES: tuple[str, ...] = tuple(_REGISTRY)


def optimizer_spec(name: str) -> OptimizerSpec:
    """The spec registered under exactly `name`; an unknown name lists the valid ones."""
    if name not in _REGISTRY:
        close = difflib.get_close_matches(name, OPTIMIZER_NAMES, n=1)
        hint = f"; did you mean '{close[0]}'?" if close else ""
        raise UserError(f"unknown optimizer {name!r}; valid: {', '.join(OPTIMIZER_NAMES)}{hint}")
    return _REGISTRY[name]


def optimizer_args_problem(name: str, key: str) -> str | None:
    """Why optimizer `name` cannot take keyword argument `key` from train.optimizer_args (None: it can)."""
    spec = optimizer_spec(name)
    if key in spec.accepts:
        return None
    if key in _OWN_SETTINGS:
        return f"{name} takes {key} from {_OWN_SETTINGS[key]}, not from optimizer_args"
    if not spec.accepts:
        return f"{name} accepts no optimizer_args"
    close = difflib.get_close_matches(key, sorted(spec.accepts), n=1)
    hint = f"; did you mean '{close[0]}'?" if close else ""
    return f"{name} does not accept '{key}'; it accepts: {', '.join(sorted(spec.accepts))}{hint}"
