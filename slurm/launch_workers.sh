#!/bin/bash
# The rollout workers of one node (one srun task per worker node): ENGINES_PER_NODE engines, each on its
# own ENGINE_TP GPUs and port (taken from SPO_ENGINE_URLS, node-major), plus sglang-router on the first
# worker node. Any of them exiting is a failure: the rest are stopped and this exits non-zero, so the
# job script notices at once.
set -uo pipefail
node="$SLURM_NODEID"
name="${SLURMD_NODENAME:-$(hostname)}"
IFS=, read -ra urls <<<"$SPO_ENGINE_URLS"
log() { echo "[launch_workers $(date -u +%H:%M:%S) $name] $*"; }

if [ "$MODE" = gpu ] && [ "${ENGINE_CMD#*\$MODEL_PATH}" != "$ENGINE_CMD" ] && [ -z "${MODEL_PATH:-}" ]; then
  log "ERROR: MODEL_PATH is not set (the reference model's HF directory the engines start from)" >&2; exit 2
fi

# GPUs this task may use: SLURM's CUDA_VISIBLE_DEVICES when it sets one (ids may not start at 0), else 0..G-1.
IFS=, read -ra visible <<<"${CUDA_VISIBLE_DEVICES:-$(seq -s, 0 $((GPUS_PER_NODE - 1)))}"
pids=() what=()
for i in $(seq 0 $((ENGINES_PER_NODE - 1))); do
  url="${urls[$((node * ENGINES_PER_NODE + i))]}"
  export ENGINE_PORT="${url##*:}"
  if [ "$MODE" = gpu ]; then
    [ "${#visible[@]}" -ge $(((i + 1) * ENGINE_TP)) ] \
      || { log "ERROR: engine $i needs GPUs $((i * ENGINE_TP))..$(((i + 1) * ENGINE_TP - 1)), only ${#visible[@]} visible" >&2; exit 2; }
    export CUDA_VISIBLE_DEVICES="$(IFS=,; echo "${visible[*]:$((i * ENGINE_TP)):$ENGINE_TP}")"
  fi
  engine_log="$LOG_DIR/engine-$name-$i.log"
  log "engine $i on ${CUDA_VISIBLE_DEVICES:-cpu} at $url (log $engine_log)"
  (eval "exec $ENGINE_CMD") >>"$engine_log" 2>&1 &
  pids+=($!) what+=("engine $i ($url, $engine_log)")
done
unset CUDA_VISIBLE_DEVICES

if [ "$node" = 0 ]; then
  log "sglang-router at $SPO_ROUTER_URL over ${#urls[@]} engines (log $LOG_DIR/router.log)"
  (eval "exec $ROUTER_CMD") >>"$LOG_DIR/router.log" 2>&1 &
  pids+=($!) what+=("router ($SPO_ROUTER_URL, $LOG_DIR/router.log)")
fi

stop_all() { kill "${pids[@]}" 2>/dev/null; wait "${pids[@]}" 2>/dev/null; }
trap 'stop_all; exit 0' TERM INT

dead=""
wait -n -p dead "${pids[@]}"
rc=$?
for k in "${!pids[@]}"; do [ "${pids[$k]}" = "$dead" ] && log "ERROR: ${what[$k]} exited with status $rc" >&2; done
stop_all
exit $((rc == 0 ? 1 : rc))
