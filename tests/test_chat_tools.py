"""Tool use in chat data (toolkit/data/chat_tools.py): ShareGPT's function_call / observation turns and `tools` (as
LLaMA-Factory writes them) and OpenAI's tool_calls reach the chat template, the calls are learned as assistant
turns, the results are not; a template that drops the tools or the calls is refused through `train`, exit 2."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from conftest import REPO
from toolkit.data.text import tokenize_chat
from toolkit.errors import UserError

# the tiny model's template, with tools listed in the system header and each call written as JSON
TOOL_TEMPLATE = (
    "{{ bos_token }}{% if tools %}<|tools|>\n{% for t in tools %}{{ t['name'] }}{% endfor %}<|end|>\n{% endif %}"
    "{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}"
    "{% if message.tool_calls %}{% for c in message.tool_calls %}call {{ c.function.name }} "
    "{{ c.function.arguments | tojson }}{% endfor %}{% endif %}<|end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
TOOLS = [{"name": "get_weather", "description": "the weather in a city",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}]
SHAREGPT = {"conversations": [
    {"from": "human", "value": "what is the weather in paris"},
    {"from": "function_call", "value": json.dumps({"name": "get_weather", "arguments": {"city": "paris"}})},
    {"from": "observation", "value": "sunny"},
    {"from": "gpt", "value": "it is sunny"}],
    "tools": json.dumps(TOOLS), "__line__": 1}


def tokenizer(template: str | None = None):
    from transformers import AutoTokenizer

    from toolkit.tiny import resolve_model_path

    tok = AutoTokenizer.from_pretrained(resolve_model_path("tiny:llm"))
    if template is not None:
        tok.chat_template = template
    return tok


def labelled_text(tok, sample) -> str:
    return tok.decode([t for t, label in zip(sample.input_ids, sample.labels) if label != -100])


def test_sharegpt_tools_and_calls_reach_the_template_and_the_calls_are_learned():
    tok = tokenizer(TOOL_TEMPLATE)
    sample = tokenize_chat(SHAREGPT, tok, train_on_prompt=False, path="data.jsonl")
    text = tok.decode(sample.input_ids)
    assert "<|tools|>\nget_weather<|end|>" in text                       # the tools, from the JSON string
    assert '<|assistant|>\ncall get_weather {"city": "paris"}<|end|>' in text
    assert "<|tool|>\nsunny<|end|>" in text                               # the observation, as a tool result
    # learned: the call and the answer, each with its end of turn; not the question, the tools or the result
    assert labelled_text(tok, sample) == 'call get_weather {"city": "paris"}<|end|>\nit is sunny<|end|>\n'


def test_openai_tool_calls_with_null_content_are_kept():
    tok = tokenizer(TOOL_TEMPLATE)
    record = {"messages": [
        {"role": "user", "content": "weather in paris?"},
        {"role": "assistant", "content": None,
         "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "paris"}}}]},
        {"role": "tool", "content": "sunny", "tool_call_id": "0"},
        {"role": "assistant", "content": "sunny"}], "tools": TOOLS, "__line__": 3}
    sample = tokenize_chat(record, tok, train_on_prompt=False, path="data.jsonl")
    assert 'call get_weather {"city": "paris"}' in labelled_text(tok, sample)


def test_openai_arguments_as_a_json_string_are_learned_as_the_object():
    """OpenAI's API writes a call's arguments as a JSON string; the template's `tojson` would render that string
    quoted and escaped. The string is parsed: the model learns the object, as with arguments given as one."""
    tok = tokenizer(TOOL_TEMPLATE)

    def record(arguments):
        return {"messages": [
            {"role": "user", "content": "weather in paris?"},
            {"role": "assistant", "content": "",
             "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": arguments}}]},
            {"role": "tool", "content": "sunny", "tool_call_id": "0"},
            {"role": "assistant", "content": "sunny"}], "tools": TOOLS, "__line__": 3}

    as_string = tokenize_chat(record('{"city": "paris"}'), tok, train_on_prompt=False, path="data.jsonl")
    as_object = tokenize_chat(record({"city": "paris"}), tok, train_on_prompt=False, path="data.jsonl")
    assert as_string.input_ids == as_object.input_ids and as_string.labels == as_object.labels
    assert 'call get_weather {"city": "paris"}<|end|>' in labelled_text(tok, as_string)
    with pytest.raises(UserError, match=r"data.jsonl:3: the arguments of the call to 'get_weather' are a string "
                                        r"that is not JSON") as err:
        tokenize_chat(record("city=paris"), tok, train_on_prompt=False, path="data.jsonl")
    assert "fix: give them as a JSON object" in str(err.value)


def test_an_empty_tool_calls_list_is_a_plain_message():
    """Chat exports that write "tool_calls": [] on every message train as plain chat, with any template."""
    plain = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}],
             "__line__": 2}
    empty = {"messages": [{"role": "user", "content": "hi", "tool_calls": []},
                          {"role": "assistant", "content": "hello", "tool_calls": []}], "__line__": 2}
    tok = tokenizer()  # the tiny model's own template: no tools
    got, expected = (tokenize_chat(r, tok, train_on_prompt=False, path="d.jsonl") for r in (empty, plain))
    assert got.input_ids == expected.input_ids and got.labels == expected.labels


@pytest.mark.parametrize("record, said", [
    ({**SHAREGPT}, "the record gives 'tools', but the tokenizer's chat template does not render them"),
    ({**SHAREGPT, "tools": None}, "the conversation has tool calls, but the tokenizer's chat template does not render "
                                  "them"),
    ({**SHAREGPT, "tools": "{not json"}, "'tools' is a string that is not JSON"),
    ({"conversations": [{"from": "human", "value": "hi"}, {"from": "function_call", "value": "{}"}], "__line__": 4},
     "a 'function_call' turn must name the function it calls"),
])
def test_what_the_template_would_drop_is_refused(record, said):
    with pytest.raises(UserError, match=said.replace("(", r"\(").replace(")", r"\)")) as err:
        tokenize_chat(record, tokenizer(), train_on_prompt=False, path="data.jsonl")  # the tiny model's own template
    assert "fix:" in str(err.value)


def test_train_refuses_tools_its_model_cannot_render_and_trains_with_one_that_can(tmp_path: Path, run_cli, capsys):
    from toolkit.tiny import resolve_model_path

    data = tmp_path / "tools.jsonl"
    data.write_text("".join(json.dumps({k: v for k, v in SHAREGPT.items() if k != "__line__"}) + "\n"
                            for _ in range(4)))
    common = [f"data.path={data}", "data.format=chat", "train.steps=2", "save.every=0", "sample.every=0",
              "data.max_seq_len=128"]
    config = str(REPO / "configs/examples/quickstart_llm.yaml")
    assert run_cli("train", config, f"run.output_dir={tmp_path / 'plain'}", *common) == 2
    err = capsys.readouterr().err
    assert f"{data}:1: the record gives 'tools', but the tokenizer's chat template does not render them" in err
    assert "Traceback" not in err
    model = tmp_path / "tiny-tools"
    shutil.copytree(resolve_model_path("tiny:llm"), model)
    (model / "chat_template.jinja").write_text(TOOL_TEMPLATE)
    assert run_cli("train", config, f"run.output_dir={tmp_path / 'tools'}", f"model.name_or_path={model}",
                   *common) == 0
    assert (tmp_path / "tools" / "final" / "adapter_model.safetensors").is_file()


def test_preference_records_pass_their_tools_to_the_template_or_are_refused():
    from toolkit.data.preference import encode_records

    record = {"prompt": [{"role": "user", "content": "weather in paris?"}],
              "chosen": [{"role": "assistant", "content": "sunny"}],
              "rejected": [{"role": "assistant", "content": "rain"}], "tools": TOOLS, "__line__": 2}
    tok = tokenizer(TOOL_TEMPLATE)
    [example] = encode_records([record], "preference", tok, 256, "pairs.jsonl")
    assert "<|tools|>\nget_weather<|end|>" in tok.decode(example.prompt)
    assert [tok.decode(c) for c in example.completions] == ["sunny<|end|>\n", "rain<|end|>\n"]
    with pytest.raises(UserError, match="pairs.jsonl:2: the record gives 'tools', but the tokenizer's chat template"):
        encode_records([record], "preference", tokenizer(), 256, "pairs.jsonl")
