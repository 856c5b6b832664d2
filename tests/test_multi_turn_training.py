"""Multi-turn trajectories through the trainer (issue 63): a response of model turns with the environment's tokens
between them (response_mask 0: context, not trained). Every algorithm trains over the model's tokens only, alike in
one process and at CP 2 on packed micro-batches (a turn boundary may fall inside a CP chunk), and the mask changes
what is trained (the same tokens all trained give another update)."""

import json
import random

import pytest
import torch
from trainer_helpers import VOCAB, Traj, make_tiny_hf, trainer_config

from megatron_spo.data.trajectory import model_tokens, model_turns

pytestmark = [pytest.mark.multiproc]


def multi_turn(seed: int, k: int, drawn: int, masked: bool = True) -> list:
    """Groups of 4: prompt, model turn, an observation of 2-4 environment tokens, a second model turn; behaviour
    log-probs -4 on model tokens, 0 on the environment's."""
    rng = random.Random(seed * 1000 + drawn)
    out = []
    for i in range(k):
        prompt = [rng.randrange(1, VOCAB) for _ in range(4)]
        first, obs, second = ([rng.randrange(1, VOCAB) for _ in range(rng.randrange(a, b))]
                              for a, b in ((2, 5), (2, 5), (2, 6)))
        mask = [1] * len(first) + [0] * len(obs) + [1] * len(second)
        t = Traj(f"p{(drawn + i) // 4}", prompt, first + obs + second, reward=-float(second[-1] % 2),
                 behaviour_logprobs=[-4.0 if m else 0.0 for m in mask])
        t.response_mask, t.turn_versions = (mask, [0, 0]) if masked else (None, None)
        out.append(t)
    return out


class MultiTurnSource:
    def __init__(self, masked: bool = True):
        self.drawn, self.masked = 0, masked

    def take(self, k: int, timeout_s: float | None = None) -> list:
        out = multi_turn(0, k, self.drawn, self.masked)
        self.drawn += k
        return out

    def state_dict(self) -> dict:
        return {"drawn": self.drawn}

    def load_state_dict(self, state: dict) -> None:
        self.drawn = state["drawn"]


def train_multi_turn(runs: list) -> None:
    """One rank: each (config, out_file, masked) trains on MultiTurnSource; rank 0 saves the HF-named weights."""
    from megatron_spo.models.hf_map import iter_hf_tensors
    from megatron_spo.training.config import TrainConfig
    from megatron_spo.training.trainer import Trainer

    for i, (cfg_data, out_file, masked) in enumerate(runs):
        trainer = Trainer(TrainConfig.model_validate(cfg_data), online_source=MultiTurnSource(masked))
        try:
            trainer.train()
            weights = {name: t.clone() for name, t in iter_hf_tensors(trainer.policy, trainer.model_cfg)}
            if trainer.rank == 0:
                torch.save(weights, out_file)
        finally:
            trainer.close(keep_process_group=i < len(runs) - 1)


ALGOS = {"spo": 2, "grpo": 1, "ppo": 1}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    from megatron_spo.models.parallel import spawn_local

    root = tmp_path_factory.mktemp("multi-turn")
    hf = make_tiny_hf(str(root / "hf"))

    def run(name, algo, cp=1, masked=True):
        cfg = trainer_config(root, hf, name, algo, steps=ALGOS[algo])
        cfg["parallel"] = dict(cfg["parallel"], context_parallel_size=cp)
        return cfg, str(root / f"{name}.pt"), masked

    spawn_local(train_multi_turn, 1, [run(f"single-{a}", a) for a in ALGOS] + [run("unmasked-spo", "spo",
                                                                                   masked=False)])
    spawn_local(train_multi_turn, 2, [run(f"cp2-{a}", a, cp=2) for a in ALGOS])
    return root


def _metrics(root, name):
    return [json.loads(line) for line in (root / name / "metrics.jsonl").read_text().splitlines()]


def test_the_mask_and_its_turns():
    [t] = multi_turn(0, 1, 0)
    assert len(model_turns(t.response_mask)) == 2 == len(t.turn_versions)
    assert model_tokens(t) == sum(t.response_mask) < len(t.response_tokens)


@pytest.mark.parametrize("algo", list(ALGOS))
def test_multi_turn_trains_alike_at_cp2_on_packed_micro_batches(trained, algo):
    a, b = _metrics(trained, f"single-{algo}"), _metrics(trained, f"cp2-{algo}")
    assert len(a) == len(b) == ALGOS[algo]
    for x, y in zip(a, b):
        assert y["loss"] == pytest.approx(x["loss"], rel=1e-5, abs=1e-5 if algo == "ppo" else 1e-6)
        assert y["grad_norm"] == pytest.approx(x["grad_norm"], rel=1e-4)
    wa, wb = torch.load(trained / f"single-{algo}.pt"), torch.load(trained / f"cp2-{algo}.pt")
    for k in wa:
        torch.testing.assert_close(wb[k], wa[k], rtol=1e-4, atol=1e-5, msg=k)


def test_only_the_models_tokens_are_trained(trained):
    """SPO's response_length metric counts the model's tokens (the mask), and training every token instead (no mask)
    is another update."""
    m = _metrics(trained, "single-spo")[0]
    steps = multi_turn(0, 8, 0)
    assert m["response_length/online"] == pytest.approx(sum(model_tokens(t) for t in steps) / 8, rel=1e-6)
    unmasked = _metrics(trained, "unmasked-spo")[0]
    assert unmasked["response_length/online"] == pytest.approx(sum(len(t.response_tokens) for t in steps) / 8)
    assert abs(unmasked["grad_norm"] - m["grad_norm"]) > 1e-3 * m["grad_norm"]
