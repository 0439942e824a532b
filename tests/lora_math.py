"""What a LoRA file does to a model, in numbers: the update each trained PEFT module stands for
(alpha / rank * B @ A, from PEFT's own scaling), and the change a loader made to a fresh pipeline's weights."""

from __future__ import annotations

import torch


def randomize_lora_b(network: torch.nn.Module, seed: int = 0) -> None:
    """Non-zero lora_B everywhere (PEFT starts it at zero), so every module's update shows."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in network.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.2)


def expected_updates(model: torch.nn.Module, adapter: str = "default") -> dict[str, torch.Tensor]:
    """{weight name in the plain model: alpha/rank * B @ A} for every LoRA layer of `model`, in float64."""
    from peft.tuners.lora import LoraLayer

    updates = {}
    for path, layer in model.named_modules():
        if isinstance(layer, LoraLayer) and adapter in layer.lora_A:
            down = layer.lora_A[adapter].weight.detach().double()
            up = layer.lora_B[adapter].weight.detach().double()
            weight = layer.get_base_layer().weight
            updates[f"{path}.weight"] = (layer.scaling[adapter] * (up.flatten(1) @ down.flatten(1))).reshape(weight.shape)
    return updates


def plain_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's weights by their names without PEFT's wrapping (base_layer), LoRA factors left out."""
    return {name.replace(".base_layer.", "."): p.detach().double().clone() for name, p in model.named_parameters()
            if "lora_" not in name}


def compare_updates(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor],
                    expected: dict[str, torch.Tensor]) -> tuple[int, float]:
    """(modules matched, max abs difference) of the weight change after - before against `expected`; every
    weight with a non-zero expected update must have changed and no other weight may have (a module that got
    no gradient, like SDXL's unused last text-encoder layer, keeps B = 0)."""
    assert before.keys() == after.keys()
    missing = sorted(set(expected) - set(after))
    assert not missing, f"expected updates of weights the model does not have: {missing[:3]}"
    changed = {k for k in after if not torch.equal(after[k], before[k])}
    moved = {k for k, update in expected.items() if bool(update.abs().max() > 0)}
    assert moved, "no expected update is non-zero"
    assert changed == moved, (f"changed but not trained: {sorted(changed - moved)[:3]}; "
                              f"trained but unchanged: {sorted(moved - changed)[:3]}")
    worst = max(float((after[k] - before[k] - update).abs().max()) for k, update in expected.items())
    return len(expected), worst
