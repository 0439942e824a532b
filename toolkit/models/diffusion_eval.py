"""The diffusion families' validation loss (eval.path, eval.every, eval.timesteps, eval.seed). Mixed into
DiffusionAdapter, which provides `cfg`, `pipe`, `runtime`, `log`, `network`, `scan`, `load_item`,
`_fill_latents`, `conditioning`, `latents_of`, `loss_at` and the prompt cache.

The held-out folder is read as data.path is (the same caption, resolution and bucket settings), each image at its
bucket's centre crop, unflipped, with its caption as written (no tag shuffle, tag dropout or caption dropout). Its
latents (and, where training caches them, its text embeddings) are encoded once with the training data's. An edit
family's eval images carry their references, found by the same layout rules inside the eval folder (docs/edit.md),
cached and placed as in training.

Each image is scored at eval.timesteps fixed noise levels, (k + 0.5) / N of the noise range (a DDPM timestep,
or a flow sigma through the family's shift as in training), each with its own noise drawn from a generator
seeded by (eval.seed, image, level): no draw touches the training's random streams, so evaluating changes no
later step, and every evaluation of every run scores the same noised inputs (a resumed run's too). The eval
loss is the mean of the training loss (its weighting included) over images and levels, computed with the
LoRA in eval mode and without gradients.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from omegaconf import OmegaConf

from toolkit.data.augment import Augmentation
from toolkit.data.images import DiffusionDataset, caption_rules
from toolkit.errors import UserError
from toolkit.models.base import eval_mode

# What the eval folder is read with beyond data's settings: one plain view, the caption as written; an edit
# family's references from inside the eval folder (references/ or name_refN), as data.reference_paths's folders
# hold data.path's references only.
PLAIN_VIEW = {"random_flip": False, "crop_variants": 1, "caption_dropout": 0.0, "shuffle_tags": False,
              "tag_dropout": 0.0, "reference_paths": []}


def eval_noise(seed: int, item: int, level: int, shape: torch.Size) -> torch.Tensor:
    """The fixed noise of eval image `item` at level `level`: fp32 on the CPU, from its own generator."""
    state = np.random.SeedSequence([seed % 2**63, item, level]).generate_state(1, np.uint64)[0]
    generator = torch.Generator("cpu").manual_seed(int(state >> np.uint64(1)))
    return torch.randn(shape, generator=generator, dtype=torch.float32)


class DiffusionEval:
    eval_set: DiffusionDataset | None = None

    def eval_interval(self) -> int:
        return int(self.cfg.eval.every)

    def prepare_eval(self, root: Path) -> DiffusionDataset | None:
        """The eval folder scanned and its latents encoded (the VAE is on the device); None without eval.path."""
        path = self.cfg.eval.path
        if not path:
            return None
        data = OmegaConf.create({**OmegaConf.to_container(self.cfg.data, resolve=True), "path": str(path),
                                 **{k: v for k, v in PLAIN_VIEW.items() if k in self.cfg.data}})
        self.log(f"eval: {path}")
        try:
            items = self.scan(data, self.log)
        except UserError as err:
            raise UserError(f"eval.path: {str(err).removeprefix('data.path: ')}") from None
        if not items:
            raise UserError(f"eval.path: {path} holds no image or clip this family reads\n  fix: point eval.path at a "
                            "folder laid out as data.path (images or clips with their captions)")
        eval_set = DiffusionDataset(items, caption_rules(data), Augmentation(False, 1, 0), load=self.load_item)
        self._fill_latents(eval_set, root)
        return eval_set

    def eval_texts(self) -> list[str]:
        """The eval captions, for the text cache (training caches its captions' embeddings)."""
        return [item.caption for item in self.eval_set.items] if self.eval_set is not None else []

    def attach_eval_texts(self) -> None:
        """The eval captions' cached embeddings (from the prompt cache the text cache filled)."""
        if self.eval_set is not None:
            self.eval_set.text = [self.prompt_cache[item.caption] for item in self.eval_set.items]

    def eval_experts(self, levels: int) -> list[tuple[str, list[int]]]:
        """Which denoiser scores which of the `levels` fixed levels: one denoiser scores them all (Wan 2.2 A14B
        gives each level to the expert that owns its sigma)."""
        return [(self.active_denoiser(), list(range(levels)))]

    def eval_loss(self, batch_size: int) -> float | None:
        """The mean loss over the eval images and fixed levels, in batches of `batch_size` images of one bucket;
        each denoiser's levels together (an offloaded expert comes to the device once per evaluation)."""
        if self.eval_set is None:
            return None
        eval_set, levels, seed = self.eval_set, int(self.cfg.eval.timesteps), int(self.cfg.eval.seed)
        by_bucket: dict[int, list[int]] = {}
        for index, group in enumerate(eval_set.groups):
            by_bucket.setdefault(group, []).append(index)
        modules = dict(self.network.items())
        total, count = 0.0, 0
        with torch.no_grad(), eval_mode(self.network), self.denoisers_on_demand():
            for name, owned in self.eval_experts(levels):
                for indices in by_bucket.values():
                    for first in range(0, len(indices), batch_size):
                        chunk = indices[first:first + batch_size]
                        batch = eval_set.collate(chunk)
                        latents = self.latents_of(batch)
                        cond = self.conditioning(batch, modules)
                        for level in owned:
                            noise = torch.stack([eval_noise(seed, i, level, latents.shape[1:]) for i in chunk])
                            losses = self.loss_at(name, batch, latents, cond,
                                                  noise.to(latents.device, latents.dtype), (level + 0.5) / levels)
                            total += float(losses.double().sum())
                            count += len(chunk)
        return total / count
