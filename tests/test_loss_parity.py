"""bench/loss_parity.py on the CPU: the toolkit side trains tiny SD1.5 through `python -m toolkit train` on the
bench's block images, and the one scorer (diffusers' load_lora_weights, fixed noise and levels) gives the same
number for the LoRA from its diffusers file and from its kohya export, the base's number at scale 0, and another
number once the LoRA has trained.

With .whl-peers/kohya (kohya sd-scripts' source and pinned packages; absent in CI, so skipped there), in kohya's
own environment: a LoRA file of kohya's networks.lora is applied whole by the scorer (its output is kohya's), and
kohya encodes the captions with the pipeline's text encoder (the scorer's text states), not a random one."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import REPO
from helpers import kohya_env

sys.path.insert(0, str(REPO / "bench"))

import loss_parity  # noqa: E402
from diffusion_models import write_pipeline  # noqa: E402

KOHYA = REPO / ".whl-peers" / "kohya" / "source.tar.gz"
needs_kohya = pytest.mark.skipif(not KOHYA.exists(),
                                 reason="needs .whl-peers/kohya (bash bench/peers/packages.sh kohya)")


def test_toolkit_side_and_scorer_on_sd15(tmp_path: Path):
    folder, data = tmp_path / "sd15", tmp_path / "data"
    write_pipeline("sd15", folder, "cpu", tiny=True)
    loss_parity.write_block_images(data)
    assert sorted(p.name for p in data.iterdir())[:2] == ["000.png", "000.txt"]
    assert len(list(data.glob("*.png"))) == 8
    assert (data / "000.txt").read_text() == "a red block top left and a yellow block top right on a grey background\n"

    # lr 1e-3 for 4 steps: enough to move the held-out loss in a few CPU seconds
    files, losses = loss_parity.toolkit_parity("sd15", folder, data, tmp_path / "runs", seed=0, steps=4, lr=1e-3,
                                               rank=4, alpha=8, resolution=64, timeout=300)
    assert len(losses) == 4 and all(math.isfinite(x) and 0.1 < x < 10 for x in losses)
    assert sorted(files) == ["diffusers", "kohya"]
    keys = load_file(files["kohya"])
    assert any(k.startswith("lora_unet_") for k in keys)
    for module in ("attn2_to_k", "proj_in", "proj_out", "ff_net_0_proj", "ff_net_2"):  # kohya's targets, not ours
        assert any(k.endswith(f"{module}.lora_down.weight") for k in keys), module
    assert not any("time_emb_proj" in k for k in keys)  # outside Transformer2DModel: kohya leaves it

    base = loss_parity.held_out_loss("sd15", folder, data)
    trained = loss_parity.held_out_loss("sd15", folder, data, files["diffusers"])
    from_kohya = loss_parity.held_out_loss("sd15", folder, data, files["kohya"])
    zero = loss_parity.held_out_loss("sd15", folder, data, files["kohya"], scale=0.0)
    assert math.isfinite(base) and 0.5 < base < 2.0
    assert abs(trained - base) > 1e-4  # the LoRA moved the held-out loss
    assert abs(from_kohya - trained) < 1e-5  # one LoRA, two formats, one number
    assert abs(zero - base) < 1e-6
    assert loss_parity.last_mean(losses, 2) == (losses[-2] + losses[-1]) / 2

    # a module diffusers cannot place is skipped with a log line at most: the scorer refuses to score the rest
    from safetensors.torch import save_file

    modules = {k.split(".")[0] for k in keys}
    misnamed = {k.replace("attn2_to_k.", "attn2_to_kk."): v for k, v in keys.items()}
    save_file(misnamed, str(tmp_path / "misnamed.safetensors"))
    dropped = len({k.split(".")[0] for k in keys if "attn2_to_k." in k})
    with pytest.raises(RuntimeError, match=f"applied {len(modules) - dropped} of the {len(modules)} LoRA modules"):
        loss_parity.held_out_loss("sd15", folder, data, tmp_path / "misnamed.safetensors")


def test_the_bench_vae_posterior_is_narrow_so_a_cached_sample_is_the_mode(tmp_path: Path):
    """kohya and musubi cache one sample of the VAE posterior, the toolkit and the scorer its mode: on the bench's
    random VAE (SD1.5's four latent channels, Flux's sixteen without quant_conv) the two are the same latents."""
    import torch
    from diffusion_models import _vae

    loss_parity.write_block_images(tmp_path)
    pixels = torch.cat([loss_parity.pixels(p) for p in sorted(tmp_path.glob("*.png"))])
    for vae in (_vae(4, scaling_factor=0.18215), _vae(16, use_quant_conv=False, use_post_quant_conv=False)):
        with torch.no_grad():
            posterior = vae.encode(pixels).latent_dist
        spread = posterior.mode().std(0).pow(2).mean().sqrt()  # how much the images' latents differ
        assert posterior.std.max() < 1e-3 * spread
        torch.manual_seed(0)
        assert torch.allclose(posterior.sample(), posterior.mode(), atol=1e-2 * spread.item(), rtol=0)  # within 10 std


def test_summary_over_seeds_and_the_difference_with_its_standard_error():
    rows = [{"trainer": "toolkit", "seed": s, "last100": v, "held_out": v - 0.1} for s, v in enumerate((1.0, 1.2, 1.1))]
    rows += [{"trainer": "kohya", "seed": s, "last100": v, "held_out": "diffusers cannot load x"}
             for s, v in enumerate((1.3, 1.5))]
    rows.append({"trainer": "kohya", "seed": 2, "error": "RuntimeError: .whl-peers/kohya is missing"})
    result = loss_parity.summarise(rows, ["toolkit", "kohya"])
    toolkit, kohya = result["summary"]["toolkit"], result["summary"]["kohya"]
    assert toolkit["last100"]["n"] == 3 and abs(toolkit["last100"]["mean"] - 1.1) < 1e-12
    assert abs(toolkit["last100"]["std"] - 0.1) < 1e-12
    assert kohya["last100"]["n"] == 2 and abs(kohya["last100"]["mean"] - 1.4) < 1e-12
    assert kohya["held_out"]["n"] == 0  # a file diffusers could not load has no number
    difference = result["toolkit_minus_peer"]["kohya"]["last100"]
    assert abs(difference["difference"] + 0.3) < 1e-12
    assert abs(difference["se"] - math.sqrt(0.1**2 / 3 + (0.2**2 / 2) / 2)) < 1e-12
    assert math.isnan(result["toolkit_minus_peer"]["kohya"]["held_out"]["se"])


def test_text_encoders_in_transformers4_names_hold_the_same_weights(tmp_path: Path):
    """transformers 5 saves a CLIPTextModel without the `text_model.` prefix; kohya's transformers 4.54 would load
    none of it. The copy kohya gets has every weight under that prefix, and loads here to the same model."""
    from safetensors import safe_open
    from transformers import CLIPTextModel

    from peers import kohya

    folder = tmp_path / "sd15"
    write_pipeline("sd15", folder, "cpu", tiny=True)
    path, renamed = kohya.transformers4_text_encoders(folder, tmp_path / "kohya-pipeline")
    if not renamed:
        assert path == folder  # a transformers 4 toolkit already wrote them so
        return
    assert renamed == ["text_encoder"] and path == tmp_path / "kohya-pipeline"
    assert (path / "unet").is_symlink() and (path / "unet").resolve() == (folder / "unet").resolve()
    with safe_open(str(path / "text_encoder" / "model.safetensors"), "pt") as handle:
        keys = list(handle.keys())
    assert len(keys) == len(load_file(folder / "text_encoder" / "model.safetensors"))
    assert all(k.startswith("text_model.") for k in keys)
    ours, theirs = (CLIPTextModel.from_pretrained(p / "text_encoder").state_dict() for p in (folder, path))
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    assert kohya.transformers4_text_encoders(path, tmp_path / "again") == (path, [])  # nothing left to rename


KOHYA_TEXT = """
import sys, torch
from diffusers import StableDiffusionPipeline
from library import strategy_sd
folder, tokenizers, out, *captions = sys.argv[1:]
# as train_util._load_target_model reads a diffusers folder (its UNet conversion then needs SD1.5's real shape)
pipe = StableDiffusionPipeline.from_pretrained(folder, tokenizer=None, safety_checker=None)
tokenize = strategy_sd.SdTokenizeStrategy(False, None, tokenizers)
with torch.no_grad():
    states = strategy_sd.SdTextEncodingStrategy(None).encode_tokens(tokenize, [pipe.text_encoder],
                                                                    tokenize.tokenize(captions))[0]
