#!/usr/bin/env bash
# Download the wheels of tools/gpu_wheels.txt for the GPU machine (Python 3.12, x86_64; no network there)
# into a git-ignored folder, with a SHA256SUMS manifest that tools/gpu_check.py verifies before installing.
#
#   bash tools/gpu_wheels.sh [DIR]        # default .gpu-wheels; then carry=[".gpu-wheels"] in the device run
#
# --no-deps: every requirement is pinned in the list (the machine has torch, numpy, triton: they must not
# travel). The folder must stay under 64 MiB, the device tool's limit for everything that travels.
set -euo pipefail
cd "$(dirname "$0")/.."
dir="${1:-.gpu-wheels}"
list=tools/gpu_wheels.txt
limit=$((64 * 1024 * 1024))
mkdir -p "$dir"
rm -f "$dir"/*.whl "$dir"/SHA256SUMS
mapfile -t pins < <(grep -vE '^\s*(#|$)' "$list")
python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d "$dir" "${pins[@]}"
count=$(ls "$dir"/*.whl | wc -l)
if [ "$count" -ne "${#pins[@]}" ]; then
    echo "gpu_wheels: $count wheels in $dir for ${#pins[@]} pins in $list" >&2
    exit 1
fi
(cd "$dir" && sha256sum -- *.whl > SHA256SUMS)
total=$(cat "$dir"/*.whl | wc -c)
echo "gpu_wheels: $count wheels, $((total / 1024)) KiB in $dir (limit 64 MiB for all that travels)"
if [ "$total" -ge "$limit" ]; then
    echo "gpu_wheels: $total bytes is over the 64 MiB the device tool carries" >&2
    exit 1
fi
