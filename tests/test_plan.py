"""The run as a plan: a frozen config, decisions made once in stages from one registry, plan.json written once and
shown by `validate` and the report, resume comparing plans, the step events, and the shape the trainer keeps
(collaborators passed explicitly, a narrow adapter contract)."""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import pytest
import torch
from omegaconf.errors import ReadonlyConfigError

from conftest import REPO, run_toolkit
from toolkit.plan.decisions import Decision, RunPlan
from toolkit.plan.run import load_run

LLM = REPO / "configs/examples/quickstart_llm.yaml"
QUICK = ["train.steps=4", "save.every=2", "sample.every=0", "log.every=1", "data.max_seq_len=32",
         "train.batch_size=4", "log.tensorboard=false"]


def test_the_config_is_frozen_after_loading_and_the_settings_are_asked_plus_plan():
    run = load_run([LLM], ["train.steps=3"])
    with pytest.raises(ReadonlyConfigError):
        run.asked.train.lr = 1.0
    with pytest.raises(ReadonlyConfigError):
        run.cfg.train.steps = 5
    assert run.asked.model.dtype == "auto" and run.cfg.model.dtype == run.plan.value("model.dtype") == "fp32"
    assert run.asked.train.compile == "auto" and run.cfg.train.compile is False
    assert run.plan.stages == ("static",) and {d.stage for d in run.plan} == {"static"}
    assert str(run.plan.decision("train.compile")) == "train.compile=false: off on the CPU"


def test_a_later_stage_settles_a_setting_in_its_place_and_the_plan_round_trips_through_json():
    plan = RunPlan().with_stage("static", [Decision("train.batch_size", 2, "the preset's table"),
                                           Decision("model.dtype", "bf16", "follows")])
    later = plan.with_stage("measured", [Decision("train.batch_size", 6, "measured", "measured")])
    assert [d.key for d in later] == ["train.batch_size", "model.dtype"] and later.value("train.batch_size") == 6
    assert plan.value("train.batch_size") == 2  # immutable: the earlier plan is unchanged
    assert later.stages == ("static", "measured")
    assert RunPlan.from_json(later.to_json()) == later
    asked = {"train": {"batch_size": "auto"}, "model": {"dtype": "auto"}}
    assert later.effective(asked) == {"train": {"batch_size": 6}, "model": {"dtype": "bf16"}}
    assert asked["train"]["batch_size"] == "auto"


def test_every_rule_is_registered_once_per_stage_and_cites_evidence_that_exists():
    from toolkit.plan.evidence import evidence
    from toolkit.plan.stages import registered_keys

    keys = registered_keys()
    assert "train.precision" in keys["static"] and "device.distributed" in keys["loaded"]
    assert all(len(stage) == len(set(stage)) for stage in keys.values())
    # a measured decision names its evidence, and its reason states the figure and the file
    from toolkit.device.detect import DeviceInfo

    gpu = DeviceInfo("cuda", "sm_90", "H100", 80.0, True)
    run = load_run([REPO / "configs/examples/quickstart_sd.yaml"], ["train.steps=2000"], device=gpu)
    compile_ = run.plan.decision("train.compile")
    assert compile_.value is True and compile_.evidence == "sd-compile-cold"
    record = evidence()["sd-compile-cold"]
    assert record["figure"] in compile_.reason and all(f in compile_.reason for f in record["files"])


def test_compile_auto_keeps_a_short_run_eager_unless_its_compiled_code_is_cached(tmp_path, monkeypatch):
    """SD1.5 compiles from 1,000 steps (a cold compile is repaid there); a shorter run compiles only where a run of
    the same settings on this GPU left its compiled code in the cache, and not once that code is gone."""
    from toolkit.device.detect import DeviceInfo
    from toolkit.plan.compiled_runs import record_compiled, signature

    monkeypatch.setenv("TOOLKIT_CACHE", str(tmp_path))
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    gpu = DeviceInfo("cuda", "sm_90", "H100", 80.0, True)
    sd = REPO / "configs/examples/quickstart_sd.yaml"

    def compile_(*overrides: str):
        return load_run([sd], list(overrides), device=gpu).plan.decision("train.compile")

    assert compile_("train.steps=1000").value is True
    short = compile_("train.steps=200")
    assert short.value is False and "from 1000 steps" in short.reason and short.evidence == "sd-compile-cold"
    run = load_run([sd], ["train.steps=3000"], device=gpu)  # another length, the same compiled graphs
    record_compiled(signature(run.asked, gpu.name), "sd", 151.2)
    (tmp_path / "compiled" / "inductor" / "fxgraph").mkdir(parents=True)
    cached = compile_("train.steps=200")
    assert cached.value is True and "compiled on this machine" in cached.reason and "151 s" in cached.reason
    assert compile_("train.steps=200", "train.batch_size=3").value is False  # other shapes: a cold compile
    other_gpu = DeviceInfo("cuda", "sm_90", "H200", 140.0, True)
    assert load_run([sd], ["train.steps=200"], device=other_gpu).plan.value("train.compile") is False
    (tmp_path / "compiled" / "inductor" / "fxgraph").rmdir()  # the cache cleared: the record no longer counts
    assert compile_("train.steps=200").value is False


