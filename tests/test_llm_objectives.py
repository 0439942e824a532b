"""train.objective beyond sft (dpo, orpo, kto, grpo): the losses against TRL's trainers, the chunked log-probs
against full logits, and each quickstart through the entry point moving its margin or reward the right way
(measured with PEFT's loader on the saved adapter); resume bit-identical; the user errors."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from conftest import REPO
from helpers import adapter_for, read_metrics
from toolkit.kernels.linear_cross_entropy import HeadMath
from toolkit.kernels.linear_logprobs import linear_logprobs

pytest.importorskip("trl")

DATA = REPO / "configs/examples/data"


def records(name: str) -> list[dict]:
    return [json.loads(line) for line in (DATA / name).read_text().splitlines() if line.strip()]


def randomize_lora_b(network: torch.nn.Module, seed: int = 1) -> None:
    """A LoRA that is not the base (B is zero at init), so that the policy and the reference differ."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in network.named_parameters():
            if "lora_B" in name and ".default" in name:
                p.copy_(torch.randn(p.shape, generator=generator) * 0.05)


# -- the chunked log-probs -------------------------------------------------------------------------------------

@pytest.mark.parametrize("math_", [HeadMath(), HeadMath(softcap=3.0), HeadMath(scale=0.5)])
def test_chunked_logprobs_and_their_gradient_equal_full_logits(math_):
    """Values and per-token weighted gradients equal log_softmax over the whole logits (TRL's selective_log_softmax),
    in chunks smaller than the rows."""
    from trl.trainer.utils import selective_log_softmax

    torch.manual_seed(0)
    hidden = torch.randn(37, 16, dtype=torch.float64, requires_grad=True)
    weight, targets = torch.randn(50, 16, dtype=torch.float64), torch.randint(0, 50, (37,))
    weights = torch.randn(37, dtype=torch.float64)
    ours = linear_logprobs(hidden, weight, targets, math_=math_, chunk=8)
    (grad_ours,) = torch.autograd.grad((ours * weights).sum(), hidden)
    logits = (hidden @ weight.t()) * math_.scale
    if math_.softcap is not None:
        logits = math_.softcap * torch.tanh(logits / math_.softcap)
    theirs = selective_log_softmax(logits, targets)
    (grad_theirs,) = torch.autograd.grad((theirs * weights).sum(), hidden)
    torch.testing.assert_close(ours, theirs)
    torch.testing.assert_close(grad_ours, grad_theirs)


# -- the losses against TRL's trainers ------------------------------------------------------------------------

@pytest.fixture
def trl_trainer_state():
    """TRL's trainers set accelerate's process-wide state (and its environment variables): both are undone after
    the test, so that a run later in this process starts as it would alone."""
    import os

    from accelerate.state import AcceleratorState

    environment = dict(os.environ)
    yield
    AcceleratorState._reset_state(reset_partial_state=True)
    os.environ.clear()
    os.environ.update(environment)


@pytest.mark.parametrize("data", ["quickstart_preference.jsonl", "quickstart_preference_chat.jsonl"])
def test_dpo_loss_and_tokens_equal_trl_dpo_trainer(data, tmp_path, trl_trainer_state):
    """The same pairs (plain, or conversational through the chat template), the same LoRA: TRL's DPOTrainer (its
    tokenization, its reference: the adapter disabled) and the toolkit give the same rows and the same mean loss."""
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer

    adapter, dataset = adapter_for("quickstart_llm_dpo.yaml", tmp_path, "train.reference_logps=live",
                                   f"data.path=configs/examples/data/{data}")
    pairs = records(data)
    args = DPOConfig(output_dir=str(tmp_path / "trl"), per_device_train_batch_size=len(pairs), beta=0.1,
                     report_to=[], use_cpu=True, max_length=None, train_sampling_strategy="sequential")
    trainer = DPOTrainer(model=adapter.network, args=args, train_dataset=Dataset.from_list(pairs),
                         processing_class=adapter.tokenizer)
    trl_batch = next(iter(trainer.get_train_dataloader()))
    randomize_lora_b(adapter.network)  # after TRL's trainer is built: its reference stays the base
    batch = dataset.collate(range(len(pairs)))
    for row in range(2 * len(pairs)):
        n = int(trl_batch["attention_mask"][row].sum())
        assert batch["input_ids"][row, :n].tolist() == trl_batch["input_ids"][row, :n].tolist()
        completion = batch["labels"][row, :n] != -100
        assert completion.tolist() == trl_batch["completion_mask"][row, :n].bool().tolist()
    ours = adapter.loss(batch, adapter.trainable_modules()) / adapter.batch_units(batch)[0]
    theirs = trainer.compute_loss(adapter.network, trl_batch)
    assert float(ours) == pytest.approx(float(theirs), abs=1e-6)
    assert abs(float(ours) - 0.693147) > 1e-4  # the LoRA made a margin: not the loss at zero margin


