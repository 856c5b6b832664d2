# Sourced by bootstrap.sh and ci_newest_megatron.sh: `pkg_install PYTHON ARGS...` installs pip-style ARGS
# (-c FILE, -e ., --no-deps, requirements) into PYTHON's environment with uv (bootstrap's install 16 s against
# pip's 148 s here, the 3.12 venv 48 s against 301 s; the same version of every package), falling back to pip.
# uv reads neither pip.conf nor PIP_* (a cluster's mirror): where it fails, pip runs with them; PKG_INSTALLER=pip
# skips uv. Not for torch from a local wheel file: uv does not look there.
pkg_install() {
  local py="$1"; shift
  if [ "${PKG_INSTALLER:-uv}" != pip ]; then
    if "$py" -c "import uv" 2>/dev/null || "$py" -m pip install -q --disable-pip-version-check "uv>=0.9,<1"; then
      "$py" -m uv pip install -q --python "$("$py" -c 'import sys; print(sys.executable)')" "$@" && return 0
    fi
    echo "pkg_install: uv could not install $*; pip instead (PKG_INSTALLER=pip skips uv)" >&2
  fi
  "$py" -m pip install -q --disable-pip-version-check "$@"
}
