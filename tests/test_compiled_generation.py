"""train.generation=compiled (models/compiled_generation.py): the LoRA merged into a copy as PEFT's own merge does,
the same greedy tokens as the eager path, the trained weights untouched, one dynamo compile per padded width, a
GRPO run through the entry point that samples and trains as the eager one; auto stays eager, and the settings it
cannot merge under are refused."""

from __future__ import annotations

import copy
import json
import shutil

import pytest
import torch
import torch._dynamo
from safetensors.torch import load_file
from torch._dynamo.utils import counters

from helpers import adapter_for, read_metrics
from lora_math import randomize_lora_b
from toolkit.models import compiled_generation
from toolkit.models.compiled_generation import CompiledGeneration, padded_width
from toolkit.models.generation import EagerGeneration

pytest.importorskip("trl")

CONFIG = "configs/examples/quickstart_llm_grpo.yaml"


def prompt_batch(adapter, generator, count: int = 3, group: int = 2):
    """`count` training prompts, each `group` times, left-padded to the generator's width: (ids, mask)."""
    prompts = [e.prompt for e in adapter.examples.train.examples[:count]]
    width, pad = generator.width(max(map(len, prompts))), adapter.tokenizer.pad_token_id
    rows = [p for p in prompts for _ in range(group)]
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in rows])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in rows])
    return ids, mask


def greedy(generator, ids, mask, tokenizer, new: int = 12) -> torch.Tensor:
    """The new tokens of a greedy generation (no end token: every row runs `new` tokens)."""
    out = generator(ids, mask, do_sample=False, max_new_tokens=new, pad_token_id=tokenizer.pad_token_id,
                    eos_token_id=None, temperature=None, top_p=None, top_k=None)
    return out[:, ids.shape[1]:]


@pytest.fixture
def trained(tmp_path):
    """The grpo quickstart's adapter with a LoRA that is not the base (lora_B random)."""
    adapter, _ = adapter_for("quickstart_llm_grpo.yaml", tmp_path)
    randomize_lora_b(adapter.network)
    return adapter


def test_merged_copy_equals_peft_merge_and_leaves_the_trained_weights_bit_equal(trained):
    network = trained.network
    before = {k: v.clone() for k, v in network.state_dict().items()}
    generation = CompiledGeneration(network, "cpu")
    ids, mask = prompt_batch(trained, generation)
    greedy(generation, ids, mask, trained.tokenizer)
    after = network.state_dict()
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before)  # the LoRA and the base, bit for bit
    # PEFT's own merge (on a copy) gives the weights the decode reads; fp32 sums in another order: 1e-6
    merged = dict(copy.deepcopy(network).merge_and_unload().named_parameters())
    decoded = dict(generation.decoder.model.named_parameters())
    assert decoded.keys() == merged.keys()
    adapted = [n for n in decoded if any(decoded[n] is m for m, _ in generation.decoder.merged)]
    assert len(adapted) == len(generation.decoder.merged) == 14  # 2 layers x 7 projections of tiny:llm
    for name in decoded:
        torch.testing.assert_close(decoded[name], merged[name], rtol=0, atol=1e-6)
    base = dict(network.get_base_model().named_parameters())
    for name in adapted:  # the merge is not the base: the update is there
        frozen = base[name.replace(".weight", ".base_layer.weight")]
        assert (decoded[name] - frozen).abs().max() > 1e-3
    # every other tensor is the trained model's own, not a copy
    shared = [n for n in decoded if n not in adapted]
    assert shared and all(decoded[n].data_ptr() == base[n].data_ptr() for n in shared)


