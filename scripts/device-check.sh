#!/usr/bin/env bash
# Device check on one GPU (scripts/device_check.py says what is in its JSON report):
#   model: a small Llama's prompt KV from prefill ranks (TP 1 and 2) to a decode rank by
#          kvpush's connector halves, in vLLM 0.33's packed GPU layout; the decode's greedy
#          tokens must equal one process's alone (push, pull, block sizes, progressive push);
#   wire:  kvpush push and pull between two processes, VRAM registered with NIXL, bytes
#          verified on the device, throughput against torch's copy_ on the same GPU.
# One JSON object last on stdout; under 8 minutes on one H200, with no network.
#
# The GPU host's python3 is itself a virtual environment holding the CUDA torch, numpy,
# msgpack, anyio and transformers, with no network and no NIXL. NIXL (and whichever of
# kvpush's dependencies a host lacks) travels as wheels in .device-wheels/ (git ignores it).
#
# 1. Fetch, on a machine with network, from the repository root:
#
#      scripts/device-check.sh fetch
#
#    which runs (py3.12, x86_64, manylinux_2_28; NIXL without its torch requirement):
#
#      pip download --no-deps --python-version 3.12 --only-binary=:all: \
#          --platform manylinux_2_28_x86_64 -d .device-wheels nixl==1.5.1 nixl-cu13==1.5.1
#      pip download --python-version 3.12 --only-binary=:all: \
#          --platform manylinux_2_28_x86_64 -d .device-wheels numpy msgpack anyio
#
#    and then drops nixl_ep_cu13/ (NIXL's expert-parallel kernels, never loaded here) from
#    the nixl-cu13 wheel: 56 MiB -> 29 MiB, about 45 MiB in all, under the 64 MiB a device
#    run may carry.
#
# 2. Carry .device-wheels with the working tree (the device run's `carry: [".device-wheels"]`)
#    and run, on the GPU host, from the repository root:
#
#      scripts/device-check.sh --gpu
#
#    (any scripts/device_check.py arguments: --checks model|wire|model,wire,
#    --model-cases NAMES|all|ci, --total-mib 1024, --block-kib 16 ..., --reps 5).
#    With the same interpreter throughout (PYTHON, default python3; no venv is made: a
#    `python3 -m venv --system-site-packages` made from a venv's python sees neither its
#    torch nor its numpy), it installs offline only what does not import, into a scratch
#    site directory (KVPUSH_DEVICE_SITE, default .venv-device-site/, ignored by git):
#
#      python3 -m pip install -q --no-index --no-deps --upgrade --target .venv-device-site \
#          .device-wheels/nixl-1.5.1-*.whl .device-wheels/nixl_cu13-1.5.1-*.whl [numpy ...]
#
#    puts that directory first on PYTHONPATH, and runs, under `timeout`
#    (KVPUSH_DEVICE_TIMEOUT, default 450 s):
#
#      PYTHONPATH=.venv-device-site python3 scripts/device_check.py --gpu
#
# kvpush itself runs from this tree (the script puts it on sys.path; nothing to build).
# KVPUSH_NIXL_CUDA picks the NIXL wheel (13, or 12 for CUDA 12), KVPUSH_DEVICE_WHEELS the
# folder; --cpu runs both checks on DRAM (CI: make device-check-cpu).
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
WHEELS=${KVPUSH_DEVICE_WHEELS:-$ROOT/.device-wheels}
SITE=${KVPUSH_DEVICE_SITE:-$ROOT/.venv-device-site}
PYTHON=${PYTHON:-python3}
PLATFORM=(--python-version 3.12 --only-binary=:all: --platform manylinux_2_28_x86_64)
CU=${KVPUSH_NIXL_CUDA:-13}  # 12 for a CUDA 12 machine
NIXL_PINS=(nixl==1.5.1 "nixl-cu$CU==1.5.1")
DEPS=(numpy msgpack anyio)
# anyio's own requirements, installed beside it where they do not import (no resolver: --no-deps).
ANYIO_DEPS=(idna sniffio typing_extensions exceptiongroup)

die() { echo "device-check: $*" >&2; exit 2; }

if [[ ${1:-} == fetch ]]; then
    mkdir -p "$WHEELS"
    "$PYTHON" -m pip download --no-deps "${PLATFORM[@]}" -d "$WHEELS" "${NIXL_PINS[@]}"
    "$PYTHON" -m pip download "${PLATFORM[@]}" -d "$WHEELS" "${DEPS[@]}"
    "$PYTHON" "$ROOT/scripts/device_check.py" --slim-wheels "$WHEELS"
    du -sh "$WHEELS"
    exit 0
fi

export PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH}
imports() { "$PYTHON" -c "import $1" 2>/dev/null; }

# The wheel files of distributions `$@` (a missing one is fatal unless optional=1).
wheels=()
add_wheels() {
    local name file
    for name in "$@"; do
        file=$(compgen -G "$WHEELS/${name}-[0-9]*.whl" | sort -V | tail -n 1 || true)
        if [[ -n $file ]]; then
            wheels+=("$file")
        elif [[ ${optional:-0} != 1 ]]; then
            die "$name does not import and $WHEELS has no $name wheel:" \
                "run 'scripts/device-check.sh fetch' on a machine with network and carry it"
        fi
    done
}

imports nixl._api || add_wheels nixl "nixl_cu$CU"
for mod in "${DEPS[@]}"; do
    imports "$mod" || add_wheels "$mod"
done
if ! imports anyio; then
    for mod in "${ANYIO_DEPS[@]}"; do
        imports "$mod" || optional=1 add_wheels "$mod"
    done
fi
if ((${#wheels[@]})); then
    echo "device-check: installing into $SITE: ${wheels[*]##*/}" >&2
    "$PYTHON" -m pip install -q --no-index --no-deps --upgrade --target "$SITE" "${wheels[@]}" \
        || die "installing ${wheels[*]##*/} into $SITE failed"
fi
for mod in nixl._api "${DEPS[@]}"; do
    why=$("$PYTHON" -c "import $mod" 2>&1 | tail -n 1) \
        || die "$mod does not import with PYTHONPATH=$PYTHONPATH ($PYTHON): $why"
done

exec timeout -k 15 "${KVPUSH_DEVICE_TIMEOUT:-450}" "$PYTHON" "$ROOT/scripts/device_check.py" "$@"
