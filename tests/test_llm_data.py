"""LLM data: formats and file types, exact label masks, padding-free packing equal to padded batches."""

from __future__ import annotations

import json

import pytest
import torch
from omegaconf import OmegaConf

from toolkit.data.packing import PackedTextDataset, flatten_samples, pack_greedy
from toolkit.data.samples import IGNORE_INDEX, TokenizedSample
from toolkit.data.text import alpaca_prompt, build_text_data, pad_samples, tokenize_chat
from toolkit.errors import UserError
from toolkit.tiny import resolve_model_path

CHAT = {"messages": [
    {"role": "system", "content": "answer with colours"},
    {"role": "user", "content": "what colour is the star"},
    {"role": "assistant", "content": "the star is orange"},
    {"role": "user", "content": "how many star"},
    {"role": "assistant", "content": "one orange star"},
]}
ALPACA = {"instruction": "name the colour of the star", "input": "one star", "output": "the star is orange"}


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(resolve_model_path("tiny:llm"))


@pytest.fixture(scope="module")
def tiny_model():
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(resolve_model_path("tiny:llm"), dtype=torch.float32,
                                                attn_implementation="sdpa").eval()


def data_cfg(path, **overrides):
    base = {"path": str(path), "format": "auto", "text_field": "text", "max_seq_len": 256, "packing": False,
            "train_on_prompt": False, "eval_path": None, "eval_fraction": 0.0}
    return OmegaConf.create({**base, **overrides})


def labelled_spans(sample) -> list[list[int]]:
    """Runs of consecutive labelled positions, as token ids."""
    spans, current = [], []
    for token, label in zip(sample.input_ids, sample.labels):
        if label == IGNORE_INDEX:
            if current:
                spans.append(current)
            current = []
        else:
            assert label == token
            current.append(token)
    return spans + ([current] if current else [])


def test_chat_labels_cover_exactly_the_assistant_turns(tokenizer):
    sample = tokenize_chat(CHAT, tokenizer, train_on_prompt=False, path="x.jsonl")
    full = tokenizer.apply_chat_template(CHAT["messages"], tokenize=False)
    assert tokenizer.decode(sample.input_ids) == full
    spans = [tokenizer.decode(span) for span in labelled_spans(sample)]
    # The '<|assistant|>\n' header is masked; the answer and its end-of-turn token are learned.
    assert spans == ["the star is orange<|end|>\n", "one orange star<|end|>\n"]
    expected = [IGNORE_INDEX] * len(sample.input_ids)
    header = tokenizer(tokenizer.apply_chat_template(CHAT["messages"][:2], tokenize=False, add_generation_prompt=True),
                       add_special_tokens=False)["input_ids"]
    first_turn = tokenizer(tokenizer.apply_chat_template(CHAT["messages"][:3], tokenize=False),
                           add_special_tokens=False)["input_ids"]
    expected[len(header):len(first_turn)] = first_turn[len(header):]
    assert sample.labels[:len(first_turn)] == expected[:len(first_turn)]
    everything = tokenize_chat(CHAT, tokenizer, train_on_prompt=True, path="x.jsonl")
    assert everything.labels == everything.input_ids == sample.input_ids


