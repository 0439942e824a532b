"""The data folder's captions at the start of a run: files without a caption, caption files without a file, and
the caption an uncaptioned file trains with.

A caption belongs to the files of the same name (stem): `cat.png` + `cat.txt`; for image-to-video `clip.mp4`,
its start image `clip.png` and `clip.txt` share one. With a metadata.jsonl, its records give the captions and
caption files beside it are not read.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from toolkit.data.captions import CaptionRules

SHOWN = 5  # names listed per kind of problem; the count says how many more


def _names(names: list[str]) -> str:
    more = len(names) - SHOWN
    return ", ".join(names[:SHOWN]) + (f" and {more} more" if more > 0 else "")


def _plural(count: int, noun: str) -> str:
    return f"{count} {noun}{'s' if count != 1 else ''}"


def fallback_caption(rules: CaptionRules) -> str:
    """What a file without a caption trains with, and which settings made it."""
    text = rules.base(None)
    if not text:
        return ("the empty caption (data.default_caption and data.trigger_word are unset): it learns the images "
                "without words; set data.default_caption or write the caption files")
    if rules.default_caption.strip():
        made = "data.default_caption" + (" with data.trigger_word" if rules.trigger_word else "")
    else:
        made = "data.trigger_word alone; data.default_caption is empty"
    return f'the caption "{text}" ({made})'


def report_captions(root: Path, pairs: list[tuple[Path, str | None]], caption_ext: str, rules: CaptionRules,
                    noun: str, log: Callable[[str], None]) -> None:
    """Log the caption report of `pairs` ((file, caption text or None), captioned_files' answer) under `root`."""
    metadata = (root / "metadata.jsonl").is_file()
    by_stem: dict[str, list[tuple[Path, str | None]]] = {}
    for path, caption in pairs:
        if not path.is_file():
            continue  # a metadata.jsonl record without its file: named with the unreadable files
        by_stem.setdefault(path.stem if not metadata else str(path), []).append((path, caption))
    without = []
    for files in by_stem.values():
        caption = files[0][1]
        if caption is None or not caption.strip():
            without.append(files[0][0].name + ("" if caption is None else " (empty)"))
    captioned = len(by_stem) - len(without)
    source = "metadata.jsonl" if metadata else f"{caption_ext} files"
    log(f"data: {_plural(len(by_stem), noun)} in {root}, {captioned} with a caption ({source}), "
        f"{len(without)} without")
    if without:
        level = "note" if rules.default_caption.strip() else "warning"
        where = "no text in metadata.jsonl" if metadata else f"no {caption_ext} beside, or an empty one"
        log(f"{level}: {_plural(len(without), noun)} without a caption ({where}): {_names(without)}; "
            f"{'it trains' if len(without) == 1 else 'they train'} with {fallback_caption(rules)}")
    stray_files = sorted(p.name for p in root.glob(f"*{caption_ext}") if p.is_file() and not p.name.startswith("."))
    if metadata:
        if stray_files:
            log(f"note: {_plural(len(stray_files), caption_ext + ' file')} in {root} not read: metadata.jsonl gives the "
                f"captions ({_names(stray_files)})")
        return
    stray = [name for name in stray_files if Path(name).stem not in by_stem]
    if stray:
        article = "an" if noun[0] in "aeiou" else "a"
        log(f"warning: {_plural(len(stray), 'caption file')} without {article} {noun} of the same name, not used: "
            f"{_names(stray)} (a caption names its {noun} by its name: cat{caption_ext} for cat.png)")
