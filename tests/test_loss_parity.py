"""bench/loss_parity.py on the CPU: the toolkit side trains tiny SD1.5 through `python -m toolkit train` on the
bench's block images, and the one scorer (diffusers' load_lora_weights, fixed noise and levels) gives the same
number for the LoRA from its diffusers file and from its kohya export, the base's number at scale 0, and another
number once the LoRA has trained."""

from __future__ import annotations

import math
import sys
from pathlib import Path

from safetensors.torch import load_file

from conftest import REPO

sys.path.insert(0, str(REPO / "bench"))

import loss_parity  # noqa: E402
from diffusion_models import write_pipeline  # noqa: E402


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