def test_plan_json_is_written_once_and_checkpoints_keep_the_config_as_asked(tmp_path, run_cli, capsys):
    out = tmp_path / "run"
    assert run_cli("train", LLM, f"run.output_dir={out}", *QUICK) == 0
    capsys.readouterr()
    plan = RunPlan.from_json((out / "plan.json").read_text())
    assert plan.stages == ("static", "loaded", "measured")
    assert plan.value("device.distributed") == "ddp" and plan.decision("device.distributed").stage == "loaded"
    assert plan.value("device.sdpa_backend") == "auto" and plan.decision("device.sdpa_backend").stage == "measured"
    config = (out / "config.yaml").read_text()
    assert "dtype: auto" in config and "compile: auto" in config  # what the user asked for, never rewritten
    for step in ("step-000002", "step-000004"):
        assert (out / "checkpoints" / step / "plan.json").read_text() == (out / "plan.json").read_text()
        assert (out / "checkpoints" / step / "config.yaml").read_text() == config
    report = (out / "report.html").read_text()
    assert "Plan: what auto became, and why" in report and "device.distributed (loaded)" in report


def test_the_precision_a_run_uses_is_said_once_with_its_reason_and_matches_its_files(tmp_path):
    """bf16 asked on the CPU: the start says once that it trains in bf16 and what that costs there; the plan and
    the run's config agree with it (nothing claims fp32)."""
    out = tmp_path / "run"  # a process of its own: accelerate keeps one mixed precision per process
    done = run_toolkit("train", LLM, f"run.output_dir={out}", "train.steps=1", "train.precision=bf16", *QUICK[2:])
    assert done.returncode == 0, done.stderr
    err = done.stderr
    lines = [line.strip() for line in err.splitlines()
             if ("precision" in line or "fp32" in line) and str(tmp_path) not in line]
    assert lines == ["train.precision=bf16: set in command line: the CPU trains in bf16; bf16 matmuls are slower than "
                     "fp32 on most CPUs (auto chooses fp32 there)",
                     "model.dtype=bf16: frozen base weights follow train.precision"]
    plan = RunPlan.from_json((out / "plan.json").read_text())
    assert plan.value("train.precision") == "bf16" and plan.value("model.dtype") == "bf16"
    assert "precision: bf16" in (out / "config.yaml").read_text()


def test_validate_shows_the_static_stage(run_cli, capsys):
    assert run_cli("validate", LLM) == 0
    out = capsys.readouterr().out
    assert "# the plan's static stage" in out
    assert "#   model.dtype=fp32: frozen base weights follow train.precision" in out
    assert re.search(r"model\.dtype\s+= fp32\s+# auto: frozen base weights follow train.precision", out)


def test_resume_refuses_a_plan_that_decides_otherwise_where_it_changes_what_the_run_learns(tmp_path, run_cli,
                                                                                            capsys):
    """A checkpoint whose plan says the base was quantized (as auto decides on a smaller GPU) does not resume on a
    device where the plan keeps 16-bit weights; the message names the value to set."""
    out = tmp_path / "run"
    assert run_cli("train", LLM, f"run.output_dir={out}", *QUICK) == 0
    checkpoint = out / "checkpoints" / "step-000004"
    plan = RunPlan.from_json((checkpoint / "plan.json").read_text())
    other = plan.with_stage("loaded", [Decision("model.quantize", "8bit", "did not fit", "loaded")])
    (checkpoint / "plan.json").write_text(other.to_json())
    meta = json.loads((checkpoint / "meta.json").read_text())
    from toolkit.train.checkpoint import _sha256

    meta["files"]["plan.json"] = {"bytes": (checkpoint / "plan.json").stat().st_size,
                                  "sha256": _sha256(checkpoint / "plan.json")}
    (checkpoint / "meta.json").write_text(json.dumps(meta))
    capsys.readouterr()
    assert run_cli("train", LLM, f"run.output_dir={out}", *QUICK[1:], "train.steps=6") == 2
    err = capsys.readouterr().err
    assert "model.quantize: '8bit' in the checkpoint, None now" in err
    assert "fix: set them to the checkpoint's values (model.quantize=8bit)" in err


