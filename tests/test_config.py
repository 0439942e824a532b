"""Layered config: defaults < preset < YAML files < command line, strict validation, provenance."""

from __future__ import annotations

import os
import textwrap
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from conftest import REPO, run_toolkit
from toolkit.plan.run import load_run
from toolkit.device.detect import DeviceInfo, cpu_device_info
from toolkit.errors import ConfigError, UserError

CPU = cpu_device_info("test")


def write(path: Path, text: str) -> Path:
    path.write_text(textwrap.dedent(text))
    return path


@pytest.fixture
def base_yaml(tmp_path) -> Path:
    (tmp_path / "data.jsonl").write_text('{"text": "a red circle"}\n')  # validate checks that the data exists
    return write(tmp_path / "base.yaml", """\
        run: {name: t}
        model: {family: llm, name_or_path: tiny:llm}
        data: {path: data.jsonl}
        train: {steps: 10, lr: 1e-4}
        """)


def test_layers_later_wins_and_sources(tmp_path, base_yaml):
    second = write(tmp_path / "second.yaml", "train:\n  lr: 2.0e-4\n  steps: 20\n")
    run = load_run([base_yaml, second], ["train.steps=30", "run.seed=7"], device=CPU)
    assert run.cfg.train.lr == pytest.approx(2e-4)
    assert run.cfg.train.steps == 30
    assert run.cfg.run.seed == 7
    assert run.sources["train.lr"] == f"{second}:2"
    assert run.sources["train.steps"] == "command line"
    assert run.sources["model.family"] == f"{base_yaml}:2"
    # The preset layer sits under the user's files: the cpu preset chose fp32 and said so.
    assert run.cfg.train.precision == "fp32"
    assert run.sources["train.precision"].startswith("preset cpu")
    assert "train.batch_size" not in run.sources and run.cfg.train.batch_size == 1


def test_interpolation_follows_the_final_value(base_yaml):
    run = load_run([base_yaml], ["run.name=other"], device=CPU)
    assert run.cfg.run.output_dir == os.path.abspath("outputs/other")  # made absolute where read


def test_all_problems_reported_together(tmp_path, base_yaml):
    bad = write(tmp_path / "bad.yaml", """\
        train:
          lrr: 1e-4
          steps: many
          precision: bf15
        netwrk: {rank: 4}
        """)
    with pytest.raises(ConfigError) as info:
        load_run([base_yaml, bad], ["data.max_seq_len=-3"], device=CPU)
    problems = info.value.problems
    text = str(info.value)
    assert len(problems) == 5, text
    assert f"unknown key 'train.lrr' in {bad}:2; did you mean 'train.lr'?" in text
    assert f"'train.steps' in {bad}:3: expected an integer, got 'many'" in text
    assert "'train.precision'" in text and "did you mean 'bf16'?" in text
    assert "unknown key 'netwrk'" in text and "did you mean 'network'?" in text
    assert "'data.max_seq_len' in command line: -3 is below the minimum 8" in text


def test_missing_required_values(tmp_path):
    cfg = write(tmp_path / "c.yaml", "model: {family: llm}\n")
    with pytest.raises(ConfigError) as info:
        load_run([cfg], [], device=CPU)
    assert {p.split("'")[1] for p in info.value.problems} == {"model.name_or_path", "data.path"}


def test_data_section_follows_the_family(tmp_path):
    cfg = write(tmp_path / "c.yaml", "model: {family: llm, name_or_path: x}\ndata: {path: d.jsonl, resolution: 512}\n")
    with pytest.raises(ConfigError, match=r"unknown key 'data.resolution'"):
        load_run([cfg], [], device=CPU)


def test_unknown_family_suggests(tmp_path):
    cfg = write(tmp_path / "c.yaml", "model: {family: llmm, name_or_path: x}\n")
    with pytest.raises(ConfigError, match=r"did you mean 'llm'"):
        load_run([cfg], [], device=CPU)


def test_bad_yaml_names_file_and_line(tmp_path):
    cfg = write(tmp_path / "c.yaml", "model:\n  family: llm\n   name_or_path: x\n")
    with pytest.raises(UserError, match=rf"{cfg}:3:\d+: invalid YAML"):
        load_run([cfg], [], device=CPU)


