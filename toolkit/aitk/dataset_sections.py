"""ai-toolkit's `datasets` list translated into the data section: datasets[0] sets it (folder, captions,
resolution and buckets, caches, a video family's frames, masks, control images); each further dataset becomes a
data.datasets entry with its own folder, captions, resolutions, repeats and regularisation (its other settings are
datasets[0]'s here). A setting left out is ai-toolkit's default, as in sections.py.
"""

from __future__ import annotations

from typing import Any

from toolkit.aitk.job import Section, Translation, as_float, as_int

VIDEO_FAMILIES = ("wan21", "wan22", "ltx2", "hunyuan_video15")
FRAME_STEPS = {"ltx2": 8}  # clips are step*k+1 frames: the VAE's time compression (Wan's 4 where not listed)
REFERENCE_FAMILIES = ("qwen_image_edit", "flux_kontext", "flux2")  # data.reference_paths (docs/edit.md)
CONTROL_PATHS = ("control_path", "control_path_1", "control_path_2", "control_path_3")
RANDOM_CROPS = 3  # datasets' random_crop -> data.crop_variants: this many crops, each encoded once and cached


def clip_frames(frames: int, key: str, out: Translation) -> int:
    """The largest 4k+1 frame count up to `frames` (Wan's VAE compresses 4 frames into one after the first; LTX-2's
    8: 8k+1)."""
    step = FRAME_STEPS.get(out.family, 4)
    usable = (max(frames, 1) - 1) // step * step + 1
    if usable != frames:
        out.note(key, f"{frames} frames -> {usable} (clips here are {step}k+1 frames)")
    return usable


def datasets(out: Translation, items: Any, trigger: Any) -> None:
    """datasets[0] -> the data section; each further dataset -> an entry of data.datasets (its folder, captions,
    resolutions, repeats, regularisation), its other settings taken from datasets[0] here."""
    if not isinstance(items, list) or not items or not isinstance(items[0], dict):
        out.skip("datasets", items, "no dataset folder: set data.path")
        return
    first_dataset(out, Section(out, "datasets[0]", items[0]), trigger)
    entries = []
    for i, extra in enumerate(items[1:], start=1):
        if not isinstance(extra, dict):
            out.skip(f"datasets[{i}]", extra, "a dataset is a mapping of settings")
            continue
        entry = further_dataset(out, Section(out, f"datasets[{i}]", extra), items[0], trigger)
        if entry is not None:
            entries.append(entry)
    if entries:
        out.config.setdefault("data", {})["datasets"] = entries


# A dataset's own settings here (data.datasets entries); the others are one per run, datasets[0]'s.
OWN_KEYS = ("folder_path", "caption_ext", "caption_type", "default_caption", "trigger_word", "resolution",
            "num_repeats", "is_reg")


def further_dataset(out: Translation, s: Section, first: dict, trigger: Any) -> dict | None:
    """One more ai-toolkit dataset as a data.datasets entry; None when it has no folder."""
    path = s.take("folder_path")
    if path is None:
        out.skip(s.key("dataset_path"), s.take("dataset_path"), "no folder_path: add it as a data.datasets entry")
        s.done()
        return None
    entry: dict[str, Any] = {"path": str(path)}
    out.read(s.key("folder_path"), s.key("caption_type"))
    ext = s.take("caption_ext", s.take("caption_type"))
    if ext is not None:
        entry["caption_ext"] = ext if str(ext).startswith(".") else f".{ext}"
        out.read(s.key("caption_ext"))
    for name, key in (("default_caption", "default_caption"), ("trigger_word", "trigger_word")):
        if s.has(name):
            entry[key] = str(s.take(name) or "")
            out.read(s.key(name))
    if trigger and "trigger_word" in entry and entry["trigger_word"] != trigger:
        out.note(s.key("trigger_word"), f"this dataset's own trigger word {entry['trigger_word']!r} (the process's is "
                 f"{trigger!r})")
    if s.has("resolution"):
        resolution = s.take("resolution")
        sizes = [as_int(r, s.key("resolution")) for r in (resolution if isinstance(resolution, list) else [resolution])]
        entry.update({"resolution": max(sizes)} if len(sizes) == 1 else {"resolutions": sizes})
        out.read(s.key("resolution"))
    if s.has("num_repeats"):
        entry["repeats"] = as_int(s.take("num_repeats"), s.key("num_repeats"))
        out.read(s.key("num_repeats"))
    if s.has("is_reg"):
        entry["is_regularization"] = bool(s.take("is_reg"))
        out.read(s.key("is_reg"))
    if first.get("mask_path") and not s.rest.get("mask_path"):
        entry["masked_loss"] = False  # datasets[0]'s masks are not this dataset's: every pixel trains
    for name in list(s.rest):
        value = s.take(name)
        if name in first and first[name] == value:
            out.same(s.key(name), value, "the same as datasets[0]'s, which every dataset shares here")
        else:
            out.skip(s.key(name), value, f"one {name} for every dataset here: datasets[0]'s "
                     f"({first.get(name, 'unset')!r})")
    return entry


