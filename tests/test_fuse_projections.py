"""model.fuse_projections (toolkit/models/shared_input.py, lora_a_rows.py): q/k/v and gate/up LoRA layers run as
one matmul each with B inside the frozen product, o_proj and down_proj with A inside theirs, with PEFT's numbers,
PEFT's state dict and PEFT's saved adapter."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import read_metrics
from safetensors.torch import load_file

from conftest import REPO
from toolkit.plan.run import load_run
from toolkit.device.detect import DeviceInfo, cpu_device_info
from toolkit.models.shared_input import SharedInputGroup, group_shared_inputs

H100 = DeviceInfo("cuda", "sm_90", "test H100", 80.0, bf16=True)


def lora_model(model_type="llama", device="cpu", dtype=torch.float32, layers=2, extra_config=None, **lora):
    """A tiny random causal LM of `model_type` under PEFT LoRA on every linear layer, B initialised non-zero."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    config = AutoConfig.for_model(model_type, vocab_size=96, hidden_size=64, intermediate_size=160,
                                  num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                                  max_position_embeddings=64, **(extra_config or {}))
    model = AutoModelForCausalLM.from_config(config).to(device, dtype).requires_grad_(False)
    model.config.use_cache = False
    settings = dict(r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.0) | lora
    net = get_peft_model(model, LoraConfig(**settings), autocast_adapter_dtype=True)
    for name, param in net.named_parameters():  # B is zero at init: give the update something to carry
        if "lora_B" in name:
            torch.nn.init.normal_(param, std=0.1)
    return net


def lora_llama(device="cpu", dtype=torch.float32, layers=2, **lora):
    return lora_model("llama", device, dtype, layers, **lora)


def loss_and_grads(net, ids, device="cpu", dtype=torch.float32):
    net.zero_grad(set_to_none=True)
    with torch.autocast(device, dtype=dtype, enabled=dtype != torch.float32):
        loss = net(input_ids=ids, labels=ids).loss
    loss.backward()
    return float(loss.detach()), {n: p.grad.float().clone() for n, p in net.named_parameters() if p.requires_grad}


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def assert_trains_like(grouped, reference, ids=None):
    """fp32: the grouped model's loss within 1e-6 and every LoRA gradient within 1e-5 of the reference's."""
    if ids is None:
        ids = torch.randint(0, 96, (2, 24), generator=torch.Generator().manual_seed(1))
    want_loss, want = loss_and_grads(reference, ids)
    loss, got = loss_and_grads(grouped, ids)
    assert loss == pytest.approx(want_loss, rel=1e-6)
    assert got.keys() == want.keys()
    for name in want:
        assert relative(got[name], want[name]) < 1e-5, name
    return got


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_grouped_layers_train_like_peft(compiled):
    """fp32 on the CPU: the same loss and the same gradient for every LoRA weight as PEFT's own layers,
    eager and with each decoder layer compiled whole (fullgraph: the group adds no graph break)."""
    torch._dynamo.reset()
    reference = lora_llama()
    grouped = copy.deepcopy(reference)
    grouping = group_shared_inputs(grouped)
    assert len(grouping.groups) == 4  # q/k/v and gate/up in each of 2 layers
    assert len(grouping.rows) == 4  # o_proj and down_proj in each of 2 layers
    assert grouping.mlps == 2  # each layer's MLP as one Function (gated_mlp.py)
    if compiled:
        for layer in grouped.base_model.model.model.layers:
            layer.compile(fullgraph=True)
    for _ in range(2):  # the second call runs what the first compiled, and finds nothing left over
        assert len(assert_trains_like(grouped, reference)) == 2 * 7 * 2
    for group in (m for m in grouped.modules() if isinstance(m, SharedInputGroup)):
        assert group._pending.outputs == {} and group._pending.source is None


ARCHITECTURES = {  # q/k/v biases (qwen2), norms on q and k (qwen3), soft-capping and head_dim (gemma2)
    "qwen2": dict(), "qwen3": dict(head_dim=16), "gemma2": dict(head_dim=16, query_pre_attn_scalar=16),
    "mistral": dict()}


