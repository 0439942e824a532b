#!/usr/bin/env bash
# Launcher for the LoRA toolkit: sets up the Python environment on first use, exports the ROCm
# environment for the GPUs in this machine (before torch starts: HSA reads it at runtime start),
# then hands over to `python -m toolkit`.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# The torch pin lives here only: pyproject leaves torch open so a ROCm or CUDA build stays in place.
TORCH_SPEC="${TOOLKIT_TORCH_SPEC:-torch==2.13.0}"
STAMP_NAME=".toolkit-installed"

usage() {
    cat <<'EOF'
usage: ./start_toolkit.sh [--debug-hip] COMMAND [ARGS...]

commands (passed to `python -m toolkit COMMAND`):
  train CONFIG.yaml [key=value ...]   train a LoRA (dotlist overrides win last; resumes a run folder)
        [--gpus N|all]                one process per GPU on this node (default: one process)
        [--nnodes M --node-rank R --master-addr HOST [--master-port PORT]]
                                      several nodes: run it on every node, R = that node's rank
  validate CONFIG.yaml                the merged config and where each value came from
  presets                             GPU architecture presets, and which one applies here
  doctor                              backend, arch, ROCm environment, bitsandbytes, torch
  sample RUN_DIR [--checkpoint STEP]  images, video or text from a run's LoRA (final/ or a checkpoint)
        [--prompt TEXT ...] [--seed N] with the run's own model and sample settings, into RUN_DIR/samples/cli-*/
  merge RUN_DIR OUT_DIR               fold an LLM LoRA into its base model and save the full model
  import-aitk JOB.yaml > CONFIG.yaml  translate an ai-toolkit job file (what does not translate: on stderr)
  ui [--host H] [--port N] [--token T] [--outputs DIR]
                                      a local web UI: start, watch and compare runs (http://127.0.0.1:8642/)
  test [PYTEST ARGS]                  the test suite, or the paths given (pytest, one worker per core, at most 4)

options:
  --debug-hip   serialize HIP kernels and enable device-side assertions (slow, exact error locations)
  -h, --help    this message

environment:
  TOOLKIT_PYTHON=/path/to/python   use this interpreter's environment instead of creating .venv
  TOOLKIT_TORCH_SPEC=SPEC          what `pip install` gets for torch in a new .venv (default torch==2.13.0)

The first run creates .venv in the repository and installs the toolkit; later runs reuse it. `test` adds
.venv-test beside it (pytest, bitsandbytes, torchao over .venv), so that .venv holds only what training needs.
ROCm variables you set yourself are never overridden; every training process (--gpus) inherits them.
Several GPUs and nodes: docs/multi-gpu.md.
EOF
}

say() { echo "start_toolkit.sh: $*" >&2; }

# Runs a command with its output in a log; on failure shows the log's tail and exits.
run_logged() {
    local what="$1"; shift
    local log
    log="$(mktemp "${TMPDIR:-/tmp}/toolkit-install.XXXXXX")"
    if ! "$@" >"$log" 2>&1; then
        say "$what failed: $*"
        tail -n 40 "$log" >&2
        say "(full log: $log)"
        exit 1
    fi
    rm -f "$log"
}

pyproject_hash() {
    sha256sum "$ROOT/pyproject.toml" | cut -d' ' -f1
}

# Sets PY to a .venv interpreter with the toolkit installed, installing on first use and whenever
# pyproject.toml changed since the last successful install.
setup_venv() {
    local venv="$ROOT/.venv" stamp="$ROOT/.venv/$STAMP_NAME" want
    PY="$venv/bin/python"
    want="$(pyproject_hash)"
    if [[ -x "$PY" && -f "$stamp" && "$(cat "$stamp")" == "$want" ]]; then
        return
    fi
    if [[ ! -x "$PY" ]]; then
        say "creating $venv (first run)"
        run_logged "creating the virtual environment" "${TOOLKIT_BASE_PYTHON:-python3}" -m venv "$venv"
    fi
    if ! "$PY" -c "import torch" >/dev/null 2>&1; then
        say "installing $TORCH_SPEC"
        run_logged "installing torch" "$PY" -m pip install "$TORCH_SPEC"
    fi
    # The runtime dependencies only: the test extra's bitsandbytes and torchao print "Failed to load ..." and
    # deprecation warnings whenever transformers imports them, in every script a user runs in this environment.
    say "installing the toolkit (pip install -e .)"
    run_logged "installing the toolkit" "$PY" -m pip install -e "$ROOT"
    echo "$want" >"$stamp"
}

# Sets PY to .venv-test's interpreter: an environment layered over .venv (which it sees through a .pth file) that
# adds the test extra (pytest, pytest-xdist, bitsandbytes, torchao), so that .venv keeps only what users need.
setup_test_venv() {
    local base="$PY" venv="$ROOT/.venv-test" stamp="$ROOT/.venv-test/$STAMP_NAME" want base_site test_site extra
    want="$(pyproject_hash)"
    PY="$venv/bin/python"
    if [[ -x "$PY" && -f "$stamp" && "$(cat "$stamp")" == "$want" ]]; then
        return
    fi
    if [[ ! -x "$PY" ]]; then
        say "creating $venv (the test extra, over .venv)"
        run_logged "creating the test environment" "$base" -m venv "$venv"
    fi
    base_site="$("$base" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
    test_site="$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
    # site.addsitedir also runs .venv's own .pth files (the toolkit's editable install among them)
    printf 'import site; site.addsitedir(%s)\n' "'$base_site'" >"$test_site/_toolkit_runtime.pth"
    extra="$(cd / && "$base" - <<'EOF'
import importlib.metadata as md, re
for req in md.requires("lora-toolkit") or []:
    if re.search(r"""extra\s*==\s*['"]test['"]""", req):
        print(req.split(";")[0].strip())
EOF
)"
    say "installing the test extra into $venv: $(echo $extra)"
    # shellcheck disable=SC2086  # one requirement per word
    run_logged "installing the test extra" "$PY" -m pip install $extra
    echo "$want" >"$stamp"
}

