"""A gated MLP as one Function over its gate/up group and down's LoraARows (toolkit/models/gated_mlp.py), and the
backward that computes down's A gradient with the activation's (toolkit/kernels/gated_backward.py). The model-level
parity with PEFT (eager, compiled, checkpointed, Llama to Gemma 2, the entry point) is in test_fuse_projections.py,
whose tests that group gate/up and single out down_proj run these MLPs."""

from __future__ import annotations

import copy

import pytest
import torch
from test_fuse_projections import lora_llama, lora_model, relative
from transformers.activations import ACT2FN

from toolkit.kernels.gated_backward import gated_backward, reference, register
from toolkit.models.gated_mlp import gated_activation
from toolkit.models.shared_input import group_shared_inputs

ACTS = {"silu": "silu", "gelu_tanh": "gelu_pytorch_tanh"}  # ours: transformers' name


def autograd_truth(gate_up, grad_h, grad_low, act):
    """The gradients by autograd through transformers' own activation, in fp64."""
    gate_up = gate_up.double().requires_grad_()
    gate, up = gate_up.chunk(2, dim=-1)
    h = ACT2FN[ACTS[act]](gate) * up
    grad, = torch.autograd.grad(h, gate_up, grad_h.double())
    rank = grad_low.shape[-1]
    return grad, grad_low.reshape(-1, rank).double().t() @ h.detach().reshape(-1, h.shape[-1])


def inputs(tokens, features, rank, dtype, device="cpu", seed=0):
    """gate_up [2, tokens/2, 2F], grad_h, and grad_low as the last r columns of a wider gradient (a strided view,
    as the Function passes it)."""
    g = torch.Generator(device).manual_seed(seed)
    shape = (2, tokens // 2)
    gate_up = torch.randn(*shape, 2 * features, generator=g, device=device).mul(2).to(dtype)
    grad_h = torch.randn(*shape, features, generator=g, device=device).to(dtype)
    grad_wide = torch.randn(*shape, 24 + rank, generator=g, device=device).to(dtype)
    return gate_up, grad_h, grad_wide[..., 24:]


@pytest.mark.parametrize("act", ACTS)
def test_the_reference_backward_is_autograd_s(act):
    """fp32: gate's and up's gradients and A's equal autograd's through transformers' activation; bf16: as close
    to that truth as bf16 rounding of the result allows."""
    gate_up, grad_h, grad_low = inputs(10, 48, 4, torch.float32)
    want_gate_up, want_a = autograd_truth(gate_up, grad_h, grad_low, act)
    got_gate_up, got_a = reference(gate_up, grad_h, grad_low, act)
    assert got_gate_up.dtype == torch.float32 and got_a.shape == (4, 48)
    assert torch.allclose(got_gate_up.double(), want_gate_up, rtol=1e-5, atol=1e-5)
    assert torch.allclose(got_a.double(), want_a, rtol=1e-5, atol=1e-5)
    half = [t.bfloat16() for t in (gate_up, grad_h, grad_low)]
    want_gate_up, want_a = autograd_truth(*half, act)
    got_gate_up, got_a = reference(*half, act)
    assert got_gate_up.dtype == torch.bfloat16 and got_a.dtype == torch.float32
    assert relative(got_gate_up.double(), want_gate_up) < 4e-3
    assert relative(got_a.double(), want_a) < 4e-3


def test_only_transformers_gated_form_with_a_known_activation_is_taken_over():
    from transformers.models.gemma2.modeling_gemma2 import Gemma2MLP
    from transformers.models.llama.modeling_llama import LlamaMLP

    llama = lora_llama(layers=1).base_model.model.model.layers[0].mlp
    gemma = lora_model("gemma2", layers=1, extra_config=dict(head_dim=16, query_pre_attn_scalar=16))
    assert isinstance(llama, LlamaMLP) and gated_activation(llama) == "silu"
    assert gated_activation(gemma.base_model.model.model.layers[0].mlp) == "gelu_tanh"
    assert isinstance(gemma.base_model.model.model.layers[0].mlp, Gemma2MLP)

    class Doubled(LlamaMLP):  # another forward: not the gated form
        def forward(self, x):
            return 2 * self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))

    doubled = Doubled.__new__(Doubled)
    doubled.__dict__ = dict(llama.__dict__)
    assert gated_activation(doubled) is None
    relu = copy.deepcopy(llama)
    relu.act_fn = ACT2FN["relu"]
    assert gated_activation(relu) is None
    erf = copy.deepcopy(llama)
    erf.act_fn = ACT2FN["gelu"]  # exact GELU: the kernel computes the tanh form only
    assert gated_activation(erf) is None


def test_an_mlp_with_another_activation_keeps_its_layers_fused_one_by_one():
    reference_net = lora_llama(layers=1)
    reference_net.base_model.model.model.layers[0].mlp.act_fn = ACT2FN["relu"]
    net = copy.deepcopy(reference_net)
    grouping = group_shared_inputs(net)
    assert grouping.mlps == 0 and len(grouping.groups) == 2 and len(grouping.rows) == 2
    ids = torch.randint(0, 96, (2, 10), generator=torch.Generator().manual_seed(3))
    assert torch.allclose(net(input_ids=ids).logits, reference_net(input_ids=ids).logits, atol=1e-5)


def test_the_mlp_keeps_gate_up_for_backward_not_h():
    """What backward needs from the MLP: gate_up (the group's product, tokens x 2F), never h (tokens x F), which
    down's layer on its own keeps as its input."""
    net = lora_llama(layers=1)
    mlp = net.base_model.model.model.layers[0].mlp
    x = torch.randn(2, 12, 64, requires_grad=True)
    shapes = {}
    for fused in (False, True):
        if fused:
            assert group_shared_inputs(net).mlps == 1
        kept = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(tuple(t.shape)) or t, lambda t: t):
            out = mlp(x)
        out.sum().backward()
        shapes[fused] = kept
    assert (2, 12, 160) in shapes[False]  # PEFT's down_proj keeps its input h
    assert (2, 12, 160) not in shapes[True] and (2, 12, 320) in shapes[True]


