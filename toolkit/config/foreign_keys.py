"""Other trainers' key names and the toolkit's key for each: a did-you-mean for users of kohya's sd-scripts,
ai-toolkit, diffusers' training scripts, Hugging Face's Trainer (unsloth, TRL) and axolotl.

Looked up by the key's last name wherever it was written (`learning_rate`, `train.learning_rate`), before the
spelling-based suggestion, which cannot find `lr` from `learning_rate`.
"""

from __future__ import annotations

from typing import NamedTuple


class ForeignKey(NamedTuple):
    target: str          # the toolkit's dotted key
    used_by: str         # whose name it is, for the message
    note: str = ""       # what differs, when the meaning is not quite the same


KOHYA, DIFFUSERS, AITK, HF = "kohya's sd-scripts", "diffusers' training scripts", "ai-toolkit", "Hugging Face's Trainer"
_STEPS_NOT_EPOCHS = "the toolkit counts optimizer steps, not epochs"

FOREIGN_KEYS: dict[str, ForeignKey] = {
    # run
    "output_dir": ForeignKey("run.output_dir", f"{KOHYA}, {DIFFUSERS} and {HF}"),
    "training_folder": ForeignKey("run.output_dir", AITK, "the run folder itself, not a folder of runs"),
    "output_name": ForeignKey("run.name", KOHYA),
    "seed": ForeignKey("run.seed", f"{KOHYA}, {DIFFUSERS} and {HF}"),
    # model
    "pretrained_model_name_or_path": ForeignKey("model.name_or_path", f"{KOHYA} and {DIFFUSERS}"),
    "model_name_or_path": ForeignKey("model.name_or_path", HF),
    "base_model": ForeignKey("model.name_or_path", "axolotl"),
    "model_name": ForeignKey("model.name_or_path", "unsloth"),
    "is_flux": ForeignKey("model.family", AITK, "model.family: flux"),
    "is_xl": ForeignKey("model.family", AITK, "model.family: sdxl"),
    "quantize_base": ForeignKey("model.quantize", AITK),
    "load_in_4bit": ForeignKey("model.quantize", "unsloth and axolotl", "model.quantize: 4bit"),
    "load_in_8bit": ForeignKey("model.quantize", "axolotl", "model.quantize: 8bit"),
    # network
    "network_dim": ForeignKey("network.rank", KOHYA),
    "linear": ForeignKey("network.rank", AITK),
    "lora_r": ForeignKey("network.rank", "axolotl"),
    "lora_rank": ForeignKey("network.rank", DIFFUSERS),
    "network_alpha": ForeignKey("network.alpha", KOHYA),
    "linear_alpha": ForeignKey("network.alpha", AITK),
    "lora_alpha": ForeignKey("network.alpha", "PEFT and axolotl"),
    "network_dropout": ForeignKey("network.dropout", KOHYA),
    "lora_dropout": ForeignKey("network.dropout", "PEFT and axolotl"),
    "lora_target_modules": ForeignKey("network.target_modules", "axolotl"),
    "use_dora": ForeignKey("network.type", "PEFT", "network.type: dora"),
    "use_rslora": ForeignKey("network.rslora", "PEFT"),
    "init_lora_weights": ForeignKey("network.init", "PEFT", "network.init: gaussian or kaiming (PEFT's true)"),
    "finetune_vision_layers": ForeignKey("network.vision_layers", "unsloth"),
    "freeze_vision_tower": ForeignKey("network.vision_layers", "LLaMA-Factory", "the opposite sense: "
                                      "network.vision_layers: true trains a LoRA on the vision tower"),
    "lokr_factor": ForeignKey("network.lokr_factor", AITK),
    "lokr_full_rank": ForeignKey("network.lokr_full_rank", AITK),
    "validate_every_n_steps": ForeignKey("eval.every", KOHYA, "the diffusion families; eval.path names the images"),
    "validation_seed": ForeignKey("eval.seed", KOHYA),
    "network_weights": ForeignKey("network.init_from", KOHYA),
    "pretrained_lora_path": ForeignKey("network.init_from", AITK),
    # data
    "num_repeats": ForeignKey("data.repeats", f"{KOHYA} and {AITK}"),
    "shrink_video_to_frames": ForeignKey("data.frame_extraction", AITK,
                                         "true is data.frame_extraction: spread (the default); false: head"),
    "video_directory": ForeignKey("data.path", "musubi-tuner"),
    "is_reg": ForeignKey("data.is_regularization", f"{KOHYA} and {AITK}"),
    "reg_data_dir": ForeignKey("data.datasets", KOHYA, "a data.datasets entry with is_regularization: true"),
    "masked_loss": ForeignKey("data.masked_loss", KOHYA),
    "mask_path": ForeignKey("data.mask_folder", AITK, "with data.masked_loss: true"),
    "mask_min_value": ForeignKey("data.mask_min", AITK),
    "train_data_dir": ForeignKey("data.path", KOHYA),
    "instance_data_dir": ForeignKey("data.path", DIFFUSERS),
    "dataset_dir": ForeignKey("data.path", "other trainers"),
    "folder_path": ForeignKey("data.path", AITK),
    "datasets": ForeignKey("data.path", f"{AITK} and axolotl", "one dataset: data.path"),
    "dataset_name": ForeignKey("data.path", f"{DIFFUSERS} and {HF}", "a local file or folder, not a Hub dataset"),
    "resolution": ForeignKey("data.resolution", f"{KOHYA}, {DIFFUSERS} and {AITK}"),
    "caption_extension": ForeignKey("data.caption_ext", KOHYA),
    "caption_ext": ForeignKey("data.caption_ext", AITK),
    "shuffle_caption": ForeignKey("data.shuffle_tags", KOHYA),
    "shuffle_tokens": ForeignKey("data.shuffle_tags", AITK),
    "caption_dropout_rate": ForeignKey("data.caption_dropout", f"{KOHYA} and {AITK}"),
    "caption_tag_dropout_rate": ForeignKey("data.tag_dropout", KOHYA),
    "flip_aug": ForeignKey("data.random_flip", KOHYA),
    "flip_x": ForeignKey("data.random_flip", AITK),
    "random_crop": ForeignKey("data.crop_variants", KOHYA, "N > 1 crops per image, each cached"),
    "bucket_reso_steps": ForeignKey("data.bucket_step", KOHYA),
    "min_bucket_reso": ForeignKey("data.min_bucket_side", KOHYA),
    "max_bucket_reso": ForeignKey("data.max_bucket_side", KOHYA),
    "cache_text_encoder_outputs": ForeignKey("data.cache_text_embeddings", KOHYA),
    "max_seq_length": ForeignKey("data.max_seq_len", "TRL and unsloth"),
    "sequence_len": ForeignKey("data.max_seq_len", "axolotl"),
    "cutoff_len": ForeignKey("data.max_seq_len", "LLaMA-Factory"),
    "dataset_text_field": ForeignKey("data.text_field", "TRL"),
    "image_max_pixels": ForeignKey("data.max_pixels", "LLaMA-Factory"),
    "image_min_pixels": ForeignKey("data.min_pixels", "LLaMA-Factory"),
    # train
    "reg_weight": ForeignKey("train.prior_loss_weight", AITK),
    "diff_output_preservation_class": ForeignKey("train.dop_class", AITK),
    "diff_output_preservation_multiplier": ForeignKey("train.dop_weight", AITK),
    "diff_output_preservation": ForeignKey("train.dop_class", AITK, "setting the class word turns it on"),
    "learning_rate": ForeignKey("train.lr", f"{KOHYA}, {DIFFUSERS} and {HF}"),
    "unet_lr": ForeignKey("train.lr", KOHYA, "one learning rate for every LoRA module"),
    "max_train_steps": ForeignKey("train.steps", f"{KOHYA} and {DIFFUSERS}"),
    "max_steps": ForeignKey("train.steps", HF),
    "max_train_epochs": ForeignKey("train.steps", KOHYA, _STEPS_NOT_EPOCHS),
    "num_train_epochs": ForeignKey("train.steps", f"{DIFFUSERS} and {HF}", _STEPS_NOT_EPOCHS),
    "num_epochs": ForeignKey("train.steps", "axolotl", _STEPS_NOT_EPOCHS),
    "train_batch_size": ForeignKey("train.batch_size", f"{KOHYA} and {DIFFUSERS}"),
    "per_device_train_batch_size": ForeignKey("train.batch_size", HF),
    "micro_batch_size": ForeignKey("train.batch_size", "axolotl"),
    "gradient_accumulation_steps": ForeignKey("train.grad_accum", f"{KOHYA}, {DIFFUSERS}, {AITK} and {HF}"),
    "gradient_accumulation": ForeignKey("train.grad_accum", AITK),
    "mixed_precision": ForeignKey("train.precision", f"{KOHYA} and {DIFFUSERS}"),
    "full_bf16": ForeignKey("train.precision", KOHYA, "train.precision: bf16"),
    "full_fp16": ForeignKey("train.precision", KOHYA, "train.precision: fp16"),
    "bf16": ForeignKey("train.precision", HF, "train.precision: bf16"),
    "fp16": ForeignKey("train.precision", HF, "train.precision: fp16"),
    "optimizer_type": ForeignKey("train.optimizer", KOHYA),
    "optim": ForeignKey("train.optimizer", HF),
    "optimizer_params": ForeignKey("train.optimizer_args", AITK),
    "lr_warmup_steps": ForeignKey("train.warmup_steps", f"{KOHYA} and {DIFFUSERS}"),
    "warmup_ratio": ForeignKey("train.warmup_steps", HF, "a number of steps, not a fraction"),
    "lr_scheduler_type": ForeignKey("train.lr_scheduler", HF),
    "adam_beta1": ForeignKey("train.betas", DIFFUSERS, "train.betas: [beta1, beta2]"),
    "adam_beta2": ForeignKey("train.betas", DIFFUSERS, "train.betas: [beta1, beta2]"),
    "adam_epsilon": ForeignKey("train.eps", DIFFUSERS),
    "adam_weight_decay": ForeignKey("train.weight_decay", DIFFUSERS),
    "clip_grad_norm": ForeignKey("train.max_grad_norm", "other trainers"),
    "max_grad_norm_clip": ForeignKey("train.max_grad_norm", "other trainers"),
    "train_unet": ForeignKey("train.train_text_encoder", AITK, "the denoiser always trains"),
    "ema_config": ForeignKey("train.ema_decay", AITK),
    "use_ema": ForeignKey("train.ema_decay", DIFFUSERS, "train.ema_decay: 0.999 turns it on"),
    "noise_scheduler": ForeignKey("train.timestep_sampling", AITK),
    "timestep_type": ForeignKey("train.timestep_sampling", AITK),
    "discrete_flow_shift": ForeignKey("train.flow_shift", "musubi-tuner"),
    "resume_from_checkpoint": ForeignKey("train.resume", f"{DIFFUSERS} and {HF}"),
    "resume": ForeignKey("train.resume", KOHYA),
    # save
    "save_every_n_steps": ForeignKey("save.every", KOHYA),
    "save_steps": ForeignKey("save.every", HF),
    "checkpointing_steps": ForeignKey("save.every", DIFFUSERS),
    "save_every": ForeignKey("save.every", AITK),
    "save_every_n_epochs": ForeignKey("save.every", KOHYA, _STEPS_NOT_EPOCHS),
    "save_total_limit": ForeignKey("save.keep_last", HF),
    "checkpoints_total_limit": ForeignKey("save.keep_last", DIFFUSERS),
    "max_step_saves_to_keep": ForeignKey("save.keep_last", AITK),
    "save_precision": ForeignKey("save.dtype", KOHYA),
    "save_model_as": ForeignKey("save.format", KOHYA),
    # sample
    "sample_every_n_steps": ForeignKey("sample.every", KOHYA),
    "sample_every": ForeignKey("sample.every", AITK),
    "sample_prompts": ForeignKey("sample.prompts", KOHYA),
    "validation_prompt": ForeignKey("sample.prompts", DIFFUSERS),
    "validation_steps": ForeignKey("sample.every", DIFFUSERS),
    "sample_steps": ForeignKey("sample.num_inference_steps", AITK),
    "guidance_scale": ForeignKey("sample.guidance_scale", f"{AITK} and diffusers"),
    "neg": ForeignKey("sample.negative_prompt", AITK),
    # log
    "logging_steps": ForeignKey("log.every", HF),
    "log_every": ForeignKey("log.every", AITK),
    "report_to": ForeignKey("log.wandb", f"{DIFFUSERS} and {HF}", "log.tensorboard and log.wandb are switches"),
    "log_with": ForeignKey("log.wandb", KOHYA, "log.tensorboard and log.wandb are switches"),
    "eval_steps": ForeignKey("train.eval_every", HF),
}

# A top-level key that only an ai-toolkit job file has: the whole file is another trainer's.
JOB_FILE_KEYS = frozenset({"job", "config", "meta"})


def foreign_key_hint(name: str, top_level: bool, known_keys: set[str]) -> str:
    """'; did you mean ...' for another trainer's key name whose toolkit key is in `known_keys` (the run's schema),
    or '' when `name` is not one."""
    if top_level and name in JOB_FILE_KEYS:
        return ("; this looks like an ai-toolkit job file: translate it with "
                "`./start_toolkit.sh import-aitk JOB.yaml > config.yaml`")
    known = FOREIGN_KEYS.get(name)
    section = known.target.split(".", 1)[0] if known else ""
    # a section whose keys are not known yet (the data section before model.family is set) takes the hint as is
    if known is None or (known.target not in known_keys and any(k.startswith(section + ".") for k in known_keys)):
        return ""
    note = f"; {known.note}" if known.note else ""
    return f"; did you mean '{known.target}'? ({name}: the name in {known.used_by}{note})"
