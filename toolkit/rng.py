"""Capturing and restoring every RNG a training step touches, so a resumed run continues exactly."""

from __future__ import annotations

import random
from contextlib import contextmanager
from typing import Iterator

import numpy as np
import torch


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)  # also seeds every CUDA/HIP device


def _numpy_state() -> dict:
    """numpy's global RNG state as tensors and numbers, which a checkpoint loads without unpickling numpy types
    (toolkit/untrusted.py)."""
    kind, keys, pos, has_gauss, cached_gaussian = np.random.get_state()
    return {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
            "has_gauss": int(has_gauss), "cached_gaussian": float(cached_gaussian)}


def _set_numpy_state(state: dict | tuple) -> None:
    if isinstance(state, dict):
        state = (state["kind"], state["keys"].numpy().astype(np.uint32), state["pos"], state["has_gauss"],
                 state["cached_gaussian"])
    np.random.set_state(state)  # a tuple: numpy's own, as older checkpoints hold it


def rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": _numpy_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["device"] = torch.cuda.get_rng_state_all()
    return state


def step_rng_state() -> dict:
    """The streams a training step draws from (torch's, on the CPU and the current GPU), cheap enough to take at
    every step (the whole rng_state, numpy's above all, is not): with it a step that failed part-way is undone."""
    state = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["device_index"] = torch.cuda.current_device()
        state["device_state"] = torch.cuda.get_rng_state(state["device_index"])
    return state


def with_step_rng(state: dict, step_state: dict) -> dict:
    """`state` (an rng_state()) with the streams of `step_state` (a step_rng_state()) put back."""
    state = {**state, "torch": step_state["torch"]}
    if "device_state" in step_state and "device" in state:
        state["device"] = list(state["device"])
        state["device"][step_state["device_index"]] = step_state["device_state"]
    return state


def restore_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    _set_numpy_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "device" in state and torch.cuda.is_available() and len(state["device"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(state["device"])


@contextmanager
def rng_untouched() -> Iterator[None]:
    """Every RNG stream as it was before the block, whatever the block drew (a measurement, data preparation)."""
    state = rng_state()
    try:
        yield
    finally:
        restore_rng_state(state)
