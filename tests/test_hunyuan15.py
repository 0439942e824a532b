"""The hunyuan_video15 family on tiny:hunyuan15 (text-to-video) and tiny:hunyuan15-i2v through the real entry point:
both quickstarts train, the LoRA file loads with the transformer's own load_lora_adapter (diffusers' PEFT loader;
the pipelines have no load_lora_weights) and moves the output as the trained model does, the sample is the
pipeline's video with that LoRA, predict is the velocity one step of each pipeline moves by (the I2V condition
included: the masked text padding and image tokens left out), the ComfyUI file's fused qkv holds the same updates, block swap trains the same LoRA, and a resumed
run ends bit-identical."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

from helpers import adapter_for, cpu_runtime, diffusion_train_args, read_metrics
from toolkit.tiny import resolve_model_path

pytestmark = pytest.mark.usefixtures("own_data_caches")
PROMPT = "sks a red circle"
QUICKSTART = {"t2v": "quickstart_hunyuan15.yaml", "i2v": "quickstart_hunyuan15_i2v.yaml"}


def _pipeline(task: str):
    from diffusers import HunyuanVideo15ImageToVideoPipeline, HunyuanVideo15Pipeline

    cls = HunyuanVideo15ImageToVideoPipeline if task == "i2v" else HunyuanVideo15Pipeline
    pipe = cls.from_pretrained(resolve_model_path("tiny:hunyuan15-i2v" if task == "i2v" else "tiny:hunyuan15"))
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _transformer_inputs(pipe, prompt: str) -> dict:
    """The T2V pipeline's transformer call for one prompt: noisy latents + zero condition and mask, zero image tokens."""
    embeds, mask, embeds_2, mask_2 = pipe.encode_prompt([prompt], device="cpu", batch_size=1)
    latents = torch.randn(1, 32, 3, 4, 4, generator=torch.Generator().manual_seed(3))
    hidden = torch.cat([latents, torch.zeros_like(latents), torch.zeros(1, 1, 3, 4, 4)], dim=1)
    return dict(hidden_states=hidden, timestep=torch.tensor([600.0]), encoder_hidden_states=embeds,
                encoder_attention_mask=mask, encoder_hidden_states_2=embeds_2, encoder_attention_mask_2=mask_2,
                image_embeds=torch.zeros(1, pipe.vision_num_semantic_tokens, pipe.transformer.config.image_embed_dim),
                return_dict=False)


def _assert_loaded_as_trained(pipe, adapter, final: Path, inputs: dict) -> None:
    """final/'s file, loaded by the pipeline transformer's load_lora_adapter, gives the trained transformer's output
    on `inputs`, which the LoRA moves well beyond the tolerance."""
    with torch.no_grad():
        base = pipe.transformer(**inputs)[0]
        pipe.transformer.load_lora_adapter(load_file(str(final)), prefix="transformer")
        loaded = pipe.transformer(**inputs)[0]
        trained = adapter.pipe.transformer(**inputs)[0]
    assert (trained - base).abs().max() > 1e-2
    torch.testing.assert_close(loaded, trained, rtol=1e-5, atol=1e-5)


