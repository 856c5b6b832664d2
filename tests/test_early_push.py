"""An engine that answers without the fleet's weights between two scheduled pushes (restarted, or a push missed it)
brings the next push forward to that step (issue 65): a full push of the current weights as a new version, at most
one per model_update_interval steps, counted in weight_sync/early_pushes; the schedule and the run's last push stay."""

import json

import pytest
from trainer_helpers import DeterministicSource, make_tiny_hf, trainer_config

pytestmark = [pytest.mark.megatron, pytest.mark.multiproc]


class BehindAtSource(DeterministicSource):
    """An online source whose engine 'http://e1' answers without the fleet's weights at the steps ``behind``; its
    pushes (step, version, tensors) and the steps it was asked at are recorded."""

    def __init__(self, trainer_step, behind: set[int]):
        super().__init__()
        self.trainer_step, self.behind, self.pushes, self.asked = trainer_step, behind, [], []
        self.last_sync_error = None

    def engines_needing_weights(self) -> list[str]:
        step = self.trainer_step()
        self.asked.append(step)
        return ["http://e1"] if step in self.behind else []

    def stats(self) -> dict:  # the fleet's metrics: none here, so the step's push metrics are logged alone
        return {}

    def push_weights(self, version: int, named_tensors) -> dict:
        n = sum(1 for _ in named_tensors)
        self.pushes.append((self.trainer_step(), version, n))
        return {"weight_sync/failed": 0.0, "weight_sync/engines_updated": 2.0}


def train_with_an_engine_behind(cfg_data: dict, behind: list[int], out_file: str) -> None:
    from megatron_spo.training.config import TrainConfig
    from megatron_spo.training.trainer import Trainer

    holder = {}
    source = BehindAtSource(lambda: holder["trainer"].step, set(behind))
    trainer = holder["trainer"] = Trainer(TrainConfig.model_validate(cfg_data), online_source=source)
    try:
        trainer.train()
    finally:
        trainer.close()
    if trainer.rank == 0:
        with open(out_file, "w") as f:
            json.dump({"pushes": source.pushes, "asked": source.asked, "version": trainer.policy_version}, f)


@pytest.mark.parametrize("world", [1, 2])
def test_an_engine_behind_between_pushes_brings_the_next_push_forward_once_an_interval(tmp_path, world):
    from megatron_spo.models.parallel import spawn_local

    hf = make_tiny_hf(str(tmp_path / "hf"))
    cfg = trainer_config(tmp_path, hf, "run", tp=world, steps=8, model_update_interval=3)
    # behind at step 1 (pushed early), at 2 and 3 (within the interval of that push: not again; 3 is scheduled),
    # at 5 (pushed early), never after
    spawn_local(train_with_an_engine_behind, world, cfg, [1, 2, 3, 5], str(tmp_path / "out.json"))
    out = json.loads((tmp_path / "out.json").read_text())
    params = out["pushes"][0][2]
    assert out["pushes"] == [[1, 1, params], [3, 2, params], [5, 3, params], [6, 4, params], [8, 5, params]]
    assert out["asked"] == [1, 4, 5, 8]  # not at 2, 6, 7 (within an interval of an early push), 3 (scheduled)
    assert out["version"] == 5
    metrics = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [m.get("weight_sync/early_pushes") for m in metrics] == [1.0, None, 1.0, None, 2.0, 2.0, None, None]


def test_the_probe_for_engines_behind_never_holds_a_step_and_a_push_overtaking_it_drops_it():
    """OnlineSource.engines_needing_weights: each call returns the last finished probe's answer at once (a hung
    engine's 10 s probe timeout would otherwise hold the step) and starts the next; one a push overtook is dropped."""
    import threading

    from megatron_spo.training.online import OnlineSource

    release, calls = threading.Event(), []

    class Sender:
        def needs_weights(self):
            calls.append(1)
            assert release.wait(30)
            return ["http://e1"]

    source = object.__new__(OnlineSource)  # only the probe's state: no rollout manager, no loop
    source._on_close, source.broadcaster = [], Sender()
    assert source.engines_needing_weights() == []  # the first probe started, still waiting on the engine
    assert source.engines_needing_weights() == [] and len(calls) == 1  # not done: not asked again
    release.set()
    source._behind_probe[1].result(timeout=30)
    assert source.engines_needing_weights() == ["http://e1"]  # its answer, and the next probe started
    source._behind_probe[1].result(timeout=30)
    source._pushes += 1  # a push (push_weights) after that probe started: what it found may be stale
    assert source.engines_needing_weights() == []
    assert source._behind_probe[1].result(timeout=30) == ["http://e1"] and len(calls) == 3  # the next one's
    for close in source._on_close:
        close()
