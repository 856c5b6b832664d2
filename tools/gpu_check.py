"""The GPU check in one command: every path of the project that CI (no GPU) cannot run, on one H100/H200.

    bash tools/gpu_wheels.sh                         # here: the wheels the GPU machine lacks -> .gpu-wheels/
    bash tools/gpu_check.sh                          # there (device run, carry=[".gpu-wheels"]): all parts
    python tools/gpu_check.py --dry-run              # anywhere: the plan and the report schema, nothing run
    python tools/gpu_check.py --device cpu --size tiny --no-install --parts megatron-parity,training
    python tools/gpu_check.py --device cpu --no-install --simulate-gpu-machine   # imports as the GPU has them

Steps: verify the wheels against .gpu-wheels/SHA256SUMS and `pip install --no-deps --target <tmp>` them
(the machine's torch is never touched), then run every part in its own subprocess (PYTHONPATH = the wheels,
the checkout) under its own time cap, the whole run stopping before --budget-s (default 530 s). After
each part the report is rewritten: $OUT/gpu_report.json and $OUT/gpu_report.md (--out; the markdown is
printed at the end), and the part's output appended to $OUT/gpu_parts.log. A part's status: pass, fail
(a check missed its limit), skipped (with the reason), error (it raised: the last line and traceback are
kept), timeout (its cap ran out), not-run (the run's budget ran out first), planned (--dry-run). Exit
status 0 when no part failed, errored or timed out.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PINS = REPO / "tools" / "gpu_wheels.txt"
GPU_MACHINE_PACKAGES = REPO / "tools" / "gpu_machine_packages.txt"
IMPORT_GUARD = REPO / "tools" / "gpu_import_guard"  # its sitecustomize.py refuses what the GPU machine lacks
SCHEMA = "megatron-spo/gpu-check/1"
BUDGET_S = 530  # the device tool allows 600 s a command; issue 30 asks for under 9 min, with margin
INSTALL_CAP_S = 30
MIN_PART_S = 10  # a part is not started with less time than this left
LOG_KEEP = 20_000  # characters of each part's output kept in $OUT/gpu_parts.log
STATUSES = ("planned", "pass", "fail", "skipped", "error", "timeout", "not-run")


@dataclass(frozen=True)
class Part:
    name: str
    issue_item: int  # the numbered item of issue 30 it answers
    title: str
    script: str  # tools/<script> --device D --size S --result FILE
    cap_s: int


PARTS = (  # caps: about 1.5-3x each part's wall on the H200 (2026-11-27/28: step-bench 37 s); layouts' a guess
    Part("environment", 6, "GPU, driver, torch / triton / megatron-core versions", "gpu_part_env.py", 30),
    Part("step-bench", 3, "issue 45: the 1B SPO step vs megatron-core's LM step (tokens/s, MFU, peak memory, "
         "time split) at 8 x 4096 and 1 x 16k tokens", "gpu_part_step.py", 110),
    Part("ops-bench", 1, "tools/bench_logprobs.py at V=128256: peak memory and time vs naive and Liger (scalar and "
         "per-token upstream), block sizes, gradient errors", "gpu_part_bench.py", 160),
    Part("ops-kernels", 1, "fused token log-probs (Triton and torch blocks) and cumulative Q vs the fp64 "
         "reference, fp32 and bf16", "gpu_part_kernels.py", 20),
    Part("ops-cuda-tests", 1, "the CUDA-only tests of tests/test_ops_logprobs.py", "gpu_part_cuda_tests.py", 25),
    Part("megatron-parity", 2, "megatron-core GPTModel (local spec, NCCL group of one) vs transformers, "
         "forward + backward, fp32 and bf16, one family per registry entry", "gpu_part_megatron.py", 35),
    Part("training", 3, "SPO, GRPO, PPO and guided-GRPO steps (tiny model, deterministic source, no engines): rerun "
         "bitwise, close to CPU; a bf16 SPO run", "gpu_part_training.py", 55),
    Part("te-fp8", 5, "Transformer Engine FP8 if importable; the LM-head FP8 GEMM (torch._scaled_mm)",
         "gpu_part_fp8.py", 15),
    Part("nccl-push", 4, "the weight push over NCCL between two processes (needs 2 GPUs)",
         "gpu_part_nccl.py", 10),
    Part("layouts", 3, "issue 60: SPO steps at TP 2 + SP and at CP 2 over NCCL against one GPU (needs 2 GPUs)",
         "gpu_part_layouts.py", 30),
)


# ---------------------------------------------------------------------------------------------
# Wheels
# ---------------------------------------------------------------------------------------------
def read_pins(path: Path = PINS) -> list[str]:
    """The pinned requirements (name==version) of tools/gpu_wheels.txt."""
    pins = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        if not re.fullmatch(r"[A-Za-z0-9_.-]+==[A-Za-z0-9_.+-]+", line):
            raise ValueError(f"{path}:{number}: {line!r} is not name==version")
        pins.append(line)
    return pins


def wheel_key(name: str) -> str:
    """A distribution name as wheel file names spell it (PEP 427: runs of -_. become _, lower case)."""
    return re.sub(r"[-_.]+", "_", name).lower()


def resolve_wheels(wheel_dir: Path, pins: list[str]) -> dict:
    """Each pin's wheel file in wheel_dir and its SHA256SUMS entry, verified; reads files, downloads nothing."""
    manifest = wheel_dir / "SHA256SUMS"
    sums = {}
    if manifest.exists():
        for line in manifest.read_text().splitlines():
            digest, _, name = line.strip().partition("  ")
            sums[name] = digest
    files = {p.name: p for p in wheel_dir.glob("*.whl")} if wheel_dir.is_dir() else {}
    entries, problems = [], []
    for pin in pins:
        name, version = pin.split("==")
        prefix = f"{wheel_key(name)}-{version}-"
        matches = sorted(f for f in files if f.lower().startswith(prefix))
        entry = {"pin": pin, "file": matches[0] if matches else None}
        if not matches:
            problems.append(f"{pin}: no {prefix}*.whl")
        else:
            path = files[matches[0]]
            entry["bytes"] = path.stat().st_size
            entry["sha256"] = sums.get(path.name)
            entry["verified"] = entry["sha256"] == hashlib.sha256(path.read_bytes()).hexdigest()
            if not entry["verified"]:
                problems.append(f"{path.name}: " + ("not in SHA256SUMS" if not entry["sha256"] else "hash differs"))
        entries.append(entry)
    unpinned = sorted(set(files) - {e["file"] for e in entries})
    problems += [f"{f}: not pinned in {PINS.name}" for f in unpinned]
    return {
        "dir": str(wheel_dir),
        "wheels": entries,
        "total_bytes": sum(e.get("bytes", 0) for e in entries),
        "problems": problems,
        "ready": not problems,
    }