@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_compiled_greedy_tokens_equal_eager_and_compile_once_per_width(backend, trained, monkeypatch):
    """Greedy decoding: the merged copy with a static cache (the prompts padded to 64) gives the eager path's
    tokens; the decode step compiled (on the CPU, as CUDA does but without CUDA graphs: dynamo's eager backend,
    its guards and graphs alone, and inductor's generated C++, some 15 s to build) compiles at the first call and
    not again at a second of the same width."""
    if backend == "inductor" and shutil.which("g++") is None:
        pytest.skip("inductor on the CPU builds C++: no g++ here")
    monkeypatch.setitem(compiled_generation.DECODE_COMPILE, "cpu", dict(fullgraph=False, dynamic=False,
                                                                         backend=backend, mode=None))
    eager, compiled = EagerGeneration(trained.network), CompiledGeneration(trained.network, "cpu")
    assert compiled.compile_config is not None
    ids, mask = prompt_batch(trained, eager)
    wide_ids, wide_mask = prompt_batch(trained, compiled)
    assert wide_ids.shape[1] == padded_width(ids.shape[1]) == 64 and ids.shape[1] < 64
    expected = greedy(eager, ids, mask, trained.tokenizer)
    with trained.network.disable_adapter():
        base_tokens = greedy(eager, ids, mask, trained.tokenizer)
    assert not torch.equal(expected, base_tokens)  # the LoRA changes the tokens, so matching them means something
    torch._dynamo.reset()
    counters.clear()
    first = greedy(compiled, wide_ids, wide_mask, trained.tokenizer)
    traced = counters["frames"]["ok"]
    second = greedy(compiled, wide_ids, wide_mask, trained.tokenizer)
    recompiled = counters["frames"]["ok"] - traced
    torch._dynamo.reset()
    assert torch.equal(first, expected) and torch.equal(second, expected)
    assert traced >= 1 and recompiled == 0


def test_grpo_with_compiled_generation_trains_as_the_eager_run(run_cli, tmp_path):
    """4 steps of the grpo quickstart with each generation path. Both draw the same random numbers (one
    multinomial per new token over the same batch); the merged weights move the logits by fp32 rounding (~1e-7),
    which changes a sampled token only when a uniform draw falls that close to a boundary of the cumulative
    probabilities: the completions are the same (their rewards and lengths equal), so the scoring passes read
    the same rows and the losses agree to fp32 rounding (1e-6 relative), and the LoRA to 1e-5."""
    runs = {}
    for mode in ("eager", "compiled"):
        out = tmp_path / mode
        assert run_cli("train", CONFIG, f"run.output_dir={out}", "train.steps=4", "save.every=0", "log.every=1",
                       f"train.generation={mode}") == 0
        stats = [json.loads(line) for line in (out / "objective.jsonl").read_text().splitlines()]
        runs[mode] = (stats, [r["loss"] for r in read_metrics(out)],
                      load_file(str(out / "final" / "adapter_model.safetensors")))
    (eager_stats, eager_losses, eager_lora), (stats, losses, lora) = runs["eager"], runs["compiled"]
    assert [r["step"] for r in stats] == [1, 2, 3, 4]
    assert stats == eager_stats  # rewards, their spread and the completion lengths, step by step
    assert len(losses) == 4 and any(loss != 0 for loss in losses)
    assert losses == pytest.approx(eager_losses, rel=1e-6, abs=1e-9)
    assert lora.keys() == eager_lora.keys()
    for key in lora:
        torch.testing.assert_close(lora[key], eager_lora[key], rtol=0, atol=1e-5)
    assert any(v.abs().max() > 1e-4 for k, v in lora.items() if "lora_B" in k)  # it trained


def test_auto_is_eager_on_the_cpu(run_cli, capsys):
    assert run_cli("validate", CONFIG) == 0
    out = capsys.readouterr().out
    line = next(line for line in out.splitlines() if line.startswith("train.generation "))
    assert "= eager" in line and "on the CPU" in line


