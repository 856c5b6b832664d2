# Sourced by bootstrap.sh and ci_newest_megatron.sh: `pkg_install PYTHON ARGS...` installs pip-style ARGS
# (-c FILE, -e ., --no-deps, requirements) into PYTHON's environment with uv (bootstrap's install 16 s against
# pip's 148 s here, the 3.12 venv 48 s against 301 s; the same version of every package), falling back to pip.
# uv reads neither pip.conf nor PIP_*: it is given pip's constraint files (PIP_CONSTRAINT, pip.conf's
# `constraint`: a container's pins stay), and pip alone runs where an index-url replaces PyPI (a cluster's mirror),
# where a constraint is not a local file (a URL, or missing: pip's own error instead of a pin silently dropped),
# where uv fails, or with PKG_INSTALLER=pip. Not for torch from a local wheel file: uv does not look there.
pkg_install() {
  local py="$1"; shift
  local conf installer="${PKG_INSTALLER:-uv}" pins=() f
  conf="$("$py" -m pip config list 2>/dev/null || true)"
  if [ -n "${PIP_INDEX_URL:-}" ] || grep -q '\.index-url=' <<<"$conf"; then installer=pip; fi
  for f in ${PIP_CONSTRAINT:-} $(sed -n "s/^[^=]*\.constraint='\(.*\)'$/\1/p" <<<"$conf"); do
    if [ -f "$f" ]; then pins+=(-c "$f")
    else installer=pip; fi  # at a URL, or missing: pip reads the one and refuses the other; uv would drop both
  done
  if [ "$installer" != pip ]; then
    if "$py" -c "import uv" 2>/dev/null || "$py" -m pip install -q --disable-pip-version-check "uv>=0.9,<1"; then
      "$py" -m uv pip install -q --python "$("$py" -c 'import sys; print(sys.executable)')" "${pins[@]}" "$@" \
        && return 0
    fi
    echo "pkg_install: uv could not install $*; pip instead (PKG_INSTALLER=pip skips uv)" >&2
  fi
  "$py" -m pip install -q --disable-pip-version-check "$@"
}