torch.save(states, out)
"""


@needs_kohya
def test_kohya_encodes_the_captions_with_the_pipelines_text_encoder(tmp_path: Path):
    """The text states kohya trains on (its tokenizer and text-encoding strategies on the folder kohya.py gives it)
    are the scorer's; on the folder as the toolkit's transformers 5 wrote it, kohya's transformers 4.54 initialises
    the text encoder at random, says so, and its states are another model's."""
    from peers import kohya
    from peers.kohya_files import tokenizer_cache

    env, src = kohya_env(tmp_path)
    folder, data = tmp_path / "sd15", tmp_path / "data"
    write_pipeline("sd15", folder, "cpu", tiny=True)
    loss_parity.write_block_images(data)
    captions = [p.read_text().strip() for p in sorted(data.glob("*.txt"))]
    with torch.no_grad():
        ours = loss_parity.scored_pipeline(folder).encode_prompt(captions, "cpu", 1, False)[0]
    tokenizers = tokenizer_cache("sd15", folder, tmp_path / "tokenizers")

    def kohya_states(path: Path) -> tuple[torch.Tensor, str]:
        out = tmp_path / f"{path.name}.pt"
        done = subprocess.run([sys.executable, "-c", KOHYA_TEXT, str(path), str(tokenizers), str(out), *captions],
                              cwd=src, env=env, capture_output=True, text=True, timeout=240)
        assert done.returncode == 0, done.stderr[-2000:]
        return torch.load(out, weights_only=True), done.stdout + done.stderr

    path, renamed = kohya.transformers4_text_encoders(folder, tmp_path / "kohya-pipeline")
    theirs, said = kohya_states(path)
    assert not kohya.NOT_LOADED.search(said), said[-2000:]
    assert theirs.shape == ours.shape == (8, 77, 768)
    assert torch.allclose(theirs, ours, atol=1e-5, rtol=0), (theirs - ours).abs().max()
    if renamed:  # what kohya trained on before: a random text encoder, a warning its parity() now fails on
        theirs, said = kohya_states(folder)
        assert kohya.NOT_LOADED.search(said)
        assert (theirs - ours).abs().max() > 0.1


