#!/usr/bin/env bash
# Builds .whl-peers/NAME (source.tar.gz and wheels/) for each peer named, on a machine with PyPI, for
# bench/peers/common.py's install() on the GPU machine (CPython 3.12 x86_64; the wheels chosen are pure Python or
# abi3, so the same folder serves a CPU check on another CPython 3). Each peer's pins live in bench/peers/NAME.sh:
#   GITHUB=owner/name  COMMIT=<40 hex>  WHEELS=(spec ...)  [EXCLUDE=(path ...): left out of the source archive]
#   [SDISTS=(spec ...): pure-Python packages PyPI has only as source, built into wheels here]
# The source comes from a local mirror ($PEER_MIRRORS/owner+name/repo, the search tool's fetch) or GitHub.
#   bash bench/peers/packages.sh kohya musubi aitk
set -euo pipefail
cd "$(dirname "$0")/../.."
exclude="$(git rev-parse --git-common-dir)/info/exclude"  # a worktree shares its repository's
mkdir -p "$(dirname "$exclude")"
grep -qxF "/.whl-peers/" "$exclude" 2>/dev/null || echo "/.whl-peers/" >> "$exclude"
PLATFORMS=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64
           --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64)
for name in "$@"; do
    GITHUB= COMMIT= WHEELS=() EXCLUDE=() SDISTS=()
    # shellcheck source=/dev/null
    source "bench/peers/$name.sh"
    out=".whl-peers/$name"
    rm -rf "$out" && mkdir -p "$out/wheels"
    mirror="${PEER_MIRRORS:-/work/.mirror}/${GITHUB/\//+}/repo"
    if [ ! -d "$mirror" ]; then
        mirror="$(mktemp -d)/repo"
        git clone -q --bare "https://github.com/$GITHUB" "$mirror"
    fi
    git -C "$mirror" archive --format=tar.gz -o "$PWD/$out/source.tar.gz" "$COMMIT" -- . "${EXCLUDE[@]/#/:!}"
    if [ "${#WHEELS[@]}" -gt 0 ]; then
        python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
            "${PLATFORMS[@]}" -d "$out/wheels" "${WHEELS[@]}"
    fi
    if [ "${#SDISTS[@]}" -gt 0 ]; then
        python3 -m pip wheel -q --no-deps -w "$out/wheels" "${SDISTS[@]}"
    fi
    du -sh "$out"
done
