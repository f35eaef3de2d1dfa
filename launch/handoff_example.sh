#!/usr/bin/env bash
# Training-to-serving handoff on CPU (docs/handoff.md):
#   1. write a tiny llama-style "pretrained" checkpoint (plain HF safetensors);
#   2. train it for a few steps on 4 gloo ranks with weights sharded TP=4, then save the
#      sharded state with coordloader.save (each rank writes its own shards);
#   3. serve: load the saved checkpoint at TP=2 on 2 ranks (and at TP=1), compare logits
#      with the training side's.
# Variables: WORK (scratch directory, default a fresh temp dir), STEPS (default 5),
#            TORCHRUN (default "torchrun").
set -euo pipefail
cd "$(dirname "$0")/.."
WORK=${WORK:-$(mktemp -d)}
STEPS=${STEPS:-5}
TORCHRUN=${TORCHRUN:-torchrun}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
py=launch/handoff_example.py

python "$py" init "$WORK/init"
$TORCHRUN --standalone --nproc-per-node 4 "$py" train --init "$WORK/init" --out "$WORK/trained" \
    --steps "$STEPS"
ls "$WORK/trained"
$TORCHRUN --standalone --nproc-per-node 2 "$py" serve --ckpt "$WORK/trained" \
    --expect "$WORK/trained/eval_logits.pt"
echo "handoff example: OK ($WORK)"
