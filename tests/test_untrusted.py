"""No code runs from a checkpoint: a run folder someone shared (or a downloaded LoRA) can hold a crafted pickle that
would write a file when unpickled. Resume refuses it by name (weights-only loads, toolkit/untrusted.py); sample,
merge and network.init_from read only a checkpoint's .safetensors LoRA files, and network.init_from refuses a
pickled LoRA file that holds code; nothing is written in any case. Checkpoints of older toolkits (numpy's own RNG
state) still resume."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import REPO
from toolkit.train.checkpoint import verify_checkpoint

LLM = str(REPO / "configs/examples/quickstart_llm.yaml")
SD = str(REPO / "configs/examples/quickstart_sd.yaml")
QUICK = ["data.max_seq_len=32", "train.batch_size=8", "save.every=1", "log.every=1", "log.tensorboard=false",
         "sample.prompts=[]"]


class WritesAFile:
    """Unpickled, it writes `marker`: what a crafted checkpoint would do instead (run any code)."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return exec, (f"open({str(self.marker)!r}, 'w').write('code ran')",)


def craft(path: Path, marker: Path, state: object = None) -> None:
    """Replace `path` (a file of a checkpoint) by a pickle that writes `marker` when loaded, and record its size and
    sha256 in the checkpoint's meta.json, so that the checkpoint still verifies."""
    torch.save({"state": {}, "param_groups": [], "payload": WritesAFile(marker)} if state is None else state, path)
    record(path)


def record(path: Path) -> None:
    meta_path = path.parent / "meta.json"
    meta = json.loads(meta_path.read_text())
    meta["files"][path.name] = {"bytes": path.stat().st_size, "sha256": hashlib.sha256(path.read_bytes()).hexdigest()}
    meta_path.write_text(json.dumps(meta, indent=2) + "\n")


def snapshot(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_the_crafted_pickle_would_run_code_if_unpickled(tmp_path):
    """The tests below are only worth something if their file is live: unpickled the old way, it writes."""
    marker = tmp_path / "marker"
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "meta.json").write_text(json.dumps({"step": 1, "files": {}}))
    craft(tmp_path / "ckpt" / "optimizer.pt", marker)
    torch.load(tmp_path / "ckpt" / "optimizer.pt", weights_only=False)
    assert marker.read_text() == "code ran"


@pytest.mark.parametrize("name", ["optimizer.pt", "trainer_state.pt"])
def test_resume_refuses_a_crafted_state_and_writes_nothing(tmp_path, run_cli, capsys, name):
    out, marker = tmp_path / "run", tmp_path / "marker"
    assert run_cli("train", LLM, f"run.output_dir={out}", *QUICK, "train.steps=2") == 0
    latest = out / "checkpoints" / "step-000002"
    craft(latest / name, marker)
    assert verify_checkpoint(latest)[0] is not None
    before = {**snapshot(out / "checkpoints"), **snapshot(out / "final")}
    assert run_cli("train", LLM, f"run.output_dir={out}", *QUICK, "train.steps=4") == 2
    err = capsys.readouterr().err
    assert (f"error: {latest / name}: refused to load it: it holds a reference to exec, which no file written by "
            "this toolkit holds, and unpickling it could run code\n  fix: resume only from checkpoints you trust: "
            f"move {latest} out of its checkpoints/ folder to resume from the one before, or start over with --fresh"
            ) in err
    assert "Traceback" not in err and not marker.exists()
    assert {**snapshot(out / "checkpoints"), **snapshot(out / "final")} == before  # nothing moved, nothing written