KOHYA_LORA = """
import sys, torch
from diffusers import UNet2DConditionModel
import networks.lora as lora
folder, out = sys.argv[1:3]
unet = UNet2DConditionModel.from_pretrained(folder, subfolder="unet", torch_dtype=torch.float32).eval()
network = lora.create_network(1.0, 4, 8, None, [], unet)  # rank 4, alpha 8: scale 2; its default targets
network.apply_to([], unet, apply_text_encoder=False, apply_unet=True)
generator = torch.Generator().manual_seed(0)
x = torch.load(out + "/x.pt", weights_only=True)
with torch.no_grad():
    for module in network.unet_loras:  # the ups start at zero: random ones, so every module changes the output
        module.lora_up.weight.copy_(torch.randn(module.lora_up.weight.shape, generator=generator) * 0.05)
    y = unet(x["x"], x["t"], encoder_hidden_states=x["c"]).sample
network.save_weights(out + "/lora.safetensors", torch.float32, {})
torch.save({"y": y, "modules": len(network.unet_loras)}, out + "/y.pt")
"""


@needs_kohya
def test_scorer_applies_a_kohya_lora_file_whole(tmp_path: Path):
    """kohya's networks.lora on the pipeline's UNet (every Linear and 1x1 conv in its Transformer2DModels), saved by
    its save_weights: the scorer adapts as many layers as the file has modules, and its UNet's output is the output
    of kohya's UNet with the LoRA applied."""
    env, src = kohya_env(tmp_path)
    folder = tmp_path / "sd15"
    write_pipeline("sd15", folder, "cpu", tiny=True)
    torch.manual_seed(0)
    x = {"x": torch.randn(2, 4, 8, 8), "t": torch.tensor([100, 700]), "c": torch.randn(2, 77, 768)}
    torch.save(x, tmp_path / "x.pt")
    done = subprocess.run([sys.executable, "-c", KOHYA_LORA, str(folder), str(tmp_path)], cwd=src, env=env,
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-2000:]
    theirs = torch.load(tmp_path / "y.pt", weights_only=True)
    lora = tmp_path / "lora.safetensors"
    # 4 Transformer2DModels (down 1, mid 1, up 2) x (proj_in, proj_out, 2 x 4 attention projections, 2 ff)
    assert theirs["modules"] == 48

    pipe = loss_parity.scored_pipeline(folder, lora)
    assert loss_parity.lora_coverage(pipe, lora) == (48, 48)
    with torch.no_grad():
        ours = pipe.unet(x["x"], x["t"], encoder_hidden_states=x["c"]).sample
        pipe.set_adapters(["scored"], [0.0])
        base = pipe.unet(x["x"], x["t"], encoder_hidden_states=x["c"]).sample
    assert (theirs["y"] - base).abs().max() > 1e-2  # the LoRA moves kohya's output
    assert torch.allclose(ours, theirs["y"], atol=1e-5, rtol=0), (ours - theirs["y"]).abs().max()
