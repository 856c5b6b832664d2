#!/bin/bash
# Submit megatron-spo to SLURM: the training job (slurm/spo.sbatch: trainer component : worker component), or
# with --flow the whole chain from an HF checkpoint to a trained, evaluated HF checkpoint as dependent jobs:
#
#   convert (HF -> megatron, init.megatron) ----------------------------------------.
#   estimate-q0 (engines; Q0 + correct samples kept) -> offline build -> [pts] ----> train (exports RUN/hf) -> eval
#
#   slurm/submit.sh --flow --preset llama3.1-8b --model-path /ckpt/Llama-3.1-8B-Instruct \
#       --trainer-nodes 8 --worker-nodes 8 task.paths='[/data/my_problems.jsonl]' optimizer.lr=1e-7
#   slurm/submit.sh --mode cpu --trainer-nodes 2 --procs-per-node 2 --worker-nodes 1 --probe   # launch check
#
# KEY=VALUE arguments are trainer overrides (as for `megatron-spo train`); anything after `--` goes to sbatch
# for every job (e.g. -- --partition=gpu --account=proj). Prints one line per queued job ("STAGE JOBID") and
# "run_dir DIR". Every stage is resumable: a requeued or resubmitted stage skips the work it finished.
set -euo pipefail
SPO_HOME="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
die() { echo "submit.sh: $*" >&2; exit 2; }

usage() {
  sed -n '2,14p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'
  cat <<'EOF'
options (defaults in brackets):
  --mode gpu|cpu            [gpu] cpu: no GPUs requested, ranks per node from --procs-per-node
  --preset NAME             [llama3.1-8b] any preset of `megatron-spo plan` (planning/capacity.py or
                            examples/models/NAME.yaml): sets the engines' TP and the default config
  --config PATH             training config [examples/PRESET-spo.yaml when there is one]
  --model-path DIR          HF directory (required): the engines serve it, the trainer starts from it (init.hf)
  --trainer-nodes N         [8]    --worker-nodes M [8]    --gpus-per-node G [8]
  --procs-per-node P        trainer ranks per node [G in gpu mode, 1 in cpu mode]
  --engines-per-node E      [G / engine TP in gpu mode, 1 in cpu mode]
  --engine-tp T             [by preset: the GPUs its bf16 weights need at 40% of 80 GB]
  --run-dir DIR             [runs/<job-name>-<UTC time>]
  --job-name NAME           [megatron-spo]
  --time D-HH:MM:SS         [24:00:00]
  --signal-lead SECONDS     SIGUSR1 this long before the time limit [600]
  --q0                      queue the Q0 stage first; training starts after it succeeds (afterok)
  --q0-only                 queue only the Q0 stage
  --flow                    queue the whole chain: convert, q0, offline, [pts], train, eval (afterok)
  --pts                     with --flow: a pivotal-token-search stage feeds the config's 'mc' source
  --offline-data PATH       with --flow: more trajectories / stores for the offline build (repeatable)
  --eval-task KIND          with --flow: task of the pts and eval stages [the config's task.kind]
  --eval-data PATH          with --flow: their problems (a file or glob) [the config's task.paths]
  --q0-args, --pts-args, --eval-args 'ARGS'
                            more arguments of estimate-q0 / pts / eval (e.g. --q0-args '--samples 64')
  --container-image IMG     run every srun of the jobs in this image (pyxis: an enroot URI or a .sqsh file)
  --container-mounts M      more bind mounts, SRC[:DST[:FLAGS]][,...] (pyxis); the checkout, the run directory,
                            --model-path and --config's directory are mounted at their own paths
  --container-workdir DIR   [the checkout] working directory inside the container
  --env-file FILE           NCCL / InfiniBand settings (NCCL_SOCKET_IFNAME=..., NCCL_IB_HCA=..., GLOO_SOCKET_IFNAME=...)
                            that every trainer rank and engine worker sources before it starts (copied to
                            RUN_DIR/env.sh: the job reads the copy, also after a requeue)
  --probe                   run slurm/probe.py instead of the trainer, engines and Q0 (a launch check)
  --dry-run                 print every command; submit nothing, create nothing
EOF
}

mode=gpu preset=llama3.1-8b config="" model_path="" trainer_nodes=8 worker_nodes=8 gpus=8
procs="" engines="" engine_tp="" run_dir="" job_name=megatron-spo time_limit=24:00:00 lead=600
q0=0 q0_only=0 flow=0 pts=0 probe=0 dry=0 extra=() overrides=() offline_data=() eval_task="" eval_data=""
q0_args="" pts_args="" eval_args="" image="" mounts="" workdir="" env_file=""
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
    --flow) flow=1; shift ;;
    --pts) pts=1; shift ;;
    --offline-data) offline_data+=("$2"); shift 2 ;;
    --eval-task) eval_task="$2"; shift 2 ;;
    --eval-data) eval_data="$2"; shift 2 ;;
    --q0-args) q0_args="$2"; shift 2 ;;
    --pts-args) pts_args="$2"; shift 2 ;;
    --eval-args) eval_args="$2"; shift 2 ;;
    --container-image) image="$2"; shift 2 ;;
    --container-mounts) mounts="$2"; shift 2 ;;
    --container-workdir) workdir="$2"; shift 2 ;;
    --env-file) env_file="$2"; shift 2 ;;
    --probe) probe=1; shift ;;
    --dry-run) dry=1; shift ;;
    -h|--help) usage; exit 0 ;;
    --) shift; extra=("$@"); break ;;
    [A-Za-z_]*=*) overrides+=("$1"); shift ;;
    *) die "unknown option '$1' (see --help)" ;;
  esac
