"""Helpers shared by the tests: a CPU runtime, an adapter ready to train, its mean loss, a short diffusion run's
arguments, a run's metrics, and the optimizer tests' parameters and gradients."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from conftest import REPO


def cpu_runtime(run, tmp_path: Path, **kwargs):
    from toolkit.models.base import Runtime

    return Runtime(torch.device("cpu"), run.device, torch.float32, torch.float32, tmp_path, **kwargs)


def adapter_for(config: str, tmp_path: Path, *overrides: str):
    """(adapter, dataset) for an example config, loaded, with its data prepared and placed for training,
    in the order the trainer does it."""
    from toolkit.plan.run import load_run
    from toolkit.models import build_adapter

    run = load_run([REPO / "configs/examples" / config], [f"run.output_dir={tmp_path}", *overrides])
    adapter = build_adapter(run.cfg, cpu_runtime(run, tmp_path))
    adapter.load()
    dataset = adapter.prepare_data()  # placed for training too
    return adapter, dataset


def mean_loss(adapter, batch) -> torch.Tensor:
    """The batch's mean loss, through the adapter's own (unwrapped) trainable modules."""
    return adapter.loss(batch, adapter.trainable_modules()) / adapter.batch_units(batch)[0]


def diffusion_train_args(config: str, out: Path, *extra: str) -> list[str]:
    """`train` arguments for 2 quick steps of an example diffusion config: batch 2, no checkpoints or samples,
    a log line every step (`extra` overrides come last)."""
    return ["train", str(REPO / "configs/examples" / config), f"run.output_dir={out}", "train.steps=2",
            "train.batch_size=2", "train.lr=1e-2", "save.every=0", "sample.every=0", "sample.num_inference_steps=2",
            "log.every=1", *extra]


def data_cache_apart(root: Path) -> Path:
    """`root` as a TOOLKIT_CACHE whose tiny/ is the session's: latent and text caches filled with it are kept apart
    from the session's (other tests count cache hits), the tiny models are not written again."""
    import os

    session = Path(os.environ["TOOLKIT_CACHE"])
    (session / "tiny").mkdir(parents=True, exist_ok=True)
    root.mkdir(parents=True, exist_ok=True)
    (root / "tiny").symlink_to(session / "tiny")
    return root


# Tiny runs that tests read once they have finished (`sample`, network.init_from): two steps, a checkpoint and samples
# at each, LoRA files in fp32. sd trains with alpha != rank and writes its kohya copy; flux its ComfyUI copy.
TINY_RUN_COMMON = ["train.steps=2", "save.every=1", "sample.every=1", "log.every=1", "log.tensorboard=false",
                   "save.dtype=fp32"]
TINY_RUNS = {
    "sd": ("quickstart_sd.yaml", ["train.batch_size=2", "sample.num_inference_steps=2", "network.rank=4",
                                  "network.alpha=6", "save.format=kohya"]),
    "flux": ("quickstart_flux.yaml", ["train.batch_size=2", "sample.num_inference_steps=2", "sample.every=0"]),
    "wan21": ("quickstart_wan21.yaml", ["train.batch_size=1", "sample.num_inference_steps=2", "sample.num_frames=5"]),
    "llm": ("quickstart_llm.yaml", ["data.max_seq_len=32", "train.batch_size=4"]),
    "llm_dpo": ("quickstart_llm_dpo.yaml", ["data.max_seq_len=32"]),  # no sample.prompts: an objective's data has them
}


class TinyRuns:
    """The TINY_RUNS, each trained through the CLI on first use (runs[family] is its run folder), with latent and
    text caches of their own in `cache` (data_cache_apart): tests that load their LoRAs point
    TOOLKIT_CACHE there too, so that sample prompts' embeddings are the ones the training cached."""

    def __init__(self, root: Path):
        self.root = root
        self.cache = data_cache_apart(root / "cache")
        self.folders: dict[str, Path] = {}

    def __getitem__(self, family: str) -> Path:
        if family not in self.folders:
            import pytest

            from toolkit.cli import main

            config, extra = TINY_RUNS[family]
            out = self.root / family
            with pytest.MonkeyPatch.context() as mp:
                mp.chdir(REPO)
                mp.setenv("TOOLKIT_CACHE", str(self.cache))
                assert main(["train", str(REPO / "configs/examples" / config), f"run.output_dir={out}",
                             *TINY_RUN_COMMON, *extra]) == 0
            self.folders[family] = out
        return self.folders[family]


