"""LoRA weights of the diffusion families: checkpoints (the exact trainable tensors), the diffusers file that
`pipe.load_lora_weights` reads (with the LoRA config as metadata), the kohya / ComfyUI exports, and loading
an exported file back. Mixed into DiffusionAdapter, which provides `network`, `cfg`, `family`, `spec`, `log` and
`text_encoder_names`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch

from toolkit.errors import UserError

LORA_FILE = "pytorch_lora_weights.safetensors"


class DiffusersLoraFiles:
    # The components whose LoRA keys the diffusers file holds in diffusers' own naming, as diffusers' SD and
    # SDXL LoRA scripts (train_text_to_image_lora.py, train_text_to_image_lora_sdxl.py, train_dreambooth_lora.py,
    # train_dreambooth_lora_sdxl.py) save them: the UNet as lora.down/up, the CLIP text encoders as
    # lora_linear_layer.down/up. The transformers keep PEFT naming (lora_A/B), as the Flux, SD3, Wan and
    # Qwen-Image scripts (train_dreambooth_lora_flux.py, ...) save them.
    diffusers_named_components: tuple[str, ...] = ("unet", "text_encoder", "text_encoder_2")

    def diffusers_lora_layers(self, dtype: torch.dtype, names: list[str] | None = None) -> dict[str, dict[str, torch.Tensor]]:
        """save_lora_weights arguments (`<component>_lora_layers`) for the trained modules (or `names`), on the CPU,
        in the naming of `diffusers_named_components`."""
        from diffusers.utils import convert_state_dict_to_diffusers
        from peft.utils import get_peft_model_state_dict

        layers = {}
        for name in names or list(self.network.keys()):
            state = get_peft_model_state_dict(self.network[name])
            if name in self.diffusers_named_components:
                state = convert_state_dict_to_diffusers(state)
            layers[f"{name}_lora_layers"] = {k: v.detach().to("cpu", dtype) for k, v in state.items()}
        return layers

    def lora_adapter_metadata(self, names: list[str] | None = None) -> dict[str, dict]:
        """save_lora_weights' `<component>_lora_adapter_metadata`: each LoRA config (rank, alpha, rslora, targets)
        goes into the file, so loaders (diffusers included) scale by alpha/rank, not by 1."""
        return {f"{name}_lora_adapter_metadata": self.network[name].peft_config["default"].to_dict()
                for name in names or list(self.network.keys())}

    def save_lora(self, out_dir: Path, dtype: torch.dtype) -> list[Path]:
        """The diffusers file (pytorch_lora_weights.safetensors), plus the save.format export when asked."""
        fmt = self.cfg.save.format  # checked against the family's save_formats when the config loaded
        self.pipeline_class().save_lora_weights(out_dir, safe_serialization=True,
                                                **self.diffusers_lora_layers(dtype), **self.lora_adapter_metadata())
        files = [out_dir / LORA_FILE]
        if fmt not in ("auto", "diffusers"):
            files += self.export_or_warn(out_dir / LORA_FILE, out_dir / f"{self.cfg.run.name}_{fmt}.safetensors", fmt)
        return files

    def export_or_warn(self, diffusers_file: Path, out_file: Path, fmt: str) -> list[Path]:
        """The save.format export; one that fails (a module the format has no name for) is named in a warning,
        and the diffusers file, already written, stays the run's output."""
        try:
            return [self.export(diffusers_file, out_file, fmt)]
        except ValueError as err:
            self.log(f"warning: save.format={fmt}: {out_file.name} not written: {err}; "
                     f"{diffusers_file.name} was written")
            return []

    def export(self, diffusers_file: Path, out_file: Path, fmt: str) -> Path:
        from toolkit.models.lora_export import save_kohya

        return save_kohya(diffusers_file, out_file, self.kohya_metadata())

    def kohya_metadata(self) -> dict[str, str]:
        return {"ss_base_model": str(self.cfg.model.name_or_path), "toolkit_family": self.family,
                "ss_network_dim": str(self.cfg.network.rank), "ss_network_alpha": str(self.cfg.network.alpha),
                "ss_steps": str(self.cfg.train.steps), "ss_trigger_word": str(self.cfg.data.trigger_word or ""),
                "ss_network_module": "networks.lora"}

    def load_lora(self, path: Path) -> None:
        """Load a diffusers-format LoRA file (or a folder holding one) into the trained modules."""
        self.load_lora_into(path, list(self.network.keys()))

    def load_lora_into(self, path: Path, names: list[str], prefix_of: Callable[[str], str] = lambda n: n) -> None:
        from diffusers.utils import convert_state_dict_to_peft, convert_unet_state_dict_to_peft
        from peft import set_peft_model_state_dict

        path = Path(path)
        loaded = self.pipeline_class().lora_state_dict(str(path), weight_name=LORA_FILE if path.is_dir() else None)
        state = loaded[0] if isinstance(loaded, tuple) else loaded  # some mixins also return network alphas
        for name in names:
            prefix = f"{prefix_of(name)}."
            part = {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}
            # Back to PEFT naming: a text encoder's keys are in its own layout; a denoiser's from the UNet's
            # lora.down/up (keys already in PEFT naming, as the transformers' are, pass through unchanged).
            to_peft = convert_state_dict_to_peft if name in self.text_encoder_names else convert_unet_state_dict_to_peft
            part = to_peft(part)
            result = set_peft_model_state_dict(self.network[name], part)
            if getattr(result, "unexpected_keys", None):
                raise UserError(f"{path}: LoRA keys do not match the {name}: {result.unexpected_keys[:2]}")
