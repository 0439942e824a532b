"""The denoiser's blocks: block swap (order of transfers, numbers equal to no swap), selective gradient
checkpointing, static compile shapes, and the SDPA backend choice (recording, measuring in a child process,
choosing)."""

from __future__ import annotations

import pytest
import torch
from helpers import diffusion_train_args, read_metrics
from safetensors.torch import load_file

from toolkit.models.block_swap import SLOTS_PER_KIND, BlockSwap, plan_block_swap, spread
from toolkit.train.blocks import checkpointed_indices, compile_options, prepare_blocks


class Block(torch.nn.Module):
    """A frozen linear with a trainable low-rank update, like a LoRA block."""

    def __init__(self, width: int = 8):
        super().__init__()
        self.base = torch.nn.Linear(width, width)
        self.base.requires_grad_(False)
        self.down = torch.nn.Parameter(torch.randn(2, width) * 0.1)
        self.up = torch.nn.Parameter(torch.randn(width, 2) * 0.1)

    def forward(self, x):
        return torch.tanh(self.base(x) + x @ self.down.T @ self.up.T)


def stack(n: int = 6) -> list[Block]:
    torch.manual_seed(0)
    return [Block() for _ in range(n)]


def run_step(blocks, x):
    for block in blocks:
        x = block(x)
    x.square().sum().backward()
    return [p.grad.clone() for b in blocks for p in (b.down, b.up)]


def test_spread_and_plan():
    assert spread(0, 10) == [] and spread(10, 10) == list(range(10))
    assert spread(3, 9) == [2, 5, 8] and spread(1, 5) == [4]
    blocks = stack(4)  # 8x8 weight + 8 bias in fp32: 288 bytes frozen each
    fits = plan_block_swap("auto", blocks, resident_gb=10.0, budget_gb=20.0, device_backend="cuda", unified=False)
    assert fits.swapped == [] and "fit" in fits.reason
    need = plan_block_swap("auto", blocks, resident_gb=1e-9 * 4 * 288, budget_gb=1e-9 * 2.5 * 288,
                           device_backend="cuda", unified=False)
    assert need.swapped == [1, 3] and "auto -> 2" in need.reason
    assert plan_block_swap("auto", blocks, 99.0, 1.0, "cuda", unified=True).swapped == []
    assert plan_block_swap("auto", blocks, 99.0, 1.0, "cpu", unified=False).swapped == []
    assert plan_block_swap(3, blocks, 0.0, 1.0, "cuda", unified=False).swapped == [1, 2, 3]


# The next step's forward 1 -> 3 -> 5 finds 1 and 3 resident: it releases 1 and fetches 5; backward then as before.
SECOND_STEP = [("release", 1), ("copy", 5), ("release", 5), ("copy", 1)]


def test_block_swap_order_and_gradients_equal_to_no_swap():
    x = torch.randn(3, 8)
    reference = run_step(stack(), x)

    blocks, events = stack(), []
    swap = BlockSwap(blocks, [1, 3, 5], torch.device("cpu"), trace=lambda what, i: events.append((what, i)))
    for index, block in enumerate(blocks):
        assert block.down.device.type == "cpu" and block.down.requires_grad
    plan = prepare_blocks({"t": blocks}, compile_=False, checkpointing=False, swaps={"t": swap}, shape_count=1,
                          log=lambda m: None)
    assert plan.checkpointed == {"t": [1, 3, 5]} and plan.swapped == {"t": [1, 3, 5]}
    grads = run_step(blocks, x)
    assert all(torch.equal(a, b) for a, b in zip(grads, reference))
    # Forward 1 -> 3 -> 5 (each prefetching the next), then the recomputes in backward 5 -> 3 -> 1. Block 3 stays
    # resident at the turn (expected next), and block 3 again at the end (the next forward starts 1 -> 3).
    assert events == [("copy", 1), ("copy", 3), ("release", 1), ("copy", 5), ("release", 5), ("copy", 1)]
    # A swapped block's frozen weight points at its host copy once released, at a slot while resident.
    assert blocks[5].base.weight.data_ptr() == swap.entries[5].params[0][1].data_ptr()
    events.clear()
    for block in blocks:
        block.down.grad = block.up.grad = None
    grads = run_step(blocks, x)
    assert all(torch.equal(a, b) for a, b in zip(grads, reference))
    assert events == SECOND_STEP


