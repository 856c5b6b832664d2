"""Multi-turn rollouts against the real local engine (an EngineServer over HTTP): every turn is a /generate of the
conversation's token ids so far, the trajectory is exactly the engine's output ids with the observation ids between
them (no re-tokenisation), with the mask, the engine's log-probs (0 on the environment's tokens) and each turn's
weight version, a weight push between two turns included."""

from __future__ import annotations

import asyncio
import json
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
import env_helpers  # noqa: E402
from rollout_helpers import ServerThread, make_tiny_llama, perturbed_state_dict  # noqa: E402

from megatron_spo.config import build_config  # noqa: E402
from megatron_spo.data.trajectory import validate_record  # noqa: E402
from megatron_spo.rollout import client as client_module  # noqa: E402
from megatron_spo.rollout.config import RolloutConfig  # noqa: E402
from megatron_spo.rollout.local_engine import LocalEngine  # noqa: E402
from megatron_spo.rollout.manager import Prompt, RolloutManager  # noqa: E402
from megatron_spo.rollout.turns import PLAIN_HEAD, PLAIN_TAIL  # noqa: E402
from megatron_spo.rollout.weight_sync import WeightBroadcaster  # noqa: E402

PROMPTS = [Prompt("p0", [3, 4, 5, 6], problem="zero"), Prompt("p1", [7, 8, 9], problem="one")]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_llama(str(tmp_path_factory.mktemp("tiny") / "model"))


@pytest.fixture(scope="module")
def server(model_dir):
    torch.set_num_threads(1)
    with ServerThread(LocalEngine(model_dir, seed=0)) as srv:
        yield srv


@pytest.fixture
def recorded(monkeypatch):
    """Every /generate the clients send: (body, headers, response)."""
    calls = []
    original = client_module.EngineClient.request

    async def recording(self, method, path, body=None, timeout_s=None, headers=None):
        answer = await original(self, method, path, body, timeout_s, headers)
        if path == "/generate":
            calls.append((json.loads(json.dumps(body)), dict(headers or {}), answer))
        return answer

    monkeypatch.setattr(client_module.EngineClient, "request", recording)
    return calls


def rollout(server, env: dict, *, n: int, requests: int, prompts=PROMPTS, reward=None, max_new_tokens: int = 5):
    cfg = build_config(RolloutConfig, {"samples_per_prompt": n, "max_new_tokens": max_new_tokens, "max_inflight_requests": 2,
                                       "temperature_range": [0.6, 0.9], "env": env, "seed": 3})
    tokenizer = server.engine.tokenizer

    async def go():
        manager = RolloutManager(cfg, prompts, reward or (lambda problem, text: -float(len(text))),
                                 endpoints=[server.url], tokenizer=tokenizer)
        await manager.start(max_requests=requests)
        await manager.join()
        groups = await manager.get_groups(requests, timeout_s=30)
        stats = manager.stats()
        await manager.stop()
        return groups, stats

    return asyncio.run(go())


def observation_ids(tokenizer, text: str) -> list[int]:
    """The plain format tokenised here, piece by piece (the toy tokenizer has no chat template)."""
    def enc(t, **kw):
        return tokenizer(t, add_special_tokens=False, **kw)["input_ids"]

    return enc(PLAIN_HEAD) + enc(text, split_special_tokens=True) + enc(PLAIN_TAIL)


def turns_of(calls, trajectory) -> list[tuple[dict, dict, dict]]:
    rid = f"{trajectory.request_id}.s{trajectory.sample_index}."
    return sorted([c for c in calls if c[0]["rid"].startswith(rid)], key=lambda c: c[0]["rid"])