# Sets PY to $TOOLKIT_PYTHON; installs only the toolkit itself (no deps) when it is not importable,
# and names the dependencies that environment lacks.
use_given_python() {
    PY="$TOOLKIT_PYTHON"
    [[ -x "$PY" ]] || { say "TOOLKIT_PYTHON=$PY is not an executable"; exit 1; }
    # From / so that the repository checkout on the cwd path does not make it look installed.
    if ! (cd / && "$PY" -c "import toolkit") >/dev/null 2>&1; then
        say "installing the toolkit into $PY's environment (pip install --no-deps -e .)"
        run_logged "installing the toolkit" "$PY" -m pip install --no-deps -e "$ROOT"
    fi
    local missing
    missing="$(cd / && "$PY" - <<'EOF'
import importlib.metadata as md, re
missing = []
for req in md.requires("lora-toolkit") or []:
    if "extra ==" in req:
        continue
    name = re.match(r"[A-Za-z0-9_.-]+", req).group(0)
    try:
        md.version(name)
    except md.PackageNotFoundError:
        missing.append(req)
print(" ".join(missing))
EOF
)"
    if [[ -n "$missing" ]]; then
        say "TOOLKIT_PYTHON=$PY lacks these dependencies: $missing"
        say "install them with: $PY -m pip install -e '$ROOT'"
    fi
}

debug_hip=0
while [[ $# -gt 0 ]]; do
    case "$1" in
        --debug-hip) debug_hip=1; shift ;;
        -h|--help) usage; exit 0 ;;
        -*) say "unknown option $1"; usage >&2; exit 2 ;;
        *) break ;;
    esac
done
if [[ $# -eq 0 ]]; then
    usage
    exit 2
fi

if [[ -n "${TOOLKIT_PYTHON:-}" ]]; then
    use_given_python
else
    setup_venv
    if [[ "$1" == "test" ]]; then
        # Tests that check the users' environment (.venv, without the test extra) run this interpreter.
        export TOOLKIT_RUNTIME_PYTHON="$PY"
        setup_test_venv
    fi
fi

rocm_args=()
[[ $debug_hip -eq 1 ]] && rocm_args+=(--debug-hip)
# Tests point this at a fake sysfs tree (tests/fixtures/kfd/...).
[[ -n "${TOOLKIT_SYSFS_ROOT:-}" ]] && rocm_args+=(--sysfs-root "$TOOLKIT_SYSFS_ROOT")
rocm_exports="$("$PY" -m toolkit.device.rocm_env "${rocm_args[@]}")" || {
    say "python -m toolkit.device.rocm_env failed (see above)"
    exit 1
}
eval "$rocm_exports"
# These exports are in this shell's environment before the exec below, so `python -m toolkit` has them, and
# so does every worker that `train --gpus N` starts (torch's launcher copies the parent's environment into
# each worker's). HSA reads them when the HIP runtime starts, in each process.

command="$1"
case "$command" in
    test)
        shift
        cd "$ROOT"
        # The whole suite unless paths are given (a test file, a folder, tests/x.py::name)
        where=(tests)
        for arg in "$@"; do
            if [[ "$arg" != -* && ( -e "${arg%%::*}" ) ]]; then where=(); break; fi
        done
        # One pytest-xdist worker per core this process may use, at most 4 (TOOLKIT_TEST_WORKERS overrides, 0 runs
        # the tests in this process); none where xdist cannot apply: -n given, debugging (--pdb, --trace), output
        # not captured (-s), or xdist switched off (-p no:xdist)
        workers="${TOOLKIT_TEST_WORKERS:-$("$PY" -c 'import os; print(min(4, len(os.sched_getaffinity(0))))')}"
        if [[ ! "$workers" =~ ^[0-9]+$ ]]; then
            say "TOOLKIT_TEST_WORKERS=$workers: give a number of pytest workers (0: one process)"
            exit 2
        fi
        distribute=1
        previous=""
        for arg in "$@"; do
            case "$arg" in
                -n|-n*|--numprocesses*|--pdb|--trace|-s|--capture=no|-p*no:xdist) distribute=0 ;;
                no:xdist) [[ "$previous" == "-p" ]] && distribute=0 ;;
            esac
            previous="$arg"
        done
        if ! "$PY" -c "import xdist" >/dev/null 2>&1; then
            [[ "$workers" != 0 ]] && say "pytest-xdist is not installed in $PY's environment: the tests run in one process"
            distribute=0
        fi
        if [[ "$distribute" == 1 ]]; then
            exec "$PY" -m pytest -q "${where[@]}" -n "$workers" "$@"
        fi
        exec "$PY" -m pytest -q "${where[@]}" "$@"
        ;;
    __env)
        # Hidden, for tests: the value of each named variable after the ROCm exports.
        shift
        for name in "$@"; do
            if [[ -v "$name" ]]; then printf '%s=%s\n' "$name" "${!name}"; else printf '%s unset\n' "$name"; fi
        done
        exit 0
        ;;
    *)
        exec "$PY" -m toolkit "$@"
        ;;
esac