def first_dataset(out: Translation, s: Section, trigger: Any) -> None:
    s.skip("type", "only image (and video clip) folders train here", when="image")
    path = s.take("folder_path")
    if path is None:
        out.skip(s.key("dataset_path"), s.take("dataset_path"), "no folder_path: set data.path to an image folder")
    else:
        out.set("data.path", str(path), s.key("folder_path"))
    out.read(s.key("caption_type"))  # ai-toolkit's older name of caption_ext
    ext = s.take("caption_ext", s.take("caption_type", ".txt"))
    out.set("data.caption_ext", ext if str(ext).startswith(".") else f".{ext}", s.key("caption_ext"))
    own = s.take("trigger_word")
    if trigger and own and own != trigger:
        out.skip(s.key("trigger_word"), own, f"one trigger word per run here: the process's {trigger!r}")
    elif own:
        out.read(s.key("trigger_word"))
    if trigger:
        out.set("data.trigger_word", str(trigger), "trigger_word")
    elif own:
        out.set("data.trigger_word", str(own), s.key("trigger_word"))
    if s.has("default_caption"):
        out.set("data.default_caption", str(s.take("default_caption") or ""), s.key("default_caption"))
    if s.has("caption_dropout_rate"):
        out.set("data.caption_dropout", as_float(s.take("caption_dropout_rate"), s.key("caption_dropout_rate")),
                s.key("caption_dropout_rate"))
    if s.has("shuffle_tokens"):
        out.set("data.shuffle_tags", bool(s.take("shuffle_tokens")), s.key("shuffle_tokens"))
    if s.has("token_dropout_rate"):
        out.set("data.tag_dropout", as_float(s.take("token_dropout_rate"), s.key("token_dropout_rate")),
                s.key("token_dropout_rate"))
    if s.has("flip_x"):
        out.set("data.random_flip", bool(s.take("flip_x")), s.key("flip_x"))
    if s.rest.get("random_crop"):
        out.set("data.crop_variants", RANDOM_CROPS, s.key("random_crop"), s.take("random_crop"))
        out.note(s.key("random_crop"), f"data.crop_variants {RANDOM_CROPS}: {RANDOM_CROPS} crops along the side that "
                 "overhangs the bucket, each encoded and cached once (ai-toolkit crops anew every step)")
    s.same("random_crop", "one centred crop per image here too (data.crop_variants 1)")
    if s.has("keep_tokens"):
        out.set("data.keep_tokens", as_int(s.take("keep_tokens"), s.key("keep_tokens")), s.key("keep_tokens"))
    resolution = s.take("resolution", 512)
    sizes = [as_int(r, s.key("resolution")) for r in (resolution if isinstance(resolution, list) else [resolution])]
    out.set("data.resolution", max(sizes), s.key("resolution"))
    if len(sizes) > 1:
        out.set("data.resolutions", sizes, s.key("resolution"))
    if s.has("bucket_tolerance"):
        out.set("data.bucket_step", as_int(s.take("bucket_tolerance"), s.key("bucket_tolerance")),
                s.key("bucket_tolerance"))
    s.skip("buckets", "images are always bucketed by aspect ratio here", when=True)
    cached = [s.take(k) for k in ("cache_latents_to_disk", "cache_latents")]
    if any(c is not None for c in cached):
        out.read(s.key("cache_latents"))
        out.set("data.cache_latents", any(bool(c) for c in cached), s.key("cache_latents_to_disk"))
    if s.has("cache_text_embeddings"):
        out.set("data.cache_text_embeddings", bool(s.take("cache_text_embeddings")), s.key("cache_text_embeddings"))
    if out.family in VIDEO_FAMILIES:
        frames = s.take("num_frames")
        if frames is not None:
            out.set("data.num_frames", clip_frames(as_int(frames, s.key("num_frames")), s.key("num_frames"), out),
                    s.key("num_frames"), frames)
        if out.family == "ltx2" and s.has("fps"):  # ai-toolkit's LTX-2 gives the transformer the dataset's fps
            out.set("train.frame_rate", as_float(s.take("fps"), s.key("fps")), s.key("fps"))
        key = s.key("shrink_video_to_frames")
        if s.take("shrink_video_to_frames", True) is False:
            out.set("data.frame_extraction", "head", key, False)
            out.note(key, "data.frame_extraction=head: num_frames consecutive frames from each video's first "
                     "(ai-toolkit steps by the source-to-dataset fps ratio; a video shorter than num_frames gives "
                     "no clip here, where ai-toolkit spreads it)")
        elif "shrink_video_to_frames" in s.given:
            out.same(key, True, "clips take data.num_frames frames spread over each whole video "
                     "(data.frame_extraction=spread, the default)")
        s.skip("fps", "clips contribute data.num_frames frames by data.frame_extraction, whatever their frame rate",
               when=16)
        if out.family == "ltx2" and s.has("do_audio"):  # LTX-2's audio branch trains on the clips' soundtracks
            audio = bool(s.take("do_audio"))
            out.set("data.audio", "auto" if audio else "off", s.key("do_audio"), audio)
            if audio:
                out.note(s.key("do_audio"), "data.audio=auto: clips with a soundtrack train the audio branch too, "
                         "clips without one the video alone (data.audio=required refuses them)")
        s.skip("do_audio", f"the {out.family} family has no audio branch", when=False)
    else:
        s.skip("num_frames", f"the {out.family} family trains on images", when=1)
        s.same("fps", f"the {out.family} family trains on images (no frame rate)")
    if s.has("num_repeats"):
        out.set("data.repeats", as_int(s.take("num_repeats"), s.key("num_repeats")), s.key("num_repeats"))
    if s.has("is_reg"):
        out.set("data.is_regularization", bool(s.take("is_reg")), s.key("is_reg"))
    masks(out, s)
    controls(out, s)
    for name, reason in (("flip_y", "vertical flips are not available here (data.random_flip mirrors left and right)"),
                         ("random_scale", "augmentation (random scale) is not available here"),
                         ("scale", "images are scaled to cover their aspect bucket here"),
                         ("network_weight", "per-dataset loss weights are not available here"),
                         ("loss_multiplier", "per-dataset loss weights are not available here"),
                         ("shrink_video_to_frames", f"the {out.family} family trains on images"),
                         ("do_i2v", "image-to-video follows the model (model.task: auto)"),
                         ("batch_size", "one batch size per run here: train.batch_size")):
        s.skip(name, reason, when={"network_weight": 1.0, "loss_multiplier": 1.0, "scale": 1.0,
                                   "shrink_video_to_frames": True, "do_i2v": True, "batch_size": None}.get(name, False))
    for name in ("num_workers", "prefetch_factor", "fast_image_size", "debug"):
        s.same(name, "data loading runs its own way here: latents and text embeddings are cached, then read")
    s.done()


