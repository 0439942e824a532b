"""The static stage's checks of what the config asks for that the run could only refuse once the model had loaded:
GRPO's rewards, save.format's package, captions a family caches whole, reference and start images per sample, a
sample's size.

Each rule here decides nothing: it adds to `facts.problems` what `validate` (and `train`, before anything loads)
reports, naming the key and the fix. What a family takes is read from its FamilySpec (config/families.py).
"""

from __future__ import annotations

import toolkit.plan.llm_rules  # noqa: F401  (its rules registered before these checks)
from toolkit.config.families import FAMILY_SPECS, family_spec
from toolkit.plan.decisions import Decision
from toolkit.plan.rules import Facts, rule
from toolkit.plan.static_rules import STATIC, static_decision


@rule("train.reward", STATIC)
def reward_checks(f: Facts) -> None:
    """GRPO's rewards, before the model loads: built-in names known, a module:function's module found and defining
    the function (read, not run: models/rewards.py's missing_reward), regex given its pattern, the pattern an
    expression Python's re compiles."""
    if not f.reads("train.reward") or f.asked("train.objective") != "grpo":
        return None
    import re

    from toolkit.models.rewards import BUILTIN_REWARDS, IMPORT_FIX, missing_reward

    names, pattern = list(f.asked("train.reward") or []), f.asked("train.reward_pattern")
    for name in names:
        if ":" not in name and name not in BUILTIN_REWARDS:
            f.problems.append(f"'train.reward': unknown reward '{name}': use one of {', '.join(BUILTIN_REWARDS)}, "
                              "or module:function")
        elif ":" in name and (why := missing_reward(name)):
            f.problems.append(f"'train.reward': cannot import '{name}': {why}: {IMPORT_FIX}")
    if "regex" in names and not pattern:
        f.problems.append("'train.reward': the regex reward needs train.reward_pattern: set it to the expression a "
                          "good completion contains")
    if pattern:
        try:
            re.compile(pattern)
        except re.error as err:
            f.problems.append(f"'train.reward_pattern': {pattern!r} is not a regular expression ({err}): fix it "
                              "(Python's re syntax)")
    return None


@rule("save.format", STATIC)
def save_format(f: Facts) -> Decision | None:
    """auto: the comfyui copy too for a family whose main LoRA file ComfyUI reads only in part (FamilySpec.comfyui_auto;
    its LoKr / LoHa and DoRA files have no ComfyUI-named copy);
    save.format=gguf finds its package before the model loads (the base's architecture is checked once its config
    has loaded, still before the first step)."""
    spec = family_spec(f.family)
    if f.asked("save.format") == "auto" and spec.comfyui_auto and f.asked("network.type") == "lora":
        return static_decision("save.format", "comfyui", f"also <run>_comfyui.safetensors, which ComfyUI reads "
                               f"whole: {spec.comfyui_auto}; pytorch_lora_weights.safetensors is for diffusers")
    if f.asked("save.format") != "gguf":
        return None
    import importlib.util

    from toolkit.models.llm_gguf import GGUF_FIX, GGUF_MISSING

    if importlib.util.find_spec("gguf") is None:
        f.problems.append(f"'save.format': {GGUF_MISSING}: {GGUF_FIX}")
    return None


# Settings that change a sample's caption (or leave its encoding uncached) from step to step: (key, whether the
# value does, the value that does not).
VARYING_CAPTIONS = (
    ("data.caption_dropout", lambda value: value > 0, "data.caption_dropout=0"),
    ("data.tag_dropout", lambda value: value > 0, "data.tag_dropout=0"),
    ("data.shuffle_tags", lambda value: value is True, "data.shuffle_tags=false"),
    ("data.cache_latents", lambda value: value is False, "data.cache_latents=true"),
    ("data.cache_text_embeddings", lambda value: value is False, "data.cache_text_embeddings=true"),
)


@rule("data.caption_dropout", STATIC)
def fixed_caption_checks(f: Facts) -> None:
    """A family that caches each caption's encoding whole (FamilySpec.fixed_captions: qwen_image_edit encodes it
    with the target's reference images) cannot drop, shuffle or re-encode captions per step."""
    why = family_spec(f.family).fixed_captions
    if not why:
        return None
    for key, varies, fix in VARYING_CAPTIONS:
        value = f.asked(key)
        if varies(value):
            shown = str(value).lower() if isinstance(value, bool) else value
            f.problems.append(f"'{key}' is {shown}: {why}, so captions cannot change per step: set {fix}")
    return None


def _reference_count(references: tuple[int, int | None]) -> str:
    """'1', '1-3', 'any number, or none': how many reference images a family takes."""
    fewest, most = references
    if most is None:
        return "any number" + (", or none" if fewest == 0 else f" from {fewest}")
    return str(most) if fewest == most else f"{fewest}-{most}"


