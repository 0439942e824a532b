"""Fuzzed inputs (hypothesis): the YAML loader and the command line's key=value list, the JSONL/JSON/TXT and caption
readers, and the image and video folder scanners. The rule: a result, or a UserError (exit 2, a message naming
the file or key); never another exception, which the CLI would print as a traceback.

Bounded for CI: a few dozen examples each, derandomized (the same examples on every run), no example database.
TOOLKIT_FUZZ_EXAMPLES=500 (and TOOLKIT_FUZZ_SEED=N for other examples) runs a deeper search locally. Each bug the
fuzzers found has its own regression test in test_fuzz_regressions.py.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import hypothesis
import pytest
import yaml
from hypothesis import HealthCheck, given, settings, strategies as st

from conftest import REPO
from toolkit.errors import UserError

EXAMPLES = int(os.environ.get("TOOLKIT_FUZZ_EXAMPLES", "0"))
SEED = os.environ.get("TOOLKIT_FUZZ_SEED")


def bounded(examples: int):
    """The settings of one fuzz test: `examples` examples in CI (TOOLKIT_FUZZ_EXAMPLES overrides)."""
    return settings(max_examples=EXAMPLES or examples, deadline=20_000, derandomize=SEED is None, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                           HealthCheck.function_scoped_fixture])


def seeded(test):
    return hypothesis.seed(int(SEED))(test) if SEED is not None else test


@contextmanager
def scratch() -> Iterator[Path]:
    """A fresh folder for one example (hypothesis runs many examples in one test call)."""
    folder = Path(tempfile.mkdtemp(prefix="toolkit-fuzz-"))
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def outcome(call) -> object:
    """call()'s result, or the UserError it raised (anything else propagates and fails the test)."""
    try:
        return call()
    except UserError as err:
        assert str(err), "a UserError without a message"
        return err


# -- values and texts -----------------------------------------------------------------------------------------------
TEXT = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=40)
NASTY = st.sampled_from(["", " ", "auto", "none", "null", "~", "true", "no", "0", "-1", "1e400", "nan", ".inf",
                         "${run.name}", "${oops", "${oc.env:HOME}", "[1, 2", "{a: b}", "!!python/object/apply:os.system",
                         "tiny:llm", "tiny:nothing", "../..", "/", "a" * 300, "\x00", "\u202e", "é", "1:2:3",
                         "[]", "{}", "'", '"', "- a", "&a [*a]", "%", "@", "`"])
SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(allow_nan=True), TEXT, NASTY)
VALUES = st.recursive(SCALARS, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                       st.dictionaries(TEXT, inner, max_size=4)), max_leaves=12)


def _schema_fields() -> dict[str, dict]:
    """Dotted key -> its schema metadata (choices, bounds), over the families with each kind of data."""
    from toolkit.config.load import iter_schema_fields, schema_for

    fields: dict[str, dict] = {}
    for family in ("llm", "sd", "wan21"):
        for key, meta in iter_schema_fields(schema_for(family)):
            fields.setdefault(key, meta)
    return fields


FIELDS = _schema_fields()
SCHEMA: dict[str, list[str]] = {}
for _key in FIELDS:
    SCHEMA.setdefault(_key.split(".")[0], []).append(_key.split(".", 1)[1])
SECTIONS = st.sampled_from(sorted(SCHEMA) + ["", "runn", "trian", "data.path", "0"])


def plausible(key: str):
    """Values a user might give `key`: one of its choices, numbers around its bounds, booleans, auto, odd text."""
    meta = FIELDS.get(key, {})
    typed = [st.sampled_from(meta["choices"])] if "choices" in meta else []
    low = meta.get("min", 0)
    numbers = [st.integers(int(low) - 1, int(low) + 5000), st.floats(low - 1, low + 10)]
    return st.one_of(*typed, *typed, *typed, *numbers, *numbers, st.booleans(), st.just("auto"), NASTY, TEXT,
                     st.lists(SCALARS, max_size=3))


@st.composite
def dotted_keys(draw) -> str:
    if draw(st.integers(0, 3)):
        return draw(st.sampled_from(sorted(FIELDS)))
    section = draw(SECTIONS)
    names = SCHEMA.get(section, [])
    name = draw(st.sampled_from(names) if names and draw(st.booleans()) else TEXT)
    return draw(st.sampled_from([f"{section}.{name}", section, f"{section}.{name}.x", name, f".{name}", f"{name}."]))


BASES = {"llm": REPO / "configs/examples/quickstart_llm.yaml", "sd": REPO / "configs/examples/quickstart_sd.yaml",
         "wan21": REPO / "configs/examples/quickstart_wan21.yaml"}


