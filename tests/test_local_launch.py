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

from megatron_spo.models import parallel
from megatron_spo.models.parallel import rank_failure, spawn_local, start_local

# tests/conftest.py turns the fork server on for the suite; the CLI's launches keep the spawned helper. Both ways.
LAUNCHES = {"spawned-helper": False, "fork-server": True}


def record_rank(out_dir: str) -> None:
    rank = int(os.environ["RANK"])
    print(f"rank {rank} on stdout", flush=True)
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump({"pid": os.getpid(), "ppid": os.getppid(), "world": int(os.environ["WORLD_SIZE"]),
                   "megatron_imported_at_entry": "megatron.core.models.gpt" in sys.modules,
                   "cwd": os.getcwd(), "env": os.environ.get("LOCAL_LAUNCH_PROBE"),
                   # one write per line (parallel.whole_lines): under python -u print writes text and newline apart
                   "whole_lines": sys.stdout.line_buffering and not sys.stdout.write_through}, f)


def fail_on_rank(rank_to_fail: int, how: str) -> None:
    if int(os.environ["RANK"]) != rank_to_fail:
        return
    if how == "raise":
        raise ValueError(f"rank {rank_to_fail} refuses")
    os._exit(3)


@pytest.mark.parametrize("launch", LAUNCHES)
def test_ranks_fork_from_one_helper_that_imported_megatron_with_the_callers_env_cwd_and_streams(
        tmp_path, monkeypatch, capfd, launch):
    monkeypatch.setattr(parallel, "FORK_SERVER", LAUNCHES[launch])
    for world, probe in ((3, "first"), (1, "second")):  # the fork server's second group: this call's env, not its own
        out = tmp_path / probe
        out.mkdir()
        monkeypatch.setenv("LOCAL_LAUNCH_PROBE", probe)
        monkeypatch.chdir(out)
        spawn_local(record_rank, world, str(out))
        ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]
        assert len({r["pid"] for r in ranks}) == world and all(r["world"] == world for r in ranks)
        assert all(r["cwd"] == str(out) and r["env"] == probe and r["whole_lines"] for r in ranks)
        said = [line for line in capfd.readouterr().out.splitlines() if line.startswith("rank ")]  # not the imports'
        assert sorted(said) == [f"rank {r} on stdout" for r in range(world)]
        if world > 1:
            helpers = {r["ppid"] for r in ranks}
            assert len(helpers) == 1 and os.getpid() not in helpers  # one helper, not this process
            assert all(r["megatron_imported_at_entry"] for r in ranks)  # inherited from the helper, not imported again


@pytest.mark.parametrize("launch", LAUNCHES)
def test_a_failing_rank_reaches_the_launcher_as_its_own_one_line_reason(monkeypatch, launch):
    monkeypatch.setattr(parallel, "FORK_SERVER", LAUNCHES[launch])
    for how, expected in (("raise", ("ValueError", "rank 1 refuses")),
                          ("exit", ("ProcessExitedException", "process 1 terminated with exit code 3"))):
        ctx = start_local(fail_on_rank, 2, 1, how)
        with pytest.raises(mp.ProcessRaisedException) as err:
            while not ctx.join(timeout=1.0):
                pass
        assert rank_failure(err.value) == expected


def test_a_helper_preempted_while_importing_ends_like_a_starting_rank_in_one_line_with_exit_0(tmp_path, capfd,
                                                                                             monkeypatch):
    """SIGTERM (SLURM's cancel / preemption) during the helper's seconds of importing megatron-core: one line, exit
    0 (SLURM requeues on 0), no rank started. Without the start-up handler the helper died by the signal, which the
    launcher reports as a failed rank (exit 1)."""
    monkeypatch.setattr(parallel, "FORK_SERVER", False)  # the CLI's launch (from the server: nothing left to import)
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
