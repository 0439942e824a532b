"""`import-aitk JOB.yaml`: an ai-toolkit job file translated into this toolkit's config.

`translate_job(path)` reads the job's first process (config.process[0]: model, network, train, datasets, sample,
save, logging and its own keys) and returns a `Translation`: this toolkit's config, checked against the schema,
and every ai-toolkit setting it could not carry over, with the reason. `render(translation)` is the YAML.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from toolkit.aitk.job import Section, Translation, account_for_every_key, as_float, as_int, read_job
from toolkit.aitk.dataset_sections import VIDEO_FAMILIES, clip_frames, datasets
from toolkit.aitk.sections import dtype, network, save, train
from toolkit.errors import ConfigError, UserError

# ai-toolkit model.arch -> model.family (ai-toolkit has no HunyuanVideo 1.5 arch: its extensions_built_in models,
# 2026, list none). ai-toolkit's older is_* flags name an arch (toolkit/config_modules.py,
# ModelConfig); a model without either is sd1.
ARCHES = {"sd1": "sd", "sd2": "sd", "sdxl": "sdxl", "sd3": "sd3", "flux": "flux", "flex1": "flux", "flux2": "flux2",
          "chroma": "chroma", "qwen_image": "qwen_image", "zimage": "z_image", "wan21": "wan21", "wan22_14b": "wan22", "wan22_5b": "wan22",
          "ltx2": "ltx2", "ltx2.3": "ltx2", "qwen_image_edit_plus": "qwen_image_edit", "flux_kontext": "flux_kontext"}
# Arches whose family here would train another conditioning than the job's model was made for.
NOT_HERE = {"qwen_image_edit": "the first Qwen-Image-Edit conditions on one image through QwenImageEditPipeline; the "
                               "qwen_image_edit family here trains Qwen-Image-Edit-2509 / 2511 as "
                               "QwenImageEditPlusPipeline does\n  fix: train Qwen/Qwen-Image-Edit-2509 (ai-toolkit's "
                               "arch qwen_image_edit_plus), or translate the job by hand"}
ARCH_FLAGS = (("is_v2", "sd2"), ("is_v3", "sd3"), ("is_xl", "sdxl"), ("is_pixart", "pixart"),
              ("is_pixart_sigma", "pixart_sigma"), ("is_auraflow", "auraflow"), ("is_flux", "flux"),
              ("is_lumina2", "lumina2"), ("is_vega", "vega"), ("is_ssd", "ssd"))
QUANTIZED = {"qfloat8": "8bit", "float8": "8bit", "qint8": "8bit", "int8": "8bit", "uint8": "8bit", "qint4": "4bit",
             "int4": "4bit", "uint4": "4bit"}
SINGLE_FILES = (".safetensors", ".sft", ".ckpt", ".pt", ".pth", ".gguf")  # one-file checkpoints (ai-toolkit's UI
# default for some arches, LTX-2.3's among them)
SECTIONS = ("run", "device", "model", "network", "data", "train", "save", "sample", "log")


def arch_of(model: dict[str, Any], path: str) -> tuple[str, str]:
    """(ai-toolkit arch, this toolkit's family) of the model section; an arch with no family here is a UserError."""
    arch = model.get("arch")
    if arch is None:
        arch = next((name for flag, name in ARCH_FLAGS if model.get(flag)), "sd1")
    arch = str(arch).split(":")[0]  # ai-toolkit's UI may append ":tag"
    arch = "flux" if arch == "flex1" else arch
    if arch in NOT_HERE:
        raise UserError(f"{path}: model arch {arch!r} does not translate: {NOT_HERE[arch]}")
    if arch not in ARCHES:
        raise UserError(f"{path}: model arch {arch!r} has no family in this toolkit; the arches that translate: "
                        f"{', '.join(sorted(ARCHES))}")
    return arch, ARCHES[arch]


def translate_job(path: str | Path) -> Translation:
    name, process, others = read_job(path)
    model_data = process.get("model")
    if not isinstance(model_data, dict):
        raise UserError(f"{path}: config.process[0] has no model section")
    arch, family = arch_of(model_data, str(path))
    out = Translation(family)
    out.set("run.name", name, "config.name")
    for i, other in enumerate(others, start=1):
        out.skip(f"config.process[{i}]", (other or {}).get("type") if isinstance(other, dict) else other,
                 "only the job's first process is translated")
    s = Section(out, "", process)
    out.read("type")  # a LoRA trainer: read_job checked it
    s.take("type")
    folder = s.take("training_folder")
    if folder:
        out.set("run.output_dir", f"{folder}/${{run.name}}", "training_folder")
    device = str(s.take("device", "cuda:0"))
    if device == "cpu":
        out.set("device.backend", "cpu", "device")
    elif device in ("cuda", "cuda:0"):
        if "device" in s.given:
            out.same("device", device, "the first visible GPU trains (device.backend: auto)")
    else:
        out.skip("device", device, "the device is chosen here: select a GPU with CUDA_VISIBLE_DEVICES or "
                 "HIP_VISIBLE_DEVICES")
    model(out, Section(out, "model", s.take("model")), arch)
    network(out, Section(out, "network", s.take("network")))
    datasets(out, s.take("datasets"), s.take("trigger_word"))
    train(out, Section(out, "train", s.take("train")))
    save(out, Section(out, "save", s.take("save")))
    sample(out, Section(out, "sample", s.take("sample")))
    logging(out, Section(out, "logging", s.take("logging")))
    s.skip("performance_log_every", "every log line here has the step rate")
    s.done()
    account_for_every_key(out, process)
    check(out, path)
    return out


def model(out: Translation, s: Section, arch: str) -> None:
    s.take("arch")
    for flag, _ in ARCH_FLAGS:
        s.take(flag)
    out.read(*(s.key(name) for name in s.given if name == "arch" or name.startswith("is_") and name != "is_v_pred"))
    out.set("model.family", out.family, s.key("arch"), arch)
    path = s.take("name_or_path")
    if not path:
        raise UserError("the job's model section has no name_or_path\n  fix: add model.name_or_path (a Hub id or "
                        "folder) to the job")
    out.set("model.name_or_path", str(path), s.key("name_or_path"))
    if str(path).lower().endswith(SINGLE_FILES):
        out.note(s.key("name_or_path"), f"{path} is one checkpoint file; this toolkit loads a model from a diffusers "
                 "folder or Hub id (validate refuses the file): set model.name_or_path to the model's diffusers repo")
    if s.has("dtype"):
        weights = dtype(s.take("dtype"), s.key("dtype"), out)
        if weights:
            out.set("model.dtype", weights, s.key("dtype"))
    out.read(s.key("qtype"))
    quantize, qtype = s.take("quantize"), str(s.take("qtype", "qfloat8"))
    if not quantize and "qtype" in s.given:
        out.same(s.key("qtype"), qtype, "a quantization type, and quantize is off")
    if quantize is not None:
        bits = QUANTIZED.get(qtype.split("|")[0]) if quantize else "none"
        if bits is None:
            bits = "4bit" if "4" in qtype else "8bit"
            out.skip(s.key("qtype"), qtype, f"optimum-quanto types are not used here: {bits} with bitsandbytes/torchao")
        elif "|" in qtype:
            out.skip(s.key("qtype"), qtype, f"accuracy-recovery adapters are not available here: plain {bits}")
        out.set("model.quantize", bits, s.key("quantize"), quantize)
    if s.has("model_kwargs") and not s.rest["model_kwargs"]:
        s.same("model_kwargs", "no model arguments")
    kwargs = Section(out, s.key("model_kwargs"), s.take("model_kwargs"))
    high, low = kwargs.take("train_high_noise"), kwargs.take("train_low_noise")
    out.read(kwargs.key("train_low_noise"))
    if high is not None or low is not None:
        experts = {(True, True): "both", (True, False): "high_noise", (False, True): "low_noise"}.get(
            (high is not False, low is not False))
        if experts:
            out.set("train.experts", experts, kwargs.key("train_high_noise"))
    kwargs.done()
    te = "text encoders run once to fill the cache here, then are freed; they are not quantized"
    s.skip("quantize_te", te, when=False)
    s.skip("qtype_te", te)
    s.skip("low_vram", "the memory plan (model.quantize, model.expert_offload) is chosen from the GPU's memory",
           when=False)
    s.skip("is_v_pred", "v-prediction follows the model's scheduler config here", when=False)
    for name in ("lora_path", "assistant_lora_path", "inference_lora_path", "vae_path", "te_name_or_path",
                 "extras_name_or_path", "layer_offloading", "auto_memory"):
        s.skip(name, "not available here", when={"layer_offloading": False, "auto_memory": False}.get(name))
    s.done()


def sample(out: Translation, s: Section) -> None:
    flow = out.family not in ("sd", "sdxl")
    sampler = str(s.take("sampler", "ddpm")).lower()
    if (sampler == "flowmatch") != flow:
        out.skip(s.key("sampler"), sampler, "samples use the pipeline's own scheduler")
    elif "sampler" in s.given:
        out.same(s.key("sampler"), sampler, "samples use the pipeline's own scheduler, which is this one")
    out.set("sample.every", as_int(s.take("sample_every", 100), s.key("sample_every")), s.key("sample_every"))
    s.skip("sample_start_step", "samples start at the first sample.every step", when=0)
    for name in ("width", "height"):
        out.set(f"sample.{name}", as_int(s.take(name, 512), s.key(name)), s.key(name))
    prompts = [str(p) for p in s.take("prompts") or []]
    references: list[list[str]] = [[] for _ in prompts]
    for i, item in enumerate(s.take("samples") or []):
        entry = Section(out, s.key(f"samples[{i}]"), item if isinstance(item, dict) else {"prompt": item})
        if entry.has("prompt"):
            out.read(entry.key("prompt") if isinstance(item, dict) else s.key(f"samples[{i}]"))
            prompts.append(str(entry.take("prompt")))
            references.append(control_images(out, entry))
        for key in list(entry.rest):
            entry.skip(key, "one setting for every sample prompt here (the sample section's)")
    if "prompts" not in out.config.get("sample", {}):  # train.disable_sampling set it to none
        out.set("sample.prompts", prompts, s.key("prompts"))
        if any(references):
            out.set("sample.references", references, s.key("samples"))
    negative = s.take("neg")
    if negative:
        out.set("sample.negative_prompt", str(negative), s.key("neg"))
    elif "neg" in s.given:
        out.same(s.key("neg"), negative, "no negative prompt")
    out.set("sample.seed", as_int(s.take("seed", 0), s.key("seed")), s.key("seed"))
    walk = s.take("walk_seed", False)
    if not walk and len(prompts) > 1:
        out.skip(s.key("walk_seed"), walk, "each prompt is sampled with sample.seed plus its index here")
    elif "walk_seed" in s.given:
        out.same(s.key("walk_seed"), walk, "each prompt is sampled with sample.seed plus its index here, as "
                 "walk_seed does" if walk else "one prompt: sampled with sample.seed")
    out.set("sample.guidance_scale", as_float(s.take("guidance_scale", 7), s.key("guidance_scale")),
            s.key("guidance_scale"))
    out.set("sample.num_inference_steps", as_int(s.take("sample_steps", 20), s.key("sample_steps")),
            s.key("sample_steps"))
    frames, fps = s.take("num_frames", 1), s.take("fps")
    if out.family in VIDEO_FAMILIES:
        frames = as_int(frames, s.key("num_frames"))
        out.set("sample.num_frames", clip_frames(frames, s.key("num_frames"), out), s.key("num_frames"))
        if fps is not None:
            out.set("sample.fps", as_int(fps, s.key("fps")), s.key("fps"))
    else:
        if frames != 1:
            out.skip(s.key("num_frames"), frames, f"the {out.family} family makes images")
        elif "num_frames" in s.given:
            out.same(s.key("num_frames"), frames, f"the {out.family} family makes images")
        if fps is not None:
            out.same(s.key("fps"), fps, f"the {out.family} family makes images (no frame rate)")
    s.skip("network_multiplier", "samples apply the LoRA at its trained scale", when=1)
    s.skip("guidance_rescale", "not available here", when=0.0)
    s.skip("format", "samples are png (animated webp and mp4 for video)")
    s.done()


def control_images(out: Translation, entry: Section) -> list[str]:
    """A sample's ctrl_img (or ctrl_img_1 .. _3, the multi-control models') -> its sample.references list, for the
    families that take reference images (the others leave them to the not-translated list)."""
    from toolkit.aitk.dataset_sections import REFERENCE_FAMILIES

    if out.family not in REFERENCE_FAMILIES:
        return []
    names = [n for n in ("ctrl_img", "ctrl_img_1", "ctrl_img_2", "ctrl_img_3") if entry.has(n)]
    out.read(*(entry.key(n) for n in names))
    return [str(image) for image in (entry.take(n) for n in names) if image]


def logging(out: Translation, s: Section) -> None:
    if s.has("log_every"):
        out.set("log.every", as_int(s.take("log_every"), s.key("log_every")), s.key("log_every"))
    if s.take("use_wandb", False):
        out.set("log.wandb", True, s.key("use_wandb"))
        if s.has("project_name"):
            out.set("log.wandb_project", str(s.take("project_name")), s.key("project_name"))
    elif "use_wandb" in s.given:
        out.same(s.key("use_wandb"), False, "no Weights & Biases logging (log.wandb: false)")
    s.same("project_name", "a Weights & Biases setting, and use_wandb is off")
    s.skip("verbose", "not available here", when=False)
    s.skip("use_ui_logger", "ai-toolkit's UI is not used here", when=False)
    s.done()


def check(out: Translation, path: str | Path) -> None:
    """The translated config against this toolkit's schema (no device, data or model checks: those run at train)."""
    from toolkit.config.layers import Layer
    from toolkit.config.load import merge_layers

    try:
        merge_layers([Layer(f"translation of {path}", out.config)])
    except ConfigError as err:
        raise ConfigError(err.problems, header=f"{path}: the translated config does not validate") from None


def render(out: Translation, source: str | Path) -> str:
    """The config as YAML, its sections in the usual order, headed by where it came from."""
    ordered = {section: out.config[section] for section in SECTIONS if section in out.config}
    lines = [f"# translated from the ai-toolkit job {source} by `./start_toolkit.sh import-aitk`",
             f"# {len(out.skipped)} setting{'s' if len(out.skipped) != 1 else ''} not translated, "
             f"{len(out.as_here)} as this toolkit does anyway (see the end)"]
    body = yaml.safe_dump(ordered, sort_keys=False, default_flow_style=False, allow_unicode=True, width=120)
    tail = [f"# not translated: {s.key} = {s.value!r}: {s.reason}" for s in out.skipped]
    tail += [f"# changed: {note}" for note in out.notes]
    tail += [f"# as here: {s.key} = {s.value!r}: {s.reason}" for s in out.as_here]
    return "\n".join(lines) + "\n" + body + ("\n".join(tail) + "\n" if tail else "")