@st.composite
def configs(draw) -> tuple[str, list[str]]:
    """(the text of a YAML config, key=value overrides): mostly a quickstart config with settings changed to values a
    user might write, sometimes keys added, removed and nested in odd ways, or text that is hardly a config."""
    kind = draw(st.sampled_from(["plausible"] * 6 + ["mutated", "mutated", "random", "text"]))
    if kind == "text":
        return draw(st.one_of(TEXT, NASTY, st.just("run: [\n"), st.just("a: 1\na: 2\n"))), []
    if kind == "random":
        data = draw(st.dictionaries(st.one_of(SECTIONS, TEXT), VALUES, max_size=5))
    else:
        data = yaml.safe_load(BASES[draw(st.sampled_from(sorted(BASES)))].read_text())
        for _ in range(draw(st.integers(1, 3))):
            key = draw(st.sampled_from(sorted(FIELDS)) if kind == "plausible" else dotted_keys())
            parts = key.split(".")
            node = data
            for part in parts[:-1]:
                node = node.setdefault(part, {}) if isinstance(node, dict) else {}
            if not isinstance(node, dict):
                continue
            if kind == "mutated" and draw(st.booleans()) and parts[-1] in node:
                del node[parts[-1]]
            else:
                node[parts[-1]] = draw(plausible(key) if kind == "plausible" else VALUES)
    value = st.one_of(TEXT, NASTY, VALUES.map(lambda v: json.dumps(v, default=str)))
    well_formed = st.sampled_from(sorted(FIELDS)).flatmap(lambda k: plausible(k).map(lambda v: f"{k}={_as_text(v)}"))
    odd = st.builds(lambda k, v, sep: f"{k}{sep}{v}", dotted_keys(), value, st.sampled_from(["=", "==", ""]))
    overrides = draw(st.lists(st.one_of(well_formed, well_formed, well_formed, odd), max_size=2))
    try:
        text = yaml.safe_dump(data, allow_unicode=True, sort_keys=False)
    except (yaml.YAMLError, ValueError):
        text = str(data)
    return text, overrides


def _as_text(value) -> str:
    """A value as a user types it after key= (YAML flow style for lists)."""
    if isinstance(value, (list, dict)):
        return yaml.safe_dump(value, default_flow_style=True, allow_unicode=True).strip()
    return str(value).lower() if isinstance(value, bool) else str(value)


CPU = None


def cpu_device():
    global CPU
    if CPU is None:
        from toolkit.device.detect import detect_device

        CPU = detect_device(force_cpu=True)
    return CPU


@pytest.fixture
def at_repo(monkeypatch):
    """The quickstarts' data paths are relative to the repository."""
    monkeypatch.chdir(REPO)


@seeded
@bounded(30)
@given(config=configs())
def test_the_yaml_loader_and_dotlist_give_a_config_or_a_named_error(at_repo, config):
    from toolkit.plan.run import load_run
    from toolkit.preflight import path_checks

    text, overrides = config
    with scratch() as folder:
        path = folder / "config.yaml"
        path.write_text(text, encoding="utf-8")
        outcome(lambda: load_run([path], overrides, device=cpu_device(), check_paths=path_checks()))


@seeded
@bounded(12)
@given(config=configs(), raw=st.binary(max_size=64))
def test_validate_exits_0_or_2_on_any_config(at_repo, config, raw, capsys):
    from toolkit.cli import main

    text, overrides = config
    with scratch() as folder:
        path = folder / "config.yaml"
        path.write_bytes(raw if not text else text.encode("utf-8"))
        code = main(["validate", str(path), *overrides])
    err = capsys.readouterr().err
    assert code in (0, 2) and "Traceback" not in err
    assert code == 0 or "error: " in err


# -- data files -----------------------------------------------------------------------------------------------------
JSON_VALUES = st.recursive(st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70),
                                     st.floats(allow_nan=False), TEXT),
                           lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                   st.dictionaries(TEXT, inner, max_size=3)), max_leaves=10)
MESSAGES = st.lists(st.fixed_dictionaries({"role": st.one_of(st.sampled_from(["user", "assistant", "system", "tool"]),
                                                             JSON_VALUES),
                                           "content": st.one_of(TEXT, JSON_VALUES)}), max_size=4)
RECORDS = st.one_of(
    st.dictionaries(st.sampled_from(["text", "instruction", "input", "output", "messages", "__line__", "x"]),
                    st.one_of(TEXT, JSON_VALUES, MESSAGES), max_size=4),
    st.fixed_dictionaries({"messages": MESSAGES}),
    st.fixed_dictionaries({"instruction": TEXT, "output": TEXT}, optional={"input": st.one_of(TEXT, JSON_VALUES)}),
    st.fixed_dictionaries({"text": st.one_of(TEXT, st.text(max_size=3000))}))


