"""Caption rules: trigger word, default caption, tag shuffle with kept leading tags, caption dropout."""

from __future__ import annotations

import random
from dataclasses import dataclass

TRIGGER = "[trigger]"


def apply_trigger(text: str, trigger_word: str | None) -> str:
    """Replace [trigger] with the trigger word; prepend it when the text does not contain it."""
    if not trigger_word:
        return " ".join(text.replace(TRIGGER, "").split())
    if TRIGGER in text:
        return text.replace(TRIGGER, trigger_word)
    if trigger_word in text:
        return text
    return f"{trigger_word}, {text}" if text else trigger_word


def shuffle_tags(text: str, keep_tokens: int, rng: random.Random) -> str:
    """Shuffle the comma-separated tags after the first `keep_tokens` ones."""
    tags = [t.strip() for t in text.split(",")]
    head, tail = tags[:keep_tokens], tags[keep_tokens:]
    rng.shuffle(tail)
    return ", ".join(t for t in head + tail if t)


@dataclass(frozen=True)
class CaptionRules:
    trigger_word: str | None = None
    default_caption: str = ""
    caption_dropout: float = 0.0
    shuffle_tags: bool = False
    keep_tokens: int = 0

    @property
    def varies(self) -> bool:
        """True when the same image gets different captions across epochs (text embeddings cannot be cached)."""
        return self.shuffle_tags or self.caption_dropout > 0

    def base(self, raw: str | None) -> str:
        """The fixed part: default caption for a missing/empty one, then the trigger word."""
        text = (raw or "").strip() or self.default_caption
        return apply_trigger(text, self.trigger_word)

    def vary(self, text: str, rng: random.Random) -> str:
        """The per-step part: tag shuffle, then caption dropout (an empty caption)."""
        if self.shuffle_tags:
            keep = self.keep_tokens + (1 if self.trigger_word and text.startswith(f"{self.trigger_word},") else 0)
            text = shuffle_tags(text, keep, rng)
        if self.caption_dropout > 0 and rng.random() < self.caption_dropout:
            return ""
        return text