@rule("data.references", STATIC)
def reference_checks(f: Facts) -> None:
    """The reference images per target (data.references) and per sample prompt (sample.references) against what
    the family's pipeline takes (FamilySpec.references); the sample lists one per prompt. Their files are checked
    with the other paths (preflight: sample_reference_problems), the data folder's when it is scanned."""
    spec = family_spec(f.family)
    if spec.references is None:
        return None
    fewest, most = spec.references
    count = _reference_count(spec.references)
    takes = f"{f.family}'s pipeline takes {count} reference image{'' if count == '1' else 's'}"
    asked = f.asked("data.references")
    if isinstance(asked, int) and most is not None and asked > most:
        several = [f"{s.name} ({_reference_count(s.references)})" for s in FAMILY_SPECS.values()
                   if s.references is not None and (s.references[1] is None or s.references[1] >= asked)]
        f.problems.append(f"'data.references' is {asked}, and {takes} per target: set data.references="
                          f"{most} (or auto), or train a family that takes {asked}: {', '.join(several)}")
    prompts, lists = list(f.asked("sample.prompts") or []), [list(r) for r in f.asked("sample.references") or []]
    if not prompts:
        return None  # nothing is sampled: the references are not read
    if lists and len(lists) != len(prompts):
        f.problems.append(f"'sample.references': {len(lists)} list{'s' if len(lists) != 1 else ''} for "
                          f"{len(prompts)} prompts: give one list of "
                          "reference images per prompt, in the order of sample.prompts")
    elif fewest > 0 and (not lists or not all(lists)):
        f.problems.append(f"'sample.references': {f.family} edits reference images, and a sample prompt has none: "
                          "set sample.references: [[ref.png], ...] (one list per prompt), or sample.prompts: []")
    for n, images in enumerate(lists):
        if most is not None and len(images) > most:
            f.problems.append(f"'sample.references[{n}]' holds {len(images)} images, and {takes} per prompt: keep "
                              f"{most}")
    return None


def _folder_pipeline(f: Facts) -> str | None:
    """The pipeline class of the model folder where it is on this machine already (preflight/model_location.py)."""
    from toolkit.preflight.model_location import pipeline_class_of

    return pipeline_class_of(f.asked("model.name_or_path"), f.asked("model.revision"))


def _video_task(f: Facts, i2v_pipeline: str) -> tuple[str | None, str]:
    """(t2v or i2v, why): model.task as set, or under auto the pipeline of the model folder where it is on this
    machine already; (None, '') where it is not (the run reads it once downloaded), or contradicts model.task."""
    asked, pipeline = f.asked("model.task"), _folder_pipeline(f)
    if asked == "t2v" and pipeline == i2v_pipeline:
        return None, ""  # task_checks names it
    if asked == "i2v" and pipeline not in (None, i2v_pipeline):
        return None, ""  # whether it can (TI2V-5B can): its transformer's inputs tell, once it loads
    if asked != "auto":
        return asked, f"model.task={asked}"
    if pipeline is None:
        return None, ""
    return ("i2v" if pipeline == i2v_pipeline else "t2v"), f"model.task=auto: its folder holds a {pipeline}"


@rule("model.task", STATIC)
def task_checks(f: Facts) -> None:
    """model.task=t2v on a model whose folder holds the family's image-to-video pipeline (i2v on a text-to-video
    model is told by its transformer's inputs, once it loads: TI2V-5B's folder is a text-to-video pipeline's)."""
    spec = family_spec(f.family)
    if not spec.i2v_pipeline or f.asked("model.task") != "t2v" or _folder_pipeline(f) != spec.i2v_pipeline:
        return None
    f.problems.append(f"'model.task' is t2v, and {f.asked('model.name_or_path')} is an image-to-video model (its "
                      f"folder holds a {spec.i2v_pipeline}): set model.task=i2v (or auto), or use a text-to-video "
                      "model")
    return None


@rule("sample.images", STATIC)
def start_image_checks(f: Facts) -> None:
    """Video samples and their start images (sample.images): one per prompt, or one for all, for an image-to-video
    model; none for a text-to-video one. The task is model.task's, or under auto the model folder's
    (FamilySpec.i2v_pipeline) where the model is on this machine."""
    spec = family_spec(f.family)
    prompts, images = list(f.asked("sample.prompts") or []), list(f.asked("sample.images") or [])
    if not spec.i2v_pipeline or not (images or prompts):
        return None
    task, why = _video_task(f, spec.i2v_pipeline)
    name = f.asked("model.name_or_path")
    if task == "t2v" and images:
        f.problems.append(f"'sample.images': {name} trains text-to-video ({why}), whose samples take no start image: "
                          "remove sample.images, or train an image-to-video model (model.task=i2v)")
    elif task == "i2v" and prompts and not images:
        f.problems.append(f"'sample.images' is empty, and {name} trains image-to-video ({why}): each sample starts "
                          "from an image: set sample.images: [path/to/start.png] (one per prompt, or one for all), "
                          "or sample.prompts: []")
    elif images and prompts and len(images) not in (1, len(prompts)):
        f.problems.append(f"'sample.images': {len(images)} images for {len(prompts)} prompts: give one image per "
                          "prompt, or one for all")
    return None


@rule("sample.width", STATIC)
def sample_size_checks(f: Facts) -> None:
    """A sample.width / sample.height given as a size the family's pipeline cannot draw (FamilySpec.sample_multiple):
    diffusers refuses it only when the first sample is drawn, after training has begun, or resizes it without a word.
    0 (data.resolution) is rounded down to the multiple when the samples are drawn, and said then."""
    multiple = family_spec(f.family).sample_multiple
    if not multiple or not f.asked("sample.prompts"):
        return None
    for side in ("width", "height"):
        value = f.asked(f"sample.{side}")
        if isinstance(value, int) and value and value % multiple:
            lower, higher = max(multiple, value // multiple * multiple), (value // multiple + 1) * multiple
            f.problems.append(f"'sample.{side}' is {value}, and {f.family}'s pipeline draws samples in multiples of "
                              f"{multiple} pixels: set sample.{side} to {lower} or {higher}")
    return None