def test_selective_checkpointing_indices_and_static_shapes():
    assert checkpointed_indices(True, 4, []) == [0, 1, 2, 3]
    assert checkpointed_indices(False, 4, [2]) == [2]
    assert checkpointed_indices(2, 6, []) == [2, 5]
    assert compile_options(3)[0] == {"dynamic": False}
    assert compile_options(9)[0] == {"dynamic": None}
    assert torch._dynamo.config.recompile_limit >= 5


def test_batch_shapes_count_every_bucket_and_tail():
    from toolkit.data.order import BatchOrder

    order = BatchOrder([0, 0, 0, 1, 1, 2], batch_size=2, seed=0)
    assert order.batch_shapes() == {(0, 2), (0, 1), (1, 2), (2, 1)}
    assert len(order.first_batch()) in (1, 2) and order.position == 0


def test_flux_trains_the_same_lora_with_blocks_swapped_and_checkpointed(tmp_path, run_cli, capsys, own_data_caches):
    """Through the entry point: a run with one block swapped and both checkpointed gives the same LoRA, bit for
    bit, as the plain one (tiny:flux has one double and one single block), samples included."""
    out = {}
    for name, more in (("plain", []), ("changed", ["model.block_swap=1", "train.gradient_checkpointing=2"])):
        run_dir = tmp_path / name
        assert run_cli(*diffusion_train_args("quickstart_flux.yaml", run_dir, "sample.every=2", *more)) == 0
        out[name] = load_file(run_dir / "final" / "pytorch_lora_weights.safetensors")
        assert (run_dir / "samples" / "step-000002" / "grid.png").is_file()
    log = capsys.readouterr().err
    assert "model.block_swap=1: 1 of 2 blocks swapped" in log
    assert "blocks: transformer: 2 blocks, 2 gradient-checkpointed, 1 swapped" in log
    assert "blocks: transformer: 2 blocks, 0 gradient-checkpointed, 0 swapped" in log
    assert out["plain"].keys() == out["changed"].keys()
    assert all(torch.equal(out["plain"][k], out["changed"][k]) for k in out["plain"])


def test_wan22_experts_offloaded_with_blocks_swapped_train_the_same_loras(tmp_path, run_cli, capsys, own_data_caches):
    """Wan 2.2 A14B's two experts, alternating every step, the idle one offloaded and one block of each swapped: the
    same two LoRAs, bit for bit, as with both experts resident and nothing swapped; sampling (both experts, brought
    in on demand) included. The idle expert's swap holds no slot."""
    from toolkit.models.diffusion_wan import Wan22Adapter

    idle_slots = []
    place = Wan22Adapter.place_experts

    def watched(self, resident):
        place(self, resident)
        idle_slots.extend(e.slot for name, swap in self.memory.swaps().items() if name != resident
                          for e in swap.entries.values())

    out = {}
    for name, more in (("plain", ["model.expert_offload=false", "model.block_swap=0"]),
                       ("changed", ["model.expert_offload=true", "model.block_swap=1"])):
        run_dir = tmp_path / name
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(Wan22Adapter, "place_experts", watched)
            assert run_cli(*diffusion_train_args("quickstart_wan22.yaml", run_dir, "train.steps=4",
                                                 "train.expert_switch_every=1", "sample.every=4", *more)) == 0
        out[name] = {f.parent.name: load_file(f) for f in sorted((run_dir / "final").glob("*/*.safetensors"))}
        assert (run_dir / "samples" / "step-000004" / "grid.png").is_file()
    log = capsys.readouterr().err
    assert log.count("model.block_swap=1: 1 of 2 blocks swapped") == 2  # one plan per expert
    assert "blocks: transformer_2: 2 blocks, 1 gradient-checkpointed, 1 swapped" in log
    assert set(out["plain"]) == set(out["changed"]) == {"high_noise", "low_noise"}
    assert idle_slots and all(slot is None for slot in idle_slots)
    for expert in out["plain"]:
        assert all(torch.equal(out["plain"][expert][k], out["changed"][expert][k]) for k in out["plain"][expert])


# -- attention --------------------------------------------------------------------------------------------------
def test_attention_calls_are_recorded_with_counts():
    from toolkit.train.attention import record_attention_calls

    q = torch.randn(1, 2, 16, 8)
    k = torch.randn(1, 2, 24, 8)

    def forward():
        for _ in range(3):
            torch.nn.functional.scaled_dot_product_attention(q, k, k)
        torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)

    calls = record_attention_calls(forward)
    assert [(c.q, c.k, c.causal, c.count) for c in calls] == [((1, 2, 16, 8), (1, 2, 24, 8), False, 3),
                                                             ((1, 2, 16, 8), (1, 2, 16, 8), True, 1)]


