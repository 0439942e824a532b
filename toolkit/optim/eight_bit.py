"""8-bit AdamW and Lion with block-wise dynamic quantization of the optimizer state.

State per parameter (plain tensors, bitsandbytes' key names): "step", "state1" (first moment),
"state2" (AdamW's second moment), "absmax1"/"absmax2" (fp32, one per 256-block). Parameters of at
least 4096 elements keep uint8 moments (about 2.03 bytes of state per parameter for AdamW); smaller
ones keep fp32 moments, as in bitsandbytes. "step" is a 0-dim int64 tensor on the parameter's device
while training (as torch's fused AdamW keeps its step counts) and an int in state_dict(), as bitsandbytes
and earlier checkpoints have it.

The implementation is picked per device at the first step: the fused Triton kernels for parameters on
a GPU (CUDA or ROCm) when triton imports, else the pure-torch reference (CPU and any device).

Like torch's fused AdamW, step() takes GradScaler's `found_inf` and `grad_scale` (`_step_supports_amp_scaling`):
with `found_inf` set to anything but 0 the step changes nothing (parameters, moments, absmax, step count), and
decides so on the device, so the trainer (train/step.py) launches each step without reading its loss first.
"""

from __future__ import annotations

import warnings
from collections import defaultdict
from typing import Callable, Iterable

import torch

from toolkit.errors import UserError
from toolkit.kernels import triton_available
from toolkit.optim import reference
from toolkit.optim.bnb_compat import convert_bnb_state_dict, is_bnb_state_dict
from toolkit.optim.quant import MIN_8BIT_SIZE, num_blocks

IMPLEMENTATIONS = ("auto", "torch", "triton")


def _fusable(p: torch.Tensor, grad: torch.Tensor) -> bool:
    """Whether the fused kernel takes this parameter: contiguous, 16-byte aligned, float param and grad."""
    from toolkit.optim.triton_kernels import SUPPORTED_DTYPES, is_aligned

    return (p.is_contiguous() and p.dtype in SUPPORTED_DTYPES and grad.dtype in SUPPORTED_DTYPES
            and is_aligned(p, grad))


