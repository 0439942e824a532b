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
     ":1: the conversation has no assistant turn to learn from\n    fix: add the assistant's answer (role assistant, "
     "or ShareGPT's gpt), or drop the record"),
    ("quickstart_llm_chat.yaml", {"messages": [{"role": "assistant", "content": "hi"}]},
     ":1: the conversation begins with an assistant turn, which has no prompt before it\n    fix: start it with a "
     "user (or system) turn, or set data.train_on_prompt=true"),
    ("quickstart_llm_chat.yaml", {"conversations": [{"from": "human", "value": "hi"},
                                                    {"from": "function_call", "value": "get_weather(paris)"}]},
     ":1: a 'function_call' turn's value is not JSON"),
    ("quickstart_llm_chat.yaml", {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "x"}],
                                  "tools": "{not json"},
     ":1: 'tools' is a string that is not JSON"),
    ("quickstart_llm_alpaca.yaml", {"instruction": "a", "input": "b"},
     ":1: an alpaca record needs string fields 'instruction' and 'output' (and optionally 'input'), found keys "
     "['input', 'instruction']\n    fix: give every record those fields"),
    ("quickstart_llm_kto.yaml", {"prompt": "a", "completion": "b", "label": "yes"},
     ":1: 'label' must be true or false (a desirable completion or not)\n    fix: write it as a JSON true or false"),
    ("quickstart_llm_dpo.yaml", {"prompt": "a", "chosen": [{"role": "assistant", "content": "x"}], "rejected": "y"},
     ":1: 'prompt' and 'chosen' must both be strings or both be message lists (TRL's plain and conversational "
     "formats)\n    fix: write both as text, or both as messages"),
    ("quickstart_llm_grpo.yaml", {"prompt": 7},
     ":1: 'prompt' must be a string or a list of {\"role\": ..., \"content\": ...} messages\n    fix: give the "
     "prompt as text"),
])
def test_a_record_the_data_cannot_train_on_is_named_with_its_fix_before_the_run_folder(config, record, expected,
                                                                                       tmp_path, run_cli, capsys):
    """Read with the config (toolkit/preflight/data_records.py): nothing is loaded or written, not even the run
    folder."""
    data = tmp_path / "data.jsonl"
    write_records(data, [record] * 4)
    assert run_cli("train", f"configs/examples/{config}", f"data.path={data}", f"run.output_dir={tmp_path / 'run'}",
                   "data.eval_fraction=0", "sample.prompts=[]") == 2
    err = capsys.readouterr().err
    assert f"'data.path' in command line: {data}{expected}" in err and "Traceback" not in err
    assert err.count(f"{data}:") == 4  # each record named
    assert not (tmp_path / "run").exists()


def _files(folder) -> dict[str, tuple[int, int]]:
    """Every file under `folder`: relative path -> (size, modification time in ns)."""
    return {str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns) for p in folder.rglob("*")
            if p.is_file()}


def test_train_names_bad_chat_records_before_it_makes_or_touches_a_run_folder(tmp_path):
    """Through `python -m toolkit train`: malformed records of a chat file (OpenAI messages, ShareGPT) exit 2 with one
    message naming the file, each record's line and the fix, before anything is written: a new run folder is not
    made, and an existing one (even with --fresh, which would move it aside) is left as it was."""
    from conftest import REPO, run_toolkit

    config = "configs/examples/quickstart_llm_chat.yaml"
    good = (REPO / "configs/examples/data/quickstart_chat.jsonl").read_text().splitlines()[:3]
    narrator = {"conversations": [{"from": "narrator", "value": "once"}, {"from": "gpt", "value": "upon"}]}
    data = tmp_path / "chat.jsonl"
    data.write_text("\n".join(good + ['{"messages": "hello"}', json.dumps(narrator)]) + "\n")
    new = tmp_path / "new"
    done = run_toolkit("train", config, f"data.path={data}", f"run.output_dir={new}")
    assert done.returncode == 2, done.stderr
    assert (f"  - 'data.path' in command line: {data}:4: a chat record needs 'messages': a non-empty list of "
            "{\"role\": ..., \"content\": ...} objects, found keys ['messages']\n"
            "    fix: give each message a string 'role' and 'content'") in done.stderr
    assert (f"  - 'data.path' in command line: {data}:5: ShareGPT speakers ['narrator'] are not known\n"
            "    fix: use one of human, user") in done.stderr
    assert "Traceback" not in done.stderr and not new.exists()

    run = tmp_path / "run"
    short = ["train.steps=2", "save.every=2", "sample.prompts=[]", "data.eval_fraction=0"]
    assert run_toolkit("train", config, f"run.output_dir={run}", *short).returncode == 0
    before, beside = _files(run), sorted(p.name for p in tmp_path.iterdir())
    assert "config.yaml" in before and "plan.json" in before
    for fresh in ([], ["--fresh"]):
        done = run_toolkit("train", config, f"data.path={data}", f"run.output_dir={run}", *short, *fresh)
        assert done.returncode == 2 and f"{data}:4: a chat record needs 'messages'" in done.stderr
        assert _files(run) == before and sorted(p.name for p in tmp_path.iterdir()) == beside


def test_validate_names_the_first_bad_records_of_each_data_file_and_counts_the_rest(tmp_path, run_cli, capsys):
    import pyarrow as pa
    import pyarrow.parquet as pq

    data, held_out = tmp_path / "train.jsonl", tmp_path / "eval.parquet"
    write_records(data, [CHAT] + [{"messages": [{"role": "user", "content": f"question {n}"}]} for n in range(8)])
    pq.write_table(pa.Table.from_pylist([{"messages": [{"role": "user", "content": "q"}]}]), held_out)
    assert run_cli("validate", "configs/examples/quickstart_llm_chat.yaml", f"data.path={data}",
                   f"data.eval_path={held_out}") == 2
    err = capsys.readouterr().err
    assert "invalid config (7 problems):" in err and "Traceback" not in err
    named = [n for n in range(1, 10) if f"{data}:{n}: the conversation has no assistant turn" in err]
    assert named == [2, 3, 4, 5, 6]
    assert (f"  - 'data.path' in command line: 3 more records of {data} cannot be trained on either, from {data}:7 "
            "on: fix those above, and `validate` names the rest") in err
    assert (f"  - 'data.eval_path' in command line: {held_out} (row 0): the conversation has no assistant turn to learn "
            "from\n    fix: add the assistant's answer") in err
