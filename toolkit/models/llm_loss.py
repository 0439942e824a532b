"""The `llm` family's fused loss: the decoder's last hidden states go straight into the chunked output head +
cross-entropy (toolkit/kernels/linear_cross_entropy.py), so the tokens x vocabulary logits are never held.

It replaces the causal LM's own forward after the decoder, so it is used only for the model types whose
forward this file has been checked against (transformers 5): `logits = lm_head(hidden)`, then a scale or a
tanh soft-cap for the few that have one, then transformers' causal-LM loss. Anything else keeps the model's
own loss, and the log says why.
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from typing import Any, Callable, Iterator

import torch

from toolkit.kernels.linear_cross_entropy import (COMPILED_CHUNK_ELEMENTS, IGNORE_INDEX, HeadMath, chunk_loss_and_grad,
                                                  chunk_rows, compiled_step, linear_cross_entropy)
from toolkit.kernels.sharded_cross_entropy import sharded_linear_cross_entropy
from toolkit.models.base import is_sharded

# model_type -> what its CausalLM forward does to lm_head's output (read from the config)
HEAD_MATH: dict[str, Callable[[Any], HeadMath]] = {
    **{name: (lambda config: HeadMath()) for name in (
        "llama", "mistral", "qwen2", "qwen3", "gemma", "phi", "phi3", "olmo", "olmo2", "smollm3", "starcoder2",
        "glm4")},
    "gemma2": lambda config: HeadMath(softcap=config.final_logit_softcapping),
    "gemma3_text": lambda config: HeadMath(softcap=config.final_logit_softcapping),
    "cohere": lambda config: HeadMath(scale=float(config.logit_scale)),
    "granite": lambda config: HeadMath(scale=1.0 / float(config.logits_scaling)),
}


# Decoder-only causal LMs whose forward was checked (the list above): a token attends to earlier tokens only
# (sliding windows included), so in a right-padded batch no token the loss counts attends to a padding token.
CAUSAL_DECODERS = frozenset(HEAD_MATH)


@contextmanager
def no_packed_sequence_search() -> Iterator[None]:
    """For batches that are known not to be packed (right-padded, no position_ids): transformers builds a causal
    LM's mask without asking whether the rows hold several samples each. Without an attention mask it otherwise
    looks for packed samples in the position ids it made itself, and `.all()` on that device tensor makes the
    host wait for the GPU every step (masking_utils.find_packed_sequence_indices, transformers 5). Its answer
    for such a batch is always None ("not packed"), which is what this returns, without the wait."""
    from transformers import masking_utils

    search = getattr(masking_utils, "find_packed_sequence_indices", None)
    if search is None:  # a transformers without it: nothing to skip
        yield
        return
    masking_utils.find_packed_sequence_indices = lambda position_ids: None
    try:
        yield
    finally:
        masking_utils.find_packed_sequence_indices = search


class DecoderHiddenStates(torch.nn.Module):
    """The LoRA model up to its decoder's last hidden states (after the final norm). A module of its own so
    that the process wrapper (DDP) wraps the forward that actually runs.

    `through_model` (device.distributed=fsdp): the whole causal LM's forward runs, so that FSDP's hooks on the
    model gather the weights its own unit holds (the final norm; tied embeddings), and the decoder's output is
    taken with a forward hook. An output head sharded by rows (a unit of its own) is left out of that forward,
    so it is never gathered (the loss walks its shards, row_sharded); any other computes the logits of the last
    position only (`logits_to_keep=1`)."""

    def __init__(self, network: torch.nn.Module, through_model: bool = False):
        super().__init__()
        self.network, self.through_model = network, through_model

    def forward(self, **batch) -> torch.Tensor:
        decoder = self.network.get_base_model().get_decoder()
        if not self.through_model:
            return decoder(**batch, use_cache=False).last_hidden_state
        base = self.network.get_base_model()
        captured = []
        hook = decoder.register_forward_hook(lambda module, args, out: captured.append(out.last_hidden_state))
        try:
            with without_head(base) if row_sharded(base.get_output_embeddings()) else nullcontext():
                self.network(**batch, use_cache=False, logits_to_keep=1)
        finally:
            hook.remove()
        return captured[-1]


class _NoLogits(torch.nn.Module):
    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden[..., :0]


@contextmanager
def without_head(model: torch.nn.Module) -> Iterator[None]:
    """The causal LM with an empty output head for the block: its forward computes no logits and gathers no head."""
    head = model.get_output_embeddings()
    model.set_output_embeddings(_NoLogits())
    try:
        yield
    finally:
        model.set_output_embeddings(head)


def row_sharded(head: torch.nn.Module | None) -> bool:
    """Whether `head` is an FSDP2 unit of its own whose frozen weight is sharded by rows, with no bias: the
    fused loss then walks its shards (kernels/sharded_cross_entropy.py) instead of gathering it."""
    if head is None or not is_sharded(head) or getattr(head, "bias", None) is not None:
        return False
    weight = getattr(head, "weight", None)
    placements = getattr(weight, "placements", None)
    return (weight is not None and not weight.requires_grad and placements is not None and len(placements) == 1
            and placements[0].is_shard(0))


@contextmanager
def gathered(module: torch.nn.Module) -> Iterator[None]:
    """An FSDP2 unit's weights whole for the block (the output head as a unit of its own, device.distributed=fsdp),
    sharded again after; any other module as it is."""
    if not is_sharded(module):
        yield
        return
    module.unshard()
    try:
        yield
    finally:
        module.reshard()


class FusedCausalLMLoss:
    """Sum of the token losses of a causal LM from its hidden states, shifted as transformers shifts them."""

    def __init__(self, head: torch.nn.Linear, math_: HeadMath, compiled: bool, checkpointing: bool = False):
        self.head, self.math, self.chunk = head, math_, None
        self.step = compiled_step() if compiled else chunk_loss_and_grad
        if compiled and not checkpointing:
            self.chunk = chunk_rows(head.weight.shape[0], COMPILED_CHUNK_ELEMENTS)

    def save_memory(self) -> None:
        """Chunks of the default length, for runs that trade speed for memory (gradient checkpointing): longer
        compiled chunks hold 0.37 GiB more at the peak on a 128k vocabulary (COMPILED_CHUNK_ELEMENTS)."""
        self.chunk = None

    def __call__(self, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """`labels` as the batch has them on the host: which tokens count is found there, so the step never
        waits for the device to say how many there are. The head's weight is used in this forward only (the
        gradient for the hidden states is computed here), so a sharded head is gathered just for this call, or
        not at all where its shards can be walked (row_sharded)."""
        shifted = labels[:, 1:].reshape(-1)
        rows = torch.nonzero(shifted != IGNORE_INDEX).squeeze(1)
        device = hidden.device
        to_device = lambda t: (t.pin_memory() if device.type == "cuda" else t).to(device, non_blocking=True)  # noqa: E731
        if row_sharded(self.head):
            weight = self.head.weight
            return sharded_linear_cross_entropy(hidden[:, :-1].reshape(-1, hidden.shape[-1]), weight.to_local(),
                                                weight.shape[0], to_device(shifted), to_device(rows),
                                                group=weight.device_mesh.get_group(), math_=self.math)
        with gathered(self.head):
            return linear_cross_entropy(hidden[:, :-1].reshape(-1, hidden.shape[-1]), self.head.weight,
                                        to_device(shifted), bias=self.head.bias, math_=self.math, step=self.step,
                                        chunk=self.chunk, rows=to_device(rows))


def fused_loss_for(network: torch.nn.Module, setting: str, compiled: bool, builtin: bool,
                   checkpointing: bool = False, sharded: bool = False) -> tuple[FusedCausalLMLoss | None, str]:
    """The fused loss for this PEFT model, or None and why not (for the log)."""
    if setting != "fused":
        return None, ""
    base = network.get_base_model()
    model_type = getattr(base.config, "model_type", "?")
    head = base.get_output_embeddings()
    reason = None
    if not builtin:
        reason = "the model's code is not transformers' own (trust_remote_code)"
    elif model_type not in HEAD_MATH:
        reason = f"its forward ({model_type}) has not been checked against the fused loss"
    elif type(head) is not torch.nn.Linear or type(head.weight) is not torch.nn.Parameter:
        reason = f"its output head is a {type(head).__name__} (a LoRA target or quantized), not a plain Linear"
    if reason:
        return None, f"model.kernels=fused: {reason}; the model's own loss is used"
    return (FusedCausalLMLoss(head, HEAD_MATH[model_type](base.config), compiled, checkpointing),
            f"model.kernels=fused: output head and cross-entropy in chunks, no full logits"
            f"{' (compiled)' if compiled else ''}"
            + ("; an output head sharded as a unit of its own is read block by block from the processes' shards, "
               "never gathered whole" if sharded else ""))