def test_kto_loss_equals_trl_kto_trainer(tmp_path, trl_trainer_state):
    """KTO with its KL reference point from the batch's rotated completions, as TRL's KTOTrainer computes it."""
    from datasets import Dataset
    from trl import KTOConfig, KTOTrainer

    adapter, dataset = adapter_for("quickstart_llm_kto.yaml", tmp_path)
    examples = records("quickstart_kto.jsonl")
    args = KTOConfig(output_dir=str(tmp_path / "trl"), per_device_train_batch_size=len(examples), beta=0.1,
                     report_to=[], use_cpu=True, max_length=None, desirable_weight=1.0, undesirable_weight=1.0,
                     train_sampling_strategy="sequential")
    trainer = KTOTrainer(model=adapter.network, args=args, train_dataset=Dataset.from_list(examples),
                         processing_class=adapter.tokenizer)
    trl_batch = next(iter(trainer.get_train_dataloader()))
    randomize_lora_b(adapter.network)
    batch = dataset.collate(range(len(examples)))
    ours = adapter.loss(batch, adapter.trainable_modules()) / adapter.batch_units(batch)[0]
    theirs = trainer.compute_loss(adapter.network, trl_batch)
    assert float(ours) == pytest.approx(float(theirs), abs=1e-6)
    assert abs(float(ours) - 0.5) > 1e-4


