"""The chroma family on tiny:chroma through the real entry point: its LoRA file in ChromaPipeline.load_lora_weights
(the same transformer output as the trained PEFT model, the same images as the toolkit's samples), the T5 padding
masked in training as Chroma masks it, predict against one step of the pipeline, block swap (the same LoRA) and
fp8 (the blocks' linear layers quantized)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

from helpers import adapter_for, cpu_runtime, diffusion_train_args, mean_loss, read_metrics
from toolkit.tiny import resolve_model_path

pytestmark = pytest.mark.usefixtures("own_data_caches")
PROMPT = "sks a red circle"


def _pipeline():
    from diffusers import ChromaPipeline

    pipe = ChromaPipeline.from_pretrained(resolve_model_path("tiny:chroma"))
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _encoded(pipe, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """The pipeline's own prompt encoding: embeddings and its mask (tokens and the first padding token)."""
    with torch.no_grad():
        embeds, _, mask, *_ = pipe.encode_prompt(prompts, device="cpu", do_classifier_free_guidance=False)
    return embeds, mask


def _transformer_inputs(embeds: torch.Tensor, mask: torch.Tensor) -> dict:
    from diffusers import ChromaPipeline

    g = torch.Generator().manual_seed(3)
    latents = torch.randn(1, 16, 8, 8, generator=g)
    packed = ChromaPipeline._pack_latents(latents, 1, 16, 8, 8)
    return dict(hidden_states=packed, timestep=torch.tensor([0.6]), encoder_hidden_states=embeds,
                txt_ids=torch.zeros(embeds.shape[1], 3),
                img_ids=ChromaPipeline._prepare_latent_image_ids(1, 4, 4, "cpu", torch.float32),
                attention_mask=torch.cat([mask.bool(), torch.ones(1, packed.shape[1], dtype=torch.bool)], dim=1),
                return_dict=False)


def test_chroma_trains_and_its_lora_loads_in_chroma_pipeline(tmp_path, run_cli):
    from toolkit.models import build_adapter
    from toolkit.models.base import load_trainable_state_dict
    from toolkit.plan.run import load_run
    from toolkit.train.checkpoint import trainable_from_file

    out = tmp_path / "run"
    assert run_cli(*diffusion_train_args("quickstart_chroma.yaml", out, f"sample.prompts=[{PROMPT}]",
                                         "network.alpha=16", "save.every=2", "sample.every=2")) == 0
    losses = [r["loss"] for r in read_metrics(out)]
    assert len(losses) == 2 and all(np.isfinite(losses))
    final = out / "final" / "pytorch_lora_weights.safetensors"
    weights = load_file(str(final))
    assert all(k.startswith("transformer.") and k.endswith((".lora_A.weight", ".lora_B.weight", ".alpha"))
               for k in weights)
    assert len(weights) == 17 * 3  # 10 double-block + 7 single-block modules (Flux's targets), each with its alpha
    assert weights["transformer.single_transformer_blocks.0.proj_mlp.alpha"].item() == 16.0
    assert not any("distilled_guidance_layer" in k or k.startswith("transformer.proj_out.") for k in weights)
    assert (out / "final" / "quickstart_chroma_comfyui.safetensors").read_bytes() == final.read_bytes()

    # The trained PEFT model, with step 2's exact tensors, against a fresh pipeline that loaded the file.
    run = load_run([out / "config.yaml"], [])
    adapter = build_adapter(run.cfg, cpu_runtime(run, out))
    adapter.load()
    state = load_file(str(out / "checkpoints" / "step-000002" / "trainable_state.safetensors"))
    load_trainable_state_dict(adapter.network, trainable_from_file(state))
    pipe = _pipeline()
    embeds, mask = _encoded(pipe, [PROMPT])
    inputs = _transformer_inputs(embeds, mask)
    with torch.no_grad():
        base = pipe.transformer(**inputs)[0]
        pipe.load_lora_weights(str(out / "final"))
        loaded = pipe.transformer(**inputs)[0]
        trained = adapter.pipe.transformer(**inputs)[0]
    assert (trained - base).abs().max() > 1e-2  # the LoRA moves the output well beyond the tolerance
    torch.testing.assert_close(loaded, trained, rtol=1e-5, atol=1e-5)

    # The pipeline with the LoRA, given the boolean mask as the toolkit's samples give it, draws the sample image.
    call = dict(prompt_embeds=embeds, prompt_attention_mask=mask.bool(), negative_prompt_embeds=_encoded(pipe, ["blurry"])[0],
                negative_prompt_attention_mask=_encoded(pipe, ["blurry"])[1].bool(), num_inference_steps=2,
                guidance_scale=4.0, width=64, height=64, generator=torch.Generator("cpu").manual_seed(42))
    with_lora = np.asarray(pipe(**call).images[0], dtype=np.int16)
    sample = np.asarray(Image.open(out / "samples" / "step-000002" / "00.png"), dtype=np.int16)
    assert np.abs(with_lora - sample).max() <= 1
    pipe.disable_lora()
    call["generator"] = torch.Generator("cpu").manual_seed(42)
    assert np.abs(np.asarray(pipe(**call).images[0], dtype=np.int16) - with_lora).max() >= 2


