"""ai-toolkit's sections, one function each, translated into this toolkit's keys (its datasets:
dataset_sections.py).

Where a job leaves a setting out, ai-toolkit's default (toolkit/config_modules.py) is what it trained with, so
the translation writes that default when it differs from this toolkit's (learning rate 1e-6, rank 4, alpha 1.0,
...). Settings that only change speed or memory are carried over when the job sets them.
"""

from __future__ import annotations

from typing import Any

from toolkit.aitk.job import Section, Translation, as_float, as_int

# ai-toolkit dtype names -> train.precision / save.dtype / model.dtype
DTYPES = {"fp16": "fp16", "float16": "fp16", "half": "fp16", "bf16": "bf16", "bfloat16": "bf16", "fp32": "fp32",
          "float32": "fp32", "float": "fp32", "full": "fp32"}
# ai-toolkit optimizer name -> (this toolkit's optimizer, what ai-toolkit's constructor passes that ours would not)
OPTIMIZERS = {
    "adamw": ("adamw", {"eps": 1e-6, "weight_decay": 0.01}),        # torch AdamW's default weight decay
    "adamw8bit": ("adamw8bit", {"eps": 1e-6, "weight_decay": 0.01}),  # bitsandbytes AdamW8bit's default
    "adam": ("adamw", {"eps": 1e-6, "weight_decay": 0.0}),           # Adam = AdamW without weight decay
    "adam8bit": ("adamw8bit", {"eps": 1e-6, "weight_decay": 0.0}),
    "lion": ("lion", {}), "lion8bit": ("lion8bit", {}), "adafactor": ("adafactor", {}),
    "prodigy": ("prodigy", {"eps": 1e-6}),
}
LR_SCHEDULERS = ("constant", "constant_with_warmup", "linear", "cosine", "cosine_with_restarts")
# ai-toolkit's flow-matching timestep_type -> (train.timestep_sampling, train.flow_shift): its sigmoid and linear
# draw unshifted sigmas (CustomFlowMatchEulerDiscreteScheduler.set_train_timesteps); its shift types apply the
# scheduler's shift as inference does, which is this toolkit's flow_shift auto.
TIMESTEP_TYPES = {"sigmoid": ("logit_normal", 1.0), "linear": ("uniform", 1.0), "shift": ("uniform", None),
                  "flux_shift": ("uniform", None), "lumina2_shift": ("uniform", None)}
SD_FAMILIES = ("sd", "sdxl")


def dtype(value: Any, key: str, out: Translation) -> str | None:
    name = DTYPES.get(str(value).lower())
    if name is None:
        out.skip(key, value, f"unknown dtype; one of {', '.join(sorted(DTYPES))}")
    return name


def lokr_network(out: Translation, s: Section) -> None:
    """ai-toolkit's LoKr: lokr_factor (-1 auto) and lokr_full_rank (both Kronecker factors full, scale 1; linear
    and linear_alpha then unused), the same keys here; old_lokr_format is how ai-toolkit names its own file's keys."""
    full = s.take("lokr_full_rank", False)
    if not isinstance(full, bool):
        out.skip(s.key("lokr_full_rank"), full, "expected true or false")
    elif full:
        out.set("network.lokr_full_rank", True, s.key("lokr_full_rank"))
    factor = s.take("lokr_factor", -1)
    if factor != -1:
        out.set("network.lokr_factor", as_int(factor, s.key("lokr_factor")), s.key("lokr_factor"))
    s.skip("old_lokr_format", "ai-toolkit's older LoKr key names: the file here has LyCORIS keys (lokr_w1, "
           "lokr_w2, ...), which ComfyUI and kohya read", when=False)