def test_two_turn_conversations_are_the_engine_tokens_and_the_observations_exactly(server, recorded):
    env = {"name": "env_helpers:Scripted", "max_turns": 4, "options": {"turns": 2, "reward": -0.25}}
    groups, stats = rollout(server, env, n=2, requests=3)
    tokenizer = server.engine.tokenizer
    obs = observation_ids(tokenizer, env_helpers.OBSERVATIONS[0])
    assert len(groups) == 3 and all(len(g) == 2 for g in groups) and len(recorded) == 3 * 2 * 2
    keys = set()
    for group in groups:
        assert len({t.temperature for t in group}) == 1  # a group samples at one temperature
        for t in group:
            (body1, head1, out1), (body2, head2, out2) = turns_of(recorded, t)
            prompt = next(p for p in PROMPTS if p.prompt_id == t.prompt_id).tokens
            ids1, ids2 = out1["output_ids"], out2["output_ids"]
            # token in: turn 2 is generated from the prompt, turn 1's own ids and the observation's, as they are
            assert body1["input_ids"] == prompt and body2["input_ids"] == prompt + ids1 + obs
            assert body1["sampling_params"]["n"] == 1 and body1["sampling_params"]["temperature"] == t.temperature
            # token out: the trajectory is exactly that
            assert t.prompt_tokens == prompt and t.response_tokens == ids1 + obs + ids2
            assert t.response_mask == [1] * len(ids1) + [0] * len(obs) + [1] * len(ids2)
            lps = [[e[0] for e in o["meta_info"]["output_token_logprobs"]] for o in (out1, out2)]
            assert t.behaviour_logprobs == lps[0] + [0.0] * len(obs) + lps[1]
            assert t.turn_versions == [0, 0] and t.policy_version == 0 and t.num_turns == 2
            assert t.reward == -0.25  # the environment's final word
            assert t.text == out1["text"] + PLAIN_HEAD + env_helpers.OBSERVATIONS[0] + PLAIN_TAIL + out2["text"]
            # one conversation, one routing key (X-SMG-Routing-Key), on one engine
            assert head1 == head2 and set(head1) == {"X-SMG-Routing-Key"}
            keys.add(head1["X-SMG-Routing-Key"])
            record = validate_record(json.loads(json.dumps(t.to_record())), "here")  # the trainer reads it back
            assert record.response_mask == t.response_mask and record.turn_versions == [0, 0]
    assert len(keys) == 6  # each sample its own conversation
    assert stats["rollout/conversations"] == 6 and stats["rollout/turns_per_conversation"] == 2
    assert stats["rollout/env_tokens"] == 6 * len(obs) and stats["rollout/env_errors"] == 0


def test_a_weight_push_between_turns_tags_each_turn_with_its_version(server, model_dir, recorded, tmp_path):
    engine = server.engine
    before = {name: tensor.clone() for name, tensor in engine.model.state_dict().items()}
    new = perturbed_state_dict(model_dir, seed=11)

    async def push():  # what the trainer does while the conversation waits on its environment
        sync = WeightBroadcaster([server.url], mode="disk", disk_dir=str(tmp_path))
        report = await asyncio.to_thread(sync.push, new.items(), "1")
        assert not report.failed

    env_helpers.BETWEEN[:] = [push]
    try:
        env = {"name": "env_helpers:Scripted", "options": {"turns": 2}}  # no final word: the task's reward
        groups, _ = rollout(server, env, n=1, requests=1, prompts=PROMPTS[:1])
        [[t]] = groups
        (body1, _, out1), (body2, _, out2) = turns_of(recorded, t)
        assert t.turn_versions == [0, 1] and t.policy_version == 0 and not t.mixed_versions
        assert [out1["meta_info"]["weight_version"], out2["meta_info"]["weight_version"]] == ["default", "1"]
        assert t.reward == -float(len(out1["text"] + out2["text"]))  # the task's reward on the model's turns
        # each turn's behaviour log-probs are its weights' log softmax(logits / T), token by token
        n1, n2 = len(out1["output_ids"]), len(out2["output_ids"])
        lp = [x if x is not None else float("-inf") for x in t.behaviour_logprobs]
        assert lp[n1:len(lp) - n2] == [0.0] * (len(lp) - n1 - n2)
        assert torch.allclose(scaled_logprobs(engine, body2["input_ids"], out2["output_ids"], t.temperature),
                              torch.tensor(lp[len(lp) - n2:]), atol=1e-4)
        engine.load_named_tensors(list(before.items()))
        assert torch.allclose(scaled_logprobs(engine, body1["input_ids"], out1["output_ids"], t.temperature),
                              torch.tensor(lp[:n1]), atol=1e-4)
    finally:
        env_helpers.BETWEEN.clear()
        engine.load_named_tensors(list(before.items()))
        assert client_module.post_json(server.url + "/update_weight_version", {"new_version": "default"})[0] == 200


