# Sourced by the job scripts (spo.sbatch, stage.sbatch, launch_rank.sh, launch_workers.sh) and by submit.sh's
# --dry-run: what every step of a job gets from submit.sh's container and network options.
#   container_args   the srun options of every step (pyxis): --container-image=SPO_CONTAINER_IMAGE
#                    --no-container-mount-home --container-workdir=SPO_CONTAINER_WORKDIR (default SPO_HOME)
#                    --container-mounts=SPO_CONTAINER_MOUNTS; empty without an image
#   source_env_file  SPO_ENV_FILE (NCCL / InfiniBand settings: NCCL_SOCKET_IFNAME, NCCL_IB_HCA, GLOO_SOCKET_IFNAME...)
#                    sourced into the calling process with every variable it sets exported, on the node (and in
#                    the container) where the rank or engine starts, so a value may be computed per node
container_args=()
if [ -n "${SPO_CONTAINER_IMAGE:-}" ]; then
  container_args=(--container-image="$SPO_CONTAINER_IMAGE" --no-container-mount-home
                  --container-workdir="${SPO_CONTAINER_WORKDIR:-$SPO_HOME}")
  [ -n "${SPO_CONTAINER_MOUNTS:-}" ] && container_args+=(--container-mounts="$SPO_CONTAINER_MOUNTS")
fi

source_env_file() {  # source_env_file WHO: one line naming WHO and returning 1 when the file cannot be read here
  [ -n "${SPO_ENV_FILE:-}" ] || return 0
  if [ ! -r "$SPO_ENV_FILE" ]; then
    echo "$1: ERROR: SPO_ENV_FILE='$SPO_ENV_FILE' (submit.sh --env-file) is not readable on $(hostname)" >&2
    return 1
  fi
  set -a
  # shellcheck disable=SC1090
  . "$SPO_ENV_FILE"
  set +a
}
