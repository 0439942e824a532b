"""kohya sd-scripts' Flux loss-parity run trains the bench's tiny pipeline itself: bench/peers/kohya_launch.py sets
kohya's fixed Flux.1 / AE / CLIP-L / T5-XXL shapes to the pipeline's, kohya_files.write_flux_pipeline writes every
model in the names kohya's loaders read, kohya.check_loaded fails a row whose log says a model was not loaded whole,
and the scorer splits kohya's fused linear1 at the pipeline's width (diffusers' converter knows Flux.1's only).

With .whl-peers/kohya (absent in CI, so skipped there), in kohya's own environment (its transformers 4.54): its
loaders (library/flux_utils.py) hold every tensor of the four models, equal to the pipeline's; its tokenizers and
text-encoding strategy give the scorer's text states and its AE the scorer's latents; the same CLIP-L loader on the
file transformers 5 wrote logs missing keys, which check_loaded fails; and its LoRA network on its Flux gives the
output the scorer's pipeline gives with the file it saves."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import REPO
from helpers import kohya_env

sys.path.insert(0, str(REPO / "bench"))

import loss_parity  # noqa: E402
from diffusion_models import write_pipeline  # noqa: E402
from peers import kohya  # noqa: E402
from peers.common import PeerFailed  # noqa: E402
from peers.kohya_files import (flux_to_bfl, flux_vae_to_bfl, tokenizer_cache, transformers4_clip_names,  # noqa: E402
                               write_flux_pipeline)

PEERS = REPO / "bench" / "peers"
needs_kohya = pytest.mark.skipif(not (REPO / ".whl-peers" / "kohya" / "source.tar.gz").exists(),
                                 reason="needs .whl-peers/kohya (bash bench/peers/packages.sh kohya)")


@pytest.fixture(scope="module")
def flux(tmp_path_factory) -> tuple[Path, Path]:
    """(the bench's tiny Flux pipeline, the parity's block images)."""
    root = tmp_path_factory.mktemp("flux")
    torch.manual_seed(0)
    write_pipeline("flux", root / "flux", "cpu", tiny=True)
    loss_parity.write_block_images(root / "data")
    return root / "flux", root / "data"


def pipeline_in_kohya_names(pipe) -> dict[str, torch.Tensor]:
    """Every tensor of the pipeline's four models, under kohya's model name and its loaders' key names."""
    t5 = pipe.text_encoder_2.state_dict()
    t5.setdefault("encoder.embed_tokens.weight", t5["shared.weight"])
    models = {"flux": flux_to_bfl(pipe.transformer.state_dict()),
              "clip_l": transformers4_clip_names(pipe.text_encoder.state_dict()), "t5xxl": t5,
              "ae": flux_vae_to_bfl(pipe.vae.state_dict())}
    return {f"{name}.{key}": value for name, state in models.items() for key, value in state.items()}


def test_parity_files_hold_every_pipeline_tensor_in_kohyas_names(flux, tmp_path):
    folder, _ = flux
    files, shapes_file = write_flux_pipeline(folder, tmp_path / "files")
    shapes = json.loads(shapes_file.read_text())
    assert shapes["flux"] == {"in_channels": 64, "vec_in_dim": 768, "context_in_dim": 4096, "hidden_size": 32,
                              "num_heads": 2, "axes_dim": [4, 6, 6], "guidance_embed": True}
    assert shapes["ae"]["ch"] == 8 and shapes["ae"]["ch_mult"] == [1, 2, 4, 4] and shapes["ae_groups"] == 8
    assert shapes["clip_l"]["num_hidden_layers"] == 2 and shapes["t5xxl"]["d_model"] == 4096
    written = {f"{name}.{key}": value for name, file in files.items() for key, value in load_file(file).items()}
    pipe = loss_parity.scored_pipeline(folder)
    ours = pipeline_in_kohya_names(pipe)
    assert written.keys() == ours.keys()
    assert all(torch.equal(written[k].float(), ours[k]) for k in ours)
    assert all(k.startswith("clip_l.text_model.") for k in written if k.startswith("clip_l."))