# The TINY_RUNS are shared by a session's tests, and those that call `sample` on them add samples/cli-* folders: a test
# that copies a tiny run leaves those out (shutil.copytree(..., ignore=without_others_samples)), so it sees the training's own.
def without_others_samples(folder: str, names: list[str]) -> list[str]:
    return [n for n in names if n.startswith("cli-")] if Path(folder).name == "samples" else []


def long_quickstart(name: str, sample_every: int = 0) -> str:
    """The LLM quickstart's YAML as a run that never finishes while a test watches it (2,000 steps; tests stop it):
    a log line every step, no checkpoint but the one a stop saves, samples of 4 tokens every `sample_every` steps."""
    text = (REPO / "configs/examples/quickstart_llm.yaml").read_text(encoding="utf-8")
    for old, new in (("name: quickstart_llm", f"name: {name}"), ("steps: 100", "steps: 2000"), ("  every: 10", "  every: 1"),
                     ("  every: 50\n  dtype", "  every: 0\n  dtype"), ("max_new_tokens: 16", "max_new_tokens: 4"),
                     ("  every: 50\n  prompts", f"  every: {sample_every}\n  prompts")):
        assert old in text, old
        text = text.replace(old, new)
    return text


def read_metrics(run_dir: Path, key: str | None = "loss") -> list:
    """The records of logs/metrics.jsonl (only those with `key`, or all when key is None)."""
    records = [json.loads(line) for line in (Path(run_dir) / "logs" / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if key is None or key in r]


# The 8-bit optimizer tests' parameters: two tensors with 8-bit state (one with a partial last 256-block) and one
# under 4096 elements, which keeps fp32 state.
OPTIM_SHAPES = [(64, 128), (4099,), (32, 16)]


def optim_params(dtype: torch.dtype = torch.float32, shapes=OPTIM_SHAPES, seed: int = 0,
                 device: str = "cpu") -> list[torch.nn.Parameter]:
    """Parameters of `shapes` drawn from N(0, 0.1^2) with `seed`, in `dtype`, on `device`."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter((torch.randn(s, generator=gen) * 0.1).to(dtype).to(device)) for s in shapes]


def optim_grads(steps: int, dtype: torch.dtype = torch.float32, shapes=OPTIM_SHAPES, seed: int = 1
                ) -> list[list[torch.Tensor]]:
    """`steps` lists of gradients for `shapes`, drawn from N(0, 0.01^2) with `seed`, in `dtype` on the CPU."""
    gen = torch.Generator().manual_seed(seed)
    return [[(torch.randn(s, generator=gen) * 0.01).to(dtype) for s in shapes] for _ in range(steps)]


def optim_snapshot(optimizer, params) -> list:
    """Copies of each parameter and its optimizer state, for assert_optim_unchanged."""
    return [(p.detach().clone(), {k: v.clone() if torch.is_tensor(v) else v for k, v in optimizer.state[p].items()})
            for p in params]


def assert_optim_unchanged(optimizer, params, snapshot) -> None:
    """Each parameter and every entry of its optimizer state equal the snapshot's, bit for bit."""
    for p, (weight, state) in zip(params, snapshot, strict=True):
        assert torch.equal(p, weight)
        assert optimizer.state[p].keys() == state.keys()
        for key, value in state.items():
            now = optimizer.state[p][key]
            assert torch.equal(now, value) if torch.is_tensor(value) else now == value, key


def per_sample_generators(batch: dict) -> list:
    """A CPU generator per sample, seeded by the batch's draw_seeds: what a training batch's noise, noise offset
    and noise level are drawn from, in that order (models/sample_draws.py), rebuilt for a reference loss."""
    import torch

    return [torch.Generator().manual_seed(int(seed)) for seed in batch["draw_seeds"]]


def kohya_env(tmp_path: Path) -> tuple[dict, Path]:
    """(environment, source folder) of kohya sd-scripts unpacked from .whl-peers/kohya (bench/peers/common.py; the
    caller has bench/ on sys.path); skips the test when its library cannot import torchvision and OpenCV there
    (PEER_EXTRA_SITE adds them on a CPU-only torch)."""
    import os
    import subprocess
    import sys

    import pytest
    from peers.common import install, peer_env

    src, site = install("kohya")
    env = peer_env(site, src, tmp_path)
    if os.environ.get("PEER_EXTRA_SITE"):
        env["PYTHONPATH"] += os.pathsep + os.environ["PEER_EXTRA_SITE"]
    if subprocess.run([sys.executable, "-c", "import torchvision, cv2"], env=env, capture_output=True).returncode:
        pytest.skip("kohya's library needs torchvision and OpenCV (PEER_EXTRA_SITE on a CPU-only torch)")
    return env, src
