"""LoKr and LoHa (network.type lokr / loha) in the LyCORIS key style that ComfyUI, kohya's sd-scripts and the
LyCORIS library read: for each module, its name in the family's LoRA key style (`lora_unet_..._to_q` for
sd/sdxl, `transformer.<module>` for Flux, ...) followed by the LyCORIS tensor names, which are PEFT's own:

- LoKr: `lokr_w1` (or `lokr_w1_a` / `lokr_w1_b`) and `lokr_w2` (or `lokr_w2_a` / `lokr_w2_b`, `lokr_t2`);
  the update is scale * kron(w1, w2).
- LoHa: `hada_w1_a`, `hada_w1_b`, `hada_w2_a`, `hada_w2_b` (`hada_t1` / `hada_t2`); the update is
  scale * (w1_a @ w1_b) * (w2_a @ w2_b).

and an `.alpha`. Every reader takes scale = alpha / rank, where rank is the inner size of a decomposed factor;
a LoKr module whose w1 and w2 are both full matrices (a rank too large to decompose) has no rank, and every
reader applies scale 1 (ComfyUI comfy/weight_adapter/lokr.py, LyCORIS modules/lokr.py): its scale is folded into
w1 and its alpha written as 1.

Reading such a file back (`sample`, `network.init_from`) inverts the same names: diffusers' load_lora_weights
reads no LyCORIS keys.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from toolkit.errors import UserError
from toolkit.models.lora_export import Factor, Factors

DEFAULT = "default"
LOKR_TENSORS = ("lokr_w1", "lokr_w1_a", "lokr_w1_b", "lokr_w2", "lokr_w2_a", "lokr_w2_b", "lokr_t2")
LOHA_TENSORS = ("hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b", "hada_t1", "hada_t2")
TENSORS = {"lokr": LOKR_TENSORS, "loha": LOHA_TENSORS}
SCALED_TENSOR = {"lokr": ("lokr_w1", "lokr_w1_a"), "loha": ("hada_w1_a",)}  # the one a scale is folded into
DECOMPOSED = ("lokr_w1_b", "lokr_w2_b", "hada_w1_b")  # a tensor whose first size is the rank


@dataclass(frozen=True)
class LycorisModule:
    """One module's LoKr / LoHa tensors (LyCORIS names) and the scale its update is multiplied by."""

    tensors: dict[str, torch.Tensor]
    scale: float

    @property
    def rank(self) -> int | None:
        """The inner size of a decomposed factor; None for a LoKr of two full matrices."""
        for name in DECOMPOSED:
            if name in self.tensors:
                return int(self.tensors[name].shape[0])
        return None

    def file_tensors(self) -> dict[str, torch.Tensor]:
        """Its tensors and alpha as written: alpha = scale * rank; without a rank, the scale folded into w1."""
        rank = self.rank
        if rank is not None:
            return {**self.tensors, "alpha": torch.tensor(self.scale * rank, dtype=torch.float32)}
        out = dict(self.tensors)
        out["lokr_w1"] = (out["lokr_w1"].double() * self.scale).to(out["lokr_w1"].dtype)
        return {**out, "alpha": torch.tensor(1.0, dtype=torch.float32)}


def read_file_module(tensors: dict[str, torch.Tensor]) -> LycorisModule:
    """A module as a file holds it (tensors by LyCORIS name, `alpha` optional): the scale a reader applies."""
    tensors = dict(tensors)
    alpha = tensors.pop("alpha", None)
    module = LycorisModule(tensors, 1.0)
    rank = module.rank
    scale = 1.0 if rank is None or alpha is None else float(alpha) / rank
    return LycorisModule(tensors, scale)


def peft_modules(model: torch.nn.Module, kind: str, dtype: torch.dtype) -> dict[str, LycorisModule]:
    """{module path: its LoKr / LoHa tensors on the CPU in `dtype`, PEFT's scaling} of a model carrying PEFT's
    LoKr or LoHa adapter."""
    from peft.tuners.lycoris_utils import LycorisLayer

    out = {}
    for path, layer in model.named_modules():
        if not isinstance(layer, LycorisLayer) or DEFAULT not in layer.scaling:
            continue
        tensors = {}
        for name in TENSORS[kind]:
            holder = getattr(layer, name, None)
            if holder is not None and DEFAULT in holder:
                tensors[name] = holder[DEFAULT].detach().to("cpu", dtype).contiguous()
        out[path] = LycorisModule(tensors, float(layer.scaling[DEFAULT]))
    return out


def module_names(lora_key_style: Callable[[dict[str, Factors]], dict[str, torch.Tensor]],
                 modules: dict[str, list[str]]) -> dict[tuple[str, str], str]:
    """{(component, module path): the module's name in the family's LoRA key style}: the style is given a rank-1
    stand-in factor per module whose down weight is the module's number, and each name is read off the key that
    holds that number (the scale is 1, so no style changes it)."""
    order, factors = [], {}
    for component, paths in modules.items():
        factors[component] = {}
        for path in paths:
            order.append((component, path))
            factors[component][path] = Factor(torch.full((1, 1), float(len(order))), torch.zeros(1, 1), 1.0)
    names = {}
    for key, tensor in lora_key_style(factors).items():
        for marker in (".lora_down.weight", ".lora_A.weight"):
            if key.endswith(marker):
                names[order[int(tensor.item()) - 1]] = key[:-len(marker)]
    return names