def test_attention_choice_takes_the_fastest_that_ran_and_agrees():
    from toolkit.train.attention import choose, priority
    from torch.nn.attention import SDPBackend

    results = {"cudnn": {"error": "crashed the process: illegal memory access", "crashed": True},
               "flash": {"seconds": 0.004, "difference": 0.0},
               "efficient": {"seconds": 0.003, "difference": 0.5}}
    best, why = choose(results)
    assert best == "flash" and "cudnn (crashed the process" in why and "efficient (outputs differ" in why
    results["efficient"]["difference"] = 0.001
    assert choose(results)[0] == "efficient"
    assert choose({"cudnn": {"error": "no kernel"}}) == (None, "no backend ran on the recorded shapes: cudnn (no kernel)")
    assert priority("efficient")[:2] == [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION]


def test_attention_measured_in_a_child_process_on_the_cpu(tmp_path):
    """The real child: on the CPU only the flash kernel runs; cuDNN and memory-efficient have no CPU kernel."""
    from toolkit.train.attention import AttentionCall, measure_in_child, probe

    call = AttentionCall(q=(1, 2, 32, 16), k=(1, 2, 32, 16), v=(1, 2, 32, 16), dtype="float32", mask=None,
                         causal=False, gqa=False, count=2)
    results = measure_in_child([call], torch.device("cpu"), tmp_path)
    assert set(results) == {"cudnn", "flash", "efficient"}
    assert "seconds" in results["flash"] and results["flash"]["seconds"] > 0
    assert "error" in results["cudnn"] and "error" in results["efficient"]
    best, why = probe([call], torch.device("cpu"), tmp_path / "attention.json")
    assert best == "flash" and "measured" in why
    again = probe([call], torch.device("cpu"), tmp_path / "attention.json")
    assert again[0] == "flash" and "measured before" in again[1]


class _RecordingAttention(torch.autograd.Function):
    """An attention stand-in whose output is laid out as cuDNN's is (batch, sequence, heads, dims in memory) and
    whose backward records the layout its gradient arrives in."""

    strides: list[tuple[int, ...]] = []

    @staticmethod
    def forward(ctx, q, k, v):
        weights = torch.softmax(q @ k.transpose(-1, -2), dim=-1)
        ctx.save_for_backward(q, k, v, weights)
        return (weights @ v).transpose(1, 2).contiguous().transpose(1, 2)

    @staticmethod
    def backward(ctx, grad):
        _RecordingAttention.strides.append(grad.stride())
        q, k, v, weights = ctx.saved_tensors
        grad_weights = grad @ v.transpose(-1, -2)
        grad_scores = weights * (grad_weights - (grad_weights * weights).sum(-1, keepdim=True))
        return grad_scores @ k, grad_scores.transpose(-1, -2) @ q, weights.transpose(-1, -2) @ grad


def _single_block_like(q, k, v, mlp):
    """Flux's single block: the attention output concatenated with the MLP's, so its gradient is a slice."""
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    return torch.cat([out.transpose(1, 2).flatten(2), mlp], dim=2)


def test_attention_gradients_reach_cudnn_in_the_output_layout(monkeypatch):
    """Inside gradient_in_output_layout, an attention output's gradient arrives in the output's own layout even
    when the model slices it out of a concatenation; the gradients are the same numbers; leaving restores SDPA."""
    from toolkit.train.attention import gradient_in_output_layout

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", _RecordingAttention.apply)
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 5, 2, 4).transpose(1, 2).requires_grad_() for _ in range(3))
    mlp, weight = torch.randn(1, 5, 16), torch.randn(1, 5, 24)
    grads = {}
    for guarded in (False, True):
        _RecordingAttention.strides.clear()
        for t in (q, k, v):
            t.grad = None
        if guarded:
            with gradient_in_output_layout():
                (_single_block_like(q, k, v, mlp) * weight).sum().backward()
        else:
            (_single_block_like(q, k, v, mlp) * weight).sum().backward()
        grads[guarded] = [t.grad.clone() for t in (q, k, v)]
        strides = list(_RecordingAttention.strides)
        assert (strides == [(40, 4, 8, 1)]) is guarded, strides  # the output's layout; unguarded: the slice's
    assert all(torch.equal(a, b) for a, b in zip(grads[False], grads[True]))
    assert torch.nn.functional.scaled_dot_product_attention == _RecordingAttention.apply


