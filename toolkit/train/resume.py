"""Deciding whether a run resumes, from which checkpoint, and which changed settings it accepts."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Callable, Iterator

from toolkit.config.families import FAMILY_SPECS, applies_to
from toolkit.config.layers import upgrade_renamed
from toolkit.config.load import flatten, schema_defaults, schema_for
from toolkit.config.local_paths import adopt_recorded_paths
from toolkit.config.schema import RunConfig
from toolkit.errors import UserError
from toolkit.train.checkpoint import (Checkpoint, find_latest_checkpoint, list_checkpoints, load_checkpoint_state,
                                      verify_checkpoint)
from toolkit.train.resume_unread import READ_AT_START, settle_unread
from toolkit.train.run_dir import RunDir


def _schema_sections() -> Iterator[tuple[str, type]]:
    """(section name, dataclass) of every config section, the data section once per family data schema."""
    for section in dataclasses.fields(RunConfig):
        if section.name == "data":
            yield from (("data", schema) for schema in dict.fromkeys(s.data_schema for s in FAMILY_SPECS.values()))
        else:
            yield section.name, section.default_factory


def _resume_safe() -> tuple[frozenset[str], frozenset[str]]:
    """The settings a resumed run may change (fields marked resume_safe in the schema: they alter cadence, output
    or where the run goes, not what it learns), and the sections whose every setting is."""
    keys, sections, partly = set(), set(), set()
    for name, schema in _schema_sections():
        for f in dataclasses.fields(schema):
            if f.metadata.get("resume_safe"):
                keys.add(f"{name}.{f.name}")
            else:
                partly.add(name)
        sections.add(name)
    return frozenset(keys), frozenset(sections - partly)


RESUME_SAFE_KEYS, RESUME_SAFE_SECTIONS = _resume_safe()


def is_resume_safe(key: str) -> bool:
    """Whether a resumed run may change dotted `key`; in a section where every setting may (device, save, sample,
    log), so may one that the toolkit has dropped since the run began."""
    return key in RESUME_SAFE_KEYS or key.split(".", 1)[0] in RESUME_SAFE_SECTIONS


def config_changes(old: dict, new: dict, processes: tuple[int, int] = (1, 1)) -> tuple[list[str], list[str]]:
    """(allowed notices, refused keys) between the checkpoint's config and the current one.

    `processes` is (the checkpoint's, this run's) number of processes: train.batch_size may change with
    it as long as the global batch (batch_size x processes) stays the same.

    A key the checkpoint's config lacks (a setting added to the toolkit since the run began) is accepted
    while it keeps its default, which reproduces what the older toolkit did. Settings the run's family does
    not read are ignored: older run folders wrote every family's."""
    old_flat, new_flat = dict(flatten(old)), dict(flatten(new))
    family = new.get("model", {}).get("family")
    defaults = schema_defaults(family)
    keys = set(old_flat) | set(new_flat)
    if family in FAMILY_SPECS:
        keys = {key for key in keys if applies_to(key, family)}
    allowed, refused = [], []
    for key in sorted(keys):
        before, after = old_flat.get(key), new_flat.get(key)
        if before == after:
            continue
        if key not in old_flat and key in defaults and after == defaults[key]:
            allowed.append(f"{key}: new setting, at its default {after!r}")
        elif is_resume_safe(key):
            allowed.append(f"{key}: {before!r} -> {after!r}")
        elif (key == "train.batch_size" and processes[0] != processes[1] and isinstance(before, int)
              and isinstance(after, int) and before * processes[0] == after * processes[1]):
            allowed.append(f"{key}: {before!r} -> {after!r} ({processes[0]} -> {processes[1]} processes, "
                           f"global batch {after * processes[1]} unchanged)")
        else:
            refused.append(f"{key}: {before!r} in the checkpoint, {after!r} now")
    return allowed, refused


def checkpoint_processes(checkpoint: Checkpoint) -> int:
    """How many processes trained the run up to `checkpoint` (checkpoints from before multi-process: 1)."""
    state = load_checkpoint_state(checkpoint.path / "trainer_state.pt")
    return int(state.get("world_size", 1))


# A refused resume suggests starting over from the checkpoint's LoRA (network.init_from) unless what changed is
# one of these: a LoRA does not carry over to another model, rank or type, and init_from is then what changed.
INIT_FROM_FIXED = frozenset({"model.family", "model.name_or_path", "model.revision", "network.rank", "network.type",
                             "network.lokr_factor", "network.lokr_full_rank", "network.init_from"})


