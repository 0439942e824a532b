"""The memory plan: model.quantize / model.expert_offload auto from the device memory and the preset's budget,
the quantization library per backend, and the batch-size cap of the large diffusion families."""

from __future__ import annotations

import pytest

from conftest import REPO
from toolkit.plan.run import load_run
from toolkit.device.detect import DeviceInfo
from toolkit.errors import UserError
from toolkit.models.quantize import choose_backend, choose_quantize, plan_weights

A14B = {"transformer": 14_300_000_000, "transformer_2": 14_300_000_000}


def gpu(memory_gb: float, backend: str = "hip", arch: str = "gfx1100") -> DeviceInfo:
    return DeviceInfo(backend=backend, arch=arch, name="test GPU", memory_gb=memory_gb, bf16=True)


def test_wan22_a14b_on_a_24_gb_card_offloads_and_quantizes_to_4bit():
    # budget 24 * 0.9 * 0.6 = 12.96 GB: one expert is 28.6 GB in 16 bits, 14.3 in 8 bits, 7.2 in 4 bits
    mode, offload, why = plan_weights("auto", "auto", A14B, gpu(24), 0.9)
    assert (mode, offload) == ("4bit", True)
    assert "one expert resident, the other in CPU memory: 7.2 GB of weights within the 13.0 GB budget" in why


def test_wan22_a14b_on_strix_halo_keeps_16bit_with_offload():
    # gfx1151 reporting 96 GB, preset memory_fraction 0.75: budget 43.2 GB; both experts 57.2 GB, one 28.6 GB
    mode, offload, _ = plan_weights("auto", "auto", A14B, gpu(96, arch="gfx1151"), 0.75)
    assert (mode, offload) == ("none", True)


def test_wan22_a14b_on_a_big_gpu_keeps_both_experts_in_16bit():
    assert plan_weights("auto", "auto", A14B, gpu(141, "cuda", "sm_90"), 0.9)[:2] == ("none", False)


def test_explicit_settings_win_and_offload_needs_two_experts():
    assert plan_weights("8bit", "auto", A14B, gpu(24), 0.9)[:2] == ("8bit", True)
    assert plan_weights("none", False, A14B, gpu(24), 0.9)[:2] == ("none", False)
    with pytest.raises(UserError, match="only Wan 2.2 A14B has two experts"):
        plan_weights("auto", True, {"transformer": 12_000_000_000}, gpu(24), 0.9)


def test_flux_on_24_gb_is_quantized_to_8bit_and_the_cpu_never_is():
    mode, why = choose_quantize("auto", lambda: 11_900_000_000, gpu(24), 0.9, "the transformer")
    assert mode == "8bit" and "takes 11.9 GB in 8-bit weights, which fit the 13.0 GB weight budget" in why
    cpu = DeviceInfo(backend="cpu", arch="cpu", name="CPU", memory_gb=24, bf16=False)
    assert choose_quantize("auto", lambda: 1 / 0, cpu, 0.9)[0] == "none"  # not even counted


def test_quantization_library_per_backend():
    assert choose_backend("auto", "8bit", "hip")[0] == "torchao"
    assert choose_backend("auto", "4bit", "hip")[0] == "bitsandbytes"
    assert choose_backend("auto", "8bit", "cuda")[0] == "bitsandbytes"
    with pytest.raises(UserError, match="torchao supports 8bit only"):
        choose_backend("torchao", "4bit", "cuda")


def test_auto_batch_size_is_capped_for_video_families():
    run = load_run([REPO / "configs/examples/wan22_t2v_a14b_gfx1151.yaml"], ["train.batch_size=auto"],
                   device=gpu(96, arch="gfx1151"))
    assert run.cfg.train.batch_size == 1
    assert any("capped at 1 for wan22" in str(d) for d in run.decisions)
    assert run.cfg.device.memory_fraction == 0.75 and run.sources["device.memory_fraction"].startswith("preset gfx1151")


