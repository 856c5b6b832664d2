"""Local ranks (megatron_spo.models.parallel.start_local): several are forked from one helper that imported
megatron-core once; a failing rank's reason reaches the launcher in one line."""

import json
import os
import signal
import sys
import time
from pathlib import Path

import pytest
import torch.multiprocessing as mp

from megatron_spo.models.parallel import rank_failure, spawn_local, start_local


def record_rank(out_dir: str) -> None:
    rank = int(os.environ["RANK"])
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump({"pid": os.getpid(), "ppid": os.getppid(), "world": int(os.environ["WORLD_SIZE"]),
                   "megatron_imported_at_entry": "megatron.core.models.gpt" in sys.modules,
                   "cwd": os.getcwd(), "env": os.environ.get("LOCAL_LAUNCH_PROBE")}, f)


def fail_on_rank(rank_to_fail: int, how: str) -> None:
    if int(os.environ["RANK"]) != rank_to_fail:
        return
    if how == "raise":
        raise ValueError(f"rank {rank_to_fail} refuses")
    os._exit(3)


def test_ranks_fork_from_one_helper_that_imported_megatron_with_the_callers_env_and_cwd(tmp_path, monkeypatch):
    monkeypatch.setenv("LOCAL_LAUNCH_PROBE", "set-by-the-test")
    monkeypatch.chdir(tmp_path)
    spawn_local(record_rank, 3, str(tmp_path))
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(3)]
    helpers = {r["ppid"] for r in ranks}
    assert len(helpers) == 1 and os.getpid() not in helpers  # one helper, not this process
    assert len({r["pid"] for r in ranks}) == 3 and all(r["world"] == 3 for r in ranks)
    assert all(r["megatron_imported_at_entry"] for r in ranks)  # inherited from the helper, not imported again
    assert all(r["cwd"] == str(tmp_path) and r["env"] == "set-by-the-test" for r in ranks)


def test_a_failing_rank_reaches_the_launcher_as_its_own_one_line_reason():
    for how, expected in (("raise", ("ValueError", "rank 1 refuses")),
                          ("exit", ("ProcessExitedException", "process 1 terminated with exit code 3"))):
        ctx = start_local(fail_on_rank, 2, 1, how)
        with pytest.raises(mp.ProcessRaisedException) as err:
            while not ctx.join(timeout=1.0):
                pass
        assert rank_failure(err.value) == expected


def test_a_helper_preempted_while_importing_ends_like_a_starting_rank_in_one_line_with_exit_0(tmp_path, capfd):
    """SIGTERM (SLURM's cancel / preemption) during the helper's seconds of importing megatron-core: one line, exit
    0 (SLURM requeues on 0), no rank started. Without the start-up handler the helper died by the signal, which the
    launcher reports as a failed rank (exit 1)."""
    ctx = start_local(record_rank, 2, str(tmp_path))
    helper = ctx.processes[0]
    deadline = time.monotonic() + 120
    while True:  # the helper's start-up handler is in place (SigCgt), then it imports megatron-core for seconds
        status = dict(line.split(":", 1) for line in Path(f"/proc/{helper.pid}/status").read_text().splitlines())
        if int(status["SigCgt"], 16) >> (signal.SIGTERM - 1) & 1:
            break
        assert time.monotonic() < deadline and helper.is_alive()
        time.sleep(0.005)
    os.kill(helper.pid, signal.SIGTERM)
    while not ctx.join(timeout=1.0):  # no exception: the helper exited 0
        pass
    assert helper.exitcode == 0 and list(tmp_path.iterdir()) == []
    assert capfd.readouterr().err.strip().splitlines()[-1] == (
        "megatron-spo: SIGTERM received while starting up: nothing to save, exiting")
