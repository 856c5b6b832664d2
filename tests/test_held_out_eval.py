"""Held-out pass@k during training (config section ``eval``, training/held_out_eval.py): its config errors,
and a run on a real local engine that logs eval/pass@K exactly at the eval steps, equal to what
engine_tools/eval.py computes on the engine's final weights."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from megatron_spo.config import ConfigError, build_config  # noqa: E402
from megatron_spo.training.config import TrainConfig  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
TOY_MATH = {"kind": "toy_math", "toy": {"kind": "toy_math", "num_problems": 12, "heldout_fraction": 0.5,
                                        "num_sft_problems": 0}}


def parity_reward(problem, completion: str) -> float:
    """Passes (0.0) when the completion's character codes sum to an even number, else -1: a deterministic
    mix of passes and failures for a random model's greedy answers."""
    return 0.0 if sum(map(ord, completion)) % 2 == 0 else -1.0


@pytest.mark.parametrize("section, top, message", [
    ({"n": 2, "ks": [1, 4]}, {}, r"^eval.ks: each k must lie in \[1, n = 2\] \(samples per problem\), "
                                 r"got \[4\]"),
    ({"interval": -1}, {}, r"^eval.interval: Input should be greater than or equal to 0 \(got -1\)$"),
    ({"interval": 3}, {"model_update_interval": 2},
     r"^eval.interval: 3 is not a multiple of model_update_interval 2 \(the engines hold"),
    ({"interval": 10}, {"task": {"kind": "jsonl", "paths": ["x.jsonl"]}},
     r"^eval.paths: task kind 'jsonl' has no held-out split; give held-out problem files$"),
])
def test_eval_config_errors_name_the_field(section, top, message):
    with pytest.raises(ConfigError, match=message):
        build_config(TrainConfig, {"init": {"hf": "x"}, "eval": section, **top})



def test_eval_config_defaults_off_and_reads_the_held_out_split():
    from megatron_spo.data import tasks
    from megatron_spo.training.held_out_eval import HeldOutEval, held_out_problems

    off = build_config(TrainConfig, {"init": {"hf": "x"}})
    assert off.eval.interval == 0 and HeldOutEval.from_config(off) is None
    cfg = build_config(TrainConfig, {"init": {"hf": "x"}, "task": TOY_MATH, "eval": {"interval": 10, "limit": 4}})
    heldout = tasks.generated_task("toy_math", cfg.task.toy).heldout
    assert [p.id for p in held_out_problems(cfg)] == [p.id for p in heldout[:4]]
    assert {p.id for p in heldout} & {p.id for p in tasks.generated_task("toy_math", cfg.task.toy).train} == set()
    with pytest.raises(ConfigError, match=r"^eval.interval: held-out evaluation runs through the engines; set "):
        HeldOutEval.from_config(cfg)


def test_a_held_out_decline_past_warn_drop_below_the_best_is_one_warning_naming_the_step_to_keep():
    from megatron_spo.training.held_out_eval import HeldOutEval

    cfg = build_config(TrainConfig, {"init": {"hf": "x"}, "eval": {"ks": [1, 4], "n": 4}})
    assert cfg.eval.warn_drop == 0.1
    watch = HeldOutEval(cfg, [], None, "", [])
    said = [watch.decline_warning(step, {"eval/pass@1": p, "eval/pass@4": 0.9})
            for step, p in ((90, 0.46), (180, 0.50), (270, 0.41), (360, 0.39))]
    assert said[:3] == [None, None, None]  # 0.09 below the best is within warn_drop
    assert said[3] == ("[megatron-spo] warning: step 360: held-out pass@1 0.390 is 0.110 below its best 0.500 "
                       "(step 180; eval.warn_drop 0.1): the policy has been decaying since then "
                       "(docs/spo-stability.md, 'What to watch')")
    quiet = HeldOutEval(build_config(TrainConfig, {"init": {"hf": "x"}, "eval": {"warn_drop": None}}), [], None, "", [])
    assert [quiet.decline_warning(s, {"eval/pass@1": p}) for s, p in ((1, 0.9), (2, 0.1))] == [None, None]



def test_the_trainer_prints_the_decline_warning_after_its_held_out_eval_and_survives_a_failed_one(capsys):
    """Trainer._evaluate_held_out with the engines' evaluation replaced by known scores: the decline warning is
    printed after the evaluation that falls past warn_drop, a failed evaluation is one warning line and no metrics."""
    from types import SimpleNamespace

    from megatron_spo.rollout.client import EngineError
    from megatron_spo.training.held_out_eval import HeldOutEval
    from megatron_spo.training.trainer import Trainer

    watch = HeldOutEval(build_config(TrainConfig, {"init": {"hf": "x"}}), [], None, "", [])
    scores = iter([{"eval/pass@1": 0.5}, EngineError("http://engine:1", "connection refused"), {"eval/pass@1": 0.35}])

    def run():
        score = next(scores)
        if isinstance(score, Exception):
            raise score
        return score

    watch.run = run
    trainer = SimpleNamespace(held_out=watch, step=0, online=None)  # no online source: the base weights
    said = []
    for step in (90, 180, 270):
        trainer.step = step
        said.append((Trainer._evaluate_held_out(trainer), capsys.readouterr().out))
    assert said == [({"eval/pass@1": 0.5}, ""),
                    ({}, "[megatron-spo] warning: held-out eval at step 180 failed: EngineError: http://engine:1: connection refused\n"),
                    ({"eval/pass@1": 0.35}, "[megatron-spo] warning: step 270: held-out pass@1 0.350 is 0.150 below "
                     "its best 0.500 (step 90; eval.warn_drop 0.1): the policy has been decaying since then "
                     "(docs/spo-stability.md, 'What to watch')\n")]