def test_orpo_loss_equals_trl_orpo_formulas(tmp_path):
    """ORPO per pair: TRL's get_batch_logps (mean over tokens) and odds_ratio_loss, plus the chosen NLL, on the
    model's full logits; the toolkit's loss on the same pair through its chunked log-probs."""
    from trl.experimental.orpo import ORPOTrainer

    adapter, dataset = adapter_for("quickstart_llm_orpo.yaml", tmp_path, "train.beta=0.5")
    randomize_lora_b(adapter.network)
    trl_self = SimpleNamespace(beta=0.5, accelerator=SimpleNamespace(device=torch.device("cpu")))
    for index in range(len(dataset)):
        batch = dataset.collate([index])
        ours = adapter.loss(batch, adapter.trainable_modules())
        with torch.no_grad():
            logits = adapter.network(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        means = ORPOTrainer.get_batch_logps(logits, batch["labels"], average_log_prob=True)
        losses = ORPOTrainer.odds_ratio_loss(trl_self, means[:1], means[1:])[0]
        nll = torch.nn.functional.cross_entropy(logits[0, :-1], batch["labels"][0, 1:], ignore_index=-100)
        assert float(ours) == pytest.approx(float(nll - losses.mean()), abs=1e-5)


def test_grpo_loss_and_gradient_equal_trl_grpo_trainer(tmp_path, trl_trainer_state):
    """One group of completions the toolkit sampled (with the KV cache), its rewards and group advantages: TRL's
    GRPOTrainer loss (loss_type='grpo', beta as train.kl_coef, its reference: the adapter disabled) and the
    toolkit's, and their LoRA gradients, agree."""
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from grpo_rewards import low_token_share

    torch.manual_seed(0)  # PEFT draws lora_A from the global generator: the same adapter every run
    adapter, dataset = adapter_for("quickstart_llm_grpo.yaml", tmp_path, "train.reward=[grpo_rewards:low_token_share]",
                                   "train.kl_coef=0.04", "train.num_generations=4", "train.max_completion_length=6")
    args = GRPOConfig(output_dir=str(tmp_path / "trl"), per_device_train_batch_size=4, num_generations=4, beta=0.04,
                      loss_type="grpo", max_completion_length=6, use_cpu=True, bf16=False, report_to=[])
    trainer = GRPOTrainer(model=adapter.network, reward_funcs=low_token_share, args=args,
                          train_dataset=Dataset.from_list(records("quickstart_grpo.jsonl")),
                          processing_class=adapter.tokenizer)
    trainer.current_gradient_accumulation_steps = 1  # set by its training loop
    randomize_lora_b(adapter.network)
    batch = dataset.collate([0])
    torch.manual_seed(3)
    completions = adapter.objective.generate(batch["prompts"])
    assert len(completions) == 4 and all(1 <= len(c) <= 6 for c in completions)
    adapter.objective.generate = lambda prompts: completions
    params = [p for p in adapter.network.parameters() if p.requires_grad]

    ours = adapter.loss(batch, adapter.trainable_modules()) / adapter.batch_units(batch)[0]
    ours_grads = torch.autograd.grad(ours, params)

    rewards = torch.tensor(low_token_share(None, None, completions))
    advantages = (rewards - rewards.mean()) / (rewards.std() + 1e-4)   # TRL's scale_rewards='group'
    width, pad = max(map(len, completions)), adapter.tokenizer.pad_token_id
    prompt = torch.tensor([batch["prompts"][0]] * 4)
    completion_ids = torch.tensor([c + [pad] * (width - len(c)) for c in completions])
    completion_mask = torch.tensor([[1] * len(c) + [0] * (width - len(c)) for c in completions])
    mask = torch.cat([torch.ones_like(prompt), completion_mask], 1)
    inputs = {"prompt_ids": prompt, "prompt_mask": torch.ones_like(prompt), "completion_ids": completion_ids,
              "completion_mask": completion_mask, "advantages": advantages}
    with torch.no_grad(), adapter.network.disable_adapter():
        inputs["ref_per_token_logps"] = trainer._get_per_token_logps_and_entropies(
            adapter.network, torch.cat([prompt, completion_ids], 1), mask, width)[0]
    adapter.network.train()
    theirs = trainer._compute_loss(adapter.network, inputs)
    theirs_grads = torch.autograd.grad(theirs, params)
    assert float(ours) == pytest.approx(float(theirs), abs=1e-7)
    assert float(ours) > 0  # the KL term: the LoRA is not the base
    scale = max(float(g.abs().max()) for g in theirs_grads)
    assert scale > 0
    for mine, trl_grad in zip(ours_grads, theirs_grads):  # fp32 sums in another order: within 1e-3 of the largest
        torch.testing.assert_close(mine, trl_grad, rtol=1e-3, atol=1e-3 * scale)


# -- the quickstarts through the entry point ------------------------------------------------------------------

def sequence_logps(model, batch) -> torch.Tensor:
    """Each row's log-prob of its labelled tokens, from the model's whole logits (not the toolkit's scorer)."""
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1]
    labels = batch["labels"][:, 1:]
    picked = torch.log_softmax(logits.float(), -1).gather(2, labels.clamp(min=0).unsqueeze(2)).squeeze(2)
    return (picked * (labels != -100)).sum(1)


def peft_and_base(final: Path):
    """The saved adapter on its base, loaded by PEFT; the base alone is the adapter disabled."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    config = json.loads((final / "adapter_config.json").read_text())
    base = AutoModelForCausalLM.from_pretrained(config["base_model_name_or_path"])
    return PeftModel.from_pretrained(base, str(final)).eval()


def pair_margins(final: Path, dataset) -> torch.Tensor:
    """(chosen - rejected) log-ratio against the base, per pair, under the saved adapter."""
    model = peft_and_base(final)
    batch = dataset.collate(range(len(dataset)))
    policy = sequence_logps(model, batch)
    with model.disable_adapter():
        reference = sequence_logps(model, batch)
    chosen, rejected = (policy - reference).split(len(dataset))
    return chosen - rejected


@pytest.mark.parametrize("objective", ["dpo", "orpo"])
def test_preference_quickstart_raises_every_pairs_margin(objective, run_cli, tmp_path):
    """Through `train`: after 10 steps each pair's chosen completion gained on its rejected one against the base
    (the margin starts at 0: LoRA B is zero), and the run's objective.jsonl records the rising margin."""
    out = tmp_path / "run"
    rc = run_cli("train", f"configs/examples/quickstart_llm_{objective}.yaml", f"run.output_dir={out}",
                 "train.steps=10", "save.every=0", "train.beta=1.0" if objective == "orpo" else "train.beta=0.1")
    assert rc == 0
    _, dataset = adapter_for(f"quickstart_llm_{objective}.yaml", tmp_path / "data")
    margins = pair_margins(out / "final", dataset)
    assert (margins > 0).all(), margins
    logged = [json.loads(line) for line in (out / "objective.jsonl").read_text().splitlines()]
    assert [r["step"] for r in logged] == list(range(1, 11))
    if objective == "dpo":
        assert logged[0]["margin"] == 0.0 and logged[0]["loss"] == pytest.approx(0.693147)
        assert logged[-1]["margin"] > 0.1 and logged[-1]["accuracy"] == 1.0


