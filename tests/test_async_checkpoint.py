"""checkpoint.async_save (issue 65): shards written by a thread while the next steps train. The run trains exactly as
with synchronous saves, its background checkpoint holds the step it was taken at (a run resumed from it ends on the
straight run's weights), the staged copy owns its memory, and a failed writer fails every rank with the reason and
leaves the previous checkpoint `latest`."""

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
