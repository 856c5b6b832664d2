"""Mixed-policy GRPO (LUFFY; grpo.guide_path): the shaped term of demonstrations, exact; a bandit whose best arm the
policy never samples, learnt only with guidance; demonstrations spliced into the online groups (round-robin,
resumable) and kept whole in micro-batches; the config and quickstart errors naming the field."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from megatron_spo.algorithms.grpo import aggregate, grpo_advantages, grpo_token_losses, shaped_probability

CLIP = dict(clip_eps_low=0.2, clip_eps_high=0.2)


def _tokens(seed=0, b=4, t=5):
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(b, t, generator=g) * 6
    mask = torch.ones(b, t)
    mask[0, :2] = 0
    mask[3, 4:] = 0
    return logp, mask


def test_demonstration_rows_take_the_shaped_term_and_own_rows_are_unchanged():
    """Guided rows: l_t = -p / (p + gamma) A exactly, gradient -A gamma p / (p + gamma)^2 in log p, no KL term and
    no behaviour weight; the policy's own rows are bitwise the unguided loss's, KL and correction included."""
    logp, mask = _tokens()
    behaviour = logp - 0.3  # own rows: ratio e^0.1 against old, within the clip; the TIS cap 1.05 truncates
    ref = logp + 0.7
    old = logp - 0.1
    adv = torch.tensor([1.5, -0.5, 0.25, -1.0])
    guided = torch.tensor([True, False, False, True])
    gamma = 0.3
    kw = dict(beta=0.2, old_logp=old, correction="tis", correction_cap=1.05, **CLIP)
    x = logp.clone().requires_grad_(True)
    per_token, valid, stats = grpo_token_losses(x, behaviour, ref, adv, mask, guided=guided, shaping_gamma=gamma,
                                                **kw)
    plain, _, _ = grpo_token_losses(logp, behaviour, ref, adv, mask, **kw)
    p = logp.exp()
    want = torch.where(guided.unsqueeze(1), -p / (p + gamma) * adv.unsqueeze(1), plain) * mask
    torch.testing.assert_close(per_token, want, rtol=1e-6, atol=0)  # sigmoid form: one fp32 ulp
    assert torch.equal(per_token[~guided], plain[~guided])
    per_token.sum().backward()
    grad = -adv.unsqueeze(1) * gamma * p / (p + gamma) ** 2 * mask
    torch.testing.assert_close(x.grad[guided], grad[guided], rtol=1e-6, atol=1e-12)
    torch.testing.assert_close(stats["shaped_p"][guided], (p / (p + gamma) * mask)[guided])
    assert stats["shaped_p"][~guided].abs().max() == 0
    assert not stats["clipped"][guided].any() and stats["kl_ref"][guided].abs().max() == 0
    assert stats["behaviour_weight"][guided].abs().max() == 0  # weights are of the policy's samples only
    # a log-prob of -1000 shapes to 0, not NaN
    assert shaped_probability(torch.tensor([-1000.0, 0.0]), 0.1).tolist() == pytest.approx([0.0, 1 / 1.1])


def test_guide_arguments_are_checked():
    logp, mask = _tokens()
    adv = torch.zeros(4)
    with pytest.raises(ValueError, match=r"guided must be a bool tensor of shape \(4,\), got torch.int64 \(4,\)"):
        grpo_token_losses(logp, logp, None, adv, mask, beta=0.0, guided=torch.zeros(4, dtype=torch.long), **CLIP)
    with pytest.raises(ValueError, match="shaping_gamma must be > 0, got 0"):
        grpo_token_losses(logp, logp, None, adv, mask, beta=0.0, guided=torch.zeros(4, dtype=torch.bool),
                          shaping_gamma=0, **CLIP)


def _bandit(guide: str | None, steps: int = 300) -> float:
    """Softmax over 4 arms starting at P(arm 3) = 8e-4; reward 0 for arm 3, -1 otherwise. Every group holds the six
    samples 0, 1, 2, 0, 1, 2 (a policy that never draws arm 3), plus one demonstration of arm 3 whose term is
    guide "shaped" (-p / (p + 0.1) A) or "plain" (-p A: the ratio against a demonstrator of probability 1, unshaped);
    Dr. GRPO advantages, token mean, SGD lr 4. Returns the final P(arm 3)."""
    logits = torch.tensor([0.0, 0.0, 0.0, -6.0], requires_grad=True)
    opt = torch.optim.SGD([logits], lr=4.0)
    reward_of = torch.tensor([-1.0, -1.0, -1.0, 0.0])
    arms = torch.tensor([0, 1, 2, 0, 1, 2] + ([3] if guide else []))
    guided = torch.arange(len(arms)) == 6
    for _ in range(steps):
        logp = torch.log_softmax(logits, 0)[arms].unsqueeze(1)
        adv = grpo_advantages(reward_of[arms], torch.zeros(len(arms), dtype=torch.long), scale_rewards=False)
        per_token, valid, _ = grpo_token_losses(logp, logp.detach(), None, adv, torch.ones(len(arms), 1), beta=0.0,
                                                guided=guided if guide else None, **CLIP)
        if guide == "plain":
            per_token = torch.where(guided.unsqueeze(1), -logp.exp() * adv.unsqueeze(1), per_token)
        total, norm = aggregate(per_token, valid, "token_mean")
        opt.zero_grad()
        (total / norm).backward()
        opt.step()
    return float(torch.softmax(logits.detach(), 0)[3])


def test_guidance_teaches_an_arm_the_policy_never_samples():
    """On-policy GRPO cannot learn what it does not sample: every reward -1, advantage 0, P(arm 3) exactly where it
    started. One demonstration per group takes it past 0.99 in 300 steps (measured: past 0.9 at step 197); unshaped
    (the plain ratio p, gradient p ~ 8e-4) it is still under 0.002: the shaping's gradient ~ p / gamma is 10x."""
    start = float(torch.softmax(torch.tensor([0.0, 0.0, 0.0, -6.0]), 0)[3])
    assert _bandit(None) == pytest.approx(start, rel=1e-6)
    assert _bandit("shaped") > 0.99
    assert _bandit("plain") < 0.002


