"""train.checkpoint_offload: the saved inputs of checkpointed layers go through the offload hooks, and only they."""

from __future__ import annotations

import pytest
import torch

from conftest import REPO
from helpers import read_metrics
from toolkit.models.checkpoint_offload import InputOffload
from toolkit.models.llm_loading import checkpoint_layers

QUICKSTART = REPO / "configs/examples/quickstart_llm.yaml"


def tiny_llama(device: str):
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=100, max_position_embeddings=64)
    model = LlamaForCausalLM(config).to(device).requires_grad_(False)
    model.config.use_cache = False
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=4, target_modules="all-linear", lora_dropout=0.1))
    for name, param in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(param, std=0.05)
    return model.train()


def loss_and_grads(device: str, offload: InputOffload | None):
    model = tiny_llama(device)
    assert checkpoint_layers(model.get_base_model(), offload) == (0 if offload is None else 3)
    ids = torch.randint(0, 100, (2, 24), generator=torch.Generator().manual_seed(1)).to(device)
    torch.manual_seed(2)  # LoRA dropout: the recompute must draw what the forward drew
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return float(loss), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


def test_the_hooks_see_each_checkpointed_layers_input_once_and_change_nothing():
    """A non-reentrant checkpoint saves its inputs through the hooks around its call, before it enters its own:
    one saved tensor per layer (its hidden states), and the same loss and gradients as without the hooks."""
    offload = InputOffload(torch.device("cpu"))
    loss, grads = loss_and_grads("cpu", offload)
    expected_loss, expected = loss_and_grads("cpu", None)
    assert (offload.saved, offload.moved) == (3, 0)  # nothing to move to on the CPU
    assert loss == expected_loss and all(torch.equal(grads[n], expected[n]) for n in expected)


def test_through_the_entry_point_and_its_config_rules(tmp_path, run_cli, capsys):
    common = ["train", QUICKSTART, "train.steps=3", "log.every=1", "sample.every=0", "save.every=0",
              "train.gradient_checkpointing=true"]
    assert run_cli(*common, f"run.output_dir={tmp_path / 'plain'}") == 0
    assert run_cli(*common, f"run.output_dir={tmp_path / 'offload'}", "train.checkpoint_offload=true") == 0
    err = capsys.readouterr().err
    assert ("train.checkpoint_offload: on the cpu the inputs of 2 checkpointed layers stay where they are (no "
            "device memory to free)") in err
    losses = [[r["loss"] for r in read_metrics(tmp_path / name)] for name in ("plain", "offload")]
    assert len(losses[0]) == 3 and losses[0] == losses[1]

    assert run_cli(*common[:-1], f"run.output_dir={tmp_path / 'off'}", "train.gradient_checkpointing=false",
                   "train.checkpoint_offload=true") == 2
    assert "'train.checkpoint_offload' moves the inputs of checkpointed layers" in capsys.readouterr().err
    assert not (tmp_path / "off").exists()
    assert run_cli("train", REPO / "configs/examples/quickstart_sd.yaml", f"run.output_dir={tmp_path / 'sd'}",
                   "train.checkpoint_offload=true") == 2
    assert "checkpoint_offload" in capsys.readouterr().err


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA or ROCm GPU")
def test_on_the_gpu_the_inputs_go_to_pinned_memory_and_come_back_unchanged(monkeypatch):
    """Side-stream copies out in forward and back in backward (each layer's predecessor prefetched): the same loss
    and gradients, bit for bit, as checkpointing without offload."""
    import toolkit.models.checkpoint_offload as module

    monkeypatch.setattr(module, "MIN_BYTES", 0)  # the tiny model's hidden states are small
    offload = InputOffload(torch.device("cuda"))
    seen, pack = [], offload.pack
    offload.pack = lambda tensor: seen.append(tensor.device.type) or pack(tensor)
    loss, grads = loss_and_grads("cuda", offload)
    expected_loss, expected = loss_and_grads("cuda", None)
    # each layer's hidden states moved; on a GPU the checkpoint also saves one CPU tensor per call, kept as it is
    assert seen.count("cuda") == offload.moved == 3 and set(seen) <= {"cuda", "cpu"}
    assert loss == expected_loss and all(torch.equal(grads[n], expected[n]) for n in expected)
