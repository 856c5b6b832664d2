"""checkpoint.async_save (issue 65): shards written by a thread while the next steps train. The run trains exactly as
with synchronous saves, its background checkpoint holds the step it was taken at (a run resumed from it ends on the
straight run's weights), the staged copy owns its memory, and a failed writer fails every rank with the reason and
leaves the previous checkpoint `latest`; a preemption while a save is written completes it first."""

import json
import shutil

import pytest
import torch
from trainer_helpers import make_tiny_hf, run_spawned, trainer_config

from megatron_spo.run_layout import CheckpointDir

pytestmark = [pytest.mark.megatron, pytest.mark.multiproc]


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    return make_tiny_hf(str(tmp_path_factory.mktemp("async-ckpt") / "hf"))


def _metrics(root, name) -> list[dict]:
    return [json.loads(x) for x in (root / name / "metrics.jsonl").read_text().splitlines()]


def test_a_run_saving_in_the_background_trains_as_one_saving_in_line_and_resumes_from_it(tmp_path, hf):
    def cfg(name, async_save, keep_last=2, **kw):
        return trainer_config(tmp_path, hf, name, tp=2, steps=6, **kw, checkpoint={
            "interval": 2, "async_save": async_save, "keep_last": keep_last}), str(tmp_path / f"{name}.pt")

    run_spawned([cfg("inline", False), cfg("background", True, keep_last=3)], 2)
    inline, background = _metrics(tmp_path, "inline"), _metrics(tmp_path, "background")
    for a, b in zip(inline, background, strict=True):
        assert (a["loss"], a["grad_norm"]) == (b["loss"], b["grad_norm"]), a["step"]
    straight = torch.load(tmp_path / "inline.pt")
    assert all(torch.equal(w, straight[k]) for k, w in torch.load(tmp_path / "background.pt").items())
    # steps 2 and 4 saved in the background: each completed at a later step (the next one unless its writer is
    # slower than a step), or by the next save; step 6 (the last) in line before the run exits
    done = {m["step"]: m for m in background if "checkpoint/background_s" in m}
    assert set(done) <= {3, 4, 5} and all(m["checkpoint/background_s"] >= m["checkpoint/blocked_s"] > 0
                                          for m in done.values()), done
    assert [m["step"] for m in inline if "checkpoint/blocked_s" in m] == [3, 5]
    ckpts = CheckpointDir(tmp_path / "background" / "checkpoints")
    assert ckpts.complete_steps() == [2, 4, 6] and ckpts.latest()[0] == 6
    assert not list(ckpts.root.glob("*.partial"))

    # a run resumed from the background checkpoint of step 4 (its COMPLETE marker, manifest and shards) ends equal
    resumed = tmp_path / "resumed-ckpts"
    shutil.copytree(ckpts.root / "iter_0000004", resumed / "iter_0000004")
    (resumed / "latest").write_text("iter_0000004")
    name = "resumed"
    data, out = trainer_config(tmp_path, hf, name, tp=2, steps=6, checkpoint={
        "interval": 2, "dir": str(resumed), "allow_config_change": True}), str(tmp_path / f"{name}.pt")
    run_spawned([(data, out)], 2)
    assert [m["step"] for m in _metrics(tmp_path, name)] == [5, 6]
    assert [m["loss"] for m in _metrics(tmp_path, name)] == [m["loss"] for m in inline[4:]]
    assert all(torch.equal(w, straight[k]) for k, w in torch.load(out).items())


def test_the_staged_copy_owns_its_memory():
    """megatron's preload is tensor.to("cpu"), the tensor itself on the CPU: the writer would see the next step's
    in-place update. The staged copy does not."""
    from megatron_spo.models.async_save import _stage

    weight, moments = torch.arange(6.0), torch.ones(2, 3)
    view = moments[1]  # a view into a larger tensor: copied as its own 3 elements
    buckets = [("f0", "k0", ([], [("w", weight), ("m", view)]))]
    [(file_name, key, (raw, staged))], nbytes = _stage(buckets)
    weight.add_(1.0)
    moments.mul_(5.0)
    assert (file_name, key, raw) == ("f0", "k0", [])
    assert torch.equal(staged[0][1], torch.arange(6.0)) and torch.equal(staged[1][1], torch.ones(3))
    assert staged[1][1].untyped_storage().nbytes() == 3 * 4 and nbytes == (6 + 3) * 4


def _train_with_a_failing_writer(cfg_data: dict) -> None:
    """One rank: rank 1's shard writer fails on the step-4 save (its bucket's file cannot be opened)."""
    import torch.distributed as dist
    from trainer_helpers import DeterministicSource

    from megatron_spo.models import async_save
    from megatron_spo.training.config import TrainConfig
    from megatron_spo.training.trainer import Trainer

    stage = async_save._stage

    def failing_stage(buckets):
        staged, nbytes = stage(buckets)
        if dist.get_rank() == 1 and "iter_0000004" in staged[0][0]:
            staged = [("/nonexistent-dir/shard.distcp", *staged[0][1:])] + staged[1:]
        return staged, nbytes

    async_save._stage = failing_stage
    trainer = Trainer(TrainConfig.model_validate(cfg_data), online_source=DeterministicSource())
    try:
        with pytest.raises(RuntimeError) as err:
            trainer.train()
        with open(f"{cfg_data['run_dir']}-rank{dist.get_rank()}.err", "w") as f:
            f.write(f"{type(err.value).__name__}: {err.value}")
    finally:
        trainer.close()


