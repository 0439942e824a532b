"""Opening a run's folder, on the main process: its lock, the cleanup of what failed runs left, the checkpoint to
resume from (or the old run moved aside), the batch as far as it is known before the model loads, the check of a
resumed run's settings, and config.yaml. Every process gets the same answer; an error there stops the others
quietly (the main process prints it)."""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import yaml
from omegaconf import OmegaConf

from toolkit.config.load import as_text, resolved_container
from toolkit.disk import write_atomic
from toolkit.plan.decisions import Decision, RunPlan
from toolkit.plan.run import ResolvedRun, frozen, settings_view
from toolkit.train.batch_size import accumulate_to, checkpoint_batch
from toolkit.train.checkpoint import Checkpoint, list_checkpoints
from toolkit.train.checkpointer import OtherProcessFailed
from toolkit.train.resume import check_resume_config, checkpoint_processes, choose_start
from toolkit.train.run_dir import RunDir
from toolkit.train.run_lock import RunLock


@dataclass
class Start:
    """Where a run starts: the checkpoint it resumes (None: step 0) and its plan with the batch settled so far."""

    checkpoint: Checkpoint | None
    plan: RunPlan
    batch_resumed: bool  # train.batch_size=auto taken from the checkpoint (never measured again)


def saved_plan(checkpoint: Checkpoint) -> RunPlan | None:
    """The plan a checkpoint's run trained with (None for checkpoints written before plans)."""
    path = checkpoint.path / "plan.json"
    return RunPlan.from_json(path.read_text(encoding="utf-8")) if path.is_file() else None


def saved_settings(checkpoint: Checkpoint) -> dict:
    """The settings a checkpoint's run used: its config.yaml with its plan in place (older checkpoints' config.yaml
    holds the values used)."""
    saved = yaml.safe_load((checkpoint.path / "config.yaml").read_text(encoding="utf-8"))
    plan = saved_plan(checkpoint)
    return saved if plan is None else plan.effective(saved)


def settle_batch(run: ResolvedRun, checkpoint: Checkpoint | None, processes: int) -> tuple[list[Decision], bool]:
    """What is known of the batch before the model loads: a resumed auto run's batch size is its checkpoint's;
    train.global_batch_size gives grad_accum (a batch probe sets both again later). Returns the decisions and
    whether the batch size came from the checkpoint."""
    t = run.cfg.train
    batch_auto = run.is_auto("train.batch_size")
    if checkpoint is not None and batch_auto:
        saved = saved_settings(checkpoint)["train"]
        size, note = checkpoint_batch(saved["batch_size"], checkpoint_processes(checkpoint), processes)
        decisions = [Decision("train.batch_size", size, note.split(": ", 1)[1])]
        if t.global_batch_size is not None:
            decisions.append(Decision("train.grad_accum", saved["grad_accum"], "the checkpoint's (a resumed run keeps "
                                                                             "its batch)"))
        return decisions, True
    if t.global_batch_size is not None:
        size, accum, note = accumulate_to(t.global_batch_size, t.batch_size, processes, batch_auto, t.grad_accum)
        decisions = [Decision("train.grad_accum", accum, note)]
        if size != t.batch_size:
            decisions.append(Decision("train.batch_size", size, note))
        return decisions, False
    return [], False


def open_run_folder(run: ResolvedRun, run_dir: RunDir, procs, fresh: bool, log: Callable[[str], None],
                    restarted: bool = False) -> tuple[Start, RunLock | None]:
    """On the main process: the lock, the cleanup, the start, the batch known so far, the checked settings, the
    run folder and its config.yaml (the config as asked). Every process gets the same Start. A `restarted` run
    (the launcher restarted its processes) resumes from its own newest checkpoint, whatever train.resume says
    (false, or another run's checkpoint); without one yet it starts as the first attempt did."""
    outcome, lock = None, None
    if procs.is_main:
        try:
            # Before anything in the folder is read or moved: a live run there (or its resume) refuses here.
            lock = RunLock(run_dir.root)
            lock.acquire(log)
            run_dir.remove_unfinished(log)
            run_dir.remove_failed_starts_beside(log)
            resume = "auto" if restarted and list_checkpoints(run_dir.checkpoints) else run.cfg.train.resume
            moved_to: list[Path] = []
            checkpoint = choose_start(resume, run_dir, fresh, log, moved=moved_to.append)
            decisions, resumed = settle_batch(run, checkpoint, procs.world_size)
            if resumed:
                log(f"train.batch_size=auto -> {decisions[0].value}: {decisions[0].reason}")
            plan = run.plan.with_stage("static", decisions)
            if checkpoint is not None:
                # What the user asked for against what the run was asked (the plans are compared once this run's
                # is complete, train/resume.py check_resume_plan); a checkpoint from before plans holds the values
                # its run used, compared with this run's as far as they are known
                saved = yaml.safe_load((checkpoint.path / "config.yaml").read_text(encoding="utf-8"))
                current = resolved_container(run.asked)
                if saved_plan(checkpoint) is None:
                    current = plan.effective(current)
                check_resume_config(checkpoint, saved, current, log, processes=procs.world_size)
            run_dir.create()
            if moved_to:
                follow_moved_init_from(run, run_dir.root, moved_to[0], log)
            write_atomic(run_dir.config, config_yaml(run))
            outcome = ("ok", Start(checkpoint, plan, resumed))
        except BaseException:
            procs.from_main(("failed", None))
            if lock is not None:
                lock.release()
            raise
    status, start = procs.from_main(outcome)
    if status != "ok":
        raise OtherProcessFailed()
    return start, lock


def follow_moved_init_from(run: ResolvedRun, moved_from: Path, moved_to: Path, log: Callable[[str], None]) -> None:
    """A network.init_from inside the run folder whose earlier content was just moved aside (`moved_from` ->
    `moved_to`) names where it went, in `run` itself: config.yaml, the checkpoints' copies and the report then name
    the LoRA the run started from (already copied, train/lora_source.py), not what this run writes at that place."""
    init = run.asked.network.get("init_from")
    if not init or not Path(init).is_relative_to(moved_from):
        return
    asked = copy.deepcopy(run.asked)
    OmegaConf.set_readonly(asked, False)
    asked.network.init_from = str(moved_to / Path(init).relative_to(moved_from))
    run.asked = frozen(asked)
    run.cfg = settings_view(run.asked, run.plan)
    log(f"network.init_from: {init} was moved with the earlier run; the run's config names it at "
        f"{asked.network.init_from}")


def config_yaml(run: ResolvedRun) -> str:
    """config.yaml: the merged config as the user asked for it (defaults, preset, files, command line)."""
    return OmegaConf.to_yaml(OmegaConf.create(as_text(resolved_container(run.asked))))


def config_hash(texts: dict[str, str]) -> str:
    import hashlib

    return hashlib.sha256(json.dumps(texts, sort_keys=True).encode()).hexdigest()[:16]
