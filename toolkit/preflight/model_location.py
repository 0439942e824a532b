"""model.name_or_path before any model loads: a tiny:<kind> name, a local folder that holds the family's layout,
or a Hub id that can be reached (or is in the local cache).

A Hub id without network would otherwise cost about 50 s of retries inside from_pretrained: the Hub is asked
once here, with a short timeout. Unreachable with the model cached: offline mode (HF_HUB_OFFLINE=1) is switched
on for this run, with a note. Unreachable and not cached, or offline mode and not cached: a problem.
"""

from __future__ import annotations

import json
import os
import sys
import urllib.error
import urllib.request
from pathlib import Path

from toolkit.config.families import FAMILY_SPECS, TINY_WRITERS, FamilySpec
from toolkit.paths import TINY_PREFIX

HUB_TIMEOUT_S = 3.0
WEIGHT_PATTERNS = ("*.safetensors", "*.bin", "*.safetensors.index.json", "*.bin.index.json")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "spiece.model")
# model_index.json components that hold no weights of their own.
NO_WEIGHTS = ("Tokenizer", "TokenizerFast", "TokenizersBackend", "Scheduler", "Processor", "FeatureExtractor")
LLM_LAYOUT = "a transformers model folder: config.json, weights (*.safetensors or pytorch_model*.bin), tokenizer files"
DIFFUSERS_LAYOUT = ("a diffusers pipeline folder: model_index.json and one subfolder per component, each with its "
                    "config and *.safetensors weights")


def model_problems(name: str, spec: FamilySpec, revision: str | None, where: str) -> list[str]:
    """What is wrong with model.name_or_path `name` for the family `spec` (set in `where`)."""
    key = f"'model.name_or_path' in {where}"
    if name.startswith(TINY_PREFIX):
        return _tiny_problems(name, spec, key)
    path = Path(name).expanduser()
    if path.is_dir():
        return _layout_problems(path, spec, key)
    if path.exists():
        return [f"{key}: {path} is a file; give the folder that holds the model ({_layout(spec)})"]
    if _looks_like_a_path(name):
        return [f"{key}: the folder {path} does not exist (relative paths are taken from {Path.cwd()}); fix the path, "
                f"or give a Hub id (org/name)"]
    return _hub_problems(name, spec, revision, key)


def _layout(spec: FamilySpec) -> str:
    return DIFFUSERS_LAYOUT if spec.pipeline_class else LLM_LAYOUT


def _tiny_problems(name: str, spec: FamilySpec, key: str) -> list[str]:
    kind = name[len(TINY_PREFIX):]
    if kind not in TINY_WRITERS:
        return [f"{key}: unknown tiny model '{name}'; available: {', '.join(TINY_PREFIX + k for k in TINY_WRITERS)}"]
    if kind not in spec.tiny:
        owner = next(s.name for s in FAMILY_SPECS.values() if kind in s.tiny)
        return [f"{key}: {name} is a {owner} model, and model.family is {spec.name}; use "
                f"{' or '.join(TINY_PREFIX + k for k in spec.tiny)}"]
    return []


def _looks_like_a_path(name: str) -> bool:
    """A Hub id is `name` or `org/name`; anything else (absolute, ./, ~, a deeper path) is meant as a folder."""
    return name.startswith((".", "/", "~")) or name.count("/") > 1 or os.sep != "/" and os.sep in name


def _has_weights(folder: Path) -> bool:
    return any(next(folder.glob(pattern), None) is not None for pattern in WEIGHT_PATTERNS)


def _pipeline_class(folder: Path) -> str | None:
    try:
        return str(json.loads((folder / "model_index.json").read_text(encoding="utf-8")).get("_class_name"))
    except (OSError, ValueError, AttributeError):
        return None


def pipeline_class_of(name: str, revision: str | None) -> str | None:
    """The model_index.json _class_name of model.name_or_path where the model is on this machine already (a tiny
    model written, a local folder, a Hub id in the local cache); None where it is not, or holds none."""
    if name.startswith(TINY_PREFIX):
        from toolkit.tiny import tiny_folder

        folder = tiny_folder(name)
        return _pipeline_class(folder) if (folder / "tiny_model.json").is_file() else None
    path = Path(name).expanduser()
    if path.is_dir():
        return _pipeline_class(path)
    if path.exists() or _looks_like_a_path(name):
        return None
    from huggingface_hub import try_to_load_from_cache

    try:
        cached = try_to_load_from_cache(name, "model_index.json", revision=revision)
    except ValueError:  # not a valid repo id
        return None
    return _pipeline_class(Path(cached).parent) if isinstance(cached, str) else None


def _layout_problems(folder: Path, spec: FamilySpec, key: str) -> list[str]:
    missing = _diffusers_missing(folder, spec) if spec.pipeline_class else _transformers_missing(folder)
    if not missing:
        return []
    return [f"{key}: {folder} holds no {spec.name} model: {'; '.join(missing)}. Expected {_layout(spec)}"]


