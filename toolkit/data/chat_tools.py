"""Tool use in chat records, as transformers' chat templates take it: the functions a conversation may call
(`apply_chat_template(tools=...)`) and the assistant's calls (an assistant message's `tool_calls`, the results in
`tool` messages).

Two layouts are read:
- OpenAI's: `messages` whose assistant turns may carry `tool_calls` (content then may be empty), `tool` turns with
  the results, and a top-level `tools` list of function schemas;
- ShareGPT's as LLaMA-Factory writes it: `function_call` turns whose value is a JSON {"name", "arguments"} (or a list
  of them), `observation` turns with the results, and `tools` as a JSON string.

A chat template that leaves the tools or the calls out of what it renders is refused by name: the model would
otherwise learn the conversation without them, silently.
"""

from __future__ import annotations

import json
from typing import Callable

from toolkit.data.records import where
from toolkit.errors import UserError

TOOLS_FIX = ("  fix: use a model whose chat template renders tools (Qwen2.5 and later, Llama 3.1 and later, Mistral's "
             "instruct models), or drop the tools and tool calls from the data")


def record_tools(record: dict, path: str) -> list[dict] | None:
    """The record's top-level `tools` (a list of function schemas, or a JSON string of one); None without any."""
    tools = record.get("tools")
    if tools is None or tools == "" or tools == []:
        return None
    if isinstance(tools, str):
        try:
            tools = json.loads(tools)
        except ValueError as err:
            raise UserError(f"{where(path, record)}: 'tools' is a string that is not JSON ({err})\n"
                            "  fix: give 'tools' as a list of function schemas, or as a JSON string of one") from None
    tools = [tools] if isinstance(tools, dict) else tools
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise UserError(f"{where(path, record)}: 'tools' must be a list of function schemas (objects), "
                        f"found {type(tools).__name__}\n  fix: give 'tools' as a list of objects")
    return tools


def sharegpt_call(value: str, record: dict, path: str) -> dict:
    """A ShareGPT `function_call` turn as the assistant message with `tool_calls` that chat templates read."""
    try:
        calls = json.loads(value)
    except ValueError as err:
        raise UserError(f"{where(path, record)}: a 'function_call' turn's value is not JSON ({err})\n"
                        "  fix: give it as {\"name\": ..., \"arguments\": {...}} (or a list of those)") from None
    calls = calls if isinstance(calls, list) else [calls]
    if not calls or not all(isinstance(c, dict) and isinstance(c.get("name"), str) for c in calls):
        raise UserError(f"{where(path, record)}: a 'function_call' turn must name the function it calls\n"
                        "  fix: give it as {\"name\": ..., \"arguments\": {...}} (or a list of those)")
    return {"role": "assistant", "content": "",
            "tool_calls": [{"type": "function", "function": {"name": c["name"], "arguments": c.get("arguments", {})}}
                           for c in calls]}


def openai_message(message, record: dict, path: str) -> dict | None:
    """An OpenAI-style message as the chat template takes it (None when it is not one): role and content, an
    assistant's tool_calls (its content then may be empty or null; an empty list is no calls), a tool result's
    tool_call_id and name. A call's `arguments` given as a JSON string, as OpenAI's API writes them, are parsed:
    the templates render them with `tojson`, and would otherwise teach the model a quoted, escaped string."""
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        return None
    calls = message.get("tool_calls") or None
    content = message.get("content")
    if calls is not None:
        if message["role"] != "assistant" or not isinstance(calls, list) or not all(
                isinstance(c, dict) and isinstance((c.get("function") or {}).get("name"), str) for c in calls):
            return None
        content = "" if content is None else content
        calls = [_parsed_arguments(c, record, path) for c in calls]
    if not isinstance(content, str):
        return None
    kept = {"role": message["role"], "content": content}
    kept.update({k: message[k] for k in ("tool_call_id", "name") if message.get(k) is not None})
    if calls is not None:
        kept["tool_calls"] = calls
    return kept


def _parsed_arguments(call: dict, record: dict, path: str) -> dict:
    arguments = call["function"].get("arguments")
    if not isinstance(arguments, str):
        return call
    try:
        parsed = json.loads(arguments) if arguments.strip() else {}
    except json.JSONDecodeError as err:
        raise UserError(f"{where(path, record)}: the arguments of the call to '{call['function']['name']}' are a "
                        f"string that is not JSON ({err})\n  fix: give them as a JSON object, or a string of one "
                        "(as OpenAI's API writes them)") from None
    return {**call, "function": {**call["function"], "arguments": parsed}}


def check_rendered(render: Callable[..., str], messages: list[dict], tools: list[dict] | None, record: dict,
                   path: str) -> None:
    """Refuse a record whose tools or tool calls the chat template (`render(messages, tools=...)`) leaves out."""
    whole = render(messages, tools=tools)
    if tools and whole == render(messages, tools=None):
        raise UserError(f"{where(path, record)}: the record gives 'tools', but the tokenizer's chat template does not "
                        f"render them: the model would learn the conversation without them\n{TOOLS_FIX}")
    if any("tool_calls" in m for m in messages):
        bare = [{k: v for k, v in m.items() if k != "tool_calls"} for m in messages]
        if whole == render(bare, tools=tools):
            raise UserError(f"{where(path, record)}: the conversation has tool calls, but the tokenizer's chat "
                            f"template does not render them: the model would learn empty assistant turns\n{TOOLS_FIX}")
