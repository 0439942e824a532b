"""train.checkpoint_keeps=attention: a checkpointed block keeps its SDPA outputs, so backward recomputes the rest of
the block but not the attention; gradients unchanged, eager and compiled, and through the entry point."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from omegaconf import OmegaConf
import torch.nn.functional as F
from helpers import diffusion_train_args
from safetensors.torch import load_file
from torch.utils._python_dispatch import TorchDispatchMode

from toolkit.plan.decisions import RunPlan
from toolkit.train.blocks import ATTENTION_OPS, prepare_blocks, worth_keeping


class AttentionBlock(torch.nn.Module):
    """A frozen attention + MLP block with trainable low-rank updates on its query and output projections."""

    def __init__(self, width: int = 16, heads: int = 2):
        super().__init__()
        self.heads = heads
        self.qkv = torch.nn.Linear(width, 3 * width).requires_grad_(False)
        self.out = torch.nn.Linear(width, width).requires_grad_(False)
        self.mlp = torch.nn.Linear(width, width).requires_grad_(False)
        self.down = torch.nn.Parameter(torch.randn(2, width) * 0.1)
        self.up = torch.nn.Parameter(torch.randn(3 * width, 2) * 0.1)

    def forward(self, x):
        b, n, w = x.shape
        qkv = (self.qkv(x) + x @ self.down.T @ self.up.T).view(b, n, 3, self.heads, w // self.heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)
        attended = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, n, w)
        x = x + self.out(attended)
        return x + torch.nn.functional.gelu(self.mlp(x))


class AttentionCalls(TorchDispatchMode):
    """Counts the SDPA kernels' forward calls that actually run (a selective checkpoint's cached result does not
    reach a mode outside it)."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls += func.overloadpacket.__name__ in ATTENTION_OPS
        return func(*args, **(kwargs or {}))


def blocks_and_input(n: int = 3, device: str = "cpu"):
    torch.manual_seed(0)
    return [AttentionBlock().to(device) for _ in range(n)], torch.randn(2, 24, 16).to(device)


def step(blocks, x) -> tuple[list[torch.Tensor], int]:
    with AttentionCalls() as calls:
        for block in blocks:
            x = block(x)
        x.square().mean().backward()
    return [p.grad.clone() for b in blocks for p in (b.down, b.up)], calls.calls


def prepared(checkpointing, keeps: str, compile_: bool = False, device: str = "cpu"):
    blocks, x = blocks_and_input(device=device)
    lines = []
    prepare_blocks({"t": blocks}, compile_=compile_, checkpointing=checkpointing, swaps={}, shape_count=1,
                   log=lines.append, keeps=keeps)
    return blocks, x, lines


def test_kept_attention_runs_once_per_block_and_changes_no_gradient():
    reference, calls = step(*prepared(False, "nothing")[:2])
    assert calls == 3  # one forward per block, no recompute
    everything, calls = step(*prepared(True, "nothing")[:2])
    assert calls == 6  # every block's attention again in backward
    blocks, x, lines = prepared(True, "attention")
    kept, calls = step(blocks, x)
    assert calls == 3  # kept, not recomputed
    assert "blocks: t: 3 blocks, 3 gradient-checkpointed (attention kept), 0 swapped" in lines
    assert all(torch.equal(a, b) for a, b in zip(kept, everything))
    assert all(torch.equal(a, b) for a, b in zip(kept, reference))
    some, calls = step(*prepared(1, "attention")[:2])  # one block checkpointed keeps; the others never recompute
    assert calls == 3 and all(torch.equal(a, b) for a, b in zip(some, reference))