def test_attention_layout_guard_steps_aside_when_compiled_and_allows_in_place_ops(monkeypatch):
    """Compiled code keeps PyTorch's own SDPA: the guard hooks nothing inside a compiled graph (fullgraph holds);
    eager, it hooks each output that needs a gradient, and an in-place op on that output stays legal. The attention
    recorder still sees the calls while the guard's wrapper is installed."""
    import toolkit.train.attention as attention

    hooked = []
    hand = attention._hand_gradient_in_layout
    monkeypatch.setattr(attention, "_hand_gradient_in_layout", lambda out: (hooked.append(out.shape), hand(out)))
    q, k, v = (torch.randn(1, 5, 2, 4).transpose(1, 2).requires_grad_() for _ in range(3))
    mlp = torch.randn(1, 5, 16)
    with attention.gradient_in_output_layout():
        compiled = torch.compile(_single_block_like, backend="aot_eager", fullgraph=True)
        out = compiled(q, k, v, mlp)
        out.square().sum().backward()
        assert hooked == []
        eager = _single_block_like(q, k, v, mlp)
        assert hooked == [(1, 2, 5, 4)] and torch.allclose(out, eager)
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel([SDPBackend.MATH]):  # its backward does not need its output, so in place is legal
            attended = torch.nn.functional.scaled_dot_product_attention(q, k, v)
            attended.mul_(2).sum().backward()  # in place on a hooked output
        with torch.no_grad():
            torch.nn.functional.scaled_dot_product_attention(q, k, v)
        assert len(hooked) == 2  # nothing to hook without gradients
        calls = attention.record_attention_calls(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v))
        assert [c.q for c in calls] == [(1, 2, 5, 4)]
    assert q.grad is not None and q.grad.shape == q.shape


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA or ROCm GPU")
def test_flux_blocks_on_cudnn_attention_train_with_the_layout_guard():
    """A Flux double block then a single block at 1024 px, eager, cuDNN SDPA only, plain and checkpointed, inside
    the guard: both run (without it, cuDNN 9.19 crashed the process on an H100: bench/cudnn_layouts.py)."""
    import subprocess
    import sys

    from conftest import REPO

    done = subprocess.run([sys.executable, str(REPO / "bench" / "cudnn_layouts.py"), "both-guard", "both-ckpt-guard"],
                          capture_output=True, text=True, timeout=300, cwd=REPO)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = [line for line in done.stdout.splitlines() if line.startswith("both")]
    assert len(lines) == 2 and all("rc=0 ['ok']" in line for line in lines), done.stdout


@pytest.mark.parametrize("make, dense", [(lambda: torch.randn(2, 3, 4), True),
                                         (lambda: torch.randn(2, 4, 3).transpose(1, 2), True),
                                         (lambda: torch.randn(2, 3, 8)[..., :4], False),
                                         (lambda: torch.randn(3, 1).expand(3, 4), False)])
def test_dense_layouts(make, dense):
    from toolkit.train.attention import _dense

    assert _dense(make()) is dense


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA or ROCm GPU")
def test_block_swap_on_the_gpu_streams_and_gives_the_same_gradients():
    """On a GPU the copies run on a side stream behind events: the gradients still equal the resident run's, with
    and without compiled blocks, and the swapped blocks' frozen weights take no device memory between uses."""
    x = torch.randn(64, 8, device="cuda")
    resident = [b.cuda() for b in stack()]
    reference = run_step(resident, x)
    for compiled in (False, True):
        blocks = stack()
        swap = BlockSwap(blocks, [0, 2, 3, 5], torch.device("cuda"))
        for index, block in enumerate(blocks):
            if index not in swap.entries:
                block.cuda()
            else:
                block.down.data, block.up.data = block.down.data.cuda(), block.up.data.cuda()
        assert blocks[2].base.weight.is_pinned()
        prepare_blocks({"t": blocks}, compile_=compiled, checkpointing=False, swaps={"t": swap}, shape_count=1,
                       log=lambda m: None)
        for _ in range(2):
            for block in blocks:
                block.down.grad = block.up.grad = None
            grads = run_step(blocks, x)
            torch.cuda.synchronize()
            assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(grads, reference))
        resident = [i for i, entry in swap.entries.items() if entry.slot is not None]
        assert len(resident) <= SLOTS_PER_KIND  # one kind of block here: never more on the device than its slots
        assert all(p.device.type == "cpu" for i in swap.entries if i not in resident
                   for p, _ in swap.entries[i].params)


