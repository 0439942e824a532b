"""LoKr and LoHa files (network.type lokr / loha) read by ComfyUI's own loader at alpha != rank: trained through the
entry point on tiny:sd (UNet and text encoder) and tiny:flux, the file goes through what comfy.sd.load_lora_for_models
runs (comfy.lora.model_lora_keys_unet / _clip key mapping, comfy.lora_convert.convert_lora, comfy.lora.load_lora,
which builds comfy/weight_adapter/lokr.py's and loha.py's adapters, and comfy.lora.calculate_weight) on stand-ins of
ComfyUI's model classes (bench/check_exports.py's ComfyUI), and each weight must change by exactly the update the
trained PEFT layer applies (get_delta_weight). The LyCORIS library is checked only at alpha == rank
(test_lycoris_files.py: it applies alpha / rank twice to decomposed factors); ComfyUI applies it once, as PEFT does.

ComfyUI's `comfy` package is taken from a bare git mirror (TOOLKIT_COMFYUI_MIRROR, by default
/work/.mirror/pollockjj+ComfyUI; skipped where there is none), its files written out once per session; blobs the
mirror lacks (a large tokenizer.json) are left out: the LoRA path reads none. Its import needs torchvision, whose
PyPI wheel does not load with the CPU torch here; an empty stand-in serves, for the module-level imports of models
(Cosmos) that the weight math never runs, as in bench/check_exports.py."""

from __future__ import annotations

import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import REPO
from lora_math import plain_weights
from test_lycoris_files import _peft_updates, _plain_copy, _trained_adapter

MIRROR = Path("/work/.mirror/pollockjj+ComfyUI")


def _git_dir(root: Path) -> Path | None:
    """The bare git directory at `root` (or in its `repo` folder), if any."""
    for candidate in (root, root / "repo"):
        if (candidate / "HEAD").is_file() and (candidate / "objects").is_dir():
            return candidate
    return None


def write_comfy_package(git_dir: Path, dest: Path) -> None:
    """HEAD's comfy/ from `git_dir` under `dest`, every blob the mirror holds (git archive stops at a missing one)."""
    git = ["git", f"--git-dir={git_dir}"]
    listing = subprocess.run([*git, "ls-tree", "-r", "-z", "HEAD", "comfy"], capture_output=True, check=True).stdout
    blobs = []
    for entry in filter(None, listing.split(b"\0")):
        meta, path = entry.split(b"\t", 1)
        _, kind, sha = meta.split()
        if kind == b"blob":
            blobs.append((sha.decode(), path.decode()))
    contents = subprocess.run([*git, "cat-file", "--batch"], input="".join(f"{sha}\n" for sha, _ in blobs).encode(),
                              capture_output=True, check=True).stdout
    at = 0
    for _, path in blobs:
        end = contents.index(b"\n", at)
        header, at = contents[at:end].split(), end + 1
        if header[-1] == b"missing":
            continue
        size = int(header[2])
        out = dest / path
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_bytes(contents[at:at + size])
        at += size + 1


@pytest.fixture(scope="session")
def comfyui_checkout(tmp_path_factory) -> Path:
    import os

    git_dir = _git_dir(Path(os.environ.get("TOOLKIT_COMFYUI_MIRROR", MIRROR)))
    if git_dir is None:
        pytest.skip("no ComfyUI mirror (TOOLKIT_COMFYUI_MIRROR)")
    root = tmp_path_factory.mktemp("comfyui")
    write_comfy_package(git_dir, root)
    return root


@pytest.fixture(scope="module")
def comfyui(comfyui_checkout):
    """bench/check_exports.py's ComfyUI (comfy imported with --cpu); torchvision's stand-in and sys.argv undone
    after the module's tests."""
    import diffusers.loaders.peft  # noqa: F401  (before the stand-in: diffusers checks for the real torchvision)

    with pytest.MonkeyPatch.context() as patch:
        stand_in = types.ModuleType("torchvision")
        stand_in.transforms = types.ModuleType("torchvision.transforms")
        for name, module in (("torchvision", stand_in), ("torchvision.transforms", stand_in.transforms)):
            if name not in sys.modules:
                patch.setitem(sys.modules, name, module)
        patch.setattr(sys, "argv", list(sys.argv))
        patch.syspath_prepend(str(REPO / "bench"))
        from check_exports import ComfyUI

        yield ComfyUI(comfyui_checkout)
        sys.path.remove(str(comfyui_checkout))


RUN = ["train.steps=2", "train.batch_size=2", "train.lr=5e-2", "save.every=1", "sample.prompts=[]",
       "network.rank=2", "network.alpha=3", "save.dtype=fp32", "train.optimizer=adamw"]


@pytest.mark.parametrize("family,config,kind,extra", [
    ("sd", "quickstart_sd.yaml", "lokr", ("train.train_text_encoder=true",)),  # w1 full, w2 = w2_a @ w2_b
    ("sd", "quickstart_sd.yaml", "loha", ()),
    ("flux", "quickstart_flux.yaml", "lokr", ()),   # q, k, v into ComfyUI's fused qkv (row offsets)
    ("flux", "quickstart_flux.yaml", "loha", ()),
    # the feed-forwards and the single blocks' projections under ComfyUI's Flux.2 names (its Flux map lacks them)
    ("flux2", "quickstart_flux2_references.yaml", "lokr", ("network.target_modules=all-linear",)),
])
def test_comfyui_applies_the_trained_update_at_alpha_3_rank_2(run_cli, tmp_path, own_data_caches, comfyui,
                                                             family, config, kind, extra):
    from check_exports import compare

    out = tmp_path / "run"
    assert run_cli("train", f"configs/examples/{config}", f"run.output_dir={out}", *RUN, f"network.type={kind}",
                   *extra) == 0
    file = out / "final" / "pytorch_lora_weights.safetensors"
    written = load_file(str(file))
    ranks = {int(v.shape[0]) for k, v in written.items() if k.endswith(("lokr_w2_b", "hada_w1_b"))}
    alphas = {float(v) for k, v in written.items() if k.endswith(".alpha")}
    assert ranks == {2} and alphas == {3.0}  # every module decomposed at rank 2, alpha 3: scale 1.5

    adapter = _trained_adapter(out, 2)  # final/ is step 2's (no EMA)
    plain = {name: _plain_copy(model) for name, model in adapter.network.items()}
    expected = {}
    for name, model in adapter.network.items():
        base = plain_weights(plain[name])
        expected.update({f"{name}.{k}": (base[k], update) for k, update in _peft_updates(model).items()})
    assert min(float(update.abs().max()) for _, update in expected.values()) > 1e-4  # every module trained
    stand_in = types.SimpleNamespace(network=plain, component=plain.__getitem__)
    before, after, unread = comfyui.apply(file, family, stand_in, list(plain))

    landed, worst = compare(expected, before, after)
    assert unread == 0 and landed == len(expected) == len(written) // len({k.rsplit(".", 1)[1] for k in written})
    assert worst < 1e-5, worst

    # the alpha is read: the same factors with alpha = rank land a third smaller (scale 1 for 1.5)
    at_rank = tmp_path / "alpha_at_rank.safetensors"
    save_file({k: (torch.tensor(2.0) if k.endswith(".alpha") else v) for k, v in written.items()}, str(at_rank))
    _, unscaled = comfyui.apply(at_rank, family, stand_in, list(plain))[:2]
    largest = max(float(update.abs().max()) for _, update in expected.values())
    assert compare(expected, before, unscaled)[1] > largest / 3 * 0.99