def test_missing_file_and_bad_override(tmp_path, base_yaml):
    with pytest.raises(UserError, match="config file not found"):
        load_run([tmp_path / "nope.yaml"], [], device=CPU)
    with pytest.raises(ConfigError, match="is not key=value"):
        load_run([base_yaml], ["train.lr"], device=CPU)


def test_bf16_refused_where_the_arch_has_none(base_yaml):
    gfx906 = DeviceInfo("hip", "gfx906", "Radeon VII", 16.0, bf16=False)
    with pytest.raises(ConfigError, match="gfx906 has no bf16 support: use train.precision=fp16"):
        load_run([base_yaml], ["train.precision=bf16"], device=gfx906)
    run = load_run([base_yaml], [], device=gfx906)
    assert run.preset.name == "gfx906" and run.cfg.train.precision == "fp16"


def test_cli_misspelt_key_exit_code_2_without_traceback(tmp_path, base_yaml):
    proc = run_toolkit("train", base_yaml, "train.lrr=1", "device.backend=cpu", cwd=tmp_path)
    assert proc.returncode == 2
    assert "unknown key 'train.lrr' in command line; did you mean 'train.lr'?" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_cli_validate_prints_sources(tmp_path, base_yaml):
    proc = run_toolkit("validate", base_yaml, "train.steps=99", "device.backend=cpu", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    lines = {line.split("=")[0].strip(): line for line in proc.stdout.splitlines() if " = " in line}
    assert lines["train.steps"].rstrip().endswith("# command line")
    assert "99" in lines["train.steps"]
    assert lines["train.lr"].rstrip().endswith(f"# {base_yaml}:4")
    assert "# preset cpu" in lines["train.optimizer_backend"]
    assert "# auto: frozen base weights follow train.precision" in lines["model.dtype"]
    assert lines["run.output_dir"].split("=", 1)[1].split("#")[0].strip() == str(tmp_path / "outputs/t")


def flux_yaml(tmp_path: Path, extra: str = "") -> Path:
    from toolkit.tiny.fixtures import write_shapes_dataset

    write_shapes_dataset(tmp_path / "imgs", sizes=((64, 64),), count=1)  # a data folder holds an image at least
    return write(tmp_path / "my.yaml", "model:\n  family: flux\n  name_or_path: tiny:flux\ndata:\n  path: imgs\n"
                 "train:\n  steps: 10\n" + extra)


def test_a_family_setting_another_family_reads_is_an_error(tmp_path):
    cfg = flux_yaml(tmp_path, "  noise_offset: 0.1\n")
    with pytest.raises(ConfigError) as info:
        load_run([cfg], ["sample.max_new_tokens=32", "train.lrr=1"], device=CPU)
    assert info.value.problems == [
        "unknown key 'train.lrr' in command line; did you mean 'train.lr'?",
        "'sample.max_new_tokens' in command line has no effect for model.family flux; remove it (it applies to: llm, vlm)",
        f"'train.noise_offset' in {cfg}:8 has no effect for model.family flux; remove it (it applies to: sd, sdxl)",
    ]
    # The same key where the family reads it, and at its default where it does not, both pass.
    assert load_run([cfg], ["model.family=sd"], device=CPU).cfg.train.noise_offset == pytest.approx(0.1)
    assert load_run([flux_yaml(tmp_path, "  noise_offset: 0\n")], [], device=CPU).cfg.model.family == "flux"


def test_a_preset_setting_that_does_not_apply_is_no_error(base_yaml):
    # The HIP presets turn device.vae_encode_cudnn off for every family; an llm run does not read it.
    gfx1100 = DeviceInfo("hip", "gfx1100", "RX 7900 XTX", 24.0, bf16=True)
    run = load_run([base_yaml], [], device=gfx1100)
    assert "vae_encode_cudnn" not in run.cfg.device  # the llm's typed device section has no such setting
    sd = load_run([base_yaml], ["model.family=sd", "model.name_or_path=tiny:sd",
                                f"data.path={REPO / 'configs/examples/data/shapes'}"], device=gfx1100)
    assert sd.sources["device.vae_encode_cudnn"].startswith("preset gfx1100")
    assert sd.cfg.device.vae_encode_cudnn is False
    with pytest.raises(ConfigError, match=r"'device.vae_encode_cudnn' in command line has no effect for "
                                          r"model.family llm; remove it \(it applies to: sd, sdxl, flux, sd3, wan21, wan22"):
        load_run([base_yaml], ["device.vae_encode_cudnn=false"], device=gfx1100)


def test_resolved_config_holds_only_the_family_settings(tmp_path, base_yaml):
    from toolkit.config.families import FAMILY_SCOPED_SETTINGS, applies_to
    from toolkit.config.load import flatten, resolved_container

    for run, family in ((load_run([base_yaml], [], device=CPU), "llm"), (load_run([flux_yaml(tmp_path)], [], device=CPU), "flux")):
        keys = dict(flatten(resolved_container(run.cfg)))
        scoped = {k for k in keys if k in FAMILY_SCOPED_SETTINGS}
        assert scoped == {k for k in FAMILY_SCOPED_SETTINGS if applies_to(k, family)}
    assert "train.guidance" in keys and "train.noise_offset" not in keys and "sample.max_new_tokens" not in keys
    assert keys["train.timestep_sampling"] == "logit_normal" and "model.attention" not in keys


def test_cli_validate_shows_only_the_family_settings(tmp_path):
    proc = run_toolkit("validate", flux_yaml(tmp_path), "device.backend=cpu", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    keys = {line.split("=")[0].strip() for line in proc.stdout.splitlines() if " = " in line}
    assert {"train.guidance", "train.flow_shift", "sample.guidance_scale", "device.vae_encode_cudnn"} <= keys
    assert not keys & {"train.noise_offset", "train.experts", "sample.max_new_tokens", "model.trust_remote_code"}


def test_an_older_run_folder_with_every_family_setting_resumes(tmp_path):
    """Older toolkits wrote every setting into a checkpoint's config.yaml; those of other families are ignored."""
    import copy

    import torch
    import yaml

    from toolkit.config.load import resolved_container
    from toolkit.train.checkpoint import Checkpoint
    from toolkit.train.resume import check_resume_config

    current = resolved_container(load_run([flux_yaml(tmp_path)], [], device=CPU).cfg)
    saved = copy.deepcopy(current)
    saved["train"].update(noise_offset=0.0, min_snr_gamma=0.0, experts="both")
    saved["sample"].update(max_new_tokens=64, temperature=0.0)
    saved["model"].update(trust_remote_code=False, attention="sdpa")
    folder = tmp_path / "step-000010"
    folder.mkdir()
    torch.save({"step": 10}, folder / "trainer_state.pt")  # a run from before multi-process: one process
    (folder / "config.yaml").write_text(yaml.safe_dump(saved))
    notices: list[str] = []
    check_resume_config(Checkpoint(folder, 10, {}), saved, current, notices.append)
    assert notices == []
    saved["train"]["guidance"] = 3.0  # a flux setting still counts
    with pytest.raises(UserError, match=r"train.guidance: 3.0 in the checkpoint, 1.0 now"):
        check_resume_config(Checkpoint(folder, 10, {}), saved, current, notices.append)


def test_resume_safe_settings_come_from_the_schema():
    from toolkit.train.resume import RESUME_SAFE_KEYS, is_resume_safe

    assert {k for k in RESUME_SAFE_KEYS if not k.startswith(("device.", "sample.", "log."))} == {
        "run.name", "run.output_dir", "save.every", "save.keep_last", "save.dtype", "save.format", "train.steps",
        "train.resume", "train.max_nan_steps", "train.eval_every", "train.optimizer_backend",
        "train.gradient_checkpointing", "train.compile", "train.cuda_graphs", "train.compile_recompute",
        "train.compile_regions", "train.checkpoint_offload", "train.checkpoint_keeps", "model.attention",
        "model.kernels", "model.fuse_projections", "model.block_swap", "eval.every", "train.generation"}
    assert {"device.preset", "device.distributed", "device.collective_timeout", "device.gradient_sync", "sample.prompts",
            "log.wandb"} <= RESUME_SAFE_KEYS
    assert not any(is_resume_safe(k) for k in ("train.lr", "train.optimizer", "train.optimizer_args.d_coef",
                                               "network.rank", "data.path", "model.name_or_path", "run.seed"))
    assert is_resume_safe("device.a_setting_since_dropped") and not is_resume_safe("train.a_setting_since_dropped")


def test_validate_rejects_an_unknown_optimizer_before_any_model_loads(tmp_path, base_yaml):
    proc = run_toolkit("validate", base_yaml, "train.optimizer=adamw9bit", "device.backend=cpu", cwd=tmp_path)
    assert proc.returncode == 2
    assert ("'train.optimizer' in command line: 'adamw9bit' is not one of adamw, adamw8bit, lion8bit, lion, "
            "adafactor, prodigy; did you mean 'adamw8bit'?") in proc.stderr


def test_optimizer_args_are_checked_against_the_optimizer(tmp_path, base_yaml):
    extra = write(tmp_path / "opt.yaml", "train:\n  optimizer: prodigy\n  optimizer_args:\n    d_coef: 0.5\n"
                                         "    d_coeff: 2\n")
    with pytest.raises(ConfigError) as info:
        load_run([base_yaml, extra], ["train.optimizer_args.growth_rat=1.02"], device=CPU)
    accepted = "beta3, d0, d_coef, decouple, growth_rate, safeguard_warmup, use_bias_correction"
    assert info.value.problems == [
        f"'train.optimizer_args.d_coeff' in {extra}:5: prodigy does not accept 'd_coeff'; it accepts: {accepted}; "
        "did you mean 'd_coef'?",
        f"'train.optimizer_args.growth_rat' in command line: prodigy does not accept 'growth_rat'; it accepts: "
        f"{accepted}; did you mean 'growth_rate'?"]
    # Layers merge the mapping key by key, each key keeping its source.
    good = write(tmp_path / "good.yaml", "train:\n  optimizer: prodigy\n  optimizer_args: {d_coef: 0.5}\n")
    run = load_run([base_yaml, good], ["train.optimizer_args.growth_rate=1.02"], device=CPU)
    assert dict(run.cfg.train.optimizer_args) == {"d_coef": 0.5, "growth_rate": 1.02}
    assert run.sources["train.optimizer_args.d_coef"] == f"{good}:3"
    assert run.sources["train.optimizer_args.growth_rate"] == "command line"
    with pytest.raises(ConfigError, match=r"'train.optimizer_args.d_coef' in .*good.yaml:3: adamw does not accept"):
        load_run([base_yaml, good], ["train.optimizer=adamw"], device=CPU)


def test_accepted_optimizer_args_show_in_validate(tmp_path, base_yaml):
    proc = run_toolkit("validate", base_yaml, "train.optimizer=adamw", "train.optimizer_args.amsgrad=true",
                       "device.backend=cpu", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    line = next(line for line in proc.stdout.splitlines() if line.startswith("train.optimizer_args.amsgrad "))
    assert line.split("=", 1)[1].split("#")[0].strip() == "True" and line.rstrip().endswith("# command line")


def test_save_format_is_checked_against_the_family(tmp_path, base_yaml):
    with pytest.raises(ConfigError) as info:
        load_run([base_yaml], ["save.format=diffusers"], device=CPU)
    assert info.value.problems == ["'save.format' in command line: diffusers is not available for model.family llm; "
                                   "use one of auto, peft, gguf"]
    with pytest.raises(ConfigError, match="'save.format' in command line: kohya is not available for model.family "
                                          "flux; use one of auto, diffusers, comfyui"):
        load_run([flux_yaml(tmp_path)], ["save.format=kohya"], device=CPU)
    assert load_run([flux_yaml(tmp_path)], ["save.format=kohya", "model.family=sd"], device=CPU).cfg.save.format == "kohya"
    assert load_run([base_yaml], ["network.type=dora", "save.format=peft"], device=CPU).cfg.network.type == "dora"


def test_dora_needs_the_family_format(tmp_path):
    cfg = flux_yaml(tmp_path, "network:\n  type: dora\nsave:\n  format: comfyui\n")
    with pytest.raises(ConfigError) as info:
        load_run([cfg], [], device=CPU)
    assert info.value.problems == [f"'save.format' in {cfg}:11: comfyui files hold plain LoRA weights, and "
                                   f"network.type is dora ({cfg}:9); use save.format=diffusers (or auto), or "
                                   "network.type=lora"]
    assert load_run([cfg], ["save.format=diffusers"], device=CPU).cfg.save.format == "diffusers"


def test_distributed_settings(base_yaml):
    run = load_run([base_yaml], [], device=CPU)
    assert run.cfg.device.distributed == "auto" and run.cfg.device.collective_timeout == 1800
    with pytest.raises(ConfigError) as info:
        load_run([base_yaml], ["device.distributed=fsdpp", "device.collective_timeout=0"], device=CPU)
    assert info.value.problems == [
        "'device.distributed' in command line: 'fsdpp' is not one of auto, ddp, fsdp; did you mean 'fsdp'?",
        "'device.collective_timeout' in command line: 0 is below the minimum 1"]


def test_the_old_timeout_minutes_is_read_as_collective_timeout_with_a_note(tmp_path, base_yaml):
    old = tmp_path / "old.yaml"
    old.write_text(Path(base_yaml).read_text() + "device:\n  timeout_minutes: 2\n")
    run = load_run([old], [], device=CPU)
    assert run.cfg.device.collective_timeout == 120 and "timeout_minutes" not in run.cfg.device
    line = len(Path(base_yaml).read_text().splitlines()) + 2
    assert [n for layer in run.layers for n in layer.notes] == [
        f"'device.timeout_minutes' in {old}:{line} is deprecated: read as device.collective_timeout=120 (seconds); "
        "rename it"]
    assert run.sources["device.collective_timeout"] == f"{old}:{line}"
    assert load_run([base_yaml], ["device.timeout_minutes=1"], device=CPU).cfg.device.collective_timeout == 60
    with pytest.raises(ConfigError) as info:
        load_run([base_yaml], ["device.timeout_minutes=1", "device.collective_timeout=60"], device=CPU)
    assert info.value.problems == ["'device.timeout_minutes' in command line is the old name of "
                                   "'device.collective_timeout', which is set too; remove 'device.timeout_minutes'"]
    proc = run_toolkit("validate", old, cwd=tmp_path)
    assert proc.returncode == 0 and "note: 'device.timeout_minutes' in" in proc.stderr
    assert "device.collective_timeout" in proc.stdout and "device.timeout_minutes" not in proc.stdout


EXAMPLES = sorted((REPO / "configs" / "examples").glob("*.yaml"))


def preset_device(preset) -> DeviceInfo:
    """A stand-in for the hardware a preset is for: its first arch (or a generic one), bf16 unless it asks for fp16."""
    if preset.backend == "cpu":
        return CPU
    arch = preset.archs[0] if preset.archs else {"cuda": "sm_75", "hip": "gfx9999"}[preset.backend]
    precision = preset.layer.data.get("train", {}).get("precision")
    return DeviceInfo(preset.backend, arch, f"test {arch}", 64.0, bf16=precision not in ("fp16", None))


@pytest.fixture(scope="module")
def presets() -> dict:
    from toolkit.config.presets import load_presets

    return load_presets()


@pytest.mark.parametrize("config", EXAMPLES, ids=lambda p: p.name)
def test_every_example_config_validates_under_every_preset(config, presets, run_cli, capsys, monkeypatch):
    """`validate` on every configs/examples/*.yaml: the quickstarts exit 0, the real-model examples fail only on
    what a user supplies (their data folder, the model offline); the config merges under each preset in
    configs/presets/ and its auto values resolve on that preset's hardware; the llm examples' data files exist."""
    from toolkit.config.layers import read_yaml_layer
    from toolkit.config.load import merge_layers
    from toolkit.plan.run import frozen, static_plan

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # no network in tests: a Hub model not in the cache is a problem
    code = run_cli("validate", config)
    if config.name.startswith("quickstart_"):
        assert code == 0
    else:
        problems = [line for line in capsys.readouterr().err.splitlines() if line.startswith("  - ")]
        assert code == 2 and problems
        user_files = ("  - 'data.path' in", "  - 'model.name_or_path' in", "  - 'sample.images' in",
                      "  - 'data.datasets[", "  - 'network.init_from' in")
        assert all(p.startswith(user_files) for p in problems), problems
    user = read_yaml_layer(config)
    problems = []
    for name, preset in presets.items():
        try:
            loaded = merge_layers([preset.layer, user])
            static_plan(frozen(loaded.cfg), preset_device(preset), preset, loaded.sources)
        except UserError as err:
            problems.append(f"preset {name}: {err}")
    assert not problems, "\n".join(problems)
    cfg = OmegaConf.load(config)
    if cfg.model.family == "llm":
        assert (REPO / cfg.data.path).is_file()


@pytest.mark.parametrize("family, steps, compiled", [("llm", 10, True), ("sd", 999, False), ("sd", 1000, True),
                                                     ("flux", 10, True), ("wan21", 10, True), ("sdxl", 199, False),
                                                     ("sdxl", 200, True), ("ltx2", 199, False), ("ltx2", 200, True),
                                                     ("hunyuan_video15", 199, False), ("hunyuan_video15", 200, True),
                                                     ("chroma", 199, False), ("chroma", 200, True),
                                                     ("flux_kontext", 199, False), ("flux_kontext", 200, True),
                                                     ("qwen_image_edit", 199, False), ("qwen_image_edit", 200, True),
                                                     ("sd3", 5000, False)])
def test_compile_auto_follows_the_measurements_and_the_run_length(family, steps, compiled, presets):
    """train.compile=auto on a GPU: on for the families measured faster compiled; SDXL and SD only for runs long
    enough to repay a cold compile (SDXL block by block, about a minute; SD's whole UNet, about 100-150 s, from 1,000
    steps); nothing is in this test's compile cache. A family not measured stays eager, and the reason is said
    either way. compile_regions=auto: SDXL's UNet block by block under 5,000 steps, whole from there; SD's whole;
    not used when the run does not compile."""
    from toolkit.config.layers import Layer
    from toolkit.config.load import merge_layers
    from toolkit.plan.run import frozen, static_plan

    preset = presets["sm_90"]
    user = Layer("test.yaml", {"model": {"family": family, "name_or_path": "m"}, "data": {"path": "d"},
                               "train": {"steps": steps, "compile": "auto"}})
    loaded = merge_layers([preset.layer, user])
    cfg = frozen(loaded.cfg)
    decisions = {d.key: d for d in static_plan(cfg, preset_device(preset), preset, loaded.sources)}
    assert cfg.train.compile == "auto" and decisions["train.compile"].value is compiled
    reason = decisions["train.compile"].reason
    if family != "sd3" and not compiled:  # measured faster compiled, but only from a number of steps
        assert f"train.steps={steps} (in all" in reason and "too short" in reason
        assert f"from {1000 if family == 'sd' else 200} steps" in reason
    elif compiled:
        assert ("trained" in reason or "compiled" in reason) and ("H100" in reason or "H200" in reason)
    else:
        assert reason == "not measured faster for sd3 yet"
    regions = decisions.get("train.compile_regions")
    assert (regions.value if regions else None) == {"sd": "whole", "sdxl": "blocks" if compiled else "whole"}.get(family)
    if regions and not compiled:
        assert regions.reason == "not used: train.compile is off"
    if family == "sdxl":
        long_run = Layer("test.yaml", {"model": {"family": "sdxl", "name_or_path": "m"}, "data": {"path": "d"},
                                       "train": {"steps": 5000}})
        loaded = merge_layers([preset.layer, long_run])
        plan = static_plan(frozen(loaded.cfg), preset_device(preset), preset, loaded.sources)
        assert plan.value("train.compile_regions") == "whole" and "336.8 s cold" in plan.decision(
            "train.compile_regions").reason
