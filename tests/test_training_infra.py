"""Metrics files, plots, atomic checkpoints and preemption signals (the trainer's plumbing)."""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from megatron_spo.run_layout import CheckpointDir, CheckpointError, PreemptionHandler
from megatron_spo.training.metrics import MetricsFileError, MetricsLogger, plot_main, read_metrics


def test_metrics_roundtrip_exact_and_nonfinite(tmp_path):
    with MetricsLogger(tmp_path) as log:
        log.log(1, {"loss": 0.5, "reward": -1.0})
        log.log(2, {"loss": float("nan"), "kl": float("inf")})
    recs = read_metrics(tmp_path)
    assert [r["step"] for r in recs] == [1, 2]
    assert recs[0]["loss"] == 0.5 and recs[0]["reward"] == -1.0
    assert recs[1]["loss"] != recs[1]["loss"] and recs[1]["kl"] == float("inf")


def test_torn_last_line_is_reported_and_repaired_on_resume(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "loss": 1.0}\n{"step": 2, "loss": 0.9}\n{"step": 3, "lo')
    with pytest.warns(UserWarning, match="line 3: torn last line skipped"):
        assert [r["step"] for r in read_metrics(path)] == [1, 2]
    # resuming from step 1 replays step 2: both the torn line and step 2 go
    with MetricsLogger(tmp_path, resume_from_step=1) as log:
        log.log(2, {"loss": 0.8})
    assert [(r["step"], r["loss"]) for r in read_metrics(path)] == [(1, 1.0), (2, 0.8)]


def test_malformed_middle_line_names_file_and_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\nnot json\n{"step": 3}\n')
    with pytest.raises(MetricsFileError, match=r"metrics.jsonl line 2: not valid JSON"):
        read_metrics(path)
    path.write_text('{"loss": 1}\n')
    with pytest.raises(MetricsFileError, match="line 1: a record needs a 'step' field"):
        read_metrics(path)


def test_plot_writes_one_png_per_panel_with_data(tmp_path, capsys):
    with MetricsLogger(tmp_path) as log:
        for s in range(1, 6):
            log.log(s, {"loss": 1.0 / s, "reward": -1 + s / 10, "time/step": 0.1, "time/weight_sync": 0.01})
    assert plot_main([str(tmp_path), "--smooth", "2"]) == 0
    names = sorted(p.name for p in (tmp_path / "plots").iterdir())
    assert names == ["loss.png", "overview.png", "reward.png", "step_time_split_s.png"]
    assert (tmp_path / "plots" / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # one figure drawn once: each panel is its cell of overview.png (3 panels: one row of 3 cells of 5 x 3.2 in)
    import matplotlib.image
    import numpy as np

    overview = matplotlib.image.imread(tmp_path / "plots" / "overview.png")
    assert overview.shape[:2] == (320, 1500)
    for col, name in enumerate(["loss", "reward", "step_time_split_s"]):
        panel = matplotlib.image.imread(tmp_path / "plots" / f"{name}.png")
        np.testing.assert_array_equal(panel, overview[:, 500 * col:500 * (col + 1)])
        assert (panel[..., :3] < 0.5).any(axis=-1).mean() > 0.01  # drawn on: lines, ticks, title
    assert plot_main([str(tmp_path / "missing")]) == 1
    assert "no such metrics file" in capsys.readouterr().err  # errors go to stderr (issue 28)


def _write(name):
    def write(d):
        (d / name).write_text("payload")
    return write


def test_checkpoint_commit_latest_and_prune(tmp_path):
    ck = CheckpointDir(tmp_path, keep_last=2)
    assert ck.latest() is None
    for step in (10, 20, 30):
        ck.save(step, _write("model.bin"), {"world_size": 1})
    assert ck.complete_steps() == [20, 30]
    step, path = ck.latest()
    assert step == 30 and (path / "model.bin").read_text() == "payload"
    assert ck.metadata(path)["world_size"] == 1
    ck.save(30, _write("other.bin"))  # re-save of the same step (after a resume) replaces it whole
    assert sorted(p.name for p in ck.latest()[1].iterdir()) == ["COMPLETE", "digests.json", "other.bin"]


def test_failed_write_leaves_previous_checkpoint_latest(tmp_path):
    ck = CheckpointDir(tmp_path)
    ck.save(1, _write("a"))

    def broken(d):
        (d / "half").write_text("x")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        ck.save(2, broken)
    assert ck.latest()[0] == 1
    assert (tmp_path / "iter_0000002.partial").exists()  # left for inspection, never loaded
    ck.save(3, _write("b"))
    assert not (tmp_path / "iter_0000002.partial").exists()


def test_sigkill_during_save_never_yields_a_valid_looking_checkpoint(tmp_path):
    script = textwrap.dedent(f"""
        import os, signal
        from megatron_spo.run_layout import CheckpointDir
        ck = CheckpointDir({str(tmp_path)!r})
        ck.save(5, lambda d: (d / "w").write_text("ok"))
        def die(d):
            (d / "w").write_text("half")
            os.kill(os.getpid(), signal.SIGKILL)
        ck.save(6, die)
    """)
    proc = subprocess.run([sys.executable, "-c", script])
    assert proc.returncode == -signal.SIGKILL
    step, path = CheckpointDir(tmp_path).latest()
    assert step == 5 and (path / "w").read_text() == "ok"


def test_latest_pointer_to_incomplete_dir_falls_back(tmp_path):
    ck = CheckpointDir(tmp_path)
    ck.save(1, _write("a"))
    (tmp_path / "iter_0000009").mkdir()
    (tmp_path / "latest").write_text("iter_0000009")
    assert ck.latest()[0] == 1
    (tmp_path / "iter_0000001" / "COMPLETE").write_text("{broken")
    with pytest.raises(CheckpointError, match="unreadable checkpoint marker"):
        ck.metadata(tmp_path / "iter_0000001")
    with pytest.raises(CheckpointError, match="keep_last must be >= 1"):
        CheckpointDir(tmp_path, keep_last=0)


@pytest.mark.parametrize("sig", [signal.SIGUSR1, signal.SIGTERM])
def test_preemption_signal_is_recorded(sig):
    handler = PreemptionHandler()
    try:
        assert not handler.requested()
        os.kill(os.getpid(), sig)
        assert handler.requested() and handler.received == sig
    finally:
        handler.restore()
    assert signal.getsignal(sig) is not handler._on_signal


def test_metrics_file_is_json_lines(tmp_path):
    with MetricsLogger(tmp_path) as log:
        log.log(7, {"a": 1})
    line = (tmp_path / "metrics.jsonl").read_text().splitlines()[0]
    rec = json.loads(line)
    assert rec["step"] == 7 and rec["a"] == 1.0 and isinstance(rec["time"], float)


def test_online_source_gives_up_with_a_reason_when_no_rollouts_arrive():
    """A fleet that stopped answering ends the run after rollout.wait_timeout_s instead of hanging it."""
    from megatron_spo.net import free_port
    from megatron_spo.rollout.config import RolloutConfig
    from megatron_spo.rollout.manager import Prompt, RolloutManager
    from megatron_spo.training.online import OnlineSource

    async def reward(problem, text):
        return 0.0

    cfg = RolloutConfig(samples_per_prompt=2, max_retries=0, endpoint_cooldown_s=0.1, wait_timeout_s=1.5)
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    source = OnlineSource(RolloutManager(cfg, [Prompt("p0", [1, 2, 3])], reward, endpoints=[dead]), q0={})
    try:
        start = time.monotonic()
        with pytest.raises(RuntimeError, match=r"online source: no batch of 4 trajectories within 1.5 s "
                                               r"\(rollout.wait_timeout_s\); rollout counters: .*failed_requests [1-9]"):
            source.take(4)
        assert time.monotonic() - start < 10
    finally:
        source.close()


def test_step_metrics_are_assembled_from_the_step_parts():
    """The step's line: staleness and reward of online samples only, tokens/s over the step's time, kl only
    where online samples report their log-ratio, reference_step only with reference refresh."""
    from types import SimpleNamespace as T

    from megatron_spo.training.step_metrics import StepTimes, step_metrics

    trajs = [T(reward=0.0, source="online", policy_version=3, response_tokens=[1, 2, 3]),
             T(reward=-1.0, source="online", policy_version=5, response_tokens=[1]),
             T(reward=-1.0, source="offline", policy_version=0, response_tokens=[1, 2, 3, 4])]
    times = StepTimes(rollout_wait=0.5, forward_backward=1.0, weight_sync=0.25, step=2.0)
    m = step_metrics(trajs, loss={"loss": 0.5, "mean_seq_log_ratio/online": 0.125}, fleet={"rollout/groups": 4.0},
                     update={"grad_norm/extra": 1.0}, evaluation={}, times=times, lr=1e-5, grad_norm=2.0,
                     policy_version=6, pad_share=0.25, reference_step=None)
    assert m["reward"] == -2 / 3 and m["reward/online"] == -0.5 and m["samples/online"] == 2.0
    assert m["staleness"] == 2.0 and m["staleness/max"] == 3.0
    assert m["tokens_per_s"] == 4.0 and m["kl"] == 0.125 and m["batch/pad_share"] == 0.25
    assert m["time/weight_sync"] == 0.25 and m["rollout/groups"] == 4.0 and "reference_step" not in m
    offline = step_metrics(trajs[2:], loss={}, fleet={}, update={}, evaluation={"eval/pass@1": 0.5}, times=times,
                           lr=1e-5, grad_norm=0.0, policy_version=6, pad_share=0.0, reference_step=4)
    assert "staleness" not in offline and "kl" not in offline and offline["reference_step"] == 4.0
    assert offline["eval/pass@1"] == 0.5


def test_peak_rss_starts_over_where_the_trainer_starts():
    """The trainer's memory/peak_rss_gb is its own: a 300 MB peak from before (a quickstart's reference build in the
    same process) is forgotten once reset_peak_rss() runs, as Trainer.__init__ does first."""
    from megatron_spo.memory import peak_rss_gb, reset_peak_rss

    block = b"\x01" * (300 * 1024 * 1024)  # touched pages: resident
    del block
    before = peak_rss_gb()
    assert reset_peak_rss()
    assert peak_rss_gb() < before - 0.25
