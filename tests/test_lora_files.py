"""The LoRA files of every image/video family, through the real entry point, trained with alpha != rank: final/'s
file and a checkpoint's file, loaded with diffusers' own `load_lora_weights` into a fresh tiny pipeline and
fused, change exactly the trained weights, each by alpha/rank * B @ A of the trained PEFT modules (restored from
the checkpoint's exact tensors). Numbers, not key names. Then the toolkit's own loader reads a checkpoint."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from helpers import cpu_runtime, data_cache_apart, diffusion_train_args
from lora_math import compare_updates, expected_updates, plain_weights
from toolkit.tiny import resolve_model_path
from toolkit.train.checkpoint import trainable_from_file
from toolkit.models.base import load_trainable_state_dict, trainable_state_dict

# family, quickstart, pipeline class, extra overrides; each trains with rank 4, alpha 6 (scale 1.5)
CASES = {
    "sd": ("quickstart_sd.yaml", "StableDiffusionPipeline", ["train.train_text_encoder=true"]),
    "sdxl": ("quickstart_sdxl.yaml", "StableDiffusionXLPipeline", ["train.train_text_encoder=true"]),
    "flux": ("quickstart_flux.yaml", "FluxPipeline", []),
    "sd3": ("quickstart_sd3.yaml", "StableDiffusion3Pipeline", []),
    "qwen_image": ("quickstart_qwen_image.yaml", "QwenImagePipeline", []),
    "qwen_image_edit": ("quickstart_qwen_image_edit.yaml", "QwenImageEditPlusPipeline", []),
    "flux_kontext": ("quickstart_flux_kontext.yaml", "FluxKontextPipeline", []),
    "z_image": ("quickstart_z_image.yaml", "ZImagePipeline", []),
    "flux2": ("quickstart_flux2.yaml", "Flux2Pipeline", []),
    "chroma": ("quickstart_chroma.yaml", "ChromaPipeline", []),
    "wan21": ("quickstart_wan21.yaml", "WanPipeline", []),
    "wan22": ("quickstart_wan22.yaml", "WanPipeline", ["train.expert_switch_every=1"]),
    "ltx2": ("quickstart_ltx2.yaml", "LTX2Pipeline", []),
}
# Families whose diffusers pipelines have no load_lora_weights: their files are read by the transformer's own loader
# in their test file (and by ComfyUI's in bench/check_exports.py)
NO_PIPELINE_LOADER = {"hunyuan_video15": "tests/test_hunyuan15.py (transformer.load_lora_adapter)"}
# Wan 2.2 A14B: each expert's file in its own folder, the second loaded into transformer_2
EXPERT_FILES = {"transformer": ("high_noise", {}), "transformer_2": ("low_noise", {"load_into_transformer_2": True})}


# Latent and text caches of this module's runs kept apart from the session's (conftest.py)
pytestmark = pytest.mark.usefixtures("own_data_caches")


def trained_adapter(run_dir: Path, step_dir: Path):
    """The run's adapter (model loaded, no data) holding the checkpoint's exact trainable tensors."""
    from toolkit.plan.run import load_run
    from toolkit.models import build_adapter

    run = load_run([run_dir / "config.yaml"], [])
    adapter = build_adapter(run.cfg, cpu_runtime(run, run_dir))
    adapter.load()
    load_trainable_state_dict(adapter.network, trainable_from_file(load_file(str(step_dir / "trainable_state.safetensors"))))
    return adapter


def applied_updates(pipeline_name: str, family: str, folder: Path, names: list[str], expected) -> dict[str, tuple]:
    """{component: (modules matched, max abs diff)} after load_lora_weights(folder) and fuse_lora in a fresh pipeline."""
    import diffusers

    from toolkit.data.qwen_vl_processor import processor_override

    path = resolve_model_path(f"tiny:{family}")
    extra = processor_override(path) if pipeline_name == "QwenImageEditPlusPipeline" else {}  # no torchvision here
    pipe = getattr(diffusers, pipeline_name).from_pretrained(path, **extra)
    before = {name: plain_weights(getattr(pipe, name)) for name in names}
    if family == "wan22":
        for name in names:
            sub, kwargs = EXPERT_FILES[name]
            pipe.load_lora_weights(str(folder / sub), adapter_name=name, **kwargs)
    else:
        pipe.load_lora_weights(str(folder))
    pipe.fuse_lora(components=names)
    return {name: compare_updates(before[name], plain_weights(getattr(pipe, name)), expected[name]) for name in names}


@pytest.mark.parametrize("family", list(CASES))
def test_final_and_checkpoint_files_load_in_diffusers_at_the_trained_scale(family, tmp_path, run_cli):
    config, pipeline_name, extra = CASES[family]
    out = tmp_path / "run"
    assert run_cli(*diffusion_train_args(config, out, "network.rank=4", "network.alpha=6", "save.every=1",
                                         "sample.prompts=[]", "save.format=diffusers", *extra)) == 0
    checkpoint = out / "checkpoints" / "step-000002"
    adapter = trained_adapter(out, checkpoint)
    names = list(adapter.network.keys())
    assert names == {"sd": ["unet", "text_encoder"], "sdxl": ["unet", "text_encoder", "text_encoder_2"],
                     "wan22": ["transformer", "transformer_2"]}.get(family, ["transformer"])
    expected = {name: expected_updates(adapter.network[name]) for name in names}
    # step 2 is the last step: final/ and the checkpoint hold the same update
    for folder in (out / "final", checkpoint):
        for name, (matched, worst) in applied_updates(pipeline_name, family, folder, names, expected).items():
            assert matched == len(expected[name]) > 0
            assert worst < 1e-6, (folder.name, name, worst)

    # The toolkit's own loader (sampling from a run) takes a checkpoint folder: the same update again.
    fresh = trained_adapter(out, out / "checkpoints" / "step-000001")
    before = {name: expected_updates(fresh.network[name]) for name in names}
    fresh.load_lora(checkpoint)
    assert any(not torch.allclose(before[n][k], expected[n][k]) for n in names for k in before[n])  # step 1 differed
    for name in names:
        got = expected_updates(fresh.network[name])
        assert got.keys() == expected[name].keys()
        assert max(float((got[k] - expected[name][k]).abs().max()) for k in got) < 1e-6


def test_sd_kohya_keys_name_text_encoders_as_kohya_tools_do(tmp_path, run_cli):
    """The key names ComfyUI (model_lora_keys_clip) and sd-scripts read, whatever transformers calls the modules:
    SD 1.x text encoder as lora_te_text_model_..., SDXL's as lora_te1_ / lora_te2_text_model_...; an .alpha per
    module holding the trained alpha."""
    for family, prefixes in (("sd", {"lora_unet", "lora_te"}), ("sdxl", {"lora_unet", "lora_te1", "lora_te2"})):
        out = tmp_path / family
        assert run_cli(*diffusion_train_args(f"quickstart_{family}.yaml", out, "train.steps=1", "sample.prompts=[]",
                                             "network.rank=4", "network.alpha=6", "train.train_text_encoder=true",
                                             "save.format=kohya")) == 0
        files = sorted(p.name for p in (out / "final").iterdir())
        assert files == ["pytorch_lora_weights.safetensors", f"quickstart_{family}_kohya.safetensors"]
        state = load_file(str(out / "final" / f"quickstart_{family}_kohya.safetensors"))
        modules = {k.split(".")[0] for k in state}
        assert {m.split("_text_model_")[0] if "_text_model_" in m else "lora_unet" for m in modules} == prefixes
        te = "lora_te" if family == "sd" else "lora_te1"
        assert f"{te}_text_model_encoder_layers_0_self_attn_q_proj" in modules
        assert "lora_unet_down_blocks_1_attentions_0_transformer_blocks_0_attn1_to_q" in modules
        assert set(state) == {f"{m}.{s}" for m in modules for s in ("lora_down.weight", "lora_up.weight", "alpha")}
        assert {float(state[f"{m}.alpha"]) for m in modules} == {6.0}
        with safe_open(str(out / "final" / "pytorch_lora_weights.safetensors"), "pt") as f:
            assert f.metadata()["ss_network_alpha"] == "6.0" and f.metadata()["ss_network_dim"] == "4"


def test_old_checkpoint_with_lora_safetensors_resumes(tmp_path, run_cli, capsys):
    """A run folder whose checkpoint has the old tensor-file name (lora.safetensors, no LoRA files) resumes."""
    import json

    from toolkit.train.checkpoint import _sha256

    common = ("sample.prompts=[]", "save.every=1", "train.steps=1")
    out = tmp_path / "run"
    assert run_cli(*diffusion_train_args("quickstart_sd.yaml", out, *common)) == 0
    step = out / "checkpoints" / "step-000001"
    meta = json.loads((step / "meta.json").read_text())
    for name in meta.pop("lora_files"):  # as an older toolkit wrote it
        (step / name).unlink()
        del meta["files"][name]
    saved = trainable_from_file(load_file(str(step / "trainable_state.safetensors")))
    (step / "trainable_state.safetensors").unlink()
    save_file(saved, str(step / "lora.safetensors"))  # PEFT's parameter names, no prefix
    del meta["files"]["trainable_state.safetensors"]
    meta["files"]["lora.safetensors"] = {"bytes": (step / "lora.safetensors").stat().st_size,
                                         "sha256": _sha256(step / "lora.safetensors")}
    (step / "meta.json").write_text(json.dumps(meta))

    assert run_cli(*diffusion_train_args("quickstart_sd.yaml", out, "sample.prompts=[]", "save.every=1",
                                         "train.steps=2")) == 0
    assert f"resumed from {step} (step 1)" in capsys.readouterr().err
    resumed = trained_adapter(out, out / "checkpoints" / "step-000002")
    assert trainable_state_dict(resumed.network).keys() == saved.keys()
    assert any(not torch.equal(trainable_state_dict(resumed.network)[k], saved[k]) for k in saved)  # it trained on


def test_the_trainers_copy_is_no_lora_for_loaders(tmp_path, run_cli):
    """trainable_state.safetensors holds names no LoRA loader maps: Qwen-Image's diffusers reader refuses it
    (ComfyUI would read PEFT's own `lora_A.default` names for Qwen-Image, at scale 1)."""
    import diffusers

    out = tmp_path / "run"
    assert run_cli(*diffusion_train_args("quickstart_qwen_image.yaml", out, "train.steps=1", "sample.prompts=[]",
                                         "save.format=diffusers")) == 0
    state = load_file(str(out / "checkpoints" / "step-000001" / "trainable_state.safetensors"))
    assert state and all(k.startswith("trainable_state.transformer.") and ".lora_" in k for k in state)
    pipe = diffusers.QwenImagePipeline.from_pretrained(resolve_model_path("tiny:qwen_image"))
    with pytest.raises(Exception, match="not found in the base model"):
        pipe.load_lora_weights(str(out / "checkpoints" / "step-000001"), weight_name="trainable_state.safetensors")


def test_loading_a_folder_without_a_lora_file_names_the_fix(tmp_path):
    from toolkit.errors import UserError
    from toolkit.models.diffusion_files import lora_file_in

    with pytest.raises(UserError, match="no pytorch_lora_weights.safetensors here or in its final/"):
        lora_file_in(tmp_path)


def test_every_family_with_a_lora_file_has_a_case():
    from toolkit.config.families import FAMILY_SPECS

    assert set(CASES) | set(NO_PIPELINE_LOADER) == {name for name, spec in FAMILY_SPECS.items()
                                                   if spec.save_formats[0] != "peft"}
    assert not set(CASES) & set(NO_PIPELINE_LOADER)