def test_t5_padding_is_masked_in_training_as_chroma_masks_it(tmp_path):
    """The cached mask is the pipeline's (each caption's tokens and its first padding token); the loss does not see
    the padding past that token, does see that token, and a short caption batched with a long one trains as alone."""
    from toolkit.models.diffusion_base import Denoiser
    from toolkit.models.objectives import Noised

    adapter, dataset = adapter_for("quickstart_chroma.yaml", tmp_path)
    fresh = _pipeline()  # the run's text encoder is freed once the captions are cached
    # every forward keeps the tokens of the longest cached text (captions, sample prompts): one text shape a run
    longest = max(int(t["prompt_attention_mask"].sum()) for t in adapter.prompt_cache.values())
    assert adapter.text_length == longest < 32
    prompt = adapter.sample_prompts()[0]
    cached = adapter.embeddings_for(prompt)
    own_embeds, own_mask = _encoded(fresh, [prompt])
    assert torch.equal(cached["prompt_embeds"], own_embeds)
    assert torch.equal(cached["prompt_attention_mask"], own_mask.long())
    captions = ["a red circle", "a blue square on a white background"]
    embeds, mask = _encoded(fresh, captions)
    text = {"prompt_embeds": embeds, "prompt_attention_mask": mask.long()}
    tokens = [len(fresh.tokenizer(c).input_ids) for c in captions]  # with </s>
    assert mask.sum(dim=1).tolist() == [n + 1 for n in tokens] and tokens[0] < tokens[1]

    pair = [i for i, g in enumerate(dataset.groups) if g == dataset.groups[0]][:2]  # one bucket
    collated = dataset.collate(pair)
    assert collated["prompt_attention_mask"].shape == (2, 512)  # cached captions batch with their masks
    latents = collated["latents"]

    def loss(embeds: torch.Tensor, rows=slice(None)) -> torch.Tensor:
        batch = {"latents": latents[rows], "prompt_embeds": embeds[rows],
                 "prompt_attention_mask": text["prompt_attention_mask"][rows]}
        torch.manual_seed(0)
        with torch.no_grad():
            return adapter.loss(batch, adapter.trainable_modules())

    short = tokens[0] + 1  # the short caption's attended tokens
    reference = loss(embeds)
    past_first_pad = embeds.clone()
    past_first_pad[0, short:] = 100.0  # the short caption's masked padding (some of it inside the long one's length)
    assert torch.equal(loss(past_first_pad), reference)
    first_pad = embeds.clone()
    first_pad[0, short - 1] = 100.0  # its first padding token, which Chroma attends to
    assert (loss(first_pad) - reference).abs() > 1e-4  # float noise would be ~1e-7

    noised = adapter.objective.noise(latents)
    transformer = adapter.pipe.transformer
    denoiser = Denoiser(transformer, transformer.dtype, transformer.config)
    with torch.no_grad():
        together = adapter.predict(denoiser, noised, text, {})
        for i in range(2):
            alone = Noised(noised.noisy[i:i + 1], noised.t[i:i + 1], noised.target[i:i + 1])
            cond = {k: v[i:i + 1] for k, v in text.items()}
            torch.testing.assert_close(adapter.predict(denoiser, alone, cond, {}), together[i:i + 1],
                                       rtol=1e-5, atol=1e-5)
    assert mean_loss(adapter, collated).isfinite()


def test_predict_is_the_velocity_the_pipeline_steps_with(tmp_path):
    """One scheduler step of ChromaPipeline (given the cached text and its boolean mask) from latents x at its first
    sigma moves x by (sigma_1 - sigma_0) * predict(x, sigma_0); the training sigmas are shifted as the pipeline
    shifts them (Flux's resolution-dependent mu); the cached latents are what the pipeline's VAE encodes."""
    from toolkit.data.images import load_pixels
    from toolkit.models.diffusion_base import Denoiser
    from toolkit.models.objectives import Noised

    adapter, dataset = adapter_for("quickstart_chroma.yaml", tmp_path)
    text = adapter.embeddings_for(adapter.sample_prompts()[0])  # cached
    pipe, steps = adapter.pipe, 50
    x = torch.randn((1, 16, 8, 8), generator=torch.Generator().manual_seed(0))
    seen = []

    def first_step(pipeline, i, t, kwargs):
        seen.append(kwargs["latents"].clone())
        pipeline._interrupt = True  # the remaining steps are skipped
        return {}

    from diffusers import ChromaPipeline

    packed = ChromaPipeline._pack_latents(x.clone(), 1, 16, 8, 8)
    pipe(prompt_embeds=text["prompt_embeds"], prompt_attention_mask=text["prompt_attention_mask"].bool(),
         guidance_scale=1.0, num_inference_steps=steps, width=64, height=64, latents=packed, output_type="latent",
         callback_on_step_end=first_step)
    sigmas = pipe.scheduler.sigmas
    transformer = pipe.transformer
    with torch.no_grad():
        velocity = adapter.predict(Denoiser(transformer, transformer.dtype, transformer.config),
                                   Noised(x, sigmas[:1], torch.zeros_like(x)), text, {})
    from toolkit.models.diffusion_flow import unpack_flux

    after = unpack_flux(seen[0], 1, 16, 8, 8)
    torch.testing.assert_close(after, x + (sigmas[1] - sigmas[0]) * velocity, rtol=1e-5, atol=1e-6)
    sampler = adapter.sampler_for(x)
    assert adapter.dynamic_shift and sampler.mu is not None
    assert float(sampler.shifted(torch.tensor(1 - 1 / steps))) == pytest.approx(float(sigmas[1]), rel=1e-5)
    batch = dataset.collate([0])
    pixels = load_pixels(dataset.items[0])[0][None]
    with torch.no_grad():
        encoded = pipe.vae.encode(pixels).latent_dist.mode()
    config = pipe.vae.config
    torch.testing.assert_close(batch["latents"], (encoded - config.shift_factor) * config.scaling_factor,
                               rtol=1e-5, atol=1e-5)


