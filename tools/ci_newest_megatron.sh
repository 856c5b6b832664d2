#!/usr/bin/env bash
# CI's second leg: the tests marked `newest_megatron` (one representative per megatron-core interface that changed
# between versions: tests/conftest.py NEWEST_MEGATRON) on the newest megatron-core the package accepts (0.19.x);
# with --all every test marked `megatron` (model builds, parallel layouts, conversion, checkpoints; see
# pyproject.toml): run that when changing models/ or the megatron-core range.
# megatron-core 0.17 and later ship only for Python >= 3.12, so the leg runs in a venv of Python 3.12 (pyenv's,
# or PYTHON312=...) holding PyPI's torch 2.13.0 (on 3.12 that is the CUDA build: it runs on the CPU) and this
# checkout installed editable.
#   bash tools/ci_newest_megatron.sh [pytest args...]
#   bash tools/ci_newest_megatron.sh --all [pytest args...]   # every megatron-marked test (~26 min on 2 cores)
#   bash tools/ci_newest_megatron.sh --build-only             # the venv only
# The venv is kept under .cache/ and reused while setup.py and this script are unchanged.
set -euo pipefail
cd "$(dirname "$0")/.."
unset PYTHONDONTWRITEBYTECODE  # as bootstrap.sh: run on its own too, the leg's processes cache their bytecode
T0="${BOOTSTRAP_T0:-$(date +%s)}"  # seconds since bootstrap.sh started, when it runs this
log() { printf '\033[1m[ci-newest +%ds]\033[0m %s\n' "$(( $(date +%s) - T0 ))" "$*"; }

PY312="${PYTHON312:-}"
if [ -z "$PY312" ]; then  # pyenv's own 3.12 first: its `python3.12` shim fails unless 3.12 is a selected version
  PY312="$(ls -d "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.12*/bin/python 2>/dev/null | tail -n 1 || true)"
  [ -n "$PY312" ] || PY312="$(command -v python3.12 || true)"
fi
[ -n "$PY312" ] && "$PY312" -c "import sys; sys.exit(sys.version_info[:2] != (3, 12))" 2>/dev/null || {
  echo "ci-newest: no working Python 3.12 found (set PYTHON312=/path/to/python3.12); megatron-core 0.17+ needs it" >&2
  exit 1; }

venv=".cache/py312-mcore019"
stamp="$venv/.stamp-$(cat setup.py tools/ci_newest_megatron.sh tools/pkg_install.sh | sha1sum | cut -c1-12)"
if [ ! -f "$stamp" ]; then
  log "venv $venv from $PY312: torch 2.13.0, megatron-core 0.19.x, this package"
  rm -rf "$venv"
  "$PY312" -m venv "$venv"
  source tools/pkg_install.sh  # uv, else pip: ~5 GB of torch and CUDA wheels, 48 s with uv here, 301 s with pip
  pkg_install "$venv/bin/python" "torch==2.13.0"
  c312="$(mktemp)"; "$venv/bin/python" tools/torch_constraint.py > "$c312"  # a file: pip may read it after uv
  pkg_install "$venv/bin/python" -c "$c312" "megatron-core>=0.19,<0.20" -e . pytest pytest-timeout pytest-xdist
  rm -f "$c312"
  touch "$stamp"
fi
[ "${1:-}" = --build-only ] && { log "venv ready: $venv"; exit 0; }
"$venv/bin/python" - <<'EOF'
import importlib.metadata as md, sys
v = md.version("megatron-core")
assert v.startswith("0.19."), f"ci-newest: expected megatron-core 0.19.x in the venv, found {v}"
print(f"[ci-newest] Python {sys.version.split()[0]}, megatron-core {v}, torch {md.version('torch')}")
EOF
marker=newest_megatron; [ "${1:-}" = --all ] && { marker=megatron; shift; }
# only the files that hold the leg's tests are collected (collection imports every test module in every worker)
files=(); if [ "$marker" = newest_megatron ] && [ "$#" = 0 ]; then
  mapfile -t files < <("$venv/bin/python" -c "import runpy
for f in sorted({k.split('::')[0] for k in runpy.run_path('tests/conftest.py')['NEWEST_MEGATRON']}): print(f)")
fi
log "venv ready; the tests marked $marker"
rc=0; "$venv/bin/python" -m pytest -q -m "$marker" -p no:cacheprovider -n "${TEST_WORKERS:-$(nproc)}" --dist loadgroup --no-loadscope-reorder \
  "${files[@]}" "$@" || rc=$?
[ "$rc" = 5 ] && { log "no test marked $marker among the ones asked for"; rc=0; }  # pytest: nothing collected
exit "$rc"
