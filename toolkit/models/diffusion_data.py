"""The data half of a diffusion adapter: scanning the folder, loading an item's views (augment.py), and filling
the latent and text-embedding caches. Mixed into DiffusionAdapter, which provides `cfg`, `pipe`, `runtime`,
`log`, `model_path`, `family`, `text_encoders`, `encode_pixels`, `encode_text` and the sample prompts.

Latents: every view of every item (crop offsets and flip, data.crop_variants and data.random_flip) is encoded
once and cached, keyed by the file's content, its bucket, the model, the VAE mode, the view and anything the
family conditions on beside it (`latent_key_parts`: an image-to-video start image). A family that caches more
than the latents per view (Wan image-to-video: the start frame's condition) returns it from `encode_view`.

Text: each caption is encoded once and cached, with the empty caption when data.caption_dropout is set, unless
the words change every epoch (tag shuffle, tag dropout) or the text encoders train: a shuffled caption has as
many variants as orders of its tags (3.6 million for 10 tags), far more than a cache could hold or a run would
see twice, so those captions are encoded every step and the text encoders stay on the device. kohya refuses
cached text-encoder outputs with shuffle_caption for the same reason.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Callable

import torch

from toolkit.data.augment import Augmentation, View
from toolkit.data.datasets import DatasetSettings, EpochMix, dataset_settings, describe, named_for
from toolkit.data.images import DiffusionDataset, caption_rules, file_hash, load_image_view, scan_images
from toolkit.data.latent_cache import TensorCache, cache_key
from toolkit.data.masks import attach_masks, load_mask
from toolkit.errors import UserError
from toolkit.paths import cache_root


def unbatch(tensors: dict[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
    """A dict of batched tensors as one dict per item."""
    n = next(iter(tensors.values())).shape[0]
    return [{k: v[i] for k, v in tensors.items()} for i in range(n)]


class DiffusionData:
    # -- family hooks ----------------------------------------------------------------------
    def scan(self, data, log: Callable[[str], None]) -> list:
        return scan_images(data, log)

    def load_item(self, item, view: View) -> dict[str, torch.Tensor]:
        """One view of an item: {"pixels": CHW (or CFHW) in [-1, 1], "crop": (top, left)} and any extras the
        family's `encode_view` reads."""
        return load_image_view(item, view)

    def encode_view(self, loaded: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """What the latent cache keeps of one loaded view (batch of 1 in, unbatched out): its latents, and a
        family's other image-derived conditioning."""
        return {"latents": self.encode_pixels(loaded["pixels"][None])[0]}

    def latent_key_parts(self, item) -> tuple:
        """What else the cached entry of `item` depends on beyond file, bucket, model and view."""
        return ()

    # -- caches ----------------------------------------------------------------------------
    def fill_caches(self) -> DiffusionDataset:
        """Scan the data and fill the latent and text caches (the main process first; the others then read
        what it wrote). The VAE visits the device for encoding; text encoders are freed when nothing needs
        them again."""
        with self.runtime.main_process_first():
            return self._prepare_data()

    def _prepare_data(self) -> DiffusionDataset:
        data, rules = self.cfg.data, caption_rules(self.cfg.data)
        settings = dataset_settings(data)
        items = self.scan_datasets(settings)
        augment = Augmentation.from_data(data, self.cfg.run.seed)
        mix = EpochMix(tuple(item.dataset for item in items), tuple(s.repeats for s in settings),
                       tuple(s.weight for s in settings), self.cfg.run.seed,
                       tuple(s.is_regularization for s in settings), bool(data.balance_regularization))
        prior = ([self.cfg.train.prior_loss_weight if settings[item.dataset].is_regularization else 1.0
                  for item in items] if any(s.is_regularization for s in settings) else None)
        dataset = DiffusionDataset(items, rules, augment, load=self.load_item, mix=mix, prior_weights=prior)
        if len(settings) > 1 or mix.size() != len(items):
            for line in describe(settings, mix):
                self.log(line)
        root = cache_root() / "diffusion"
        if any(s.section.masked_loss for s in settings):
            self._fill_masks(dataset, root)
        vae = self.pipe.vae
        vae.to(self.runtime.device)
        if data.cache_latents:
            self._fill_latents(dataset, root)
        self.eval_set = self.prepare_eval(root)  # diffusion_eval.py: eval.path's latents, always cached
        if data.cache_latents:
            vae.to("cpu")  # only sampling needs it again
        self._prepare_text(dataset, items, rules, root, settings)
        return dataset

    def scan_datasets(self, settings: list[DatasetSettings]) -> list:
        """Every dataset's items at each of its resolutions (an image's bucket once per dataset), each marked with
        its dataset and, with data.masked_loss, its mask."""
        items = []
        for index, dataset in enumerate(settings):
            said: set[str] = set()

            def log_once(line: str) -> None:  # a folder's caption report once, not once per resolution
                if line not in said:
                    said.add(line)
                    self.log(line)

            found, seen = [], set()
            for resolution in dataset.resolutions:
                section = dataset.section.copy()
                section.resolution = resolution
                try:
                    scanned = self.scan(section, log_once)
                except UserError as err:
                    raise named_for(err, dataset) from None
                for item in scanned:
                    # content_hash tells the clips cut from one video apart (data.frame_extraction)
                    if (item.path, item.bucket, item.content_hash) not in seen:
                        seen.add((item.path, item.bucket, item.content_hash))
                        found.append(dataclasses.replace(item, dataset=index))
            if dataset.section.masked_loss:
                found = attach_masks(found, dataset, self.cfg.data.mask_folder)
            items += found
        return items

    def _fill_masks(self, dataset: DiffusionDataset, root: Path) -> None:
        """dataset.masks: each view's mask at its bucket's size (uint8), from the mask cache or cut now; an item of
        a dataset without masks trains every pixel (all white)."""
        cache = TensorCache(root, "masks")
        masked = [(i, v) for i, (item, views) in enumerate(zip(dataset.items, dataset.views)) if item.mask is not None
                  for v in range(len(views))]
        hashes = {dataset.items[i].mask: file_hash(dataset.items[i].mask) for i, _ in masked}
        entries = [(dataset.items[i], dataset.views[i][v]) for i, v in masked]
        keys = [cache_key("mask", hashes[item.mask], item.bucket, view.top_left, view.flip) for item, view in entries]
        cut = dict(zip(masked, cache.fill(keys, lambda idx: [{"mask": load_mask(*entries[i])} for i in idx])))
        dataset.masks = [[cut[(i, v)]["mask"] if (i, v) in cut else
                          torch.full((1, item.bucket[1], item.bucket[0]), 255, dtype=torch.uint8)
                          for v in range(len(views))] for i, (item, views) in enumerate(zip(dataset.items, dataset.views))]
        unmasked = sum(item.mask is None for item in dataset.items)
        without = f"; {unmasked} items of datasets without masks train every pixel" if unmasked else ""
        self.log(f"masks: {cache.hits} cached, {cache.misses} cut (data.mask_min={self.cfg.data.mask_min:g}){without}")

    def _fill_latents(self, dataset: DiffusionDataset, root: Path) -> None:
        """dataset.encoded: every view of every item, from the cache or encoded now (one VAE call per view)."""
        self.latent_cache = TensorCache(root, "latents")
        vae_id = (self.model_path, self.cfg.model.revision, str(self.pipe.vae.dtype), "mode")
        entries = [(item, view) for item, views in zip(dataset.items, dataset.views) for view in views]
        keys = [cache_key(item.content_hash, item.bucket, *vae_id, *self.latent_key_parts(item), *view.key_parts())
                for item, view in entries]
        cached = iter(self.latent_cache.fill(keys, lambda idx: [self._encode_entry(*entries[i]) for i in idx]))
        dataset.encoded = [[next(cached) for _ in views] for views in dataset.views]
        views = len(entries) // len(dataset.items)
        per_item = f" ({views} views per item)" if len(entries) > len(dataset.items) else ""
        self.log(f"latents: {self.latent_cache.hits} cached, {self.latent_cache.misses} encoded{per_item}")

    def _encode_entry(self, item, view: View) -> dict[str, torch.Tensor]:
        loaded = self.load_item(item, view)
        return {**self.encode_view(loaded), "crop": torch.as_tensor(loaded["crop"])}

    def _prepare_text(self, dataset: DiffusionDataset, items: list, rules, root: Path,
                      settings: list[DatasetSettings]) -> None:
        data, train_te = self.cfg.data, self.trains_text_encoders
        per_step = ("train.train_text_encoder is on" if train_te else
                    "data.shuffle_tags changes captions every step" if rules.shuffle_tags else
                    "data.tag_dropout changes captions every step" if rules.tag_dropout > 0 else
                    "data.cache_text_embeddings is off" if not data.cache_text_embeddings else None)
        encoders = self.text_encoders
        for encoder in encoders:
            encoder.to(self.runtime.device)
        classes = self.class_captions(items, settings)
        if classes is not None:
            dataset.dop_captions = classes
        if per_step is not None:
            if data.cache_text_embeddings:
                self.log(f"text embeddings: computed every step, not cached ({per_step}); the text encoders stay "
                         "on the device")
            return
        captions = [it.caption for it in items]
        extra = ([""] if rules.caption_dropout > 0 else []) + self.eval_texts()
        extra += [c for c in classes or [] if c is not None]
        if not self.samples_need_text_encoders:
            extra += self.sample_texts()
        extra = [p for p in dict.fromkeys(extra) if p not in captions]
        dataset.text = self.cache_texts(captions + extra, root)[:len(captions)]
        dataset.empty_text = self.prompt_cache.get("")
        if classes is not None:  # an item without a class caption keeps its own (its preservation is masked off)
            dataset.dop_text = [self.prompt_cache[c] if c is not None else dataset.text[i] for i, c in enumerate(classes)]
        self.attach_eval_texts()
        self.log(f"text embeddings: {self.text_cache.hits} cached, {self.text_cache.misses} encoded")
        if self.samples_need_text_encoders:
            for encoder in encoders:
                encoder.to("cpu")
        else:
            self.free_text_encoders()

    def class_captions(self, items: list, settings: list[DatasetSettings]) -> list[str | None] | None:
        """train.dop_class: each item's caption with its dataset's trigger word replaced by the class word (None for
        regularisation images); None when output preservation is off. The config was checked before the model
        loaded (plan/static_rules.py: dop_checks): no LoRA on the text encoders, a trigger word for every training
        dataset."""
        word = self.cfg.train.dop_class
        if not word:
            return None
        classes = []
        for item in items:
            dataset = settings[item.dataset]
            if dataset.is_regularization:
                classes.append(None)
                continue
            trigger = dataset.section.trigger_word
            if not trigger:
                raise UserError(f"train.dop_class: output preservation replaces the trigger word, and "
                                f"{dataset.label.rsplit('.', 1)[0]} has no trigger_word\n  fix: set data.trigger_word "
                                "(the word the LoRA learns), or unset train.dop_class")
            classes.append(item.caption.replace(trigger, word))
        kept = sum(c is not None for c in classes)
        self.log(f"output preservation: {kept} of {len(items)} items with a class caption (their trigger word -> "
                 f"{word!r}; train.dop_weight={self.cfg.train.dop_weight:g}), the base prediction from the same model "
                 "with its LoRA off")
        return classes

    def cache_texts(self, texts: list[str], root: Path) -> list[dict[str, torch.Tensor]]:
        """The text conditioning of `texts` from the disk cache, encoded (and cached) where it is not there;
        they become the prompt cache that samples read."""
        self.text_cache = TensorCache(root, "text")
        text_id = (self.model_path, self.cfg.model.revision, self.family, str(self.text_encoders[0].dtype))
        keys = [cache_key(text, *text_id) for text in texts]
        with torch.no_grad():
            cached = self.text_cache.fill(keys, lambda idx: unbatch(self.encode_text([texts[i] for i in idx])))
        self.prompt_cache = dict(zip(texts, cached))
        return cached

    def sample_texts(self) -> list[str]:
        """The texts samples are generated from when the text encoders are gone: prompts and negative prompt."""
        return self.sample_prompts() + ([self.cfg.sample.negative_prompt] if self.uses_negative_prompt else [])

    def prepare_sampling(self) -> None:
        """For `sample`: families that sample from cached text get their prompts' embeddings (the ones training
        cached, read back, so the samples match the trainer's), then the text encoders are freed; then the
        denoisers go where training would put them."""
        if not self.samples_need_text_encoders:
            for encoder in self.text_encoders:
                encoder.to(self.runtime.device)
            self.cache_texts(list(dict.fromkeys(self.sample_texts())), cache_root() / "diffusion")
            self.log(f"text embeddings: {self.text_cache.hits} cached, {self.text_cache.misses} encoded")
            self.free_text_encoders()
        self.place_for_training()

    def free_text_encoders(self) -> None:
        """Drop the text encoders: every caption and sample prompt is cached, so nothing needs them again."""
        for name in self.text_encoder_names:
            if getattr(self.pipe, name, None) is not None:
                setattr(self.pipe, name, None)
        self.log("text encoders: freed after caching (every caption and sample prompt is cached)")