@pytest.mark.parametrize("preset_name, backend, arch, extra, value, said", [
    ("sm_90", "cuda", "sm_90", {}, "compiled", "20.19 completions/s"),  # measured: evidence grpo-generation-compiled
    ("gfx942", "hip", "gfx942", {}, "eager", "not been measured"),
    ("sm_90", "cuda", "sm_90", {"network": {"type": "dora"}}, "eager", "network.type=dora"),
    ("sm_90", "cuda", "sm_90", {"model": {"quantize": "4bit"}}, "eager", "model.quantize=4bit"),
])
def test_auto_is_compiled_on_nvidia_gpus_where_it_can_merge(preset_name, backend, arch, extra, value, said):
    """The plan of the GRPO quickstart on a stand-in GPU (nothing runs on it): compiled where it was measured faster
    and its merged copy can be made, eager elsewhere, each with its reason."""
    from omegaconf import OmegaConf

    from toolkit.config.layers import Layer
    from toolkit.config.load import merge_layers
    from toolkit.config.presets import load_presets
    from toolkit.device.detect import DeviceInfo
    from toolkit.plan.run import frozen, static_plan

    preset = load_presets()[preset_name]
    user = OmegaConf.to_container(OmegaConf.merge(OmegaConf.load(CONFIG), extra))
    loaded = merge_layers([preset.layer, Layer("grpo.yaml", user)])
    device = DeviceInfo(backend, arch, f"test {arch}", 80.0, bf16=True)
    decisions = {d.key: d for d in static_plan(frozen(loaded.cfg), device, preset, loaded.sources)}
    decision = decisions["train.generation"]
    assert decision.value == value and said in decision.reason
    if value == "compiled":
        assert decision.evidence == "grpo-generation-compiled" and "one more copy" in decision.reason


@pytest.mark.parametrize("override, named", [
    ("network.type=dora", "network.type=dora"),
    ("model.fuse_projections=true", "model.fuse_projections=true"),
])
def test_compiled_refused_where_it_cannot_merge(override, named, run_cli, capsys):
    assert run_cli("validate", CONFIG, "train.generation=compiled", override) == 2
    err = capsys.readouterr().err
    assert f"'train.generation'=compiled cannot apply with {named}" in err and "train.generation=eager" in err
    assert "Traceback" not in err


@pytest.mark.parametrize("params, memory_gb, fraction, value", [
    (1.24e9, 24.0, 1.0, "compiled"),   # Llama-3.2-1B: 2.5 GB and its copy, well inside 24 GB's 14.4 GB budget
    (8.03e9, 80.0, 1.0, "compiled"),   # Llama-3.1-8B on 80 GB: 32.1 GB of a 48 GB budget
    (8.03e9, 24.0, 1.0, "eager"),      # ... on 24 GB: the base alone is 16.1 GB
    (8.03e9, 80.0, 0.5, "eager"),      # ... on half of 80 GB (device.memory_fraction): a 24 GB budget
])
def test_auto_generates_eagerly_where_the_merged_copy_would_not_fit(params, memory_gb, fraction, value):
    """The loaded stage, once the base is counted: compiled generation's merged copy (up to the base's size again)
    must fit the device's weight budget beside the base, else auto falls back to eager and says why."""
    from omegaconf import OmegaConf

    from toolkit.device.detect import DeviceInfo
    from toolkit.plan.decisions import Decision
    from toolkit.plan.rules import Facts
    from toolkit.plan.stages import decide

    cfg = OmegaConf.create({"model": {"family": "llm", "quantize": "none", "dtype": "bf16"}, "network": {"type": "lora"},
                            "train": {"objective": "grpo", "generation": "auto"},
                            "device": {"distributed": "auto", "memory_fraction": fraction}})
    device = DeviceInfo("cuda", "sm_90", "test", memory_gb, True)
    static = Decision("train.generation", "compiled", "measured faster", "static", "grpo-generation-compiled")
    facts = Facts(cfg, device, decided={"train.generation": static},
                  extra={"processes": 1, "base_parameters": lambda: int(params)})
    made = {d.key: d for d in decide("loaded", facts)}
    assert facts.value("train.generation") == value
    if value == "eager":
        assert made["train.generation"].stage == "loaded" and "weight budget" in made["train.generation"].reason
    else:
        assert "train.generation" not in made
    asked = Facts(OmegaConf.merge(cfg, {"train": {"generation": "compiled"}}), device,
                  extra={"processes": 1, "base_parameters": lambda: int(params)})
    decide("loaded", asked)
    assert asked.value("train.generation") == "compiled"  # asked for: kept, whatever the budget


