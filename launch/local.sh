#!/usr/bin/env bash
# Single-node launch: torchrun over NPROC local ranks (CPU ranks over gloo, or one rank per GPU).
#
# Variables read (all optional):
#   NPROC        ranks on this node (default: number of GPUs, else 2)
#   CKPT         checkpoint directory (default: synthesize a tiny qwen3_moe under $TMPDIR)
#   DEVICE       cpu | cuda (default: cuda when a GPU is visible, else cpu)
#   PYTHON       interpreter (default: python)
# Remaining arguments go to coordloader.load (layout flags: default --tp $NPROC).
#
#   NPROC=2 launch/local.sh --tp 2 --verify digest
set -euo pipefail
PYTHON=${PYTHON:-python}
if [[ -z "${DEVICE:-}" ]]; then
  if "$PYTHON" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
    DEVICE=cuda
  else
    DEVICE=cpu
  fi
fi
if [[ -z "${NPROC:-}" ]]; then
  if [[ "$DEVICE" == cuda ]]; then
    NPROC=$("$PYTHON" -c 'import torch; print(torch.cuda.device_count())')
    if [[ "$NPROC" -lt 1 ]]; then
      # torchrun would die on an assertion with 0 processes
      echo "local.sh: DEVICE=cuda but torch sees no CUDA device; set DEVICE=cpu or NPROC" >&2
      exit 2
    fi
  else
    NPROC=2
  fi
fi
if [[ -z "${CKPT:-}" ]]; then
  CKPT="${TMPDIR:-/tmp}/coordloader-tiny-qwen3_moe"
  if [[ ! -f "$CKPT/config.json" ]]; then
    "$PYTHON" -m coordloader.synth --arch qwen3_moe --size tiny "$CKPT"
  fi
fi
# no layout flag given: --tp $NPROC (also beside other flags, such as --verify digest)
has_layout=0
for a in "$@"; do
  case "$a" in --tp|--tp=*|--pp|--pp=*|--dp|--dp=*|--ep|--ep=*) has_layout=1 ;; esac
done
if [[ $has_layout -eq 0 ]]; then
  set -- --tp "$NPROC" "$@"
fi
exec "$PYTHON" -m torch.distributed.run --standalone --nproc-per-node "$NPROC" \
  -m coordloader.load "$CKPT" --device "$DEVICE" "$@"