def network(out: Translation, s: Section) -> None:
    kind = str(s.take("type", "lora")).lower()
    if kind == "lora" and "type" in s.given:
        out.same(s.key("type"), kind, "a LoRA is trained here")
    elif kind == "lokr":
        out.set("network.type", kind, s.key("type"))
    elif kind != "lora":
        reason = {"locon": "LoCon's convolution layers are not adapted here (linear layers only)"}
        out.skip(s.key("type"), kind, reason.get(kind, "only LoRA, DoRA, LoKr and LoHa adapters are available "
                                                       "here") + "; a LoRA of the same rank and alpha is trained instead")
    if kind == "lokr":
        lokr_network(out, s)
    else:  # ai-toolkit's LoRA modules start A kaiming-uniform (toolkit/lora_special.py), the job's lr assumes it
        out.set("network.init", "kaiming", s.key("type"), kind)
        out.note(s.key("type"), "network.init: kaiming, as ai-toolkit starts a LoRA (this toolkit's diffusion default "
                 "is gaussian), so the job's learning rate takes the steps it took there")
    for lokr in ("lokr_full_rank", "lokr_factor", "old_lokr_format"):
        s.skip(lokr, "applies to LoKr only")
    out.read(s.key("rank"), s.key("alpha"))  # ai-toolkit's older names of linear and linear_alpha
    rank = s.take("rank", s.take("linear"))
    rank = 4 if rank is None else as_int(rank, s.key("linear"))
    alpha = s.take("alpha", 1.0)
    alpha = s.take("linear_alpha", alpha)
    out.set("network.rank", rank, s.key("linear"))
    out.set("network.alpha", as_float(alpha, s.key("linear_alpha")), s.key("linear_alpha"))
    s.skip("conv", "LoRA on convolution layers: this toolkit adapts linear layers only", when=None)
    s.skip("conv_alpha", "LoRA on convolution layers: this toolkit adapts linear layers only", when=None)
    dropout = s.take("dropout")
    if dropout is not None:
        out.set("network.dropout", as_float(dropout, s.key("dropout")), s.key("dropout"))
    s.skip("network_kwargs", "module filters by name (only_if_contains, ignore_if_contains): set "
           "network.target_modules to a list of module names instead", when={})
    s.skip("transformer_only", "LoRA outside the transformer: sd/sdxl take train.train_text_encoder", when=True)
    if s.rest.get("pretrained_lora_path"):
        out.set("network.init_from", str(s.take("pretrained_lora_path")), s.key("pretrained_lora_path"))
    s.same("pretrained_lora_path", "the LoRA starts from random weights here too")
    s.skip("lorm", "LoRM (low-rank extraction) is not available here")
    s.skip("split_multistage_loras", "Wan 2.2's two experts always save their LoRAs apart here (final/high_noise/, "
           "final/low_noise/)", when=True)
    s.done()


def save(out: Translation, s: Section) -> None:
    saved = dtype(s.take("dtype", "float16"), s.key("dtype"), out)
    if saved:
        out.set("save.dtype", saved, s.key("dtype"))
    out.set("save.every", as_int(s.take("save_every", 1000), s.key("save_every")), s.key("save_every"))
    out.set("save.keep_last", max(1, as_int(s.take("max_step_saves_to_keep", 5), s.key("max_step_saves_to_keep"))),
            s.key("max_step_saves_to_keep"))
    if s.has("save_format"):
        fmt = s.take("save_format")
        if fmt == "diffusers":
            out.set("save.format", "diffusers", s.key("save_format"))
        elif fmt == "safetensors":
            out.same(s.key("save_format"), fmt, "LoRA files are .safetensors here")
        else:
            out.skip(s.key("save_format"), fmt, "unknown save format")
    push = s.take("push_to_hub", False)
    if push:
        out.skip(s.key("push_to_hub"), push, "uploading to the Hugging Face Hub is not done here: upload final/")
        s.skip("hf_repo_id", "Hub upload")
        s.skip("hf_private", "Hub upload")
    else:  # the Hub settings do nothing without push_to_hub
        if "push_to_hub" in s.given:
            out.same(s.key("push_to_hub"), push, "nothing is uploaded to the Hugging Face Hub")
        s.same("hf_repo_id", "a Hub upload setting, and push_to_hub is off")
        s.same("hf_private", "a Hub upload setting, and push_to_hub is off")
    s.done()