def test_t2v_trains_and_its_lora_loads_in_the_pipelines_transformer(tmp_path, run_cli):
    from toolkit.models import build_adapter
    from toolkit.models.base import load_trainable_state_dict
    from toolkit.plan.run import load_run
    from toolkit.train.checkpoint import trainable_from_file

    out = tmp_path / "run"
    assert run_cli(*diffusion_train_args(QUICKSTART["t2v"], out, f"sample.prompts=[{PROMPT}]", "network.alpha=16",
                                         "save.every=2", "sample.every=2", "save.format=comfyui")) == 0
    losses = [r["loss"] for r in read_metrics(out)]
    assert len(losses) == 2 and all(np.isfinite(losses))
    final = out / "final" / "pytorch_lora_weights.safetensors"
    weights = load_file(str(final))
    # 2 blocks x 12 attention / feed-forward projections, diffusers' names, the scale (16 / 8) folded into lora_A
    assert len(weights) == 2 * 12 * 2 and not any(k.endswith(".alpha") for k in weights)
    assert all(k.startswith("transformer.transformer_blocks.") for k in weights)

    run = load_run([out / "config.yaml"], [])
    adapter = build_adapter(run.cfg, cpu_runtime(run, out))
    adapter.load()
    state = load_file(str(out / "checkpoints" / "step-000002" / "trainable_state.safetensors"))
    load_trainable_state_dict(adapter.network, trainable_from_file(state))
    pipe = _pipeline("t2v")
    with torch.no_grad():
        inputs = _transformer_inputs(pipe, PROMPT)
    _assert_loaded_as_trained(pipe, adapter, final, inputs)

    # The pipeline with the loaded LoRA draws the toolkit's sample (its middle frame), and without it another video.
    pipe.guider.guidance_scale = 3.0
    call = dict(prompt=PROMPT, negative_prompt="", height=64, width=64, num_frames=9, num_inference_steps=2,
                output_type="pil")
    with torch.no_grad():
        frames = pipe(**call, generator=torch.Generator("cpu").manual_seed(42)).frames[0]
    sample = np.asarray(Image.open(out / "samples" / "step-000002" / "00.png"), dtype=np.int16)
    assert np.abs(np.asarray(frames[4], dtype=np.int16) - sample).max() <= 1
    pipe.transformer.disable_lora()
    with torch.no_grad():
        plain = pipe(**call, generator=torch.Generator("cpu").manual_seed(42)).frames[0]
    assert np.abs(np.asarray(plain[4], dtype=np.int16) - sample).max() >= 2

    # ComfyUI's names: q/k/v of each stream fused into one qkv LoRA whose B @ A stacks the three updates.
    comfy = load_file(str(out / "final" / "quickstart_hunyuan15_comfyui.safetensors"))
    assert len(comfy) == 2 * 8 * 2  # per block: 2 qkv, 2 proj, 4 mlp layers
    fused = comfy["diffusion_model.double_blocks.1.txt_attn.qkv.lora_B.weight"] @ \
        comfy["diffusion_model.double_blocks.1.txt_attn.qkv.lora_A.weight"]
    parts = [weights[f"transformer.transformer_blocks.1.attn.{p}.lora_B.weight"]
             @ weights[f"transformer.transformer_blocks.1.attn.{p}.lora_A.weight"]
             for p in ("add_q_proj", "add_k_proj", "add_v_proj")]
    torch.testing.assert_close(fused, torch.cat(parts), rtol=1e-6, atol=1e-7)
    assert fused.abs().max() > 0


def test_i2v_quickstart_trains_with_the_start_image_as_its_condition(tmp_path, run_cli, capsys):
    out = tmp_path / "run"
    assert run_cli(*diffusion_train_args(QUICKSTART["i2v"], out, "train.batch_size=1", "sample.every=2")) == 0
    assert "model.task: i2v (auto: the model folder holds a HunyuanVideo15ImageToVideoPipeline)" in capsys.readouterr().err
    losses = [r["loss"] for r in read_metrics(out)]
    assert len(losses) == 2 and all(np.isfinite(losses))
    assert (out / "samples" / "step-000002" / "00.webp").is_file()
    assert len(load_file(str(out / "final" / "pytorch_lora_weights.safetensors"))) == 48