def test_the_budget_counts_fp32_weights_at_their_size_and_an_unreadable_model_is_left_to_loading():
    from omegaconf import OmegaConf

    from toolkit.device.detect import DeviceInfo
    from toolkit.plan.decisions import Decision
    from toolkit.plan.rules import Facts
    from toolkit.plan.stages import decide

    def plan(dtype: str, count):
        cfg = OmegaConf.create({"model": {"family": "llm", "quantize": "none", "dtype": dtype},
                                "network": {"type": "lora"}, "train": {"objective": "grpo", "generation": "auto"},
                                "device": {"distributed": "auto", "memory_fraction": 1.0}})
        static = Decision("train.generation", "compiled", "measured faster", "static", "grpo-generation-compiled")
        facts = Facts(cfg, DeviceInfo("cuda", "sm_90", "test", 48.0, True), decided={"train.generation": static},
                      extra={"processes": 1, "base_parameters": count})
        decide("loaded", facts)
        return facts.value("train.generation"), facts.decided["train.generation"].reason

    assert plan("bf16", lambda: int(6e9))[0] == "compiled"  # 2 x 12 GB of a 28.8 GB budget
    value, reason = plan("fp32", lambda: int(6e9))  # 2 x 24 GB
    assert value == "eager" and "24.0 GB in fp32" in reason

    def unreadable():
        raise OSError("no config.json in /nowhere")
    assert plan("bf16", unreadable)[0] == "compiled"  # load() reports the path with its fix


def test_a_lora_on_the_input_embeddings_is_merged_too(tmp_path):
    """network.target_modules with embed_tokens (an nn.Embedding: PEFT keeps its factors in lora_embedding_A/B):
    the copy's embedding holds W + its delta, as PEFT's own merge gives it, and greedy decoding matches the eager
    path's."""
    adapter, _ = adapter_for("quickstart_llm_grpo.yaml", tmp_path,
                             "network.target_modules=[q_proj,v_proj,embed_tokens]")
    randomize_lora_b(adapter.network)
    for name, p in adapter.network.named_parameters():
        if "lora_embedding_" in name:
            torch.nn.init.normal_(p, std=0.5)  # PEFT starts one factor of an embedding's LoRA at zero
    network = adapter.network
    generation = CompiledGeneration(network, "cpu")
    ids, mask = prompt_batch(adapter, generation)
    tokens = greedy(generation, ids, mask, adapter.tokenizer)
    merged = dict(copy.deepcopy(network).merge_and_unload().named_parameters())
    decoded = dict(generation.decoder.model.named_parameters())
    assert len(generation.decoder.merged) == 5  # 2 layers x 2 projections + the embeddings
    embed = next(n for n in decoded if n.endswith("embed_tokens.weight"))
    base = dict(network.get_base_model().named_parameters())
    assert (decoded[embed] - base[embed.replace(".weight", ".base_layer.weight")]).abs().max() > 1e-2
    for name in decoded:
        torch.testing.assert_close(decoded[name], merged[name], rtol=0, atol=1e-6)
    assert torch.equal(tokens, greedy(EagerGeneration(network), ids, mask, adapter.tokenizer))


