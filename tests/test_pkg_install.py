"""tools/pkg_install.sh: uv when it works, with pip's constraint files; else pip with the very same arguments (a
cluster whose mirror only pip knows); pip alone where an index-url replaces PyPI or PKG_INSTALLER=pip. The
interpreter is a stand-in script that records each call."""

import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FAKE = r"""#!/usr/bin/env bash
# a python that has uv importable; `-m uv` exits with $UV_RC; `pip config list` prints $PIP_CONF; -m calls logged
if [ "$1" = -c ]; then
  case "$2" in *"import uv"*) exit 0;; *sys.executable*) echo "$0"; exit 0;; esac
fi
[ "$*" = "-m pip config list" ] && { printf '%s' "$PIP_CONF"; exit 0; }
echo "$*" >> "$CALLS"
[ "$2" = uv ] && exit "$UV_RC"
exit 0
"""
PIP = "-m pip install -q --disable-pip-version-check -c c.txt -e .[test]"


def _run(tmp_path, uv_rc: int, installer: str | None = None, pip_conf: str = "", **env_extra):
    py = tmp_path / "python"
    py.write_text(FAKE)
    py.chmod(0o755)
    calls = tmp_path / "calls.txt"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_") and k != "PKG_INSTALLER"}
    env.update(CALLS=str(calls), UV_RC=str(uv_rc), PIP_CONF=pip_conf, **env_extra)
    if installer:
        env["PKG_INSTALLER"] = installer
    proc = subprocess.run(["bash", "-c", f'source {ROOT}/tools/pkg_install.sh && pkg_install "$0" -c c.txt -e ".[test]"',
                           str(py)], env=env, capture_output=True, text=True, timeout=60)
    return proc, calls.read_text().splitlines() if calls.exists() else []


def test_uv_installs_when_it_can(tmp_path):
    proc, calls = _run(tmp_path, uv_rc=0)
    assert proc.returncode == 0, proc.stderr
    assert calls == [f"-m uv pip install -q --python {tmp_path / 'python'} -c c.txt -e .[test]"]
    assert proc.stderr == ""


def test_uv_gets_the_constraint_files_pip_would_apply(tmp_path):
    """A container's pins (NGC sets PIP_CONSTRAINT) and pip.conf's constraint bind uv too (a missing one goes to
    pip, which refuses it: test_pip_alone_where_asked_or_a_mirror_replaces_pypi)."""
    env_pins, conf_pins = tmp_path / "env.txt", tmp_path / "conf.txt"
    env_pins.write_text("numpy==1.26.4\n")
    conf_pins.write_text("torch<=2.14.1\n")
    proc, calls = _run(tmp_path, uv_rc=0, PIP_CONSTRAINT=str(env_pins),
                       pip_conf=f"global.constraint='{conf_pins}'\nglobal.find-links='/opt/wheels'\n")
    assert proc.returncode == 0, proc.stderr
    assert calls == [f"-m uv pip install -q --python {tmp_path / 'python'} -c {env_pins} -c {conf_pins} "
                     "-c c.txt -e .[test]"]


def test_pip_gets_the_same_arguments_when_uv_fails(tmp_path):
    proc, calls = _run(tmp_path, uv_rc=2)
    assert proc.returncode == 0, proc.stderr
    assert calls[1:] == [PIP]
    assert proc.stderr == "pkg_install: uv could not install -c c.txt -e .[test]; pip instead (PKG_INSTALLER=pip skips uv)\n"


@pytest.mark.parametrize("how", ["PKG_INSTALLER=pip", "PIP_INDEX_URL", "pip.conf index-url", "constraint URL",
                                 "constraint file missing"])
def test_pip_alone_where_asked_or_a_mirror_replaces_pypi(tmp_path, how):
    kwargs = {"PKG_INSTALLER=pip": {"installer": "pip"}, "PIP_INDEX_URL": {"PIP_INDEX_URL": "https://mirror/simple"},
              "pip.conf index-url": {"pip_conf": "global.index-url='https://mirror/simple'\n"},
              "constraint URL": {"PIP_CONSTRAINT": "https://cluster/pins.txt"},
              "constraint file missing": {"PIP_CONSTRAINT": "/nonexistent/pins.txt"}}[how]
    proc, calls = _run(tmp_path, uv_rc=0, **kwargs)
    assert proc.returncode == 0 and calls == [PIP] and proc.stderr == "", (calls, proc.stderr)
