"""bench/peers/kohya_files.py: the Flux.1 transformer in BFL names, as kohya sd-scripts' own loader reads it.

The tiny diffusers transformer is converted, then loaded by kohya's flux_utils.load_flow_model in the peer's own
environment (its pinned packages, from .whl-peers/kohya: absent in CI, so skipped there) with its Flux config set
to the tiny width (kohya reads only the block counts from a file); both models see the same input."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers import kohya_env

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))

PEER = REPO / ".whl-peers" / "kohya" / "source.tar.gz"

KOHYA_SIDE = """
import json, sys, torch
from dataclasses import replace
from library import flux_models, flux_utils
c = json.loads(sys.argv[2])
spec = flux_models.configs["dev"]
flux_models.configs["dev"] = replace(spec, params=replace(
    spec.params, hidden_size=c["num_attention_heads"] * c["attention_head_dim"], num_heads=c["num_attention_heads"],
    axes_dim=list(c["axes_dims_rope"]), context_in_dim=c["joint_attention_dim"], vec_in_dim=c["pooled_projection_dim"]))
_, model = flux_utils.load_flow_model(sys.argv[1], torch.float32, "cpu")
x = torch.load(sys.argv[3], weights_only=True)
with torch.no_grad():
    out = model(img=x["img"], img_ids=x["img_ids"][None], txt=x["txt"], txt_ids=x["txt_ids"][None],
                timesteps=x["t"], y=x["pooled"], guidance=x["guidance"])
torch.save(out, sys.argv[4])
"""


def test_flux_to_bfl_names_every_tensor_once():
    from diffusers import FluxTransformer2DModel

    from diffusion_models import SHAPES
    from peers.kohya_files import flux_to_bfl

    model = FluxTransformer2DModel(**SHAPES["flux"])
    sd = model.state_dict()
    bfl = flux_to_bfl(sd)
    assert sum(t.numel() for t in bfl.values()) == sum(t.numel() for t in sd.values())
    assert bfl["double_blocks.1.img_attn.qkv.weight"].shape == (3 * 32, 32)
    assert torch.equal(bfl["single_blocks.3.linear1.bias"][:32], sd["single_transformer_blocks.3.attn.to_q.bias"])
    assert not any(k.startswith(("transformer_blocks", "single_transformer_blocks")) for k in bfl)


@pytest.mark.skipif(not PEER.exists(), reason="needs .whl-peers/kohya (bash bench/peers/packages.sh kohya)")
def test_flux_bfl_file_loads_in_kohya_with_the_same_output(tmp_path):
    from diffusers import FluxTransformer2DModel
    from safetensors.torch import save_file

    from diffusion_models import SHAPES
    from peers.kohya_files import flux_to_bfl

    env, src = kohya_env(tmp_path)
    torch.manual_seed(0)
    model = FluxTransformer2DModel(**SHAPES["flux"]).eval()
    c = dict(model.config)
    save_file(flux_to_bfl(model.state_dict()), str(tmp_path / "flux.safetensors"))
    side = 4
    ids = torch.zeros(side, side, 3)
    ids[..., 1] += torch.arange(side)[:, None]
    ids[..., 2] += torch.arange(side)[None, :]
    x = {"img": torch.randn(1, side * side, 64), "img_ids": ids.reshape(-1, 3), "txt": torch.randn(1, 7, 4096),
         "txt_ids": torch.zeros(7, 3), "t": torch.tensor([0.7]), "pooled": torch.randn(1, 768),
         "guidance": torch.tensor([1.0])}
    torch.save(x, tmp_path / "x.pt")
    with torch.no_grad():
        ours = model(hidden_states=x["img"], encoder_hidden_states=x["txt"], pooled_projections=x["pooled"],
                     timestep=x["t"], img_ids=x["img_ids"], txt_ids=x["txt_ids"], guidance=x["guidance"],
                     return_dict=False)[0]
    config = {k: list(v) if isinstance(v, tuple) else v for k, v in c.items() if not k.startswith("_")}
    done = subprocess.run([sys.executable, "-c", KOHYA_SIDE, str(tmp_path / "flux.safetensors"), json.dumps(config),
                           str(tmp_path / "x.pt"), str(tmp_path / "out.pt")], cwd=src, env=env, capture_output=True,
                          text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-2000:]
    theirs = torch.load(tmp_path / "out.pt", weights_only=True)
    assert theirs.shape == ours.shape
    assert torch.allclose(theirs, ours, atol=1e-5, rtol=0), (theirs - ours).abs().max()


AE_SIDE = """
import sys, torch
from library import flux_models
from safetensors.torch import load_file
params = flux_models.AutoEncoderParams(resolution=256, in_channels=3, ch=32, out_ch=3, ch_mult=[1, 2],
                                       num_res_blocks=2, z_channels=16, scale_factor=0.3611, shift_factor=0.1159)
ae = flux_models.AutoEncoder(params)
info = ae.load_state_dict(load_file(sys.argv[1]), strict=True)
x = torch.load(sys.argv[2], weights_only=True)
with torch.no_grad():
    torch.save({"moments": ae.encoder(x["image"]), "image": ae.decoder(x["z"])}, sys.argv[3])
"""


@pytest.mark.skipif(not PEER.exists(), reason="needs .whl-peers/kohya (bash bench/peers/packages.sh kohya)")
def test_flux_vae_in_bfl_names_is_kohyas_autoencoder(tmp_path):
    """A Flux-kind diffusers VAE (two levels of 32 and 64 channels: kohya's GroupNorm has 32 groups) converted to BFL
    names loads strictly into kohya's AutoEncoder of the same levels; encoder and decoder give the same outputs."""
    from diffusers import AutoencoderKL
    from safetensors.torch import save_file

    from peers.kohya_files import flux_vae_to_bfl

    env, src = kohya_env(tmp_path)
    torch.manual_seed(0)
    vae = AutoencoderKL(in_channels=3, out_channels=3, latent_channels=16, block_out_channels=(32, 64),
                        down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2,
                        layers_per_block=2, norm_num_groups=32, use_quant_conv=False, use_post_quant_conv=False).eval()
    save_file(flux_vae_to_bfl(vae.state_dict()), str(tmp_path / "ae.safetensors"))
    x = {"image": torch.randn(1, 3, 16, 16), "z": torch.randn(1, 16, 8, 8)}
    torch.save(x, tmp_path / "x.pt")
    with torch.no_grad():
        ours = {"moments": vae.encoder(x["image"]), "image": vae.decoder(x["z"])}
    done = subprocess.run([sys.executable, "-c", AE_SIDE, str(tmp_path / "ae.safetensors"), str(tmp_path / "x.pt"),
                           str(tmp_path / "out.pt")], cwd=src, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-2000:]
    theirs = torch.load(tmp_path / "out.pt", weights_only=True)
    for name in ours:
        gap = (theirs[name] - ours[name]).abs().max()
        assert torch.allclose(theirs[name], ours[name], atol=1e-5, rtol=0), (name, gap)
