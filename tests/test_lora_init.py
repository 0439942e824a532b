"""network.init: how a LoRA's down matrix A starts, read back from the files a run writes before any step moves it
(train.lr=0). gaussian is N(0, 1/rank), as diffusers' training scripts start it (the diffusion families' auto);
kaiming is PEFT's kaiming-uniform with a = sqrt(5), kohya's, musubi-tuner's and ai-toolkit's start: uniform in
+-1/sqrt(fan_in), std 1/sqrt(3 fan_in) (the llm's auto). Loss parity beside musubi-tuner found the difference
(docs/performance.md): at one lr the two take steps of different size."""

from __future__ import annotations

import math

import pytest
import torch
from safetensors.torch import load_file

from conftest import REPO

ZERO_LR = ["train.steps=1", "train.lr=0", "save.dtype=fp32", "sample.prompts=[]", "network.rank=16",
           "network.alpha=16", "train.optimizer=adamw"]


def _down_matrices(file) -> dict[str, torch.Tensor]:
    return {k: v.double() for k, v in load_file(str(file)).items() if ".lora_A." in k or "lora_down" in k}


def _assert_gaussian(downs: dict[str, torch.Tensor], rank: int) -> None:
    values = torch.cat([a.flatten() for a in downs.values()])
    assert abs(float(values.std()) * rank - 1) < 0.03, float(values.std())  # N(0, 1/rank), thousands of draws
    assert float(values.abs().max()) > 3 / rank  # a normal's tail: no uniform reaches 3 std


def _assert_kaiming(downs: dict[str, torch.Tensor]) -> None:
    for key, a in downs.items():
        bound = 1 / math.sqrt(a.shape[1])  # fan_in: A is rank x in_features
        assert float(a.abs().max()) <= bound * (1 + 1e-6), key
        assert float(a.abs().max()) > 0.9 * bound, key  # uniform: it reaches near its bound
    ratios = torch.cat([(a * math.sqrt(3 * a.shape[1])).flatten() for a in downs.values()])
    assert abs(float(ratios.std()) - 1) < 0.05  # std 1/sqrt(3 fan_in)


@pytest.mark.parametrize("init", ["auto", "gaussian", "kaiming"])
def test_a_diffusion_lora_starts_as_network_init_says(init, run_cli, tmp_path, own_data_caches):
    """Flux (diffusers names, A unscaled in the file): auto and gaussian give N(0, 1/16); kaiming gives each layer
    uniform +-1/sqrt(fan_in) whatever the rank. B starts at zero either way."""
    out = tmp_path / init
    assert run_cli("train", REPO / "configs/examples/quickstart_flux.yaml", f"run.output_dir={out}", *ZERO_LR,
                   f"network.init={init}") == 0
    file = out / "final" / "pytorch_lora_weights.safetensors"
    downs = _down_matrices(file)
    assert len(downs) > 10
    assert all(float(v.abs().max()) == 0 for k, v in load_file(str(file)).items() if ".lora_B." in k)
    if init == "kaiming":
        _assert_kaiming(downs)
    else:
        _assert_gaussian(downs, 16)


@pytest.mark.parametrize("init", ["auto", "gaussian"])
def test_an_llm_lora_starts_kaiming_unless_told(init, run_cli, tmp_path):
    """The llm's auto is PEFT's own start (kaiming), as before network.init; gaussian is taken when asked."""
    out = tmp_path / init
    assert run_cli("train", REPO / "configs/examples/quickstart_llm.yaml", f"run.output_dir={out}", *ZERO_LR,
                   f"network.init={init}") == 0
    downs = _down_matrices(out / "final" / "adapter_model.safetensors")
    assert len(downs) > 4
    if init == "auto":
        _assert_kaiming(downs)
    else:
        _assert_gaussian(downs, 16)


def test_a_lokr_run_refuses_another_init(run_cli, capsys):
    code = run_cli("validate", REPO / "configs/examples/quickstart_sd.yaml", "network.type=lokr",
                   "network.init=kaiming")
    err = capsys.readouterr().err
    assert code == 2
    assert ("'network.init'=kaiming is a LoRA setting that PEFT's lokr adapter does not have: set network.init=auto, "
            "or network.type=lora") in err