def test_check_loaded_reads_kohyas_loader_lines(tmp_path):
    log = tmp_path / "output.log"
    ok = "".join(f"2026-11-29 INFO     Loaded {name}: <All keys matched successfully>   flux_utils.py:1\n"
                 for name in kohya.FLUX_MODELS)
    log.write_text(ok)
    kohya.check_loaded(log, kohya.FLUX_MODELS)
    for bad, said in (
            (ok.replace("Loaded CLIP-L: <All keys matched successfully>",
                        "Loaded CLIP-L: _IncompatibleKeys(missing_keys=['text_model.embeddings.token_embedding.weight'"
                        "], unexpected_keys=['embeddings.token_embedding.weight'])"), "Loaded CLIP-L: _Incompatible"),
            (ok.replace("Loaded AE", "Built AE"), "no 'Loaded AE: "),
            (ok + "Some weights of CLIPTextModel were not initialized from the model checkpoint\n", "not initialized")):
        log.write_text(bad)
        with pytest.raises(PeerFailed, match=said):
            kohya.check_loaded(log, kohya.FLUX_MODELS)


def test_scorer_splits_kohyas_fused_linear1_at_the_pipelines_width(flux, tmp_path):
    """A kohya Flux LoRA file (random, every module kohya's lora_flux adapts, alpha != rank) read by the scorer: each
    fused layer's update up @ down * alpha / rank is the pipeline's adapted layers' updates, back in BFL names."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    folder, _ = flux
    weights = load_file(next((folder / "transformer").glob("*.safetensors")))
    bfl = flux_to_bfl(weights)
    targets = [k.removesuffix(".weight") for k, v in bfl.items() if v.dim() == 2 and "_blocks." in k]
    generator = torch.Generator().manual_seed(0)
    lora, expected = {}, {}
    for target in targets:
        out_features, in_features = bfl[target + ".weight"].shape
        name = "lora_unet_" + target.replace(".", "_")
        down = torch.randn(4, in_features, generator=generator) * 0.1
        up = torch.randn(out_features, 4, generator=generator) * 0.1
        lora.update({f"{name}.lora_down.weight": down, f"{name}.lora_up.weight": up,
                     f"{name}.alpha": torch.tensor(8.0)})
        expected[target + ".weight"] = up @ down * 2.0
    assert sum("linear1" in t for t in targets) == 4 and sum("qkv" in t for t in targets) == 4
    save_file(lora, str(tmp_path / "kohya.safetensors"))

    pipe = loss_parity.scored_pipeline(folder, tmp_path / "kohya.safetensors")
    deltas = {k: torch.zeros_like(v, dtype=torch.float32) for k, v in weights.items()}
    for name, layer in pipe.transformer.named_modules():
        if isinstance(layer, BaseTunerLayer) and "scored" in layer.lora_A:
            deltas[name + ".weight"] = layer.get_delta_weight("scored")
    got = flux_to_bfl(deltas)
    assert loss_parity.lora_coverage(pipe, tmp_path / "kohya.safetensors") == (32, 52)  # qkv in 3, linear1 in 4
    for key, delta in got.items():
        if key in expected:
            assert torch.allclose(delta, expected[key], atol=1e-6, rtol=1e-5), key
        else:
            assert not delta.any(), key  # nothing else adapted


KOHYA_FLUX = """
import json, sys, torch
shapes, files, tokenizers, peers, out, clip_as_saved, *captions = sys.argv[1:]
sys.path.insert(0, peers)
import kohya_launch
kohya_launch.configure(json.load(open(shapes)))
from library import flux_utils, strategy_flux
files = json.loads(files)
_, flux = flux_utils.load_flow_model(files["flux"], None, "cpu")
clip = flux_utils.load_clip_l(files["clip_l"], None, "cpu")
t5 = flux_utils.load_t5xxl(files["t5xxl"], None, "cpu")
ae = flux_utils.load_ae(files["ae"], torch.float32, "cpu")
tokenize = strategy_flux.FluxTokenizeStrategy(512, tokenizers)
tokens = tokenize.tokenize(captions)
with torch.no_grad():
    pooled, t5_out, _, _ = strategy_flux.FluxTextEncodingStrategy().encode_tokens(tokenize, [clip, t5], tokens)
    mean = ae.encoder(torch.load(out + "/pixels.pt", weights_only=True)).chunk(2, dim=1)[0]