def _train(cfg_data: dict) -> None:
    from megatron_spo.training.trainer import Trainer

    trainer = Trainer(TrainConfig.model_validate(cfg_data))
    try:
        trainer.train()
    finally:
        trainer.close()


@pytest.mark.multiproc
def test_training_logs_held_out_pass_at_k_at_the_eval_steps(tmp_path, monkeypatch):
    """Two ranks, a push every step, eval.interval 2 over 4 steps: eval/pass@1 and @2 at steps 2 and 4 only
    (rank 1 waits for rank 0's evaluation at the metrics gather). Greedy samples make the last one exact: the
    same evaluation of engine_tools/eval.py on the engine after training (it holds step 4's weights) gives it."""
    import rollout_helpers as rh
    from test_extensions import _cfg

    from megatron_spo.engine_tools.eval import evaluate
    from megatron_spo.models.parallel import spawn_local
    from megatron_spo.rollout.client import EngineClient
    from megatron_spo.training.held_out_eval import HeldOutEval

    monkeypatch.chdir(REPO)
    monkeypatch.setenv("PYTHONPATH", str(REPO / "tests") + os.pathsep + os.environ.get("PYTHONPATH", ""))
    model = rh.make_tiny_llama(str(tmp_path / "engine_model"))
    with rh.serving_engine(model) as url:
        cfg = _cfg(tmp_path, model, "eval", steps=4, algo="agro",
                   batch={"sequences_per_step": 4, "max_tokens_per_micro_batch": 1024, "max_seq_length": 256},
                   task={**TOY_MATH, "reward": "test_held_out_eval:parity_reward", "max_prompt_tokens": 240},
                   fleet={"engine_urls": [url]},
                   rollout={"samples_per_prompt": 2, "max_new_tokens": 8, "buffer_groups": 4,
                            "max_inflight_requests": 2},
                   eval={"interval": 2, "n": 2, "ks": [1, 2], "temperature": 0.0, "limit": 6})
        spawn_local(_train, 2, cfg)
        held_out = HeldOutEval.from_config(TrainConfig.model_validate(cfg))

        async def again():
            async with EngineClient(url) as client:
                return await evaluate(held_out.prompts, client, held_out.reward_pool, n=2, temperature=0.0,
                                      top_p=0.95, ks=(1, 2), sampling=held_out.sampling())

        try:
            expected = asyncio.run(again())
        finally:
            held_out.close()
    metrics = [json.loads(x) for x in (tmp_path / "eval" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2, 3, 4]
    assert [m["step"] for m in metrics if "eval/pass@1" in m] == [2, 4]
    for m in metrics[1::2]:
        assert m["eval/problems"] == 6.0 and m["time/eval"] > 0
        assert 0.0 <= m["eval/pass@1"] <= m["eval/pass@2"] <= 1.0
        assert m["eval/pass@1"] == m["eval/pass@2"]  # greedy: both samples of a problem are one answer
    assert len(expected.problems) == 6
    assert metrics[3]["eval/pass@1"] == pytest.approx(expected.mean[1], abs=1e-12)
    assert metrics[3]["eval/pass@2"] == pytest.approx(expected.mean[2], abs=1e-12)


def test_the_quickstart_passes_train_eval_interval_to_the_trainer(tmp_path):
    """`megatron-spo quickstart train.eval_interval=20 heldout_limit=30`: the trainer evaluates the quickstart's
    own held-out problems (the toy task's held-out split, first 30) with its eval settings; default off."""
    from megatron_spo.config import apply_overrides
    from megatron_spo.experiments.quickstart import QuickstartConfig, train_config

    endpoints = type("E", (), {"router_url": "http://127.0.0.1:1", "engine_urls": ["http://127.0.0.1:2"]})()

    def trainer_cfg(*overrides):
        cfg = build_config(QuickstartConfig, apply_overrides({}, list(overrides)), "quickstart")
        return train_config(cfg, tmp_path, tmp_path / "ref", tmp_path / "init", endpoints, tmp_path / "q0.jsonl", None)

    assert trainer_cfg().eval.interval == 0
    ev = trainer_cfg("train.eval_interval=20", "heldout_limit=30", "eval_n=12").eval
    assert (ev.interval, ev.n, ev.ks, ev.temperature, ev.top_p, ev.limit, ev.paths) == (20, 12, (1, 10), 0.4, 0.95, 30,
                                                                                       [])
    # the quickstart's tables report pass@10: fewer samples are refused when the config is read, not after the
    # reference, its Q0 and the fleet are built (eval_n=4 did fail there, in the evaluation's ks check)
    with pytest.raises(ConfigError, match=r"eval_n: Input should be greater than or equal to 10"):
        build_config(QuickstartConfig, {"eval_n": 4}, "quickstart")
    # refused when the quickstart's config is read (it validates the trainer config it will make), not at step 6
    # of 6 after the reference, Q0 and the fleet are built
    with pytest.raises(ConfigError, match=r"^quickstart: the trainer would refuse this run .*: eval.interval: 15 is "
                       r"not a multiple of model_update_interval 10 "):
        build_config(QuickstartConfig, apply_overrides({}, ["train.eval_interval=15"]), "quickstart")
