"""What the config points at, checked before any model loads: the data (a data file's every record:
data_records.py), the model, the output location.

`validate` and `train` pass `path_checks(...)` to `load_run`, so these problems are reported together with the
config's own, before the run folder is made. Only the process that owns the run folder (the main one) checks the
output location.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from toolkit.config.data_schemas import (FILE_DATA_SCHEMAS, FRAME_EXTRACTION_MODES, FRAME_EXTRACTION_SETTINGS,
                                        modes_reaching)
from toolkit.config.families import FAMILY_SPECS
from toolkit.config.load import DEFAULTS_LABEL, PathCheck
from toolkit.data.video import frame_count_problem
from toolkit.preflight.data_records import record_problems
from toolkit.preflight.init_from import init_from_problems
from toolkit.preflight.model_location import model_problems
from toolkit.preflight.output_location import output_problems


def path_checks(check_output: bool = True) -> PathCheck:
    """The PathCheck for load_run: data and model locations, and (check_output) run.output_dir."""

    def check(cfg: DictConfig, sources: dict) -> list[str]:
        family = _value(cfg, "model.family")
        if family not in FAMILY_SPECS:
            return []
        files = FAMILY_SPECS[family].data_schema in FILE_DATA_SCHEMAS
        problems = data_problems(cfg, sources, files)
        problems += record_problems(FAMILY_SPECS[family].data_schema, partial(_value, cfg), sources)
        problems += sample_image_problems(cfg, sources) + sample_reference_problems(cfg, sources)
        problems += frame_problems(cfg, sources, FAMILY_SPECS[family].data_schema)
        problems += unread_frame_settings(cfg, sources, FAMILY_SPECS[family].data_schema)
        problems += init_from_problems(_value(cfg, "network.init_from"), family, _value(cfg, "run.output_dir"),
                                       sources.get("network.init_from", DEFAULTS_LABEL))
        name = _value(cfg, "model.name_or_path")
        if isinstance(name, str) and name:
            problems += model_problems(name, FAMILY_SPECS[family], _value(cfg, "model.revision"),
                                       sources.get("model.name_or_path", DEFAULTS_LABEL))
        output = _value(cfg, "run.output_dir")
        if check_output and isinstance(output, str) and output:
            problems += output_problems(output, sources.get("run.output_dir", DEFAULTS_LABEL),
                                        {} if files else _data_folders(cfg))
        return problems

    return check


def _value(cfg: DictConfig, key: str) -> Any:
    """The resolved value of `key`, or None when it is missing or does not resolve (reported elsewhere)."""
    try:
        return OmegaConf.select(cfg, key, throw_on_missing=False)
    except OmegaConfBaseException:
        return None


def _data_keys(cfg: DictConfig, files: bool) -> list[str]:
    """The keys that name the run's data: files for text data (`files`), folders of images or clips otherwise."""
    if files:
        return ["data.path", "data.eval_path"]
    return ["data.path", "data.mask_folder", "eval.path",
            *(f"data.datasets[{n}].path" for n in range(len(_value(cfg, "data.datasets") or [])))]


def _data_folders(cfg: DictConfig) -> dict[str, str]:
    """key -> folder, for the image and clip folders the run reads."""
    return {key: value for key in _data_keys(cfg, files=False)
            if isinstance(value := _value(cfg, key), str) and value}


def data_problems(cfg: DictConfig, sources: dict, files: bool) -> list[str]:
    """data.path (and data.eval_path / eval.path): a file for text data (`files`), a folder of images or clips
    otherwise."""
    problems = []
    for key in _data_keys(cfg, files):
        value = _value(cfg, key)
        if not isinstance(value, str) or not value:
            continue
        path, where = Path(value), sources.get(key.split("[")[0] if "[" in key else key, DEFAULTS_LABEL)
        relative = "" if path.is_absolute() else f" (relative paths are taken from {Path.cwd()})"
        if not path.exists():
            kind = "data file" if files else "data folder"
            problems.append(f"'{key}' in {where}: the {kind} {path} does not exist{relative}; fix the path")
        elif files and not path.is_file():
            problems.append(f"'{key}' in {where}: {path} is a folder; give a .jsonl, .json, .parquet or .txt file")
        elif not files and not path.is_dir():
            problems.append(f"'{key}' in {where}: {path} is a file; give the folder that holds the images or videos "
                            "(with same-name caption files, or a metadata.jsonl)")
        elif not files and key != "data.mask_folder" and (empty := _without_media(path)) is not None:
            problems.append(f"'{key}' in {where}: no images or videos in {path}{empty}; add them (.png, .jpg, .webp, "
                            ".mp4, ...), each with a same-name .txt caption, or give the folder that holds them")
    return problems


def _without_media(folder: Path) -> str | None:
    """None when `folder` holds an image or video (or a metadata.jsonl, or kohya's N_name subfolders, which the
    scan reads or explains); else what it holds, for the message."""
    from toolkit.data.images import IMAGE_EXTS, kohya_subfolders
    from toolkit.data.video import VIDEO_EXTS

    try:
        names = sorted(p.name for p in folder.iterdir())
    except OSError:
        return None  # unreadable: the scan says why
    media = IMAGE_EXTS + VIDEO_EXTS
    if "metadata.jsonl" in names or kohya_subfolders(folder) or any(Path(n).suffix.lower() in media for n in names):
        return None
    return f" (it holds {', '.join(names[:4])}{', ...' if len(names) > 4 else ''})" if names else " (it is empty)"