@pytest.mark.parametrize("model_type", ARCHITECTURES)
def test_other_decoders_train_like_peft(model_type):
    reference = lora_model(model_type, extra_config=ARCHITECTURES[model_type])
    grouped = copy.deepcopy(reference)
    grouping = group_shared_inputs(grouped)
    assert len(grouping.groups) == 4 and len(grouping.rows) == 4 and grouping.mlps == 2  # gelu_tanh: gemma2
    assert_trains_like(grouped, reference)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_the_single_layers_alone_train_like_peft(compiled):
    """o_proj and down_proj with A inside the frozen product, nothing grouped: PEFT's loss and gradients."""
    torch._dynamo.reset()
    reference = lora_llama()
    rows_only = copy.deepcopy(reference)
    grouping = group_shared_inputs(rows_only, siblings=())
    assert not grouping.groups and len(grouping.rows) == 4
    if compiled:
        for layer in rows_only.base_model.model.model.layers:
            layer.compile(fullgraph=True)
    for _ in range(2):
        assert_trains_like(rows_only, reference)


def test_a_single_layer_holds_a_in_the_rows_below_its_weight():
    """[W ; A]: the layer's weight is the buffer's first rows (contiguous, the same storage), A is copied into
    the last rows before the forward, and the state dict is PEFT's."""
    reference = lora_llama(layers=1)
    net = copy.deepcopy(reference)
    group_shared_inputs(net)
    mlp = net.base_model.model.model.layers[0].mlp
    rows, down = mlp.lora_a_rows_down, mlp.down_proj
    assert rows.weight.shape == (64 + 4, 160)
    weight = down.base_layer.weight
    assert weight.is_contiguous() and weight.data_ptr() == rows.weight.data_ptr() and not weight.requires_grad
    with torch.no_grad():
        down.lora_A["default"].weight.add_(1.0)  # as an optimizer step would
        net(input_ids=torch.randint(0, 96, (1, 8)))
    assert torch.equal(rows.weight[64:], down.lora_A["default"].weight)
    assert torch.equal(rows.weight[:64], reference.base_model.model.model.layers[0].mlp.down_proj.base_layer.weight)
    want, got = reference.state_dict(), net.state_dict()
    assert got.keys() == want.keys()


def test_a_single_layer_keeps_low_for_backward_not_the_whole_product():
    """The product x·[W ; A]^T is tokens x (out + r); B's gradient needs only its last r columns. Kept as a view,
    they held the whole product until backward (1 GiB more at the peak on the Llama-1B bench)."""
    net = lora_llama(layers=1)
    group_shared_inputs(net, siblings=())
    down = net.base_model.model.model.layers[0].mlp.down_proj
    x = torch.randn(2, 12, 160, requires_grad=True)
    with torch.no_grad():
        down.lora_A["default"].weight.add_(1.0)  # called outside the model's pre-hook: the layer copies A itself
    kept = []

    def pack(tensor):
        kept.append(tensor.untyped_storage().nbytes())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = down(x)
    out.sum().backward()
    product = 2 * 12 * (64 + 4) * 4  # the fp32 product [frozen | low]
    assert kept and product not in kept
    assert 2 * 12 * 4 * 4 in kept  # low, its own r columns
    rows = net.base_model.model.model.layers[0].mlp.lora_a_rows_down
    assert torch.equal(rows.weight[64:], down.lora_A["default"].weight)


def test_layers_with_biases_train_like_peft_and_keep_the_output_dtype():
    """Biases on every projection (attention_bias, mlp_bias): fp32 parity; under bf16 autocast over an fp32 base
    the single layers return bf16, as PEFT's do (the bias is added inside the product)."""
    reference = lora_model("llama", extra_config=dict(attention_bias=True, mlp_bias=True))
    grouped = copy.deepcopy(reference)
    grouping = group_shared_inputs(grouped)
    assert len(grouping.groups) == 4 and len(grouping.rows) == 4 and grouping.mlps == 2
    assert_trains_like(grouped, reference)
    down = grouped.base_model.model.model.layers[0].mlp.down_proj
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert down(torch.randn(2, 3, 160)).dtype == torch.bfloat16


