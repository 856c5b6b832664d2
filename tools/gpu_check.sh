#!/usr/bin/env bash
# The GPU check in one command (see tools/gpu_check.py and docs/gpu/README.md). On the device machine:
#   bash tools/gpu_check.sh            # installs .gpu-wheels/ to a temporary folder, runs every part, writes $OUT
#   bash tools/gpu_check.sh --dry-run  # anywhere: the plan and the report schema only
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
exec "${PYTHON:-python3}" tools/gpu_check.py "$@"
