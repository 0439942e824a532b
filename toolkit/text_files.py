"""Reading the user's text files (config YAML, JSONL/JSON/TXT data, captions, metadata.jsonl) by one rule.

- UTF-8 is read as is.
- A UTF-8 byte-order mark is dropped, and a UTF-16 file (it starts with its byte-order mark, as Windows
  Notepad writes "Unicode") is decoded as UTF-16; both with a note naming the file.
- Anything else that is not UTF-8 (a binary file, Latin-1 or cp1252 text) is a UserError naming the file,
  line and column and how to convert it. There is no silent guess at a legacy encoding: a wrong guess would
  train on garbled text without a word.
"""

from __future__ import annotations

import codecs
import os
import sys
from pathlib import Path

from toolkit.errors import UserError

_BOMS = ((codecs.BOM_UTF8, "utf-8-sig", "a UTF-8 byte-order mark: read as UTF-8 without it"),
         (codecs.BOM_UTF16_LE, "utf-16", "a UTF-16 byte-order mark: decoded as UTF-16"),
         (codecs.BOM_UTF16_BE, "utf-16", "a UTF-16 byte-order mark: decoded as UTF-16"))


_NOTES_SHOWN = 3
_notes = 0


def _note(message: str) -> None:
    """A note on stderr, from the main process only (every process reads the same files); after the first few
    (a folder of captions saved with a BOM), one line says that more were not shown."""
    global _notes
    _notes += 1
    if os.environ.get("RANK", "0") != "0" or _notes > _NOTES_SHOWN + 1:
        return
    text = message if _notes <= _NOTES_SHOWN else "more files with byte-order marks were read the same way"
    print(f"note: {text}", file=sys.stderr, flush=True)


def decode_text(raw: bytes, path: str | Path, key: str = "") -> str:
    """The text of a file's bytes by the rule above; `key` (a config key) is named in the error."""
    for bom, encoding, what in _BOMS:
        if raw.startswith(bom):
            try:
                text = raw.decode(encoding)
            except UnicodeDecodeError:
                break  # a BOM followed by something else: reported below as not UTF-8
            _note(f"{path} starts with {what}")
            return text
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise _not_utf8(raw, err.start, path, key) from None


def read_text(path: str | Path, key: str = "") -> str:
    """The text of the file at `path` (which must exist) by the rule above."""
    try:
        raw = Path(path).read_bytes()
    except OSError as err:
        prefix = f"{key}: " if key else ""
        raise UserError(f"{prefix}cannot read {path}: {err.strerror or err}\n  fix: check the file's permissions") from None
    return decode_text(raw, path, key)


def _not_utf8(raw: bytes, offset: int, path: str | Path, key: str) -> UserError:
    line = raw.count(b"\n", 0, offset) + 1
    column = offset - (raw.rfind(b"\n", 0, offset) + 1) + 1
    prefix = f"{key}: " if key else ""
    if b"\x00" in raw[:8192]:
        return UserError(f"{prefix}{path} is a binary file, not text (it holds NUL bytes; the first byte that is "
                         f"not UTF-8 is at line {line}, column {column})\n  fix: point the setting at a UTF-8 text file")
    return UserError(f"{prefix}{path}:{line}:{column}: not UTF-8 (byte 0x{raw[offset]:02x}); the toolkit reads text "
                     "files as UTF-8\n  fix: save the file as UTF-8, e.g. iconv -f cp1252 -t utf-8 FILE > NEW "
                     "(use the file's real encoding in place of cp1252)")