def train(out: Translation, s: Section) -> None:
    family = out.family
    out.set("train.steps", as_int(s.take("steps", 1000), s.key("steps")), s.key("steps"))
    out.set("train.batch_size", as_int(s.take("batch_size", 1), s.key("batch_size")), s.key("batch_size"))
    out.read(s.key("gradient_accumulation_steps"))  # ai-toolkit's older name of gradient_accumulation
    accum = as_int(s.take("gradient_accumulation", 1), s.key("gradient_accumulation"))
    legacy = as_int(s.take("gradient_accumulation_steps", 1), s.key("gradient_accumulation_steps"))
    if legacy < 1:
        out.skip(s.key("gradient_accumulation_steps"), legacy, "accumulating a whole epoch (-1) is not available here")
    accum = max(accum, legacy)
    if accum > 1 or {"gradient_accumulation", "gradient_accumulation_steps"} & s.given:
        out.set("train.grad_accum", max(accum, 1), s.key("gradient_accumulation"))
    lr = as_float(s.take("lr", 1e-6), s.key("lr"))
    unet_lr = s.take("unet_lr")
    if unet_lr is not None and as_float(unet_lr, s.key("unet_lr")) != lr:
        lr = as_float(unet_lr, s.key("unet_lr"))
        out.note(s.key("unet_lr"), f"train.lr {lr} (the denoiser's learning rate)")
    out.read(s.key("unet_lr"))
    if s.has("text_encoder_lr") and as_float(s.rest["text_encoder_lr"], s.key("text_encoder_lr")) == lr:
        s.same("text_encoder_lr", "one learning rate for every trained module here: train.lr")
    s.skip("text_encoder_lr", "one learning rate for every trained module here: train.lr", when=None)
    for name in ("refiner_lr", "embedding_lr", "adapter_lr"):
        s.skip(name, "no refiner, embedding or adapter trains here", when=lr)
    optimizer(out, s, lr)
    scheduler = str(s.take("lr_scheduler", "constant"))
    params = s.take("lr_scheduler_params") or {}
    if scheduler in LR_SCHEDULERS:
        out.set("train.lr_scheduler", scheduler, s.key("lr_scheduler"))
    else:
        out.skip(s.key("lr_scheduler"), scheduler, f"not available here ({', '.join(LR_SCHEDULERS)}): constant")
    sched = Section(out, s.key("lr_scheduler_params"), params)
    if sched.has("num_warmup_steps"):
        out.set("train.warmup_steps", as_int(sched.take("num_warmup_steps"), sched.key("num_warmup_steps")),
                sched.key("num_warmup_steps"))
    sched.done()
    precision = dtype(s.take("dtype", "fp32"), s.key("dtype"), out)
    if precision:
        out.set("train.precision", precision, s.key("dtype"))
    if s.has("gradient_checkpointing"):
        out.set("train.gradient_checkpointing", bool(s.take("gradient_checkpointing")), s.key("gradient_checkpointing"))
    out.set("train.max_grad_norm", as_float(s.take("max_grad_norm", 1.0), s.key("max_grad_norm")), s.key("max_grad_norm"))
    ema = s.take("ema_config") or {}
    if isinstance(ema, dict) and ema.get("use_ema"):
        out.set("train.ema_decay", as_float(ema.get("ema_decay", 0.999), s.key("ema_config.ema_decay")),
                s.key("ema_config"))
        for extra in sorted(set(ema) - {"use_ema", "ema_decay"}):
            out.skip(s.key(f"ema_config.{extra}"), ema[extra])
    noise = str(s.take("noise_scheduler", "ddpm")).lower()
    flow = family not in SD_FAMILIES
    timesteps = str(s.take("timestep_type", "sigmoid"))
    if any(s.rest.get(name) for name in ("linear_timesteps", "linear_timesteps2")):  # as ai-toolkit: linear wins
        out.read(s.key("linear_timesteps"), s.key("linear_timesteps2"))
        s.take("linear_timesteps"), s.take("linear_timesteps2")
        timesteps = "linear"
    if flow and timesteps in TIMESTEP_TYPES:  # ai-toolkit's DDPM training ignores timestep_type (uniform steps)
        sampling, shift = TIMESTEP_TYPES[timesteps]
        out.set("train.timestep_sampling", sampling, s.key("timestep_type"), timesteps)
        if shift is not None:
            out.set("train.flow_shift", shift, s.key("timestep_type"), timesteps)
    elif flow:
        out.skip(s.key("timestep_type"), timesteps, f"not available here ({', '.join(TIMESTEP_TYPES)} are): the "
                 "family's usual sampling")
    how = f"the {family} family trains with {'rectified flow' if flow else 'its DDPM noise schedule'}"
    if (noise == "flowmatch") != flow:
        out.skip(s.key("noise_scheduler"), noise, how)
    elif "noise_scheduler" in s.given:
        out.same(s.key("noise_scheduler"), noise, how)
    if not flow and "timestep_type" in s.given:
        out.same(s.key("timestep_type"), timesteps, "ai-toolkit's DDPM training draws uniform timesteps, as here")
    for name in ("linear_timesteps", "linear_timesteps2"):
        s.same(name, "off: the timestep_type applies")
    if s.take("train_text_encoder", False):
        out.set("train.train_text_encoder", True, s.key("train_text_encoder"))
    elif "train_text_encoder" in s.given:
        out.same(s.key("train_text_encoder"), False, "the text encoders are not trained here either")
    for name, key in (("noise_offset", "train.noise_offset"), ("min_snr_gamma", "train.min_snr_gamma"),
                      ("snr_gamma", "train.min_snr_gamma")):
        value = s.take(name)
        if value:
            out.set(key, as_float(value, s.key(name)), s.key(name))
    preservation(out, s)
    if s.has("switch_boundary_every"):
        out.set("train.expert_switch_every", as_int(s.take("switch_boundary_every"), s.key("switch_boundary_every")),
                s.key("switch_boundary_every"))
    if s.take("disable_sampling", False):
        out.set("sample.prompts", [], s.key("disable_sampling"))
    elif "disable_sampling" in s.given:
        out.same(s.key("disable_sampling"), False, "samples are taken at sample.every")
    s.skip("train_unet", "the denoiser always trains here", when=True)
    s.skip("skip_first_sample", "no sample is taken before the first step here", when=True)
    s.skip("loss_type", "the loss is the mean squared error here", when="mse")
    s.skip("content_or_style", "timestep weighting by content/style is not available here", when="balanced")
    s.skip("unload_text_encoder", "text encoders are freed once their outputs are cached", when=False)
    s.skip("cache_text_embeddings", "text embeddings are cached (data.cache_text_embeddings)", when=True)
    s.skip("xformers", "attention runs through PyTorch's SDPA", when=False)
    s.skip("sdp", "attention runs through PyTorch's SDPA", when=True)
    s.skip("attention_backend", "attention runs through PyTorch's SDPA", when="native")
    s.done()


