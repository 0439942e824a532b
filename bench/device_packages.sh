#!/usr/bin/env bash
# Builds what the benches need on a GPU machine that has PyTorch, transformers, peft and accelerate but no
# package registry: .whl/ (wheels of the toolkit's missing dependencies) and .whl-unsloth/peer.tar.gz (unsloth
# and what it imports, installed for CPython 3.12 x86_64, for bench/peer_unsloth.py). Run it in the repository
# root on a machine with PyPI; both folders are git-ignored through .git/info/exclude. On the GPU machine:
#
#   python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl
#   mkdir -p /tmp/peer && tar xzf .whl-unsloth/peer.tar.gz -C /tmp/peer
#   export PYTHONPATH=/tmp/site:$PWD
#
# The unsloth wheels come to about 85 MB, over what a device call carries (64 MiB with the tree): the archive
# leaves out unsloth's studio/ web app and bitsandbytes' libraries for CUDA versions other than 13.x (16 MB).
set -euo pipefail
cd "$(dirname "$0")/.."
PLATFORMS=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64
           --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64)
get() {  # get DIR SPEC...: binary wheels for CPython 3.12 x86_64, without their dependencies
    local dir="$1"; shift
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        "${PLATFORMS[@]}" -d "$dir" "$@"
}
for path in /.whl/ /.whl-unsloth/; do
    grep -qxF "$path" .git/info/exclude 2>/dev/null || echo "$path" >> .git/info/exclude
done

rm -rf .whl && mkdir -p .whl
# diffusers and what it needs beyond the image; omegaconf (its antlr4 runtime is an sdist: built here);
# liger-kernel for bench/llm.py's liger rows. av (PyAV, 35 MB) is left out: only video data reads it.
get .whl omegaconf diffusers ftfy wcwidth importlib_metadata liger-kernel
python3 -m pip wheel -q --no-deps -w .whl antlr4-python3-runtime==4.9.3

work="$(mktemp -d)"
get "$work/wheels" unsloth==2026.10.9 unsloth_zoo==2026.10.9 "trl<=1.15.0" "datasets<5,!=4.4.*,!=4.5.0" \
    bitsandbytes tyro docstring_parser shtab dill multiprocess pydantic pydantic_core annotated_types \
    typing_inspection json5 nest_asyncio structlog msgspec cut_cross_entropy
python3 -m pip install -q --no-deps --no-compile --python-version 3.12 --implementation cp "${PLATFORMS[@]}" \
    --only-binary=:all: --target "$work/tree" "$work"/wheels/*.whl
rm -rf "$work/tree/studio" "$work/tree/unsloth/studio"
find "$work/tree/bitsandbytes" -name 'libbitsandbytes_*.so' ! -name '*cuda13*' -delete
rm -rf .whl-unsloth && mkdir -p .whl-unsloth
tar czf .whl-unsloth/peer.tar.gz -C "$work/tree" .
rm -rf "$work"
du -sh .whl .whl-unsloth