@pytest.mark.parametrize("parameters, value", [(10**12, "eager"), (10**6, "compiled")])
def test_the_loaded_stage_choice_reaches_the_generator_the_objective_samples_with(parameters, value, tmp_path,
                                                                                  monkeypatch):
    """load_model as the trainer calls it, with the static stage standing in for a GPU's (auto: compiled; the
    resolved config itself says eager, the CPU's): a base counted far over the budget gets eager, a small one keeps
    compiled, and GRPO samples with the generator the plan settled, not the config's."""
    from contextlib import ExitStack

    from accelerate import Accelerator

    from toolkit.models.llm import LLMMemory
    from toolkit.plan.decisions import Decision, RunPlan
    from toolkit.plan.run import load_run
    from toolkit.train.distributed import Processes
    from toolkit.train.model_setup import load_model

    from conftest import REPO

    run = load_run([REPO / "configs/examples/quickstart_llm_grpo.yaml"], [f"run.output_dir={tmp_path}"])
    assert run.asked_value("train.generation") == "auto"
    gpu = Decision("train.generation", "compiled", "a stand-in for a GPU's static stage", "static")
    plan = RunPlan().with_stage("static", [d for d in run.plan if d.key != "train.generation"] + [gpu])
    assert run.cfg.train.generation == "eager"
    monkeypatch.setattr(LLMMemory, "base_parameters", lambda self: parameters)
    lines: list[str] = []
    with ExitStack() as exits:
        model = load_model(run, plan, Processes(Accelerator(cpu=True)), torch.device("cpu"), tmp_path, None, exits,
                           lines.append)
    assert model.plan.value("train.generation") == value
    chosen = EagerGeneration if value == "eager" else CompiledGeneration
    assert type(model.adapter.objective.generator) is chosen
    said = any(line.startswith("train.generation=auto -> eager: the base (1000.00B parameters") for line in lines)
    assert said is (value == "eager")


def test_a_run_resumes_with_the_other_generation_path(run_cli, tmp_path, capsys):
    """train.generation only changes how completions are sampled (the passes that train are the same code): a run
    saved with one path resumes with the other, as when a run made before auto chose compiled resumes on a GPU."""
    out = tmp_path / "run"
    common = (f"run.output_dir={out}", "save.every=2", "log.every=1")
    assert run_cli("train", CONFIG, *common, "train.steps=2", "train.generation=eager") == 0
    assert run_cli("train", CONFIG, *common, "train.steps=4", "train.generation=compiled") == 0
    said = capsys.readouterr()
    assert "resumed from" in said.out + said.err
    assert [r["step"] for r in read_metrics(out)][-1] == 4
    assert (out / "final" / "adapter_model.safetensors").is_file()


def test_auto_generates_eagerly_in_a_run_too_short_to_repay_the_compile():
    from toolkit.config.layers import Layer
    from toolkit.config.load import merge_layers
    from toolkit.config.presets import load_presets
    from toolkit.device.detect import DeviceInfo
    from toolkit.plan.run import frozen, static_plan
    from toolkit.plan.llm_rules import GENERATION_COMPILED_STEPS

    from omegaconf import OmegaConf

    preset = load_presets()["sm_90"]
    values = {}
    for steps in (GENERATION_COMPILED_STEPS - 1, GENERATION_COMPILED_STEPS):
        user = OmegaConf.to_container(OmegaConf.merge(OmegaConf.load(CONFIG), {"train": {"steps": steps}}))
        loaded = merge_layers([preset.layer, Layer("grpo.yaml", user)])
        plan = static_plan(frozen(loaded.cfg), DeviceInfo("cuda", "sm_90", "test", 80.0, True), preset, loaded.sources)
        values[steps] = next(d for d in plan if d.key == "train.generation")
    short = values[GENERATION_COMPILED_STEPS - 1]
    assert short.value == "eager" and f"train.steps={GENERATION_COMPILED_STEPS - 1} is short" in short.reason
    assert "90.5 s" in short.reason  # the measured bound it rests on
    assert values[GENERATION_COMPILED_STEPS].value == "compiled"


def test_a_layer_whose_delta_cannot_be_merged_is_a_user_error(run_cli, tmp_path, capsys, monkeypatch):
    from peft.tuners.lora import Linear

    real = Linear.get_delta_weight
    monkeypatch.setattr(Linear, "get_delta_weight", lambda self, adapter: real(self, adapter).T)  # not W's layout
    assert run_cli("train", CONFIG, f"run.output_dir={tmp_path / 'run'}", "train.steps=2",
                   "train.generation=compiled") == 2
    err = capsys.readouterr().err
    assert "compiled generation cannot merge the LoRA of a Linear" in err and "fix: train.generation=eager" in err
    assert "Traceback" not in err
