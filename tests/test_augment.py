"""Augmentation: flipped and cropped views encoded and cached once each (sd and wan21 through the entry point),
caption shuffle / tag dropout / caption dropout drawn per (seed, epoch, item), and the config bounds."""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import REPO
from helpers import adapter_for, diffusion_train_args
from toolkit.data.augment import Augmentation, crop_offsets
from toolkit.data.captions import CaptionRules
from toolkit.data.images import DiffusionDataset, ImageItem, load_pixels
from toolkit.data.video import load_clip
from toolkit.tiny.fixtures import write_shapes_dataset

CLIPS = REPO / "configs/examples/data/clips"
# Latent and text caches of this module's runs kept apart from the session's (conftest.py)
pytestmark = pytest.mark.usefixtures("own_data_caches")


@pytest.fixture(scope="module")
def overhang(tmp_path_factory) -> Path:
    """2 images of 64x64 (their bucket: one crop) and 2 of 96x64 (bucket 64x64 at resolution 96 with
    data.bucket_step=64, as the test runs set it: 32 px overhang)."""
    path = tmp_path_factory.mktemp("overhang")
    write_shapes_dataset(path, sizes=((64, 64), (96, 64)), count=2)
    return path


@pytest.fixture
def vae_calls(monkeypatch) -> list:
    """The batch size of every VAE encode call (sd's AutoencoderKL and Wan's AutoencoderKLWan)."""
    from diffusers import AutoencoderKL, AutoencoderKLWan

    calls = []
    for cls in (AutoencoderKL, AutoencoderKLWan):
        encode = cls.encode
        monkeypatch.setattr(cls, "encode", lambda self, x, *a, _encode=encode, **k:
                            calls.append(x.shape[0]) or _encode(self, x, *a, **k))
    return calls


def test_crop_offsets_span_the_overhang_and_views_pair_each_crop_with_its_mirror():
    # 96x64 covering a 64x64 bucket: no resize, 32 px to spare along the width
    assert crop_offsets((96, 64), (64, 64), 1) == [(0, 16)]
    assert crop_offsets((96, 64), (64, 64), 3) == [(0, 0), (0, 16), (0, 32)]
    assert crop_offsets((64, 64), (64, 64), 4) == [(0, 0)]            # nothing overhangs: one crop
    assert crop_offsets((200, 100), (64, 64), 3) == [(0, 0), (0, 32), (0, 64)]  # resized to 128x64 first
    views = Augmentation(random_flip=True, crop_variants=3).views((96, 64), (64, 64))
    assert [(v.top_left, v.flip, v.plain) for v in views] == [
        ((0, 0), False, False), ((0, 0), True, False), ((0, 16), False, True), ((0, 16), True, False),
        ((0, 32), False, False), ((0, 32), True, False)]
    assert views[2].key_parts() == () and views[3].key_parts() == ("view", 0, 16, True)


def test_view_draws_are_a_function_of_seed_epoch_and_item():
    aug = Augmentation(random_flip=True, crop_variants=3, seed=42)
    draws = [[aug.draw_view(i, epoch, 6) for epoch in range(400)] for i in range(3)]
    assert draws == [[aug.draw_view(i, epoch, 6) for epoch in range(400)] for i in range(3)]   # no hidden state
    assert draws[0] != draws[1]
    for row in draws:  # every view is drawn, each about 1/6 of the time
        counts = np.bincount(row, minlength=6)
        assert counts.min() > 40, counts
    assert [Augmentation(seed=42).draw_view(0, e, 1) for e in range(5)] == [0] * 5
    flips = [Augmentation(random_flip=True, seed=7).draw_view(3, e, 2) for e in range(400)]
    assert 160 < sum(flips) < 240


def _caption_dataset(rules: CaptionRules, seed: int = 42) -> DiffusionDataset:
    items = [ImageItem(Path("x.png"), "sks, a, b, c, d", (64, 64), (64, 64))]
    return DiffusionDataset(items, rules, Augmentation(seed=seed),
                            load=lambda item, view: {"pixels": torch.zeros(1), "crop": torch.zeros(2)})


def _captions(dataset: DiffusionDataset, epochs: int) -> list[str]:
    return [c for epoch in range(epochs) for c in dataset.collate([0], epoch)["captions"]]


def test_tag_shuffle_keeps_the_leading_tags_and_draws_every_order():
    dataset = _caption_dataset(CaptionRules(trigger_word="sks", shuffle_tags=True, keep_tokens=1))
    captions = _captions(dataset, 600)
    # the trigger word and the first tag stay; the other three tags come in all 3! orders
    assert set(captions) == {"sks, a, " + ", ".join(p) for p in itertools.permutations(["b", "c", "d"])}
    assert captions == _captions(_caption_dataset(dataset.rules), 600)  # the same seed draws the same
    assert captions != _captions(_caption_dataset(dataset.rules, seed=1), 600)


