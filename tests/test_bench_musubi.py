"""bench/peers/musubi_files.py: the bench's diffusers Wan DiT, VAE and UMT5 encoder converted to the original Wan names
give the same outputs through musubi-tuner's own modules (its WanModel, WanVAE_, T5Encoder, at the pinned commit)
as through diffusers / transformers; its Qwen-Image DiT and VAE read diffusers' names as they are. Needs the peer's
source (.whl-peers/musubi, built by bench/peers/packages.sh musubi); skipped without it."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "bench")]

pytestmark = pytest.mark.skipif(not (ROOT / ".whl-peers" / "musubi" / "source.tar.gz").exists(),
                                reason="musubi-tuner's source is not here (bash bench/peers/packages.sh musubi)")


@pytest.fixture(scope="module")
def musubi():
    """musubi-tuner's package on sys.path (its source only: the modules tested need torch and einops)."""
    from peers.common import install

    src, _ = install("musubi")  # /tmp/peer-musubi, once per machine
    sys.path.insert(0, str(src / "src"))
    cuda_device = torch.cuda.current_device
    if not torch.cuda.is_available():  # musubi's t5.py calls it for a default argument when imported
        torch.cuda.current_device = lambda: 0
    yield src
    torch.cuda.current_device = cuda_device
    sys.path.remove(str(src / "src"))


def test_wan_dit_matches_diffusers_through_musubis_model(musubi):
    from diffusers import WanTransformer3DModel
    from diffusion_models import SHAPES
    from musubi_tuner.wan.modules.model import WanModel
    from peers.musubi_files import wan_dit_state

    torch.manual_seed(0)
    ours = WanTransformer3DModel(**SHAPES["wan"]).eval()
    for p in ours.parameters():  # diffusers zero-initialises some layers: random everywhere, so every key matters
        p.data.normal_(0, 0.05)
    c = ours.config
    theirs = WanModel(model_type="t2v", model_version="2.1", dim=c.num_attention_heads * c.attention_head_dim,
                      eps=c.eps, ffn_dim=c.ffn_dim, freq_dim=c.freq_dim, in_dim=c.in_channels,
                      num_heads=c.num_attention_heads, num_layers=c.num_layers, out_dim=c.out_channels, text_len=512,
                      attn_mode="torch").eval()
    theirs.load_state_dict(wan_dit_state(ours.state_dict()), strict=True)
    latents = torch.randn(1, 16, 2, 8, 8)
    text = torch.zeros(1, 512, c.text_dim)  # musubi pads the text to 512 zeros before its text embedding
    text[:, :7] = torch.randn(1, 7, c.text_dim)
    t = torch.tensor([700.0])
    with torch.no_grad():
        expected = ours(hidden_states=latents, timestep=t, encoder_hidden_states=text, return_dict=False)[0]
        got = theirs([latents[0]], t=t, context=[text[0, :7]], seq_len=2 * 4 * 4)[0]
    assert got.shape == expected[0].shape
    # musubi computes the rotary and sinusoidal tables in float64, diffusers in float32: 2e-4 of the output's norm
    # here; a module mapped to the wrong weights (norm2 / norm3 swapped, say) moves it by ~1.0
    assert ((got - expected[0]).norm() / expected[0].norm()).item() < 1e-3


def test_wan_vae_matches_diffusers_through_musubis_vae(musubi):
    from musubi_tuner.wan.modules.vae import WanVAE_
    from peers.musubi_files import wan_vae_state
    from toolkit.tiny.flow import wan21_vae

    torch.manual_seed(0)
    ours = wan21_vae().eval()
    c = ours.config
    theirs = WanVAE_(dim=c.base_dim, z_dim=c.z_dim, dim_mult=list(c.dim_mult), num_res_blocks=c.num_res_blocks,
                     attn_scales=[], temperal_downsample=list(c.temperal_downsample), dropout=0.0).eval()
    theirs.load_state_dict(wan_vae_state(ours.state_dict(), c.num_res_blocks), strict=True)
    video = torch.rand(1, 3, 5, 32, 32) * 2 - 1
    with torch.no_grad():
        expected = ours.encode(video).latent_dist.mean
        got = theirs.encode(video, scale=[0.0, 1.0])
        decoded = ours.decode(expected).sample
        theirs_decoded = theirs.decode(got, scale=[0.0, 1.0])
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(theirs_decoded.clamp(-1, 1), decoded, atol=1e-5, rtol=1e-5)