def test_blocks_swapped_and_checkpointed_train_the_same_lora(tmp_path, run_cli, capsys):
    """model.block_swap=1 (one of tiny:chroma's 2 blocks, its double and its single block, in pinned CPU memory)
    with both checkpointed gives the same losses and LoRA as the plain run, bit for bit."""
    out, losses = {}, {}
    for name, more in (("plain", []), ("swapped", ["model.block_swap=1", "train.gradient_checkpointing=2"])):
        assert run_cli(*diffusion_train_args("quickstart_chroma.yaml", tmp_path / name, "sample.prompts=[]", *more)) == 0
        out[name] = load_file(tmp_path / name / "final" / "pytorch_lora_weights.safetensors")
        losses[name] = [r["loss"] for r in read_metrics(tmp_path / name)]
    log = capsys.readouterr().err
    assert "model.block_swap=1: 1 of 2 blocks swapped" in log
    assert "blocks: transformer: 2 blocks, 2 gradient-checkpointed, 1 swapped" in log
    assert "blocks: transformer: 2 blocks, 0 gradient-checkpointed, 0 swapped" in log
    assert len(losses["plain"]) == 2 and all(np.isfinite(losses["plain"])) and losses["swapped"] == losses["plain"]
    assert out["plain"].keys() == out["swapped"].keys() and len(out["plain"]) == 17 * 3
    assert all(torch.equal(out["plain"][k], out["swapped"][k]) for k in out["plain"])


def test_fp8_quantizes_the_blocks_linear_layers(tmp_path, run_cli, capsys):
    """model.quantize=fp8: the 17 linear layers of the 2 blocks (12 attention and feed-forward projections of the
    double block, 5 of the single block: the LoRA's targets) in the toolkit's fp8 layer, and nothing outside the
    blocks (embedders, output projection, the guidance approximator); the run trains the same LoRA keys, near the
    16-bit losses."""
    from toolkit.kernels.fp8_linear import Float8Linear

    for name, extra in (("fp8", ["model.quantize=fp8"]), ("plain", ["model.quantize=none"])):
        assert run_cli(*diffusion_train_args("quickstart_chroma.yaml", tmp_path / name, "sample.prompts=[]", *extra)) == 0
    assert "model: quantized 17 linear layers of the transformer to fp8 (toolkit)" in capsys.readouterr().err
    fp8, plain = ([r["loss"] for r in read_metrics(tmp_path / n)] for n in ("fp8", "plain"))
    assert len(fp8) == 2 and fp8 != plain and fp8 == pytest.approx(plain, rel=0.05)
    files = [load_file(tmp_path / n / "final" / "pytorch_lora_weights.safetensors") for n in ("fp8", "plain")]
    assert files[0].keys() == files[1].keys()

    adapter, _ = adapter_for("quickstart_chroma.yaml", tmp_path / "loaded", "model.quantize=fp8")
    modules = dict(adapter.pipe.transformer.named_modules())
    quantized = {name.removesuffix(".base_layer") for name, m in modules.items() if isinstance(m, Float8Linear)}
    lora_targets = {name for name, m in modules.items() if hasattr(m, "lora_A")}
    assert len(quantized) == 17 and quantized == lora_targets
    assert sum(n.startswith("transformer_blocks.0.") for n in quantized) == 12
    assert sum(n.startswith("single_transformer_blocks.0.") for n in quantized) == 5
    plain_linear = [n for n, m in modules.items() if type(m) is torch.nn.Linear and "lora_" not in n]
    assert any(n.startswith("distilled_guidance_layer.") for n in plain_linear)
    assert {"x_embedder", "context_embedder", "proj_out"} <= set(plain_linear)