def test_a_failed_background_write_fails_every_rank_and_keeps_the_previous_checkpoint_latest(tmp_path, hf):
    from megatron_spo.models.parallel import spawn_local

    data = trainer_config(tmp_path, hf, "failing", tp=2, steps=6, checkpoint={"interval": 2, "async_save": True})
    spawn_local(_train_with_a_failing_writer, 2, data)
    errors = {(tmp_path / f"failing-rank{r}.err").read_text() for r in (0, 1)}
    partial = tmp_path / "failing" / "checkpoints" / "iter_0000004.partial"
    last = tmp_path / "failing" / "checkpoints" / "iter_0000002"
    assert errors == {f"CheckpointError: checkpoint: writing {partial} in the background failed on rank 1 "
                      "(FileNotFoundError: [Errno 2] No such file or directory: '/nonexistent-dir/shard.distcp'); "
                      f"the last complete checkpoint is step 2 ({last})"}, errors
    ckpts = CheckpointDir(tmp_path / "failing" / "checkpoints")
    assert ckpts.complete_steps() == [2] and ckpts.latest()[0] == 2
    # found at step 5 (or at the next save, when the writer fails slower than a step): the run stops there
    assert [m["step"] for m in _metrics(tmp_path, "failing")] in ([1, 2, 3, 4], [1, 2, 3, 4, 5], [1, 2, 3, 4, 5, 6])


def _train_preempted_while_a_save_is_written(cfg_data: dict, out_file: str) -> None:
    """One rank: the step-2 background save's writer is held until the checkpoint is completed (async_save.finish),
    so it is in flight when SIGTERM reaches rank 0 during step 3; rank 0 writes what it saw and printed."""
    import contextlib
    import io
    import os
    import signal
    import threading

    import torch.distributed as dist
    from trainer_helpers import DeterministicSource

    from megatron_spo.models import async_save
    from megatron_spo.models.hf_map import iter_hf_tensors
    from megatron_spo.training.config import TrainConfig
    from megatron_spo.training.trainer import Trainer

    release, write, finish = threading.Event(), async_save._write, async_save.finish

    def held_write(transforms, buckets, results_queue, pending):
        if "iter_0000002" in buckets[0][0]:
            release.wait(timeout=120)
        write(transforms, buckets, results_queue, pending)

    def releasing_finish(pending, ckpt_dir):
        release.set()
        finish(pending, ckpt_dir)

    async_save._write, async_save.finish = held_write, releasing_finish
    trainer = Trainer(TrainConfig.model_validate(cfg_data), online_source=DeterministicSource())
    seen, train_step = {}, trainer.train_step

    def signalled_step():
        if trainer.step == 2:
            seen["in_flight"] = trainer.pending_save is not None and trainer.pending_save.step == 2
            if dist.get_rank() == 0:
                os.kill(os.getpid(), signal.SIGTERM)  # rank 1 learns it from the step's agreement
        return train_step()

    trainer.train_step = signalled_step
    printed = io.StringIO()
    try:
        with contextlib.redirect_stdout(printed):
            seen["last_step"] = trainer.train()
        weights = {name: t.clone() for name, t in iter_hf_tensors(trainer.policy, trainer.model_cfg)}
        seen["pending_after"] = trainer.pending_save is not None
        if dist.get_rank() == 0:
            torch.save({"weights": weights, "seen": seen, "printed": printed.getvalue()}, out_file)
    finally:
        trainer.close()


def test_sigterm_while_a_background_save_is_written_completes_it_then_saves_the_step_and_both_resume(tmp_path, hf):
    """A preemption while a background checkpoint is still being written: the run stops at the end of that step,
    the checkpoint in flight is completed first (its shards hold the step it was taken at, though the weights moved
    on under the held writer), then the step is saved in line; a run resumed from either ends on the straight run's
    weights."""
    from megatron_spo.models.parallel import spawn_local

    def cfg(name, **checkpoint):
        return trainer_config(tmp_path, hf, name, tp=2, steps=6, checkpoint={"interval": 2, **checkpoint})

    out = str(tmp_path / "preempted.pt")
    spawn_local(_train_preempted_while_a_save_is_written, 2, cfg("preempted", async_save=True), out)
    got = torch.load(out)
    assert got["seen"] == {"in_flight": True, "last_step": 3, "pending_after": False}, got["seen"]
    ckpts = CheckpointDir(tmp_path / "preempted" / "checkpoints")
    assert ckpts.complete_steps() == [2, 3] and ckpts.latest()[0] == 3 and not list(ckpts.root.glob("*.partial"))
    lines = [x for x in got["printed"].splitlines() if x.startswith("[megatron-spo]") and "library warning" not in x]
    assert lines[0].startswith(f"[megatron-spo] checkpoint at step 2 complete: {ckpts.root / 'iter_0000002'} ("), lines
    assert lines[1:] == ["[megatron-spo] preempted: checkpoint at step 3 saved, exiting"], lines
    assert [m["step"] for m in _metrics(tmp_path, "preempted")] == [1, 2, 3]

    runs = [(cfg("straight"), str(tmp_path / "straight.pt"))]
    for step in (2, 3):
        resumed = tmp_path / f"from-{step}-ckpts"
        shutil.copytree(ckpts.root / f"iter_000000{step}", resumed / f"iter_000000{step}")
        (resumed / "latest").write_text(f"iter_000000{step}")
        runs.append((cfg(f"from-{step}", dir=str(resumed), allow_config_change=True), str(tmp_path / f"from-{step}.pt")))
    run_spawned(runs, 2)
    straight = torch.load(runs[0][1])
    assert [m["loss"] for m in _metrics(tmp_path, "preempted")] == [m["loss"] for m in _metrics(tmp_path, "straight")][:3]
    for step in (2, 3):
        assert [m["step"] for m in _metrics(tmp_path, f"from-{step}")] == list(range(step + 1, 7))
        assert all(torch.equal(w, straight[k]) for k, w in torch.load(tmp_path / f"from-{step}.pt").items()), step
