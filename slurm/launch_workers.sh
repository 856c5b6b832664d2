#!/bin/bash
# The rollout workers of one node (one srun task per worker node): ENGINES_PER_NODE engines, each on its
# own ENGINE_TP GPUs and port (taken from SPO_ENGINE_URLS, node-major), plus sglang-router on the first
# worker node. Engines that come back: an engine that exits, or stops answering (ENGINE_HEALTH_FAILURES /health
# checks in a row fail: `fleet watch` kills it), is started again on its GPUs and port, ENGINE_RESTARTS times, then
# dropped in one line while the others go on. A restarted engine leaves the router at once and rejoins it once it
# holds the weight version the other engines hold (`fleet rejoin`; the trainer's next push reaches it: pushes go to
# every engine directly). The router is restarted the same way. This task fails (and with it the job, at once) when
# the router is lost for good, or when the worker component is this one node and its last engine was dropped.
set -uo pipefail
node="$SLURM_NODEID"
name="${SLURMD_NODENAME:-$(hostname)}"
IFS=, read -ra urls <<<"$SPO_ENGINE_URLS"
log() { echo "[launch_workers $(date -u +%H:%M:%S) $name] $*"; }
restarts="${ENGINE_RESTARTS:-3}"  # per engine, and for the router
health=(--health-interval-s "${ENGINE_HEALTH_INTERVAL_S:-5}" --health-timeout-s "${ENGINE_HEALTH_TIMEOUT_S:-30}"
        --health-failures "${ENGINE_HEALTH_FAILURES:-12}")  # ~7 min without an answer: longer than a push's pause
fleet_py=(python3 -m megatron_spo.rollout.fleet)  # standard library only: the checkout (the working directory) is enough
. "$(dirname "${BASH_SOURCE[0]}")/job_env.sh"
source_env_file launch_workers.sh || exit 2  # NCCL / IB settings (submit.sh --env-file), for every engine of the node

if [ "$MODE" = gpu ] && [ "${ENGINE_CMD#*\$MODEL_PATH}" != "$ENGINE_CMD" ] && [ -z "${MODEL_PATH:-}" ]; then
  log "ERROR: MODEL_PATH is not set (the reference model's HF directory the engines start from)" >&2; exit 2
fi

# GPUs this task may use: SLURM's CUDA_VISIBLE_DEVICES when it sets one (ids may not start at 0), else 0..G-1.
IFS=, read -ra visible <<<"${CUDA_VISIBLE_DEVICES:-$(seq -s, 0 $((GPUS_PER_NODE - 1)))}"
unset CUDA_VISIBLE_DEVICES
if [ "$MODE" = gpu ]; then
  for i in $(seq 0 $((ENGINES_PER_NODE - 1))); do
    [ "${#visible[@]}" -ge $(((i + 1) * ENGINE_TP)) ] \
      || { log "ERROR: engine $i needs GPUs $((i * ENGINE_TP))..$(((i + 1) * ENGINE_TP - 1)), only ${#visible[@]} visible" >&2; exit 2; }
  done
fi

declare -A role=()  # pid -> "engine I" | router: the processes this task keeps running
helpers=() tries=() router_tries=0
engine_url() { echo "${urls[$((node * ENGINES_PER_NODE + $1))]}"; }
engine_log() { echo "$LOG_DIR/engine-$name-$1.log"; }