def test_sample_merge_and_init_from_read_only_the_lora_files_of_a_crafted_checkpoint(tiny_runs, tmp_path, run_cli,
                                                                                      capsys):
    run, marker = tmp_path / "shared", tmp_path / "marker"
    shutil.copytree(tiny_runs["llm"], run)
    checkpoint = run / "checkpoints" / "step-000002"
    for name in ("optimizer.pt", "trainer_state.pt"):
        craft(checkpoint / name, marker)
    before = snapshot(run)
    assert run_cli("sample", run, "--checkpoint", "2", "--out", tmp_path / "samples", "--prompt", "the red") == 0
    assert run_cli("merge", run, tmp_path / "merged", "--step", "2") == 0
    assert run_cli("train", LLM, f"run.output_dir={tmp_path / 'new'}", *QUICK, "train.steps=1",
                   f"network.init_from={checkpoint}") == 0
    err = capsys.readouterr().err
    assert f"network.init_from: the LoRA starts from checkpoint {checkpoint}" in err
    assert not marker.exists() and snapshot(run) == before
    assert (tmp_path / "merged" / "config.json").is_file() and (tmp_path / "samples" / "samples.jsonl").is_file()


def test_a_pickled_lora_file_that_holds_code_is_refused_by_init_from_and_never_read_by_merge(tiny_runs, tmp_path, run_cli, capsys):
    marker = tmp_path / "marker"
    lora = tmp_path / "downloaded_lora.bin"  # diffusers reads a .bin LoRA file with torch.load
    torch.save({"unet.down_blocks.0.lora.down.weight": WritesAFile(marker)}, lora)
    assert run_cli("train", SD, f"run.output_dir={tmp_path / 'sd'}", "train.steps=1", "train.batch_size=2",
                   "sample.prompts=[]", f"network.init_from={lora}") == 2
    err = capsys.readouterr().err
    assert (f"error: network.init_from (file {lora}): refused to load it: it holds a reference to exec, which no file "
            "written by this toolkit holds, and unpickling it could run code\n  fix: use LoRA files in .safetensors") \
        in err
    assert "Traceback" not in err and not marker.exists()
    # merge reads adapter_model.safetensors only: a pickled adapter_model.bin is never loaded, beside it or alone
    adapter = tmp_path / "adapter"
    shutil.copytree(tiny_runs["llm"] / "final", adapter)
    torch.save({"base_model.model.lm_head.weight": WritesAFile(marker)}, adapter / "adapter_model.bin")
    assert run_cli("merge", adapter, tmp_path / "merged") == 0
    (adapter / "adapter_model.safetensors").unlink()
    assert run_cli("merge", adapter, tmp_path / "merged-bin") == 2
    err = capsys.readouterr().err
    assert f"error: merge: {adapter} holds no PEFT adapter (adapter_config.json + adapter_model.safetensors)" in err
    assert not marker.exists() and not (tmp_path / "merged-bin").exists()


def test_a_checkpoint_with_numpys_own_rng_state_still_resumes_exactly(tmp_path, run_cli, capsys):
    """Checkpoints written before the RNG state was stored without numpy types hold numpy's tuple: allowed by name."""
    out, reference = tmp_path / "run", tmp_path / "reference"
    assert run_cli("train", LLM, f"run.output_dir={reference}", *QUICK, "train.steps=4") == 0
    assert run_cli("train", LLM, f"run.output_dir={out}", *QUICK, "train.steps=2") == 0
    path = out / "checkpoints" / "step-000002" / "trainer_state.pt"
    state = torch.load(path, weights_only=True)
    for rng in {id(r): r for r in state["rng_ranks"] + [state["rng"]]}.values():  # "rng" is rank 0's, not a copy
        saved = rng["numpy"]
        rng["numpy"] = (saved["kind"], saved["keys"].numpy().astype(np.uint32), saved["pos"], saved["has_gauss"],
                        saved["cached_gaussian"])
    torch.save(state, path)
    record(path)
    assert run_cli("train", LLM, f"run.output_dir={out}", *QUICK, "train.steps=4") == 0
    assert "resumed from" in capsys.readouterr().err
    from safetensors.torch import load_file

    a, b = (load_file(str(r / "final" / "adapter_model.safetensors")) for r in (reference, out))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