@st.composite
def data_files(draw) -> tuple[str, bytes]:
    """(suffix, bytes) of a data file: JSON lines of records (some broken), a JSON document, text, or random bytes
    in any encoding (UTF-16 with its BOM, Latin-1, NULs, a huge line)."""
    suffix = draw(st.sampled_from([".jsonl", ".json", ".txt", ".JSONL", ".csv"]))
    kind = draw(st.sampled_from(["records", "records", "json", "text", "bytes", "huge"]))
    if kind == "records":
        lines = draw(st.lists(st.one_of(RECORDS.map(json.dumps), JSON_VALUES.map(json.dumps), TEXT), max_size=6))
        text = draw(st.sampled_from(["\n", "\r\n", "\n\n"])).join(lines)
    elif kind == "json":
        text = json.dumps(draw(st.one_of(st.lists(RECORDS, max_size=4), st.dictionaries(TEXT, st.lists(RECORDS,
                                                                                                       max_size=3),
                                                                                        max_size=2), JSON_VALUES)))
    elif kind == "huge":
        text = json.dumps({"text": "word " * draw(st.integers(10_000, 200_000))})
    else:
        text = draw(TEXT)
    if kind == "bytes":
        return suffix, draw(st.binary(max_size=200))
    encoding = draw(st.sampled_from(["utf-8", "utf-8", "utf-8-sig", "utf-16", "latin-1", "cp1252"]))
    return suffix, text.encode(encoding, errors="replace")


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from toolkit.tiny import resolve_model_path

    return AutoTokenizer.from_pretrained(resolve_model_path("tiny:llm"))


@seeded
@bounded(60)
@given(file=data_files(), fmt=st.sampled_from(["auto", "text", "alpaca", "chat"]), max_seq_len=st.integers(8, 64),
       train_on_prompt=st.booleans())
def test_data_files_give_samples_or_a_named_error(tokenizer, file, fmt, max_seq_len, train_on_prompt):
    from omegaconf import OmegaConf

    from toolkit.config.data_schemas import TextDataSection
    from toolkit.data.text import build_text_data

    suffix, raw = file
    with scratch() as folder:
        path = folder / f"data{suffix}"
        path.write_bytes(raw)
        data = OmegaConf.structured(TextDataSection)
        data.path, data.format, data.max_seq_len, data.train_on_prompt = str(path), fmt, max_seq_len, train_on_prompt
        result = outcome(lambda: build_text_data(data, tokenizer, seed=0))
        if not isinstance(result, UserError):
            assert len(result.train) > 0


@seeded
@bounded(60)
@given(raw=st.one_of(st.binary(max_size=200), TEXT.map(lambda t: t.encode("utf-8")),
                     TEXT.map(lambda t: t.encode("utf-16"))),
       trigger=st.one_of(st.none(), TEXT), default=TEXT, keep=st.integers(0, 5), dropout=st.floats(0, 1),
       shuffle=st.booleans())
def test_captions_read_and_vary_or_give_a_named_error(raw, trigger, default, keep, dropout, shuffle):
    import random

    from toolkit.data.captions import CaptionRules
    from toolkit.text_files import decode_text

    text = outcome(lambda: decode_text(raw, "caption.txt", "data.path"))
    if isinstance(text, UserError):
        assert "caption.txt" in str(text) and "fix:" in str(text)
        return
    rules = CaptionRules(trigger_word=trigger, default_caption=default, caption_dropout=dropout, shuffle_tags=shuffle,
                         keep_tokens=keep, tag_dropout=dropout)
    base = rules.base(text)
    assert isinstance(rules.vary(base, random.Random(0)), str)


# -- image and video folders ----------------------------------------------------------------------------------------
NAME = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",), exclude_characters="/\x00"), min_size=1,
               max_size=20).filter(lambda n: n not in (".", ".."))
SUFFIX = st.sampled_from([".png", ".jpg", ".jpeg", ".webp", ".bmp", ".gif", ".PNG", ".JpG", ".mp4", ".webm", ".mkv",
                          ".mov", ".avi", ".txt", ".jsonl", ""])


def _image_bytes(width: int, height: int, fmt: str, frames: int) -> bytes:
    from PIL import Image

    images = [Image.new("RGB", (width, height), (i * 40 % 256, 100, 200)) for i in range(frames)]
    buffer = io.BytesIO()
    extra = {"save_all": True, "append_images": images[1:]} if frames > 1 and fmt in ("GIF", "WEBP") else {}
    images[0].save(buffer, format=fmt, **extra)
    return buffer.getvalue()


