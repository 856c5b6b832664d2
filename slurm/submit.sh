#!/bin/bash
# Submit slurm/spo.sbatch (trainer component : worker component) with sizes and commands as parameters.
#
#   slurm/submit.sh --preset llama3.1-70b --config examples/llama3.1-70b-spo.yaml --model-path /ckpt/llama3.1-70b-hf \
#       --trainer-nodes 8 --worker-nodes 8 --q0
#   slurm/submit.sh --mode cpu --trainer-nodes 2 --procs-per-node 2 --worker-nodes 1 --probe   # launch check
#
# Prints one line per queued job: "q0 JOBID" (with --q0) and "train JOBID". Anything after `--` goes to
# sbatch for both components' job (e.g. -- --partition=gpu --account=proj).
set -euo pipefail
SPO_HOME="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
die() { echo "submit.sh: $*" >&2; exit 2; }

usage() {
  sed -n '2,9p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'
  cat <<'EOF'
options (defaults in brackets):
  --mode gpu|cpu            [gpu] cpu: no GPUs requested, ranks per node from --procs-per-node
  --preset NAME             [llama3.1-8b] llama3.1-8b (engines TP 1) | llama3.1-70b (engines TP 8)
  --config PATH             training config [examples/llama3.1-8b-spo.yaml or examples/llama3.1-70b-spo.yaml]
  --model-path DIR          HF directory the engines start from (the reference model)
  --trainer-nodes N         [8]    --worker-nodes M [8]    --gpus-per-node G [8]
  --procs-per-node P        trainer ranks per node [G in gpu mode, 1 in cpu mode]
  --engines-per-node E      [G / engine TP in gpu mode, 1 in cpu mode]
  --engine-tp T             [by preset]
  --run-dir DIR             [runs/<job-name>-<UTC time>]
  --job-name NAME           [megatron-spo]
  --time D-HH:MM:SS         [24:00:00]
  --signal-lead SECONDS     SIGUSR1 this long before the time limit [600]
  --q0                      queue the Q0 stage first; training starts after it succeeds (afterok)
  --q0-only                 queue only the Q0 stage
  --probe                   run slurm/probe.py instead of the trainer, engines and Q0 (a launch check)
  --dry-run                 print the sbatch commands instead of running them
EOF
}

mode=gpu preset=llama3.1-8b config="" model_path="" trainer_nodes=8 worker_nodes=8 gpus=8
procs="" engines="" engine_tp="" run_dir="" job_name=megatron-spo time_limit=24:00:00 lead=600
q0=0 q0_only=0 probe=0 dry=0 extra=()
while [ $# -gt 0 ]; do
  case "$1" in
    --mode) mode="$2"; shift 2 ;;
    --preset) preset="$2"; shift 2 ;;
    --config) config="$2"; shift 2 ;;
    --model-path) model_path="$2"; shift 2 ;;
    --trainer-nodes) trainer_nodes="$2"; shift 2 ;;
    --worker-nodes) worker_nodes="$2"; shift 2 ;;
    --gpus-per-node) gpus="$2"; shift 2 ;;
    --procs-per-node) procs="$2"; shift 2 ;;
    --engines-per-node) engines="$2"; shift 2 ;;
    --engine-tp) engine_tp="$2"; shift 2 ;;
    --run-dir) run_dir="$2"; shift 2 ;;
    --job-name) job_name="$2"; shift 2 ;;
    --time) time_limit="$2"; shift 2 ;;
    --signal-lead) lead="$2"; shift 2 ;;
    --q0) q0=1; shift ;;
    --q0-only) q0=1; q0_only=1; shift ;;
    --probe) probe=1; shift ;;
    --dry-run) dry=1; shift ;;
    -h|--help) usage; exit 0 ;;
    --) shift; extra=("$@"); break ;;
    *) die "unknown option '$1' (see --help)" ;;
  esac
done

