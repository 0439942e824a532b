"""LoKr and LoHa (network.type lokr / loha): trained through the entry point on tiny:sd, the file written in
LyCORIS keys, and read back by a loader the toolkit did not write: the LyCORIS library's kohya network
(lycoris.kohya.create_network_from_weights + merge_to, what kohya's sd-scripts runs for a LyCORIS file), whose
merged weights must change by exactly the update PEFT's trained layers apply (get_delta_weight). The package
(lycoris-lora, in the test extra) is imported from the environment, or from TOOLKIT_LYCORIS_DEPS (a
`pip install --target` folder of lycoris-lora, einops and toml)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from toolkit.models.base import load_trainable_state_dict



@pytest.fixture
def lycoris_kohya():
    """The LyCORIS library's kohya module (the test extra's lycoris-lora, or TOOLKIT_LYCORIS_DEPS)."""
    if os.environ.get("TOOLKIT_LYCORIS_DEPS") and os.environ["TOOLKIT_LYCORIS_DEPS"] not in sys.path:
        sys.path.append(os.environ["TOOLKIT_LYCORIS_DEPS"])
    return pytest.importorskip("lycoris.kohya", reason="lycoris-lora (the test extra) is not installed")

RUN = ["train.steps=2", "train.batch_size=2", "train.lr=5e-2", "save.every=1", "sample.prompts=[]",
       "network.alpha=3", "save.dtype=fp32", "train.optimizer=adamw"]


def _train(run_cli, out: Path, kind: str, rank: int, *extra: str) -> Path:
    assert run_cli("train", "configs/examples/quickstart_sd.yaml", f"run.output_dir={out}", *RUN,
                   f"network.type={kind}", f"network.rank={rank}", *extra) == 0
    return out


def _trained_adapter(out: Path, step: int):
    """The run's adapter holding checkpoint `step`'s exact trainable tensors."""
    from toolkit.models import build_adapter
    from toolkit.models.base import Runtime
    from toolkit.plan.run import load_run
    from toolkit.train.checkpoint import trainable_from_file

    run = load_run([out / "config.yaml"], [])
    adapter = build_adapter(run.cfg, Runtime(torch.device("cpu"), run.device, torch.float32, torch.float32, out))
    adapter.load()
    state = load_file(str(out / "checkpoints" / f"step-{step:06d}" / "trainable_state.safetensors"))
    load_trainable_state_dict(adapter.network, trainable_from_file(state))
    return adapter


def _peft_updates(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """{weight name in the plain model: PEFT's own update} of every LoKr / LoHa layer."""
    from peft.tuners.lycoris_utils import LycorisLayer

    return {f"{path}.weight": layer.get_delta_weight("default").detach().double()
            for path, layer in model.named_modules() if isinstance(layer, LycorisLayer)}


def _plain_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of `model` without its adapter (PEFT's layers unwrapped to their base layers)."""
    import copy

    from peft.tuners.tuners_utils import BaseTunerLayer

    plain = copy.deepcopy(model)
    for path, layer in list(plain.named_modules()):
        if isinstance(layer, BaseTunerLayer):
            parent, _, child = path.rpartition(".")
            setattr(plain.get_submodule(parent) if parent else plain, child, layer.get_base_layer())
    return plain


def _lycoris_merged(lycoris_kohya, file: Path, unet: torch.nn.Module, text_encoder: torch.nn.Module | None,
                    monkeypatch):
    """(weights before, after) of the UNet and text encoder once the LyCORIS library has merged `file` into them.
    The network's default targets are emptied first: create_network_from_weights builds its modules from the
    file's keys, but first constructs a default network, whose preset matches tiny:sd's time_embedding twice."""
    network_class = lycoris_kohya.LycorisNetworkKohya
    for attr in ("UNET_TARGET_REPLACE_MODULE", "UNET_TARGET_REPLACE_NAME", "TEXT_ENCODER_TARGET_REPLACE_MODULE",
                 "TEXT_ENCODER_TARGET_REPLACE_NAME"):
        monkeypatch.setattr(network_class, attr, [])
    weights = load_file(str(file))
    before = {**{f"unet.{k}": v.double().clone() for k, v in unet.state_dict().items()},
              **({f"te.{k}": v.double().clone() for k, v in text_encoder.state_dict().items()} if text_encoder else {})}
    # kohya names CLIP modules as transformers 4's CLIPTextModel has them, under text_model. (lora_export.py)
    named_as_kohya = None
    if text_encoder is not None:
        named_as_kohya = torch.nn.Module()
        named_as_kohya.text_model = text_encoder
    network, _ = lycoris_kohya.create_network_from_weights(1.0, str(file), None, named_as_kohya, unet,
                                                           weights_sd=weights, for_inference=True)
    network.merge_to(named_as_kohya, unet, weights, torch.float32, "cpu")
    after = {**{f"unet.{k}": v.double() for k, v in unet.state_dict().items()},
             **({f"te.{k}": v.double() for k, v in text_encoder.state_dict().items()} if text_encoder else {})}
    return before, after


# Decomposed factors are checked at alpha = rank: LyCORIS 4.1.3's LokrModule and LohaModule multiply by alpha / rank
# twice when they merge (in get_weight and again in get_diff_weight: at alpha 3, rank 2 the merged update is 1.5 x
# PEFT's), where ComfyUI (comfy/weight_adapter/lokr.py, loha.py), PEFT and the toolkit apply it once; ComfyUI's
# loader is checked at alpha 3, rank 2 in test_lycoris_comfyui.py.
@pytest.mark.parametrize("kind,rank,extra", [
    ("lokr", 2, ("network.alpha=2",)),                      # w1 full, w2 decomposed (rank 2 < 8 / 2)
    ("lokr", 4, ()),                                        # w1 and w2 full: the scale 3/4 folded into w1
    ("loha", 2, ("network.alpha=2", "train.train_text_encoder=true")),  # the text encoder too (lora_te_ names)
])
def test_lycoris_library_merges_the_trained_update(run_cli, tmp_path, own_data_caches, monkeypatch, lycoris_kohya,
                                                  kind, rank, extra):
    out = _train(run_cli, tmp_path / "run", kind, rank, *extra)
    file = out / "final" / "pytorch_lora_weights.safetensors"
    with safe_open(str(file), "pt") as f:
        keys, metadata = list(f.keys()), f.metadata()
    suffixes = {k.rsplit(".", 1)[1] for k in keys}
    expected_suffixes = {("lokr", 2): {"lokr_w1", "lokr_w2_a", "lokr_w2_b", "alpha"},
                         ("lokr", 4): {"lokr_w1", "lokr_w2", "alpha"},
                         ("loha", 2): {"hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b", "alpha"}}[(kind, rank)]
    assert suffixes == expected_suffixes
    assert all(k.startswith(("lora_unet_", "lora_te_")) for k in keys)
    assert any(k.startswith("lora_te_") for k in keys) == ("train.train_text_encoder=true" in extra)
    assert metadata["ss_network_module"] == "lycoris.kohya" and f'"algo": "{kind}"' in metadata["ss_network_args"]

    adapter = _trained_adapter(out, 2)  # final/ is step 2's LoRA (no EMA)
    expected = {f"unet.{k}": v for k, v in _peft_updates(adapter.network["unet"]).items()}
    if "train.train_text_encoder=true" in extra:
        expected.update({f"te.{k}": v for k, v in _peft_updates(adapter.network["text_encoder"]).items()})
    unet = _plain_copy(adapter.component("unet"))
    encoder = _plain_copy(adapter.component("text_encoder")) if "train.train_text_encoder=true" in extra else None
    before, after = _lycoris_merged(lycoris_kohya, file, unet, encoder, monkeypatch)

    changed = {k for k in after if not torch.equal(after[k], before[k])}
    assert changed == set(expected) and len(expected) == len(keys) // len(expected_suffixes)
    assert min(float(u.abs().max()) for u in expected.values()) > 1e-4  # every module trained away from zero
    worst = max(float((after[k] - before[k] - update).abs().max()) for k, update in expected.items())
    assert worst < 1e-5, worst


def test_init_from_reads_the_lycoris_file_back_at_the_file_s_scale(run_cli, tmp_path, own_data_caches):
    """network.init_from of a LoKr file trained at alpha 3 into a run at alpha 6: the run's first update equals the
    file's (its w1 halved, since the run's scale is twice the file's)."""
    out = _train(run_cli, tmp_path / "run", "lokr", 2)
    second = tmp_path / "second"
    assert run_cli("train", "configs/examples/quickstart_sd.yaml", f"run.output_dir={second}", *RUN,
                   "network.type=lokr", "network.rank=2", "network.alpha=6", "train.lr=0", "train.steps=1",
                   f"network.init_from={out}") == 0
    first = _peft_updates(_trained_adapter(out, 2).network["unet"])
    again = _peft_updates(_trained_adapter(second, 1).network["unet"])
    assert first.keys() == again.keys()
    for key, update in first.items():
        torch.testing.assert_close(again[key], update, rtol=1e-6, atol=1e-7)


def test_a_flux2_lokr_file_names_modules_as_comfyui_s_flux2_model_and_reads_back(run_cli, tmp_path, own_data_caches):
    """FLUX.2's LoKr file is for ComfyUI: the feed-forwards and the single blocks' projections, which ComfyUI's Flux
    map lacks, take its Flux.2 model's names (the rest keep diffusers' `transformer.` names, which it maps), and
    network.init_from reads the file back to the same update (ComfyUI's own loader: test_lycoris_comfyui.py)."""
    flux2 = ["configs/examples/quickstart_flux2_references.yaml", *RUN, "network.type=lokr", "network.rank=2",
             "network.target_modules=all-linear"]
    out = tmp_path / "run"
    assert run_cli("train", *flux2, f"run.output_dir={out}") == 0
    modules = {k.rsplit(".", 1)[0] for k in load_file(str(out / "final" / "pytorch_lora_weights.safetensors"))}
    assert {"diffusion_model.double_blocks.0.img_mlp.0", "diffusion_model.double_blocks.0.txt_mlp.2",
            "diffusion_model.single_blocks.0.linear1", "diffusion_model.single_blocks.0.linear2",
            "transformer.transformer_blocks.0.attn.to_q"} <= modules
    assert not any("ff.linear_in" in m or "to_qkv_mlp_proj" in m or "single_transformer_blocks.0.attn.to_out" in m
                   for m in modules)

    second = tmp_path / "second"
    assert run_cli("train", *flux2, f"run.output_dir={second}", "train.lr=0", "train.steps=1",
                   f"network.init_from={out}") == 0
    first = _peft_updates(_trained_adapter(out, 2).network["transformer"])
    again = _peft_updates(_trained_adapter(second, 1).network["transformer"])
    assert first.keys() == again.keys() and len(first) == len(modules)
    for key, update in first.items():
        torch.testing.assert_close(again[key], update, rtol=1e-6, atol=1e-7)

    # a file written before the rename (those modules under diffusers' names) is read under today's names
    renames = {"diffusion_model.double_blocks.": "transformer.transformer_blocks.",
               "diffusion_model.single_blocks.": "transformer.single_transformer_blocks."}
    inner = {".img_mlp.0.": ".ff.linear_in.", ".img_mlp.2.": ".ff.linear_out.", ".txt_mlp.0.": ".ff_context.linear_in.",
             ".txt_mlp.2.": ".ff_context.linear_out.", ".linear1.": ".attn.to_qkv_mlp_proj.",
             ".linear2.": ".attn.to_out."}
    old_names = {}
    for key, value in load_file(str(out / "final" / "pytorch_lora_weights.safetensors")).items():
        for new_prefix, old_prefix in renames.items():
            if key.startswith(new_prefix):
                key = old_prefix + key[len(new_prefix):]
                key = next((key.replace(a, b) for a, b in inner.items() if a in key), key)
        old_names[key] = value
    assert sum(k.startswith("diffusion_model.") for k in old_names) == 0
    old_file = tmp_path / "old_names.safetensors"
    save_file(old_names, str(old_file))
    third = tmp_path / "third"
    assert run_cli("train", *flux2, f"run.output_dir={third}", "train.lr=0", "train.steps=1",
                   f"network.init_from={old_file}") == 0
    from_old = _peft_updates(_trained_adapter(third, 1).network["transformer"])
    for key, update in first.items():
        torch.testing.assert_close(from_old[key], update, rtol=1e-6, atol=1e-7)


def test_a_lora_file_into_a_lokr_run_is_a_named_error(run_cli, tmp_path, own_data_caches, capsys):
    out = _train(run_cli, tmp_path / "run", "loha", 2)
    code = run_cli("train", "configs/examples/quickstart_sd.yaml", f"run.output_dir={tmp_path / 'second'}", *RUN,
                   "network.type=lokr", "network.rank=2", "train.steps=1", f"network.init_from={out}")
    err = capsys.readouterr().err
    assert code == 2 and "it is a loha file, network.type is lokr" in err and "fix: set network.type=loha" in err


@pytest.mark.parametrize("config,overrides,message", [
    ("quickstart_llm.yaml", ["network.type=lokr"], "'network.type'=lokr is for the diffusion families"),
    ("quickstart_sd.yaml", ["network.type=loha", "network.dropout=0.1"],
     "'network.dropout'=0.1 is a LoRA setting that PEFT's loha adapter does not have"),
    ("quickstart_sd.yaml", ["network.lokr_factor=4"], "'network.lokr_factor' applies to network.type=lokr only"),
    ("quickstart_sd.yaml", ["network.type=lokr", "network.lokr_factor=0"], "'network.lokr_factor'=0 splits nothing"),
])
def test_lycoris_settings_that_cannot_apply_are_named(run_cli, capsys, config, overrides, message):
    code = run_cli("validate", f"configs/examples/{config}", *overrides)
    err = capsys.readouterr().err
    assert code == 2 and message in err and "Traceback" not in err