def test_i2v_lora_loads_in_the_image_to_video_pipeline_and_draws_the_sample(tmp_path, run_cli):
    """The I2V run's LoRA file, loaded with load_lora_adapter into HunyuanVideo15ImageToVideoPipeline's transformer,
    gives the trained model's output on an image-to-video input (start latent in the first condition frame, mask 1
    there, SigLIP tokens), and the pipeline from the same start image draws the toolkit's sample."""
    from toolkit.models import build_adapter
    from toolkit.models.base import load_trainable_state_dict
    from toolkit.plan.run import load_run
    from toolkit.train.checkpoint import trainable_from_file

    out = tmp_path / "run"
    assert run_cli(*diffusion_train_args(QUICKSTART["i2v"], out, "train.batch_size=1", "network.alpha=16",
                                         "save.every=2", "sample.every=2")) == 0
    final = out / "final" / "pytorch_lora_weights.safetensors"
    weights = load_file(str(final))
    assert len(weights) == 2 * 12 * 2 and all(k.startswith("transformer.transformer_blocks.") for k in weights)

    run = load_run([out / "config.yaml"], [])
    adapter = build_adapter(run.cfg, cpu_runtime(run, out))
    adapter.load()
    load_trainable_state_dict(adapter.network, trainable_from_file(
        load_file(str(out / "checkpoints" / "step-000002" / "trainable_state.safetensors"))))
    pipe = _pipeline("i2v")
    start = Image.open("configs/examples/data/clips_i2v/green_circle.png").convert("RGB").resize((64, 64))
    inputs = _transformer_inputs(pipe, "sks, a green circle moving right on a white background")
    adapter.pipe.image_encoder.to("cpu")
    pixels = torch.from_numpy(np.asarray(start, dtype=np.float32) / 127.5 - 1).permute(2, 0, 1)
    with torch.no_grad():
        condition = adapter.encode_start(pixels[None])  # the start image as training encodes it
    assert condition["start_latent"].shape == (1, 32, 1, 4, 4) and condition["image_embeds"].shape == (1, 16, 32)
    inputs["hidden_states"][:, 32:64, :1] = condition["start_latent"]
    inputs["hidden_states"][:, 64:, :1] = 1.0  # the mask: 1 on the first frame
    inputs["image_embeds"] = condition["image_embeds"]
    _assert_loaded_as_trained(pipe, adapter, final, inputs)

    # The sample's prompt has the trigger word in front (prompts.txt says so); the pipeline from the same start
    # image with the loaded LoRA draws its middle frame, and without the LoRA another video.
    prompt = (out / "samples" / "step-000002" / "prompts.txt").read_text().strip().removeprefix("00: ")
    assert prompt == "sks, a green circle moving right on a white background"
    pipe.guider.guidance_scale = 3.0
    call = dict(prompt=prompt, negative_prompt="", image=start, num_frames=9, num_inference_steps=2, output_type="pil")
    with torch.no_grad():
        frames = pipe(**call, generator=torch.Generator("cpu").manual_seed(42)).frames[0]
    sample = np.asarray(Image.open(out / "samples" / "step-000002" / "00.png"), dtype=np.int16)
    assert sample.shape == (64, 64, 3) and len(frames) == 9
    assert np.abs(np.asarray(frames[4], dtype=np.int16) - sample).max() <= 1
    pipe.transformer.disable_lora()
    with torch.no_grad():
        plain = pipe(**call, generator=torch.Generator("cpu").manual_seed(42)).frames[0]
    assert np.abs(np.asarray(plain[4], dtype=np.int16) - sample).max() >= 2


@pytest.mark.parametrize("task", ["t2v", "i2v"])
def test_predict_is_the_velocity_the_pipeline_steps_with(tmp_path, task):
    """One scheduler step of the pipeline from latents x at its first sigma moves x by (sigma_1 - sigma_0) *
    predict(x, sigma_0), given the cached text (and for I2V the condition the toolkit encodes from the same start
    image: its latent in the first condition frame, SigLIP tokens); the sigmas are shifted alike."""
    from toolkit.models.diffusion_base import Denoiser
    from toolkit.models.objectives import Noised

    adapter, dataset = adapter_for(QUICKSTART[task], tmp_path, "sample.prompts=[sks a red circle]",
                                   *(["sample.images=[configs/examples/data/clips_i2v/green_circle.png]"]
                                     if task == "i2v" else []))
    text = adapter.embeddings_for(adapter.sample_prompts()[0])
    # predict keeps the longest cached text's tokens (1 ByT5 token: no caption quotes text); the pipeline all
    assert adapter.text_lengths[0] < 100 and adapter.text_lengths[1] == 1
    assert text["prompt_embeds"].shape[1] == 1000 and text["prompt_embeds_2"].shape[1] == 256
    pipe, steps = adapter.pipe, 50
    x = torch.randn((1, 32, 3, 4, 4), generator=torch.Generator().manual_seed(0))
    seen, extra, cond = [], {}, dict(text)
    if task == "i2v":
        image = Image.open("configs/examples/data/clips_i2v/green_circle.png").convert("RGB").resize((64, 64))
        pipe.image_encoder.to("cpu")
        extra["image"] = image
        pixels = torch.from_numpy(np.asarray(image, dtype=np.float32) / 127.5 - 1).permute(2, 0, 1)
        cond.update(adapter.encode_start(pixels[None]))
    else:
        extra.update(height=64, width=64)

    class FirstStep(Exception):
        pass

    step = pipe.scheduler.step

    def first_step(*args, **kwargs):  # the pipelines take no step callback: the scheduler's step is watched
        seen.append(step(*args, **kwargs)[0].clone())
        raise FirstStep

    pipe.guider.guidance_scale = 1.0  # one conditional forward a step
    pipe.scheduler.step = first_step
    with pytest.raises(FirstStep):
        pipe(prompt_embeds=text["prompt_embeds"], prompt_embeds_mask=text["prompt_embeds_mask"],
             prompt_embeds_2=text["prompt_embeds_2"], prompt_embeds_mask_2=text["prompt_embeds_mask_2"],
             num_inference_steps=steps, num_frames=9, latents=x.clone(), output_type="latent", **extra)
    sigmas = pipe.scheduler.sigmas
    transformer = pipe.transformer
    with torch.no_grad():
        velocity = adapter.predict(Denoiser(transformer, transformer.dtype, transformer.config),
                                   Noised(x, sigmas[:1], torch.zeros_like(x)), cond, {})
    torch.testing.assert_close(seen[0], x + (sigmas[1] - sigmas[0]) * velocity, rtol=1e-5, atol=1e-6)
    sampler = adapter.sampler_for(x)
    assert float(sampler.shifted(torch.tensor(1 - 1 / steps))) == pytest.approx(float(sigmas[1]), rel=1e-5)
    batch = dataset.collate([next(i for i, item in enumerate(dataset.items) if item.bucket[2] == 9)])
    assert batch["latents"].shape[1:3] == (32, 3)  # 9 frames: 3 latent frames of 32 channels
    if task == "i2v":
        assert batch["start_latent"].shape[1:3] == (32, 1)
        assert batch["image_embeds"].shape[1:] == (16, 32)  # tiny SigLIP: 16 tokens of width 32


