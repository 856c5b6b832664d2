"""Every SGLang server / sglang-router command line this project builds or ships is parsed by the real
launcher parsers (tests/sglang_source.py), so a flag they do not know, a malformed value, or a flag that
is read as something else fails CI. The command lines, all taken from the project's own files:

* slurm/spo.sbatch ``default_engine`` (MODE=gpu) and ``default_router``: the SLURM defaults of
  ENGINE_CMD / ROUTER_CMD that slurm/launch_workers.sh runs (submit.sh overrides them only with probe.py).
* megatron_spo/rollout/fleet.py: the router command ``Fleet.__init__`` builds, and the SGLang engine
  template its module docstring documents for ``--engine-command``.
* megatron_spo/rollout/router.py (``megatron-spo router``, which Fleet and spo.sbatch's MODE=cpu start): the
  RouterArgs it parses equal launch_router's for the same argv.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import sglang_source as sgl

if not sgl.sglang_available():
    pytest.skip(sgl.SGLANG_NOT_INSTALLED, allow_module_level=True)

REPO = Path(__file__).resolve().parents[1]
SBATCH = REPO / "slurm" / "spo.sbatch"
# Representative values for the variables the sbatch command lines use (a 70B job: TP 8, two engines).
SBATCH_ENV = {"MODEL_PATH": "/models/Llama-3.1-8B", "ENGINE_TP": "8", "ENGINE_PORT": "30001",
              "ROUTER_PORT": "30000", "PORT_BASE": "30000",
              "SPO_ENGINE_URLS": "http://n1:30001,http://n2:30001"}


def sbatch_argv(var: str, module: str) -> list[str]:
    """The argv after ``python3 -m MODULE`` of the one assignment ``VAR='...'`` in slurm/spo.sbatch that
    runs MODULE, expanded as the job expands it.

    The line is read from the file and run by bash itself: the assignment stores the single-quoted
    command, and ``eval "set -- $VAR"`` then performs exactly the parsing that slurm/launch_workers.sh's
    ``eval "exec $ENGINE_CMD"`` / ``eval "exec $ROUTER_CMD"`` does (quotes, ``${SPO_ENGINE_URLS//,/ }``
    split into words, ``$((PORT_BASE + 2))``), only with ``set --`` instead of ``exec``. The words come
    back NUL-separated, so nothing is re-parsed in Python (shlex knows neither ``${//}`` nor ``$(( ))``).
    The environment holds only PATH and SBATCH_ENV, so an unexpected variable expands to nothing and the
    parser notices."""
    lines = [line.strip() for line in SBATCH.read_text().splitlines()
             if re.match(rf"\s*{var}=", line) and f" -m {module} " in line]
    assert len(lines) == 1, f"expected one {var}=... line running {module} in {SBATCH}, found {lines}"
    script = f'{lines[0]}\neval "set -- ${var}"\nprintf "%s\\0" "$@"'
    out = subprocess.run(["bash", "-c", script], env={"PATH": os.environ["PATH"], **SBATCH_ENV},
                         capture_output=True, text=True, check=True).stdout
    argv = out.split("\0")[:-1]
    assert argv[:3] == ["python3", "-m", module], argv
    return argv[3:]


def fleet_docstring_engine(tmp_path) -> list[str]:
    """The ``--engine-command`` template in fleet.py's docstring, as Fleet expands it for engine 0."""
    from megatron_spo.rollout import fleet

    template = " ".join(re.search(r'--engine-command "([^"]*)"', fleet.__doc__).group(1).split())
    cmd = fleet.Fleet(str(tmp_path), 2, engine_ports=[30001, 30002], engine_command=template,
                      router=False).engines[0].command
    assert cmd[1:3] == ["-m", "sglang.launch_server"], cmd
    return cmd[3:]


def fleet_router(tmp_path) -> list[str]:
    """Fleet.__init__'s router command (the Fleet is constructed, not started)."""
    from megatron_spo.rollout.fleet import Fleet

    cmd = Fleet(str(tmp_path), 2, router_port=30000, engine_ports=[30001, 30002],
                startup_timeout_s=300).router.command
    assert cmd[1:4] == ["-m", "megatron_spo.cli", "router"], cmd  # sglang_router.launch_router's argv
    return cmd[4:]


@pytest.mark.parametrize("source, expected", [
    ("spo.sbatch", dict(model_path="/models/Llama-3.1-8B", tp_size=8, host="0.0.0.0", port=30001)),
    ("fleet.py", dict(host="127.0.0.1", port=30001, tp_size=1)),  # model_path: the temp model dir
], ids=["spo.sbatch", "fleet.py"])
def test_sglang_server_command(source, expected, tmp_path):
    """sglang/srt/server_args.py prepare_server_args parses slurm/spo.sbatch ``default_engine`` and the
    megatron_spo/rollout/fleet.py docstring ``--engine-command`` template, with the values meant."""
    if source == "spo.sbatch":
        argv = sbatch_argv("default_engine", "sglang.launch_server")
    else:
        argv, expected = fleet_docstring_engine(tmp_path), {**expected, "model_path": str(tmp_path)}
    args = sgl.parse_sglang_server_argv(argv)
    assert {k: getattr(args, k) for k in expected} == expected


@pytest.mark.parametrize("source", ["spo.sbatch", "fleet.py"])
def test_router_command(source, tmp_path):
    """sglang_router/launch_router.py parse_router_args (+ RouterArgs._validate_router_args) parses
    slurm/spo.sbatch ``default_router`` and megatron_spo/rollout/fleet.py ``Fleet.__init__``'s router
    command, with the values meant."""
    pytest.importorskip("sglang_router")
    if source == "spo.sbatch":
        argv = sbatch_argv("default_router", "sglang_router.launch_router")
        expected = dict(host="0.0.0.0", port=30000, worker_urls=["http://n1:30001", "http://n2:30001"],
                        prometheus_port=30002, worker_startup_timeout_secs=1800)
    else:
        argv = fleet_router(tmp_path)
        expected = dict(host="127.0.0.1", port=30000,
                        worker_urls=["http://127.0.0.1:30001", "http://127.0.0.1:30002"],
                        policy="round_robin", log_level="warn", health_check_interval_secs=5,
                        health_check_timeout_secs=30, health_failure_threshold=12, health_success_threshold=1,
                        worker_startup_timeout_secs=300,
                        prometheus_host="127.0.0.1",
                        prometheus_port=int(argv[argv.index("--prometheus-port") + 1]))
    args = sgl.parse_router_argv(argv)
    assert {k: getattr(args, k) for k in expected} == expected


@pytest.mark.parametrize("var, module, parse, flag", [
    ("default_engine", "sglang.launch_server", sgl.parse_sglang_server_argv, "--tp-size"),
    ("default_router", "sglang_router.launch_router", sgl.parse_router_argv, "--prometheus-port"),
], ids=["engine", "router"])
def test_misspelled_flag_is_refused(var, module, parse, flag, capsys):
    """The check can fail: slurm/spo.sbatch's line with one flag misspelled is refused by
    sglang/srt/server_args.py prepare_server_args / sglang_router/launch_router.py parse_router_args.
    (Both parsers accept unambiguous prefixes, e.g. ``--prometheus-po``, so the typo adds a letter.)"""
    if module.startswith("sglang_router"):
        pytest.importorskip("sglang_router")
    argv = [a + "s" if a == flag else a for a in sbatch_argv(var, module)]
    assert flag + "s" in argv
    with pytest.raises(SystemExit) as bad:
        parse(argv)
    assert bad.value.code == 2 and f"unrecognized arguments: {flag}s" in capsys.readouterr().err


def test_megatron_spo_router_parses_as_launch_router_does(tmp_path, capsys, monkeypatch):
    """megatron_spo/rollout/router.py (`megatron-spo router`, which Fleet and spo.sbatch's MODE=cpu run)
    builds the RouterArgs sglang_router/launch_router.py parse_router_args builds from the same argv, and
    refuses what it refuses; spo.sbatch's MODE=cpu router line is its MODE=gpu line's flags; `--mini-lb` (the
    Python balancer) is handed to launch_router itself. (sglang-router is a dependency in setup.py: no skip.)"""
    import runpy

    from megatron_spo.rollout import router
    from megatron_spo.rollout.router import parse_router_args

    for argv in (fleet_router(tmp_path), sbatch_argv("default_router", "sglang_router.launch_router")):
        assert parse_router_args(argv) == sgl.parse_router_argv(argv)
        with pytest.raises(SystemExit) as bad:
            parse_router_args([*argv, "--worker-url-typo", "x"])
        assert bad.value.code == 2 and "unrecognized arguments: --worker-url-typo" in capsys.readouterr().err
    lines = [line.strip() for line in SBATCH.read_text().splitlines() if re.match(r"\s*(\[.*\] \|\| )?default_router=", line)]
    assert len(lines) == 2, lines
    script = "\n".join([*lines, 'eval "set -- $default_router"', 'printf "%s\\0" "$@"'])
    out = subprocess.run(["bash", "-c", script], env={"PATH": os.environ["PATH"], **SBATCH_ENV, "MODE": "cpu"},
                         capture_output=True, text=True, check=True).stdout
    assert out.split("\0")[:-1] == ["megatron-spo", "router", *sbatch_argv("default_router", "sglang_router.launch_router")]
    ran = []
    monkeypatch.setattr(runpy, "run_module", lambda name, **kw: ran.append((name, list(sys.argv))))
    assert router.main(["--mini-lb", "--port", "30000"]) == 0
    assert ran == [("sglang_router.launch_router", ["sglang_router.launch_router", "--mini-lb", "--port", "30000"])]


def test_every_shipped_command_line_is_covered():
    """No other file (slurm/, megatron_spo/, tools/, examples/, READMEs) starts an SGLang server or
    sglang-router: a new command line must be added to the tests above."""
    pattern = re.compile(r"sglang\.launch_server|sglang_router\.launch_router")
    found = {}
    for path in [REPO / "README.md", *[p for d in ("slurm", "megatron_spo", "tools", "examples")
                                       for p in (REPO / d).rglob("*") if p.is_file() and "__pycache__" not in p.parts]]:
        n = len(pattern.findall(path.read_text(errors="ignore")))
        if n:
            found[str(path.relative_to(REPO))] = n
    # spo.sbatch: the gpu line and the cpu line's derivation; fleet.py, router.py, cli.py: megatron-spo router,
    # which parses as launch_router does (test_megatron_spo_router_parses_as_launch_router_does)
    assert found == {"slurm/spo.sbatch": 4, "megatron_spo/rollout/fleet.py": 1, "megatron_spo/rollout/router.py": 4,
                     "megatron_spo/cli.py": 1}, found