def _record(pid, response, reward=0.0):
    return {"prompt_id": pid, "prompt_tokens": [1, 2], "response_tokens": response, "reward": reward,
            "source": "expert", "policy_version": 0}


@pytest.fixture
def guide_file(tmp_path):
    path = tmp_path / "guide.jsonl"
    rows = [_record("a", [5, 6]), _record("a", [7]), _record("b", [8, 9, 10], -1.0)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _online(pids, per=3):
    return [SimpleNamespace(prompt_id=p, prompt_tokens=[1, 2], response_tokens=[3, 4], reward=-1.0, source="online")
            for p in pids for _ in range(per)]


def test_guide_source_splices_each_groups_demonstrations_round_robin_and_resumes(guide_file):
    from megatron_spo.training.sources import GUIDE_SOURCE, GuideSource

    guide = GuideSource(str(guide_file), per_prompt=1)
    first = guide.splice(_online(["a", "c", "b"]))
    assert [(t.prompt_id, t.source) for t in first] == [("a", "online")] * 3 + [("a", GUIDE_SOURCE)] + [
        ("c", "online")] * 3 + [("b", "online")] * 3 + [("b", GUIDE_SOURCE)]
    assert [t.response_tokens for t in first if t.source == GUIDE_SOURCE] == [[5, 6], [8, 9, 10]]
    state = json.loads(json.dumps(guide.state_dict()))
    second = guide.splice(_online(["a", "b"]))
    assert [t.response_tokens for t in second if t.source == GUIDE_SOURCE] == [[7], [8, 9, 10]]
    resumed = GuideSource(str(guide_file), per_prompt=1)
    resumed.load_state_dict(state)
    assert [t.response_tokens for t in resumed.splice(_online(["a", "b"])) if t.source == GUIDE_SOURCE] == [
        [7], [8, 9, 10]]
    two = GuideSource(str(guide_file), per_prompt=2).splice(_online(["a"]) + [
        SimpleNamespace(prompt_id="a", source="offline")])
    assert [t.source for t in two] == ["online"] * 3 + ["offline", GUIDE_SOURCE, GUIDE_SOURCE]  # one group, together


def test_guide_that_matches_no_prompt_warns_once_and_a_missing_file_names_the_field(guide_file, tmp_path, caplog):
    from megatron_spo.config import ConfigError
    from megatron_spo.training.sources import GuideSource

    guide = GuideSource(str(guide_file), per_prompt=1)
    with caplog.at_level(logging.WARNING, logger="megatron_spo.training.sources"):
        assert len(guide.splice(_online(["x", "y"]))) == 6
    assert "none of this step's 2 prompts (e.g. 'x') has a demonstration (its 2 prompts, e.g. 'a')" in caplog.text
    with pytest.raises(ConfigError, match=r"grpo.guide_path: trajectories: '.*nowhere' is neither"):
        GuideSource(str(tmp_path / "nowhere"), per_prompt=1)


def _train_cfg(tmp_path, **kw):
    from megatron_spo.training.config import TrainConfig

    data = dict(run_dir=str(tmp_path / "run"), algo="grpo", init={"hf": "x"},
                rollout={"temperature_range": [1.0, 1.0], "top_p": 1.0},
                batch={"sequences_per_step": 8, "max_tokens_per_micro_batch": 16, "max_seq_length": 16})
    data.update(kw)
    return TrainConfig.model_validate(data)


def test_micro_batches_keep_demonstrations_in_their_online_group(guide_file, tmp_path):
    from megatron_spo.training.micro_batches import micro_batches
    from megatron_spo.training.sources import GuideSource

    cfg = _train_cfg(tmp_path, grpo={"guide_path": str(guide_file)})
    trajs = GuideSource(str(guide_file), per_prompt=1).splice(_online(["a", "b"]))
    for t in trajs:
        t.policy_version, t.q0, t.behaviour_logprobs, t.mc_targets = 0, None, None, None
        t.routed_experts = getattr(t, "routed_experts", None)
    # prompt a: 4 rows of width 3 (12 tokens padded), b: 4 rows of width 4 (its demonstration's 2 + 3 - 1): 16
    mbs = micro_batches(trajs, cfg, keep_groups=True, pad_id=0, dp_rank=0)
    assert [mb.source for mb in mbs] == [["online"] * 3 + ["guide"], ["online"] * 3 + ["guide"]]
    assert [mb.group.unique().numel() for mb in mbs] == [1, 1]
    # the demonstration is part of its group: 11 tokens hold a's online rows (9) but not the group
    tight = _train_cfg(tmp_path, grpo={"guide_path": str(guide_file)},
                       batch={"sequences_per_step": 8, "max_tokens_per_micro_batch": 11, "max_seq_length": 16})
    with pytest.raises(ValueError, match="a group of 4 sequences of up to 3 tokens does not fit max_tokens 11"):
        micro_batches(trajs, tight, keep_groups=True, pad_id=0, dp_rank=0)


def test_guide_config_errors_name_the_field(guide_file, tmp_path):
    from megatron_spo.config import ConfigError, build_config
    from megatron_spo.experiments.quickstart import QuickstartConfig, train_config

    with pytest.raises(ValueError, match="grpo.guide_path: demonstrations join GRPO's prompt groups .* algo is 'spo'"):
        _train_cfg(tmp_path, algo="spo", rollout={}, grpo={"guide_path": str(guide_file)})
    with pytest.raises(ValueError, match="sources.guide: the name 'guide' is reserved for grpo.guide_path's"):
        _train_cfg(tmp_path, algo="spo", rollout={}, sources={"online": {}, "guide": {"path": str(guide_file)}})
    with pytest.raises(ConfigError, match="offline_data_guide 1: mixed-policy GRPO needs algo=grpo on the megatron "
                                          "trainer and offline_data .got algo 'spo'"):
        build_config(QuickstartConfig, {"offline_data_guide": 1, "offline_data": ["/d"]}, "quickstart")
    with pytest.raises(ConfigError, match="offline_data_guide 2: .*0 offline_data paths"):
        build_config(QuickstartConfig, {"offline_data_guide": 2, "algo": "grpo"}, "quickstart")
    cfg = build_config(QuickstartConfig, {"offline_data_guide": 2, "algo": "grpo", "offline_data": ["/d"]},
                       "quickstart")
    w = Path("/w")
    ends = SimpleNamespace(router_url="http://127.0.0.1:1", engine_urls=["http://127.0.0.1:2"])
    t = train_config(cfg, w, w / "ref", w / "init", ends, w / "q0.jsonl", w / "offline.jsonl",
                     data_path=w / "data.jsonl")
    assert (t.grpo.guide_path, t.grpo.guide_per_prompt, t.grpo.guide_shaping) == ("/w/data.jsonl", 2, 0.1)
    assert sorted(t.sources) == ["online"]  # the data joins the groups, not the source mix


def test_records_longer_than_a_trainer_row_are_refused_at_start_naming_the_source(guide_file, tmp_path):
    """An offline source or the guide with a record over batch.max_seq_length fails when the trainer builds its
    sampler (one line: the field, how many, an example), not at the step that first draws the record."""
    from megatron_spo.config import ConfigError
    from megatron_spo.training.sources import GuideSource, OfflineSource

    with pytest.raises(ConfigError, match=r"grpo.guide_path \(.*guide.jsonl\): 1 of 3 records are longer than "
                                          r"batch.max_seq_length 4 \(e.g. prompt 'b': 2 \+ 3 tokens\); drop them "
                                          r"\(`megatron-spo offline build ... --max-tokens 4`\)"):
        GuideSource(str(guide_file), per_prompt=1, max_seq_length=4)
    assert len(GuideSource(str(guide_file), per_prompt=1, max_seq_length=5).by_prompt) == 2
    with pytest.raises(ConfigError, match=r"sources.expert \(.*guide.jsonl\): 2 of 3 records are longer than "
                                          r"batch.max_seq_length 3 \(e.g. prompt 'a': 2 \+ 2 tokens\)"):
        OfflineSource("expert", str(guide_file), seed=0, max_seq_length=3)
