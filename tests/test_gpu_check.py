"""The GPU check kit (tools/gpu_check.py, issue 30) cannot rot in CI, which has no GPU: its dry run plans every
part within the device tool's time, its wheel manifest is verified before anything is installed, and the
parts that can run on a CPU (megatron-core parity, training) really do, at their tiny size, with numbers.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tools"))
import gpu_check  # noqa: E402

DEVICE_COMMAND_LIMIT_S = 9 * 60  # the issue: the whole check stops cleanly before 9 minutes


def run_check(*args: str) -> tuple[subprocess.CompletedProcess, dict, str]:
    env = {**os.environ, "PYTHON": sys.executable}  # the wrapper's interpreter: this one, not PATH's python3
    proc = subprocess.run(["bash", "tools/gpu_check.sh", *args], cwd=REPO, capture_output=True, text=True, env=env)
    out = Path(args[args.index("--out") + 1])
    return proc, json.loads((out / "gpu_report.json").read_text()), (out / "gpu_report.md").read_text()


def test_dry_run_plans_every_part_within_the_time_limit(tmp_path):
    proc, report, md = run_check("--dry-run", "--out", str(tmp_path), "--wheels", str(tmp_path / "no-wheels"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert report["schema"] == gpu_check.SCHEMA and report["mode"] == "dry-run"
    assert (report["device"], report["size"]) == ("cuda", "full")
    parts = report["parts"]
    assert [p["name"] for p in parts] == [p.name for p in gpu_check.PARTS]
    assert sorted({p["issue_item"] for p in parts}) == [1, 2, 3, 4, 5, 6]  # every item of issue 30
    for p in parts:
        assert p["status"] == "planned"
        script = Path(p["command"][1])
        assert script.parent == REPO / "tools" and script.is_file(), p["command"]
        assert p["command"][2:] == ["--device", "cuda", "--size", "full", "--result", p["command"][-1]]
        assert 0 < p["cap_s"] <= 180
        assert f"| {p['name']} | {p['issue_item']} | planned |" in md
    total = sum(p["cap_s"] for p in parts) + report["install_cap_s"]
    assert total <= report["budget_s"] < DEVICE_COMMAND_LIMIT_S, total
    # the wheel list resolves from the pinned list; none is downloaded here, so each is reported missing
    pins = gpu_check.read_pins()
    assert [w["pin"] for w in report["wheels"]["wheels"]] == pins
    assert {p.split("==")[0] for p in pins} >= {"megatron-core", "pydantic", "pydantic-core"}
    assert report["wheels"]["ready"] is False and len(report["wheels"]["problems"]) == len(pins)


def fake_wheels(folder: Path) -> list[Path]:
    """One small file per pin, named as pip names wheels, and their SHA256SUMS."""
    folder.mkdir()
    files = []
    for pin in gpu_check.read_pins():
        name, version = pin.split("==")
        path = folder / f"{gpu_check.wheel_key(name)}-{version}-py3-none-any.whl"
        path.write_bytes(pin.encode())
        files.append(path)
    lines = [f"{hashlib.sha256(f.read_bytes()).hexdigest()}  {f.name}" for f in files]
    (folder / "SHA256SUMS").write_text("\n".join(lines) + "\n")
    return files


def test_wheels_are_verified_against_the_manifest_before_install(tmp_path):
    files = fake_wheels(tmp_path / "w")
    resolved = gpu_check.resolve_wheels(tmp_path / "w", gpu_check.read_pins())
    assert resolved["ready"] and resolved["problems"] == []
    assert resolved["total_bytes"] == sum(f.stat().st_size for f in files)
    files[0].write_bytes(b"tampered")
    (tmp_path / "w" / "extra-1.0-py3-none-any.whl").write_bytes(b"x")
    resolved = gpu_check.resolve_wheels(tmp_path / "w", gpu_check.read_pins())
    assert resolved["problems"] == [f"{files[0].name}: hash differs", "extra-1.0-py3-none-any.whl: not pinned in gpu_wheels.txt"]
    refused = gpu_check.install_wheels(resolved, tmp_path / "w", tmp_path / "site")
    assert refused["status"] == "fail" and "hash differs" in refused["reason"]
    assert not (tmp_path / "site").exists()  # nothing was installed


def test_cap_scale_is_for_cpu_runs_and_at_least_one(tmp_path):
    for args, given in ((["--device", "cuda", "--cap-scale", "2"], "2 with --device cuda"),
                        (["--device", "cpu", "--cap-scale", "0.5"], "0.5 with --device cpu")):
        proc = subprocess.run([sys.executable, "tools/gpu_check.py", "--dry-run", "--out", str(tmp_path), *args],
                              cwd=REPO, capture_output=True, text=True)
        assert proc.returncode == 2
        assert proc.stderr.strip().splitlines()[-1] == (
            f"gpu_check: error: --cap-scale: a number >= 1, for --device cpu runs (got {given})")


def test_pins_must_be_exact(tmp_path):
    bad = tmp_path / "pins.txt"
    bad.write_text("# comment\nmegatron-core>=0.19\n")
    with pytest.raises(ValueError, match=r"pins.txt:2: 'megatron-core>=0.19' is not name==version"):
        gpu_check.read_pins(bad)


@pytest.mark.slow
@pytest.mark.megatron
def test_megatron_parity_and_training_pass_on_cpu_at_tiny_size(tmp_path):
    """Parts 2 and 3 as the GPU runs them, on the CPU (gloo, fp32 and bf16, one family; SPO, GRPO, PPO), importing
    only what the GPU machine has or the wheels bring."""
    # caps x 4 and a budget to match: CI's 3.12 leg runs this at nice 10 beside the suite (70 s ran out there)
    proc, report, md = run_check("--device", "cpu", "--no-install", "--parts", "megatron-parity,training",
                                 "--simulate-gpu-machine", "--cap-scale", "4", "--budget-s", "1200", "--out", str(tmp_path))
    parts = {p["name"]: p for p in report["parts"]}
    assert proc.returncode == 0, (proc.stdout[-3000:], {k: p.get("log_tail") for k, p in parts.items()})
    assert (report["mode"], report["size"], report["install"]["status"]) == ("run", "tiny", "skipped")
    assert set(parts) == {"megatron-parity", "training"}
    parity = {c["name"]: c for c in parts["megatron-parity"]["checks"]}
    assert parts["megatron-parity"]["status"] == "pass" and all(c["ok"] for c in parity.values())
    assert parts["megatron-parity"]["numbers"]["process group backend"] == "gloo"
    assert parity["llama (llama3.2-tied) float32 logits max abs diff"]["value"] < 1e-4
    assert parity["llama (llama3.2-tied) bfloat16 logits error / transformers' bf16 error"]["value"] <= 3.0
    training = {c["name"]: c for c in parts["training"]["checks"]}
    assert parts["training"]["status"] == "pass"
    for algo in ("spo", "grpo", "ppo"):
        assert training[f"{algo} rerun bitwise (weights, losses)"]["ok"]
        assert training[f"{algo} weights moved (max abs)"]["value"] > 1e-5
        losses = parts["training"]["numbers"][f"{algo} losses"]
        assert len(losses) == 2 and all(isinstance(x, float) for x in losses)
    assert "| megatron-parity | 2 | pass |" in md and "| training | 3 | pass |" in md
    assert report["simulated_gpu_machine"]["refused_imports"] == []


def test_the_import_guard_refuses_in_the_checkout_what_the_gpu_machine_lacks(tmp_path):
    """msgspec (a test dependency here, absent there) neither imports nor is found from the checkout's code;
    yaml (there) imports; the same import from outside the checkout is left alone."""
    checkout, outside = tmp_path / "checkout", tmp_path / "outside"
    checkout.mkdir(), outside.mkdir()
    probe = (
        "import importlib.util, json\n"
        "import yaml\n"
        "try:\n    import msgspec\n    imported = True\nexcept ModuleNotFoundError as err:\n    imported = str(err)\n"
        "print(json.dumps([imported, importlib.util.find_spec('msgspec') is not None]))\n"
    )
    (checkout / "probe.py").write_text(probe)
    (outside / "probe.py").write_text(probe)
    env = gpu_check.part_env("cpu", None, {**gpu_check.import_guard(tmp_path), "GPU_CHECK_REPO": str(checkout)})
    results = {}
    for where in (checkout, outside):
        proc = subprocess.run([sys.executable, str(where / "probe.py")], env=env, capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr[-2000:]
        results[where.name] = json.loads(proc.stdout)
    assert results["checkout"] == ["No module named 'msgspec' (not on the GPU machine)", False]
    assert results["outside"] == [True, True]
    assert (tmp_path / "refused-imports.log").read_text().split() == ["msgspec", "msgspec"]
