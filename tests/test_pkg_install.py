"""tools/pkg_install.sh: uv when it works, else pip with the very same arguments (a cluster whose mirror only pip
knows), and PKG_INSTALLER=pip never tries uv. The interpreter is a stand-in script that records each call."""

import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FAKE = r"""#!/usr/bin/env bash
# a python that has uv importable; `-m uv` exits with $UV_RC; every -m call is logged
if [ "$1" = -c ]; then
  case "$2" in *"import uv"*) exit 0;; *sys.executable*) echo "$0"; exit 0;; esac
fi
echo "$*" >> "$CALLS"
[ "$2" = uv ] && exit "$UV_RC"
exit 0
"""


def _run(tmp_path, uv_rc: int, installer: str | None = None):
    py = tmp_path / "python"
    py.write_text(FAKE)
    py.chmod(0o755)
    calls = tmp_path / "calls.txt"
    env = {**os.environ, "CALLS": str(calls), "UV_RC": str(uv_rc)}
    env.pop("PKG_INSTALLER", None)
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


def test_pip_gets_the_same_arguments_when_uv_fails(tmp_path):
    proc, calls = _run(tmp_path, uv_rc=2)
    assert proc.returncode == 0, proc.stderr
    assert calls[1:] == ["-m pip install -q --disable-pip-version-check -c c.txt -e .[test]"]
    assert proc.stderr == "pkg_install: uv could not install -c c.txt -e .[test]; pip instead (PKG_INSTALLER=pip skips uv)\n"


@pytest.mark.parametrize("uv_rc", [0, 2])
def test_pkg_installer_pip_never_tries_uv(tmp_path, uv_rc):
    proc, calls = _run(tmp_path, uv_rc=uv_rc, installer="pip")
    assert proc.returncode == 0 and calls == ["-m pip install -q --disable-pip-version-check -c c.txt -e .[test]"]