def install_wheels(wheels: dict, wheel_dir: Path, target: Path) -> dict:
    """pip install --no-deps --target the verified wheels; the machine's own packages stay as they are."""
    if not wheels["ready"]:
        return {"status": "fail", "reason": "; ".join(wheels["problems"][:5])}
    files = [str(wheel_dir / e["file"]) for e in wheels["wheels"]]
    cmd = [sys.executable, "-m", "pip", "install", "--quiet", "--no-index", "--no-deps", "--no-compile",
           "--no-cache-dir", "--disable-pip-version-check", "--target", str(target), *files]
    start = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=INSTALL_CAP_S)
    except subprocess.TimeoutExpired:
        return {"status": "timeout", "reason": f"pip install ran past {INSTALL_CAP_S} s"}
    out = {"status": "pass" if proc.returncode == 0 else "fail", "target": str(target),
           "install_s": round(time.perf_counter() - start, 2)}
    if proc.returncode:
        out["reason"] = proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else f"pip exited {proc.returncode}"
    return out


# ---------------------------------------------------------------------------------------------
# Parts
# ---------------------------------------------------------------------------------------------
def part_command(part: Part, device: str, size: str, result: Path) -> list[str]:
    return [sys.executable, str(REPO / "tools" / part.script), "--device", device, "--size", size,
            "--result", str(result)]


