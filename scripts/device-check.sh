#!/usr/bin/env bash
# Device check: kvpush push and pull over NIXL (UCX) between two processes on one GPU,
# VRAM registered with NIXL, bytes verified on the device with torch, throughput against
# a plain torch copy_ on the same GPU; one JSON object last on stdout (scripts/device_check.py
# says what is in it). Under 8 minutes on one H200 by default, with no network.
#
# The device machine has Python 3.12, CUDA 13 and a CUDA torch, and no network. NIXL and
# any of kvpush's own dependencies (numpy, msgpack, anyio) it lacks travel as wheels in
# .device-wheels/ (git ignores it). On a machine with network, from the repository root:
#
#   scripts/device-check.sh fetch
#
# which runs (py3.12, x86_64, manylinux_2_28; NIXL without its torch requirement):
#
#   pip download --no-deps --python-version 3.12 --only-binary=:all: \
#       --platform manylinux_2_28_x86_64 -d .device-wheels nixl==1.5.1 nixl-cu13==1.5.1
#   pip download --python-version 3.12 --only-binary=:all: \
#       --platform manylinux_2_28_x86_64 -d .device-wheels numpy msgpack anyio
#
# and then drops nixl_ep_cu13/ (NIXL's expert-parallel kernels, never loaded here) from the
# nixl-cu13 wheel: 56 MiB -> 29 MiB, so everything (about 45 MiB) fits in the 64 MiB a
# device run may carry. Carry .device-wheels with the working tree (run's `carry`), then on
# the device machine:
#
#   scripts/device-check.sh [--gpu] [--total-mib 1024] [--block-kib 16 ...] [--reps 5]
#
# makes .venv-device with --system-site-packages (so the machine's torch is used), installs
# offline only what is missing:
#
#   pip install --no-deps --no-index --find-links .device-wheels nixl nixl-cu13
#   pip install --no-index --find-links .device-wheels <those of numpy msgpack anyio absent>
#
# and runs scripts/device_check.py under `timeout` (KVPUSH_DEVICE_TIMEOUT, default 420 s).
# kvpush itself runs from this tree (the script puts the tree on sys.path; nothing to build).
# Where `python3 -m venv` is unavailable it installs with `pip install --target .venv-device-site`
# instead. PYTHON picks the interpreter (default python3), KVPUSH_NIXL_CUDA the NIXL wheel
# (13, or 12 for CUDA 12), KVPUSH_DEVICE_WHEELS the folder; --cpu runs the DRAM path (CI).
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
WHEELS=${KVPUSH_DEVICE_WHEELS:-$ROOT/.device-wheels}
PYTHON=${PYTHON:-python3}
PLATFORM=(--python-version 3.12 --only-binary=:all: --platform manylinux_2_28_x86_64)
CU=${KVPUSH_NIXL_CUDA:-13}  # 12 for a CUDA 12 machine
NIXL_PINS=(nixl==1.5.1 "nixl-cu$CU==1.5.1")
DEPS=(numpy msgpack anyio)

die() { echo "device-check: $*" >&2; exit 2; }

if [[ ${1:-} == fetch ]]; then
    mkdir -p "$WHEELS"
    "$PYTHON" -m pip download --no-deps "${PLATFORM[@]}" -d "$WHEELS" "${NIXL_PINS[@]}"
    "$PYTHON" -m pip download "${PLATFORM[@]}" -d "$WHEELS" "${DEPS[@]}"
    "$PYTHON" "$ROOT/scripts/device_check.py" --slim-wheels "$WHEELS"
    du -sh "$WHEELS"
    exit 0
fi

VENV=$ROOT/.venv-device
if [[ -x $VENV/bin/python ]] || "$PYTHON" -m venv --system-site-packages "$VENV" >&2; then
    PY=$VENV/bin/python
    TARGET=()
else
    echo "device-check: no venv (python3-venv missing?): installing into .venv-device-site" >&2
    PY=$PYTHON
    TARGET=(--target "$ROOT/.venv-device-site")
    export PYTHONPATH=$ROOT/.venv-device-site${PYTHONPATH:+:$PYTHONPATH}
fi
PIP=("$PY" -m pip install -q --no-index --find-links "$WHEELS" "${TARGET[@]}")

missing=()
for mod in "${DEPS[@]}"; do
    "$PY" -c "import $mod" 2>/dev/null || missing+=("$mod")
done
if ! "$PY" -c 'import nixl._api' 2>/dev/null || ((${#missing[@]})); then
    [[ -d $WHEELS ]] || die "NIXL or ${missing[*]:-nothing else} missing and no $WHEELS:" \
        "run 'scripts/device-check.sh fetch' on a machine with network and carry it"
fi
if ! "$PY" -c 'import nixl._api' 2>/dev/null; then
    "${PIP[@]}" --no-deps nixl "nixl-cu$CU" || die "installing NIXL from $WHEELS failed"
fi
if ((${#missing[@]})); then
    "${PIP[@]}" "${missing[@]}" || die "installing ${missing[*]} from $WHEELS failed"
fi

exec timeout -k 15 "${KVPUSH_DEVICE_TIMEOUT:-420}" "$PY" "$ROOT/scripts/device_check.py" "$@"