def lycoris_state(modules: dict[str, dict[str, LycorisModule]], names: dict[tuple[str, str], str]
                  ) -> dict[str, torch.Tensor]:
    """The file's tensors: `<name>.<lyCORIS tensor>` and `<name>.alpha` for every module."""
    return {f"{names[(component, path)]}.{tensor}": value
            for component, by_path in modules.items() for path, module in by_path.items()
            for tensor, value in module.file_tensors().items()}


def split_file(state: dict[str, torch.Tensor], kind: str) -> dict[str, dict[str, torch.Tensor]]:
    """{module name: {LyCORIS tensor name or alpha: tensor}} of a file's keys; other keys are a UserError's."""
    out: dict[str, dict[str, torch.Tensor]] = {}
    unknown = []
    for key, value in state.items():
        name, _, tensor = key.rpartition(".")
        if tensor in TENSORS[kind] or tensor == "alpha":
            out.setdefault(name, {})[tensor] = value
        else:
            unknown.append(key)
    if unknown:
        other = next((k for k, names in TENSORS.items() if any(key.endswith(n) for n in names for key in unknown)),
                     "lora")
        raise UserError(f"keys of another adapter type, e.g. {', '.join(sorted(unknown)[:3])}: it is a {other} file, "
                        f"network.type is {kind}\n  fix: set network.type={other}")
    return out


def copy_into_peft(model: torch.nn.Module, path: str, module: LycorisModule, label: str) -> None:
    """Set the trained LoKr / LoHa of `model`'s module `path` to `module`'s update: its tensors, the first factor
    rescaled by the file's scale over the trained one."""
    layer = model.get_submodule(path)
    ratio = module.scale / float(layer.scaling[DEFAULT])
    kind = "lokr" if any(n.startswith("lokr") for n in module.tensors) else "loha"
    have = {n: tuple(getattr(layer, n)[DEFAULT].shape) for n in TENSORS[kind] if DEFAULT in getattr(layer, n)}
    if have != {n: tuple(v.shape) for n, v in module.tensors.items()}:
        got = {n: tuple(v.shape) for n, v in module.tensors.items()}
        raise UserError(f"{label}: its {kind} of {path} is {got}, the trained one {have}\n  fix: set network.rank "
                        "(and network.lokr_factor) as the file was trained")
    with torch.no_grad():
        for name, value in module.tensors.items():
            holder = getattr(layer, name)
            scaled = value.double() * ratio if name in SCALED_TENSOR[kind] and ratio != 1.0 else value
            holder[DEFAULT].copy_(scaled.to(holder[DEFAULT].dtype))


def load_lycoris_file(file: Path, kind: str, models: dict[str, torch.nn.Module],
                      names: dict[tuple[str, str], str], partial: bool, label: str,
                      log: Callable[[str], None], today: Callable[[str], str] = str) -> int:
    """Copy a LyCORIS file's modules into the trained modules (`names` as module_names gives them; `today`: a
    module name in the file as the family names it now, for files written before a rename); returns how many.
    Modules the file has that the run does not train are an error; trained modules it lacks are too, unless
    `partial` (network.init_from), where they keep their initial weights with a note."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        state = load_file(str(file))
    except (OSError, SafetensorError) as err:
        raise UserError(f"{label}: cannot be read as a safetensors file: {str(err).splitlines()[0]}\n  fix: give "
                        "the LoKr / LoHa .safetensors file") from None
    try:
        in_file = {today(name): tensors for name, tensors in split_file(state, kind).items()}
    except UserError as err:
        raise UserError(f"{label}: {err}") from None
    by_name = {name: key for key, name in names.items()}
    extra = sorted(set(in_file) - set(by_name))
    if extra:
        raise UserError(f"{label}: it has {kind} weights for {len(extra)} modules this run does not train (e.g. "
                        f"{', '.join(extra[:3])})\n  fix: add them to network.target_modules (or, for a text "
                        "encoder, set train.train_text_encoder=true)")
    missing = sorted(set(by_name) - set(in_file))
    if missing and not partial:
        raise UserError(f"{label}: it has no {kind} weights for {len(missing)} of the {len(by_name)} trained modules "
                        f"(e.g. {', '.join(missing[:3])})\n  fix: load a file written by a run with the same model "
                        "and network settings")
    for name, tensors in in_file.items():
        component, path = by_name[name]
        copy_into_peft(models[component], path, read_file_module(tensors), label)
    if missing:
        log(f"{label}: {len(missing)} of the {len(by_name)} {kind} modules are not in it and start from the usual "
            f"initialisation (e.g. {', '.join(missing[:3])})")
    return len(in_file)
