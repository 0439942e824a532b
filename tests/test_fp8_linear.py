"""model.quantize=fp8: the toolkit's own fp8 linear layers (toolkit/kernels/fp8_linear.py). The arithmetic of
both paths against the formula and against the bf16 layer, what backward keeps, which device gets which path,
the refusals, and runs through the real entry point."""

from __future__ import annotations

import pytest
import torch
from helpers import diffusion_train_args, read_metrics
from safetensors.torch import load_file

from toolkit.device.detect import DeviceInfo
from toolkit.kernels.fp8_linear import Float8Linear, fp8_format, fp8_matmul_supported

E4M3 = torch.float8_e4m3fn


def layer(seed: int = 0, inputs: int = 64, outputs: int = 96, bias: bool = True) -> torch.nn.Linear:
    torch.manual_seed(seed)
    return torch.nn.Linear(inputs, outputs, bias=bias).to(torch.bfloat16)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.detach().float() - b.detach().float()).norm() / b.detach().float().norm())


def quantized_rows(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The formula, written out: each row scaled so its largest magnitude is 448, rounded to e4m3."""
    scale = t.float().abs().amax(dim=1, keepdim=True) / 448
    return (t.float() / scale).to(E4M3).float(), scale


def test_the_stored_weight_is_each_row_scaled_to_e4m3():
    base = layer()
    fp8 = Float8Linear(base, E4M3, matmul=True, compute_dtype=torch.bfloat16)
    assert fp8.weight.dtype == torch.uint8 and fp8.weight_scale.dtype == torch.int32  # fp32 scales' bits
    assert not fp8.weight.requires_grad and fp8.bias is not None and not fp8.bias.requires_grad
    q, scale = quantized_rows(base.weight)
    assert torch.equal(fp8.weight.view(E4M3).float(), q)
    assert fp8.scale.dtype == torch.float32 and torch.allclose(fp8.scale, scale.view(-1))
    assert fp8.weight.view(E4M3).float().abs().amax(dim=1).eq(448).all()  # every row uses the whole range
    assert rel(fp8.dequantized(), base.weight) < 0.03  # e4m3: 3 mantissa bits
    kept = fp8.scale.clone()
    fp8.to(torch.float16)  # a whole-model dtype cast leaves the 8-bit weight and its fp32 scales alone
    assert fp8.weight.dtype == torch.uint8 and torch.equal(fp8.scale, kept)


@pytest.mark.parametrize("matmul", [True, False], ids=["fp8-matmul", "upcast"])
def test_forward_and_input_gradient_follow_the_formula(matmul):
    base = layer()
    fp8 = Float8Linear(base, E4M3, matmul=matmul, compute_dtype=torch.bfloat16)
    assert fp8.matmul is matmul
    x = torch.randn(3, 5, 64, dtype=torch.bfloat16, requires_grad=True)
    y = fp8(x)
    grad = torch.randn_like(y)
    y.backward(grad)
    w = fp8.weight.view(E4M3).float() * fp8.scale[:, None]
    if matmul:  # the input quantized row by row; backward folds the weight's scale into the gradient first
        qx, sx = quantized_rows(x.detach().reshape(-1, 64))
        expect_y = (qx * sx) @ w.t() + base.bias.float()
        g = grad.reshape(-1, 96).float() * fp8.scale[None, :]
        qg, sg = quantized_rows(g)
        expect_gx = (qg * sg) @ fp8.weight.view(E4M3).float()
    else:
        expect_y = x.detach().reshape(-1, 64).float() @ w.to(torch.bfloat16).float().t() + base.bias.float()
        expect_gx = grad.reshape(-1, 96).float() @ w.to(torch.bfloat16).float()
    assert y.dtype == torch.bfloat16 and x.grad.dtype == torch.bfloat16
    assert rel(y.reshape(-1, 96), expect_y) < 0.01  # the rest is bf16 rounding of the output
    assert rel(x.grad.reshape(-1, 64), expect_gx) < 0.01
    # and against the 16-bit layer: the error fp8 costs
    x16 = x.detach().requires_grad_()
    y16 = base(x16)
    y16.backward(grad)
    assert rel(y, y16) < 0.06 and rel(x.grad, x16.grad) < 0.06


def test_transposed_inputs_and_gradients_give_the_same_numbers():
    """A column-major input (or gradient) reshapes to a column-major view, which cuBLASLt refuses as the first
    operand: the quantized rows are made contiguous. The same values either way give the same numbers."""
    fp8 = Float8Linear(layer(), E4M3, matmul=True, compute_dtype=torch.bfloat16)
    x, grad = torch.randn(5, 64, dtype=torch.bfloat16), torch.randn(5, 96, dtype=torch.bfloat16)
    rows = x.clone().requires_grad_()
    y_rows = fp8(rows)
    y_rows.backward(grad)
    columns = x.t().contiguous().requires_grad_()  # columns.t(): the same values, column-major
    y_columns = fp8(columns.t())
    y_columns.backward(grad.t().contiguous().t())
    assert not columns.t().is_contiguous()
    assert torch.equal(y_rows, y_columns) and torch.equal(rows.grad, columns.grad.t())


def test_backward_keeps_only_the_8_bit_weight():
    """Nothing of the input is saved for backward (the base is frozen): the weight's bits and its scales."""
    fp8 = Float8Linear(layer(), E4M3, matmul=True, compute_dtype=torch.bfloat16)
    saved = []
    x = torch.randn(4, 64, dtype=torch.bfloat16, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        fp8(x)
    assert {(t.dtype, tuple(t.shape)) for t in saved} == {(torch.uint8, (96, 64)), (torch.int32, (96,))}


def test_autocast_and_shapes_the_fp8_kernels_do_not_take():
    # under bf16 autocast an fp32 input takes the fp8 path and gives bf16, like an autocast nn.Linear
    fp8 = Float8Linear(layer(), E4M3, matmul=True, compute_dtype=torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert fp8(torch.randn(2, 64)).dtype == torch.bfloat16
    # fp32 compute, and sides that are not multiples of 16, upcast instead
    assert fp8(torch.randn(2, 64)).dtype == torch.float32
    odd = Float8Linear(layer(inputs=24, outputs=40), E4M3, matmul=True, compute_dtype=torch.bfloat16)
    assert not odd.matmul and odd(torch.randn(2, 24, dtype=torch.bfloat16)).shape == (2, 40)


def info(backend: str, arch: str) -> DeviceInfo:
    return DeviceInfo(backend=backend, arch=arch, name="fake", memory_gb=24.0, bf16=True)


def test_which_devices_run_fp8_matmuls():
    assert [fp8_matmul_supported(info("cuda", a)) for a in ("sm_80", "sm_86", "sm_89", "sm_90", "sm_100", "sm_120")] \
        == [False, False, True, True, True, True]
    assert [fp8_matmul_supported(info("hip", a)) for a in ("gfx942", "gfx950", "gfx1100", "gfx1151")] \
        == [True, True, False, False]
    assert fp8_matmul_supported(info("cpu", "cpu"))
    assert fp8_format(info("hip", "gfx942")) == torch.float8_e4m3fnuz  # MI300's own variant
    assert fp8_format(info("hip", "gfx1151")) == fp8_format(info("cuda", "sm_90")) == E4M3


def test_peft_wraps_it_and_keeps_the_lora_in_16_or_32_bits():
    from peft import LoraConfig, get_peft_model

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = Float8Linear(layer(), E4M3, matmul=True, compute_dtype=torch.bfloat16)

        def forward(self, x):
            return self.proj(x)

    config = LoraConfig(r=4, lora_alpha=4, target_modules=["proj"])
    # PEFT gives the LoRA the base layer's dtype: compute_dtype's, not the uint8 bits'
    plain = get_peft_model(Net(), config, autocast_adapter_dtype=False)
    assert plain.base_model.model.proj.lora_A["default"].weight.dtype == torch.bfloat16
    net = get_peft_model(Net(), LoraConfig(r=4, lora_alpha=4, target_modules=["proj"]), autocast_adapter_dtype=True)
    a = net.base_model.model.proj.lora_A["default"].weight
    assert a.dtype == torch.float32 and a.requires_grad  # as the toolkit trains it
    x = torch.randn(2, 64, dtype=torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        net(x).float().square().sum().backward()
    assert a.grad is not None and torch.isfinite(a.grad).all()


def test_flux_trains_with_fp8_weights_through_the_cli(run_cli, tmp_path, capsys):
    """The blocks' linear layers become fp8 (embedders and the output head stay 16-bit); the losses stay within
    fp8's error of the 16-bit run, and the LoRA file holds the same keys."""
    runs = {}
    for name, extra in (("fp8", ["model.quantize=fp8"]), ("bf16", ["model.quantize=none"])):
        assert run_cli(*diffusion_train_args("quickstart_flux.yaml", tmp_path / name, *extra)) == 0
        runs[name] = capsys.readouterr().err
    assert "model: quantized 20 linear layers of the transformer to fp8 (toolkit)" in runs["fp8"]
    assert "model.quantize_backend=toolkit" in runs["fp8"] and "quantized" not in runs["bf16"].split("model.quantize")[0]
    fp8, bf16 = ([r["loss"] for r in read_metrics(tmp_path / n)] for n in ("fp8", "bf16"))
    assert len(fp8) == 2 and fp8 != bf16 and fp8 == pytest.approx(bf16, rel=0.02)
    files = [load_file(tmp_path / n / "final" / "pytorch_lora_weights.safetensors") for n in ("fp8", "bf16")]
    assert files[0].keys() == files[1].keys() and all(t.dtype != torch.uint8 for t in files[0].values())


def test_llm_trains_with_fp8_weights_through_the_cli(run_cli, tmp_path, capsys):
    from conftest import REPO

    assert run_cli("train", REPO / "configs/examples/quickstart_llm.yaml", f"run.output_dir={tmp_path}",
                   "model.quantize=fp8", "train.steps=2", "save.every=0", "sample.prompts=[]", "log.every=1") == 0
    err = capsys.readouterr().err
    assert "model: quantized 14 linear layers to fp8 after loading" in err  # every linear layer but the head
    losses = [r["loss"] for r in read_metrics(tmp_path)]
    assert len(losses) == 2 and all(0 < x < 20 for x in losses)
    assert (tmp_path / "final" / "adapter_model.safetensors").is_file()


def test_wan22_experts_train_with_fp8_weights_and_offload(run_cli, tmp_path, capsys):
    """Both experts quantized (the idle one where it waits), trained in turn across an expert switch."""
    assert run_cli(*diffusion_train_args("quickstart_wan22.yaml", tmp_path, "model.quantize=fp8",
                                         "model.expert_offload=true", "train.expert_switch_every=1")) == 0
    err = capsys.readouterr().err
    assert "quantized" in err and "of the transformer to fp8 (toolkit)" in err
    assert "of the transformer_2 to fp8 (toolkit)" in err
    losses = [r["loss"] for r in read_metrics(tmp_path)]
    assert len(losses) == 2 and all(0 < x < 20 for x in losses)


@pytest.mark.parametrize("extra, message", [
    (["network.type=dora", "save.format=auto"], "'network.type'=dora needs the base weights in 16 bits"),
    (["model.block_swap=1"], "not combined with model.quantize=fp8"),
    (["model.quantize_backend=torchao"], "'model.quantize_backend'=torchao: model.quantize=fp8 is the toolkit's own"),
])
def test_what_fp8_is_not_combined_with(run_cli, tmp_path, capsys, extra, message):
    """Refused while the config is checked: exit 2, a line naming the key, and no run folder made."""
    assert run_cli(*diffusion_train_args("quickstart_flux.yaml", tmp_path / "run", "model.quantize=fp8", *extra)) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert not (tmp_path / "run").exists()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_on_the_gpu_the_fp8_kernels_follow_the_formula_eager_and_compiled():
    """torch._scaled_mm on the GPU computes the formula (the same as the CPU test's); compiled (fullgraph) too."""
    from toolkit.device.detect import detect_device

    device = detect_device()
    if not fp8_matmul_supported(device):
        pytest.skip(f"{device.arch} has no fp8 matmuls")
    fmt = fp8_format(device)
    module = Float8Linear(layer(inputs=256, outputs=512).cuda(), fmt, matmul=True, compute_dtype=torch.bfloat16)
    x = torch.randn(64, 256, dtype=torch.bfloat16, device="cuda")
    grad = torch.randn(64, 512, dtype=torch.bfloat16, device="cuda")
    w8, scale = module.weight.view(fmt).float(), module.scale
    qx, sx = quantized_rows(x)
    qg, sg = quantized_rows(grad.float() * scale[None, :])
    expect_y, expect_gx = (qx * sx) @ (w8 * scale[:, None]).t() + module.bias.float(), (qg * sg) @ w8
    for run in (module, torch.compile(module, fullgraph=True)):
        leaf = x.clone().requires_grad_()
        y = run(leaf)
        y.backward(grad)
        assert rel(y, expect_y) < 0.01 and rel(leaf.grad, expect_gx) < 0.01
    columns = x.t().contiguous().requires_grad_()  # column-major input and gradient: cuBLASLt takes them too
    y = module(columns.t())
    y.backward(grad.t().contiguous().t())
    assert rel(y, expect_y) < 0.01 and rel(columns.grad.t(), expect_gx) < 0.01


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_on_the_gpu_quantizing_never_holds_the_16_bit_model():
    """quantize_linear_layers brings each layer's 16-bit weight over alone: the peak stays well under the
    16-bit model's size (the first version held every moved layer until the loop ended)."""
    from toolkit.device.detect import detect_device
    from toolkit.models.quantize import quantize_linear_layers

    model = torch.nn.Sequential(*(torch.nn.Linear(2048, 512, bias=False) for _ in range(64))).to(torch.bfloat16)
    sixteen = sum(p.numel() * 2 for p in model.parameters())
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    assert quantize_linear_layers(model, "fp8", torch.bfloat16, torch.device("cuda"), backend="toolkit",
                                  info=detect_device()) == 64
    assert torch.cuda.max_memory_allocated() - before < 0.75 * sixteen
    assert all(p.device.type == "cuda" for p in model.parameters())