def scaled_logprobs(engine, context: list[int], output: list[int], temperature: float) -> torch.Tensor:
    with torch.no_grad():
        logits = engine.model(torch.tensor([context + output])).logits[0].float()
    logits = logits[len(context) - 1: len(context) + len(output) - 1] / temperature
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(output)[:, None])[:, 0]


def test_limits_end_conversations_and_a_broken_environment_drops_its_group(server, recorded):
    tokenizer = server.engine.tokenizer
    obs = observation_ids(tokenizer, env_helpers.OBSERVATIONS[0])
    env = {"name": "env_helpers:Scripted", "max_turns": 3, "options": {"turns": 99}}
    groups, stats = rollout(server, env, n=1, requests=2)
    assert all(t.num_turns == 3 and t.response_mask.count(0) > 0 for g in groups for t in g)  # max_turns
    assert stats["rollout/turns_per_conversation"] == 3
    # max_total_tokens: the prompt (4) + turn 1 (5) + the observation leave no room for a reply: one turn
    budget = 4 + 5 + len(obs)
    recorded.clear()
    groups, _ = rollout(server, {**env, "max_total_tokens": budget}, n=1, requests=1, prompts=PROMPTS[:1])
    [[t]] = groups
    assert t.num_turns == 1 and t.response_mask == [1] * len(t.response_tokens) and len(recorded) == 1
    groups, _ = rollout(server, {**env, "max_total_tokens": budget + 2}, n=1, requests=1, prompts=PROMPTS[:1])
    [[t]] = groups  # room for 2 tokens: turn 2's max_new_tokens is cut to them
    assert t.num_turns == 2 and len(t.response_tokens) <= budget + 2 - 4
    assert recorded[-1][0]["sampling_params"]["max_new_tokens"] == 2

    async def never(problem, text):
        raise AssertionError("unreachable")

    cfg = build_config(RolloutConfig, {"samples_per_prompt": 2, "max_new_tokens": 3, "env": "env_helpers:BadResult"})

    async def go():
        manager = RolloutManager(cfg, PROMPTS, never, endpoints=[server.url], tokenizer=tokenizer)
        await manager.start(max_requests=2)
        await manager.join()
        stats = manager.stats()
        await manager.stop()
        return stats

    stats = asyncio.run(go())
    assert stats["rollout/env_errors"] == 2 and stats["rollout/groups"] == 0


