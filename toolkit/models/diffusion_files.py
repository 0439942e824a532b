"""LoRA files of the diffusion families: `pytorch_lora_weights.safetensors`, written the same way into final/ and
into every checkpoint, and loading such a file back into the trained modules. Mixed into DiffusionAdapter,
which provides `network`, `cfg`, `family`, `spec`, `pipe`, `log` and `component`.

The file's keys are the family's `lora_key_style` (toolkit/models/lora_export.py): one style that diffusers'
`pipe.load_lora_weights`, ComfyUI's LoRA loader and the family's kohya / musubi tools all apply as
base + alpha/rank * B @ A. A LoRA the style cannot hold (DoRA, a Wan module without an original name) is
written in diffusers' own layout instead (save_lora_weights, the LoRA config as metadata), which diffusers
loads exactly; the log says that other tools cannot read it.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from toolkit.errors import UserError
from toolkit.models.lora_export import Factors, peft_factors
from toolkit.models.lycoris_files import TENSORS, load_lycoris_file, lycoris_state, module_names, peft_modules
from toolkit.models.lora_loading import (DEFAULT, LOADED, copy_loaded_adapter, has_loaded, reading_lora,
                                         refuse_unplaced, second_adapter, unplaced_lora_keys)

LORA_FILE = "pytorch_lora_weights.safetensors"


def lora_file_in(path: Path, folder: str = "", label: str | None = None) -> Path:
    """The LoRA file of `path`: the file itself, a folder holding it (final/, a checkpoint), or a run folder
    (its final/); `folder` is a subfolder (a Wan 2.2 expert's) of the folder; `label` names `path` in errors."""
    path = Path(path)
    if path.is_file():
        return path
    for candidate in (path / folder / LORA_FILE, path / "final" / folder / LORA_FILE):
        if candidate.is_file():
            return candidate
    raise UserError(f"{label or path}: no {Path(folder) / LORA_FILE} here or in its final/\n  fix: give a run folder, "
                    "its final/ folder, a checkpoint folder (checkpoints/step-NNNNNN) or the .safetensors file")


class DiffusersLoraFiles:
    def lora_key_style(self, factors: dict[str, Factors]) -> dict[str, torch.Tensor]:
        """The file's keys for the components' factors, in the family's style (lora_export.py); a ValueError
        when the style cannot hold them."""
        raise NotImplementedError

    def lora_factors(self, dtype: torch.dtype, names: list[str] | None = None) -> dict[str, Factors]:
        """The trained modules' factors (or those of `names`), on the CPU in `dtype`."""
        return {name: peft_factors(self.network[name], dtype) for name in names or list(self.network.keys())}

    def lora_metadata(self) -> dict[str, str]:
        """safetensors metadata in the ss_* keys kohya's tools and ComfyUI show."""
        network = self.cfg.network
        lycoris = {"ss_network_module": "lycoris.kohya",
                   "ss_network_args": json.dumps({"algo": network.type, "factor": network.lokr_factor})
                   } if network.type in TENSORS else {"ss_network_module": "networks.lora"}
        return {"ss_base_model": str(self.cfg.model.name_or_path), "toolkit_family": self.family,
                "ss_network_dim": str(network.rank), "ss_network_alpha": str(network.alpha),
                "ss_steps": str(self.cfg.train.steps), "ss_trigger_word": str(self.cfg.data.trigger_word or ""),
                **lycoris}

    # -- LoKr / LoHa (toolkit/models/lycoris_files.py) -----------------------------------------------------------
    def lycoris_names(self, names: list[str]) -> dict[tuple[str, str], str]:
        """{(component, module path): its name in the file} for the LoKr / LoHa modules of the components `names`:
        the family's LoRA key style's names."""
        kind = self.cfg.network.type
        paths = {name: list(peft_modules(self.network[name], kind, torch.float32)) for name in names}
        return module_names(self.lycoris_key_style, paths)

    def lycoris_key_style(self, factors: dict[str, Factors]) -> dict[str, torch.Tensor]:
        """The key style LoKr / LoHa modules are named by: the family's LoRA key style, unless a family's readers
        of LyCORIS files (ComfyUI) need other names (Flux.2)."""
        return self.lora_key_style(factors)

    @staticmethod
    def lycoris_name_today(name: str) -> str:
        """A module name in a LoKr / LoHa file as lycoris_key_style names it now (files written before a family's
        names changed: Flux.2's)."""
        return name

    def check_lycoris_names(self) -> None:
        """At load, before any step: every LoKr / LoHa module has a name in the family's files."""
        if self.cfg.network.type not in TENSORS:
            return
        try:
            self.lycoris_names(list(self.network.keys()))
        except ValueError as err:
            raise UserError(f"network.type={self.cfg.network.type}: {err}\n  fix: leave network.target_modules at "
                            "auto, or name modules the family's LoRA files can hold") from None

    def lycoris_state(self, dtype: torch.dtype, names: list[str]) -> dict[str, torch.Tensor]:
        """The file's tensors for the LoKr / LoHa of the components `names` in `dtype`."""
        kind = self.cfg.network.type
        modules = {name: peft_modules(self.network[name], kind, dtype) for name in names}
        return lycoris_state(modules, self.lycoris_names(names))

    def save_lora(self, out_dir: Path, dtype: torch.dtype) -> list[Path]:
        """pytorch_lora_weights.safetensors, plus a copy named for save.format (kohya, comfyui) when asked."""
        out_dir.mkdir(parents=True, exist_ok=True)
        return self.write_lora_file(out_dir, list(self.network.keys()), dtype, out_dir / self.cfg.run.name)

    def write_lora_file(self, folder: Path, names: list[str], dtype: torch.dtype, copy_stem: Path) -> list[Path]:
        """The LoRA of the components `names` as folder/pytorch_lora_weights.safetensors in the family's key style
        (diffusers' own layout when the style cannot hold it), and its save.format copy `<copy_stem>_<fmt>`."""
        file, fmt = folder / LORA_FILE, self.cfg.save.format  # checked against the family's save_formats
        copy = copy_stem.with_name(f"{copy_stem.name}_{fmt}.safetensors")
        try:  # a DoRA's factors, or a module the key style has no name for: a ValueError
            factors = None if self.cfg.network.type in TENSORS else self.lora_factors(dtype, names)
            state = self.lycoris_state(dtype, names) if factors is None else self.lora_key_style(factors)
        except ValueError as err:  # a LoKr / LoHa was checked at load (check_lycoris_names)
            self.write_diffusers_layout(folder, names, dtype)
            self.log(f"warning: {file}: written in diffusers' own layout, which diffusers loads but ComfyUI and "
                     f"kohya's tools do not: {err}")
            if fmt not in ("auto", "diffusers"):
                self.log(f"warning: save.format={fmt}: {copy.name} not written")
            return [file]
        save_file(state, str(file), metadata=self.lora_metadata())
        if fmt in ("auto", "diffusers"):
            return [file]
        try:
            renamed = self.copy_state(fmt, factors)
        except ValueError as err:
            self.log(f"warning: save.format={fmt}: {copy.name} not written: {err}")
            return [file]
        if renamed is None:
            shutil.copyfile(file, copy)
        else:
            save_file(renamed, str(copy), metadata=self.lora_metadata())
        return [file, copy]

    def copy_state(self, fmt: str, factors: dict[str, Factors] | None) -> dict[str, torch.Tensor] | None:
        """The save.format copy's tensors where its tool reads other names than the main file's (`factors`: the
        file's LoRA factors; None for a LoKr / LoHa); None: the copy is the main file's bytes. A ValueError: the
        copy cannot be written (said, and the main file kept)."""
        return None

    def write_diffusers_layout(self, folder: Path, names: list[str], dtype: torch.dtype) -> None:
        """diffusers' save_lora_weights for the components (each as `<prefix>_lora_layers`, PEFT naming, its
        LoRA config as metadata so diffusers scales by alpha/rank)."""
        from peft.utils import get_peft_model_state_dict

        layers, metadata = {}, {}
        for name in names:
            prefix = self.file_prefix(name)
            state = get_peft_model_state_dict(self.network[name])
            layers[f"{prefix}_lora_layers"] = {k: v.detach().to("cpu", dtype) for k, v in state.items()}
            metadata[f"{prefix}_lora_adapter_metadata"] = self.network[name].peft_config["default"].to_dict()
        self.pipeline_class().save_lora_weights(folder, safe_serialization=True, **layers, **metadata)

    def file_prefix(self, name: str) -> str:
        """The component's key prefix in a diffusers-layout file (Wan 2.2's second expert saves as transformer)."""
        return name

    # -- loading a file back -------------------------------------------------------------------------------------
    def load_lora(self, path: Path, partial: bool = False, label: str | None = None) -> None:
        """Load the LoRA file of a run folder, its final/, a checkpoint folder or a file into the trained modules
        (`partial`: modules the file does not cover keep their weights; see lora_loading.copy_loaded_adapter;
        `label`: how messages name it, else its path)."""
        file = lora_file_in(path, label=label)
        self.load_lora_file(file, list(self.network.keys()), partial, label or str(file))

    def load_lora_file(self, file: Path, names: list[str], partial: bool, label: str, **load_kwargs) -> None:
        """Load `file` with the pipeline's own load_lora_weights (as users do: it reads every key style diffusers
        knows) under a second adapter name, then copy each module's update into the trained adapter of the
        components `names` (toolkit/models/lora_loading.py)."""
        model = f"{self.family} model ({self.cfg.model.name_or_path})"
        if self.cfg.network.type in TENSORS:  # diffusers reads no LyCORIS keys
            load_lycoris_file(file, self.cfg.network.type, {name: self.component(name) for name in names},
                              self.lycoris_names(names), partial, label, self.log, self.lycoris_name_today)
            return
        with second_adapter():
            self._load_lora_file(file, names, partial, label, model, load_kwargs)

    def _load_lora_file(self, file: Path, names: list[str], partial: bool, label: str, model: str,
                        load_kwargs: dict) -> None:
        try:
            with unplaced_lora_keys() as unplaced, reading_lora(label, model):
                self.pipe.load_lora_weights(str(file.parent), weight_name=file.name, adapter_name=LOADED, **load_kwargs)
            refuse_unplaced(label, unplaced, model)
            loaded = [name for name, module in self.pipe.components.items()
                      if isinstance(module, torch.nn.Module) and has_loaded(module)]
            untrained = [name for name in loaded if name not in names]
            if untrained:
                raise UserError(f"{label}: it has LoRA weights for the {', '.join(untrained)}, which this run does not "
                                "train\n  fix: train.train_text_encoder=true for text encoders, or a LoRA of the "
                                f"{', '.join(names)} alone")
            if not loaded:
                raise UserError(f"{label}: none of its weights is a LoRA of the {model}\n  fix: give a LoRA trained "
                                "for this model")
            for name in names:
                copy_loaded_adapter(self.component(name), label, name, partial, self.log)
        finally:
            if any(has_loaded(m) for m in self.pipe.components.values() if isinstance(m, torch.nn.Module)):
                self.pipe.delete_adapters(LOADED)
            for name in names:
                self.component(name).set_adapter(DEFAULT)
