"""A YAML syntax error as a user can act on it: the line to fix, not only where the parser stopped.

PyYAML reports where it noticed the problem. For a missing ':' after a key, an unclosed quote or bracket, or a
line indented one space off, that mark lands on the line after the mistake (or at the end of the file): the key
`train` without its colon on line 20 is noticed at `lr:` on line 21. When the mark sits at the start of its
line's content (nothing on that line before it can be wrong), the message also names the last non-empty line
before it, and the line where the construct the parser was reading began (a quote, a bracket).
"""

from __future__ import annotations

from pathlib import Path

import yaml


def _line(lines: list[str], number: int) -> str:
    """Line `number` (1-based) without its newline, or '' past the end."""
    return lines[number - 1].rstrip("\r\n") if 0 < number <= len(lines) else ""


def _mark_past_the_mistake(lines: list[str], line: int, column: int) -> bool:
    """Whether the parser stopped where nothing before it on its line can be wrong: at the line's first
    non-blank character, on an empty line or past the end of the file."""
    text = _line(lines, line)
    return not text.strip() or column <= len(text) - len(text.lstrip())


def _previous_content_line(lines: list[str], line: int) -> int | None:
    """The last line before `line` that holds something other than blanks or a comment."""
    for number in range(min(line, len(lines) + 1) - 1, 0, -1):
        stripped = _line(lines, number).strip()
        if stripped and not stripped.startswith("#"):
            return number
    return None


def yaml_error_message(path: str | Path, text: str, err: yaml.YAMLError) -> str:
    """The user-facing message for a YAML error in `text` (the file at `path`): location, problem, the lines
    to look at with the parser's stop marked, and a fix line."""
    mark = getattr(err, "problem_mark", None)
    problem = getattr(err, "problem", None) or str(err).splitlines()[0]
    if mark is None:
        return f"{path}: invalid YAML: {problem}\n  fix: check indentation and quoting"
    lines = text.splitlines()
    line, column = mark.line + 1, mark.column  # column: 0-based, as in the mark
    if "'\\t'" in problem or "\t" in problem:  # a tab: the parser names the character, the user needs the line
        return "\n".join([f"{path}:{line}:{column + 1}: invalid YAML: a tab where YAML takes only spaces",
                          f"    {line} | {_line(lines, line).replace(chr(9), '<tab>')}",
                          f"  fix: indent line {line} with spaces (keys of one section share one indentation)"])
    culprits: list[int] = []
    context = getattr(err, "context_mark", None)
    # Only a token's start is worth naming (an open quote or bracket, a key); "while parsing a block mapping"
    # points at the section's first line, which is seldom where the mistake is.
    about_a_token = any(word in (getattr(err, "context", None) or "") for word in ("scanning", "flow"))
    if context is not None and about_a_token and context.line + 1 < line:
        culprits.append(context.line + 1)
    # "expected <block end>": a line indented off; the mark is on that very line.
    if "<block end>" not in problem and _mark_past_the_mistake(lines, line, column):
        previous = _previous_content_line(lines, line)
        if previous is not None and previous not in culprits:
            culprits.append(previous)
    # "mapping values are not allowed here" on a key's colon: a line before it without its own colon ran on into
    # this one as one plain value (`family sd` above `name_or_path: ...`)
    if "mapping values are not allowed" in problem:
        previous = _previous_content_line(lines, line)
        if previous is not None and ":" not in _line(lines, previous) and previous not in culprits:
            culprits.append(previous)
    culprits.sort()
    width = len(str(max([line, *culprits])))
    shown = [f"    {n:>{width}} | {_line(lines, n)}" for n in culprits if n != line]
    if line <= len(lines):
        shown.append(f"    {line:>{width}} | {_line(lines, line)}")
        shown.append(f"    {'':>{width}}   {' ' * column}^ the parser stopped here")
    else:
        shown.append("    (the parser stopped at the end of the file)")
    if culprits:
        named = " or ".join(f"line {n}" for n in culprits)
        head = f"{path}:{culprits[0]}: invalid YAML: {problem} (noticed at line {line}, column {column + 1})"
        fix = (f"  fix: look at {named}: a key needs ':' after it, quotes and brackets must close, and keys of one "
               "section share one indentation")
    else:
        head = f"{path}:{line}:{column + 1}: invalid YAML: {problem}"
        fix = "  fix: check that line: its indentation (keys of one section share one), quotes and brackets"
    return "\n".join([head, *shown, fix])
