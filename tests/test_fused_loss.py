"""The fused output head + cross-entropy (toolkit/kernels/linear_cross_entropy.py) against PyTorch's own
cross-entropy, and through the real entry point against the model's own loss."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from conftest import REPO
from helpers import read_metrics
from toolkit.cli import main
from toolkit.kernels.linear_cross_entropy import HeadMath, chunk_rows, compiled_step, linear_cross_entropy
from toolkit.models.llm_loss import FusedCausalLMLoss

CASES = {"plain": (HeadMath(), False, False),
         "softcap+scale+bias, trained head": (HeadMath(scale=0.5, softcap=3.0), True, True)}


def reference(hidden, weight, bias, labels, math_):
    logits = hidden @ weight.t() + (bias if bias is not None else 0)
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32)) * math_.scale
    if math_.softcap is not None:
        logits = math_.softcap * torch.tanh(logits / math_.softcap)
    return F.cross_entropy(logits, labels, reduction="sum")


def _inputs(dtype, device, with_bias, head_grad, tokens=70, size=24, vocab=53):
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(tokens, size, generator=g).to(device, dtype).requires_grad_()
    weight = torch.randn(vocab, size, generator=g).to(device, dtype).requires_grad_(head_grad)
    bias = torch.randn(vocab, generator=g).to(device, dtype).requires_grad_() if with_bias else None
    labels = torch.randint(vocab, (tokens,), generator=g).to(device)
    labels[::4] = -100
    return hidden, weight, bias, labels


def _loss_and_grads(fn, hidden, weight, bias, labels, math_):
    loss = fn(hidden, weight, bias, labels, math_)
    wrt = [t for t in (hidden, weight, bias) if t is not None and t.requires_grad]
    return loss, torch.autograd.grad(3.0 * loss, wrt)  # a scale on the output, as the trainer applies one


@pytest.mark.parametrize("case", CASES)
def test_fused_loss_and_gradients_equal_cross_entropy_in_fp64(case):
    """Chunks of 8 tokens, a quarter of the labels ignored: the sum and every gradient match F.cross_entropy."""
    math_, with_bias, head_grad = CASES[case]
    inputs = _inputs(torch.float64, "cpu", with_bias, head_grad)
    expected, expected_grads = _loss_and_grads(reference, *inputs, math_)
    fused, grads = _loss_and_grads(
        lambda h, w, b, y, m: linear_cross_entropy(h, w, y, bias=b, math_=m, chunk=8), *inputs, math_)
    assert fused.dtype == torch.float64
    assert abs(float(fused) - float(expected)) < 1e-12 * float(expected)
    assert len(grads) == len(expected_grads) == 1 + with_bias + head_grad
    for got, want in zip(grads, expected_grads):
        assert got.dtype == want.dtype and torch.allclose(got, want, rtol=1e-10, atol=1e-12)


def test_no_labelled_token_gives_zero_loss_and_zero_gradient():
    hidden, weight, _, labels = _inputs(torch.float32, "cpu", False, False)
    loss = linear_cross_entropy(hidden, weight, torch.full_like(labels, -100))
    (grad,) = torch.autograd.grad(loss, [hidden])
    assert float(loss) == 0.0 and not grad.any()


def test_compiled_chunks_are_longer_unless_memory_is_saved():
    """At a 128k vocabulary: 512 tokens a chunk eager, 1,024 compiled; gradient checkpointing (asked for, or
    turned on later by the trainer through save_memory) keeps 512, for the lower peak."""
    head = torch.nn.Linear(16, 128256, bias=False, device="meta")
    assert chunk_rows(128256) == 512
    assert FusedCausalLMLoss(head, HeadMath(), compiled=False).chunk is None
    assert FusedCausalLMLoss(head, HeadMath(), compiled=True).chunk == 1024
    assert FusedCausalLMLoss(head, HeadMath(), compiled=True, checkpointing=True).chunk is None
    loss = FusedCausalLMLoss(head, HeadMath(), compiled=True)
    loss.save_memory()
    assert loss.chunk is None


def _train(monkeypatch, out, *extra):
    monkeypatch.chdir(REPO)
    assert main(["train", "configs/examples/quickstart_llm_chat.yaml", f"run.output_dir={out}", "train.steps=6",
                 "save.every=0", "sample.every=0", "train.eval_every=3", "log.every=1", *extra]) == 0
    return read_metrics(out), read_metrics(out, "eval_loss")


def test_fused_loss_trains_like_the_models_own_loss(monkeypatch, tmp_path, capsys):
    """Chat data, packed, prompt tokens ignored: model.kernels=fused gives the losses and eval losses of
    model.kernels=none through the real entry point (fp32 on the CPU: equal to rounding)."""
    own, own_eval = _train(monkeypatch, tmp_path / "none", "model.kernels=none")
    fused, fused_eval = _train(monkeypatch, tmp_path / "fused", "model.kernels=fused")
    assert "model.kernels=fused: output head and cross-entropy in chunks" in capsys.readouterr().err
    assert len(own) == len(fused) == 6 and len(own_eval) == len(fused_eval) == 2
    for a, b in zip(own + own_eval, fused + fused_eval):
        value = "loss" if "loss" in a else "eval_loss"
        assert b[value] == pytest.approx(a[value], rel=1e-5)


def test_auto_is_off_on_the_cpu(monkeypatch, tmp_path, capsys):
    monkeypatch.chdir(REPO)
    assert main(["validate", "configs/examples/quickstart_llm.yaml"]) == 0
    line = [x for x in capsys.readouterr().out.splitlines() if x.startswith("model.kernels ")]
    assert line and "none" in line[0] and "the CPU keeps the model's own loss" in line[0]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA or ROCm GPU")
@pytest.mark.parametrize("case", CASES)
def test_compiled_fused_loss_matches_in_bf16_on_the_gpu(case):
    """bf16 hidden states and head, the compiled chunk step, a 32k vocabulary, against what the model's own
    loss does (the bf16 head's logits upcast to fp32, then cross-entropy): loss within 1e-4 relative,
    gradients within bf16 rounding."""
    math_, with_bias, head_grad = CASES[case]
    inputs = _inputs(torch.bfloat16, "cuda", with_bias, head_grad, tokens=3000, size=256, vocab=32000)
    expected, expected_grads = _loss_and_grads(reference, *inputs, math_)
    step = compiled_step()
    fused, grads = _loss_and_grads(
        lambda h, w, b, y, m: linear_cross_entropy(h, w, y, bias=b, math_=m, step=step, chunk=1024), *inputs, math_)
    assert abs(float(fused) - float(expected)) < 1e-4 * abs(float(expected)), (float(fused), float(expected))
    for got, want in zip(grads, expected_grads):
        assert got.dtype == torch.bfloat16
        error = (got.float() - want.float()).norm() / want.float().norm()
        assert error < 1e-2, float(error)