def part_env(device: str, site: Path | None, guard: dict | None = None) -> dict:
    """The parts' environment; guard: the --simulate-gpu-machine variables (see gpu_import_guard)."""
    paths = ([str(IMPORT_GUARD)] if guard else []) + ([str(site)] if site else []) + [str(REPO)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths + [os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
           "PYTHONUNBUFFERED": "1", "PYTHONWARNINGS": "ignore", "HF_HUB_OFFLINE": "1",
           "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "WANDB_MODE": "disabled",
           "TRANSFORMERS_VERBOSITY": "error", "HF_HUB_DISABLE_PROGRESS_BARS": "1"}
    if device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""  # a CPU run on a GPU machine must not find the GPU
    return {**env, **(guard or {})}


def import_guard(work: Path) -> dict:
    """Environment of gpu_import_guard: allowed = the GPU machine's packages, the pinned wheels, this project."""
    project = work / "project-dist.txt"
    project.write_text("megatron-spo\n")
    allowed = os.pathsep.join(str(p) for p in (GPU_MACHINE_PACKAGES, PINS, project))
    return {"GPU_CHECK_ALLOWED_DISTS": allowed, "GPU_CHECK_REFUSED_LOG": str(work / "refused-imports.log"),
            "GPU_CHECK_REPO": str(REPO)}


def run_part(cmd: list[str], env: dict, cap_s: float, result: Path, log: Path) -> dict:
    """Run one part in its own process group; kill the group at the cap. The part's JSON, or why there is none."""
    start = time.perf_counter()
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=REPO, start_new_session=True)
        try:
            rc = proc.wait(timeout=cap_s)
            timed_out = False
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the part and whatever it started (workers, pytest)
            rc = proc.wait()
            timed_out = True
    wall = round(time.perf_counter() - start, 2)
    tail = log.read_text(errors="replace")[-3000:]
    if timed_out:
        return {"status": "timeout", "reason": f"ran past its cap of {cap_s:.0f} s", "wall_s": wall, "log_tail": tail}
    if not result.exists():
        lines = tail.strip().splitlines()
        return {"status": "error", "reason": f"exited {rc} without a result: {lines[-1] if lines else ''}",
                "wall_s": wall, "log_tail": tail}
    out = json.loads(result.read_text())
    out["wall_s"] = wall
    if out["status"] in ("fail", "error"):
        out["log_tail"] = tail
    return out


# ---------------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------------
def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


def write_report(report: dict, out_dir: Path) -> str:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "gpu_report.json").write_text(json.dumps(report, indent=1, default=str) + "\n")
    text = markdown(report)
    (out_dir / "gpu_report.md").write_text(text)
    return text


def _fmt(value) -> str:
    if isinstance(value, float):
        return f"{value:.3g}"
    return str(value)


