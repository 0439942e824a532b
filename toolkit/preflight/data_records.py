"""Every record of a data file (data.path, data.eval_path), read before the run folder is made.

What the data loader would refuse about a record itself, without the tokenizer: its fields, its conversation (an
assistant turn, a prompt before it, the tools' JSON), a vision chat's image parts and image files. Each record is
named by file and line, so a bad record stops `train` (and `validate`) before anything is written or loaded. What
only the model's chat template can tell (a turn order it refuses, tools or calls it leaves out) is still checked
as the data loads: that needs the tokenizer, which comes with the model.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from toolkit.config.data_schemas import TextDataSection, VisionChatDataSection
from toolkit.config.load import DEFAULTS_LABEL
from toolkit.config.objectives import OBJECTIVE_FORMATS
from toolkit.data.preference import FIELDS, FIELDS_FIX, check_example, missing_fields
from toolkit.data.records import read_records, where
from toolkit.data.text import check_record, format_of
from toolkit.data.vision_chat import check_vision_record
from toolkit.errors import UserError

Setting = Callable[[str], Any]  # a key's resolved value (None when it is missing or does not resolve)
SHOWN = 5  # records named per file; the rest are counted


def record_problems(schema: type, setting: Setting, sources: dict) -> list[str]:
    """The records of data.path and data.eval_path that the data loader would refuse (the checks RECORD_CHECKS
    holds for the family's data schema), each named with its file and line."""
    check = RECORD_CHECKS.get(schema)
    if check is None:
        return []
    problems = []
    for key in ("data.path", "data.eval_path"):
        path = setting(key)
        if not isinstance(path, str) or not Path(path).is_file():
            continue  # a path that is not a file is named by data_problems
        label = f"'{key}' in {sources.get(key, DEFAULTS_LABEL)}"
        try:
            records = read_records(path, key)
        except UserError as err:  # not JSON, not a list of objects, no records, another extension
            problems.append(f"{label}: {_indented(err)}")
            continue
        problems += [f"{label}: {problem}" for problem in check(records, path, setting)]
    return problems


def text_record_problems(records: list[dict], path: str, setting: Setting) -> list[str]:
    """llm: the records as the data format reads them (data.format; auto: the objective's, or for sft the first
    record's)."""
    objective, text_field, requested = setting("train.objective"), setting("data.text_field"), setting("data.format")
    formats = OBJECTIVE_FORMATS.get(objective)
    if formats is None:
        return []  # an unknown objective is named by the config's choices check
    if requested != "auto":
        fmt = requested
    else:
        fmt = format_of(records[0], text_field) if objective == "sft" else formats[0]
    if fmt not in formats:
        return []  # the plan's data.format rule names the setting, or a first record whose fields match no format
    if fmt in FIELDS:
        if (missing := missing_fields(records[0], fmt)):  # other data altogether: said once, with the objective
            return [f"train.objective={objective} trains on {fmt} records, and the first of {path} is not one: "
                    f"{missing}: {FIELDS_FIX}"]
        return refused(records, path, lambda record: check_example(record, fmt, path))
    train_on_prompt = setting("data.train_on_prompt")
    return refused(records, path, lambda record: check_record(record, fmt, text_field, train_on_prompt, path))


def vision_record_problems(records: list[dict], path: str, setting: Setting) -> list[str]:
    """vlm: each record's messages, image parts and image files."""
    return refused(records, path, lambda record: check_vision_record(record, path))


RECORD_CHECKS: dict[type, Callable[[list[dict], str, Setting], list[str]]] = {
    TextDataSection: text_record_problems,
    VisionChatDataSection: vision_record_problems,
}


def refused(records: list[dict], path: str, check: Callable[[dict], None]) -> list[str]:
    """The messages of the UserErrors `check` raises for the records: the first SHOWN, then how many more."""
    messages, more = [], []
    for record in records:
        try:
            check(record)
        except UserError as err:
            if len(messages) < SHOWN:
                messages.append(_indented(err))
            else:
                more.append(record)
    if more:
        messages.append(f"{len(more)} more record{'s' if len(more) > 1 else ''} of {path} cannot be trained on "
                        f"either, from {where(path, more[0])} on: fix those above, and `validate` names the rest")
    return messages


def _indented(err: UserError) -> str:
    """The error's message as one item of a list of problems (its fix line under the item's text)."""
    return str(err).replace("\n", "\n  ")