def _family_of(pipeline_class: str | None) -> str | None:
    return next((s.name for s in FAMILY_SPECS.values() if s.pipeline_class == pipeline_class), None)


def _transformers_missing(folder: Path) -> list[str]:
    if (folder / "model_index.json").is_file() and not (folder / "config.json").is_file():
        cls = _pipeline_class(folder)
        owner = _family_of(cls)
        return [f"it is a diffusers pipeline ({cls}{f', model.family {owner}' if owner else ''}), not a causal LM"]
    missing = []
    if not (folder / "config.json").is_file():
        missing.append("config.json is missing")
    if not _has_weights(folder):
        missing.append("no weights (*.safetensors or pytorch_model*.bin)")
    if not any((folder / name).is_file() for name in TOKENIZER_FILES):
        missing.append("no tokenizer files (tokenizer.json or tokenizer_config.json)")
    return missing


def _diffusers_missing(folder: Path, spec: FamilySpec) -> list[str]:
    index = folder / "model_index.json"
    if not index.is_file():
        if (folder / "config.json").is_file():
            return ["model_index.json is missing: it holds a single model or a transformers model (config.json), "
                    "not a whole pipeline"]
        return ["model_index.json is missing"]
    try:
        components = json.loads(index.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        return [f"model_index.json is unreadable ({err})"]
    cls = str(components.get("_class_name"))
    owner = _family_of(cls)
    if owner is not None and cls != spec.pipeline_class:
        return [f"it is a {cls} (model.family {owner}), not a {spec.pipeline_class}"]
    missing = []
    for name, entry in components.items():
        if name.startswith("_") or not isinstance(entry, list) or len(entry) != 2 or None in entry:
            continue
        sub = folder / name
        if not sub.is_dir():
            missing.append(f"{name}/ is missing")
        elif not str(entry[1]).endswith(NO_WEIGHTS):
            if not (sub / "config.json").is_file():
                missing.append(f"{name}/config.json is missing")
            if not _has_weights(sub):
                missing.append(f"{name}/ has no weights (*.safetensors)")
        elif not any(sub.iterdir()):
            missing.append(f"{name}/ is empty")
    return missing


def _offline() -> bool:
    return any(os.environ.get(v, "").upper() in ("1", "ON", "YES", "TRUE") for v in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))


def _hub_endpoint() -> str:
    return os.environ.get("HF_ENDPOINT", "https://huggingface.co").rstrip("/")


def _hub_reachable() -> bool:
    """Whether the Hub answers at all within HUB_TIMEOUT_S (any HTTP status counts; proxies are honoured)."""
    try:
        urllib.request.urlopen(urllib.request.Request(_hub_endpoint(), method="HEAD"), timeout=HUB_TIMEOUT_S)
    except urllib.error.HTTPError:
        return True
    except (urllib.error.URLError, OSError, ValueError):
        return False
    return True


def _cached(repo_id: str, spec: FamilySpec, revision: str | None) -> bool:
    from huggingface_hub import try_to_load_from_cache

    filename = "model_index.json" if spec.pipeline_class else "config.json"
    try:
        return isinstance(try_to_load_from_cache(repo_id, filename, revision=revision), str)
    except ValueError:  # not a valid repo id
        return False


def _go_offline(repo_id: str) -> None:
    """Offline mode for the rest of this process (and the processes it starts): the model is in the cache."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    from huggingface_hub import constants

    constants.HF_HUB_OFFLINE = True
    if os.environ.get("RANK", "0") == "0":
        print(f"note: {_hub_endpoint()} did not answer within {HUB_TIMEOUT_S:.0f} s; '{repo_id}' is in the local "
              "cache, so this run uses it in offline mode (HF_HUB_OFFLINE=1)", file=sys.stderr, flush=True)


def _hub_problems(repo_id: str, spec: FamilySpec, revision: str | None, key: str) -> list[str]:
    local_fix = (f"or point model.name_or_path at a local folder that holds the model ({_layout(spec)})")
    if _offline():
        if _cached(repo_id, spec, revision):
            return []
        return [f"{key}: '{repo_id}' is not in the local Hugging Face cache, and offline mode is on (HF_HUB_OFFLINE=1); "
                f"download it once with network (hf download {repo_id}), {local_fix}"]
    if _hub_reachable():
        return []  # from_pretrained downloads it, or names what the Hub refused
    if _cached(repo_id, spec, revision):
        _go_offline(repo_id)
        return []
    return [f"{key}: '{repo_id}' is not in the local Hugging Face cache and {_hub_endpoint()} did not answer within "
            f"{HUB_TIMEOUT_S:.0f} s (no network?); connect and run again, {local_fix}. With the model cached, "
            "HF_HUB_OFFLINE=1 skips the Hub"]
