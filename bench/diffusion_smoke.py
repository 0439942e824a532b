"""Every tiny diffusion family trains a few bf16 steps on the GPU, with samples and checkpoints: flux with
bitsandbytes 8-bit, sd3 with torchao 8-bit, wan21, wan22 with expert offload (also over quantized bases),
wan22-5b, and flux / wan21 with block swap and selective checkpointing. Prints OK (with the files written and where
the experts' weights sit) or the error.

    python bench/diffusion_smoke.py
"""

from __future__ import annotations

import sys
import tempfile
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

REPO = Path(__file__).resolve().parents[1]


def smoke(work: Path) -> None:
    from toolkit.plan.run import load_run
    from toolkit.train.trainer import Trainer

    cases = [("flux", ["model.quantize=8bit", "model.quantize_backend=bitsandbytes", "train.optimizer=adamw8bit"]),
             ("sd3", ["model.quantize=8bit", "model.quantize_backend=torchao"]),
             ("wan21", ["train.optimizer=adamw8bit"]),
             ("wan22", ["model.expert_offload=true", "train.expert_switch_every=2", "train.ema_decay=0.99"]),
             ("wan22", ["model.expert_offload=true", "train.expert_switch_every=2", "model.quantize=8bit",
                        "model.quantize_backend=bitsandbytes"]),
             ("wan22", ["model.expert_offload=true", "train.expert_switch_every=2", "model.quantize=8bit",
                        "model.quantize_backend=torchao"]),
             ("wan22", ["model.expert_offload=true", "train.expert_switch_every=2", "model.quantize=4bit"]),
             ("wan22", ["model.name_or_path=tiny:wan22-5b"]),
             ("flux", ["model.block_swap=1", "train.gradient_checkpointing=1", "train.compile=true"]),
             ("wan21", ["model.block_swap=1", "train.compile=true"])]
    for family, extra in cases:
        out = work / f"smoke-{family}-{len(extra)}"
        overrides = [f"run.output_dir={out}", "device.preset=auto", "train.steps=4", "save.every=2", "sample.every=2",
                     "train.precision=bf16", "sample.num_inference_steps=2", *extra]
        try:
            run = load_run([REPO / "configs/examples" / f"quickstart_{family}.yaml"], overrides)
            trainer = Trainer(run, fresh=True, log=lambda m: None)
            final = trainer.run()
            files = sorted(str(p.relative_to(final)) for p in final.rglob("*.safetensors"))
            placement = ""
            if "model.expert_offload=true" in extra:
                adapter = trainer.adapter
                placement = "; " + ", ".join(
                    f"{name} base on {next(p for p in adapter.component(name).parameters() if not p.requires_grad).device}"
                    f" / LoRA on {next(p for p in adapter.component(name).parameters() if p.requires_grad).device}"
                    for name in adapter.denoiser_names)
            print(f"smoke {family:6s} {' '.join(extra):80s} OK  {files}{placement}", flush=True)
        except Exception:
            print(f"smoke {family:6s} {' '.join(extra):80s} FAILED\n{traceback.format_exc()}", flush=True)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    print(f"device: {torch.cuda.get_device_name()}; torch {torch.__version__}", flush=True)
    smoke(Path(tempfile.mkdtemp(prefix="bench-smoke-")))
