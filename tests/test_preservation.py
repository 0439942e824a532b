"""Differential output preservation (train.dop_class, train.dop_weight): the LoRA's prediction for the class caption
pulled towards the base model's, computed in the same step with the adapter switched off."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from conftest import run_toolkit
from helpers import adapter_for, diffusion_train_args
from toolkit.models.objectives import per_sample_mse
from toolkit.tiny.fixtures import write_shapes_dataset

SINGLE_THREAD = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
LORA = "pytorch_lora_weights.safetensors"

pytestmark = pytest.mark.usefixtures("own_data_caches")


def test_dop_weight_0_trains_bit_for_bit_as_plain_training_and_weight_1_does_not(tmp_path):
    data = tmp_path / "data"
    write_shapes_dataset(data, sizes=((64, 64),), count=4)
    env = {**SINGLE_THREAD, "TOOLKIT_CACHE": str(tmp_path / "cache")}
    finals = {}
    for name, extra in (("plain", []), ("dop0", ["train.dop_class=shape", "train.dop_weight=0"]),
                        ("dop1", ["train.dop_class=shape", "train.dop_weight=1"])):
        out = tmp_path / name
        proc = run_toolkit(*diffusion_train_args("quickstart_sd.yaml", out, f"data.path={data}", "train.steps=3",
                                                 "log.tensorboard=false", *extra), env=env)
        assert proc.returncode == 0, proc.stderr
        if extra:
            assert ("output preservation: 4 of 4 items with a class caption (their trigger word -> 'shape'; "
                    f"train.dop_weight={extra[1][-1]})") in proc.stderr
        finals[name] = load_file(str(out / "final" / LORA))
    assert finals["plain"].keys() == finals["dop0"].keys() and len(finals["plain"]) > 0
    assert all(torch.equal(finals["plain"][k], finals["dop0"][k]) for k in finals["plain"])
    assert any(not torch.equal(finals["plain"][k], finals["dop1"][k]) for k in finals["plain"])


def test_the_base_prediction_is_the_model_with_its_lora_off(tmp_path):
    data, reg = tmp_path / "data", tmp_path / "reg"
    write_shapes_dataset(data, sizes=((64, 64),), count=2)
    write_shapes_dataset(reg, sizes=((64, 64),), count=2)
    adapter, dataset = adapter_for("quickstart_sd.yaml", tmp_path, f"data.path={data}", "train.dop_class=shape",
                                   "train.dop_weight=0.5", f"data.datasets=[{{path: {reg}, is_regularization: true}}]")
    assert dataset.dop_captions[:2] == [item.caption.replace("sks", "shape") for item in dataset.items[:2]]
    assert dataset.dop_captions[0].startswith("shape, a ")
    assert dataset.dop_captions[2:] == [None, None]   # regularisation images are not preserved
    lora_b = [p for n, p in adapter.network.named_parameters() if "lora_B" in n]
    torch.manual_seed(1)
    with torch.no_grad():
        for p in lora_b:  # a trained LoRA: its prediction differs from the base model's
            p.normal_(std=0.5)
    batch = dataset.collate([0, 2])
    assert batch["preserve"].tolist() == [True, False]
    calls = []
    predict = adapter.predict
    adapter.predict = lambda *args: calls.append((args[1], args[2], predict(*args))) or calls[-1][2]
    torch.manual_seed(0)
    total = adapter.loss(batch, adapter.trainable_modules())
    plain, base, lora = (c[2] for c in calls)
    noised, class_cond = calls[1][0], calls[1][1]
    assert not base.requires_grad and lora.requires_grad
    # the base prediction is the prediction with the LoRA's B at zero, the LoRA's is the same call with it back
    saved = [p.detach().clone() for p in lora_b]
    with torch.no_grad():
        for p in lora_b:
            p.zero_()
        without = predict(adapter_denoiser(adapter), noised, class_cond, batch)
        for p, s in zip(lora_b, saved):
            p.copy_(s)
        again = predict(adapter_denoiser(adapter), noised, class_cond, batch)
    torch.testing.assert_close(base, without, rtol=0, atol=0)
    torch.testing.assert_close(lora.detach(), again, rtol=0, atol=0)   # the adapter is on again afterwards
    preservation = per_sample_mse(lora.detach(), base)
    assert preservation[0] > 0
    main = adapter.objective.loss(plain.detach(), noised)
    torch.testing.assert_close(total.detach(), main.sum() + 0.5 * preservation[0], rtol=1e-6, atol=0)


def adapter_denoiser(adapter):
    from toolkit.models.diffusion_base import Denoiser

    name = adapter.active_denoiser()
    component = adapter.component(name)
    return Denoiser(adapter.trainable_modules()[name], component.dtype, component.config)
