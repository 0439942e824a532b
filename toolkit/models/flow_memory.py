"""The memory plan of a flow-matching denoiser (Flux, SD3, Qwen-Image, Z-Image, FLUX.2, Wan): which frozen weights
are quantized (model.quantize), which Wan 2.2 expert waits in CPU memory (model.expert_offload), which blocks stream
in from pinned CPU memory (model.block_swap), and moving the denoisers where the plan puts them.

`plan()` runs at load, before the LoRA is added: the 16-bit weights against the device's budget (models/quantize.py)
decide it, and every choice is recorded as a Decision of the run's loaded stage (`decisions`) besides the one log
line that explains it. Quantized denoisers go to the device at once (the libraries quantize on the move); 16-bit
ones wait in CPU memory until the caches are filled (`place`), so the text encoders never share the device with them.
"""

from __future__ import annotations

import torch

from toolkit.errors import UserError
from toolkit.models.block_swap import BlockSwap, move_except_swapped, plan_block_swap
from toolkit.models.diffusion_base import DiffusionMemory
from toolkit.models.quantize import choose_backend, plan_weights, quantize_linear_layers, weight_budget_gb, weights_gb
from toolkit.plan.decisions import Decision


class FlowMemory(DiffusionMemory):
    """The memory plan of a flow family's adapter (see the module docstring)."""

    def __init__(self, adapter):
        super().__init__(adapter)
        self.quantize, self.offload, self.library = "none", False, None
        self.swap_plans: dict = {}
        self.swap_by_name: dict[str, BlockSwap] = {}
        self._decisions: dict[str, Decision] = {}

    # -- the plan ----------------------------------------------------------------------------
    def plan(self) -> None:
        """model.quantize, model.expert_offload and model.block_swap for this device, logged and recorded."""
        a = self.adapter
        model, device = a.cfg.model, a.runtime.info
        counts = {name: sum(p.numel() for p in a.component(name).parameters()) for name in a.denoiser_names}
        offload = False if a.shard_base else a.expert_offload_setting()  # fsdp: refused true before loading
        self.quantize, self.offload, why = plan_weights(a.quantize_setting(), offload, counts, device,
                                                        a.cfg.device.memory_fraction)
        self.swap_plans, self.swap_by_name = {}, {}
        if model.block_swap != 0 and not a.shard_base:
            self.swap_plans, why = self.plan_block_swap(counts, offload, why)
        a.log(why)
        self._record(why, counts)
        self.library = None
        if self.quantize != "none":
            self.library, reason = choose_backend(model.quantize_backend, self.quantize, device.backend)
            a.log(f"model.quantize_backend={self.library}: {reason}")

    def _record(self, why: str, counts: dict[str, int]) -> None:
        model = self.adapter.cfg.model
        if model.quantize == "auto":
            self._decisions["model.quantize"] = Decision("model.quantize", self.quantize, why, "loaded")
        if len(counts) > 1 and self.adapter.expert_offload_setting() == "auto":
            self._decisions["model.expert_offload"] = Decision("model.expert_offload", self.offload, why, "loaded")
        if model.block_swap == "auto":
            swapped = {name: len(plan.swapped) for name, plan in self.swap_plans.items()}
            value = swapped.get(next(iter(counts)), 0) if len(counts) == 1 else (swapped or 0)
            self._decisions["model.block_swap"] = Decision("model.block_swap", value, why, "loaded")

    def plan_block_swap(self, counts: dict[str, int], offload, why: str) -> tuple[dict, str]:
        """model.block_swap: which blocks stay in CPU memory (models/block_swap.py). Under auto, with
        model.quantize auto too, a base whose 16-bit weights exceed the budget swaps blocks rather than being
        quantized; returns the plans by denoiser and the memory plan's reason."""
        a = self.adapter
        model, device, fraction = a.cfg.model, a.runtime.info, a.cfg.device.memory_fraction
        if model.block_swap == "auto" and a.quantize_setting() == "auto" and self.quantize != "none":
            self.quantize, self.offload, _ = plan_weights("none", offload, counts, device, fraction)
            why = ("model.quantize=auto -> none" + (", model.expert_offload=true" if self.offload else "") +
                   ": 16-bit weights with blocks swapped rather than quantized (model.block_swap=auto)")
        if self.quantize != "none":
            if model.block_swap == "auto":
                return {}, why + "; model.block_swap=auto -> 0 (the base is quantized)"
            raise UserError("model.block_swap: swaps 16-bit weights; it is not combined with model.quantize\n"
                            "  fix: model.quantize=none, or model.block_swap=0")
        budget = weight_budget_gb(device, fraction)
        # With expert offload one expert is on the device at a time (Wan 2.2 A14B): each swaps within the budget.
        resident = weights_gb(max(counts.values()) if self.offload else sum(counts.values()), "none")
        plans = {}
        names = a.lora_denoiser_names()
        for name in names:
            plan = plan_block_swap(model.block_swap, a.denoiser_blocks(name), resident,
                                   budget, device.backend, device.integrated)
            why += f"; {name}: {plan.reason}" if len(names) > 1 else f"; {plan.reason}"
            if plan.swapped:
                plans[name] = plan
        return plans, why

    # -- what the trainer reads ------------------------------------------------------------------
    def decisions(self) -> dict[str, Decision]:
        return dict(self._decisions)

    def quantized(self) -> str:
        return self.quantize

    def swaps(self) -> dict:
        return self.swap_by_name

    def fixes(self) -> list[str]:
        fixes = []
        a = self.adapter
        if self.quantize == "none" and not a.shard_base and a.runtime.info.backend != "cpu":
            name = a.lora_denoiser_names()[0]
            total = len(a.denoiser_blocks(name))
            swapped = len(self.swap_by_name[name].order) if name in self.swap_by_name else 0
            more = min(total, swapped + max(1, total // 4))
            if more > swapped:
                fixes.append(f"model.block_swap={more} ({more} of the {total} frozen blocks wait in CPU memory and "
                             "stream in ahead of use)")
        if self.quantize in ("none", "8bit"):
            fixes.append(f"model.quantize={'8bit' if self.quantize == 'none' else '4bit'} (a quantized frozen base)")
        fixes.append("data.resolution lower (fewer latent tokens per image)")
        return fixes

    # -- placing the denoisers -------------------------------------------------------------------
    def place_quantized(self) -> None:
        """At load, before the LoRA: quantized denoisers to their device now (bitsandbytes quantizes on the move)."""
        a = self.adapter
        if self.quantize == "none":
            return
        for name in a.denoiser_names:
            count = quantize_linear_layers(a.component(name), self.quantize, a.runtime.compute_dtype,
                                           self.quantize_device(name), skip=(), backend=self.library,
                                           include=a.quantized_layer, info=a.runtime.info)
            a.log(f"model: quantized {count} linear layers of the {name} to {self.quantize} ({self.library})")

    def quantize_device(self, name: str) -> torch.device:
        """Where denoiser `name` is quantized: the device; with expert offload, an fp8 expert that starts idle is
        quantized in CPU memory (the toolkit's own layer quantizes anywhere), so both experts never share the
        device, not even while they are quantized."""
        a = self.adapter
        if self.offload and self.quantize == "fp8" and name != a.active_denoiser():
            return torch.device("cpu")
        return a.runtime.device

    def build_swaps(self) -> None:
        """The BlockSwap of each denoiser that has a swap plan (models/block_swap.py)."""
        a = self.adapter
        for name, plan in self.swap_plans.items():
            self.swap_by_name[name] = BlockSwap(a.denoiser_blocks(name), plan.swapped,
                                                a.runtime.device)

    def move_denoiser(self, name: str, target: torch.device) -> None:
        """A denoiser onto `target` (the device, or the CPU for an idle Wan 2.2 expert), its LoRA weights onto the
        device either way. Swapped blocks' frozen weights stay in pinned CPU memory; a denoiser without swap moves
        by Module.to, which quantized layers (bitsandbytes) need to carry their quantization state along."""
        a = self.adapter
        module, swap, device = a.component(name), self.swap_by_name.get(name), a.runtime.device
        if swap is not None:
            move_except_swapped(module, target, swap, trainable=device)
            return
        lora = [p for p in module.parameters() if p.requires_grad]
        module.to(target)
        for p in lora:
            p.data = p.data.to(device)

    def place(self, resident: str | None = None) -> None:
        """After the caches are filled: the swaps built and every denoiser on the device, or with expert offload
        only `resident` (the others in CPU memory; an expert going idle gives its GPU slots back first)."""
        a = self.adapter
        if a.shard_base:
            return
        if not self.swap_by_name:
            self.build_swaps()
        for name in a.denoiser_names:
            target = a.runtime.device if (not self.offload or name == resident) else torch.device("cpu")
            if name in self.swap_by_name and target.type == "cpu":
                self.swap_by_name[name].release_all()
            self.move_denoiser(name, target)