class Recorder:
    def __init__(self):
        from toolkit.train.events import StepEvents

        self.seen = []
        recorder = self

        class Sub(StepEvents):
            def step_started(self, step):
                recorder.seen.append(("started", step))

            def step_launched(self, step, sums):
                recorder.seen.append(("launched", step))

            def step_recorded(self, step, sums):
                recorder.seen.append(("recorded", step, round(sums.mean, 4)))

            def saved(self, step, path):
                recorder.seen.append(("saved", step, path.name))

            def finished(self, step, final):
                recorder.seen.append(("finished", step, final.name))

            def phase(self, name):
                recorder.seen.append(name)

        self.subscriber = Sub()


def test_step_events_come_in_order_with_each_phase(tmp_path):
    """The loop's events on a tiny run: each step starts, marks its phases, is launched, read (one step late where
    the optimizer skips on the device), saved at save.every, and the run finishes; losses as metrics.jsonl has them."""
    from toolkit.train.trainer import Trainer

    recorder = Recorder()
    run = load_run([LLM], [f"run.output_dir={tmp_path / 'run'}", *QUICK, "train.optimizer=adamw"])
    Trainer(run, fresh=True, log=lambda m: None, events=[recorder.subscriber]).run()
    seen = recorder.seen
    steps = [e for e in seen if isinstance(e, tuple)]
    assert [e[:2] for e in steps] == [("started", 1), ("launched", 1), ("started", 2), ("launched", 2),
                                      ("recorded", 1), ("recorded", 2), ("saved", 2), ("started", 3),
                                      ("launched", 3), ("started", 4), ("launched", 4), ("recorded", 3),
                                      ("recorded", 4), ("saved", 4), ("finished", 4)]
    first = seen[seen.index(("started", 1)) + 1:seen.index(("launched", 1))]
    assert first == ["start", "queued", "forward", "backward", "update", "updated", "end"]
    losses = [json.loads(line)["loss"] for line in (tmp_path / "run/logs/metrics.jsonl").read_text().splitlines()]
    assert [e[2] for e in steps if e[0] == "recorded"] == [round(x, 4) for x in losses]


def _calls_passing_self(path: Path, cls: str) -> list[str]:
    tree = ast.parse(path.read_text())
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name == cls:
            for call in ast.walk(node):
                if isinstance(call, ast.Call):
                    args = list(call.args) + [k.value for k in call.keywords]
                    if any(isinstance(a, ast.Name) and a.id == "self" for a in args):
                        found.append(ast.unparse(call))
    return found


def test_the_trainer_hands_itself_to_no_helper_and_train_uses_a_narrow_adapter():
    """Shape guards: the Trainer passes its collaborators, never `self`; train/ uses at most 14 adapter members,
    memory among them as one object."""
    assert _calls_passing_self(REPO / "toolkit/train/trainer.py", "Trainer") == []
    members = set()
    for path in (REPO / "toolkit/train").glob("*.py"):
        members |= set(re.findall(r"\badapter\.(\w+)", path.read_text()))
    assert "memory" in members and len(members) <= 14, sorted(members)
    from toolkit.models.base import ModelAdapter

    required = {name for name in ModelAdapter.__abstractmethods__}
    assert required == {"load", "prepare_data", "trainable_modules", "batch_units", "loss", "sample", "save_lora",
                        "load_lora"}


def test_adapter_inheritance_is_base_kind_family_at_most():
    from toolkit.config.families import FAMILY_SPECS
    from toolkit.models import adapter_class
    from toolkit.models.base import ModelAdapter

    for name in FAMILY_SPECS:
        cls = adapter_class(name)
        chain = [c for c in cls.__mro__ if isinstance(c, type) and issubclass(c, ModelAdapter)]
        assert len(chain) <= 3, (name, [c.__name__ for c in chain])
