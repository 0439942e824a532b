"""Caption rules: trigger word, default caption, tag shuffle with kept tokens, caption dropout."""

from __future__ import annotations

import random

from toolkit.data.captions import CaptionRules, apply_trigger, shuffle_tags


def test_trigger_word_replaces_the_placeholder_or_is_prepended():
    assert apply_trigger("a photo of [trigger] dog", "sks") == "a photo of sks dog"
    assert apply_trigger("a dog", "sks") == "sks, a dog"
    assert apply_trigger("sks dog", "sks") == "sks dog"
    assert apply_trigger("a [trigger] dog", None) == "a dog"
    assert apply_trigger("", "sks") == "sks"


def test_default_caption_fills_missing_ones_before_the_trigger():
    rules = CaptionRules(trigger_word="sks", default_caption="a toy")
    assert rules.base(None) == "sks, a toy"
    assert rules.base("  ") == "sks, a toy"
    assert rules.base("a red [trigger]\n") == "a red sks"
    assert not rules.varies


def test_shuffle_keeps_the_leading_tags_and_every_tag():
    text = "keep1, keep2, a, b, c, d, e, f"
    outs = {shuffle_tags(text, 2, random.Random(seed)) for seed in range(20)}
    assert len(outs) > 5
    for out in outs:
        tags = out.split(", ")
        assert tags[:2] == ["keep1", "keep2"] and sorted(tags[2:]) == ["a", "b", "c", "d", "e", "f"]


def test_vary_keeps_the_trigger_first_and_drops_captions_at_the_given_rate():
    rules = CaptionRules(trigger_word="sks", shuffle_tags=True, keep_tokens=0, caption_dropout=0.25)
    assert rules.varies
    rng = random.Random(0)
    outs = [rules.vary(rules.base("a, b, c"), rng) for _ in range(400)]
    dropped = sum(o == "" for o in outs)
    assert 70 <= dropped <= 130, dropped
    assert all(o.startswith("sks, ") for o in outs if o)