done

case "$mode" in gpu|cpu) ;; *) die "--mode must be gpu or cpu, got '$mode'" ;; esac
for v in trainer_nodes worker_nodes gpus lead; do
  [[ "${!v}" =~ ^[0-9]+$ ]] && [ "${!v}" -gt 0 ] || die "--${v//_/-} must be a positive integer, got '${!v}'"
done
[ "$flow" = 1 ] && [ "$q0" = 1 ] && die "--flow already has its Q0 stage: drop --q0 / --q0-only"
[ "$flow" = 0 ] && { [ "$pts" = 1 ] || [ ${#offline_data[@]} -gt 0 ] || [ -n "$eval_data$eval_task$pts_args$eval_args" ]; } &&
  die "--pts, --offline-data, --eval-task, --eval-data, --pts-args and --eval-args belong to --flow"
[ "$flow" = 1 ] && [ "$probe" = 1 ] && die "--flow runs the real stages: drop --probe"
if [ "$probe" = 0 ]; then  # the preset registry: engine TP and example config (slurm/preset.py)
  preset_info="$(cd "$SPO_HOME" && python3 slurm/preset.py "$preset")" || exit 2
  engine_tp="${engine_tp:-${preset_info%% *}}"
  config="${config:-${preset_info#* }}"
  [ -n "$model_path" ] || die "--model-path is required: the HF directory the engines serve and the trainer starts from"
  [ -d "$model_path" ] || die "--model-path: no such directory '$model_path'"
  model_path="$(cd "$model_path" && pwd)"
  [ -n "$config" ] || die "--config is required: preset '$preset' has no examples/$preset-spo.yaml"
fi
if [ "$mode" = gpu ]; then
  procs="${procs:-$gpus}"; gpu_opt="--gpus-per-node=$gpus"
else
  procs="${procs:-1}"; gpu_opt="--gpus-per-node=0"
fi
[[ "$procs" =~ ^[0-9]+$ ]] && [ "$procs" -gt 0 ] || die "--procs-per-node must be a positive integer, got '$procs'"
[ -z "$config" ] || [ -f "$config" ] || [ "$probe" = 1 ] || die "--config: no such file '$config'"
[ -n "$config" ] && config="$(cd "$(dirname "$config")" && pwd)/$(basename "$config")"
for p in "${offline_data[@]}"; do [ -e "$p" ] || die "--offline-data: no such file or store '$p'"; done
# ---- containers (pyxis) and the env file: checked here, before any allocation ------------------------------------
[ -z "$image" ] && [ -n "$mounts$workdir" ] && die "--container-mounts and --container-workdir need --container-image"
IFS=, read -ra user_mounts <<<"$mounts"
[ -n "$mounts" ] && [ "${mounts: -1}" = , ] && user_mounts+=("")
for m in "${user_mounts[@]}"; do  # pyxis: SRC[:DST[:FLAGS]], SRC a path (or tmpfs / umount); absolute here
  IFS=: read -r m_src m_dst m_rest <<<"$m"
  [[ "$m_src" == /* || "$m_src" == tmpfs || "$m_src" == umount ]] && [[ "$m" != *: ]] &&
    [[ -z "$m_dst$m_rest" || "$m_dst" == /* ]] && [[ "$m_rest" != *:* ]] ||
    die "--container-mounts: '$m' is not SRC[:DST[:FLAGS]] with absolute paths (e.g. /data:/data:ro)"
done
[ -z "$workdir" ] || [[ "$workdir" == /* ]] || die "--container-workdir must be an absolute path, got '$workdir'"
if [ -n "$env_file" ]; then
  [ -f "$env_file" ] && [ -r "$env_file" ] || die "--env-file: no such file '$env_file'"
  syntax="$(bash -n "$env_file" 2>&1 | head -n 1)" || die "--env-file: '$env_file' is not a file bash can source ($syntax)"
fi

run_dir="${run_dir:-$SPO_HOME/runs/$job_name-$(date -u +%Y%m%d-%H%M%S)}"
run_dir="$(realpath -m "$run_dir")"  # absolute, created only when something is submitted
q0_dir="$run_dir/q0"
if [ -n "$image" ]; then  # what the job itself reads is mounted at its own path, unless a same-path mount covers it
  covered() { local m d; for m in "${all_mounts[@]}"; do d="${m%%:*}"
    [[ "$m" == "$d" || "$m" == "$d:$d" || "$m" == "$d:$d:"* ]] && [[ "$1" == "$d" || "$1" == "$d"/* ]] && return 0
  done; return 1; }
  all_mounts=("${user_mounts[@]}")
  for p in "$SPO_HOME" "$run_dir" "$model_path" "${config:+$(dirname "$config")}"; do
    [ -n "$p" ] && ! covered "$p" && all_mounts+=("$p:$p")
  done
  export SPO_CONTAINER_IMAGE="$image" SPO_CONTAINER_MOUNTS="$(IFS=,; echo "${all_mounts[*]}")"
  export SPO_CONTAINER_WORKDIR="${workdir:-$SPO_HOME}"
fi
[ -n "$env_file" ] && export SPO_ENV_FILE="$run_dir/env.sh"
. "$SPO_HOME/slurm/job_env.sh"  # container_args: what every srun of the jobs gets

# ---- the trainer's arguments after the config: where the flow's stages put their outputs, then the user's -----
quote() { local out="" a; for a in "$@"; do out+=" $(printf '%q' "$a")"; done; echo "${out# }"; }
train_args=()
[ -n "$model_path" ] && train_args+=("init.hf=$model_path")
if [ "$flow" = 1 ]; then
  train_args+=("init.megatron=$run_dir/megatron-init" "sources.offline.path=$run_dir/offline"
               "task.q0_path=$q0_dir/q0.jsonl" "checkpoint.export_hf=true")
  [ "$pts" = 1 ] && train_args+=("sources.mc.path=$run_dir/pts/pts.jsonl")
fi
train_args+=("${overrides[@]}")

# ---- the flow's task for pts / eval (the config's unless given) -------------------------------------------------
task_args=""
if [ "$flow" = 1 ]; then
  task_line="$(cd "$SPO_HOME" && python3 - "$config" "${train_args[@]}" <<'EOF'
import sys
from megatron_spo.config import ConfigError, load_config
from megatron_spo.training.config import TrainConfig
try:
    cfg = load_config(TrainConfig, sys.argv[1], sys.argv[2:])
except ConfigError as err:
    sys.exit(f"submit.sh: --config: {err}")
print(cfg.task.kind, ",".join(cfg.task.paths or []) or "-")
EOF
  )" || exit 2
  read -r cfg_kind cfg_paths <<<"$task_line"
  eval_task="${eval_task:-$cfg_kind}"
  [ -z "$eval_data" ] && [ "$cfg_paths" != "-" ] && eval_data="$cfg_paths"
  task_args="--task $(printf '%q' "$eval_task")"
  [ -n "$eval_data" ] && task_args+=" --data $(printf '%q' "$eval_data")"
fi

# ---- validate before any allocation ------------------------------------------------------------------------------
# What earlier stages will write (stores, Q0, the converted checkpoint) does not exist yet: those lines are left to
# the train stage, which validates again, complete, before it starts the trainer (SPO_VALIDATE=1 in spo.sbatch);
# until then the architecture is read from --model-path.
validate_cmd="" submit_validate_cmd="" later=""
if [ "$probe" = 0 ] && megatron-spo validate --help >/dev/null 2>&1; then
  check_args=("${train_args[@]}")
  if [ "$flow" = 1 ]; then
    check_args=("${train_args[@]/#init.megatron=*/init.megatron=null}")
    later='init\.megatron|sources\.offline|sources\.mc|task\.q0_path'
  elif [ "$q0" = 1 ]; then
    check_args+=("task.q0_path=$q0_dir/q0.jsonl")
    later='task\.q0_path'
  fi
  world="--world-size $((trainer_nodes * procs))"
  validate_cmd="megatron-spo validate $(quote "$config" "${train_args[@]}") $world"
  submit_validate_cmd="megatron-spo validate $(quote "$config" "${check_args[@]}") $world"
fi
if [ -n "$validate_cmd" ] && [ "$dry" = 0 ]; then
  report="$(cd "$SPO_HOME" && eval "$submit_validate_cmd" 2>&1)" || {
    left="$(grep -E '^  ' <<<"$report" | grep -vE "^ +(${later:-^})" || true)"
    if [ -z "$later" ] || [ -n "$left" ]; then
      echo "$report" >&2; die "the config does not validate (above): nothing submitted"
    fi
  }
fi

# ---- stage commands (single-quoted parts expand where they run) --------------------------------------------------
export SPO_HOME MODE="$mode" MODEL_PRESET="$preset" GPUS_PER_NODE="$gpus" RUN_DIR="$run_dir"
export SPO_TRAIN_ARGS="$(quote "${train_args[@]}")"
[ -n "$config" ] && export CONFIG="$config"
[ -n "$model_path" ] && export MODEL_PATH="$model_path"
[ -n "$engines" ] && export ENGINES_PER_NODE="$engines"
[ -n "$engine_tp" ] && export ENGINE_TP="$engine_tp"
[ -n "$q0_args" ] && export Q0_ARGS="$q0_args"
if [ "$probe" = 1 ]; then
  export TRAIN_CMD="${TRAIN_CMD:-python3 \"\$SPO_HOME/slurm/probe.py\" trainer ${PROBE_TRAIN_ARGS:-}}"
  export ENGINE_CMD="${ENGINE_CMD:-python3 \"\$SPO_HOME/slurm/probe.py\" engine --port \"\$ENGINE_PORT\"}"
  export Q0_CMD="${Q0_CMD:-python3 \"\$SPO_HOME/slurm/probe.py\" q0}"
fi
offline_inputs="$(quote "${offline_data[@]}")"
convert_cmd='[ -e "$RUN_DIR/megatron-init" ] || megatron-spo convert hf-to-megatron --hf "$MODEL_PATH" --out "$RUN_DIR/megatron-init"'
offline_cmd='[ -e "$RUN_DIR/offline" ] || { inputs=(); [ -s "$SPO_Q0_DIR/reference.jsonl" ] && inputs+=("$SPO_Q0_DIR/reference.jsonl"); megatron-spo offline build "${inputs[@]}" '"$offline_inputs"' --out "$RUN_DIR/offline" --verdict pass --assume-kind reference; }'
pts_cmd='megatron-spo pts "$CONFIG" --router-url "$SPO_ROUTER_URL" '"$task_args"' --tokenizer "$MODEL_PATH" --trajectories "$RUN_DIR/offline" --q0 "$SPO_Q0_DIR/q0.jsonl" --out "$RUN_DIR/pts/pts.jsonl" --no-progress '"$pts_args"
eval_cmd='megatron-spo eval "$CONFIG" --router-url "$SPO_ROUTER_URL" '"$task_args"' --tokenizer "$MODEL_PATH" --out "$RUN_DIR/eval/eval.jsonl" --json "$RUN_DIR/eval/eval.json" --no-progress '"$eval_args"

common=(--parsable --job-name="$job_name" --time="$time_limit" --signal="B:USR1@$lead"
        --output="$run_dir/logs/%x-%j.out" --export=ALL "${extra[@]}")
trainer_opts=(--nodes="$trainer_nodes" --ntasks-per-node="$procs" "$gpu_opt")
worker_opts=(--nodes="$worker_nodes" --ntasks-per-node=1 "$gpu_opt")
driver_opts=(--nodes=1 --ntasks-per-node=1 --gpus-per-node=0)  # a driver of the engines (q0, pts, eval)
script="$SPO_HOME/slurm/spo.sbatch"
stage_script="$SPO_HOME/slurm/stage.sbatch"

declare -A ids=()
submit() {  # submit STAGE "AFTER STAGES" [VAR=value ...] -- [sbatch options...]: prints "STAGE JOBID"
  local stage="$1" after="$2" envs=() dep=() s ids_after=""
  shift 2
  while [ "$1" != -- ]; do envs+=("$1"); shift; done
  shift
  for s in $after; do ids_after+=":${ids[$s]}"; done
  [ -n "$ids_after" ] && dep=(--dependency="afterok$ids_after" --kill-on-invalid-dep=yes)
  if [ "$dry" = 1 ]; then
    ids[$stage]="DRYRUN-$stage"
    echo "$stage ${ids[$stage]}"
    echo "  $(quote env STAGE="$stage" "${envs[@]}" sbatch "${common[@]}" --job-name="$job_name-$stage" "${dep[@]}" "$@")"
    if [ -n "$image" ]; then echo "  every srun: srun ${container_args[*]} ..."; fi
    if [ -n "$env_file" ]; then echo "  every rank, engine worker and stage command first sources $SPO_ENV_FILE"; fi
  else
    mkdir -p "$run_dir/logs"
    if [ -n "$env_file" ] && [ ! "$env_file" -ef "$SPO_ENV_FILE" ] && [ "${#ids[@]}" = 0 ]; then  # once, at the first
      cp "$env_file" "$SPO_ENV_FILE" || die "--env-file: cannot copy '$env_file' to $SPO_ENV_FILE"
    fi
    ids[$stage]="$(env STAGE="$stage" "${envs[@]}" sbatch "${common[@]}" --job-name="$job_name-$stage" "${dep[@]}" "$@" | cut -d';' -f1)"
    echo "$stage ${ids[$stage]}"
  fi
}
show() { [ "$dry" = 1 ] && echo "  $1: $2" || true; }  # the command a stage runs (dry run)

if [ "$dry" = 1 ]; then
  echo "preset $preset: engine TP ${ENGINE_TP:-?}, config ${CONFIG:-<none>}, model ${MODEL_PATH:-<none>}"
  [ -n "$validate_cmd" ] && echo "validate (before submitting): $submit_validate_cmd"
  [ -n "$image" ] && echo "container (pyxis, every srun of every job): ${container_args[*]}"
  if [ -n "$env_file" ]; then
    echo "env file (every trainer rank and engine worker sources it before it starts): $SPO_ENV_FILE, a copy of" \
         "$(realpath "$env_file"):"
    grep -vE '^[[:space:]]*(#|$)' "$env_file" | sed 's/^/  /'
  fi
fi
export SPO_VALIDATE="$([ "$flow" = 1 ] && [ -n "$validate_cmd" ] && echo 1 || echo 0)"
if [ "$flow" = 1 ]; then
  submit convert "" STAGE_CMD="$convert_cmd" -- --nodes=1 --ntasks-per-node=1 "$stage_script"
  show command "$convert_cmd"
  submit q0 "" Q0_KEEP=4 -- "${driver_opts[@]}" : "${worker_opts[@]}" "$script"
  show command 'megatron-spo estimate-q0 "$CONFIG" --router-url "$SPO_ROUTER_URL" --out "$SPO_Q0_DIR" --trajectories-out "$SPO_Q0_DIR/reference.jsonl" --keep-successful 4 --tokenizer "$MODEL_PATH" '"$q0_args"' (spo.sbatch Q0_CMD)'
  submit offline "q0" STAGE_CMD="$offline_cmd" -- --nodes=1 --ntasks-per-node=1 "$stage_script"
  show command "$offline_cmd"
  before_train="convert offline"
  if [ "$pts" = 1 ]; then
    submit pts "offline" PTS_CMD="$pts_cmd" -- "${driver_opts[@]}" : "${worker_opts[@]}" "$script"
    show command "$pts_cmd"
    before_train+=" pts"
  fi
  submit train "$before_train" -- "${trainer_opts[@]}" : "${worker_opts[@]}" "$script"
  show command "${validate_cmd:+$validate_cmd && }megatron-spo train \"\$CONFIG\" run_dir=\"\$SPO_RUN_DIR\" checkpoint.dir=\"\$SPO_CHECKPOINT_DIR\" $SPO_TRAIN_ARGS"
  # the engines of the eval stage serve the trained policy (the train stage's HF export)
  submit eval "train" MODEL_PATH="$run_dir/hf" EVAL_CMD="$eval_cmd" -- "${driver_opts[@]}" : "${worker_opts[@]}" "$script"
  show command "$eval_cmd"
else
  after=""
  if [ "$q0" = 1 ]; then
    # Q0 needs the engines, not the trainers: one driver node (no GPUs) + the worker component.
    submit q0 "" -- "${driver_opts[@]}" : "${worker_opts[@]}" "$script"
    after=q0
  fi
  if [ "$q0_only" = 0 ]; then
    submit train "$after" -- "${trainer_opts[@]}" : "${worker_opts[@]}" "$script"
    show command "megatron-spo train \"\$CONFIG\" run_dir=\"\$SPO_RUN_DIR\" checkpoint.dir=\"\$SPO_CHECKPOINT_DIR\" $SPO_TRAIN_ARGS"
  fi
fi
echo "run_dir $run_dir"
