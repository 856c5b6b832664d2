"""Extension points: a custom reward, a custom SPO loss and a custom algorithm named in the config as hooks
('package.module:name'), each loaded at start-up, each trained with for two steps; wrong hooks are refused in
one line naming the field; config choices come from the registries."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from trainer_helpers import make_tiny_hf, run_spawned, toy_q0_file  # noqa: E402

from megatron_spo.config import ConfigError  # noqa: E402
from megatron_spo.training.config import TrainConfig  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
pytestmark = [pytest.mark.multiproc]


def _cfg(tmp_path: Path, hf: str, name: str, **kw) -> dict:
    cfg = dict(run_dir=str(tmp_path / name), steps=2, beta=0.5, init={"hf": hf},
               optimizer={"lr": 1e-3, "warmup_steps": 2},
               batch={"sequences_per_step": 8, "max_tokens_per_micro_batch": 48, "max_seq_length": 64},
               model_update_interval=1, checkpoint={"interval": 100, "export_hf": False}, logging={"progress": False})
    cfg.update(kw)
    return cfg


def test_registries_are_the_config_choices():
    from megatron_spo.algorithms.spo import LOSSES, REGRESSION_LOSSES
    from megatron_spo.data.tasks import TASK_KINDS
    from megatron_spo.training.algos import names

    assert names() == ["agro", "grpo", "ppo", "spo"]
    assert LOSSES == tuple(REGRESSION_LOSSES) == ("squared", "cross_entropy", "sigmoid_bce")
    assert list(TASK_KINDS) == ["toy", "toy_math", "codecontests", "taco", "math", "jsonl", "humaneval", "mbpp",
                                "verl", "slime", "trl", "hf"]
    base = dict(init={"hf": "x"})
    with pytest.raises(ValueError, match=r"algo\n.*unknown algorithm 'trpo' \(choose from agro, grpo, ppo, spo, or a hook"):
        TrainConfig.model_validate({**base, "algo": "trpo"})
    with pytest.raises(ValueError, match=r"unknown loss 'huber' \(choose from squared, cross_entropy, sigmoid_bce, "
                                         r"or a hook 'package.module:function'\)"):
        TrainConfig.model_validate({**base, "sources": {"online": {"loss": "huber"}}})
    with pytest.raises(ValueError, match=r"unknown task kind 'gsm8k' \(choose from toy, toy_math, codecontests, taco, math, jsonl"):
        TrainConfig.model_validate({**base, "task": {"kind": "gsm8k"}})


@pytest.mark.parametrize("path, message", [
    ("examples.nope:f", "sources.online.loss: cannot import 'examples.nope' (ModuleNotFoundError: No module named "
                        "'examples.nope')"),
    ("examples.custom_loss:hubr", "sources.online.loss: module 'examples.custom_loss' has no attribute 'hubr'"),
    ("examples.custom_loss:torch", "sources.online.loss: 'examples.custom_loss:torch' is not callable"),
])
def test_a_wrong_hook_is_refused_naming_the_field(path, message, monkeypatch):
    from megatron_spo.training.trainer import make_algorithm

    monkeypatch.chdir(REPO)
    cfg = TrainConfig.model_validate(dict(init={"hf": "x"}, sources={"online": {"loss": path}}))
    with pytest.raises(ConfigError) as info:
        make_algorithm(cfg)
    assert str(info.value) == message


def test_custom_loss_and_custom_algorithm_train_two_steps(tmp_path, monkeypatch):
    """The hooked Huber loss trains, and differs from the built-in squared loss; a hooked algorithm class
    (here SPO with the reference log-probs halved: a visible change) drives the same trainer."""
    monkeypatch.chdir(REPO)
    hf = make_tiny_hf(str(tmp_path / "hf"))
    runs = [(_cfg(tmp_path, hf, "huber", sources={"online": {"loss": "examples.custom_loss:huber"}}),
             str(tmp_path / "huber.pt")),
            (_cfg(tmp_path, hf, "squared", sources={"online": {"loss": "squared"}}), str(tmp_path / "squared.pt")),
            (_cfg(tmp_path, hf, "hooked", algo="extension_helpers:LoudSPO"), str(tmp_path / "hooked.pt"))]
    monkeypatch.setenv("PYTHONPATH", str(REPO / "tests") + os.pathsep + os.environ.get("PYTHONPATH", ""))
    run_spawned(runs, 1)
    metrics = {n: [json.loads(x) for x in (tmp_path / n / "metrics.jsonl").read_text().splitlines()]
               for n in ("huber", "squared", "hooked")}
    assert all([m["step"] for m in ms] == [1, 2] for ms in metrics.values())
    # same data, same first forward: the Huber loss (delta 0.5) is below the squared loss where |error| > 0.5
    assert metrics["huber"][0]["loss"] < metrics["squared"][0]["loss"]
    assert metrics["hooked"][0]["loud_spo"] == 1.0  # the hooked class ran (its own metric)
    a, b = torch.load(tmp_path / "huber.pt"), torch.load(tmp_path / "squared.pt")
    assert any(not torch.equal(a[k], b[k]) for k in a)


def test_custom_reward_scores_the_online_rollouts(tmp_path, monkeypatch):
    """A real engine, the toy task's prompts and examples/custom_reward.py as task.reward: every online
    trajectory's reward is the hook's value (-1 or in [-0.5, 0]), two steps train, and no sandbox is started
    for it (the toy task's own code reward needs one)."""
    import rollout_helpers as rh

    from examples.custom_reward import fenced_code  # exact values of the example itself

    assert fenced_code(None, "```python\nprint(1)\n```") == -0.5 * 9 / 400
    assert fenced_code(None, "print(1)") == -1.0 and fenced_code(None, "```\na\n``` ```\nb\n```") == -1.0

    monkeypatch.chdir(REPO)
    from megatron_spo.models.parallel import spawn_local

    model = rh.make_tiny_llama(str(tmp_path / "engine_model"))
    with rh.serving_engine(model) as url:
        cfg = _cfg(tmp_path, model, "reward", batch={"sequences_per_step": 4, "max_tokens_per_micro_batch": 1024,
                                                      "max_seq_length": 512},
                   task={"kind": "toy", "reward": "examples.custom_reward:fenced_code", "limit": 4,
                         "max_prompt_tokens": 400, "q0_path": toy_q0_file(tmp_path, limit=4)},
                   fleet={"engine_urls": [url]},
                   rollout={"samples_per_prompt": 2, "max_new_tokens": 8, "buffer_groups": 4,
                            "max_inflight_requests": 2})
        spawn_local(_train_and_record, 1, cfg, str(tmp_path / "rewards.json"))
    seen = json.loads((tmp_path / "rewards.json").read_text())
    assert seen["sandbox"] is None and "RewardPool" in seen["closers"]  # the toy task's code reward would start one
    assert len(seen["rewards"]) == 8 and all(r == -1.0 or -0.5 <= r <= 0.0 for r in seen["rewards"])
    metrics = [json.loads(x) for x in (tmp_path / "reward" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2]


def _train_and_record(cfg_data: dict, out: str) -> None:
    from megatron_spo.training.trainer import Trainer

    trainer = Trainer(TrainConfig.model_validate(cfg_data))
    rewards = []
    take = trainer.online.take

    def recording_take(k, timeout_s=None):
        batch = take(k, timeout_s)
        rewards.extend(t.reward for t in batch)
        return batch

    trainer.online.take = recording_take
    trainer.sampler.sources["online"].take = recording_take
    try:
        trainer.train()
        owners = [type(getattr(c, "__self__", None)).__name__ for c in trainer.online._on_close]
        Path(out).write_text(json.dumps({"rewards": rewards, "sandbox": "SandboxPool" if "SandboxPool" in owners
                                         else None, "closers": owners}))
    finally:
        trainer.close()
