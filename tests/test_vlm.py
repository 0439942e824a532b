"""The vlm family through the real entry point on tiny Qwen2.5-VL and Qwen3-VL: image chats encoded as the model
reads them, the quickstart's loss going down, the adapter loaded by PEFT over AutoModelForImageTextToText to the
same logits, the vision tower's LoRA, a bit-identical resume, and data mistakes as one message."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import REPO
from helpers import cpu_runtime, read_metrics
from toolkit.data.samples import IGNORE_INDEX
from toolkit.models.base import load_trainable_state_dict
from toolkit.tiny import resolve_model_path
from toolkit.train.checkpoint import trainable_from_file

QUICKSTART = "configs/examples/quickstart_vlm.yaml"
SHORT = ["train.steps=6", "save.every=3", "sample.prompts=[]", "train.eval_every=0", "log.every=1",
         "train.lr=2e-2", "train.lr_scheduler=constant", "train.warmup_steps=0"]
IMAGE = REPO / "configs/examples/data/shapes/red_circle_64x64.png"


def train(run_cli, out: Path, *overrides: str) -> int:
    return run_cli("train", QUICKSTART, f"run.output_dir={out}", *SHORT, *overrides)


def toolkit_model(run_dir: Path):
    """The toolkit's own model with the last checkpoint's exact trainable tensors, and its adapter."""
    from toolkit.models import build_adapter
    from toolkit.plan.run import load_run

    run = load_run([run_dir / "config.yaml"], [])
    adapter = build_adapter(run.cfg, cpu_runtime(run, run_dir))
    adapter.load()
    last = sorted((run_dir / "checkpoints").iterdir())[-1]
    load_trainable_state_dict(adapter.network, trainable_from_file(load_file(str(last / "trainable_state.safetensors"))))
    return adapter


@pytest.mark.parametrize("kind, vision", [("qwen25_vl", False), ("qwen3_vl", True)])
def test_adapter_loads_with_peft_over_auto_image_text_to_text_to_the_same_logits(run_cli, tmp_path, tiny_cache,
                                                                               kind, vision):
    from peft import PeftModel
    from transformers import AutoModelForImageTextToText

    out = tmp_path / "run"
    assert train(run_cli, out, f"model.name_or_path=tiny:{kind}", f"network.vision_layers={vision}",
                 "save.dtype=fp32") == 0
    config = json.loads((out / "final" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == resolve_model_path(f"tiny:{kind}")
    keys = load_file(str(out / "final" / "adapter_model.safetensors"))
    language = [k for k in keys if ".language_model.layers." in k]
    tower = [k for k in keys if ".visual." in k]
    assert len(language) == 2 * 7 * 2           # 2 layers x q k v o gate up down x (A, B)
    assert (len(tower) > 0) == vision            # blocks and merger only with network.vision_layers
    assert len(keys) == len(language) + len(tower)

    adapter = toolkit_model(out)
    inputs = adapter.model_inputs(adapter.encoder.prompt("describe the image", IMAGE))
    assert int((inputs["input_ids"] == adapter.network.config.image_token_id).sum()) == \
        int(inputs["image_grid_thw"].prod()) // 4   # one token per merged 2x2 patch
    base = AutoModelForImageTextToText.from_pretrained(resolve_model_path(f"tiny:{kind}"), dtype=torch.float32)
    peft = PeftModel.from_pretrained(base, str(out / "final")).eval()
    adapter.network.eval()
    with torch.no_grad():
        theirs = peft(**inputs).logits
        ours = adapter.network(**inputs).logits
        with peft.disable_adapter():
            plain = peft(**inputs).logits
    torch.testing.assert_close(theirs, ours, atol=1e-5, rtol=1e-5)
    assert (theirs - plain).abs().max() > 1e-3     # the LoRA changes the answer
    # load_lora (sample, network.init_from): a fresh adapter given the final/ folder answers as the trained one
    from toolkit.models import build_adapter
    from toolkit.plan.run import load_run

    run = load_run([out / "config.yaml"], [])
    fresh = build_adapter(run.cfg, cpu_runtime(run, out))
    fresh.load()
    fresh.load_lora(out)
    fresh.network.eval()
    with torch.no_grad():
        torch.testing.assert_close(fresh.network(**inputs).logits, ours, atol=1e-5, rtol=1e-5)
    # `merge`: a full model folder that AutoModelForImageTextToText loads to the same logits, its image processor beside
    assert run_cli("merge", out, tmp_path / "merged") == 0
    assert (tmp_path / "merged" / "preprocessor_config.json").is_file()
    merged = AutoModelForImageTextToText.from_pretrained(tmp_path / "merged", dtype=torch.float32).eval()
    with torch.no_grad():
        torch.testing.assert_close(merged(**inputs).logits, theirs, atol=1e-4, rtol=1e-4)

    # the loss the trainer divides is the SUM of the assistant tokens' cross-entropies, over a padded batch of two
    from toolkit.data.vision_chat import VisionChatDataset

    data = REPO / "configs/examples/data/quickstart_vlm.jsonl"
    records = [json.loads(line) for line in data.read_text().splitlines()[:2]]
    dataset = VisionChatDataset([adapter.encoder.encode(r, str(data)) for r in records], adapter.tokenizer.pad_token_id)
    batch = dataset.collate([0, 1])
    assert batch["attention_mask"].sum() < batch["attention_mask"].numel()   # one row padded
    with torch.no_grad():
        loss = adapter.loss(batch, adapter.trainable_modules())
        logits = adapter.network(**adapter.model_inputs({k: v for k, v in batch.items() if k != "labels"})).logits
    expected = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), batch["labels"][:, 1:].flatten(),
                                                 ignore_index=IGNORE_INDEX, reduction="sum")
    torch.testing.assert_close(loss, expected, atol=1e-4, rtol=1e-5)
    assert adapter.batch_units(batch)[0] == int((batch["labels"][:, 1:] != IGNORE_INDEX).sum()) > 0


def test_quickstart_loss_goes_down_and_resume_is_bit_identical(run_cli, tmp_path, tiny_cache):
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    assert train(run_cli, straight) == 0
    losses = [r["loss"] for r in read_metrics(straight)]
    assert len(losses) == 6 and losses[-1] < losses[0] - 0.3
    assert train(run_cli, resumed, "train.steps=3") == 0
    assert train(run_cli, resumed) == 0         # resumes from step 3
    assert [r["step"] for r in read_metrics(resumed)] == [1, 2, 3, 4, 5, 6]
    a = load_file(str(straight / "final" / "adapter_model.safetensors"))
    b = load_file(str(resumed / "final" / "adapter_model.safetensors"))
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)
    assert [r["loss"] for r in read_metrics(resumed)][3:] == losses[3:]
    # `sample` on the finished run: its LoRA in its model, the prompt asked about the run's sample.images
    assert run_cli("sample", straight, "--prompt", "describe the image") == 0
    records = [json.loads(line) for folder in (straight / "samples").iterdir()
               for line in (folder / "samples.jsonl").read_text().splitlines()]
    assert [(r["prompt"], Path(r["image"]).name) for r in records] == [("describe the image", IMAGE.name)]
    assert records[0]["completion"]


def test_labels_cover_the_assistant_turns_and_never_an_image_token(tmp_path, tiny_cache):
    from transformers import AutoImageProcessor, AutoTokenizer
    from omegaconf import OmegaConf

    from toolkit.data.vision_chat import VisionChatEncoder

    folder = resolve_model_path("tiny:qwen25_vl")
    tokenizer = AutoTokenizer.from_pretrained(folder)
    image_token_id = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    data = OmegaConf.create({"max_seq_len": 512, "train_on_prompt": False, "min_pixels": 0, "max_pixels": 0})
    encoder = VisionChatEncoder(tokenizer, AutoImageProcessor.from_pretrained(folder), image_token_id, data)
    record = {"messages": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what colour"}]},
                           {"role": "assistant", "content": "red"},
                           {"role": "user", "content": "and the shape"},
                           {"role": "assistant", "content": [{"type": "text", "text": "a circle"}]}],
              "images": ["shapes/red_circle_64x64.png"]}
    sample = encoder.encode(record, str(REPO / "configs/examples/data/quickstart_vlm.jsonl"))
    # 64x64 resized by the processor to 56x56: 4x4 patches of 14, 2x2 of them merged into one token
    assert sample.image_grid_thw.tolist() == [[1, 4, 4]]
    assert sample.pixel_values.shape == (16, 3 * 2 * 14 * 14)
    assert sample.input_ids.count(image_token_id) == 4
    learned = tokenizer.decode([t for t, l in zip(sample.input_ids, sample.labels) if l != IGNORE_INDEX])
    assert learned == "red<|im_end|>\na circle<|im_end|>\n"
    # the whole conversation, as the template renders it, with the image token repeated
    text = tokenizer.apply_chat_template([{"role": m["role"], "content": m["content"]} if isinstance(m["content"], str)
                                          else m for m in record["messages"]], tokenize=False)
    assert tokenizer.decode(sample.input_ids) == text.replace("<|image_pad|>", "<|image_pad|>" * 4)
    # max_pixels: fewer patches, fewer image tokens
    small = VisionChatEncoder(tokenizer, AutoImageProcessor.from_pretrained(folder), image_token_id,
                              OmegaConf.merge(data, {"max_pixels": 28 * 28}))
    assert small.encode(record, str(REPO / "configs/examples/data/quickstart_vlm.jsonl")).input_ids.count(
        image_token_id) == 1


@pytest.mark.parametrize("record, message", [
    ({"messages": [{"role": "user", "content": [{"type": "image"}]}, {"role": "assistant", "content": "x"}]},
     "more image parts than images"),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "x"}],
      "images": ["shapes/red_circle_64x64.png"]}, "more images than image parts"),
    ({"messages": [{"role": "user", "content": [{"type": "image"}]}, {"role": "assistant", "content": "x"}],
      "images": ["missing.png"]}, "cannot read image"),
    ({"messages": [{"role": "user", "content": "hi"}]}, "no assistant turn"),
])
def test_a_bad_record_is_one_message_naming_file_and_line(run_cli, tmp_path, capsys, tiny_cache, record, message):
    # beside the images it names; the pid keeps the pytest workers' files apart (their tmp_path names repeat)
    data = REPO / "configs/examples/data" / f".test_vlm_{os.getpid()}_{tmp_path.name}.jsonl"
    good = json.loads((REPO / "configs/examples/data/quickstart_vlm.jsonl").read_text().splitlines()[0])
    data.write_text(json.dumps(good) + "\n" + json.dumps(record) + "\n")
    try:
        assert train(run_cli, tmp_path / "run", f"data.path={data}", "data.eval_fraction=0") == 2
    finally:
        data.unlink()
    err = capsys.readouterr().err
    assert f"{data}:2: " in err and message in err and "fix:" in err and "Traceback" not in err
    assert not (tmp_path / "run").exists()  # read with the config (preflight/data_records.py), before the run folder


def test_unsloth_and_llama_factory_names_point_at_the_vlm_keys(run_cli, capsys):
    assert run_cli("validate", QUICKSTART, "finetune_vision_layers=true", "data.image_max_pixels=50176",
                   "sample.max_new_tokens=8") == 2
    err = capsys.readouterr().err
    assert "invalid config (2 problems)" in err
    assert "unknown key 'finetune_vision_layers' in command line; did you mean 'network.vision_layers'? " in err
    assert "unknown key 'data.image_max_pixels' in command line; did you mean 'data.max_pixels'? " in err