def test_i2v_start_image_reaches_the_loss(tmp_path):
    """Changing only the cached start latent, or only the image tokens, changes the loss."""
    adapter, dataset = adapter_for(QUICKSTART["i2v"], tmp_path)
    batch = dataset.collate([0])

    def loss(**changed) -> torch.Tensor:
        torch.manual_seed(0)
        with torch.no_grad():
            return adapter.loss({**batch, **changed}, adapter.trainable_modules())

    reference = loss()
    assert torch.equal(loss(), reference)
    assert (loss(start_latent=batch["start_latent"] + 1.0) - reference).abs() > 1e-4
    # (a constant shift would not do: the image projection starts with a LayerNorm)
    assert (loss(image_embeds=batch["image_embeds"].flip(-1)) - reference).abs() > 1e-4


def test_blocks_swapped_and_checkpointed_train_the_same_lora(tmp_path, run_cli, capsys):
    """One of the two dual-stream blocks swapped, both checkpointed: the same losses and LoRA as the plain run to
    float rounding (the swapped block's weights are slot copies: the CPU's matmul may sum in another order, ~1e-7
    in the loss and up to ~1e-5 in the LoRA after Adam's two steps at lr 1e-2, where tiny:flux happens to come out bit-identical; checkpointing alone
    keeps the losses bit for bit)."""
    out, losses = {}, {}
    for name, more in (("plain", []), ("changed", ["model.block_swap=1", "train.gradient_checkpointing=2"])):
        run_dir = tmp_path / name
        assert run_cli(*diffusion_train_args(QUICKSTART["t2v"], run_dir, "train.batch_size=1", *more)) == 0
        out[name] = load_file(run_dir / "final" / "pytorch_lora_weights.safetensors")
        losses[name] = [r["loss"] for r in read_metrics(run_dir)]
    log = capsys.readouterr().err
    assert "model.block_swap=1: 1 of 2 blocks swapped" in log
    assert "blocks: transformer: 2 blocks, 2 gradient-checkpointed, 1 swapped" in log
    assert "blocks: transformer: 2 blocks, 0 gradient-checkpointed, 0 swapped" in log
    assert len(losses["plain"]) == 2 and np.allclose(losses["changed"], losses["plain"], rtol=1e-6, atol=0)
    assert out["plain"].keys() == out["changed"].keys()
    for key in out["plain"]:
        torch.testing.assert_close(out["changed"][key], out["plain"][key], rtol=1e-5, atol=5e-5)


