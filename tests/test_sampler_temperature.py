"""Trainer and engine log-probs compared at the sampler's temperature (issue 62): the engines report log softmax(logits
/ T) of the sampling temperature, so the trust region, TIS / MIS and PPO's ratio compare the trainer's log-probs of
logits / T with them. Step 1 of a run, whose weights are the engines', then clips and corrects nothing."""

import json

import pytest
import torch
from trainer_helpers import EngineSource, make_tiny_hf, train_on_engine_samples, trainer_config

from megatron_spo import algorithms
from megatron_spo.algorithms.spo_transforms import trust_region

pytestmark = [pytest.mark.multiproc]


def test_the_trust_region_compares_the_samplers_log_probs_with_the_policys_at_their_temperature():
    """Rows sampled at T = 0.3 from the current weights: the policy's log-probs at T = 0.3 are the sampler's, so
    nothing is clipped; compared at T = 1 (the rule before) a large share of the tokens is."""
    torch.manual_seed(0)
    logits = torch.randn(4, 6, 11, dtype=torch.float64) * 2
    tokens = torch.distributions.Categorical(logits=logits / 0.3).sample()
    logp = torch.log_softmax(logits, -1).gather(2, tokens[..., None])[..., 0].requires_grad_()
    behaviour = torch.log_softmax(logits / 0.3, -1).gather(2, tokens[..., None])[..., 0]
    mask = torch.ones(4, 6, dtype=torch.bool)
    reward = torch.tensor([0.0, -1.0, 0.0, -1.0], dtype=torch.float64)
    base = dict(logp=logp, ref_logp=logp.detach() - 0.05, mask=mask, reward=reward,
                q0=torch.full((4,), -0.3, dtype=torch.float64), behaviour_logp=behaviour)

    def clipped(**kw):
        _, m = algorithms.spo_loss(algorithms.SPOInputs(**base, **kw), beta=0.5, objective="terminal", loss="squared",
                                   transforms=(lambda t: trust_region(t, limit=0.2),))
        return m["trust_region_clipped"]

    assert clipped(sampler_logp=behaviour) == 0.0
    assert clipped() > 0.2  # the T = 1 log-probs against the tempered sampler's


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """1 step each on the local engine's samples of the tiny Llama (fp32 both sides): SPO at the at-scale default
    sampling (T ~ U(0.1, 0.8), top-p 0.95: the paper's) and at T 0.3; GRPO with TIS and PPO at T 0.6, top-p 0.95."""
    from megatron_spo.models.parallel import spawn_local

    root = tmp_path_factory.mktemp("tempered")
    hf = make_tiny_hf(str(root / "hf"))
    at = {"temperature_range": [0.1, 0.8], "top_p": 0.95}
    t06 = {"temperature_range": [0.6, 0.6], "top_p": 0.95}
    plan = {
        "spo-default": (trainer_config(root, hf, "spo-default", "spo", steps=1, rollout=at),
                        {"temperature": (0.1, 0.8), "top_p": 0.95}),
        "spo-t03": (trainer_config(root, hf, "spo-t03", "spo", steps=1, rollout=at), {"temperature": 0.3, "top_p": 0.95}),
        "grpo-tis": (trainer_config(root, hf, "grpo-tis", "grpo", steps=1, rollout=t06, model_update_interval=10,
                                    grpo={"behaviour_correction": "tis"}), {"temperature": 0.6, "top_p": 0.95}),
        "ppo": (trainer_config(root, hf, "ppo", "ppo", steps=1, rollout=t06), {"temperature": 0.6, "top_p": 0.95}),
    }
    for cfg, _ in plan.values():
        cfg["batch"] = dict(cfg["batch"], sequences_per_step=16)
    spawn_local(train_on_engine_samples, 1, list(plan.values()))
    return root, hf


def _step1(root, name) -> dict:
    return json.loads((root / name / "metrics.jsonl").read_text().splitlines()[0])


@pytest.mark.parametrize("name", ["spo-default", "spo-t03"])
def test_spo_at_the_at_scale_sampling_clips_nothing_at_step_1(runs, name):
    root, hf = runs
    m = _step1(root, name)
    assert m["trust_region_clipped/online"] == 0.0
    # the engine's weights are the trainer's (fp32 both): the gap, at the sample's temperature, is rounding
    assert m["logprob_gap/mean_abs"] < 1e-5
    # what the rule before compared: the policy at T = 1 against the tempered sampler, KL(mu || pi) per sequence
    assert m["kl_sampler_k3/online"] > 0.1


def _t1_share_past(hf, temperature, limit: float) -> float:
    """The share of the engine's tokens (EngineSource, seed 0, 16 samples) whose log(pi / mu) at T = 1 is past
    +-limit: what the trust region compared before."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
    past = total = 0
    for t in EngineSource(hf, temperature=temperature, top_p=0.95).take(16):
        ids = torch.tensor([t.prompt_tokens + t.response_tokens])
        with torch.no_grad():
            logp = torch.log_softmax(model(ids).logits[0, len(t.prompt_tokens) - 1:-1], -1)
        ratio = logp.gather(1, torch.tensor(t.response_tokens)[:, None])[:, 0] - torch.tensor(t.behaviour_logprobs)
        past += int((ratio.abs() > limit).sum())
        total += ratio.numel()
    return past / total


def test_the_old_rule_would_have_frozen_tokens_of_the_same_samples(runs):
    root, hf = runs
    assert _t1_share_past(hf, 0.3, 0.2) > 0.1


@pytest.mark.parametrize("name", ["grpo-tis", "ppo"])
def test_grpo_with_tis_and_ppo_at_t_06_take_ratio_1_at_step_1(runs, name):
    """The policy's log-probs at T 0.6 are the engine's: TIS weights pi_old / mu = 1 (nothing truncated, mismatch KL
    ~0), and the clipped ratio pi / pi_old (GRPO with TIS) or pi / mu (PPO) clips nothing at step 1."""
    root, _ = runs
    m = _step1(root, name)
    assert m["clip_fraction"] == 0.0
    assert abs(m["approx_kl_old_new"]) < 1e-8  # compared at T = 1 (the rule before): 2.4e-3 for PPO
    assert m["logprob_gap/mean_abs"] < 1e-5
    if name == "ppo":
        assert m["mean_ratio"] == pytest.approx(1.0, abs=1e-5)  # the rule before: 1.0045
    if name == "grpo-tis":
        assert m["behaviour_weight"] == pytest.approx(1.0, abs=1e-5)
        assert m["behaviour_corrected"] == 0.0
        assert abs(m["mismatch_kl"]) < 1e-8
