#!/bin/bash
# One trainer rank (one srun task per GPU): torch.distributed's env:// variables from SLURM's, then the
# command (a string, expanded here so it can use $RANK, $CONFIG, ...). SIGUSR1/SIGTERM reach the command
# directly (exec): the trainer checkpoints and exits 0 on either.
#   srun ... bash slurm/launch_rank.sh "$TRAIN_CMD"
set -euo pipefail
[ $# = 1 ] || { echo "usage: launch_rank.sh 'COMMAND'" >&2; exit 2; }
export RANK="$SLURM_PROCID"                     # restarts at 0 per het component: trainer ranks are 0..N-1
export WORLD_SIZE="$SLURM_NTASKS"
export LOCAL_RANK="$SLURM_LOCALID"
export LOCAL_WORLD_SIZE="$((SLURM_NTASKS / SLURM_NNODES))"
export NODE_RANK="$SLURM_NODEID"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-$([ "${MODE:-gpu}" = cpu ] && echo 1 || echo 8)}"
echo "[launch_rank $(date -u +%H:%M:%S)] rank $RANK/$WORLD_SIZE local $LOCAL_RANK node $SLURMD_NODENAME" \
     "restart ${SPO_RESTART_COUNT:-0}: $1"
eval "exec $1"