def sample_image_problems(cfg: DictConfig, sources: dict) -> list[str]:
    """sample.images (image-to-video start images): each an image file that exists."""
    where = sources.get("sample.images", DEFAULTS_LABEL)
    return [problem for image in _value(cfg, "sample.images") or []
            if (problem := _image_problem("sample.images", where, Path(str(image))))]


def sample_reference_problems(cfg: DictConfig, sources: dict) -> list[str]:
    """sample.references (each sample prompt's reference images, edit families): each an image file that exists."""
    where = sources.get("sample.references", DEFAULTS_LABEL)
    return [problem for n, images in enumerate(_value(cfg, "sample.references") or []) for image in images
            if (problem := _image_problem(f"sample.references[{n}]", where, Path(str(image))))]


def _image_problem(key: str, where: str, path: Path) -> str:
    """What is wrong with the image file `path` that `key` names ('' when nothing)."""
    if not path.is_file():
        relative = "" if path.is_absolute() else f" (relative paths are taken from {Path.cwd()})"
        what = "is a folder" if path.is_dir() else "does not exist"
        return f"'{key}' in {where}: {path} {what}{relative}; give an image file"
    if (why := _unreadable_image(path)):
        return f"'{key}' in {where}: {path} is not an image that can be read ({why}); give a .png, .jpg or .webp file"
    return ""


def frame_problems(cfg: DictConfig, sources: dict, schema: type) -> list[str]:
    """The clip lengths of a video family (data.num_frames, data.target_frames, and each dataset's): each k x the
    VAE's time compression + 1 (4k+1; LTX-2's 8k+1), checked before any model loads by the rule the clip scan
    applies (data/video.py's frame_count_problem)."""
    factor = getattr(schema, "time_compression", 0)
    if not factor:
        return []
    sections = [("data", _value(cfg, "data"))]
    sections += [(f"data.datasets[{n}]", entry) for n, entry in enumerate(_value(cfg, "data.datasets") or [])]
    problems = []
    for prefix, section in sections:
        lengths = [("target_frames", list(section.get("target_frames") or []))]
        if prefix == "data":
            lengths.append(("num_frames", [section.get("num_frames")]))
        for name, values in lengths:
            for frames in values:
                if not isinstance(frames, int) or not (problem := frame_count_problem(frames, factor)):
                    continue
                where = sources.get(f"data.{name}", DEFAULTS_LABEL) if prefix == "data" else sources.get(
                    "data.datasets", DEFAULTS_LABEL)
                problems.append(f"'{prefix}.{name}' in {where}: {problem}")
    return problems


def unread_frame_settings(cfg: DictConfig, sources: dict, schema: type) -> list[str]:
    """The frame settings only some data.frame_extraction modes read (FRAME_EXTRACTION_SETTINGS), set to other than
    their default where no dataset's mode reads them. data.<key> is read by data.path's dataset and by each
    data.datasets entry that leaves the key unset; an entry's own key by that entry alone (with its own
    frame_extraction, else data.frame_extraction). A mode outside the choices is reported by the choices check."""
    if not getattr(schema, "time_compression", 0):
        return []
    defaults = OmegaConf.to_container(OmegaConf.structured(schema))
    mode = _value(cfg, "data.frame_extraction")
    entries = list(_value(cfg, "data.datasets") or [])
    problems = []
    for key, readers in FRAME_EXTRACTION_SETTINGS.items():
        fix = f"to one that reads it: {', '.join(readers)}"
        modes = modes_reaching(key, mode, entries)
        if (f"data.{key}" in sources and _plain(_value(cfg, f"data.{key}")) != defaults[key]
                and all(m in FRAME_EXTRACTION_MODES and m not in readers for _, m in modes)):
            said = ", ".join(f"{name}={m}" for name, m in modes)
            problems.append(f"'data.{key}' in {sources[f'data.{key}']} has no effect with {said}; remove it, or set "
                            f"data.frame_extraction {fix}")
        for n, entry in enumerate(entries):
            value, own = _plain(entry.get(key)), entry.get("frame_extraction")
            used = own or mode
            if value is None or value == defaults[key] or used not in FRAME_EXTRACTION_MODES or used in readers:
                continue
            said = f"data.datasets[{n}].frame_extraction={own}" if own else f"data.frame_extraction={mode}"
            problems.append(f"'data.datasets[{n}].{key}' in {sources.get('data.datasets', DEFAULTS_LABEL)} has no "
                            f"effect with {said}; remove it, or set data.datasets[{n}].frame_extraction {fix}")
    return problems


def _plain(value: Any) -> Any:
    """A config value as plain Python (a list for a ListConfig), to compare with a schema default."""
    return OmegaConf.to_container(value) if isinstance(value, (DictConfig, ListConfig)) else value


def sample_checks(cfg: DictConfig, sources: dict) -> list[str]:
    """The PathCheck of the sample command: the files its sample.* overrides name."""
    return sample_image_problems(cfg, sources) + sample_reference_problems(cfg, sources)


def _unreadable_image(path: Path) -> str:
    """Why PIL cannot decode `path` ('' when it can): checked before a run trains, not at its first sample."""
    from PIL import Image

    try:
        with Image.open(path) as image:
            image.load()
    except Exception as err:  # PIL raises many kinds (UnidentifiedImageError, OSError for a truncated file, ...)
        return f"{type(err).__name__}: {str(err).splitlines()[0][:200] if str(err) else 'unreadable'}"
    return ""