class _Blockwise8bitOptimizer(torch.optim.Optimizer):
    """Shared state handling, dispatch and (bitsandbytes-compatible) state dict loading."""

    _name = ""  # "adamw" or "lion": the fused kernel's optimizer
    _moments = 2
    # GradScaler sets `found_inf` and `grad_scale` and calls step() without reading found_inf itself (no host
    # sync); the trainer's Stepper sets `found_inf` from the loss (Stepper.skips_on_device)
    _step_supports_amp_scaling = True

    def __init__(self, params, defaults: dict, impl: str):
        if impl not in IMPLEMENTATIONS:
            raise ValueError(f"impl must be one of {IMPLEMENTATIONS}, got {impl!r}")
        lr, betas, wd = defaults["lr"], defaults["betas"], defaults["weight_decay"]
        if not lr >= 0.0:
            raise ValueError(f"invalid learning rate: {lr}")
        if not all(0.0 <= b < 1.0 for b in betas) or len(betas) != 2:
            raise ValueError(f"invalid betas: {betas} (two values in [0, 1))")
        if not wd >= 0.0:
            raise ValueError(f"invalid weight_decay: {wd}")
        super().__init__(params, defaults)
        self.impl = impl
        self._launch_tables: dict[tuple, object] = {}
        self._launched: set[tuple] = set()  # fused launch keys that compiled and ran once

    def implementation_for(self, device: torch.device) -> str:
        """'triton' or 'torch': what steps parameters on `device`."""
        if self.impl != "auto":
            if self.impl == "triton" and not triton_available():
                raise UserError("impl='triton' needs the triton package: pip install triton (or use impl='torch')")
            if self.impl == "triton" and device.type != "cuda":
                raise UserError(f"impl='triton' needs parameters on a GPU, not {device.type} (use impl='torch')")
            return self.impl
        return "triton" if device.type == "cuda" and triton_available() else "torch"

    def _init_state(self, p: torch.Tensor) -> dict:
        state = self.state[p]
        state["step"] = torch.zeros((), dtype=torch.int64, device=p.device)
        if p.numel() < MIN_8BIT_SIZE:
            for i in range(1, self._moments + 1):
                state[f"state{i}"] = torch.zeros_like(p, dtype=torch.float32, memory_format=torch.contiguous_format)
        else:
            for i in range(1, self._moments + 1):
                state[f"state{i}"] = torch.zeros_like(p, dtype=torch.uint8, memory_format=torch.contiguous_format)
                state[f"absmax{i}"] = torch.zeros(num_blocks(p.numel()), dtype=torch.float32, device=p.device)
        return state

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        scaler = {}  # device -> _ScalerInputs
        found_inf, grad_scale = getattr(self, "found_inf", None), getattr(self, "grad_scale", None)
        for index, group in enumerate(self.param_groups):
            fused = defaultdict(list)  # (device, param dtype, grad dtype, new state) -> [(p, grad, state)]
            unfused, counts = defaultdict(list), defaultdict(list)  # device -> [(p, grad, state)], step counts
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError(f"{type(self).__name__} does not support sparse gradients")
                new = not self.state[p]
                state = self._init_state(p) if new else self.state[p]
                counts[p.device].append(state["step"])
                grad = p.grad if p.grad.is_contiguous() else p.grad.contiguous()
                eight_bit = state["state1"].dtype == torch.uint8
                if eight_bit and self.implementation_for(p.device) == "triton" and _fusable(p, grad):
                    fused[(p.device, p.dtype, grad.dtype, new)].append((p, grad, state))
                else:
                    unfused[p.device].append((p, grad, state))
            for device, steps in counts.items():
                if device not in scaler:
                    scaler[device] = _ScalerInputs(found_inf, grad_scale, device)
                taken = scaler[device].taken  # one device tensor per count: _foreach_add_ with one tensor syncs
                torch._foreach_add_(steps, [taken] * len(steps) if torch.is_tensor(taken) else taken)
            for device, triples in unfused.items():
                self._unfused_update(triples, group, scaler[device])
            for key, triples in fused.items():
                if self.implementation_for(key[0]) == "torch":  # a kernel failed to compile earlier in this step
                    self._unfused_update(triples, group, scaler[key[0]])
                    continue
                try:
                    self._fused_update(index, key, triples, group, scaler[key[0]])
                except Exception as error:  # noqa: BLE001 - a kernel that does not compile here
                    if (index,) + key in self._launched:
                        raise
                    self._fall_back(key[0], error)
                    self._unfused_update(triples, group, scaler[key[0]])
                else:
                    self._launched.add((index,) + key)
        return loss

    def _fall_back(self, device: torch.device, error: Exception) -> None:
        """The Triton kernel failed at its first launch (before writing anything): the torch implementation steps
        this optimizer's parameters from now on, the same numbers up to rounding, slower. Said once, as a warning."""
        self.impl = "torch"
        warnings.warn(f"{type(self).__name__}: the Triton kernel failed on {device} ({type(error).__name__}: "
                      f"{str(error).splitlines()[0] if str(error) else ''}); stepping with the torch implementation "
                      "instead (slower; optimizer_backend: bitsandbytes is the other choice)", stacklevel=3)

    def _unfused_update(self, triples: list, group: dict, inputs: "_ScalerInputs") -> None:
        scales = self._step_scales(group, [state["step"] for _, _, state in triples])
        for (p, grad, state), step_scales in zip(triples, scales):
            if inputs.inv_scale is not None:
                grad = grad.float() * inputs.inv_scale
            with reference.undone_if(inputs.skip, p, *(state[k] for k in _STATE_TENSORS if k in state)):
                self._reference_update(p, grad, state, group, step_scales)

    def _fused_update(self, group_index: int, key: tuple, triples: list, group: dict, inputs: "_ScalerInputs") -> None:
        from toolkit.optim import triton_kernels

        tables = self._launch_tables.get((group_index,) + key)
        if tables is None:
            tables = self._launch_tables[(group_index,) + key] = triton_kernels._LaunchTables()
        params, grads, states = (list(x) for x in zip(*triples))
        beta1, beta2 = group["betas"]
        triton_kernels.fused_step(self._name, params, grads, states, tables, lr=group["lr"], beta1=beta1,
                                  beta2=beta2, eps=group.get("eps", 0.0), weight_decay=group["weight_decay"],
                                  found_inf=inputs.found_inf, inv_scale=inputs.inv_scale, first=key[3])

    def _step_scales(self, group: dict, steps: list[torch.Tensor]) -> list:
        """What the reference update needs of each step count, computed for all of them at once."""
        return [None] * len(steps)

    def _reference_update(self, p, grad, state, group, step_scales) -> None:
        raise NotImplementedError

    def state_dict(self) -> dict:
        """torch's state dict, with each "step" an int as bitsandbytes keeps it (read from the device: this waits
        for the GPU, as saving does anyway)."""
        state_dict = super().state_dict()
        state_dict["state"] = {k: {**s, "step": int(s["step"])} for k, s in state_dict["state"].items()}
        return state_dict

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a state dict of this class or of the bitsandbytes optimizer of the same kind (converted first).

        Tensors keep their dtype (torch's default loader would cast uint8 and fp32 state to the param dtype)
        and move to their parameter's device; "step" (an int, or a tensor) becomes an int64 tensor there.
        """
        if is_bnb_state_dict(state_dict):
            state_dict = convert_bnb_state_dict(state_dict)
        groups, saved_groups = self.param_groups, state_dict["param_groups"]
        if len(groups) != len(saved_groups):
            raise ValueError(f"the state dict has {len(saved_groups)} parameter groups, the optimizer {len(groups)}")
        for i, (g, sg) in enumerate(zip(groups, saved_groups)):
            if len(g["params"]) != len(sg["params"]):
                raise ValueError(f"parameter group {i} holds {len(g['params'])} parameters, "
                                 f"the state dict's {len(sg['params'])}")
        id_map = {saved_id: p for g, sg in zip(groups, saved_groups) for saved_id, p in zip(sg["params"], g["params"])}
        state = defaultdict(dict)
        for saved_id, saved in state_dict["state"].items():
            if saved_id not in id_map:
                raise ValueError(f"the state dict has state for parameter id {saved_id}, which no group lists")
            p = id_map[saved_id]
            state[p] = {k: v.to(p.device, copy=True) if isinstance(v, torch.Tensor) else v for k, v in saved.items()}
            state[p]["step"] = torch.tensor(int(state[p]["step"]), dtype=torch.int64, device=p.device)
            self._check_loaded_state(p, state[p])
        param_groups = [{**sg, "params": g["params"]} for g, sg in zip(groups, saved_groups)]
        self.__setstate__({"state": state, "param_groups": param_groups})

    def _check_loaded_state(self, p: torch.Tensor, state: dict) -> None:
        expected = ["state1", "step"]
        if self._moments == 2:
            expected.append("state2")
        eight_bit = state["state1"].dtype == torch.uint8
        if eight_bit:
            expected += [f"absmax{i}" for i in range(1, self._moments + 1)]
        missing = sorted(set(expected) - set(state))
        if missing:
            raise UserError(f"{type(self).__name__}: loaded optimizer state lacks {missing} for a parameter of shape "
                            f"{tuple(p.shape)}; was it saved by another optimizer?")
        if state["state1"].numel() != p.numel():
            raise UserError(f"{type(self).__name__}: loaded state1 has {state['state1'].numel()} elements, the "
                            f"parameter {p.numel()}")
        if eight_bit and state["absmax1"].numel() != num_blocks(p.numel()):
            raise UserError(f"{type(self).__name__}: loaded absmax1 has {state['absmax1'].numel()} blocks, "
                            f"expected {num_blocks(p.numel())} blocks of 256")


_STATE_TENSORS = ("state1", "state2", "absmax1", "absmax2")


class _ScalerInputs:
    """GradScaler's (or the Stepper's) found_inf and grad_scale on one device, as step() uses them; nothing here
    is read back to the host."""

    def __init__(self, found_inf: torch.Tensor | None, grad_scale: torch.Tensor | None, device: torch.device):
        self.found_inf = self.skip = self.inv_scale = None
        self.taken: torch.Tensor | int = 1  # what the step counts advance by
        if found_inf is not None:
            self.found_inf = found_inf.to(device, torch.float32, non_blocking=True)
            self.skip = self.found_inf != 0  # NaN too
            self.taken = (self.found_inf == 0).long()
        if grad_scale is not None:  # 1 / scale as GradScaler.unscale_ computes it
            self.inv_scale = grad_scale.double().reciprocal().float().to(device, non_blocking=True)


class AdamW8bit(_Blockwise8bitOptimizer):
    """AdamW with 8-bit block-quantized moments (bitsandbytes-compatible state; decoupled weight decay)."""

    _name = "adamw"
    _moments = 2

    def __init__(self, params: Iterable, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2, *, impl: str = "auto"):
        if not eps >= 0.0:
            raise ValueError(f"invalid eps: {eps}")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay), impl)

    def _step_scales(self, group: dict, steps: list[torch.Tensor]) -> list:
        """reference.adam_step_scales of each step count: a few small ops per group rather than per parameter."""
        beta1, beta2 = group["betas"]
        step_size, correction2 = reference.adam_step_scales(torch.stack(steps), group["lr"], beta1, beta2)
        return list(zip(step_size.unbind(), correction2.unbind()))

    def _reference_update(self, p, grad, state, group, step_scales) -> None:
        beta1, beta2 = group["betas"]
        kwargs = dict(lr=group["lr"], beta1=beta1, beta2=beta2, eps=group["eps"], weight_decay=group["weight_decay"],
                      scales=step_scales)
        if state["state1"].dtype == torch.uint8:
            reference.adamw_8bit_update_(p, grad, state, **kwargs)
        else:
            reference.adamw_update_(p, grad, state["state1"], state["state2"], step=state["step"], **kwargs)


class Lion8bit(_Blockwise8bitOptimizer):
    """Lion (sign of interpolated momentum) with an 8-bit block-quantized momentum; Lion has no eps."""

    _name = "lion"
    _moments = 1

    def __init__(self, params: Iterable, lr: float = 1e-4, betas: tuple[float, float] = (0.9, 0.99),
                 weight_decay: float = 0.0, *, impl: str = "auto"):
        super().__init__(params, dict(lr=lr, betas=tuple(betas), weight_decay=weight_decay), impl)

    def _reference_update(self, p, grad, state, group, step_scales) -> None:
        beta1, beta2 = group["betas"]
        kwargs = dict(lr=group["lr"], beta1=beta1, beta2=beta2, weight_decay=group["weight_decay"])
        if state["state1"].dtype == torch.uint8:
            reference.lion_8bit_update_(p, grad, state, **kwargs)
        else:
            reference.lion_update_(p, grad, state["state1"], **kwargs)