def preservation(out: Translation, s: Section) -> None:
    """reg_weight -> train.prior_loss_weight; diff_output_preservation (with its class and multiplier) ->
    train.dop_class and train.dop_weight."""
    if s.has("reg_weight"):
        out.set("train.prior_loss_weight", as_float(s.take("reg_weight"), s.key("reg_weight")), s.key("reg_weight"))
    if s.take("diff_output_preservation", False):
        out.read(s.key("diff_output_preservation"))
        out.set("train.dop_class", str(s.take("diff_output_preservation_class", "person")),
                s.key("diff_output_preservation_class"))
        out.set("train.dop_weight", as_float(s.take("diff_output_preservation_multiplier", 1.0),
                                             s.key("diff_output_preservation_multiplier")),
                s.key("diff_output_preservation_multiplier"))
    else:
        if "diff_output_preservation" in s.given:
            out.same(s.key("diff_output_preservation"), False, "no output preservation (train.dop_class unset)")
        for name in ("diff_output_preservation_class", "diff_output_preservation_multiplier"):
            s.same(name, "diff_output_preservation is off")


def optimizer(out: Translation, s: Section, lr: float) -> None:
    name = str(s.take("optimizer", "adamw")).lower()
    ours, implied = OPTIMIZERS.get(name, (None, {}))
    if ours is None:
        ours, implied = OPTIMIZERS["adamw8bit"]
        out.skip(s.key("optimizer"), name, f"not available here; adamw8bit instead (available: "
                 f"{', '.join(sorted(OPTIMIZERS))})")
    elif ours != name:
        out.note(s.key("optimizer"), f"{name} -> train.optimizer {ours} with weight_decay 0")
    if ours == "prodigy" and lr < 0.1:  # ai-toolkit runs Prodigy (and D-Adaptation) at lr 1.0 below 0.1
        out.note(s.key("lr"), f"{lr} -> 1.0 (ai-toolkit trains Prodigy at 1.0 when lr is under 0.1)")
        lr = 1.0
    out.set("train.lr", lr, s.key("lr"))
    out.set("train.optimizer", ours, s.key("optimizer"), name)
    params = Section(out, s.key("optimizer_params"), s.take("optimizer_params"))
    settings = dict(implied)
    for key in ("weight_decay", "eps"):
        if params.has(key):
            settings[key] = as_float(params.take(key), params.key(key))
    if params.has("betas"):
        settings["betas"] = [as_float(b, params.key("betas")) for b in params.take("betas")]
    for key, value in settings.items():
        out.set(f"train.{key}", value, params.key(key))
    extra = {}
    from toolkit.optim.specs import optimizer_spec

    for key in list(params.rest):
        if key in optimizer_spec(ours).accepts:
            extra[key] = params.take(key)
    if extra:
        out.set("train.optimizer_args", extra, params.key(next(iter(extra))))
    params.done()
