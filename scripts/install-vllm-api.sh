#!/usr/bin/env bash
# Install the real vLLM 0.33.0 *API* (scheduler, KV connector base/factory, config, Request) into
# the environment of the given Python interpreter, on a CPU-only host, for tests/vllm/.
#
#   scripts/install-vllm-api.sh PYTHON        e.g. scripts/install-vllm-api.sh .venv/bin/python
#
# What it installs (see requirements/vllm-0.33-cpu.txt for why):
#   1. torch==2.13.0+cpu, pinned so that pip fails loudly instead of pulling a multi-GB CUDA
#      build: from /opt/wheels when the wheel lies there, else from the PyTorch CPU index;
#   2. vllm==0.33.0 with --no-deps (its metadata pins a CUDA torch and GPU kernels);
#   3. requirements/vllm-0.33-cpu.txt: vllm's own requirements minus the GPU ones;
#   4. xgrammar==0.2.8 with --no-deps (the scheduler imports it) and apache-tvm-ffi==0.1.11.
# Idempotent: exits at once when `import vllm.v1.core.sched.scheduler` already works.
# Optional: VLLM_WHEEL_DIR=DIR adds DIR as a --find-links source (a pre-downloaded vllm wheel).
set -euo pipefail

if [[ $# -ne 1 ]]; then
    echo "usage: $0 PYTHON" >&2
    exit 2
fi
PY=$1
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
REQS="$ROOT/requirements/vllm-0.33-cpu.txt"

TORCH_VERSION=2.13.0+cpu
VLLM_VERSION=0.33.0
XGRAMMAR_VERSION=0.2.8
TVM_FFI_VERSION=0.1.11
LOCAL_WHEELS=/opt/wheels
TORCH_CPU_INDEX=https://download.pytorch.org/whl/cpu

export VLLM_TARGET_DEVICE=cpu HF_HUB_OFFLINE=1

probe() {
    "$PY" -c 'import vllm.v1.core.sched.scheduler' >/dev/null 2>&1
}

if probe; then
    echo "install-vllm-api: vllm API already importable in $("$PY" -c 'import sys; print(sys.prefix)'); skipping"
    exit 0
fi

start=$SECONDS
# A constraints file that holds torch at the CPU build through every step below: a requirement
# that wanted another torch makes pip fail instead of replacing it with a CUDA build.
constraints=$(mktemp)
trap 'rm -f "$constraints"' EXIT
echo "torch==$TORCH_VERSION" >"$constraints"

# pip's stderr goes to stdout, less two kinds of expected noise: the "Location ... is ignored"
# warnings that this machine kind's local index configuration prints for every package it
# does not hold, and the resolver's complaints that vllm's GPU requirements (left out on
# purpose) are missing or that torch is 2.13.0+cpu rather than 2.14.0, and that xgrammar
# lacks triton. Any other conflict line still shows. pip's exit status is kept (pipefail).
pip_install() {
    "$PY" -m pip install -q --disable-pip-version-check -c "$constraints" \
        ${VLLM_WHEEL_DIR:+--find-links "$VLLM_WHEEL_DIR"} "$@" 2>&1 \
        | sed -e '/is ignored: it is neither a file nor a directory/d' \
            -e "/^ERROR: pip's dependency resolver does not currently take into account/d" \
            -e "/^vllm $VLLM_VERSION \(requires\|has requirement\) /d" \
            -e "/^xgrammar $XGRAMMAR_VERSION requires triton/d"
}

# 1. CPU torch.
torch_src=()
if compgen -G "$LOCAL_WHEELS/torch-$TORCH_VERSION-*.whl" >/dev/null; then
    torch_src=(--find-links "$LOCAL_WHEELS")
else
    torch_src=(--extra-index-url "$TORCH_CPU_INDEX")
fi
pip_install "${torch_src[@]}" "torch==$TORCH_VERSION"

# 2. vLLM itself, without its (CUDA) requirements.
pip_install --no-deps "vllm==$VLLM_VERSION"

# 3. vLLM's requirements minus the GPU ones.
pip_install "${torch_src[@]}" -r "$REQS"

# 4. Structured-output backends the scheduler imports.
pip_install --no-deps "xgrammar==$XGRAMMAR_VERSION"
pip_install "apache-tvm-ffi==$TVM_FFI_VERSION"

if ! "$PY" -c 'import vllm.v1.core.sched.scheduler'; then
    echo "install-vllm-api: vllm installed but the scheduler does not import (see above)" >&2
    exit 1
fi
got=$("$PY" -c 'import torch, vllm; print(f"vllm {vllm.__version__}, torch {torch.__version__}")')
echo "install-vllm-api: $got installed in $((SECONDS - start)) s"