@st.composite
def media_files(draw) -> bytes:
    """A real image or animation of a random size, cut short or not, or random bytes."""
    kind = draw(st.sampled_from(["image", "image", "image", "bytes", "empty"]))
    if kind == "bytes":
        return draw(st.binary(min_size=1, max_size=300))
    if kind == "empty":
        return b""
    fmt = draw(st.sampled_from(["PNG", "JPEG", "WEBP", "GIF", "BMP"]))
    data = _image_bytes(draw(st.integers(1, 160)), draw(st.integers(1, 160)), fmt, draw(st.integers(1, 3)))
    if draw(st.booleans()):
        data = data[:draw(st.integers(0, len(data)))]
    return data


@st.composite
def folders(draw) -> list[tuple[str, str, object]]:
    """Entries of a data folder: (kind, name, content): files of media or captions, sub-folders named like images,
    symlinks (dangling, looping, to a file), and sometimes a metadata.jsonl."""
    entries = []
    for _ in range(draw(st.integers(0, 6))):
        name = draw(NAME) + draw(SUFFIX)
        kind = draw(st.sampled_from(["media", "media", "media", "caption", "folder", "link"]))
        if kind == "media":
            entries.append(("file", name, draw(media_files())))
            if draw(st.booleans()):
                caption = draw(st.one_of(TEXT.map(lambda t: t.encode("utf-8")), st.binary(max_size=40)))
                entries.append(("file", Path(name).stem + ".txt", caption))
        elif kind == "caption":
            entries.append(("file", name, draw(st.binary(max_size=40))))
        elif kind == "folder":
            entries.append(("folder", name, None))
        else:
            entries.append(("link", name, draw(st.sampled_from(["missing", "self", "first"]))))
    if draw(st.integers(0, 4)) == 0:
        lines = draw(st.lists(st.one_of(
            st.fixed_dictionaries({"file_name": st.one_of(NAME, st.sampled_from([e[1] for e in entries] or ["x"]),
                                                           st.just("../outside.png"), st.just("/etc/passwd"),
                                                           JSON_VALUES),
                                   "text": st.one_of(TEXT, JSON_VALUES)}).map(json.dumps),
            TEXT), max_size=4))
        entries.append(("file", "metadata.jsonl", "\n".join(lines).encode("utf-8")))
    return entries


def _write_folder(root: Path, entries: list[tuple[str, str, object]]) -> None:
    for kind, name, content in entries:
        path = root / name
        try:
            if kind == "file":
                path.write_bytes(content)
            elif kind == "folder":
                path.mkdir(exist_ok=True)
            elif content == "missing":
                path.symlink_to(root / "nothing-here.png")
            elif content == "self":
                path.symlink_to(path)
            else:
                first = next((root / n for k, n, _ in entries if k == "file"), root / "nothing-here.png")
                path.symlink_to(first)
        except (FileExistsError, IsADirectoryError, NotADirectoryError, OSError):
            pass  # two entries with one name, or a name the file system refuses: the folder is as far as it got


@seeded
@bounded(50)
@given(entries=folders(), step=st.sampled_from([8, 64]), resolution=st.sampled_from([64, 96]))
def test_image_and_video_folders_scan_or_give_a_named_error(entries, step, resolution):
    from omegaconf import OmegaConf

    from toolkit.config.data_schemas import ImageDataSection, VideoDataSection
    from toolkit.data.images import scan_images
    from toolkit.data.video import scan_clips

    with scratch() as folder:
        root = folder / "data"
        root.mkdir()
        _write_folder(root, entries)
        for schema, scan in ((ImageDataSection, scan_images), (VideoDataSection, scan_clips)):
            data = OmegaConf.structured(schema)
            data.path, data.bucket_step, data.resolution = str(root), step, resolution
            if schema is VideoDataSection:
                data.num_frames = 5
            result = outcome(lambda: scan(data, lambda message: None))
            if not isinstance(result, UserError):
                assert result and all(min(item.bucket[:2]) >= step for item in result)


def test_the_fuzzers_cover_every_section_of_the_schema():
    """The generated keys reach every section (a new section is fuzzed without a change here)."""
    assert {"run", "device", "model", "network", "data", "train", "save", "sample", "log"} <= set(SCHEMA)
    assert "collective_timeout" in SCHEMA["device"] and "bucket_step" in SCHEMA["data"]
    assert "device.collective_timeout" in FIELDS and FIELDS["train.optimizer"]["choices"]
