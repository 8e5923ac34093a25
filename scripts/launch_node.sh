#!/usr/bin/env bash
# Start this node's share of a multi-node DDP job with torchrun. Run it once on every node:
#
#   scripts/launch_node.sh NODE_RANK MASTER_ADDR [NNODES] [NPROC_PER_NODE] [train.py overrides...]
#
#   node 0:  scripts/launch_node.sh 0 10.0.0.1 2 8 model=resnet18 data=cifar10
#   node 1:  scripts/launch_node.sh 1 10.0.0.1 2 8 model=resnet18 data=cifar10
#
# Environment: MASTER_PORT (default 29500), LT_RUN_ID (the run dir's name, the same on every node; default: derived
# from MASTER_ADDR, MASTER_PORT and the date — set it to keep runs apart), PYTHON (default: .venv/bin/python or python3),
# TRAINER (default ddp_multinode), TORCHRUN_ARGS (extra torchrun flags, e.g. "--max-restarts=3").
#
# Rendezvous: torchrun's c10d backend on MASTER_ADDR:MASTER_PORT; torchrun may number the nodes in the order they
# join (NODE_RANK is checked here, GROUP_RANK is what the job uses). Each attempt (after a --max-restarts restart)
# gets a fresh store for init_process_group: with the store shared across attempts (torch's default), a restarted
# rank can read the previous attempt's addresses and fail to connect (pytorch/pytorch#135712).
set -euo pipefail

if [[ $# -lt 2 ]]; then
  sed -n '2,11p' "$0" >&2
  exit 2
fi
NODE_RANK=$1; MASTER_ADDR=$2; shift 2
NNODES=${1:-2}; [[ $# -gt 0 ]] && shift
NPROC_PER_NODE=${1:-gpu}; [[ $# -gt 0 ]] && shift

for v in NODE_RANK NNODES; do
  [[ ${!v} =~ ^[0-9]+$ ]] || { echo "error: $v=${!v} must be a whole number" >&2; exit 2; }
done
(( NODE_RANK < NNODES )) || { echo "error: NODE_RANK=$NODE_RANK is out of range for NNODES=$NNODES (0..$((NNODES-1)))" >&2; exit 2; }

cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-$( [[ -x .venv/bin/python ]] && echo .venv/bin/python || echo python3 )}
MASTER_PORT=${MASTER_PORT:-29500}
export LT_RUN_ID=${LT_RUN_ID:-multinode_${MASTER_ADDR}_${MASTER_PORT}_$(date +%Y-%m-%d)}
export NUM_NODES=$NNODES
if [[ $NPROC_PER_NODE == gpu ]]; then
  NPROC_PER_NODE=$("$PYTHON" -c "import torch; print(max(torch.cuda.device_count(), 1))")
fi
export GPUS_PER_NODE=$NPROC_PER_NODE
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=${TORCH_DISABLE_SHARE_RDZV_TCP_STORE:-1}

echo "node $NODE_RANK/$NNODES: $NPROC_PER_NODE processes, rendezvous $MASTER_ADDR:$MASTER_PORT, run dir logs/.../$LT_RUN_ID" >&2
# shellcheck disable=SC2086
exec "$PYTHON" -m torch.distributed.run \
  --nnodes="$NNODES" --node_rank="$NODE_RANK" --nproc_per_node="$NPROC_PER_NODE" \
  --rdzv_backend=c10d --rdzv_endpoint="$MASTER_ADDR:$MASTER_PORT" --rdzv_id="$LT_RUN_ID" \
  ${TORCHRUN_ARGS:-} \
  train.py trainer="${TRAINER:-ddp_multinode}" "$@"