def test_a_single_vector_and_a_deleted_adapter():
    """A 1-D input trains (PEFT's layers take one); after delete_adapter the model runs PEFT's own layers."""
    reference = lora_llama(layers=1)
    net = copy.deepcopy(reference)
    group_shared_inputs(net, reset_before=net.get_base_model().get_decoder())  # the hook where the toolkit puts it
    for name in ("self_attn.o_proj", "mlp.down_proj"):
        got, want = (m.base_model.model.model.layers[0].get_submodule(name) for m in (net, reference))
        x = torch.randn(got.base_layer.in_features)
        got(x).square().sum().backward()
        want(x).square().sum().backward()
        assert relative(got.lora_A["default"].weight.grad, want.lora_A["default"].weight.grad) < 1e-5, name
    ids = torch.randint(0, 96, (1, 8))
    for model in (net, reference):
        model.delete_adapter("default")
    with torch.no_grad():  # PeftModel itself refuses to run without its active adapter: its model does
        got, want = (m.base_model.model(input_ids=ids).logits for m in (net, reference))
    assert torch.allclose(got, want, atol=1e-5)


def test_a_single_layer_wider_out_than_in_is_left_alone():
    """A inside suits layers whose input is the wide side; up_proj (64 -> 160) keeps PEFT's layer."""
    net = lora_llama(layers=1)
    grouping = group_shared_inputs(net, siblings=(), singles=("up_proj", "down_proj"))
    mlp = net.base_model.model.model.layers[0].mlp
    assert [r._member for r in grouping.rows] == [mlp.down_proj]


def test_the_frozen_weights_are_held_once_and_the_state_dict_is_peft_s(tmp_path):
    reference = lora_llama(layers=1)
    grouped = copy.deepcopy(reference)
    group_shared_inputs(grouped)
    attention = grouped.base_model.model.model.layers[0].self_attn
    group = attention.shared_input_q_k_v
    assert group.weight.shape == (64 + 32 + 32, 64 + 3 * 4)  # [W | block-diagonal B, rank 4 each]
    for row, name in zip((0, 64, 96), ("q_proj", "k_proj", "v_proj")):
        weight = getattr(attention, name).base_layer.weight
        assert weight.untyped_storage().data_ptr() == group.weight.untyped_storage().data_ptr()
        assert weight.storage_offset() == row * (64 + 12) and not weight.requires_grad
    want, got = reference.state_dict(), grouped.state_dict()
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    reference.save_pretrained(tmp_path / "a")
    grouped.save_pretrained(tmp_path / "b")
    a, b = (load_file(tmp_path / x / "adapter_model.safetensors") for x in "ab")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_the_buffer_holds_each_up_projection_on_the_diagonal_after_a_forward():
    net = lora_llama(layers=1)
    group_shared_inputs(net)
    attention = net.base_model.model.model.layers[0].self_attn
    with torch.no_grad():
        for name in ("q_proj", "k_proj", "v_proj"):
            getattr(attention, name).lora_B["default"].weight.add_(1.0)  # as an optimizer step would
        net(input_ids=torch.randint(0, 96, (1, 8)))
    lora_b = attention.shared_input_q_k_v.weight[:, 64:]
    want = torch.block_diag(*[getattr(attention, n).lora_B["default"].weight for n in ("q_proj", "k_proj", "v_proj")])
    assert torch.equal(lora_b, want)


def test_an_input_without_gradient_is_not_given_one():
    """The first decoder layer's q/k/v read frozen embeddings: backward then multiplies the output's gradient by
    B's columns only (2·tokens·out·r flops), not the whole buffer (2·tokens·out·(in + r)), and A's and B's
    gradients are the same as with an input that needs its gradient. (Compiled, the same: the first layer's
    graph is its own, and test_grouped_layers_train_like_peft compares its gradients with PEFT's.)"""
    from torch.utils.flop_counter import FlopCounterMode

    net = lora_llama(layers=1)
    group_shared_inputs(net)
    attention = net.base_model.model.model.layers[0].self_attn
    group = attention.shared_input_q_k_v
    lora = [p for n, p in attention.named_parameters()
            if "lora_" in n and n.split(".")[0] in ("q_proj", "k_proj", "v_proj")]
    assert len(lora) == 6
    x = torch.randn(2, 8, 64, generator=torch.Generator().manual_seed(3))
    grads, flops = {}, {}
    for needs in (True, False):
        source = x.clone().requires_grad_(needs)
        out = group.product(source)
        counter = FlopCounterMode(display=False)
        with counter:
            out.square().sum().backward()
        flops[needs] = counter.get_total_flops()
        grads[needs] = [p.grad.clone() for p in lora]
        assert (source.grad is not None) is needs
        net.zero_grad(set_to_none=True)
    tokens, width, ranks = 16, 64, 3 * 4
    out_cols = group.weight.shape[0]
    # the buffer's product for x's gradient, and (autograd's own) the x·A^T product's
    assert flops[True] - flops[False] == 2 * tokens * width * (out_cols + ranks)
    for with_input, without in zip(grads[True], grads[False]):  # A's from products of another width: rounding
        torch.testing.assert_close(without, with_input, rtol=1e-6, atol=1e-7)