start_engine() {  # start_engine I [rejoin]: engine I on its GPUs and port, its health watch, after a restart its rejoin
  local i="$1" url gpus="cpu" pid
  url="$(engine_url "$i")"
  [ "$MODE" = gpu ] && gpus="$(IFS=,; echo "${visible[*]:$((i * ENGINE_TP)):$ENGINE_TP}")"
  (
    export ENGINE_PORT="${url##*:}"
    [ "$MODE" = gpu ] && export CUDA_VISIBLE_DEVICES="$gpus"
    eval "exec $ENGINE_CMD"
  ) >>"$(engine_log "$i")" 2>&1 &
  pid=$!
  role[$pid]="engine $i"
  log "engine $i on $gpus at $url (pid $pid, log $(engine_log "$i"))"
  local h=()
  if [ "${ENGINE_HEALTH_FAILURES:-12}" -gt 0 ]; then
    "${fleet_py[@]}" watch --engine "$url" --pid "$pid" "${health[@]}" &
    h+=($!)
  fi
  if [ "${2:-}" = rejoin ]; then
    "${fleet_py[@]}" rejoin --router "$SPO_ROUTER_URL" --engine "$url" --peers "$SPO_ENGINE_URLS" \
      --timeout-s "${ENGINE_REJOIN_TIMEOUT_S:-86400}" &
    h+=($!)
  fi
  helpers[$i]="${h[*]}"
}

start_router() {
  (eval "exec $ROUTER_CMD") >>"$LOG_DIR/router.log" 2>&1 &
  role[$!]=router
  log "sglang-router at $SPO_ROUTER_URL over ${#urls[@]} engines (pid $!, log $LOG_DIR/router.log)"
}

for i in $(seq 0 $((ENGINES_PER_NODE - 1))); do start_engine "$i"; done
[ "$node" = 0 ] && start_router

stop_all() {
  # shellcheck disable=SC2086
  kill "${!role[@]}" ${helpers[*]} 2>/dev/null
  wait 2>/dev/null
}
trap 'stop_all; exit 0' TERM INT

engines_left() { local p n=0; for p in "${!role[@]}"; do [ "${role[$p]}" != router ] && n=$((n + 1)); done; echo "$n"; }

while true; do
  dead=""
  wait -n -p dead "${!role[@]}"
  rc=$?
  [ -n "$dead" ] || continue  # a trapped signal interrupted the wait
  what="${role[$dead]}"
  unset "role[$dead]"
  if [ "$what" = router ]; then
    if [ "$router_tries" -lt "$restarts" ]; then
      router_tries=$((router_tries + 1))
      log "ERROR: router ($SPO_ROUTER_URL) exited with status $rc: restarting it (restart $router_tries of $restarts)" >&2
      start_router
      continue
    fi
    log "ERROR: router ($SPO_ROUTER_URL, $LOG_DIR/router.log) exited with status $rc: dropped after $restarts" \
        "restarts (ENGINE_RESTARTS); stopping this node's engines" >&2
    stop_all
    exit $((rc == 0 ? 1 : rc))
  fi
  i="${what#engine }"
  url="$(engine_url "$i")"
  # shellcheck disable=SC2086
  kill ${helpers[$i]} 2>/dev/null  # its health watch, and a rejoin still waiting
  if [ "${tries[$i]:-0}" -lt "$restarts" ]; then
    tries[$i]=$((${tries[$i]:-0} + 1))
    log "ERROR: engine $i ($url, $(engine_log "$i")) exited with status $rc: restarting it on its GPUs and port" \
        "(restart ${tries[$i]} of $restarts)" >&2
    start_engine "$i" rejoin
    continue
  fi
  left="$(engines_left)"
  log "ERROR: engine $i ($url, $(engine_log "$i")) exited with status $rc: dropped after $restarts restarts" \
      "(ENGINE_RESTARTS); $left engine(s) left on this node" >&2
  [ -n "${SPO_ROUTER_URL:-}" ] && "${fleet_py[@]}" leave --router "$SPO_ROUTER_URL" --engine "$url" &
  if [ "$left" = 0 ] && [ "${SLURM_NNODES:-1}" -le 1 ]; then
    log "ERROR: no engine left on the only worker node: stopping" >&2
    stop_all
    exit $((rc == 0 ? 1 : rc))
  fi
  if [ "${#role[@]}" = 0 ]; then
    log "no engine left on this node; the other worker nodes go on"
    exit 0
  fi
done