def test_resumed_run_is_bit_identical(tmp_path, run_cli):
    """4 steps straight, against the same run cut back to its step-2 checkpoint and resumed."""
    args = ["train.steps=4", "save.every=2", "train.batch_size=1", "save.keep_last=5"]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    assert run_cli(*diffusion_train_args(QUICKSTART["t2v"], straight, *args)) == 0
    assert run_cli(*diffusion_train_args(QUICKSTART["t2v"], resumed, *args[1:], "train.steps=2")) == 0
    shutil.rmtree(resumed / "final")
    assert run_cli(*diffusion_train_args(QUICKSTART["t2v"], resumed, *args)) == 0
    a = load_file(straight / "final" / "pytorch_lora_weights.safetensors")
    b = load_file(resumed / "final" / "pytorch_lora_weights.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert [r["loss"] for r in read_metrics(straight)][2:] == [r["loss"] for r in read_metrics(resumed)][-2:]


def test_fp8_quantizes_the_dual_stream_blocks(tmp_path, run_cli, capsys):
    """model.quantize=fp8: the 14 linear layers of each of the 2 blocks (attention, feed-forward, modulation) in
    the toolkit's fp8 layer, nothing outside the blocks; the run trains the same LoRA modules, near the 16-bit losses."""
    losses, keys = {}, {}
    for name, more in (("plain", []), ("fp8", ["model.quantize=fp8"])):
        run_dir = tmp_path / name
        assert run_cli(*diffusion_train_args(QUICKSTART["t2v"], run_dir, "train.batch_size=1", *more)) == 0
        losses[name] = [r["loss"] for r in read_metrics(run_dir)]
        keys[name] = set(load_file(run_dir / "final" / "pytorch_lora_weights.safetensors"))
    assert "model: quantized 28 linear layers of the transformer to fp8 (toolkit)" in capsys.readouterr().err
    assert keys["fp8"] == keys["plain"]
    assert losses["fp8"] != losses["plain"] and np.allclose(losses["fp8"], losses["plain"], rtol=0.05)


def test_i2v_on_a_text_to_video_folder_is_a_short_error(tmp_path, run_cli, capsys):
    resolve_model_path("tiny:hunyuan15")  # on this machine: its folder's pipeline is known before it loads
    assert run_cli(*diffusion_train_args(QUICKSTART["t2v"], tmp_path / "run", "model.task=i2v")) == 2
    err = capsys.readouterr().err
    assert "model.task=i2v: tiny:hunyuan15 has no image_encoder (SigLIP)" in err and "fix: use an image-to-video" in err
    assert "Traceback" not in err


def test_dora_file_loads_in_the_pipelines_transformer_as_trained(tmp_path, run_cli):
    """network.type=dora: the file (PEFT keys under transformer., each scale folded into lora_A, the magnitudes
    beside) loads with load_lora_adapter and gives the trained model's output."""
    from toolkit.models import build_adapter
    from toolkit.models.base import load_trainable_state_dict
    from toolkit.plan.run import load_run
    from toolkit.train.checkpoint import trainable_from_file

    out = tmp_path / "run"
    assert run_cli(*diffusion_train_args(QUICKSTART["t2v"], out, "network.type=dora", "network.alpha=16",
                                         "save.every=2")) == 0
    weights = load_file(str(out / "final" / "pytorch_lora_weights.safetensors"))
    assert sum(k.endswith(".lora_magnitude_vector") for k in weights) == 24
    run = load_run([out / "config.yaml"], [])
    adapter = build_adapter(run.cfg, cpu_runtime(run, out))
    adapter.load()
    state = load_file(str(out / "checkpoints" / "step-000002" / "trainable_state.safetensors"))
    load_trainable_state_dict(adapter.network, trainable_from_file(state))
    pipe = _pipeline("t2v")
    with torch.no_grad():
        inputs = _transformer_inputs(pipe, PROMPT)
        base = pipe.transformer(**inputs)[0]
        pipe.transformer.load_lora_adapter(weights, prefix="transformer")
        loaded = pipe.transformer(**inputs)[0]
        trained = adapter.pipe.transformer(**inputs)[0]
    assert (trained - base).abs().max() > 1e-2
    torch.testing.assert_close(loaded, trained, rtol=1e-5, atol=1e-5)


def _loss_and_grads(adapter, batch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The batch's loss and its LoRA gradients (noise and sigmas drawn from seed 0)."""
    from toolkit.models.base import trainable_parameters

    modules = adapter.trainable_modules()
    params = {f"{name}.{i}": p for name, module in modules.items() for i, p in enumerate(trainable_parameters(module))}
    for p in params.values():
        p.grad = None
    torch.manual_seed(0)
    loss = adapter.loss(batch, modules)
    loss.backward()
    return loss.detach(), {k: p.grad.clone() for k, p in params.items() if p.grad is not None}


def _joint_attention_masks(monkeypatch, adapter) -> list:
    """Records the attn_mask of each SDPA call of the dual-stream blocks (their queries hold the video tokens too;
    the text refiner's hold text only), through torch's own SDPA."""
    seen, sdpa = [], torch.nn.functional.scaled_dot_product_attention

    def spy(query, key, value, attn_mask=None, *args, **kwargs):
        if query.shape[2] > adapter.text_lengths[0] + 16:  # 48 video tokens + the text: no text alone is as long
            seen.append(attn_mask)
        return sdpa(query, key, value, attn_mask, *args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    return seen


def _random_lora(adapter) -> None:
    """Nonzero lora_B (PEFT starts it at zero): every LoRA factor gets a gradient."""
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in adapter.pipe.transformer.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=generator) * 0.1)


@pytest.mark.parametrize("task", ["t2v", "i2v"])
def test_attention_runs_mask_free_when_every_token_is_valid(tmp_path, monkeypatch, task):
    """Batch 1, and batch 2 of one caption: the joint attention gets attn_mask None (texts cut to their tokens,
    text-to-video's masked image token and the all-masked ByT5 text left out), and the loss and LoRA gradients
    equal the masked path's (the run's padded text lengths, the image token masked: diffusers' S x S mask)."""
    import toolkit.models.diffusion_hunyuan15 as family

    adapter, dataset = adapter_for(QUICKSTART[task], tmp_path)
    # compiled blocks count a shape per text length pair: the 2 captions' ("a blue circle on ...", "a red circle
    # moving right ..."), the sample prompts', and the padded one
    assert adapter.memory.sequence_variants() >= 3
    _random_lora(adapter)
    masks = _joint_attention_masks(monkeypatch, adapter)
    nine = [i for i, item in enumerate(dataset.items) if item.bucket[2] == 9]
    for indices in ([nine[0]], [nine[1], nine[1]]):
        batch = dataset.collate(indices)
        masks.clear()
        free, free_grads = _loss_and_grads(adapter, batch)
        assert len(masks) == 2 and all(m is None for m in masks)  # one call a block
        with monkeypatch.context() as m:
            m.setattr(family, "valid_lengths", lambda *masks: None)  # as before: padding and image token masked
            masks.clear()
            masked, masked_grads = _loss_and_grads(adapter, batch)
        assert len(masks) == 2 and all(m is not None and not bool(m.all()) for m in masks)
        torch.testing.assert_close(free, masked, rtol=1e-6, atol=1e-6)
        assert free_grads.keys() == masked_grads.keys() and any(g.abs().max() > 1e-3 for g in free_grads.values())
        for key in free_grads:
            torch.testing.assert_close(free_grads[key], masked_grads[key], rtol=1e-6, atol=1e-6)


def test_a_batch_with_padding_keeps_diffusers_masked_attention_bit_for_bit(tmp_path, monkeypatch):
    """Two captions of different lengths in one batch: the toolkit's processor hands the call to diffusers' own
    (the S x S mask), so loss and gradients equal those with diffusers' processor installed, bit for bit."""
    from diffusers.models.transformers.transformer_hunyuan_video15 import HunyuanVideo15AttnProcessor2_0

    from toolkit.models.diffusion_hunyuan15 import TEXT_KEYS, kept_tokens

    adapter, dataset = adapter_for(QUICKSTART["t2v"], tmp_path)
    _random_lora(adapter)
    nine = [i for i, item in enumerate(dataset.items) if item.bucket[2] == 9]  # "a red circle moving right ..."
    one = next(i for i, item in enumerate(dataset.items) if item.bucket[2] == 1)  # "a blue circle on ...": shorter
    batch, short = dataset.collate(nine[:2]), dataset.collate([one])
    for key in TEXT_KEYS:  # the second clip captioned with the shorter text
        batch[key] = torch.cat([batch[key][:1], short[key]])
    lengths = [kept_tokens(mask) for mask in batch["prompt_embeds_mask"]]
    assert lengths[1] < lengths[0]  # padding left in the second text
    masks = _joint_attention_masks(monkeypatch, adapter)
    ours, our_grads = _loss_and_grads(adapter, batch)
    assert len(masks) == 2 and all(m is not None for m in masks)
    for block in adapter.pipe.transformer.transformer_blocks:
        block.attn.set_processor(HunyuanVideo15AttnProcessor2_0())
    theirs, their_grads = _loss_and_grads(adapter, batch)
    assert torch.equal(ours, theirs)
    assert all(torch.equal(our_grads[k], their_grads[k]) for k in our_grads)


def test_mask_free_start_line(tmp_path, run_cli, capsys):
    assert run_cli(*diffusion_train_args(QUICKSTART["t2v"], tmp_path / "run", "train.steps=1")) == 0
    assert ("attention: no mask (SDPA free to pick flash / cuDNN) for a batch whose texts are as long (batch 1 "
            "always)" in capsys.readouterr().err)