def compiled_grouped_pair():
    """A tiny model under PEFT, and a copy grouped as the toolkit groups it (the pre-hook on the decoder) with each
    decoder layer compiled whole (fullgraph)."""
    torch._dynamo.reset()
    reference = lora_llama()
    grouped = copy.deepcopy(reference)
    group_shared_inputs(grouped, reset_before=grouped.get_base_model().get_decoder())
    for layer in grouped.base_model.model.model.layers:
        layer.compile(fullgraph=True)
    return reference, grouped


def test_compiled_layers_follow_the_optimizer_s_steps_like_peft():
    """Compiled layers do not copy B themselves; the pre-hook does before each forward: three AdamW steps give
    PEFT's losses, step for step (fp32)."""
    reference, grouped = compiled_grouped_pair()
    ids = torch.randint(0, 96, (2, 24), generator=torch.Generator().manual_seed(1))
    losses = {}
    for key, net in (("peft", reference), ("grouped", grouped)):
        optimizer = torch.optim.AdamW([p for p in net.parameters() if p.requires_grad], lr=1e-2)
        losses[key] = []
        for _ in range(3):
            loss, _ = loss_and_grads(net, ids)
            optimizer.step()
            losses[key].append(loss)
    assert losses["grouped"] == pytest.approx(losses["peft"], rel=1e-5)
    assert losses["peft"][2] < losses["peft"][0] - 0.01  # the steps changed B (and the loss)


def test_two_forwards_before_one_backward_give_peft_s_gradients():
    """The copy into the buffer leaves its version alone, so a graph still waiting for backward stays valid."""
    reference = lora_llama(layers=1)
    grouped = copy.deepcopy(reference)
    group_shared_inputs(grouped)
    ids = torch.randint(0, 96, (2, 24), generator=torch.Generator().manual_seed(1))
    grads = []
    for net in (reference, grouped):
        loss = net(input_ids=ids, labels=ids).loss + net(input_ids=ids.flip(1), labels=ids.flip(1)).loss
        loss.backward()
        grads.append({n: p.grad for n, p in net.named_parameters() if p.requires_grad})
    for name in grads[0]:
        assert relative(grads[1][name], grads[0][name]) < 1e-5, name


def test_an_fp32_base_under_bf16_autocast_trains_like_peft():
    """Backward runs outside autocast: the group's backward computes in the forward's dtype (bf16 here) over a
    buffer in fp32, within bf16 rounding of PEFT's layers."""
    reference = lora_llama()
    grouped = copy.deepcopy(reference)
    group_shared_inputs(grouped)
    ids = torch.randint(0, 96, (2, 24), generator=torch.Generator().manual_seed(1))
    want_loss, want = loss_and_grads(reference, ids, dtype=torch.bfloat16)
    loss, got = loss_and_grads(grouped, ids, dtype=torch.bfloat16)
    assert loss == pytest.approx(want_loss, rel=1e-3)
    for name in want:
        assert relative(got[name], want[name]) < 3e-2, name