state = {f"{name}.{k}": v for name, model in (("flux", flux), ("clip_l", clip), ("t5xxl", t5), ("ae", ae))
         for k, v in model.state_dict().items()}
torch.save({"state": state, "tokens": tokens, "pooled": pooled, "t5": t5_out,
            "latents": ae.scale_factor * (mean - ae.shift_factor)}, out + "/kohya.pt")
print("=== the CLIP-L file as transformers 5 saved it ===", file=sys.stderr, flush=True)
flux_utils.load_clip_l(clip_as_saved, None, "cpu")
"""


@needs_kohya
def test_kohya_loads_the_pipelines_flux_models_whole(flux, tmp_path):
    folder, data = flux
    env, src = kohya_env(tmp_path)
    env["COLUMNS"] = kohya.LOG_COLUMNS
    files, shapes = write_flux_pipeline(folder, tmp_path / "files")
    tokenizers = tokenizer_cache("flux", folder, tmp_path / "tokenizers")
    images = sorted(data.glob("*.png"))
    captions = [image.with_suffix(".txt").read_text().strip() for image in images]
    pixels = torch.cat([loss_parity.pixels(image) for image in images])
    torch.save(pixels, tmp_path / "pixels.pt")
    as_saved = folder / "text_encoder" / "model.safetensors"  # transformers 5's names
    done = subprocess.run([sys.executable, "-c", KOHYA_FLUX, str(shapes),
                           json.dumps({k: str(v) for k, v in files.items()}), str(tokenizers), str(PEERS),
                           str(tmp_path), str(as_saved), *captions],
                          cwd=src, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-2000:]
    ours_log, as_saved_log = done.stderr.split("=== the CLIP-L file as transformers 5 saved it ===")
    (tmp_path / "ours.log").write_text(ours_log)
    kohya.check_loaded(tmp_path / "ours.log", kohya.FLUX_MODELS)  # "Loaded MODEL: <All keys matched ...>" x 4
    (tmp_path / "as-saved.log").write_text(as_saved_log)
    with pytest.raises(PeerFailed, match="Loaded CLIP-L: _IncompatibleKeys"):  # what the fix's copy prevents
        kohya.check_loaded(tmp_path / "as-saved.log")

    theirs = torch.load(tmp_path / "kohya.pt", weights_only=True)
    pipe = loss_parity.scored_pipeline(folder)
    ours = pipeline_in_kohya_names(pipe)
    assert theirs["state"].keys() == ours.keys()  # flux 100, clip_l 36, t5xxl 22, ae 180 tensors
    assert all(torch.equal(theirs["state"][k].float(), ours[k]) for k in ours)  # every one exact
    with torch.no_grad():
        text, pooled, _ = pipe.encode_prompt(prompt=captions, prompt_2=None, device="cpu")
        vae = pipe.vae
        latents = (vae.encode(pixels).latent_dist.mode() - vae.config.shift_factor) * vae.config.scaling_factor
    ids = [pipe.tokenizer(captions, padding="max_length", max_length=77, truncation=True, return_tensors="pt"),
           pipe.tokenizer_2(captions, padding="max_length", max_length=512, truncation=True, return_tensors="pt")]
    assert all(torch.equal(mine.input_ids, kohyas) for mine, kohyas in zip(ids, theirs["tokens"]))
    assert torch.allclose(theirs["pooled"], pooled, atol=1e-5, rtol=0), (theirs["pooled"] - pooled).abs().max()
    assert torch.allclose(theirs["t5"], text, atol=1e-4, rtol=0), (theirs["t5"] - text).abs().max()  # of 4.6
    assert torch.allclose(theirs["latents"], latents, atol=1e-5, rtol=0), (theirs["latents"] - latents).abs().max()


KOHYA_FLUX_LORA = """
import json, sys, torch
shapes, flux_file, peers, out = sys.argv[1:]
sys.path.insert(0, peers)
import kohya_launch
kohya_launch.configure(json.load(open(shapes)))
from library import flux_utils
import networks.lora_flux as lora_flux
_, flux = flux_utils.load_flow_model(flux_file, torch.float32, "cpu")
flux.eval()
network = lora_flux.create_network(1.0, 4, 8, None, [], flux)  # rank 4, alpha 8: scale 2; its default targets
network.apply_to([], flux, apply_text_encoder=False, apply_unet=True)
generator = torch.Generator().manual_seed(0)
x = torch.load(out + "/x.pt", weights_only=True)
with torch.no_grad():
    for module in network.unet_loras:  # the ups start at zero: random ones, so every module changes the output
        module.lora_up.weight.copy_(torch.randn(module.lora_up.weight.shape, generator=generator) * 0.05)
    y = flux(img=x["img"], img_ids=x["img_ids"][None], txt=x["txt"], txt_ids=x["txt_ids"][None], timesteps=x["t"],
             y=x["pooled"], guidance=x["guidance"])
