"""Writes --clip_l, --t5xxl and --ae files for kohya sd-scripts' flux_train_network.py, run in the peer's own
environment (its source on the path): the shapes are those kohya's library/flux_utils.py builds (CLIP-L and T5-XXL
from their fixed configs, the AutoEncoder from flux_models.configs["dev"]).

    python kohya_shapes.py PIPELINE_FOLDER OUT_FOLDER DEVICE

A pipeline text encoder whose every tensor has kohya's name and shape is copied (CLIP-L's in transformers 4's
`text_model.*` names, which transformers 5 leaves out); anything else gets random bf16 weights of kohya's shapes
(norm scales 1, biases 0, the rest N(0, 0.02)), built on DEVICE: T5-XXL is 4.7B parameters. The pipeline's VAE is
converted to BFL names (kohya_files.flux_vae_to_bfl) and used when its shapes are the AE's. OUT_FOLDER/notes.txt says
which is which."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file


def random_like(shapes: dict[str, torch.Size], device: str) -> dict[str, torch.Tensor]:
    g = torch.Generator(device).manual_seed(0)
    out = {}
    for key, shape in shapes.items():
        if len(shape) == 1 and "norm" in key and key.endswith(("weight", "scale")):
            t = torch.ones(shape, dtype=torch.bfloat16)
        elif len(shape) == 1:
            t = torch.zeros(shape, dtype=torch.bfloat16)
        else:
            t = (torch.randn(shape, generator=g, device=device) * 0.02).to(torch.bfloat16).cpu()
        out[key] = t
    return out


def pipeline_weights(folder: Path) -> dict[str, torch.Tensor]:
    sd = {}
    for shard in sorted(folder.glob("*.safetensors")):
        sd.update(load_file(shard))
    return sd


def main() -> None:
    from library import flux_models, flux_utils

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from peers.kohya_files import flux_vae_to_bfl, transformers4_clip_names

    pipeline, out, device = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
    out.mkdir(parents=True, exist_ok=True)
    built = {"clip_l": flux_utils.load_clip_l(None, torch.bfloat16, "cpu", state_dict={}),
             "t5xxl": flux_utils.load_t5xxl(None, torch.bfloat16, "cpu", state_dict={})}
    with torch.device("meta"):
        built["ae"] = flux_models.AutoEncoder(flux_models.configs["dev"].ae_params)
    sources = {"clip_l": pipeline / "text_encoder", "t5xxl": pipeline / "text_encoder_2", "ae": pipeline / "vae"}
    notes = []
    for name, model in built.items():
        shapes = {k: v.shape for k, v in model.state_dict().items()}
        theirs = pipeline_weights(sources[name])
        if name == "clip_l":  # transformers 5 saves CLIP-L without the prefix kohya's transformers 4 reads
            theirs = transformers4_clip_names(theirs)
        if "shared.weight" in theirs:  # T5's tied embedding, saved once
            theirs.setdefault("encoder.embed_tokens.weight", theirs["shared.weight"])
        if name == "ae":
            try:
                theirs = flux_vae_to_bfl(theirs)
            except ValueError:
                theirs = {}
        same = bool(theirs) and all(k in theirs and theirs[k].shape == s for k, s in shapes.items())
        if same:
            weights = {k: theirs[k].to(torch.bfloat16).contiguous() for k in shapes}
            notes.append(f"{name}: the pipeline's own weights")
        else:
            weights = random_like(shapes, device)
            count = sum(t.numel() for t in weights.values())
            notes.append(f"{name}: random weights of the shape kohya builds ({count / 1e6:.0f}M parameters)")
        save_file(weights, str(out / f"{name}.safetensors"))
        del weights, theirs
    (out / "notes.txt").write_text("\n".join(notes) + "\n")


if __name__ == "__main__":
    main()