def test_only_attention_over_at_least_as_many_keys_as_the_width_is_kept():
    heads = torch.empty(1, 12, 1, 128)  # a width of 1536 (Wan 2.1 1.3B)
    assert worth_keeping(heads, torch.empty(1, 12, 32760, 128))  # self-attention over 81 x 480 x 832
    assert not worth_keeping(heads, torch.empty(1, 12, 512, 128))  # cross-attention to the text
    blocks, x = blocks_and_input()
    prepare_blocks({"t": blocks}, compile_=False, checkpointing=True, swaps={}, shape_count=1, log=print,
                   keeps="attention")
    _, calls = step(blocks, x[:, :12])  # 12 keys, 16 wide: recomputed
    assert calls == 6
    _, calls = step(blocks, x)  # 24 keys: kept
    assert calls == 3


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA or ROCm GPU")])])
def test_compiled_blocks_compile_the_selective_checkpoint_without_a_graph_break(device):
    """The checkpoint goes inside the compiled function so that its policy sees the traced ops: it compiles
    (dynamo counts no graph break), the gradients match the eager ones, and later steps compile nothing again."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    expected, _ = step(*prepared(True, "nothing", device=device)[:2])
    blocks, x, lines = prepared(True, "attention", compile_=True, device=device)
    for block in blocks:
        x = block(x)
    x.square().mean().backward()
    grads = [p.grad.clone() for b in blocks for p in (b.down, b.up)]
    assert "blocks: t: 3 blocks, 3 gradient-checkpointed (attention kept), 0 swapped, compiled" in lines
    assert sum(counters["graph_break"].values()) == 0 and counters["stats"]["unique_graphs"] >= 1
    assert all(torch.allclose(a, b, rtol=1e-4, atol=1e-6) for a, b in zip(grads, expected))
    compiled = counters["stats"]["unique_graphs"]
    for _ in range(2):  # later steps reuse the compiled blocks: nothing is compiled again
        y = x.detach()
        for block in blocks:
            y = block(y)
        y.square().mean().backward()
    assert counters["stats"]["unique_graphs"] == compiled
    torch._dynamo.reset()


def test_through_the_entry_point_the_same_lora_and_the_setting_is_the_denoisers(tmp_path, run_cli, capsys,
                                                                                 own_data_caches):
    out = {}
    for name, keeps in (("nothing", "nothing"), ("attention", "attention")):
        run_dir = tmp_path / name
        assert run_cli(*diffusion_train_args("quickstart_wan21.yaml", run_dir, "train.gradient_checkpointing=true",
                                             f"train.checkpoint_keeps={keeps}")) == 0
        out[name] = load_file(next((run_dir / "final").glob("*.safetensors")))
    log = capsys.readouterr().err
    assert "gradient-checkpointed (attention kept)" in log
    assert out["nothing"].keys() == out["attention"].keys()
    assert all(torch.equal(out["nothing"][k], out["attention"][k]) for k in out["nothing"])
    assert run_cli("validate", "configs/examples/quickstart_llm.yaml", "train.checkpoint_keeps=attention") == 2
    assert "checkpoint_keeps" in capsys.readouterr().err


@pytest.mark.parametrize("keeps", ["auto", "nothing"])
def test_auto_keeps_nothing_where_unmeasured_and_says_so(run_cli, capsys, keeps):
    from toolkit.config.families import FAMILY_SPECS

    assert run_cli("validate", "configs/examples/quickstart_sd.yaml", "train.gradient_checkpointing=true",
                   f"train.checkpoint_keeps={keeps}") == 0
    out = capsys.readouterr()
    said = "keeping attention not measured faster for sd yet" in out.out + out.err
    assert said == (keeps == "auto") and FAMILY_SPECS["sd"].keeps_auto is None


def test_auto_on_flux_keeps_attention_compiled_and_nothing_eager_or_swapped(tmp_path, run_cli, capsys, monkeypatch,
                                                                             own_data_caches):
    """flux was measured faster keeping attention, compiled: auto keeps it there, not with train.compile off, and
    not where blocks are swapped (memory is short; a swapped compiled block recomputes everything anyway)."""
    monkeypatch.setattr(torch, "compile", lambda fn, **options: fn)  # the decisions are the subject, not inductor
    common = ["train.gradient_checkpointing=true", "train.steps=1"]
    assert run_cli("validate", "configs/examples/quickstart_flux.yaml", *common, "train.compile=false") == 0
    assert "keeping attention was measured compiled, and train.compile is off" in capsys.readouterr().out
    for name, more in (("kept", []), ("swapped", ["model.block_swap=1"])):
        assert run_cli(*diffusion_train_args("quickstart_flux.yaml", tmp_path / name, *common, "train.compile=true",
                                             *more)) == 0
        log = capsys.readouterr().err
        assert ("blocks: transformer: 2 blocks, 2 gradient-checkpointed (attention kept)" in log) is (name == "kept")
        assert ("train.checkpoint_keeps=auto -> nothing: blocks are swapped (memory is short)" in log) is (
            name == "swapped")


def test_compile_auto_leaves_a_quantized_denoiser_eager(tmp_path, run_cli, capsys, monkeypatch, own_data_caches):
    """train.compile=auto was measured with 16-bit weights: where the denoiser is quantized, the trainer turns it
    off and says so, and checkpoint_keeps auto follows (nothing, as for eager blocks); fp8 stays compiled.
    compile=auto resolves as on a GPU here (the CPU turns it off before anything loads)."""
    import toolkit.plan.stages  # noqa: F401  (the rules registered)
    from toolkit.plan.decisions import Decision

    def as_on_a_gpu(facts):
        if facts.asked("train.compile") == "auto":
            return Decision("train.compile", True, "measured faster (test)")
        return None

    from toolkit.plan.rules import RULES

    rules = [r if r.key != "train.compile" else type(r)(r.key, r.stage, as_on_a_gpu) for r in RULES["static"]]
    monkeypatch.setitem(RULES, "static", rules)

    monkeypatch.setattr(torch, "compile", lambda fn, **options: fn)  # the decisions are the subject, not inductor
    common = ["train.gradient_checkpointing=true", "train.steps=1", "train.compile=auto"]
    for quantize in ("none", "8bit", "fp8"):  # fp8 stays compiled (its quantization is fused there)
        if quantize == "8bit" and importlib.util.find_spec("bitsandbytes") is None:
            continue
        run_dir = tmp_path / quantize
        assert run_cli(*diffusion_train_args("quickstart_flux.yaml", run_dir, *common,
                                             f"model.quantize={quantize}")) == 0
        log = capsys.readouterr().err
        quantized = quantize == "8bit"
        assert ("train.compile=auto -> false: the denoiser is quantized (8bit)" in log) is quantized
        assert ("gradient-checkpointed (attention kept)" in log) is not quantized
        blocks = next(line for line in log.splitlines() if line.startswith("blocks: transformer:"))
        assert blocks.endswith(", compiled") is not quantized, blocks
        saved = OmegaConf.load(run_dir / "config.yaml")  # as asked; what auto became is in plan.json
        assert saved.train.compile == "auto" and saved.train.checkpoint_keeps == "auto"
        plan = RunPlan.from_json((run_dir / "plan.json").read_text())
        assert plan.value("train.compile") is not quantized
        assert plan.value("train.checkpoint_keeps") == ("nothing" if quantized else "attention")


def test_blocks_of_several_classes_share_the_selective_function_within_a_raised_recompile_limit():
    """Compiled blocks keeping attention all run one function's code (the checkpoint inside torch.compile), so
    dynamo counts every block class's versions against one recompile limit: it is raised to classes x (shapes +
    2). An unresolved 'auto' keeps nothing."""
    import torch._dynamo

    class Other(AttentionBlock):
        pass

    saved = torch._dynamo.config.recompile_limit  # a config module: monkeypatch would delete it on undo
    torch._dynamo.config.recompile_limit = 8
    try:
        blocks = [AttentionBlock(), Other(), AttentionBlock()]
        prepare_blocks({"t": blocks}, compile_=True, checkpointing=True, swaps={}, shape_count=5, log=print,
                       keeps="attention")
        assert torch._dynamo.config.recompile_limit == 2 * (5 + 2)
    finally:
        torch._dynamo.config.recompile_limit = saved
    lines = []
    prepare_blocks({"t": [AttentionBlock()]}, compile_=False, checkpointing=True, swaps={}, shape_count=1,
                   log=lines.append, keeps="auto")
    assert lines == ["blocks: t: 1 blocks, 1 gradient-checkpointed, 0 swapped"]