def controls(out: Translation, s: Section) -> None:
    """control_path (a folder, or a list of them) or control_path_1 .. _3 (the multi-control models' folders), each
    holding one control image per target under its name -> data.reference_paths, in that order, for the families
    that take reference images; the other families train without them."""
    given = {name: s.take(name) for name in CONTROL_PATHS if s.has(name)}
    folders = [str(f) for value in given.values() for f in (value if isinstance(value, list) else [value]) if f]
    s.skip("controls", "reference images come from data.reference_paths here, not from a list of control types")
    for name in ("full_size_control_images", "control_transparent_color"):
        s.skip(name, "references are sized as the family's pipeline sizes them (docs/edit.md)")
    if not folders:
        for name, value in given.items():
            out.same(s.key(name), value, "no control images")
    elif out.family not in REFERENCE_FAMILIES:
        for name, value in given.items():
            out.skip(s.key(name), value, f"the {out.family} family trains without control images (reference "
                     f"images train with {', '.join(REFERENCE_FAMILIES)})")
    else:
        first, *others = given
        out.read(*(s.key(name) for name in others))
        out.set("data.reference_paths", folders, s.key(first))
        out.note(s.key(first), f"data.reference_paths {folders}: reference i of name.png is folder i's image with "
                 "its name (docs/edit.md); every target needs one in each folder")


def masks(out: Translation, s: Section) -> None:
    """mask_path (a folder of masks named as the images, white trained) -> data.masked_loss with data.mask_folder;
    mask_min_value -> data.mask_min."""
    folder = s.take("mask_path")
    if folder:
        out.set("data.masked_loss", True, s.key("mask_path"), folder)
        out.set("data.mask_folder", str(folder), s.key("mask_path"))
        if s.has("mask_min_value"):
            out.set("data.mask_min", as_float(s.take("mask_min_value"), s.key("mask_min_value")),
                    s.key("mask_min_value"))
    else:
        s.same("mask_min_value", "no mask_path: the loss is not masked")
    s.skip("invert_mask", "masks are read white = trained here: invert the mask files", when=False)
    s.skip("alpha_mask", "masks come from mask files here (name.mask.png or data.mask_folder), not from the image's "
           "alpha channel", when=False)
