"""LLM runs through the real entry point: chat + packing, eval loss, samples, PEFT reload, merge, QLoRA, HIP rules."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from conftest import REPO
from helpers import cpu_runtime, read_metrics
from toolkit.cli import main
from toolkit.errors import UserError
from toolkit.tiny import resolve_model_path
from toolkit.train.checkpoint import trainable_from_file
from toolkit.models.base import load_trainable_state_dict

PROMPT = "what colour is the star"


def train(monkeypatch, *args) -> int:
    monkeypatch.chdir(REPO)
    return main(["train", *map(str, args)])


@pytest.fixture(scope="module")
def chat_run(tmp_path_factory):
    """4 steps of the chat quickstart (packing, eval split), eval and samples every 2 steps, fp32 export."""
    out = tmp_path_factory.mktemp("chat") / "run"
    with pytest.MonkeyPatch.context() as mp:
        rc = train(mp, "configs/examples/quickstart_llm_chat.yaml", f"run.output_dir={out}", "train.steps=4",
                   "train.eval_every=2", "save.every=0", "sample.every=2", "sample.max_new_tokens=4")
    assert rc == 0
    return out


def test_chat_run_logs_eval_loss_and_writes_samples(chat_run):
    evals = read_metrics(chat_run, "eval_loss")
    assert [r["step"] for r in evals] == [2, 4]
    assert all(0 < r["eval_loss"] < 20 for r in evals)
    for step in ("step-000002", "step-000004"):
        records = [json.loads(l) for l in (chat_run / "samples" / step / "samples.jsonl").read_text().splitlines()]
        assert [r["prompt"] for r in records] == [PROMPT]
        assert f"### {PROMPT}\n" in (chat_run / "samples" / step / "samples.txt").read_text()
    assert {"adapter_config.json", "adapter_model.safetensors"} <= {p.name for p in (chat_run / "final").iterdir()}


def chat_prompt_ids(tokenizer) -> torch.Tensor:
    text = tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}], tokenize=False, add_generation_prompt=True)
    return torch.tensor([tokenizer(text, add_special_tokens=False)["input_ids"]])


def test_chat_prompts_go_through_the_template(chat_run):
    """The adapter renders sample prompts with add_generation_prompt for chat data."""
    from toolkit.plan.run import load_run
    from toolkit.models.llm import LLMAdapter

    run = load_run([chat_run / "config.yaml"], [])
    adapter = LLMAdapter(run.cfg, cpu_runtime(run, chat_run))
    from transformers import AutoTokenizer
    adapter.tokenizer = AutoTokenizer.from_pretrained(adapter.model_path)
    assert adapter.data_format() == "chat"
    assert adapter.prompt_ids(PROMPT) == chat_prompt_ids(adapter.tokenizer)[0].tolist()
    assert adapter.tokenizer.decode(adapter.prompt_ids(PROMPT)).endswith("<|assistant|>\n")


def toolkit_logits(run_dir: Path, input_ids: torch.Tensor, checkpoint: Path | None = None) -> torch.Tensor:
    """Logits of the toolkit's own model with a checkpoint's (default: the last one's) exact LoRA tensors."""
    from safetensors.torch import load_file

    from toolkit.plan.run import load_run
    from toolkit.models import build_adapter

    run = load_run([run_dir / "config.yaml"], [])
    adapter = build_adapter(run.cfg, cpu_runtime(run, run_dir))
    adapter.load()
    last = checkpoint or sorted((run_dir / "checkpoints").iterdir())[-1]
    load_trainable_state_dict(adapter.network, trainable_from_file(load_file(str(last / "trainable_state.safetensors"))))
    adapter.network.eval()
    with torch.no_grad():
        return adapter.network(input_ids=input_ids).logits


def peft_model(adapter_dir: Path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(resolve_model_path("tiny:llm"), dtype=torch.float32)
    return PeftModel.from_pretrained(base, str(adapter_dir)).eval()


def test_final_adapter_reloads_with_peft_to_the_same_logits(chat_run):
    from transformers import AutoTokenizer

    config = json.loads((chat_run / "final" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == resolve_model_path("tiny:llm")
    ids = chat_prompt_ids(AutoTokenizer.from_pretrained(resolve_model_path("tiny:llm")))
    with torch.no_grad():
        reloaded = peft_model(chat_run / "final")(input_ids=ids).logits
    ours = toolkit_logits(chat_run, ids)
    torch.testing.assert_close(reloaded, ours, atol=1e-6, rtol=1e-6)


def test_merge_writes_a_full_model_with_equal_logits(chat_run, tmp_path, monkeypatch, capsys):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    monkeypatch.chdir(REPO)
    assert main(["merge", str(chat_run), str(tmp_path / "merged"), "--dtype", "fp32"]) == 0
    merged_dir = tmp_path / "merged"
    # The line names what was written, and says the cached base model was only read.
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"merge: wrote {merged_dir} (float32): the base model {resolve_model_path('tiny:llm')} with the LoRA of "
        f"{chat_run / 'final'} folded in; the base model's own files are unchanged")
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= {p.name for p in merged_dir.iterdir()}
    merged = AutoModelForCausalLM.from_pretrained(merged_dir).eval()
    assert not any("lora" in name for name, _ in merged.named_parameters())
    tokenizer = AutoTokenizer.from_pretrained(merged_dir)
    ids = chat_prompt_ids(tokenizer)
    with torch.no_grad():
        expected = peft_model(chat_run / "final")(input_ids=ids).logits
        got = merged(input_ids=ids).logits
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    # A non-trivial LoRA: the merged model differs from the base.
    base = AutoModelForCausalLM.from_pretrained(resolve_model_path("tiny:llm")).eval()
    with torch.no_grad():
        assert (base(input_ids=ids).logits - got).abs().max() > 1e-3


def test_a_checkpoint_is_an_adapter_that_peft_loads_and_merge_takes(tmp_path, monkeypatch, capsys):
    """Every checkpoint holds the adapter files final/ holds: PEFT loads step 1's to the logits of step 1's exact
    tensors, and merge takes the checkpoint folder or --step."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "run"
    assert train(monkeypatch, "configs/examples/quickstart_llm.yaml", f"run.output_dir={out}", "train.steps=2",
                 "save.every=1", "sample.prompts=[]", "train.lr=1e-2") == 0
    step1 = out / "checkpoints" / "step-000001"
    ids = chat_prompt_ids(AutoTokenizer.from_pretrained(resolve_model_path("tiny:llm")))
    with torch.no_grad():
        from_files = peft_model(step1)(input_ids=ids).logits
        final = peft_model(out / "final")(input_ids=ids).logits
    ours = toolkit_logits(out, ids, step1)
    torch.testing.assert_close(from_files, ours, atol=1e-6, rtol=1e-6)
    assert (from_files - final).abs().max() > 1e-4  # step 1 is not the final adapter

    assert main(["merge", str(out), str(tmp_path / "m1"), "--step", "1", "--dtype", "fp32"]) == 0
    assert main(["merge", str(step1), str(tmp_path / "m2"), "--dtype", "fp32"]) == 0
    for merged_dir in (tmp_path / "m1", tmp_path / "m2"):
        with torch.no_grad():
            got = AutoModelForCausalLM.from_pretrained(merged_dir).eval()(input_ids=ids).logits
        torch.testing.assert_close(got, from_files, atol=1e-5, rtol=1e-5)
    capsys.readouterr()
    assert main(["merge", str(out), str(tmp_path / "m3"), "--step", "7"]) == 2
    err = capsys.readouterr().err
    assert f"merge --step 7: {out / 'checkpoints' / 'step-000007'} does not exist" in err
    assert "use one of the run's checkpoint steps: 1, 2" in err and "Traceback" not in err


def test_merge_bad_path_and_existing_output_are_user_errors(tmp_path, monkeypatch, capsys, chat_run):
    monkeypatch.chdir(REPO)
    assert main(["merge", str(tmp_path / "missing"), str(tmp_path / "out")]) == 2
    assert f"merge: {tmp_path / 'missing'} does not exist" in capsys.readouterr().err
    assert main(["merge", str(tmp_path), str(tmp_path / "out")]) == 2
    assert "holds no PEFT adapter" in capsys.readouterr().err
    old = tmp_path / "step-000002"  # a checkpoint written before checkpoints held the adapter files
    old.mkdir()
    (old / "lora.safetensors").write_bytes(b"")
    assert main(["merge", str(old), str(tmp_path / "out")]) == 2
    assert "is a checkpoint from before checkpoints held the adapter files" in capsys.readouterr().err
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    assert main(["merge", str(chat_run), str(tmp_path / "full")]) == 2
    assert "exists and is not empty" in capsys.readouterr().err


def test_alpaca_parquet_and_text_txt_train(tmp_path, monkeypatch):
    """Other formats and file types through the CLI: alpaca from parquet (eval_path), raw text from txt."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    records = [json.loads(l) for l in (REPO / "configs/examples/data/quickstart_alpaca.jsonl").read_text().splitlines()]
    pq.write_table(pa.Table.from_pylist(records[:40]), tmp_path / "train.parquet")
    pq.write_table(pa.Table.from_pylist(records[40:]), tmp_path / "eval.parquet")
    out = tmp_path / "alpaca"
    assert train(monkeypatch, "configs/examples/quickstart_llm_alpaca.yaml", f"run.output_dir={out}",
                 f"data.path={tmp_path / 'train.parquet'}", f"data.eval_path={tmp_path / 'eval.parquet'}",
                 "train.steps=4", "train.eval_every=2", "save.every=0", "sample.prompts=[]") == 0
    assert [r["step"] for r in read_metrics(out, "eval_loss")] == [2, 4]
    (tmp_path / "t.txt").write_text("the red circle\n\nthe blue square\nthe green triangle\n")
    out = tmp_path / "text"
    assert train(monkeypatch, "configs/examples/quickstart_llm.yaml", f"run.output_dir={out}",
                 f"data.path={tmp_path / 't.txt'}", "data.packing=true", "train.steps=2", "save.every=0",
                 "sample.prompts=[]", "train.batch_size=2") == 0
    losses = [r["loss"] for r in read_metrics(out)]
    assert len(losses) >= 1 and all(0 < x < 20 for x in losses)


def test_malformed_record_is_a_user_error_naming_file_and_line(tmp_path, monkeypatch, capsys):
    data = tmp_path / "chat.jsonl"
    lines = (REPO / "configs/examples/data/quickstart_chat.jsonl").read_text().splitlines()[:3]
    data.write_text("\n".join(lines + ['{"messages": "hello"}']) + "\n")
    assert train(monkeypatch, "configs/examples/quickstart_llm_chat.yaml", f"run.output_dir={tmp_path / 'r'}",
                 f"data.path={data}") == 2
    assert f"{data}:4: a chat record needs 'messages'" in capsys.readouterr().err


def test_flash_attention_without_flash_attn_is_a_user_error(tmp_path, monkeypatch, capsys):
    import importlib.util
    if importlib.util.find_spec("flash_attn") is not None:
        pytest.skip("flash_attn is installed")
    assert train(monkeypatch, "configs/examples/quickstart_llm.yaml", f"run.output_dir={tmp_path / 'r'}",
                 "model.attention=flash_attention_2") == 2
    assert "model.attention: flash_attention_2 needs the flash_attn package" in capsys.readouterr().err


def test_qlora_4bit_trains_on_cpu(tmp_path, monkeypatch):
    """bitsandbytes 0.50 runs 4-bit layers on the CPU: a QLoRA run through the CLI."""
    pytest.importorskip("bitsandbytes")
    out = tmp_path / "q"
    assert train(monkeypatch, "configs/examples/quickstart_llm.yaml", f"run.output_dir={out}", "model.quantize=4bit",
                 "train.steps=2", "save.every=0", "sample.prompts=[]", "log.every=1") == 0
    losses = [r["loss"] for r in read_metrics(out)]
    assert len(losses) == 2 and all(0 < x < 20 for x in losses)
    assert (out / "final" / "adapter_model.safetensors").is_file()


# -- HIP decisions, with a fake HIP DeviceInfo on the CPU ----------------------------------------

def hip_adapter(tmp_path, name_or_path: str, quantize: str, notes: list | None = None):
    from toolkit.plan.run import load_run
    from toolkit.device.detect import DeviceInfo
    from toolkit.models.base import Runtime
    from toolkit.models.llm import LLMAdapter

    run = load_run([REPO / "configs/examples/quickstart_llm.yaml"],
                   [f"model.name_or_path={name_or_path}", f"model.quantize={quantize}", f"run.output_dir={tmp_path}"])
    info = DeviceInfo(backend="hip", arch="gfx1151", name="fake", memory_gb=96.0, bf16=True)
    log = notes.append if notes is not None else print
    return LLMAdapter(run.cfg, Runtime(torch.device("cpu"), info, torch.float32, torch.float32, tmp_path, log=log))


def test_hip_refuses_a_prequantized_checkpoint(tmp_path):
    import shutil
    fake = tmp_path / "prequantized"
    shutil.copytree(resolve_model_path("tiny:llm"), fake)
    config = json.loads((fake / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "bitsandbytes", "load_in_4bit": True}
    (fake / "config.json").write_text(json.dumps(config))
    with pytest.raises(UserError, match="(?s)prequantized checkpoint \\(bitsandbytes\\); on ROCm .* point model.name_or_path at the 16-bit model"):
        hip_adapter(tmp_path, str(fake), "none").load()


def test_hip_quantizes_after_loading_16bit_weights(tmp_path):
    bnb = pytest.importorskip("bitsandbytes")

    notes = []
    adapter = hip_adapter(tmp_path, "tiny:llm", "4bit", notes)
    adapter.load()
    assert any("quantizing the linear layers after loading" in n for n in notes)
    assert "model: quantized 14 linear layers to 4bit after loading" in notes
    q_proj = adapter.network.base_model.model.model.layers[0].self_attn.q_proj
    assert isinstance(q_proj.base_layer, bnb.nn.Linear4bit)
    ids = torch.tensor([[1, 20, 30, 40]])
    loss = adapter.loss({"input_ids": ids, "labels": ids}, adapter.trainable_modules())
    loss.backward()
    assert torch.isfinite(loss) and q_proj.lora_A["default"].weight.grad is not None


def test_plan_quantization_rules():
    from toolkit.models.llm_loading import plan_quantization

    assert plan_quantization("none", "cuda", None, "m").mode == "none"
    assert not plan_quantization("4bit", "cuda", None, "m").after_load
    assert plan_quantization("8bit", "hip", None, "m").after_load
    assert plan_quantization("none", "cuda", {"quant_method": "gptq"}, "m").mode == "prequantized"
    with pytest.raises(UserError, match="model.quantize: 'm' is already quantized"):
        plan_quantization("4bit", "cuda", {"quant_method": "bitsandbytes"}, "m")


def test_quantize_without_bitsandbytes_names_the_fix(monkeypatch):
    import importlib.util

    from toolkit.models.llm_loading import plan_quantization

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "bitsandbytes" else real(name, *a))
    with pytest.raises(UserError, match=r"model.quantize=4bit needs bitsandbytes.*\n  fix: pip install bitsandbytes"):
        plan_quantization("4bit", "cuda", None, "tiny:llm")


def test_compiled_blocks_train_the_same_losses_as_eager(tmp_path):
    """train.compile=true compiles each decoder layer on its own (inductor's C++ on the CPU) and trains the same
    numbers as the eager run; sampling afterwards runs the blocks eagerly (no recompilation per length)."""
    from conftest import run_toolkit

    common = ["train", REPO / "configs/examples/quickstart_llm.yaml", "train.steps=4", "log.every=1",
              "train.optimizer=adamw", "sample.every=0", "log.tensorboard=false"]
    eager = run_toolkit(*common, f"run.output_dir={tmp_path / 'eager'}", "train.compile=false",
                        "train.cuda_graphs=true", timeout=600)
    compiled = run_toolkit(*common, f"run.output_dir={tmp_path / 'compiled'}", "train.compile=true", timeout=600)
    assert eager.returncode == 0 and compiled.returncode == 0, compiled.stderr
    assert "train.cuda_graphs: applies to a denoiser compiled whole; the decoder blocks keep" in eager.stderr
    assert "train.compile: 2 blocks (LlamaDecoderLayer) compiled one by one" in compiled.stderr
    assert "train.compile: the first step took" in compiled.stderr and "recompile_limit" not in compiled.stderr
    validated = run_toolkit("validate", REPO / "configs/examples/quickstart_llm.yaml").stdout
    assert [line.split() for line in validated.splitlines() if line.startswith("train.compile ")] == [
        ["train.compile", "=", "False", "#", "auto:", "off", "on", "the", "CPU"]]
    losses = [r["loss"] for r in read_metrics(tmp_path / "compiled")]
    assert losses == pytest.approx([r["loss"] for r in read_metrics(tmp_path / "eager")], rel=1e-4)
    assert len(losses) == 4
    from toolkit.plan.compiled_runs import records_file, signature
    from toolkit.plan.run import load_run

    run = load_run([REPO / "configs/examples/quickstart_llm.yaml"], ["train.steps=4"])
    record = json.loads(records_file().read_text())[signature(run.asked, run.device.name)]
    assert record["family"] == "llm" and record["first_step_s"] > 0  # plan/compiled_runs.py: auto may compile it


def test_loss_is_the_sum_of_token_losses_for_builtin_and_remote_code_models(tmp_path):
    """Built-in transformers models sum through num_items_in_batch; remote-code ones (whose forward may drop
    it) get mean x tokens: the same number, and mean_loss is the per-token mean either way."""
    import torch.nn.functional as F

    from helpers import adapter_for
    from toolkit.models.token_loss import label_tokens

    adapter, dataset = adapter_for("quickstart_llm.yaml", tmp_path)
    assert adapter.sums_loss  # LlamaForCausalLM ships with transformers
    batch = dataset.collate([0, 1, 2])
    with torch.no_grad():
        summed = adapter.loss(batch, adapter.trainable_modules())
        adapter.sums_loss = False
        fallback = adapter.loss(batch, adapter.trainable_modules())
        logits = adapter.network(input_ids=batch["input_ids"], attention_mask=batch.get("attention_mask")).logits
    expected = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), batch["labels"][:, 1:].flatten(),
                               ignore_index=-100, reduction="sum")
    assert label_tokens(batch["labels"]) > 0
    assert torch.allclose(summed, expected, rtol=1e-5) and torch.allclose(fallback, expected, rtol=1e-5)


def test_a_right_padded_batch_trains_the_same_without_its_padding_mask(tmp_path, monkeypatch):
    """A causal decoder's real tokens never attend to the padding after them: the loss and every LoRA gradient are
    the same with the mask as without it (which lets attention take its is_causal path with no host read), and
    transformers' search for packed samples (a host read of a device tensor) is skipped for such a batch."""
    from transformers import masking_utils

    from helpers import adapter_for

    searches = []
    search = masking_utils.find_packed_sequence_indices
    watched = lambda position_ids: searches.append(position_ids.shape) or search(position_ids)  # noqa: E731
    monkeypatch.setattr(masking_utils, "find_packed_sequence_indices", watched)

    adapter, dataset = adapter_for("quickstart_llm.yaml", tmp_path)
    assert adapter.drops_padding_mask  # tiny:llm is a LlamaForCausalLM
    lengths = [len(s.input_ids) for s in dataset.samples]
    indices = [lengths.index(min(lengths)), lengths.index(max(lengths))]
    batch = dataset.collate(indices)
    assert min(lengths) < max(lengths) and "attention_mask" in batch  # padded
    results = {}
    for drops in (True, False):
        adapter.drops_padding_mask = drops
        modules = adapter.trainable_modules()
        params = [p for p in adapter.network.parameters() if p.requires_grad]
        for p in params:
            p.grad = None
        loss = adapter.loss(batch, modules)
        loss.backward()
        results[drops] = (loss.detach(), [p.grad.clone() for p in params])
    assert torch.allclose(results[True][0], results[False][0], rtol=1e-6)
    assert all(torch.allclose(a, b, rtol=1e-5, atol=1e-7) for a, b in zip(results[True][1], results[False][1]))
    assert searches == [] and masking_utils.find_packed_sequence_indices is watched  # skipped, then put back
    with torch.no_grad():  # the same forward outside the adapter's loss searches once
        adapter._loss({k: v for k, v in batch.items() if k != "attention_mask"}, adapter.trainable_modules())
    assert len(searches) == 1