def test_umt5_matches_transformers_through_musubis_encoder(musubi):
    from musubi_tuner.wan.modules import t5
    from peers.musubi_files import umt5_state
    from toolkit.tiny.flow import t5_config
    from transformers import UMT5EncoderModel

    torch.manual_seed(0)
    config = t5_config(120, d_model=64, umt5=True)
    ours = UMT5EncoderModel(config).eval()
    defaults = t5.T5RelativeEmbedding.__init__.__defaults__
    t5.T5RelativeEmbedding.__init__.__defaults__ = (config.relative_attention_max_distance,)  # as musubi_launch sets it
    try:
        theirs = t5._t5("umt5-xxl", encoder_only=True, vocab_size=120, dim=64, dim_attn=config.num_heads * config.d_kv,
                        dim_ffn=config.d_ff, num_heads=config.num_heads, encoder_layers=config.num_layers,
                        decoder_layers=config.num_layers, num_buckets=config.relative_attention_num_buckets,
                        shared_pos=False, dropout=0.0).eval()
    finally:
        t5.T5RelativeEmbedding.__init__.__defaults__ = defaults
    theirs.load_state_dict(umt5_state(ours.state_dict(), config.num_layers), strict=True)
    ids = torch.randint(3, 120, (2, 40))
    mask = torch.ones_like(ids)
    mask[1, 25:] = 0
    with torch.no_grad():
        expected = ours(input_ids=ids, attention_mask=mask).last_hidden_state
        got = theirs(ids, mask)
    torch.testing.assert_close(got[0], expected[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got[1, :25], expected[1, :25], atol=1e-5, rtol=1e-5)


def test_qwen_image_dit_and_vae_match_diffusers_through_musubis_modules(musubi):
    """musubi's Qwen-Image DiT and VAE keep diffusers' names: the bench's files load into them as they are."""
    from diffusers import AutoencoderKLQwenImage, QwenImageTransformer2DModel
    from diffusion_models import SHAPES
    from musubi_tuner.qwen_image import qwen_image_autoencoder_kl, qwen_image_model

    torch.manual_seed(0)
    ours = QwenImageTransformer2DModel(**SHAPES["qwen_image"]).eval()
    for p in ours.parameters():
        p.data.normal_(0, 0.05)
    c = ours.config
    theirs = qwen_image_model.QwenImageTransformer2DModel(
        patch_size=2, in_channels=64, out_channels=16, num_layers=c.num_layers, attention_head_dim=c.attention_head_dim,
        num_attention_heads=c.num_attention_heads, joint_attention_dim=c.joint_attention_dim, guidance_embeds=False,
        axes_dims_rope=tuple(c.axes_dims_rope), attn_mode="torch", split_attn=False, zero_cond_t=False,
        use_additional_t_cond=False, use_layer3d_rope=False).eval()
    theirs.load_state_dict(ours.state_dict(), strict=True)
    latents, text = torch.randn(1, 16, 64), torch.randn(1, 7, c.joint_attention_dim)
    mask = torch.ones(1, 7, dtype=torch.long)
    with torch.no_grad():
        expected = ours(hidden_states=latents, encoder_hidden_states=text, encoder_hidden_states_mask=mask,
                        timestep=torch.tensor([0.7]), img_shapes=[[(1, 4, 4)]], return_dict=False)[0]
        got = theirs(hidden_states=latents, encoder_hidden_states=text, encoder_hidden_states_mask=mask,
                     timestep=torch.tensor([0.7]), img_shapes=[(1, 4, 4)], txt_seq_lens=[7])
    got = got[0] if isinstance(got, (tuple, list)) else got
    assert ((got - expected).norm() / expected.norm()).item() < 1e-3  # rotary tables: float64 in musubi

    vae = AutoencoderKLQwenImage(base_dim=8, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                                 temperal_downsample=[False, True, True]).eval()
    their_vae = qwen_image_autoencoder_kl.AutoencoderKLQwenImage(
        base_dim=8, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1, temperal_downsample=[False, True, True]).eval()
    their_vae.load_state_dict(vae.state_dict(), strict=True)
    image = torch.rand(1, 3, 1, 32, 32) * 2 - 1
    with torch.no_grad():
        expected = vae.encode(image).latent_dist.mean
        got = their_vae.encode(image, return_dict=False)[0].mean
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
