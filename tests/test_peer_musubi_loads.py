"""musubi-tuner's Wan loss-parity run reads the bench's tiny pipeline whole: the files musubi_files.write_wan writes,
loaded by musubi's own loaders in its own environment (its transformers 4.57, the tokenizer from the Hugging Face
cache write_wan fills, its model shapes set by musubi_launch.configure) as its caching scripts and trainer load them
(wan/modules/t5.py's T5EncoderModel, vae.py's WanVAE, model.py's load_wan_model), hold every tensor of the
pipeline's UMT5 encoder, VAE and DiT; its tokenizer gives the pipeline tokenizer's ids, and its text states and
latents are the scorer's. The T5 file is bfloat16, as musubi runs T5 (wan_shared_cfg.t5_dtype): the reference
encoder holds the same bfloat16-rounded weights. Needs .whl-peers/musubi (bash bench/peers/packages.sh musubi);
skipped without it."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from conftest import REPO

sys.path.insert(0, str(REPO / "bench"))

import loss_parity  # noqa: E402
from diffusion_models import write_pipeline  # noqa: E402

pytestmark = pytest.mark.skipif(not (REPO / ".whl-peers" / "musubi" / "source.tar.gz").exists(),
                                reason="needs .whl-peers/musubi (bash bench/peers/packages.sh musubi)")

MUSUBI_WAN = """
import json, sys, torch
shapes_file, peers, out, *captions = sys.argv[1:]
sys.path.insert(0, peers)
import musubi_launch
if not torch.cuda.is_available():
    torch.cuda.current_device = lambda: 0  # as musubi_launch.main: t5.py calls it for a default argument
shapes = json.load(open(shapes_file))
musubi_launch.configure(shapes)
from musubi_tuner.wan.configs import WAN_CONFIGS
from musubi_tuner.wan.modules.model import load_wan_model
from musubi_tuner.wan.modules.t5 import T5EncoderModel
from musubi_tuner.wan.modules.vae import WanVAE
files = shapes["files"]
t5 = T5EncoderModel(text_len=512, dtype=torch.float32, device="cpu", weight_path=files["t5"])
vae = WanVAE(vae_path=files["vae"], dtype=torch.float32, device="cpu")
dit = load_wan_model(WAN_CONFIGS["t2v-1.3B"], "cpu", files["dit"], "torch", False, "cpu", torch.float32)
pixels = torch.load(out + "/pixels.pt", weights_only=True)
with torch.no_grad():
    ids, mask = t5.tokenizer(captions, return_mask=True, add_special_tokens=True)
    text = t5(captions, "cpu")
    latents = vae.encode(list(pixels[:, :, None]))  # each image a 1-frame video
state = {f"{name}.{k}": v for name, model in (("t5", t5.model), ("vae", vae.model), ("dit", dit))
         for k, v in model.state_dict().items()}
torch.save({"state": state, "ids": ids, "mask": mask, "text": text, "latents": latents}, out + "/musubi.pt")
"""


def test_musubi_loads_the_pipelines_wan_models_whole(tmp_path):
    from peers.musubi import musubi_env
    from peers.musubi_files import umt5_state, wan_dit_state, wan_vae_state, write_wan

    folder, data = tmp_path / "wan", tmp_path / "data"
    torch.manual_seed(0)
    write_pipeline("wan", folder, "cpu", tiny=True)
    loss_parity.write_block_images(data)
    shapes = write_wan(folder, tmp_path / "files", torch.float32)
    src, env = musubi_env(shapes, tmp_path)
    images = sorted(data.glob("*.png"))
    captions = [image.with_suffix(".txt").read_text().strip() for image in images]
    pixels = torch.cat([loss_parity.pixels(image) for image in images])
    torch.save(pixels, tmp_path / "pixels.pt")
    done = subprocess.run([sys.executable, "-c", MUSUBI_WAN, str(tmp_path / "files" / "shapes.json"),
                           str(REPO / "bench" / "peers"), str(tmp_path), *captions], cwd=src, env=env,
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "Loaded DiT model from" in done.stderr and "info=<All keys matched successfully>" in done.stderr
    theirs = torch.load(tmp_path / "musubi.pt", weights_only=True)

    pipe = loss_parity.scored_pipeline(folder)
    encoder = pipe.text_encoder
    t5 = encoder.state_dict()
    t5.setdefault("shared.weight", t5["encoder.embed_tokens.weight"])
    models = {"t5": {k: v.to(torch.bfloat16).float() for k, v in umt5_state(t5, encoder.config.num_layers).items()},
              "vae": wan_vae_state(pipe.vae.state_dict(), pipe.vae.config.num_res_blocks),
              "dit": wan_dit_state(pipe.transformer.state_dict())}
    ours = {f"{name}.{key}": value for name, state in models.items() for key, value in state.items()}
    assert theirs["state"].keys() == ours.keys()  # t5 22, vae 146, dit 123 tensors
    assert all(torch.equal(theirs["state"][k].float(), ours[k].float()) for k in ours)  # every one exact

    with torch.no_grad():
        for p in encoder.parameters():  # the T5 file's bfloat16 weights
            p.copy_(p.to(torch.bfloat16).float())
        text = pipe.encode_prompt(captions, do_classifier_free_guidance=False, device="cpu")[0]
        latents, _ = loss_parity.wan_predictor(pipe, pixels, captions)
    tokens = pipe.tokenizer(captions, padding="max_length", max_length=512, truncation=True, add_special_tokens=True,
                            return_tensors="pt")
    assert torch.equal(theirs["ids"], tokens.input_ids) and torch.equal(theirs["mask"], tokens.attention_mask)
    for i, states in enumerate(theirs["text"]):  # musubi keeps each caption's tokens, the scorer pads with zeros
        assert len(states) == int(tokens.attention_mask[i].sum())
        scored = text[i, :len(states)]
        assert torch.allclose(states, scored, atol=1e-5, rtol=0), (states - scored).abs().max()
        assert not text[i, len(states):].any()
    got = torch.stack(theirs["latents"])
    assert got.shape == latents.shape == (8, 16, 1, 8, 8)
    assert torch.allclose(got, latents, atol=1e-5, rtol=0), (got - latents).abs().max()
