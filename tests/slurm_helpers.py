"""The single-host SLURM test cluster as a pytest fixture, and job helpers (scontrol, waiting, logs); the commands
slurm/spo.sbatch starts, without a cluster (job_commands).

Shared by tests/test_slurm.py (the launch probe) and tests/test_slurm_trainer.py (the real trainer).
A test module takes the fixture as `cluster = slurm_helpers.cluster`: each module gets its own cluster.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SUBMIT = REPO / "slurm" / "submit.sh"
CLUSTER = REPO / "slurm" / "test_cluster.sh"
TERMINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE"}


def _missing_slurm() -> str | None:
    if os.geteuid() != 0:
        return "needs root (slurmd runs the test jobs)"
    missing = [b for b in ("munged", "slurmctld", "slurmd", "sbatch", "scontrol") if not shutil.which(b)
               and not Path("/usr/sbin", b).exists()]
    if missing:
        return f"Debian packages slurmctld slurmd slurm-client munge missing ({', '.join(missing)} not found)"
    return None


# Each test module's cluster numbers its jobs from its own first id: spo.sbatch derives its ports from the job id
# (20000 + (id % 127) * 100), so the modules' clusters can run at once (on two pytest-xdist workers) without two
# jobs taking the same ports. A module submits far fewer than 40 jobs, and every job's ports stay below Linux's
# ephemeral range (32768 and up), where any connection of any test may hold a port as its local end.
FIRST_JOB_IDS = {"test_slurm": 1, "test_slurm_flow": 41, "test_slurm_trainer": 81}


@pytest.fixture(scope="module")
def cluster(request, tmp_path_factory):
    """Environment (dict) for SLURM client commands against a fresh 4-node cluster; stopped at the end."""
    reason = _missing_slurm()
    if reason:
        pytest.skip(reason)
    root = tmp_path_factory.mktemp("slurm")
    state = root / "cluster"
    # Nothing of an enclosing SLURM job (when CI itself runs under SLURM) may leak into the test jobs.
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SPO_"))}
    env.update(SLURM_CONF=str(state / "slurm.conf"), OMP_NUM_THREADS="1")
    first_job_id = FIRST_JOB_IDS[request.module.__name__.rpartition(".")[2]]
    try:
        subprocess.run(["bash", str(CLUSTER), "start", str(state), "4"], env={**env, "FIRST_JOB_ID": str(first_job_id)},
                       check=True,
                       capture_output=True, text=True, timeout=60)
        yield {"env": env, "root": root}
    finally:
        subprocess.run(["bash", str(CLUSTER), "stop", str(state)], env=env, capture_output=True, timeout=120)


def job_info(cluster, job_id: str) -> list[dict[str, str]]:
    """One dict per het component, from `scontrol show job -o` (finished jobs stay for MinJobAge)."""
    out = subprocess.run(["scontrol", "show", "job", "-o", job_id], env=cluster["env"], capture_output=True,
                         text=True, check=True).stdout
    rows = []
    for line in out.splitlines():
        fields = dict(tok.split("=", 1) for tok in line.split() if "=" in tok)
        rows.append(fields)
    return rows


def wait_job(cluster, job_id: str, timeout_s: float, until=None) -> list[dict[str, str]]:
    """Wait until every component is terminal (or `until()` is true).

    Slurm 22.05 starts heterogeneous jobs only from the backfill scheduler, and backfill runs only after
    some job/node/partition change: on an idle test cluster a requeued job whose BeginTime (requeue +
    cred_expire) has passed waits for such a change, up to the controller's periodic pass (~60 s), and so does
    every job waiting on it. A no-op update (Comment) of the pending job waited on is that change; busy
    clusters need none.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        info = job_info(cluster, job_id)
        if until is not None and until():
            return info
        if all(c["JobState"] in TERMINAL for c in info):
            return info
        if info[0]["JobState"] == "PENDING":
            subprocess.run(["scontrol", "update", f"JobId={job_id}", f"Comment=poke{time.monotonic():.0f}"],
                           env=cluster["env"], capture_output=True)
        if time.monotonic() > deadline:
            pytest.fail(f"job {job_id} not done after {timeout_s} s: {[c['JobState'] for c in info]}")
        time.sleep(0.5)


def batch_log(run_dir: Path) -> str:
    """The batch shell's output (all restarts: --open-mode=append)."""
    return "".join(p.read_text() for p in sorted((run_dir / "logs").glob("*.out")))


def job_commands(tmp_path: Path, **env: str) -> dict:
    """The commands slurm/spo.sbatch starts, without a cluster: scontrol and srun stand-ins (trainer node n0 : worker
    node n1) record ENGINE_CMD and TRAIN_CMD as the job leaves them (unexpanded), and every srun's arguments, and
    return at once (as where pyxis is absent: its --container-* options are recorded, not run). ``env``: the job's
    variables (MODE, CONFIG, MODEL_PATH, SPO_TRAIN_ARGS, SPO_CONTAINER_IMAGE, ...). {"engine", "train", "stderr",
    "sruns": [each srun's argv]}."""
    out = Path(tempfile.mkdtemp(dir=tmp_path))
    (out / "bin").mkdir()
    (out / "bin" / "scontrol").write_text('#!/bin/bash\n[ "$1 $2" = "show hostnames" ] && echo node1\nexit 0\n')
    # the job stops one step once the other ended: each stand-in appends its arguments in one write, then returns only
    # once both steps (workers, driver) wrote theirs (or after 30 s), so neither record is lost to that stop
    (out / "bin" / "srun").write_text('#!/bin/bash\nargv="$(printf "%s\\x1f" "$@")"\n'
                                      'printf "%s\\n" "$argv" >> "$OUT/sruns"\n'
                                      'printf "%s\\n" "$ENGINE_CMD" > "$OUT/engine"\n'
                                      'printf "%s\\n" "$TRAIN_CMD" > "$OUT/train"\n'
                                      'for _ in $(seq 600); do [ "$(wc -l < "$OUT/sruns")" -ge 2 ] && break; sleep 0.05; '
                                      'done\nexit 0\n')
    for tool in ("scontrol", "srun"):
        (out / "bin" / tool).chmod(0o755)
    job = {"PATH": f"{out / 'bin'}:{os.environ['PATH']}", "HOME": str(out), "SLURM_JOB_ID": "7", "SLURM_HET_SIZE": "2",
           "SLURM_JOB_NODELIST_HET_GROUP_0": "n0", "SLURM_JOB_NODELIST_HET_GROUP_1": "n1", "SPO_HOME": str(REPO),
           "RUN_DIR": str(out / "run"), "OUT": str(out), "PYTHONPATH": str(REPO), **env}
    proc = subprocess.run(["bash", str(REPO / "slurm" / "spo.sbatch")], env=job, capture_output=True, text=True,
                          timeout=120)
    read = {name: (out / name).read_text().strip() if (out / name).exists() else "" for name in ("engine", "train")}
    sruns = (out / "sruns").read_text().splitlines() if (out / "sruns").exists() else []
    return {**read, "stderr": proc.stderr, "sruns": [line.split("\x1f")[:-1] for line in sruns]}
