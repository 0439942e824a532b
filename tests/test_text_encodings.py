"""Text files that are binary, not UTF-8 or carry a byte-order mark: an error naming file and line, or a noted
decoding; never a UnicodeDecodeError traceback."""

from __future__ import annotations

import codecs
import json
import shutil
from pathlib import Path

from conftest import REPO, run_toolkit

LLM = REPO / "configs/examples/quickstart_llm.yaml"
QUICK = ["train.steps=1", "save.every=0", "sample.prompts=[]", "log.tensorboard=false"]


def jsonl(*texts: str) -> bytes:
    return "".join(json.dumps({"text": t}, ensure_ascii=False) + "\n" for t in texts).encode("utf-8")


def test_jsonl_data_not_utf8_or_binary_is_an_error_naming_file_and_line(tmp_path):
    latin1 = tmp_path / "latin1.jsonl"
    latin1.write_bytes(jsonl("a red circle", "a blue square") + '{"text": "café"}\n'.encode("latin-1"))
    binary = tmp_path / "binary.jsonl"
    binary.write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR\x00\xff")
    for data, expected in ((latin1, f"data.path: {latin1}:3:14: not UTF-8 (byte 0xe9)"),
                           (binary, f"data.path: {binary} is a binary file, not text")):
        proc = run_toolkit("train", LLM, f"data.path={data}", f"run.output_dir={tmp_path / 'run'}", *QUICK, timeout=120)
        assert proc.returncode == 2 and "Traceback" not in proc.stderr
        assert expected in proc.stderr, proc.stderr


def test_a_bom_is_read_with_a_note_and_trains(tmp_path):
    data = tmp_path / "bom.jsonl"
    data.write_bytes(codecs.BOM_UTF8 + jsonl(*[f"a red circle number {i}" for i in range(16)]))
    utf16 = tmp_path / "utf16.txt"
    utf16.write_text("".join(f"a blue square {i}\n" for i in range(16)), encoding="utf-16")  # with its BOM
    proc = run_toolkit("train", LLM, f"data.path={data}", f"data.eval_path={utf16}", "data.format=text",
                       f"run.output_dir={tmp_path / 'run'}", *QUICK, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert f"note: {data} starts with a UTF-8 byte-order mark: read as UTF-8 without it" in proc.stderr
    assert f"note: {utf16} starts with a UTF-16 byte-order mark: decoded as UTF-16" in proc.stderr
    assert "16 training samples" in proc.stderr


def test_a_caption_file_not_utf8_is_an_error_naming_it(tmp_path):
    images = tmp_path / "images"
    shutil.copytree(REPO / "configs/examples/data/shapes", images)
    caption = sorted(images.glob("*.txt"))[0]
    text = "a red circle, très rouge"
    caption.write_bytes(text.encode("cp1252"))
    proc = run_toolkit("train", REPO / "configs/examples/quickstart_sd.yaml", f"data.path={images}",
                       f"run.output_dir={tmp_path / 'run'}", *QUICK, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert f"data.path: {caption}:1:{text.index('è') + 1}: not UTF-8 (byte 0xe8)" in proc.stderr
    assert "iconv" in proc.stderr


def test_a_config_file_not_utf8_is_an_error_and_one_with_a_bom_is_read(tmp_path):
    text = LLM.read_text(encoding="utf-8").replace("quickstart_llm", "quickstart_llé")
    bad = tmp_path / "latin1.yaml"
    bad.write_bytes(text.encode("latin-1"))
    proc = run_toolkit("validate", bad, timeout=60)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    line = next(n for n, row in enumerate(text.splitlines(), 1) if "é" in row)  # the first é, in a comment
    column = text.splitlines()[line - 1].index("é") + 1
    assert f"{bad}:{line}:{column}: not UTF-8 (byte 0xe9)" in proc.stderr
    bom = tmp_path / "bom.yaml"
    bom.write_bytes(codecs.BOM_UTF8 + text.encode("utf-8"))
    proc = run_toolkit("validate", bom, cwd=REPO, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert f"note: {bom} starts with a UTF-8 byte-order mark" in proc.stderr and "quickstart_llé" in proc.stdout
