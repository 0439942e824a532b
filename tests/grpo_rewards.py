"""A reward for the GRPO tests, imported as train.reward=grpo_rewards:low_token_share (TRL's call signature)."""


def low_token_share(prompts, completions, completion_ids, **columns) -> list[float]:
    """The share of a completion's tokens whose id is below 150: dense, varied within a group on a random model,
    and learnable by a LoRA in a few steps (the head's bias towards one part of the vocabulary)."""
    return [sum(token < 150 for token in ids) / len(ids) for ids in completion_ids]


def high_token_share(prompts, completions, completion_ids, **columns) -> list[float]:
    """low_token_share's opposite: the share of tokens with an id of 150 or more."""
    return [1.0 - share for share in low_token_share(prompts, completions, completion_ids)]
