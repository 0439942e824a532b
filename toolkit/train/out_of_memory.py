"""Out of memory in the middle of a run: what was kept, and what to change.

The trainer saves the state of the last completed step first (train/trainer.py `_out_of_memory`), then stops with
a UserError built here: the step, what was running and on which batch shapes, where the state is, and the fixes,
split into those a resume takes (resume-safe settings: run the same command with them) and those that change what
the run learns (they need --fresh)."""

from __future__ import annotations

from toolkit.errors import UserError
from toolkit.optim import optimizer_spec
from toolkit.train.resume import is_resume_safe


def batch_shapes(batch: dict) -> str:
    """A batch's tensors as `name 4x77x768`, the first four (what a user compares with their data settings)."""
    shapes = [f"{name} {'x'.join(str(n) for n in value.shape) or 'scalar'}" for name, value in batch.items()
              if hasattr(value, "shape")]
    return ", ".join(shapes[:4]) + (f" and {len(shapes) - 4} more" if len(shapes) > 4 else "")


def memory_fixes(cfg, setting, batch_size: int, grad_accum: int, model_fixes: list[str]) -> list[str]:
    """The remedies that apply to this run, each `key=value (why)`; `setting(key)` is the value the run uses."""
    t, fixes = cfg.train, []
    checkpointing = setting("train.gradient_checkpointing")
    if checkpointing is not True:  # off, or N of the blocks
        fixes.append("train.gradient_checkpointing=true (blocks recompute their activations in backward)")
    elif setting("train.checkpoint_keeps") == "attention":
        fixes.append("train.checkpoint_keeps=nothing (checkpointed blocks recompute their attention too)")
    fixes += model_fixes
    fraction = cfg.device.memory_fraction
    if fraction > 0.6:
        fixes.append(f"device.memory_fraction={fraction - 0.1:.2f} (the auto memory settings plan with less of the "
                     "device)")
    if batch_size > 1 and t.global_batch_size is not None:
        fixes.append(f"train.batch_size={max(1, batch_size // 2)} (train.global_batch_size keeps the batch per "
                     "optimizer step)")
    elif batch_size > 1:
        fixes.append(f"train.batch_size={max(1, batch_size // 2)} train.grad_accum={grad_accum * 2} (the same batch "
                     "per optimizer step)")
    if not optimizer_spec(t.optimizer).memory_light:
        fixes.append("train.optimizer=adamw8bit (8-bit optimizer state)")
    return fixes or ["a smaller model, or a lower data.max_seq_len / data.resolution"]


def out_of_memory_error(step: int, doing: str, shapes: str | None, device: str, kept: str,
                        fixes: list[str]) -> UserError:
    """The message: `doing` says what ran out (the step's forward and backward, the update, sampling, ...), `kept`
    what is saved, `fixes` as memory_fixes gives them."""
    resumable = [f for f in fixes if "=" in f.split(" ")[0] and all(
        is_resume_safe(part.split("=")[0]) for part in f.split(" (")[0].split())]
    fresh = [f for f in fixes if f not in resumable]
    lines = [f"out of memory at step {step} on {device}, in {doing}"
             + (f" (batch: {shapes})" if shapes else "") + f"\n  {kept}"]
    if resumable:
        lines.append("  fix (then run the same command with it: the run resumes): " + resumable[0])
        lines += [f"  or: {f}" for f in resumable[1:]]
    if fresh:
        lines.append(("  or, starting over (--fresh): " if resumable else "  fix (starting over: --fresh): ")
                     + fresh[0])
        lines += [f"  or: {f}" for f in fresh[1:]]
    return UserError("\n".join(lines))
