#!/usr/bin/env bash
# Builds .whl-dpo/: the wheels bench/device_queue.sh installs on a GPU machine (which has torch, transformers, peft
# and accelerate, no package registry): the toolkit's missing dependencies (omegaconf and its antlr4 runtime,
# diffusers, ftfy) and what bench/llm_objectives.py's TRL rows import (trl, datasets and its own). About 10 MB, so a
# device call can carry it beside one peer (.whl-peers/NAME, bench/peers/packages.sh). Run in the repository root on
# a machine with PyPI; the folder is git-ignored through .git/info/exclude.
set -euo pipefail
cd "$(dirname "$0")/.."
exclude="$(git rev-parse --git-common-dir)/info/exclude"
mkdir -p "$(dirname "$exclude")"
grep -qxF "/.whl-dpo/" "$exclude" 2>/dev/null || echo "/.whl-dpo/" >> "$exclude"
PLATFORMS=(--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
rm -rf .whl-dpo && mkdir -p .whl-dpo
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${PLATFORMS[@]}" \
    -d .whl-dpo omegaconf diffusers ftfy wcwidth importlib_metadata "trl<=1.15.0" "datasets<5" dill multiprocess xxhash
python3 -m pip wheel -q --no-deps -w .whl-dpo antlr4-python3-runtime==4.9.3
du -sh .whl-dpo