def test_alpaca_labels_are_the_response_and_eos(tmp_path, tokenizer):
    path = tmp_path / "a.jsonl"
    path.write_text(json.dumps(ALPACA) + "\n")
    data = build_text_data(data_cfg(path), tokenizer, seed=0)
    assert data.format == "alpaca"
    sample = data.train.samples[0]
    prompt = tokenizer(alpaca_prompt(ALPACA["instruction"], ALPACA["input"]))["input_ids"]
    response = tokenizer(ALPACA["output"], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    assert sample.input_ids == prompt + response
    assert sample.labels == [IGNORE_INDEX] * len(prompt) + response
    on_prompt = build_text_data(data_cfg(path, train_on_prompt=True), tokenizer, seed=0).train.samples[0]
    assert on_prompt.labels == on_prompt.input_ids


def write_records(path, records):
    suffix = path.suffix
    if suffix == ".jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in records))
    elif suffix == ".json":
        path.write_text(json.dumps(records, indent=1))
    elif suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq
        pq.write_table(pa.Table.from_pylist(records), path)
    else:
        path.write_text("".join(r["text"] + "\n" for r in records))


@pytest.mark.parametrize("fmt,suffix", [("text", ".jsonl"), ("text", ".json"), ("text", ".parquet"), ("text", ".txt"),
                                        ("alpaca", ".jsonl"), ("alpaca", ".json"), ("alpaca", ".parquet"),
                                        ("chat", ".jsonl"), ("chat", ".json"), ("chat", ".parquet")])
def test_every_format_from_every_file_type(tmp_path, tokenizer, fmt, suffix):
    records = {"text": [{"text": f"the red circle number {i}"} for i in range(5)],
               "alpaca": [dict(ALPACA, output=f"the star is {c}") for c in ("red", "blue", "green", "pink", "gold")],
               "chat": [CHAT] * 5}[fmt]
    path = tmp_path / f"data{suffix}"
    write_records(path, records)
    data = build_text_data(data_cfg(path, eval_fraction=0.2), tokenizer, seed=0)
    assert data.format == fmt
    assert (len(data.train), len(data.eval)) == (4, 1)
    reference = {"text": lambda r: tokenizer(r["text"])["input_ids"] + [tokenizer.eos_token_id],
                 "alpaca": lambda r: tokenizer(alpaca_prompt(r["instruction"], r["input"]))["input_ids"]
                 + tokenizer(r["output"], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id],
                 "chat": lambda r: tokenize_chat(r, tokenizer, False, "").input_ids}[fmt]
    expected = sorted(reference(r) for r in records)
    assert sorted(s.input_ids for s in data.train.samples + data.eval.samples) == expected


def test_missing_field_names_file_and_line(tmp_path, tokenizer):
    path = tmp_path / "chat.jsonl"
    path.write_text(json.dumps(CHAT) + "\n\n" + json.dumps({"messages": [{"role": "user"}]}) + "\n")
    with pytest.raises(UserError, match=rf"{path}:3: a chat record needs 'messages'"):
        build_text_data(data_cfg(path), tokenizer, seed=0)
    alpaca = tmp_path / "alpaca.jsonl"
    alpaca.write_text(json.dumps(ALPACA) + "\n" + json.dumps({"instruction": "x"}) + "\n")
    with pytest.raises(UserError, match=rf"{alpaca}:2: an alpaca record needs string fields 'instruction' and 'output'"):
        build_text_data(data_cfg(alpaca), tokenizer, seed=0)
    unknown = tmp_path / "u.jsonl"
    unknown.write_text(json.dumps({"prompt": "a", "completion": "b"}) + "\n")
    with pytest.raises(UserError, match=rf"{unknown}:1: data.format is auto but the fields \['completion', 'prompt'\]"):
        build_text_data(data_cfg(unknown), tokenizer, seed=0)


def test_truncation_to_max_seq_len(tmp_path, tokenizer):
    path = tmp_path / "t.txt"
    path.write_text("one two three four five six seven eight nine ten " * 4 + "\n")
    sample = build_text_data(data_cfg(path, max_seq_len=9), tokenizer, seed=0).train.samples[0]
    full = tokenizer(path.read_text().strip())["input_ids"]
    assert sample.input_ids == full[:9]


def test_pack_greedy_first_fit():
    assert pack_greedy([5, 3, 4, 2, 6], capacity=8) == [[0, 1], [2, 3], [4]]


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_packed_loss_equals_padded_loss(tokenizer, tiny_model, attention):
    """transformers derives a block-diagonal mask from restarting position_ids: same loss, no cross-attention."""
    from toolkit.data.text import tokenize_alpaca

    tiny_model.set_attn_implementation(attention)
    samples = [tokenize_chat(CHAT, tokenizer, False, "")] + [
        tokenize_alpaca(dict(ALPACA, output=f"the {c} square"), tokenizer, False, "") for c in ("red", "blue", "green")]
    packed = PackedTextDataset(samples, max_seq_len=128)
    batch = packed.collate(range(len(packed)))
    lengths = [len(s.input_ids) for s in samples]
    assert batch["input_ids"].shape == (1, sum(lengths)) and "attention_mask" not in batch
    assert batch["position_ids"][0].tolist() == [p for n in lengths for p in range(n)]
    padded = pad_samples(samples, tokenizer.pad_token_id)
    with torch.no_grad():
        packed_loss = tiny_model(**batch, use_cache=False).loss
        padded_loss = tiny_model(**padded, use_cache=False).loss
        # Control: the same row with positions that never restart lets samples see each other.
        leaky = dict(batch, position_ids=torch.arange(sum(lengths))[None])
        leaky_loss = tiny_model(**leaky, use_cache=False).loss
    n_tokens = int((padded["labels"][:, 1:] != IGNORE_INDEX).sum())
    assert int((batch["labels"][:, 1:] != IGNORE_INDEX).sum()) == n_tokens
    assert abs(packed_loss.item() - padded_loss.item()) < 1e-5
    assert abs(leaky_loss.item() - padded_loss.item()) > 1e-4  # random tiny model: small but real
    tiny_model.set_attn_implementation("sdpa")


def test_flatten_masks_first_token_of_each_sample():
    batch = flatten_samples([TokenizedSample([1, 2, 3], [1, 2, 3]), TokenizedSample([4, 5], [IGNORE_INDEX, 5])])
    assert batch["labels"].tolist() == [[IGNORE_INDEX, 2, 3, IGNORE_INDEX, 5]]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 0, 1]]


