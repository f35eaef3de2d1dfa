#!/usr/bin/env bash
# Multi-node launch: torchrun with c10d rendezvous; run this same script on every node.
#
# Variables read:
#   NNODES        number of nodes (required)
#   NODE_RANK     this node's index 0..NNODES-1 (required; informational for c10d)
#   MASTER_ADDR   host of the rendezvous endpoint, usually node 0 (required)
#   MASTER_PORT   rendezvous port (default 29500)
#   NPROC         ranks per node (default: GPUs on this node)
#   CKPT          checkpoint directory, on storage every node can read (required)
#   RDZV_ID       rendezvous job id (default: coordloader)
#   PYTHON        interpreter (default: python)
# Remaining arguments go to coordloader.load, e.g. --tp 8 --ep 8 --pp 2.
set -euo pipefail
: "${NNODES:?set NNODES}" "${NODE_RANK:?set NODE_RANK}" "${MASTER_ADDR:?set MASTER_ADDR}" "${CKPT:?set CKPT}"
PYTHON=${PYTHON:-python}
MASTER_PORT=${MASTER_PORT:-29500}
NPROC=${NPROC:-$("$PYTHON" -c 'import torch; print(max(torch.cuda.device_count(), 1))')}
exec "$PYTHON" -m torch.distributed.run \
  --nnodes "$NNODES" --node-rank "$NODE_RANK" --nproc-per-node "$NPROC" \
  --rdzv-backend c10d --rdzv-endpoint "$MASTER_ADDR:$MASTER_PORT" --rdzv-id "${RDZV_ID:-coordloader}" \
  -m coordloader.load "$CKPT" "$@"