def test_kto_quickstart_raises_desirable_and_lowers_undesirable(run_cli, tmp_path):
    out = tmp_path / "run"
    assert run_cli("train", "configs/examples/quickstart_llm_kto.yaml", f"run.output_dir={out}", "train.steps=10",
                   "save.every=0") == 0
    _, dataset = adapter_for("quickstart_llm_kto.yaml", tmp_path / "data")
    model = peft_and_base(out / "final")
    batch = dataset.collate(range(len(dataset)))
    policy = sequence_logps(model, batch)
    with model.disable_adapter():
        ratio = policy - sequence_logps(model, batch)
    desirable = batch["desirable"]
    assert ratio[desirable].mean() - ratio[~desirable].mean() > 0.5, ratio


def expected_low_share(final: Path | None, adapter, prompts) -> float:
    """The exact expected reward of one-token completions under grpo_rewards.low_token_share: the probability
    mass on ids below 150 at each prompt's next token, averaged; the base's when `final` is None."""
    from transformers import AutoModelForCausalLM

    model = (peft_and_base(final) if final is not None
             else AutoModelForCausalLM.from_pretrained(adapter.model_path).eval())
    with torch.no_grad():
        mass = [float(model(input_ids=torch.tensor([p])).logits[0, -1].softmax(-1)[:150].sum()) for p in prompts]
    return sum(mass) / len(mass)


@pytest.mark.parametrize("sign", [1, -1])
def test_grpo_moves_the_expected_reward_the_way_the_reward_points(sign, run_cli, tmp_path):
    """GRPO through `train` with a module:function reward (TRL's signature) on one-token completions, whose
    expected reward is exact: it rises for the reward and falls for its negation (the KL term on)."""
    out = tmp_path / "run"
    reward = "grpo_rewards:low_token_share" if sign > 0 else "grpo_rewards:high_token_share"
    rc = run_cli("train", "configs/examples/quickstart_llm_grpo.yaml", f"run.output_dir={out}",
                 f"train.reward=[{reward}]",
                 "train.max_completion_length=1", "train.num_generations=8", "train.batch_size=4", "train.steps=8",
                 "train.lr=0.05", "train.kl_coef=0.04", "save.every=0")
    assert rc == 0
    adapter, dataset = adapter_for("quickstart_llm_grpo.yaml", tmp_path / "data")
    prompts = [example.prompt for example in dataset.examples]
    before, after = expected_low_share(None, adapter, prompts), expected_low_share(out / "final", adapter, prompts)
    assert sign * (after - before) > 0.005, (before, after)
    logged = [json.loads(line) for line in (out / "objective.jsonl").read_text().splitlines()]
    assert [r["step"] for r in logged] == list(range(1, 9)) and all(r["completion_tokens"] == 1 for r in logged)


