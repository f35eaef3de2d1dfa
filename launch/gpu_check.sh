#!/usr/bin/env bash
# GPU check, for the day a GPU machine is lent: the checks that cannot run on CPU, in one
# bounded run (under 8 minutes on one H200), results under OUT_DIR.
#
#   launch/gpu_check.sh OUT_DIR
#
# 1. tries to install what is missing (this checkout with its test extras, instanttensor;
#    a lent machine may reach no package index: the steps then run with what is there, each
#    from this checkout); 2. `pytest -m gpu` (tests/test_gpu.py); 3. `bench load` rows
#    it_raw / it_engine next to the
#    cpu engine on the same checkpoint and plan; 4. with 2+ GPUs, a 2-process NCCL load
#    (torchrun, --verify digest against the manifest written first). Writes
#    OUT_DIR/summary.txt (one line per step: ok, FAIL or skipped, with seconds) plus each
#    step's log and JSON. Exit status: 0 all steps ok, 1 a step (or the install) failed,
#    2 no CUDA device (nothing run).
#
# Variables read (optional): PYTHON (default python), STEP_TIMEOUT (seconds per step,
# default 150), BUDGET (seconds for all steps, default 450), REPEATS (bench repeats,
# default 3).
set -uo pipefail
if [[ $# -ne 1 || -z "$1" ]]; then
  echo "usage: $0 OUT_DIR" >&2
  exit 2
fi
OUT=$1
PYTHON=${PYTHON:-python}
STEP_TIMEOUT=${STEP_TIMEOUT:-150}
REPEATS=${REPEATS:-3}
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)

# Refuse before installing or writing anything: every step below needs a CUDA device.
if ! NGPU=$("$PYTHON" -c 'import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)' 2>/dev/null); then
  echo "gpu_check: $PYTHON cannot import torch; install torch with CUDA support first" >&2
  exit 2
fi
if [[ "$NGPU" -lt 1 ]]; then
  echo "gpu_check: no CUDA device (torch.cuda.is_available() is False for $PYTHON): this script checks the GPU paths only; run the CPU suite with pytest -m 'not gpu'" >&2
  exit 2
fi

mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
SUMMARY="$OUT/summary.txt"
: > "$SUMMARY"
FAILED=0
START=$SECONDS

BUDGET=${BUDGET:-450}   # seconds for all steps: 8 minutes with room for start and install

# step NAME COMMAND...: run under the step timeout (cut to what is left of the budget), log
# to OUT/NAME.log, one summary line
step() {
  local name=$1 t0=$SECONDS rc limit
  shift
  limit=$(( BUDGET - (SECONDS - START) ))
  (( limit > STEP_TIMEOUT )) && limit=$STEP_TIMEOUT
  if (( limit < 20 )); then
    echo "$name skipped (time budget of $BUDGET s spent)" >> "$SUMMARY"
    FAILED=1
    return
  fi
  echo "gpu_check: $name (at most $limit s) ..." >&2
  (cd "$REPO" && timeout --kill-after=10 "$limit" "$@") > "$OUT/$name.log" 2>&1
  rc=$?
  if [[ $rc -eq 0 ]]; then
    echo "$name ok $((SECONDS - t0)) s" >> "$SUMMARY"
  else
    [[ $rc -eq 124 || $rc -eq 137 ]] && rc="$rc (timed out after $limit s)"
    echo "$name FAIL rc=$rc $((SECONDS - t0)) s (see $name.log)" >> "$SUMMARY"
    FAILED=1
  fi
}

# 1. install what is missing (a lent machine may start bare). coordloader itself runs from
#    this checkout (every step runs `python -m` in it); what the steps import is checked
#    from there too. An install that fails (no package index reachable) is noted and the
#    steps run with what there is: each fails on its own if it lacks something.
missing=$(cd "$REPO" && "$PYTHON" -c 'import importlib.util
mods = ["instanttensor", "pytest", "safetensors", "numpy"]
print(" ".join(m for m in mods if importlib.util.find_spec(m) is None))')
if [[ -n "$missing" ]]; then
  echo "gpu_check: installing (missing: $missing)" >&2
  if (cd "$REPO" && timeout --kill-after=10 120 "$PYTHON" -m pip install -q -e ".[test]") \
      > "$OUT/install.log" 2>&1; then
    echo "install ok (was missing: $missing)" >> "$SUMMARY"
  else
    echo "install FAIL (missing: $missing; see install.log): the steps run with what is there" >> "$SUMMARY"
    FAILED=1
  fi
fi
"$PYTHON" - > "$OUT/env.json" <<'EOF'
import json, torch
print(json.dumps({"torch": torch.__version__, "cuda": torch.version.cuda,
                  "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]}))
EOF

# 2. the GPU tests
# (the GPU tests' file alone: collecting the whole tree needs the CPU suite's extras)
step pytest_gpu "$PYTHON" -m pytest -q -m gpu -p no:cacheprovider \
  --junitxml="$OUT/pytest_gpu.xml" tests/test_gpu.py

# 3. instanttensor (raw and engine) vs the cpu engine, same checkpoint and plan; one rank
#    per GPU, so tp=1 on a single GPU
TP=$(( NGPU >= 2 ? 2 : 1 ))
step bench_it "$PYTHON" -m coordloader.bench load --methods cpu,it_raw,it_engine --tp "$TP" \
  --repeats "$REPEATS" --no-cold --out "$OUT/bench"

# 4. a 2-process NCCL load
if [[ "$NGPU" -ge 2 ]]; then
  CK="$OUT/ckpt-qwen3_moe-tiny"
  # --overwrite: a rerun into the same OUT_DIR; the manifest: without one --verify digest
  # compares the replicas only, never the content against the checkpoint.
  # the single-quoted script is expanded by the inner shell, from its environment
  # shellcheck disable=SC2016
  step nccl_load env NPROC=2 DEVICE=cuda CKPT="$CK" PYTHON="$PYTHON" bash -c \
    '"$PYTHON" -m coordloader.synth --arch qwen3_moe --size tiny --overwrite "$CKPT" >/dev/null &&
     "$PYTHON" -m coordloader.manifest --quiet "$CKPT" &&
     launch/local.sh --tp 2 --ep 2 --engine instanttensor --verify digest --report "$1"' \
    _ "$OUT/nccl_load.json"
else
  echo "nccl_load skipped (1 GPU: needs 2)" >> "$SUMMARY"
fi

echo "total $((SECONDS - START)) s" >> "$SUMMARY"
cat "$SUMMARY"
exit "$FAILED"
