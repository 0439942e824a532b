"""Generation (GRPO's completions, samples) runs the decoder eagerly and without cuDNN attention, whatever the
training steps compile or put first (models/generation.py); grpo compiled or with fused projections."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
from safetensors.torch import load_file
from torch._dynamo.utils import counters
from torch.nn.attention import SDPBackend, sdpa_kernel

from toolkit.models.generation import generating
from toolkit.models.llm_objectives import GRPO

pytest.importorskip("trl")


def test_compiled_grpo_traces_its_layers_in_step_1_only(run_cli, monkeypatch, tmp_path):
    """train.compile=true: step 1 compiles the decoder layers for the scoring passes (the policy with gradients,
    the reference without); generating the completions (a new KV length each token, no_grad) traces nothing, and
    the later steps' rows (padded to one width: the longest prompt + train.max_completion_length) trace nothing
    either. Before: step 1's generation traced the layers again, and each step's new width recompiled them until
    dynamo's recompile limit. Dynamo's eager backend: the same tracing and guards as inductor, without its code."""
    compile_module = torch.nn.Module.compile
    monkeypatch.setattr(torch.nn.Module, "compile",
                        lambda self, *args, **kw: compile_module(self, *args, **{**kw, "backend": "eager"}))
    generate, loss, traced = GRPO.generate, GRPO.loss, {"generate": [], "step": []}

    def counting(function, name):
        def counted(self, *args):
            before = counters["frames"]["total"]
            result = function(self, *args)
            traced[name].append(counters["frames"]["total"] - before)
            return result
        return counted

    monkeypatch.setattr(GRPO, "generate", counting(generate, "generate"))
    monkeypatch.setattr(GRPO, "loss", counting(loss, "step"))
    torch._dynamo.reset()
    counters.clear()
    rc = run_cli("train", "configs/examples/quickstart_llm_grpo.yaml", f"run.output_dir={tmp_path / 'run'}",
                 "train.compile=true", "train.max_completion_length=8", "train.steps=4", "save.every=0",
                 "train.kl_coef=0.04")
    torch._dynamo.reset()
    assert rc == 0
    assert traced["generate"] == [0, 0, 0, 0]
    assert traced["step"][0] >= 2 and traced["step"][1:] == [0, 0, 0], traced["step"]


def test_generating_runs_compiled_code_eagerly_and_leaves_cudnn_out():
    calls = []

    @torch.compile(backend="eager")
    def double(x):
        calls.append(torch.compiler.is_compiling())
        return x * 2

    torch._dynamo.reset()
    counters.clear()
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.MATH], set_priority=True):
        with generating():
            assert torch.equal(double(torch.ones(3)), torch.full((3,), 2.0))
            assert not torch.backends.cuda.cudnn_sdp_enabled() and torch.backends.cuda.math_sdp_enabled()
        assert torch.backends.cuda.cudnn_sdp_enabled()  # the run's own choice back on leaving
        assert not torch.backends.cuda.mem_efficient_sdp_enabled()
    assert calls == [False] and counters["frames"]["ok"] == 0
    torch._dynamo.reset()


def test_grpo_with_fused_projections_trains_the_unfused_lora(run_cli, tmp_path):
    """model.fuse_projections=true with grpo: generation and the policy pass through the fused groups, the
    reference (the LoRA disabled) through PEFT's own layers; 4 steps give the unfused run's LoRA (fp32 sums in
    another order: within 1e-3 of the 4 AdamW steps of lr 5e-3, whose updates amplify tiny gradient differences)."""
    lora = {}
    for fused in (False, True):
        out = tmp_path / f"fused-{fused}"
        assert run_cli("train", "configs/examples/quickstart_llm_grpo.yaml", f"run.output_dir={out}",
                       "train.steps=4", "save.every=0", f"model.fuse_projections={str(fused).lower()}") == 0
        lora[fused] = load_file(str(out / "final" / "adapter_model.safetensors"))
    assert lora[True].keys() == lora[False].keys()
    assert all(float(v.abs().max()) > 0 for k, v in lora[False].items() if "lora_B" in k)  # trained from zero
    for key, value in lora[False].items():
        torch.testing.assert_close(lora[True][key], value, rtol=0, atol=4 * 5e-3 * 1e-3)