network.save_weights(out + "/lora.safetensors", torch.float32, {})
torch.save({"y": y, "modules": len(network.unet_loras)}, out + "/y.pt")
"""


@needs_kohya
def test_scorer_applies_a_kohya_flux_lora_file_whole(flux, tmp_path):
    """kohya's networks.lora_flux on its Flux at the pipeline's width, saved by its save_weights: the scorer adapts
    every module of the file (its fused qkv and linear1 split) and its transformer's output is kohya's."""
    folder, _ = flux
    env, src = kohya_env(tmp_path)
    files, shapes = write_flux_pipeline(folder, tmp_path / "files")
    side = 4
    ids = torch.zeros(side, side, 3)
    ids[..., 1] += torch.arange(side)[:, None]
    ids[..., 2] += torch.arange(side)[None, :]
    torch.manual_seed(0)
    x = {"img": torch.randn(1, side * side, 64), "img_ids": ids.reshape(-1, 3), "txt": torch.randn(1, 7, 4096),
         "txt_ids": torch.zeros(7, 3), "t": torch.tensor([0.7]), "pooled": torch.randn(1, 768),
         "guidance": torch.tensor([1.0])}
    torch.save(x, tmp_path / "x.pt")
    done = subprocess.run([sys.executable, "-c", KOHYA_FLUX_LORA, str(shapes), str(files["flux"]), str(PEERS),
                           str(tmp_path)], cwd=src, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-2000:]
    theirs = torch.load(tmp_path / "y.pt", weights_only=True)
    lora = tmp_path / "lora.safetensors"
    assert theirs["modules"] == 32  # 2 double blocks x 2 streams x (qkv, proj, mlp 0 and 2, mod), 4 single x 3

    pipe = loss_parity.scored_pipeline(folder, lora)
    assert loss_parity.lora_coverage(pipe, lora) == (32, 52)

    def transformer():
        with torch.no_grad():
            return pipe.transformer(hidden_states=x["img"], encoder_hidden_states=x["txt"],
                                    pooled_projections=x["pooled"], timestep=x["t"], img_ids=x["img_ids"],
                                    txt_ids=x["txt_ids"], guidance=x["guidance"], return_dict=False)[0]

    ours = transformer()
    pipe.set_adapters(["scored"], [0.0])
    base = transformer()
    assert (theirs["y"] - base).abs().max() > 1e-2  # the LoRA moves kohya's output
    assert torch.allclose(ours, theirs["y"], atol=1e-5, rtol=0), (ours - theirs["y"]).abs().max()