def adopt_moved_init_from(saved: dict, current: dict) -> None:
    """A run started with --fresh from a LoRA inside its own folder recorded where --fresh moved that LoRA
    (<run>.old-<time>/..., train/run_start.py follow_moved_init_from), while the command that started it, run again
    to resume, still names <run>/...: the same file. In `saved`, that moved path is replaced by the command's."""
    before = saved.get("network", {}).get("init_from")
    after, root = current.get("network", {}).get("init_from"), current.get("run", {}).get("output_dir")
    if not (isinstance(before, str) and isinstance(after, str) and isinstance(root, str)) or before == after:
        return
    root, before_path, after_path = Path(root), Path(before), Path(after)
    if not after_path.is_relative_to(root) or before_path.parent == before_path:
        return
    aside = re.compile(re.escape(root.name) + r"\.old-\d{8}-\d{6}(-\d+)?")
    for top in before_path.parents:
        if top.parent == root.parent and aside.fullmatch(top.name):
            if before_path.relative_to(top) == after_path.relative_to(root):
                saved["network"]["init_from"] = after
            return


def check_resume_config(checkpoint: Checkpoint, saved: dict, current: dict, notice: Callable[[str], None],
                        processes: int = 1) -> None:
    """Refuse to resume from `checkpoint` when the settings it trained with (`saved`) and this run's (`current`)
    differ in what the run learns; say what changed otherwise."""
    upgrade_renamed(saved)  # settings renamed since the checkpoint was written compare under their new names
    family, trained = current.get("model", {}).get("family"), saved.get("model", {}).get("family")
    if trained != family:  # every other difference follows from this one
        asked = current.get("train", {}).get("resume")
        fix = (f"give train.resume a checkpoint of a {family} run, or remove it" if isinstance(asked, str)
               and asked != "auto" else "set run.output_dir to a new folder, or start over with --fresh (the old run "
               "is moved aside, not deleted)")
        raise UserError(f"cannot resume from {checkpoint.path}: it is a checkpoint of a {trained} run, and this run "
                        f"trains {family}\n  fix: {fix}")
    for line in adopt_recorded_paths(saved, current, schema_for(current.get("model", {}).get("family"))):
        notice(f"resume: {line}")
    adopt_moved_init_from(saved, current)
    settle_unread(saved, current, notice)
    allowed, refused = config_changes(saved, current, (checkpoint_processes(checkpoint), processes))
    if refused:
        keys = {r.split(":", 1)[0] for r in refused}
        keep = "" if keys & INIT_FROM_FIXED else (
            f"\n  or, to keep what it learned with the new settings, add: network.init_from={checkpoint.path} --fresh "
            "(a new run that starts from this checkpoint's LoRA, with fresh steps, optimizer and schedule)")
        raise UserError(
            f"cannot resume from {checkpoint.path}: these settings differ from the run's and would change "
            "what it learns:\n" + "\n".join(f"  - {r}" for r in refused)
            + "\n  fix: put them back, or start over with --fresh (the old run is moved aside, not deleted)" + keep)
    for change in allowed:
        notice(f"resume: applying changed setting {change}")