def test_the_router_keeps_each_conversation_on_one_engine(model_dir):
    """sglang-router's manual policy (--policy manual) pins an X-SMG-Routing-Key to one worker: every turn of a
    conversation reaches the engine that holds its cache; min_group spreads new keys over the workers."""
    import subprocess
    import time

    from rollout_helpers import engine_env, start_on_free_port

    from megatron_spo.net import free_port
    from megatron_spo.rollout.fleet import router_workers

    seen: dict[str, list[str]] = {}
    engines = [ServerThread(LocalEngine(model_dir, seed=i)) for i in range(2)]
    for srv in engines:
        handler = srv.server.generate

        async def generate(request, handler=handler, url=srv.url):
            seen.setdefault(url, []).append((await request.json())["rid"])
            return await handler(request)

        srv.server.generate = generate  # the app, built on entering, routes /generate here
    with engines[0], engines[1]:
        def start(port):
            return subprocess.Popen(
                [sys.executable, "-m", "megatron_spo.cli", "router", "--host", "127.0.0.1", "--port", str(port),
                 "--worker-urls", *[s.url for s in engines], "--policy", "manual", "--assignment-mode", "min_group",
                 "--log-level", "warn", "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())],
                env=engine_env(), start_new_session=True)

        router, url = start_on_free_port(start, "router")
        try:
            deadline = time.monotonic() + 60
            while len(router_workers(url)) < 2 and time.monotonic() < deadline:
                time.sleep(0.2)
            env = {"name": "env_helpers:Scripted", "options": {"turns": 3}}
            via = type("Via", (), {"engine": engines[0].engine, "url": url})  # the router, the engines' tokenizer
            groups, _ = rollout(via, env, n=2, requests=2)
        finally:
            router.terminate()
            router.wait(30)
    conversations = {f"{t.request_id}.s{t.sample_index}." for g in groups for t in g}
    where = {c: {u for u, rids in seen.items() for r in rids if r.startswith(c)} for c in conversations}
    assert len(conversations) == 4 and all(len(urls) == 1 for urls in where.values()), where
    assert sum(len(rids) for rids in seen.values()) == 4 * 3
    assert len({u for urls in where.values() for u in urls}) == 2  # min_group: the keys spread over both engines


def test_multi_turn_eval_scores_the_first_and_the_last_turn_of_each_conversation(server, recorded):
    """evaluate_turns: n conversations per problem through the rollout manager, each model turn's text (as the engine
    returned it) scored; pass@k at the first and the last turn, turns per conversation and the share fixed, all as
    counted from the engine's own answers."""
    from megatron_spo.engine_tools.eval import pass_at_ks
    from megatron_spo.engine_tools.eval_turns import evaluate_turns, turn_ids
    from megatron_spo.environments.config import EnvConfig
    from megatron_spo.rewards.reward import RewardResult

    class ParityPool:  # a reward hook's deterministic verdict on the text: passes when its length is even
        hidden, custom = True, "parity"

        async def score(self, problem, text):
            return RewardResult(0.0 if len(text) % 2 == 0 else -1.0, len(text) % 2 == 0, {})

    env = EnvConfig(name="env_helpers:Scripted", max_turns=4, options={"turns": 2, "reward": -0.25})
    result = asyncio.run(evaluate_turns(PROMPTS, [server.url], server.engine.tokenizer, ParityPool(), env, n=4,
                                        ks=(1, 2), max_new_tokens=5, temperature=0.8))
    assert len(recorded) == len(PROMPTS) * 4 * 2  # two turns of 4 conversations a problem
    fixed = 0
    for prompt, first, last in zip(PROMPTS, result.first.problems, result.last.problems):
        convs = {}
        for body, _, out in recorded:
            if body["input_ids"][:len(prompt.tokens)] == prompt.tokens and body["rid"].split("-", 1)[1].startswith(
                    f"{prompt.prompt_id}."):
                convs.setdefault(body["rid"].rsplit(".t", 1)[0], []).append((body["rid"], out["text"]))
        texts = [[text for _, text in sorted(turns)] for turns in convs.values()]
        assert len(texts) == 4 and all(len(t) == 2 for t in texts)
        passed_first = sum(len(t[0]) % 2 == 0 for t in texts)
        passed_last = sum(len(t[1]) % 2 == 0 for t in texts)
        fixed += sum(len(t[0]) % 2 == 1 and len(t[1]) % 2 == 0 for t in texts)
        assert (first.prompt_id, first.n, first.correct) == (prompt.prompt_id, 4, passed_first)
        assert (last.correct, last.pass_at) == (passed_last, pass_at_ks(4, passed_last, (1, 2)))
    assert result.mean_turns == 2.0 and result.fixed_share == fixed / 8
    assert turn_ids([5, 6, 7, 8, 9], [1, 1, 0, 1, 1]) == [[5, 6], [8, 9]] and turn_ids([1, 2], None) == [[1, 2]]
    assert set(result.to_json()) == {"first_turn", "last_turn", "mean_turns", "fixed_share"}