def test_compiled_layers_evaluate_under_no_grad_in_one_graph():
    """Eval and sampling (no_grad) take the plain product: a compiled layer stays one graph (fullgraph)."""
    reference, grouped = compiled_grouped_pair()
    ids = torch.randint(0, 96, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want, got = (net(input_ids=ids).logits for net in (reference, grouped))
    assert torch.allclose(got, want, atol=1e-5)


def test_a_member_called_on_its_own_input_runs_its_own_forward():
    """Only calls with one input share work: k on another tensor, or q twice, gives PEFT's output."""
    reference = lora_llama(layers=1)
    grouped = copy.deepcopy(reference)
    group_shared_inputs(grouped)
    ref, new = (m.base_model.model.model.layers[0].self_attn for m in (reference, grouped))
    x, y = torch.randn(3, 64), torch.randn(3, 64)
    with torch.no_grad():
        assert torch.allclose(new.q_proj(x), ref.q_proj(x), atol=1e-6)
        assert torch.allclose(new.k_proj(y), ref.k_proj(y), atol=1e-6)   # another input: computed anew
        assert torch.allclose(new.q_proj(x), ref.q_proj(x), atol=1e-6)   # q again before v: computed anew
        assert torch.allclose(new.v_proj(x), ref.v_proj(x), atol=1e-6)
        new.k_proj.enable_adapters(False)  # PEFT's own path for a state the group does not handle
        assert torch.allclose(new.k_proj(x), ref.k_proj.base_layer(x), atol=1e-6)


@pytest.mark.parametrize("lora", [dict(lora_dropout=0.1), dict(use_dora=True)], ids=["dropout", "dora"])
def test_layers_that_do_not_share_their_input_s_work_are_left_alone(lora):
    grouping = group_shared_inputs(lora_llama(layers=1, **lora))
    assert grouping.groups == [] and grouping.left == 2


def test_a_set_not_every_layer_of_which_is_adapted_is_left_alone_and_counted():
    grouping = group_shared_inputs(lora_llama(layers=1, target_modules=["q_proj", "v_proj", "gate_proj", "up_proj"]))
    assert len(grouping.groups) == 1 and grouping.left == 1  # gate/up grouped; k_proj is no LoRA layer


def test_checkpointed_and_compiled_layers_compile_whole_and_train_like_peft():
    """transformers' gradient checkpointing around each compiled layer (as the toolkit runs it): fullgraph
    compiles the checkpointed layer with the group inside, and the numbers are PEFT's."""
    from toolkit.models.llm_loading import checkpoint_layers

    torch._dynamo.reset()
    reference = lora_llama()
    grouped = copy.deepcopy(reference)
    group_shared_inputs(grouped)
    for net in (reference, grouped):
        checkpoint_layers(net.get_base_model())
        net.train()
    for layer in grouped.base_model.model.model.layers:
        layer.compile(fullgraph=True)
    assert_trains_like(grouped, reference)


def test_a_forward_that_raised_between_members_is_forgotten_at_the_next_forward():
    """What a failed forward left in a group (with its autograd graph) is dropped when the decoder runs again,
    before any layer: the batch-size probe retries after running out of memory."""
    import gc
    import weakref

    net = lora_llama(layers=1)
    decoder = net.get_base_model().get_decoder()
    group = group_shared_inputs(net, reset_before=decoder).groups[0]
    attention = decoder.layers[0].self_attn
    hook = attention.k_proj.register_forward_hook(lambda *_: (_ for _ in ()).throw(torch.OutOfMemoryError("probe")))
    ids = torch.randint(0, 96, (2, 24))
    with pytest.raises(torch.OutOfMemoryError):
        net(input_ids=ids)
    hook.remove()
    left = weakref.ref(group._pending.outputs["v_proj"])
    decoder(input_ids=ids)
    gc.collect()
    assert left() is None and group._pending.outputs == {}


def _resolved(*overrides, device=H100):
    return load_run([REPO / "configs/examples/quickstart_llm.yaml"], list(overrides), device=device).cfg


def test_auto_is_on_for_a_compiled_gpu_run_and_off_where_unmeasured():
    assert _resolved("device.preset=auto", "train.compile=true").model.fuse_projections is True
    assert _resolved("device.preset=auto", "train.compile=false").model.fuse_projections is False
    assert _resolved("device.preset=auto", "train.compile=true", "network.dropout=0.1").model.fuse_projections is False
    assert _resolved(device=cpu_device_info("test")).model.fuse_projections is False  # the quickstart on a CPU
    mi300 = DeviceInfo("hip", "gfx942", "test MI300X", 192.0, bf16=True)
    assert _resolved("device.preset=auto", "train.compile=true", device=mi300).model.fuse_projections is False


@pytest.mark.parametrize("example", ["llm_llama32_1b.yaml", "llm_qwen25_1p5b.yaml"])
def test_the_example_configs_get_it_on_a_gpu(example):
    cfg = load_run([REPO / "configs/examples" / example], ["device.preset=auto"], device=H100).cfg
    assert cfg.train.compile is True and cfg.model.fuse_projections is True


@pytest.mark.parametrize("extra, message", [
    ("network.type=dora", "network.type=dora (each layer normalises its own weight)"),
    ("network.dropout=0.05", "network.dropout=0.05 (each layer drops its own input)"),
    ("model.quantize=8bit", "model.quantize=8bit (the frozen weights are quantized)"),
])
def test_true_where_it_cannot_apply_is_refused(run_cli, tmp_path, capsys, extra, message):
    """Exit 2, a line naming the key and what stands in the way, no run folder made."""
    assert run_cli("train", str(REPO / "configs/examples/quickstart_llm.yaml"), f"run.output_dir={tmp_path / 'run'}",
                   "model.fuse_projections=true", extra) == 2
    err = capsys.readouterr().err
    assert "'model.fuse_projections'=true cannot apply with " + message in err and "Traceback" not in err
    assert not (tmp_path / "run").exists()


def test_through_the_entry_point_the_losses_are_peft_s(run_cli, tmp_path, capsys, monkeypatch):
    """The quickstart, 6 steps, true against false: equal losses (fp32 on the CPU), and the log says so; the
    training steps run the gated MLPs (no hook or state of the trainer's turns them off)."""
    from toolkit.models import gated_mlp

    calls = []
    apply = gated_mlp._GatedDown.apply
    monkeypatch.setattr(gated_mlp._GatedDown, "apply", lambda *args: calls.append(1) or apply(*args))
    losses = {}
    for value in ("true", "false"):
        out = tmp_path / value
        assert run_cli("train", str(REPO / "configs/examples/quickstart_llm.yaml"), f"run.output_dir={out}",
                       "train.steps=6", "save.every=0", "sample.every=0", "log.every=1",
                       f"model.fuse_projections={value}") == 0
        losses[value] = [r["loss"] for r in read_metrics(out)]
    log = capsys.readouterr().err
    assert "model.fuse_projections: 4 groups of LoRA layers" in log and "; 2 gated MLPs compute" in log
    assert len(calls) >= 6 * 2  # two MLPs a forward, one forward or more a step
    assert len(losses["true"]) == 6 and losses["true"] == pytest.approx(losses["false"], rel=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA or ROCm GPU")
def test_compiled_in_bf16_on_the_gpu():
    """bf16 autocast, each layer compiled: the loss and every LoRA gradient as close to the fp32 truth as PEFT's
    own under bf16 (two bf16 results each carry their own rounding, so each is measured against fp32)."""
    torch._dynamo.reset()
    truth = lora_llama("cuda", torch.float32, layers=2)
    ids = torch.randint(0, 96, (4, 64), generator=torch.Generator().manual_seed(1)).cuda()
    true_loss, true_grads = loss_and_grads(truth, ids, "cuda", torch.float32)
    reference, grouped = copy.deepcopy(truth), copy.deepcopy(truth)
    for net in (reference, grouped):  # a bf16 base, the LoRA weights in fp32 (autocast_adapter_dtype)
        for name, param in net.named_parameters():
            if "lora_" not in name:
                param.data = param.data.to(torch.bfloat16)
    grouping = group_shared_inputs(grouped)
    assert len(grouping.groups) == 4 and len(grouping.rows) == 4 and grouping.mlps == 2
    results = []
    for net in (reference, grouped):
        for layer in net.base_model.model.model.layers:
            layer.compile(fullgraph=True)
        results.append(loss_and_grads(net, ids, "cuda", torch.bfloat16))
    (peft_loss, peft), (loss, got) = results
    assert abs(loss - true_loss) <= 2 * abs(peft_loss - true_loss) + 1e-3 * true_loss
    for name in true_grads:
        assert relative(got[name], true_grads[name]) <= 1.5 * relative(peft[name], true_grads[name]) + 2e-3, name
