"""Files a user did not necessarily write with this toolkit (a run folder someone shared or downloaded, a LoRA from
the Hub): read without running any code they hold.

A checkpoint's states (optimizer.pt, trainer_state.pt, adapter_state.pt) are unpickled with
torch.load(weights_only=True), which builds tensors, numbers, strings, None and lists, tuples and dicts of them, and
nothing else. The toolkit writes nothing else (the numpy RNG state is stored as a tensor and numbers,
rng.py); the one other type older checkpoints hold, numpy's own RNG state (a uint32 array), is allowed by
name. A file that needs anything more, which is what a pickle that runs code looks like, is refused with a
UserError naming the file and what it asked for. The libraries that read a pickled LoRA file (a .bin given to
network.init_from, read by diffusers or PEFT) load it the same way; `pickle_refusal` finds their refusal, which the
LoRA loader names (models/lora_loading.py). `sample` and `merge` read only .safetensors LoRA files.
"""

from __future__ import annotations

import pickle
import re
import warnings
from pathlib import Path

import numpy as np
import torch

from toolkit.errors import UserError

# numpy.random.get_state()'s uint32 array, as checkpoints written before the RNG state was stored without numpy hold
# it: the array's rebuild function (numpy._core.multiarray._reconstruct, or numpy.core's before numpy 2), its class,
# and its dtype (numpy.dtype and, from numpy 1.25, the dtype's own class). Nothing in these runs code.
LEGACY_NUMPY_RNG = [np.empty(0).__reduce__()[0], np.ndarray, np.dtype, type(np.dtype(np.uint32))]


PICKLED_LORA_FIX = "use LoRA files in .safetensors (or .bin files that hold only tensors) from a source you trust"


def _asked_for(err: Exception) -> str:
    """What a refused pickle asked for, from torch's message: the global it names, else its first line."""
    found = re.search(r"Unsupported global: GLOBAL (\S+)", str(err))
    if found:
        return f"a reference to {found.group(1)}"
    found = re.search(r"WeightsUnpickler error: \s*(.+?)\s*(?:\n|$)", str(err))
    return f"pickle code outside plain data ({found.group(1)})" if found else "pickle code outside plain data"


def refused(label: str, err: Exception, fix: str) -> UserError:
    return UserError(f"{label}: refused to load it: it holds {_asked_for(err)}, which no file written by this toolkit "
                     f"holds, and unpickling it could run code\n  fix: {fix}")


def load_state(path: Path, fix: str) -> object:
    """A checkpoint's .pt state, on the CPU, unpickled without running code (see the module's docstring); a file
    that holds anything else is a UserError naming it, with `fix`."""
    try:
        with warnings.catch_warnings(), torch.serialization.safe_globals(LEGACY_NUMPY_RNG):
            warnings.simplefilter("ignore")  # "Detected pickle protocol 4": said by the refusal, if it is one
            return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        raise refused(str(path), err, fix) from None


def pickle_refusal(err: BaseException) -> pickle.UnpicklingError | None:
    """The weights-only refusal behind `err`, if any (diffusers raises its own OSError while handling it)."""
    seen: set[int] = set()
    while err is not None and id(err) not in seen:
        if isinstance(err, pickle.UnpicklingError):
            return err
        seen.add(id(err))
        err = err.__cause__ or err.__context__
    return None
