"""Settings that differ between a checkpoint's config and a resumed run's but change nothing the run learns, settled
before the resume check compares the two (resume.check_resume_config):

- settings read only when a run starts (network.init: the LoRA's first values; a resumed run's LoRA comes from
  its checkpoint);
- frame settings that no dataset's data.frame_extraction mode reads (data_schemas.FRAME_EXTRACTION_SETTINGS): a
  run begun before preflight refused them may hold one, and the key it must now drop would otherwise be a change.

Each settled difference is said; the checkpoint's config (a dict) takes the current value so the check sees none.
"""

from __future__ import annotations

from typing import Callable

from toolkit.config.data_schemas import FRAME_EXTRACTION_SETTINGS, modes_reaching

READ_AT_START = ("network.init",)


def settle_unread(saved: dict, current: dict, notice: Callable[[str], None]) -> None:
    """Give `saved` the current value of every setting above that differs without effect, saying each."""
    for key in READ_AT_START:
        section, name = key.split(".")
        before, after = saved.get(section, {}).get(name), current.get(section, {}).get(name)
        if before is not None and after is not None and before != after:
            notice(f"resume: {key} is {after!r} now, {before!r} when the run began: it is read when a run starts, "
                   "and this run's LoRA comes from its checkpoint")
            saved[section][name] = after
    _settle_frame_settings(saved.get("data"), current.get("data"), notice)


def _settle_frame_settings(saved: dict | None, current: dict | None, notice: Callable[[str], None]) -> None:
    if not (isinstance(saved, dict) and isinstance(current, dict) and "frame_extraction" in saved):
        return
    for key, readers in FRAME_EXTRACTION_SETTINGS.items():
        if key in saved and saved[key] != current.get(key) and not (_read_at_top(saved, key, readers)
                                                                    or _read_at_top(current, key, readers)):
            notice(f"resume: data.{key} was {saved[key]!r} when the run began; data.frame_extraction="
                   f"{saved['frame_extraction']} did not read it, so leaving it out changes nothing")
            saved[key] = current.get(key, saved[key])
        old_entries, new_entries = _entries(saved), _entries(current)
        for n, (old, new) in enumerate(zip(old_entries, new_entries)):
            if old.get(key) == new.get(key) or old.get(key) is None:
                continue
            modes = {entry.get("frame_extraction") or top.get("frame_extraction")
                     for entry, top in ((old, saved), (new, current))}
            if not modes & set(readers):
                notice(f"resume: data.datasets[{n}].{key} was {old[key]!r} when the run began; its frame_extraction "
                       f"({', '.join(sorted(str(m) for m in modes))}) did not read it, so leaving it out changes "
                       "nothing")
                if key in new:
                    old[key] = new[key]
                else:
                    del old[key]


def _entries(data: dict) -> list:
    entries = data.get("datasets")
    return [e for e in entries if isinstance(e, dict)] if isinstance(entries, list) else []


def _read_at_top(data: dict, key: str, readers: tuple[str, ...]) -> bool:
    """Whether data.<key> is read by a mode it reaches (as preflight.unread_frame_settings decides)."""
    return any(mode in readers for _, mode in modes_reaching(key, data.get("frame_extraction"), _entries(data)))