SHAREGPT_SPEAKERS = {"system": "system", "user": "human", "assistant": "gpt"}
SHAREGPT = {"conversations": [{"from": SHAREGPT_SPEAKERS[m["role"]], "value": m["content"]} for m in CHAT["messages"]]}


def test_sharegpt_conversations_train_as_their_messages(tokenizer):
    """axolotl's and LLaMA-Factory's ShareGPT records: the same tokens and labels as the messages they map to, a
    top-level system prompt first."""
    assert tokenize_chat(SHAREGPT, tokenizer, False, "x.jsonl") == tokenize_chat(CHAT, tokenizer, False, "x.jsonl")
    system_apart = {"system": CHAT["messages"][0]["content"], "conversations": SHAREGPT["conversations"][1:]}
    assert tokenize_chat(system_apart, tokenizer, False, "x.jsonl") == tokenize_chat(CHAT, tokenizer, False, "x.jsonl")
    unknown = {"conversations": [{"from": "narrator", "value": "once"}, {"from": "gpt", "value": "upon"}]}
    with pytest.raises(UserError, match=r"x.jsonl: ShareGPT speakers \['narrator'\] are not known\n  fix: use one of "
                                        "human, user, gpt, assistant, system, tool, function, observation, function_call in 'from'"):
        tokenize_chat(unknown, tokenizer, False, "x.jsonl")


def test_validate_shows_the_format_read_from_the_data_and_train_takes_sharegpt(tmp_path, run_cli, capsys):
    from helpers import read_metrics

    data = tmp_path / "sharegpt.jsonl"
    write_records(data, [SHAREGPT] * 6)
    run = ["configs/examples/quickstart_llm_chat.yaml", f"data.path={data}", "data.format=auto",
           f"run.output_dir={tmp_path / 'run'}"]
    assert run_cli("validate", *run) == 0
    assert ("data.format=chat: the first record of data.path has ShareGPT's conversations (from/value read as "
            "role/content)") in capsys.readouterr().out
    assert run_cli("train", *run, "train.steps=2", "save.every=0", "sample.prompts=[]", "data.eval_fraction=0",
                   "log.every=1") == 0
    assert [r["step"] for r in read_metrics(tmp_path / "run")] == [1, 2]
    unknown = tmp_path / "unknown.jsonl"
    write_records(unknown, [{"prompt": "a", "completion": "b"}])
    assert run_cli("validate", *run[:-1], f"data.path={unknown}") == 2
    err = capsys.readouterr().err
    assert (f"'data.format' is auto, and the fields ['completion', 'prompt'] of the first record of {unknown} match no "
            "format: use 'text' (text, data.text_field), instruction/input/output (alpaca), or messages or ShareGPT's "
            "conversations (chat), or set data.format") in err and "Traceback" not in err


@pytest.mark.parametrize("config, record, expected", [
    ("quickstart_llm_chat.yaml", {"messages": [{"role": "user", "content": "hi"}]},
     ":1: the conversation has no assistant turn to learn from\n  fix: add the assistant's answer (role assistant, "
     "or ShareGPT's gpt), or drop the record"),
    ("quickstart_llm_kto.yaml", {"prompt": "a", "completion": "b", "label": "yes"},
     ":1: 'label' must be true or false (a desirable completion or not)\n  fix: write it as a JSON true or false"),
    ("quickstart_llm_dpo.yaml", {"prompt": "a", "chosen": [{"role": "assistant", "content": "x"}], "rejected": "y"},
     ":1: 'prompt' and 'chosen' must both be strings or both be message lists (TRL's plain and conversational "
     "formats)\n  fix: write both as text, or both as messages"),
])
def test_a_record_the_data_cannot_train_on_is_named_with_its_fix(config, record, expected, tmp_path, run_cli, capsys):
    data = tmp_path / "data.jsonl"
    write_records(data, [record] * 4)
    assert run_cli("train", f"configs/examples/{config}", f"data.path={data}", f"run.output_dir={tmp_path / 'run'}",
                   "data.eval_fraction=0", "sample.prompts=[]") == 2
    err = capsys.readouterr().err
    assert f"{data}{expected}" in err and "Traceback" not in err