def test_tag_dropout_and_caption_dropout_rates():
    dataset = _caption_dataset(CaptionRules(trigger_word="sks", keep_tokens=1, tag_dropout=0.5, caption_dropout=0.2))
    captions = _captions(dataset, 1000)
    dropped = captions.count("")
    assert 160 <= dropped <= 240, dropped
    kept = [c.split(", ") for c in captions if c]
    assert all(tags[:2] == ["sks", "a"] and tags[2:] == [t for t in "bcd" if t in tags[2:]] for tags in kept)
    for tag in "bcd":  # each later tag survives half the time, in its place
        share = sum(tag in tags for tags in kept) / len(kept)
        assert 0.4 < share < 0.6, (tag, share)


def test_cached_text_drops_the_same_captions_as_the_per_step_path(tmp_path):
    rules = CaptionRules(caption_dropout=0.3)
    per_step = _captions(_caption_dataset(rules), 200)
    cached = _caption_dataset(rules)
    cached.text, cached.empty_text = [{"prompt_embeds": torch.ones(2)}], {"prompt_embeds": torch.zeros(2)}
    embeds = [cached.collate([0], epoch)["prompt_embeds"][0, 0].item() for epoch in range(200)]
    assert [e == 0.0 for e in embeds] == [c == "" for c in per_step]


def test_sd_flip_and_crop_views_are_each_encoded_once_and_cached(overhang, tmp_path, run_cli, capsys, vae_calls):
    args = ["data.random_flip=true", "data.crop_variants=3", f"data.path={overhang}", "data.bucket_step=64",
            "train.steps=1", "sample.prompts=[]"]
    assert run_cli(*diffusion_train_args("quickstart_sd.yaml", tmp_path / "a", *args)) == 0
    # 2 images x 1 crop x 2 + 2 images x 3 crops x 2: one VAE call per view
    assert "latents: 0 cached, 16 encoded (4 views per item)" in capsys.readouterr().err
    assert vae_calls == [1] * 16
    vae_calls.clear()
    assert run_cli(*diffusion_train_args("quickstart_sd.yaml", tmp_path / "b", *args)) == 0
    assert "latents: 16 cached, 0 encoded" in capsys.readouterr().err and vae_calls == []

    adapter, dataset = adapter_for("quickstart_sd.yaml", tmp_path / "c", *args)
    wide = next(i for i, item in enumerate(dataset.items) if item.size == (96, 64))
    views = dataset.views[wide]
    assert len(views) == 6 and len(dataset.encoded[wide]) == 6
    pixels, crop = load_pixels(dataset.items[wide], views[0])              # crop at the left edge
    assert crop == (0, 0)
    flipped = dataset.encoded[wide][1]                                         # the same crop, mirrored
    expected = adapter.encode_pixels(pixels.flip(-1)[None])[0]
    assert torch.equal(flipped["latents"], expected)
    assert not torch.allclose(flipped["latents"], dataset.encoded[wide][0]["latents"].flip(-1), atol=1e-3)
    assert flipped["crop"].tolist() == [0, 32]  # SDXL's crop conditioning: the left edge in the mirrored image
    plain = next(v for v, view in enumerate(views) if view.plain)
    assert torch.equal(dataset.encoded[wide][plain]["latents"],
                       adapter.encode_pixels(load_pixels(dataset.items[wide])[0][None])[0])


def test_wan21_flipped_clips_are_encoded_once_and_cached(tmp_path, run_cli, capsys, vae_calls):
    args = ["data.random_flip=true", "train.steps=1", "sample.prompts=[]"]
    assert run_cli(*diffusion_train_args("quickstart_wan21.yaml", tmp_path / "a", *args)) == 0
    assert "latents: 0 cached, 16 encoded (2 views per item)" in capsys.readouterr().err  # 6 clips + 2 stills
    assert vae_calls == [1] * 16

    adapter, dataset = adapter_for("quickstart_wan21.yaml", tmp_path / "b", *args)
    clip = next(i for i, item in enumerate(dataset.items) if item.bucket[2] == 9)
    flipped = dataset.encoded[clip][1]["latents"]
    assert flipped.shape == (16, 3, 8, 8)
    assert torch.equal(flipped, adapter.encode_pixels(load_clip(dataset.items[clip]).flip(-1)[None])[0])


def test_bounds_and_the_cached_text_decision(run_cli, capsys, tmp_path):
    config = REPO / "configs/examples/quickstart_sd.yaml"
    assert run_cli("validate", config, "data.caption_dropout=1.5", "data.tag_dropout=-0.1", "data.crop_variants=0") == 2
    err = capsys.readouterr().err
    assert "'data.caption_dropout' in command line: 1.5 is above the maximum 1.0" in err
    assert "'data.tag_dropout' in command line: -0.1 is below the minimum 0.0" in err
    assert "'data.crop_variants' in command line: 0 is below the minimum 1" in err
    assert run_cli(*diffusion_train_args("quickstart_sd.yaml", tmp_path / "run", "data.tag_dropout=0.2",
                                         "train.steps=1", "sample.prompts=[]")) == 0
    assert ("text embeddings: computed every step, not cached (data.tag_dropout changes captions every step)"
            in capsys.readouterr().err)