case "$mode" in gpu|cpu) ;; *) die "--mode must be gpu or cpu, got '$mode'" ;; esac
case "$preset" in llama3.1-8b|llama3.1-70b) ;; *) die "--preset must be llama3.1-8b or llama3.1-70b, got '$preset'" ;; esac
for v in trainer_nodes worker_nodes gpus lead; do
  [[ "${!v}" =~ ^[0-9]+$ ]] && [ "${!v}" -gt 0 ] || die "--${v//_/-} must be a positive integer, got '${!v}'"
done
if [ "$mode" = gpu ]; then
  procs="${procs:-$gpus}"; gpu_opt="--gpus-per-node=$gpus"
else
  procs="${procs:-1}"; gpu_opt="--gpus-per-node=0"
fi
[[ "$procs" =~ ^[0-9]+$ ]] && [ "$procs" -gt 0 ] || die "--procs-per-node must be a positive integer, got '$procs'"
[ -z "$config" ] || [ -f "$config" ] || [ "$probe" = 1 ] || die "--config: no such file '$config'"
[ -n "$config" ] && config="$(cd "$(dirname "$config")" && pwd)/$(basename "$config")"

run_dir="${run_dir:-$SPO_HOME/runs/$job_name-$(date -u +%Y%m%d-%H%M%S)}"
mkdir -p "$run_dir/logs"
run_dir="$(cd "$run_dir" && pwd)"

export SPO_HOME MODE="$mode" MODEL_PRESET="$preset" GPUS_PER_NODE="$gpus" RUN_DIR="$run_dir"
[ -n "$config" ] && export CONFIG="$config"
[ -n "$model_path" ] && export MODEL_PATH="$model_path"
[ -n "$engines" ] && export ENGINES_PER_NODE="$engines"
[ -n "$engine_tp" ] && export ENGINE_TP="$engine_tp"
if [ "$probe" = 1 ]; then
  export TRAIN_CMD="${TRAIN_CMD:-python3 \"\$SPO_HOME/slurm/probe.py\" trainer ${PROBE_TRAIN_ARGS:-}}"
  export ENGINE_CMD="${ENGINE_CMD:-python3 \"\$SPO_HOME/slurm/probe.py\" engine --port \"\$ENGINE_PORT\"}"
  export Q0_CMD="${Q0_CMD:-python3 \"\$SPO_HOME/slurm/probe.py\" q0}"
fi

common=(--parsable --job-name="$job_name" --time="$time_limit" --signal="B:USR1@$lead"
        --output="$run_dir/logs/%x-%j.out" --export=ALL "${extra[@]}")
trainer_opts=(--nodes="$trainer_nodes" --ntasks-per-node="$procs" "$gpu_opt")
worker_opts=(--nodes="$worker_nodes" --ntasks-per-node=1 "$gpu_opt")
script="$SPO_HOME/slurm/spo.sbatch"

submit() {  # submit STAGE [sbatch options...] : echoes the job id
  local stage="$1"; shift
  if [ "$dry" = 1 ]; then
    echo "STAGE=$stage sbatch $*" >&2; echo "DRYRUN"
  else
    STAGE="$stage" sbatch "$@" | cut -d';' -f1
  fi
}

dependency=()
if [ "$q0" = 1 ]; then
  # Q0 needs the engines, not the trainers: one driver node (no GPUs) + the worker component.
  q0_id="$(submit q0 "${common[@]}" --job-name="$job_name-q0" --nodes=1 --ntasks-per-node=1 --gpus-per-node=0 \
           : "${worker_opts[@]}" "$script")"
  echo "q0 $q0_id"
  dependency=(--dependency="afterok:$q0_id" --kill-on-invalid-dep=yes)
fi
if [ "$q0_only" = 0 ]; then
  train_id="$(submit train "${common[@]}" "${dependency[@]}" "${trainer_opts[@]}" : "${worker_opts[@]}" "$script")"
  echo "train $train_id"
fi
echo "run_dir $run_dir"