# -- resume ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("objective, extra", [
    ("dpo", ["train.reference_logps=precompute", "data.eval_fraction=0.25", "train.eval_every=2"]),
    ("grpo", ["train.max_completion_length=4", "train.num_generations=2", "train.kl_coef=0.04"]),
    ("grpo", ["train.max_completion_length=4", "train.num_generations=2", "train.generation=compiled"]),
])
def test_resume_is_bit_identical(objective, extra, run_cli, tmp_path, capsys):
    """4 steps at once, and 2 then 2 more in the same folder (dpo reads its precomputed reference back; grpo's
    sampled completions follow the restored RNG): the same LoRA, bit for bit."""
    config = f"configs/examples/quickstart_llm_{objective}.yaml"
    whole, halves = tmp_path / "whole", tmp_path / "halves"
    common = ["save.every=2", "train.batch_size=2", *extra]
    assert run_cli("train", config, f"run.output_dir={whole}", "train.steps=4", *common) == 0
    assert run_cli("train", config, f"run.output_dir={halves}", "train.steps=2", *common) == 0
    capsys.readouterr()
    assert run_cli("train", config, f"run.output_dir={halves}", "train.steps=4", *common) == 0
    if objective == "dpo":
        assert "reference log-probs read from" in capsys.readouterr().err
    ours = load_file(str(halves / "checkpoints" / "step-000004" / "trainable_state.safetensors"))
    reference = load_file(str(whole / "checkpoints" / "step-000004" / "trainable_state.safetensors"))
    assert ours.keys() == reference.keys()
    assert all(torch.equal(ours[k], reference[k]) for k in ours)
    assert not all(torch.equal(ours[k], torch.zeros_like(ours[k])) for k in ours if "lora_B" in k)
    evals = read_metrics(whole, "eval_loss")
    if objective == "dpo":  # the mean DPO loss of the held-out pairs: log 2 at zero margin, then it moves
        assert [r["step"] for r in evals] == [2, 4] and all(0 < r["eval_loss"] < 2 for r in evals)
        assert evals[0]["eval_loss"] != pytest.approx(0.693147, abs=1e-7)


# -- user errors ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("overrides, message", [
    (["data.format=chat"], "'data.format' is chat, which train.objective=dpo cannot train on"),
    (["data.packing=true"], "set data.packing=false"),
    (["data.path=configs/examples/data/quickstart_kto.jsonl"], "a preference record needs the fields"),
])
def test_dpo_config_and_data_errors_exit_2_naming_the_key(overrides, message, run_cli, tmp_path, capsys):
    rc = run_cli("train", "configs/examples/quickstart_llm_dpo.yaml", f"run.output_dir={tmp_path / 'run'}",
                 *overrides)
    err = capsys.readouterr().err
    assert rc == 2 and message in err and "Traceback" not in err


def test_validate_names_data_without_the_objectives_fields(run_cli, capsys):
    data = REPO / "configs/examples/data/quickstart_preference.jsonl"
    assert run_cli("validate", "configs/examples/quickstart_llm_kto.yaml", f"data.path={data}") == 2
    err = capsys.readouterr().err
    assert (f"'data.path' in command line: train.objective=kto trains on unpaired records, and the first of {data} "
            "is not one: an unpaired record needs the fields ['prompt', 'completion', 'label'], missing ['completion', "
            "'label'] (found ['chosen', 'prompt', 'rejected']): use TRL's field names, or the objective that matches "
            "the data (train.objective)") in err and "Traceback" not in err


def test_grpo_refuses_held_out_data(run_cli, tmp_path, capsys):
    rc = run_cli("validate", "configs/examples/quickstart_llm_grpo.yaml", "data.eval_fraction=0.2")
    assert rc == 2 and "which train.objective=grpo has none of" in capsys.readouterr().err


@pytest.mark.parametrize("reward, message", [
    ("nope", "'train.reward': unknown reward 'nope': use one of format, regex, length, or module:function"),
    ("regex", "'train.reward': the regex reward needs train.reward_pattern: set it to"),
    ("no_such_module:f", "'train.reward': cannot import 'no_such_module:f': there is no module 'no_such_module'"),
])
def test_grpo_reward_errors_exit_2(reward, message, run_cli, tmp_path, capsys):
    rc = run_cli("train", "configs/examples/quickstart_llm_grpo.yaml", f"run.output_dir={tmp_path / 'run'}",
                 f"train.reward=[{reward}]")
    err = capsys.readouterr().err
    assert rc == 2 and message in err and "Traceback" not in err


def test_builtin_rewards():
    from toolkit.models.rewards import reward_functions

    (_, fmt), = reward_functions(["format"], None, 4)
    (_, regex), (_, length) = reward_functions(["regex", "length"], "colour", 4)
    completions = ["<think>a</think> <answer>b</answer>", "my colour", [{"role": "assistant", "content": "abcd"}]]
    assert fmt(completions=completions) == [1.0, 0.0, 0.0]
    assert regex(completions=completions) == [0.0, 1.0, 0.0]
    assert length(completions=completions) == [1.0 - 31 / 4, 1.0 - 5 / 4, 1.0]
