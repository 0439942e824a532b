"""bitsandbytes interoperability: state dict conversion and the one-step self-check used by `auto`.

The 8-bit optimizers (eight_bit.py) import the conversion; the self-check compares bitsandbytes with the
reference math (reference.py) the optimizers run, so this module never imports eight_bit.py.

A bitsandbytes 8-bit optimizer keeps, per parameter, `step`, `state1`/`state2` (uint8 codes, or fp32 for
tensors under 4096 elements), `absmax1`/`absmax2` and the maps `qmap1`/`qmap2`; since 0.49.2 its
`state_dict()` nests the tensors under `__bnb_optimizer_quant_state__`. The toolkit uses the same keys,
block size and maps, so conversion drops the (verified) maps and unwraps the nesting: it is lossless.
"""

from __future__ import annotations

import torch

from toolkit.errors import UserError
from toolkit.optim import reference
from toolkit.optim.quant import create_dynamic_map, dequantize_blockwise, num_blocks

BNB_NESTED_KEY = "__bnb_optimizer_quant_state__"
_BNB_ONLY_GROUP_KEYS = {"alpha": 0.0, "t_alpha": None, "t_beta3": None}  # AdEMAMix settings, inert for AdamW
_TOOLKIT_STATE_KEYS = {"step", "state1", "state2", "absmax1", "absmax2"}


def is_bnb_state_dict(state_dict: dict) -> bool:
    """True when any parameter state carries bitsandbytes' maps or its nested quantization state."""
    return any(isinstance(s, dict) and (BNB_NESTED_KEY in s or "qmap1" in s) for s in state_dict["state"].values())


def convert_bnb_state_dict(state_dict: dict) -> dict:
    """A bitsandbytes AdamW8bit/Lion8bit state dict (flat or nested) as a toolkit AdamW8bit/Lion8bit one."""
    maps = {"qmap1": create_dynamic_map(signed=True), "qmap2": create_dynamic_map(signed=False)}
    state = {}
    for param_id, saved in state_dict["state"].items():
        saved = dict(saved)
        saved.update(saved.pop(BNB_NESTED_KEY, {}))
        for key, expected in maps.items():
            if key in saved and not torch.equal(saved.pop(key).cpu().float(), expected):
                raise UserError(f"bitsandbytes state of parameter {param_id} uses a custom {key}; only the default "
                                "dynamic maps convert to the toolkit's 8-bit optimizers")
        unknown = sorted(set(saved) - _TOOLKIT_STATE_KEYS)
        if unknown:
            raise UserError(f"bitsandbytes state of parameter {param_id} has {unknown}, which the toolkit's 8-bit "
                            "optimizers do not support (max_unorm, AdEMAMix and paged extras cannot be converted)")
        saved["step"] = int(saved["step"])
        state[param_id] = saved
    groups = []
    for group in state_dict["param_groups"]:
        group = dict(group)
        for key, inert in _BNB_ONLY_GROUP_KEYS.items():
            if key in group and group.pop(key) != inert:
                raise UserError(f"bitsandbytes parameter group sets {key}; that is AdEMAMix, not AdamW or Lion")
        groups.append(group)
    return {"state": state, "param_groups": groups}


def bnb_self_check(name: str, device: torch.device) -> tuple[bool, str]:
    """Step bitsandbytes' `name` optimizer once on a tiny tensor and compare with the toolkit's reference.

    The first step's parameter update does not depend on quantization, so it must agree closely; the
    requantized moments must agree within a few codes (quantizers may round a value to either neighbour).
    Returns (passed, why). A failure to import or run bitsandbytes counts as a failed check.
    """
    try:
        import bitsandbytes as bnb
    except Exception as exc:  # a broken install raises more than ImportError
        return False, f"bitsandbytes does not import ({type(exc).__name__}: {exc})"

    # The reference update is what the toolkit's AdamW8bit/Lion8bit step with impl="torch". Betas and eps
    # are both libraries' defaults, passed to both explicitly.
    bnb_class, update, moments, betas, eps = {
        "adamw8bit": (bnb.optim.AdamW8bit, reference.adamw_8bit_update_, 2, (0.9, 0.999), {"eps": 1e-8}),
        "lion8bit": (bnb.optim.Lion8bit, reference.lion_8bit_update_, 1, (0.9, 0.99), {}),
    }[name]
    gen = torch.Generator().manual_seed(0)
    start, grad = torch.randn(64, 128, generator=gen), torch.randn(64, 128, generator=gen)
    params = [start.clone().to(device), torch.nn.Parameter(start.clone().to(device))]
    ours = {"step": 1}  # a fresh 8-bit state (zero moments), as the optimizers' first step sees it
    for i in range(1, moments + 1):
        ours[f"state{i}"] = torch.zeros_like(params[0], dtype=torch.uint8)
        ours[f"absmax{i}"] = torch.zeros(num_blocks(start.numel()), dtype=torch.float32, device=device)
    update(params[0], grad.to(device), ours, lr=1e-2, beta1=betas[0], beta2=betas[1], weight_decay=0.01, **eps)
    optimizer = bnb_class([params[1]], lr=1e-2, betas=betas, weight_decay=0.01, **eps)
    try:
        params[1].grad = grad.to(device)
        optimizer.step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    except Exception as exc:
        return False, f"bitsandbytes {name} failed a test step on {device.type} ({type(exc).__name__}: {exc})"
    param_error = (params[0] - params[1]).abs().max().item()
    if not param_error <= 1e-5:  # the step moves params by ~1e-2
        return False, f"bitsandbytes {name} disagrees with the reference after one step (max |dp| = {param_error:.1e})"
    theirs = optimizer.state[params[1]]
    for i in range(1, moments + 1):
        ours_i, theirs_i = (dequantize_blockwise(s[f"state{i}"], s[f"absmax{i}"].to(device), signed=i == 1)
                            for s in (ours, theirs))
        scale = ours_i.abs().max().item()
        error = (ours_i - theirs_i).abs()
        if not (error.max().item() <= 0.03 * scale and error.mean().item() <= 1e-3 * scale):
            return False, (f"bitsandbytes {name} state{i} disagrees with the reference after one step "
                           f"(max error {error.max().item() / scale:.1%} of absmax)")
    return True, f"bitsandbytes {name} passed the self-check (max |dp| = {param_error:.1e})"