def markdown(report: dict) -> str:
    env = next((p for p in report["parts"] if p["name"] == "environment"), {}).get("numbers", {})
    lines = [f"# GPU check ({report['mode']}, {report['device']}, size {report['size']})", "",
             f"Started {report['started_utc']}; wall {report.get('wall_s', 0):.0f} s of a {report['budget_s']} s budget.",
             f"Device: {env.get('gpu', 'not read')}; driver {env.get('driver', '?')}; torch {env.get('torch', '?')}; "
             f"triton {env.get('triton', '?')}; megatron-core {env.get('megatron_core', '?')}.", ""]
    w = report["wheels"]
    lines.append(f"Wheels: {len(w['wheels'])} pinned, {w['total_bytes'] / 2**20:.1f} MiB in {w['dir']}; "
                 f"install: {report['install'].get('status')} {report['install'].get('reason', '')}".rstrip())
    lines += ["", "| part | item | status | wall s | cap s | numbers / reason |", "| --- | --- | --- | --- | --- | --- |"]
    for p in report["parts"]:
        detail = p.get("reason", "")
        checks = [f"{c['name']}={_fmt(c['value'])}" + ("" if c["ok"] else " FAILED") for c in p.get("checks", [])]
        failed = [c for c in checks if c.endswith("FAILED")]
        shown = failed or checks
        if shown:
            detail = (detail + "; " if detail else "") + "; ".join(shown[:8]) + (" ..." if len(shown) > 8 else "")
        detail = detail.replace("|", "/").replace("\n", " ")
        lines.append(f"| {p['name']} | {p['issue_item']} | {p['status']} | {_fmt(p.get('wall_s', ''))} | "
                     f"{p['cap_s']} | {detail} |")
    for p in report["parts"]:
        extra = [f"- {k}: {_fmt(v)}" for k, v in p.get("numbers", {}).items()] + [f"- note: {n}" for n in p.get("notes", [])]
        if extra:
            lines += ["", f"## {p['name']}", *extra]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gpu_check", description=__doc__.split("\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="plan, resolve wheels, write the schema; run nothing")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--size", choices=["full", "tiny"], default=None, help="default: full on cuda, tiny on cpu")
    parser.add_argument("--parts", default="", help=f"comma list (default all): {','.join(p.name for p in PARTS)}")
    parser.add_argument("--out", default=os.environ.get("OUT") or str(REPO / "outputs" / "gpu-check"))
    parser.add_argument("--wheels", default=str(REPO / ".gpu-wheels"), help="folder of tools/gpu_wheels.sh")
    parser.add_argument("--no-install", action="store_true", help="use this machine's packages as they are")
    parser.add_argument("--budget-s", type=float, default=BUDGET_S, help="stop starting parts after this")
    parser.add_argument("--keep-work", action="store_true", help="keep the scratch folder (parts' files, logs)")
    parser.add_argument("--cap-scale", type=float, default=1.0,
                        help="(--device cpu) multiply every part's cap: the caps fit the GPU's device time; a CPU run "
                             "beside other work (CI's 3.12 leg runs at nice 10 beside the suite) takes longer")
    parser.add_argument("--simulate-gpu-machine", action="store_true",
                        help="(--device cpu) refuse imports of installed packages the GPU machine lacks")
    args = parser.parse_args(argv)
    if args.simulate_gpu_machine and args.device != "cpu":
        parser.error("--simulate-gpu-machine is for --device cpu runs (the GPU machine is itself)")
    if not (args.cap_scale >= 1 and math.isfinite(args.cap_scale)) or (args.cap_scale != 1 and args.device != "cpu"):
        parser.error(f"--cap-scale: a number >= 1, for --device cpu runs (got {args.cap_scale:g} with --device "
                     f"{args.device})")
    start = time.perf_counter()
    size = args.size or ("full" if args.device == "cuda" else "tiny")
    chosen = [p for p in PARTS if not args.parts or p.name in args.parts.split(",")]
    unknown = set(filter(None, args.parts.split(","))) - {p.name for p in PARTS}
    if unknown:
        parser.error(f"--parts: unknown {sorted(unknown)} (known: {', '.join(p.name for p in PARTS)})")
    work = Path(tempfile.mkdtemp(prefix="gpu-check-"))
    out_dir = Path(args.out)
    wheel_dir = Path(args.wheels)
    report = {
        "schema": SCHEMA, "mode": "dry-run" if args.dry_run else "run", "device": args.device, "size": size,
        "started_utc": _now(), "budget_s": args.budget_s, "install_cap_s": INSTALL_CAP_S, "python": sys.version.split()[0],
        "wheels": resolve_wheels(wheel_dir, read_pins()), "install": {"status": "planned"}, "parts": [],
    }
    for part in chosen:
        cmd = part_command(part, args.device, size, work / f"{part.name}.json")
        report["parts"].append({"name": part.name, "issue_item": part.issue_item, "title": part.title,
                                "cap_s": part.cap_s, "command": cmd, "status": "planned"})
    if args.dry_run:
        report["wall_s"] = round(time.perf_counter() - start, 2)
        print(write_report(report, out_dir))
        shutil.rmtree(work)
        return 0

    site = None
    if args.no_install:
        report["install"] = {"status": "skipped", "reason": "--no-install: this machine's packages"}
    else:
        site = work / "site"
        report["install"] = install_wheels(report["wheels"], wheel_dir, site)
        if report["install"]["status"] != "pass":
            site = None
    write_report(report, out_dir)
    (out_dir / "gpu_parts.log").write_text("")
    guard = import_guard(work) if args.simulate_gpu_machine else None
    env = part_env(args.device, site, guard)
    for entry, part in zip(report["parts"], chosen):
        left = args.budget_s - (time.perf_counter() - start)
        cap = min(part.cap_s * args.cap_scale, left)
        if cap < MIN_PART_S:
            entry.update(status="not-run", reason=f"the run's budget ran out ({left:.0f} s left)")
        else:
            print(f"gpu_check: {part.name} (cap {cap:.0f} s) ...", flush=True)
            log = work / f"{part.name}.log"
            entry.update(run_part(entry["command"], env, cap, work / f"{part.name}.json", log))
            with open(out_dir / "gpu_parts.log", "a") as logs:  # every part's output, its end if long
                logs.write(f"===== {part.name}: {entry['status']} =====\n{log.read_text(errors='replace')[-LOG_KEEP:]}\n")
            print(f"gpu_check: {part.name}: {entry['status']} in {entry['wall_s']} s {entry.get('reason', '')}", flush=True)
        report["wall_s"] = round(time.perf_counter() - start, 2)
        write_report(report, out_dir)
    if guard:
        log = Path(guard["GPU_CHECK_REFUSED_LOG"])
        refused = sorted(set(log.read_text().split())) if log.exists() else []
        report["simulated_gpu_machine"] = {"refused_imports": refused, "packages": str(GPU_MACHINE_PACKAGES)}
    report["finished_utc"] = _now()
    report["summary"] = {s: sum(p["status"] == s for p in report["parts"]) for s in STATUSES}
    if args.keep_work:
        report["work"] = str(work)
    else:
        shutil.rmtree(work, ignore_errors=True)
    print(write_report(report, out_dir))
    return 1 if any(p["status"] in ("fail", "error", "timeout") for p in report["parts"]) else 0


if __name__ == "__main__":
    sys.exit(main())