def test_distributed_auto_shards_only_a_base_that_does_not_fit_one_gpu():
    from toolkit.plan.weights import choose_distributed

    flux = lambda: 11_900_000_000  # noqa: E731  (23.8 GB in 16-bit)
    # 80 GB: budget 80 * 0.9 * 0.6 = 43.2 GB, the base fits: a copy per GPU
    assert choose_distributed("auto", 2, flux, gpu(80, "cuda", "sm_90"), 0.9)[0] == "ddp"
    # 24 GB: budget 12.96 GB, 23.8 GB does not fit: sharded, 11.9 GB each
    mode, why = choose_distributed("auto", 2, flux, gpu(24, "cuda", "sm_89"), 0.9)
    assert mode == "fsdp" and "does not fit the 13.0 GB weight budget of one device; sharded over 2, 11.9 GB each" in why
    assert choose_distributed("auto", 2, lambda: None, gpu(24), 0.9) == (
        "ddp", "auto: the base's size is not known before loading")
    assert choose_distributed("auto", 1, flux, gpu(24), 0.9)[0] == "ddp"
    assert choose_distributed("auto", 2, flux, DeviceInfo(backend="cpu", arch="cpu", name="cpu", memory_gb=24.0,
                                                          bf16=False), 0.9)[0] == "ddp"
    assert choose_distributed("fsdp", 2, flux, gpu(80), 0.9) == ("fsdp", "set in the config")


def test_base_parameters_are_counted_without_loading(tmp_path):
    """The count device.distributed=auto decides from equals the loaded model's (both Wan 2.2 experts)."""
    from diffusers import WanPipeline
    from transformers import AutoModelForCausalLM

    from helpers import cpu_runtime
    from toolkit.models import build_adapter

    counts = {}
    for config in ("quickstart_llm.yaml", "quickstart_wan22.yaml"):
        run = load_run([REPO / "configs/examples" / config], [f"run.output_dir={tmp_path}"])
        adapter = build_adapter(run.cfg, cpu_runtime(run, tmp_path))
        counts[config] = (adapter.memory.base_parameters(), adapter.model_path)
    llm_count, llm_path = counts["quickstart_llm.yaml"]
    assert llm_count == sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(llm_path).parameters())
    wan_count, wan_path = counts["quickstart_wan22.yaml"]
    pipe = WanPipeline.from_pretrained(wan_path)
    assert wan_count == sum(p.numel() for m in (pipe.transformer, pipe.transformer_2) for p in m.parameters())


def test_wan22_a14b_on_24_gb_with_block_swap_auto_keeps_16bit_offloads_and_swaps_each_expert():
    """Block swap instead of 4-bit: one expert on the device at a time (the other offloaded), and each expert swaps
    the fewest blocks that bring its 28.6 GB of 16-bit weights within the 12.96 GB budget."""
    from types import SimpleNamespace

    import torch
    from omegaconf import OmegaConf

    from toolkit.models.base import repeated_blocks
    from toolkit.models.flow_memory import FlowMemory

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.empty(14_300_000_000 // 40, dtype=torch.bfloat16, device="meta"),
                                             requires_grad=False)

    def expert():
        root = torch.nn.Module()
        root._no_split_modules = ["Block"]
        root.blocks = torch.nn.ModuleList(Block() for _ in range(40))
        return root

    experts = {"transformer": expert(), "transformer_2": expert()}
    mode, offload, why = plan_weights("auto", "auto", A14B, gpu(24), 0.9)
    adapter = SimpleNamespace(
        cfg=OmegaConf.create({"model": {"block_swap": "auto"}, "device": {"memory_fraction": 0.9}}),
        runtime=SimpleNamespace(info=gpu(24)), quantize_setting=lambda: "auto",
        lora_denoiser_names=lambda: list(experts), component=experts.__getitem__,
        denoiser_blocks=lambda name: repeated_blocks(experts[name], outermost=True))
    memory = FlowMemory(adapter)
    memory.quantize, memory.offload = mode, offload
    plans, why = memory.plan_block_swap(A14B, "auto", why)
    assert (memory.quantize, memory.offload) == ("none", True)
    # 28.6 - 12.96 = 15.64 GB to move at 0.715 GB a block: 22 blocks of 40, in each expert
    assert {name: len(plan.swapped) for name, plan in plans.items()} == {"transformer": 22, "transformer_2": 22}
    assert why.startswith("model.quantize=auto -> none, model.expert_offload=true: 16-bit weights with blocks swapped")
    assert "; transformer: model.block_swap=auto -> 22" in why and "; transformer_2: model.block_swap=auto -> 22" in why