def test_disabled_or_merged_adapters_run_the_model_s_own_mlp():
    reference_net = lora_llama(layers=1)
    net = copy.deepcopy(reference_net)
    assert group_shared_inputs(net).mlps == 1
    ids = torch.randint(0, 96, (2, 10), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        for model in (net, reference_net):
            model.base_model.model.model.layers[0].mlp.down_proj.merge()
        got, want = (m(input_ids=ids).logits for m in (net, reference_net))
        assert torch.allclose(got, want, atol=1e-5)
        for model in (net, reference_net):
            model.base_model.model.model.layers[0].mlp.down_proj.unmerge()
        with net.disable_adapter(), reference_net.disable_adapter():
            got, want = (m(input_ids=ids).logits for m in (net, reference_net))
        assert torch.allclose(got, want, atol=1e-5)
        got, want = (m(input_ids=ids).logits for m in (net, reference_net))
        assert torch.allclose(got, want, atol=1e-5)


def test_unload_hooks_and_mixed_adapter_batches_run_the_layers_themselves():
    """States the MLP cannot see in its layers' flags: PEFT's unload() (the base layers put back), a forward hook
    on a layer (it must fire), PEFT's mixed-batch adapter_names (passed to the layers by pre-hooks)."""
    reference_net = lora_llama(layers=1)
    net = copy.deepcopy(reference_net)
    assert group_shared_inputs(net, reset_before=net.get_base_model().get_decoder()).mlps == 1
    ids = torch.randint(0, 96, (2, 6), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        for model in (net, reference_net):
            model.eval()
        names = ["__base__", "default"]
        got, want = (m(input_ids=ids, adapter_names=names).logits for m in (net, reference_net))
        assert relative(got, want) < 1e-6
        fired = []
        mlp = net.base_model.model.model.layers[0].mlp
        handles = [getattr(mlp, name).register_forward_hook(lambda *_, name=name: fired.append(name))
                   for name in ("gate_proj", "up_proj", "down_proj")]
        got, want = (m(input_ids=ids).logits for m in (net, reference_net))
        assert fired == ["gate_proj", "up_proj", "down_proj"] and relative(got, want) < 1e-6
        for handle in handles:
            handle.remove()
        got, want = (m.unload()(input_ids=ids).logits for m in (net, reference_net))
        assert torch.equal(got, want)


def test_an_fp64_model_keeps_fp64():
    reference_net = lora_llama(layers=1, dtype=torch.float64)
    net = copy.deepcopy(reference_net)
    assert group_shared_inputs(net).mlps == 1
    ids = torch.randint(0, 96, (2, 8), generator=torch.Generator().manual_seed(3))
    grads = []
    for model in (net, reference_net):
        model(input_ids=ids, labels=ids).loss.backward()
        grads.append({n: p.grad for n, p in model.named_parameters() if p.requires_grad})
    for name, want in grads[1].items():
        assert grads[0][name].dtype == torch.float64 and relative(grads[0][name], want) < 1e-12, name


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA or ROCm GPU")
@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("tokens, features, rank", [(8192, 8192, 16), (1000, 300, 8), (130, 256, 40),
                                                    (512, 2048, 128)])
def test_the_triton_kernel_is_the_reference_on_the_gpu(act, tokens, features, rank):
    """bf16: gate's and up's gradients within one bf16 rounding of the reference's (the same fp32 math, another
    order of operations); A's within 1e-3 (h rounded to bf16 on both sides: where the fp32 values differ in the
    last bits, a rounding flips)."""
    assert register()
    gate_up, grad_h, grad_low = inputs(tokens, features, rank, torch.bfloat16, "cuda")
    got_gate_up, got_a = gated_backward(gate_up, grad_h, grad_low, act)
    want_gate_up, want_a = reference(gate_up, grad_h, grad_low, act)
    assert got_gate_up.shape == gate_up.shape and got_gate_up.dtype == torch.bfloat16
    difference = (got_gate_up.float() - want_gate_up.float()).abs()
    assert (difference <= want_gate_up.float().abs() * 2 ** -7 + 1e-6).all()
    assert got_a.dtype == torch.float32 and relative(got_a, want_a) < 1e-3


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA or ROCm GPU")
def test_the_kernel_runs_inside_a_compiled_layer():
    """The custom op in a compiled graph (fullgraph): the same gradients as the eager Function."""
    from toolkit.models.gated_mlp import _GatedDown

    assert register()
    torch._dynamo.reset()
    gate_up = torch.randn(4, 64, 2 * 320, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    weight = torch.randn(64 + 16, 320, device="cuda", dtype=torch.bfloat16) / 20
    lora_a = torch.zeros(16, 320, device="cuda", requires_grad=True)

    def run(gate_up, lora_a):
        return _GatedDown.apply(gate_up, weight, None, lora_a, "silu").float().square().sum()

    grads = []
    for fn in (run, torch.compile(run, fullgraph=True)):
        gate_up.grad = lora_a.grad = None
        fn(gate_up, lora_a).backward()
        grads.append((gate_up.grad.float(), lora_a.grad))
    (eager_gate_up, eager_a), (compiled_gate_up, compiled_a) = grads
    assert relative(compiled_gate_up, eager_gate_up) < 1e-2 and relative(compiled_a, eager_a) < 1e-2
