#!/bin/bash
# One trainer rank (one srun task per GPU): torch.distributed's env:// variables from SLURM's, then the
# command (a string, expanded here so it can use $RANK, $CONFIG, ...). SIGUSR1/SIGTERM reach the command
# directly (exec): the trainer checkpoints and exits 0 on either; estimate-q0 / eval / pts save the items
# they finished and exit 0 on SIGUSR1.
#   srun ... bash slurm/launch_rank.sh "$TRAIN_CMD"
set -euo pipefail
[ $# = 1 ] || { echo "usage: launch_rank.sh 'COMMAND'" >&2; exit 2; }
export RANK="$SLURM_PROCID"                     # restarts at 0 per het component: trainer ranks are 0..N-1
export WORLD_SIZE="$SLURM_NTASKS"
export LOCAL_RANK="$SLURM_LOCALID"
export LOCAL_WORLD_SIZE="$((SLURM_NTASKS / SLURM_NNODES))"
export NODE_RANK="$SLURM_NODEID"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-$([ "${MODE:-gpu}" = cpu ] && echo 1 || echo 8)}"
. "$(dirname "${BASH_SOURCE[0]}")/job_env.sh"
source_env_file launch_rank.sh || exit 1  # NCCL / IB settings (submit.sh --env-file), on this node
echo "[launch_rank $(date -u +%H:%M:%S)] rank $RANK/$WORLD_SIZE local $LOCAL_RANK node $SLURMD_NODENAME" \
     "restart ${SPO_RESTART_COUNT:-0}: $1"
# SIGUSR1 before the command runs (srun delivers it to every process of the step): nothing was
# started, so there is nothing to save; exit 0 and let spo.sbatch requeue the job.
trap 'echo "[launch_rank $(date -u +%H:%M:%S)] stop signal before the command started: exiting"; exit 0' USR1
if [ "${SPO_WAIT_FOR_FLEET:-0}" = 1 ]; then  # a driver sending work to the router at once (Q0) waits for the fleet
  echo "[launch_rank $(date -u +%H:%M:%S)] waiting for the engines and the router ($SPO_ROUTER_URL) to register them"
  python3 - "${SPO_WAIT_TIMEOUT_S:-1800}" <<'EOF' || exit 1
# Every engine answers /health, and the router lists them all under /workers (its /health answers as soon as
# it listens, and it registers workers asynchronously: until then /generate is a 503).
import json, os, sys, time, urllib.request
engines = [u.rstrip("/") for u in os.environ["SPO_ENGINE_URLS"].split(",") if u]
router, limit = os.environ["SPO_ROUTER_URL"].rstrip("/"), float(sys.argv[1])
deadline = time.monotonic() + limit
def get(url):
    with urllib.request.urlopen(url, timeout=5) as resp:
        return resp.read()
while True:
    try:
        for url in engines:
            get(url + "/health")
        listed = json.loads(get(router + "/workers")).get("workers", [])
        if len(listed) >= len(engines):
            break
        why = f"router lists {len(listed)} of {len(engines)} engines"
    except (OSError, ValueError) as err:
        why = str(err)
    if time.monotonic() > deadline:
        sys.exit(f"launch_rank: the fleet is not up after {limit:.0f} s ({why})")
    time.sleep(1)
EOF
fi
eval "exec $1"
