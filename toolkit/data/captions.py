"""Caption rules: trigger word, default caption, and the per-step edits (caption dropout, tag shuffle with kept
leading tags, tag dropout) drawn from a generator the caller seeds (toolkit/data/augment.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

TRIGGER = "[trigger]"


class Draws(Protocol):
    """What the caption edits draw from: numpy's Generator and Python's random.Random both have these."""

    def random(self) -> float: ...

    def shuffle(self, x: list) -> None: ...


def apply_trigger(text: str, trigger_word: str | None) -> str:
    """Replace [trigger] with the trigger word; prepend it when the text does not contain it."""
    if not trigger_word:
        return " ".join(text.replace(TRIGGER, "").split())
    if TRIGGER in text:
        return text.replace(TRIGGER, trigger_word)
    if trigger_word in text:
        return text
    return f"{trigger_word}, {text}" if text else trigger_word


def edit_tags(text: str, keep_tokens: int, rng: Draws, shuffle: bool = True, dropout: float = 0.0) -> str:
    """The comma-separated tags after the first `keep_tokens` shuffled, then each left out with probability
    `dropout` (kohya's order)."""
    tags = [t.strip() for t in text.split(",")]
    head, tail = tags[:keep_tokens], tags[keep_tokens:]
    if shuffle:
        rng.shuffle(tail)
    if dropout > 0:
        tail = [t for t in tail if rng.random() >= dropout]
    return ", ".join(t for t in head + tail if t)


def shuffle_tags(text: str, keep_tokens: int, rng: Draws) -> str:
    """Shuffle the comma-separated tags after the first `keep_tokens` ones."""
    return edit_tags(text, keep_tokens, rng)


@dataclass(frozen=True)
class CaptionRules:
    trigger_word: str | None = None
    default_caption: str = ""
    caption_dropout: float = 0.0
    shuffle_tags: bool = False
    keep_tokens: int = 0
    tag_dropout: float = 0.0

    @property
    def varies(self) -> bool:
        """True when the same image gets different captions across epochs."""
        return self.per_step or self.caption_dropout > 0

    @property
    def per_step(self) -> bool:
        """True when a caption's words change between epochs (tag shuffle or tag dropout): there are too many
        variants to cache their text embeddings, so they are computed every step."""
        return self.shuffle_tags or self.tag_dropout > 0

    def base(self, raw: str | None) -> str:
        """The fixed part: default caption for a missing/empty one, then the trigger word."""
        text = (raw or "").strip() or self.default_caption
        return apply_trigger(text, self.trigger_word)

    def dropped(self, rng: Draws) -> bool:
        """Whether this draw trains on the empty caption: the first draw of every caption, so the cached-text
        path (which draws only this) and the per-step path drop the same samples."""
        return self.caption_dropout > 0 and rng.random() < self.caption_dropout

    def vary(self, text: str, rng: Draws) -> str:
        """The per-step part: caption dropout (an empty caption), else tag shuffle and tag dropout."""
        if self.dropped(rng):
            return ""
        if self.per_step:
            keep = self.keep_tokens + (1 if self.trigger_word and text.startswith(f"{self.trigger_word},") else 0)
            text = edit_tags(text, keep, rng, self.shuffle_tags, self.tag_dropout)
        return text
