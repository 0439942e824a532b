"""Masked loss: masks beside the image or in masks/, cut and mirrored with their image, cached, weighting the loss
per latent pixel (data.mask_min outside); a missing mask, a mask of the wrong size and an empty regularisation
folder are named errors with exit code 2."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from PIL import Image

from helpers import adapter_for, diffusion_train_args
from toolkit.data.masks import loss_weights
from toolkit.tiny.fixtures import write_shapes_dataset

pytestmark = pytest.mark.usefixtures("own_data_caches")


def _half_mask(size: tuple[int, int]) -> Image.Image:
    """White over the left half, black over the right."""
    mask = Image.new("L", size, 0)
    mask.paste(255, (0, 0, size[0] // 2, size[1]))
    return mask


@pytest.fixture
def masked(tmp_path) -> Path:
    """Two 64x64 images: one with its mask beside it (name.mask.png), one with its mask in masks/."""
    data = tmp_path / "data"
    images = write_shapes_dataset(data, sizes=((64, 64),), count=2)
    _half_mask((64, 64)).save(images[0].with_name(f"{images[0].stem}.mask.png"))
    (data / "masks").mkdir()
    _half_mask((64, 64)).save(data / "masks" / images[1].name)
    return data


def test_a_mask_that_zeros_half_the_image_halves_the_gradient_s_support(tmp_path, masked):
    adapter, dataset = adapter_for("quickstart_sd.yaml", tmp_path, f"data.path={masked}", "data.masked_loss=true",
                                   "data.random_flip=true")
    assert len(dataset.items) == 2 and all(item.mask is not None for item in dataset.items)  # no .mask.png item
    plain, mirrored = dataset.masks[0]
    assert plain.shape == (1, 64, 64) and plain.dtype == torch.uint8
    assert plain[..., :32].eq(255).all() and plain[..., 32:].eq(0).all()
    assert torch.equal(mirrored, plain.flip(-1))           # the flipped view's mask is flipped with it
    batch = dataset.collate([0, 1])
    assert batch["mask"].shape == (2, 1, 64, 64)

    predictions = []
    predict = adapter.predict

    def keep_prediction(*args):
        pred = predict(*args)
        pred.retain_grad()
        predictions.append(pred)
        return pred

    adapter.predict = keep_prediction
    grads, losses = [], []
    for masks in (batch["mask"], None):
        torch.manual_seed(0)
        loss = adapter.loss({**batch, "mask": masks} if masks is not None else
                            {k: v for k, v in batch.items() if k != "mask"}, adapter.trainable_modules())
        loss.backward()
        grads.append(predictions[-1].grad)
        losses.append(loss.detach())
    masked_grad, full_grad = grads
    # each sample's white half on the latent grid (a flipped view's mask is flipped: its right half)
    kept = loss_weights(batch["mask"], full_grad.shape, 0.0).expand_as(full_grad)
    assert set(kept.unique().tolist()) == {0.0, 1.0}
    assert full_grad.ne(0).sum() == full_grad.numel()
    assert masked_grad.ne(0).sum() * 2 == full_grad.numel()                     # half the support
    assert torch.equal(masked_grad.ne(0), kept.bool())                          # exactly the white half
    torch.testing.assert_close(masked_grad * kept, full_grad * kept)
    # the loss: each sample's mean over all its latent values of mask x squared error. The unmasked gradient is
    # 2 (pred - target) / values per sample, so it gives the error back.
    per_sample = full_grad[0].numel()
    squared = (full_grad * per_sample / 2).pow(2)
    torch.testing.assert_close(losses[1], squared.flatten(1).mean(1).sum(), rtol=1e-5, atol=0)
    torch.testing.assert_close(losses[0], (squared * kept).flatten(1).mean(1).sum(), rtol=1e-5, atol=0)
    assert 0.3 < losses[0] / losses[1] < 0.7


def test_mask_min_weights_the_rest_and_masks_are_cached(tmp_path, masked, run_cli, capsys):
    weights = loss_weights(torch.tensor([[[[255, 255, 0, 0]] * 2]], dtype=torch.uint8), torch.Size((1, 4, 1, 2)),
                           0.25)
    assert weights.tolist() == [[[[1.0, 0.25]]]]                                # each latent pixel its patch's mean
    out = tmp_path / "run"
    args = diffusion_train_args("quickstart_sd.yaml", out, f"data.path={masked}", "data.masked_loss=true",
                                "data.mask_min=0.25", "train.steps=1")
    assert run_cli(*args) == 0
    assert "masks: 0 cached, 2 cut (data.mask_min=0.25)" in capsys.readouterr().err
    assert run_cli(*args, "--fresh") == 0
    assert "masks: 2 cached, 0 cut (data.mask_min=0.25)" in capsys.readouterr().err


def test_a_missing_mask_and_a_mask_of_the_wrong_size_are_named(tmp_path, masked, run_cli, capsys):
    (masked / "masks" / "extra.png").write_bytes(b"")  # a stray file in masks/ is not an image to train
    images = sorted(p for p in masked.glob("*.png") if not p.name.endswith(".mask.png"))
    moved = masked / "masks" / images[1].name
    moved.rename(tmp_path / "kept.png")
    args = diffusion_train_args("quickstart_sd.yaml", tmp_path / "run", f"data.path={masked}", "data.masked_loss=true")
    assert run_cli(*args) == 2
    err = capsys.readouterr().err
    assert (f"data.path: data.masked_loss is on and 1 image(s) have no mask: {images[1].name}\n  fix: add "
            f"name.mask.png beside each image or name.png in {masked / 'masks'}") in err
    assert "Traceback" not in err
    _half_mask((32, 64)).save(moved)
    assert run_cli(*args) == 2
    err = capsys.readouterr().err
    assert f"data.masked_loss: the mask {moved} is 32x64 and its image {images[1].name} is 64x64" in err
    assert "fix: save the mask at the image's size" in err


def test_an_empty_regularisation_folder_is_named(tmp_path, run_cli, capsys):
    data, empty = tmp_path / "data", tmp_path / "reg"
    write_shapes_dataset(data, sizes=((64, 64),), count=2)
    empty.mkdir()
    args = diffusion_train_args("quickstart_sd.yaml", tmp_path / "run", f"data.path={data}",
                                f"data.datasets=[{{path: {empty}, is_regularization: true}}]")
    assert run_cli(*args) == 2
    err = capsys.readouterr().err
    # named with the config's other problems, before any model loads
    assert f"'data.datasets[0].path' in command line: no images or videos in {empty} (it is empty)" in err
    assert "Traceback" not in err


def test_a_dataset_without_masks_beside_a_masked_one_trains_every_pixel(tmp_path, masked):
    reg = tmp_path / "reg"
    write_shapes_dataset(reg, sizes=((64, 64),), count=1)
    adapter, dataset = adapter_for("quickstart_sd.yaml", tmp_path, f"data.path={masked}", "data.masked_loss=true",
                                   f"data.datasets=[{{path: {reg}, is_regularization: true, masked_loss: false}}]")
    assert [item.mask is not None for item in dataset.items] == [True, True, False]
    assert dataset.masks[2][0].shape == (1, 64, 64) and dataset.masks[2][0].eq(255).all()
    batch = dataset.collate([0, 2])
    weights = loss_weights(batch["mask"], torch.Size((2, 4, 8, 8)), 0.0)
    assert weights[0].mean() == 0.5 and weights[1].eq(1).all()
