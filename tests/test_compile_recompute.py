"""train.compile_recompute: what a compiled LoRA decoder layer keeps for its backward (CPU, inductor's C++)."""

from __future__ import annotations

import collections
import math

import pytest
import torch

from toolkit.train.compile import recompute_elementwise

HIDDEN, INTERMEDIATE, TOKENS = 96, 384, (2, 40)


def layer_with_lora(device: str = "cpu", dtype: torch.dtype = torch.float32):
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, vocab_size=128, max_position_embeddings=64)
    model = LlamaForCausalLM(config).to(device, dtype).requires_grad_(False)
    model.config.use_cache = False
    model = get_peft_model(model, LoraConfig(r=8, lora_alpha=8, target_modules="all-linear", lora_dropout=0.0),
                           autocast_adapter_dtype=True)

    for name, param in model.named_parameters():  # B is zero at init: give the update something to carry
        if "lora_B" in name:
            torch.nn.init.normal_(param, std=0.02)
    return model


def saved_and_grads(compiled: bool, pointwise: bool, device: str = "cpu", dtype: torch.dtype = torch.float32):
    """Bytes of the activations autograd keeps for one forward (weights excluded), and the LoRA gradients."""
    torch._dynamo.reset()
    recompute_elementwise(pointwise)
    model = layer_with_lora(device, dtype)
    decoder = model.base_model.model.model
    if compiled:
        decoder.layers[0].compile()
    ids = torch.randint(0, 128, TOKENS, generator=torch.Generator().manual_seed(1)).to(device)
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    kept = collections.Counter()

    def pack(tensor):
        if tensor.untyped_storage().data_ptr() not in weights and tensor.dim() >= 2:
            kept[tuple(tensor.shape)] += tensor.numel() * tensor.element_size()
        return tensor

    for record in (False, True):  # the first call compiles
        kept.clear()
        model.zero_grad(set_to_none=True)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), \
                torch.autocast(device, dtype=dtype, enabled=dtype != torch.float32):
            hidden = decoder(input_ids=ids).last_hidden_state
        hidden.float().square().mean().backward()
    grads = {n: p.grad.float().clone() for n, p in model.named_parameters() if p.requires_grad}
    return sum(kept.values()), kept, grads


@pytest.fixture(autouse=True)
def default_partitioner():
    yield
    recompute_elementwise(False)
    torch._dynamo.reset()


def intermediate_bytes(kept) -> int:
    """Bytes of the kept tokens x intermediate activations (not the 16-bit copies of LoRA weights)."""
    tokens = math.prod(TOKENS)
    return sum(v for k, v in kept.items() if k[-1] == INTERMEDIATE and math.prod(k[:-1]) == tokens)


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def test_pointwise_keeps_less_and_trains_the_same_gradients():
    """fp32 on the CPU, so that compiled and eager gradients compare to 1e-4."""
    eager_bytes, _, eager = saved_and_grads(compiled=False, pointwise=False)
    default_bytes, default_kept, default = saved_and_grads(compiled=True, pointwise=False)
    lean_bytes, lean_kept, lean = saved_and_grads(compiled=True, pointwise=True)
    # The SwiGLU product (tokens x intermediate) is kept by default besides gate and up; pointwise recomputes it.
    per_tensor = math.prod(TOKENS) * INTERMEDIATE * 4
    assert intermediate_bytes(default_kept) == 3 * per_tensor
    assert intermediate_bytes(lean_kept) == 2 * per_tensor
    assert lean_bytes < 0.8 * default_bytes < 0.8 * eager_bytes
    for name, grad in eager.items():
        assert relative(default[name], grad) < 1e-4 and relative(lean[name], grad) < 1e-4, name


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA or ROCm GPU")
def test_pointwise_on_the_gpu_in_bf16():
    """Triton kernels under bf16 autocast: the SwiGLU product is recomputed, and the gradients stay within bf16
    rounding of the default partition's."""
    _, default_kept, default = saved_and_grads(compiled=True, pointwise=False, device="cuda", dtype=torch.bfloat16)
    _, lean_kept, lean = saved_and_grads(compiled=True, pointwise=True, device="cuda", dtype=torch.bfloat16)
    per_tensor = math.prod(TOKENS) * INTERMEDIATE * 2
    assert (intermediate_bytes(default_kept), intermediate_bytes(lean_kept)) == (3 * per_tensor, 2 * per_tensor)
    for name, grad in default.items():
        assert relative(lean[name], grad) < 2e-2, name
