"""Loading a LoRA into the LoRA a run trains, for `sample` (the run's own files) and `network.init_from` (any LoRA).

The library that reads the format loads the file under a second adapter name, LOADED: diffusers'
`pipe.load_lora_weights` for the diffusion families (it converts kohya, ComfyUI, Wan / Qwen-Image native and
diffusers keys, and applies their alphas) and PEFT's `load_adapter` for the llm family (an adapter folder with its
config). Then `copy_loaded_adapter` copies each layer's update into the trained adapter ("default"): B as read, A
times the loaded scale over the trained one, so that scaling * B @ A is the file's whatever network.alpha says
(bit-exact when the two scales agree), and a DoRA magnitude as read. The LOADED adapter is then deleted.

Loaded weights take the dtype of the base layer they sit on (PEFT's rule in diffusers): over a bf16 base a file
saved in fp32 is read at bf16 precision, as diffusers and ComfyUI read it.
"""

from __future__ import annotations

import pickle
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

import torch

from toolkit.errors import UserError
from toolkit.untrusted import PICKLED_LORA_FIX, pickle_refusal, refused

LOADED = "toolkit_loaded"  # the adapter name a file is loaded under before its weights are copied
DEFAULT = "default"        # the adapter the run trains


def lora_layers(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """{module path: PEFT LoRA layer} of `model`."""
    from peft.tuners.lora import LoraLayer

    return {path: m for path, m in model.named_modules() if isinstance(m, LoraLayer)}


def has_loaded(model: torch.nn.Module) -> bool:
    """Whether any LoRA layer of `model` holds the LOADED adapter."""
    return any(LOADED in layer.lora_A for layer in lora_layers(model).values())


def _adds_nothing(layer: torch.nn.Module) -> bool:
    """Whether the LOADED LoRA of `layer` is all zeros: diffusers' Wan loader fills the image cross-attention of an
    image-to-video model (attn2.add_k_proj / add_v_proj) with such zeros when a file has none for it."""
    return not (layer.lora_A[LOADED].weight.any() or layer.lora_B[LOADED].weight.any())


def copy_loaded_adapter(model: torch.nn.Module, label: str, component: str, partial: bool = False,
                        log: Callable[[str], None] = print) -> int:
    """Copy the LOADED adapter of every LoRA layer of `model` into its trained adapter; returns how many layers.

    The file must not hold modules the run does not train, its ranks must be the run's, and DoRA must be on or off
    in both. With `partial` (init_from) trained modules the file does not cover keep their initial weights, with a
    note; without it (sampling a run's own LoRA) they are an error."""
    layers = lora_layers(model)
    trained = sorted(p for p, m in layers.items() if DEFAULT in m.lora_A)
    loaded = {p for p, m in layers.items() if LOADED in m.lora_A}
    extra = sorted(p for p in loaded.difference(trained) if not _adds_nothing(layers[p]))
    loaded.intersection_update(trained)
    missing = [p for p in trained if p not in loaded]
    if extra:
        raise UserError(f"{label}: it has LoRA weights for {len(extra)} modules of the {component} that this run does "
                        f"not train (e.g. {', '.join(extra[:3])})\n  fix: add them to network.target_modules (or, "
                        "for a text encoder, set train.train_text_encoder=true)")
    if missing and not partial:
        raise UserError(f"{label}: it has no LoRA weights for {len(missing)} of the {len(trained)} trained modules of "
                        f"the {component} (e.g. {', '.join(missing[:3])})\n  fix: load a file written by a run with "
                        "the same model and network settings")
    for path in sorted(loaded):
        layer = layers[path]
        if layer.r[LOADED] != layer.r[DEFAULT]:
            raise UserError(f"{label}: its LoRA has rank {layer.r[LOADED]} ({path} of the {component}), network.rank "
                            f"is {layer.r[DEFAULT]}\n  fix: set network.rank={layer.r[LOADED]} (a run keeps the rank "
                            "of the LoRA it starts from)")
        dora = {name: name in layer.lora_magnitude_vector for name in (LOADED, DEFAULT)}
        if dora[LOADED] != dora[DEFAULT]:
            kind = {True: "DoRA", False: "plain LoRA"}
            raise UserError(f"{label}: it is a {kind[dora[LOADED]]}, this run trains a {kind[dora[DEFAULT]]} "
                            f"({path})\n  fix: set network.type={'dora' if dora[LOADED] else 'lora'}")
        if layer.lora_bias.get(LOADED):
            raise UserError(f"{label}: it has LoRA biases (lora_B.bias, {path}), which the toolkit does not train")
    with torch.no_grad():
        for path in sorted(loaded):
            layer = layers[path]
            ratio = layer.scaling[LOADED] / layer.scaling[DEFAULT]
            down = layer.lora_A[LOADED].weight
            layer.lora_A[DEFAULT].weight.copy_(down if ratio == 1.0 else (down.double() * ratio).to(down.dtype))
            layer.lora_B[DEFAULT].weight.copy_(layer.lora_B[LOADED].weight)
            if LOADED in layer.lora_magnitude_vector:
                layer.lora_magnitude_vector[DEFAULT].weight.copy_(layer.lora_magnitude_vector[LOADED].weight)
    if missing:
        log(f"{label}: {len(missing)} of the {len(trained)} LoRA modules of the {component} are not in it and start "
            f"from the usual initialisation (e.g. {', '.join(missing[:3])})")
    return len(loaded)


@contextmanager
def second_adapter() -> Iterator[None]:
    """PEFT's warnings about a model holding a second adapter, and about deleting it, are what loading through
    LOADED means: not shown."""
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Already found a `peft_config` attribute")
        warnings.filterwarnings("ignore", message=f"Adapter {LOADED} was active which is now deleted")
        yield


@contextmanager
def unplaced_lora_keys() -> Iterator[list[str]]:
    """Collects the LoRA keys that diffusers' load_lora_weights could place on no module of a denoiser: diffusers
    only logs them (a warning the CLI silences), through loaders.peft._maybe_warn_for_unhandled_keys, which this
    wraps while the block runs."""
    import diffusers.loaders.peft as peft_loader

    report = peft_loader._maybe_warn_for_unhandled_keys
    found: list[str] = []

    def collect(incompatible_keys, adapter_name):
        found.extend(k for k in getattr(incompatible_keys, "unexpected_keys", None) or [] if ".lora_" in k)
        return report(incompatible_keys, adapter_name)

    peft_loader._maybe_warn_for_unhandled_keys = collect
    try:
        yield found
    finally:
        peft_loader._maybe_warn_for_unhandled_keys = report


def refuse_unplaced(label: str, keys: list[str], model: str) -> None:
    """A UserError listing a few of `keys` (weights of the file that map to no module of `model`), if any."""
    if keys:
        raise UserError(f"{label}: {len(keys)} of its LoRA weights map to no module of the {model} (e.g. "
                        f"{', '.join(sorted(keys)[:4])}, as the loader names them)\n  fix: give a LoRA trained for "
                        "this model")


@contextmanager
def reading_lora(label: str, model: str) -> Iterator[None]:
    """What a loader raises for a file it cannot read as a LoRA of `model` (unknown layout, leftover keys, shapes
    of another model), as a UserError naming the file."""
    try:
        yield
    except torch.OutOfMemoryError:
        raise
    except (ValueError, KeyError, RuntimeError, IndexError, OSError, pickle.UnpicklingError) as err:
        refusal = pickle_refusal(err)  # a .bin LoRA file that PEFT or diffusers read with weights_only=True
        if refusal is not None:
            raise refused(label, refusal, PICKLED_LORA_FIX) from None
        first = (str(err).strip().splitlines() or [type(err).__name__])[0][:400]
        raise UserError(f"{label}: cannot be loaded as a LoRA of the {model}: {first}\n  fix: give a LoRA trained "
                        "for this model") from None


def load_peft_folder(network: torch.nn.Module, path: Path, partial: bool, label: str | None, model: str,
                     log: Callable[[str], None]) -> None:
    """A PEFT adapter folder (a run folder means its final/) loaded with PEFT's load_adapter under LOADED, then
    copied into the trained adapter (copy_loaded_adapter)."""
    folder = path
    if not (folder / "adapter_config.json").is_file() and (folder / "final" / "adapter_config.json").is_file():
        folder = folder / "final"
    if not ((folder / "adapter_config.json").is_file() and (folder / "adapter_model.safetensors").is_file()):
        raise UserError(f"{label or path}: not a PEFT adapter folder (adapter_config.json + adapter_model.safetensors),"
                        " nor a run folder with one in final/\n  fix: give the folder PEFT's save_pretrained wrote (a "
                        "run's final/ or checkpoint folder), not the .safetensors file alone")
    label = label or str(folder)
    with second_adapter():
        try:
            with reading_lora(label, model):
                result = network.load_adapter(str(folder), adapter_name=LOADED)
            refuse_unplaced(label, [k for k in result.unexpected_keys if ".lora_" in k], model)
            copy_loaded_adapter(network, label, "model", partial, log)
        finally:
            if LOADED in network.peft_config:
                network.delete_adapter(LOADED)