def choose_start(resume, run_dir: RunDir, fresh: bool, notice: Callable[[str], None],
                 moved: Callable[[Path], None] = lambda to: None) -> Checkpoint | None:
    """The checkpoint to resume from (None: start from step 0), following train.resume and --fresh.

    A train.resume that names another run's checkpoint (or run folder) starts this run from it; once this run has
    checkpoints of its own, the same command resumes from those (with --fresh: from the other run's again, this run
    moved aside). A checkpoint inside this run's folder is taken as named (going back to an earlier step).

    Nothing in an existing run folder is deleted: a fresh start moves the old folder aside (`moved` is told where).
    The one exception is a folder that holds only what a failed start wrote (run_dir.py's cleanup rule): it is
    cleared and reused. The caller holds the folder's lock.
    """
    foreign = run_dir.foreign_files()
    if foreign:  # preflight says so first (output_location.py); a folder filled since is refused here too
        raise UserError(f"run.output_dir: {run_dir.root} holds files that no run of this toolkit wrote "
                        f"({', '.join(foreign[:5])}); they are left as they are\n"
                        "  fix: set run.output_dir to a new folder (it is created)")
    explicit = isinstance(resume, str) and resume not in ("auto",)
    if fresh and explicit and Path(resume).resolve().is_relative_to(run_dir.root.resolve()):
        raise UserError(f"train.resume={resume} is inside the run folder, which --fresh moves aside\n"
                        "  fix: drop --fresh to resume from it, or drop train.resume to start over (the earlier run "
                        "is moved aside, not deleted)")
    if fresh:
        if run_dir.has_content() and run_dir.holds_only_start_files():
            run_dir.clear_start_files()
        elif run_dir.has_content():
            to = run_dir.move_aside()
            notice(f"--fresh: the previous run was moved to {to}")
            moved(to)
        if not explicit:
            return None
    if explicit:
        path = Path(resume)
        own = find_latest_checkpoint(run_dir.checkpoints, warn=notice) if run_dir.checkpoints.is_dir() else None
        if own is not None and not path.resolve().is_relative_to(run_dir.root.resolve()):
            # train.resume started this run from another run's checkpoint; the run's own progress is newer
            notice(f"train.resume: {path} started this run; resuming from its own newest checkpoint, {own.path.name} "
                   "(to start over from the other run again: --fresh, or another run.output_dir)")
            return own
        if not path.is_dir():
            raise UserError(f"train.resume: {path} {'is a file' if path.exists() else 'does not exist'}\n"
                            f"  fix: give a checkpoint folder (checkpoints/step-NNNNNN) or train.resume=auto")
        if (path / "checkpoints").is_dir() and not (path / "meta.json").exists():  # a run folder: its newest
            latest = find_latest_checkpoint(path / "checkpoints", warn=notice)
            if latest is None:
                raise UserError(f"train.resume: {path} is a run folder without a complete checkpoint\n"
                                "  fix: give a checkpoint folder (checkpoints/step-NNNNNN) or train.resume=auto")
            notice(f"train.resume: {path} is a run folder; resuming from its newest checkpoint, {latest.path.name}")
            return latest
        checkpoint, problem = verify_checkpoint(path)
        if checkpoint is None:
            raise UserError(f"train.resume: cannot resume from {path}: {problem}\n"
                            f"  fix: give a checkpoint folder (checkpoints/step-NNNNNN) or train.resume=auto")
        return checkpoint
    has_steps = bool(list_checkpoints(run_dir.checkpoints))
    if resume is False:
        if has_steps:
            raise UserError(f"train.resume is false, but {run_dir.root} already has checkpoints\n"
                            "  fix: resume (train.resume=auto), or start over with --fresh (the old run is moved aside)")
        latest = None
    else:
        latest = find_latest_checkpoint(run_dir.checkpoints, warn=notice)
        if latest is None and resume is True:
            raise UserError(f"train.resume is true, but there is no complete checkpoint in {run_dir.checkpoints}\n"
                            "  fix: check run.output_dir, or use train.resume=auto to start fresh when there is none")
    if latest is None and run_dir.has_content():
        if run_dir.holds_only_start_files():
            run_dir.clear_start_files()
            notice(f"{run_dir.root}: an earlier start failed before its first step; its start files were removed")
        else:
            to = run_dir.move_aside()
            notice(f"no checkpoint to resume from; the earlier attempt was kept at {to}")
            moved(to)
    return latest


def check_resume_plan(checkpoint: Checkpoint, saved, plan, notice: Callable[[str], None]) -> None:
    """This run's plan against the checkpoint's (`saved`, its plan.json; None for checkpoints written before plans):
    a decision that changes what the run learns (model.quantize=auto or train.precision=auto choosing otherwise on
    another device, say) refuses the resume, naming the value to set; the others (the attention kernel,
    checkpointing, compile) may differ, as their settings may."""
    if saved is None:
        return
    refused = []
    for key in dict.fromkeys([d.key for d in plan] + [d.key for d in saved]):
        before = saved.value(key) if key in saved else None
        after = plan.value(key) if key in plan else None
        if before == after or is_resume_safe(key) or key in READ_AT_START:
            continue
        refused.append((key, before, after))
    if refused:
        raise UserError(
            f"cannot resume from {checkpoint.path}: on this device the run would decide these settings otherwise, "
            "which changes what it learns:\n" + "\n".join(f"  - {k}: {b!r} in the checkpoint, {a!r} now"
                                                            for k, b, a in refused)
            + "\n  fix: set them to the checkpoint's values (" + " ".join(f"{k}={b}" for k, b, _ in refused)
            + "), or start over with --fresh (the old run is moved aside, not deleted)")