@pytest.mark.parametrize("config, extra, message", [
    ("quickstart_flux.yaml", ["model.block_swap=1", "model.quantize=8bit"], "not combined with model.quantize=8bit"),
    ("quickstart_flux.yaml", ["model.block_swap=-1"], "must be a number of blocks (0: none) or auto, got -1"),
    ("quickstart_llm.yaml", ["train.gradient_checkpointing=3"], "an LLM checkpoints all its layers or none"),
])
def test_block_settings_that_cannot_run_are_refused_before_loading(run_cli, capsys, config, extra, message):
    from conftest import REPO

    assert run_cli("validate", str(REPO / "configs/examples" / config), *extra) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("setting, changes, refusal", [
    ("auto", {}, None),
    (True, {}, None),
    (False, {}, "train.cuda_graphs=false"),
    ("auto", {"gpu": False}, "no GPU"),
    ("auto", {"blocks": 19}, "compiled block by block"),
    ("auto", {"checkpointed": True}, "gradient-checkpointed"),
    ("auto", {"swapped": True}, "swapped blocks"),
    ("auto", {"grad_accum": 2}, "train.grad_accum > 1"),
    ("auto", {"ddp": True}, "DistributedDataParallel wraps it"),
    ("auto", {"grad_accum": None}, "decided by the batch probe"),
    ("auto", {"hip": True}, "not measured on ROCm yet"),
    (True, {"hip": True}, None),
    ("auto", {"static": False, "compiled": False}, "train.compile is off; more than 8 batch shapes"),
])
def test_cuda_graphs_apply_only_to_a_whole_denoiser_replayed_unchanged(setting, changes, refusal):
    """A graph replays its kernels into the same buffers: only a region compiled whole, with static shapes, neither
    recomputed in backward (checkpointed) nor re-pointed (swapped), one micro-batch a step, on a GPU."""
    from toolkit.train.blocks import graph_refusal

    facts = dict(compiled=True, static=True, blocks=1, checkpointed=False, swapped=False, grad_accum=1, gpu=True)
    found = graph_refusal(setting, **{**facts, **changes})
    assert found == refusal if refusal is None else refusal in found


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA or ROCm GPU")
def test_cuda_graphs_train_the_same_lora_as_ordinary_launches(tmp_path, run_cli, capsys, monkeypatch):
    """The SD quickstart's UNet compiled whole, replayed as a CUDA graph or launched kernel by kernel: the same
    losses step by step and the same LoRA (the graph replays the compiled kernels; only the launching differs).
    fp32 without TF32 (cuDNN's TF32 convolutions are torch's default), so that only a real difference shows. Both
    runs find the tiny model and the caches a first one-step run wrote, so that only the launching differs (a run
    that wrote its tiny model once drew other noise: test_sd_train.py)."""
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    assert run_cli(*diffusion_train_args("quickstart_sd.yaml", tmp_path / "fill", "train.steps=1",
                                         "train.compile=false", "train.precision=fp32")) == 0
    losses, weights = {}, {}
    for graphs in (True, False):
        out = tmp_path / f"graphs-{graphs}"
        args = diffusion_train_args("quickstart_sd.yaml", out, "train.steps=6", "train.compile=true",
                                    "train.precision=fp32", "train.gradient_checkpointing=false",
                                    f"train.cuda_graphs={graphs}")
        assert run_cli(*args) == 0
        log = capsys.readouterr().err
        assert ("compiled, as a CUDA graph" in log) is graphs
        losses[graphs] = [r["loss"] for r in read_metrics(out)]
        weights[graphs] = load_file(str(out / "final" / "pytorch_lora_weights.safetensors"))
    assert len(losses[True]) == 6
    assert losses[True] == pytest.approx(losses[False], rel=1e-5)
    # lr is 1e-2: a replay on stale inputs moves weights by about lr a step; Adam's normalized steps can turn fp32
    # roundings of a near-zero gradient into at most about lr x 1e-2.
    worst = max((weights[True][k].float() - weights[False][k].float()).abs().max().item() for k in weights[False])
    assert worst <= 1e-4, f"LoRA weights differ by up to {worst:.3g}"


@pytest.mark.parametrize("count, splits", [(6, False), (1, True)])
def test_blocks_compiled_one_by_one_skip_ddp_graph_splitting(count, splits):
    """Graphs compiled inside DDP's forward go to dynamo's DDPOptimizer unless optimize_ddp is off: off for
    blocks compiled one by one (measured faster and smaller on 2 H200s), kept for a denoiser compiled whole."""
    import torch._dynamo

    with torch._dynamo.config.patch(optimize_ddp=True, suppress_errors=torch._dynamo.config.suppress_errors):
        prepare_blocks({"t": stack(count)}, compile_=True, checkpointing=False, swaps={}, shape_count=1,
                       log=lambda m: None, ddp=True)
        assert torch._dynamo.config.optimize_ddp is splits
