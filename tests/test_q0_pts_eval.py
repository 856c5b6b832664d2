"""The offline tools: estimate-q0, pivotal token search, pass@k evaluation.

Bisection logic is checked exactly against pure oracles (and against a plain recursive implementation);
the tools run against a real local engine (in-process EngineServer over HTTP, a tiny random Llama with the
project's character tokenizer) and, where root and bubblewrap are available, the real sandbox reward pool.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import random
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from rollout_helpers import ServerThread  # noqa: E402

from megatron_spo.config import ConfigError  # noqa: E402
from megatron_spo.data.problem import read_problems_jsonl  # noqa: E402
from megatron_spo.data.prompts import Prompt, make_prompts  # noqa: E402
from megatron_spo.data.q0 import read_q0  # noqa: E402
from megatron_spo.data.trajectory import read_jsonl, validate_record  # noqa: E402
from megatron_spo.engine_tools.config import ToolSamplingConfig  # noqa: E402
from megatron_spo.engine_tools.estimate_q0 import estimate_q0  # noqa: E402
from megatron_spo.engine_tools.eval import ProblemEval, evaluate  # noqa: E402
from megatron_spo.engine_tools.pts import BisectionSearch, PivotalToken, bisect_oracle, pivotal_token_search  # noqa: E402
from megatron_spo.rewards.reward import RewardResult  # noqa: E402
from megatron_spo.rollout.protocol import Completion, SamplingParams  # noqa: E402

BETA = 0.25


# ---------------------------------------------------------------------------------------------
# Bisection against pure oracles
# ---------------------------------------------------------------------------------------------
def step(jumps: dict[int, float], start: float):
    """S(L) = start, changing to value v for prefix lengths > position p, for each p: v in jumps."""
    def oracle(n: int) -> float:
        value = start
        for p, v in sorted(jumps.items()):
            if n > p:
                value = v
        return value
    return oracle


def test_bisection_finds_the_pivotal_token_at_exact_positions():
    # token 5 moves S from 0.1 to 0.9; the end is a success (1.0)
    search = bisect_oracle(16, step({5: 0.9}, 0.1), s_end=1.0, threshold=0.2)
    # (0,16) -> 8; (0,8) -> 4; (8,16): |0.9 - 1.0| < 0.2 stops; (4,8) -> 6; (4,6) -> 5; (5,6) is pivotal
    assert sorted(search.estimates) == [0, 4, 5, 6, 8, 16]
    assert search.mc_targets() == [{"t": 3, "success_prob": 0.1}, {"t": 4, "success_prob": 0.1},
                                   {"t": 5, "success_prob": 0.9}, {"t": 7, "success_prob": 0.9}]
    assert search.pivotal == [PivotalToken(t=5, s_before=0.1, s_after=0.9)]
    assert not search.truncated


def test_bisection_two_jumps_gap_tolerance_and_flat_trajectories():
    # jumps at tokens 2 (0.1 -> 0.3: a gap of exactly the threshold, in floats 0.19999999999999998) and 12
    search = bisect_oracle(16, step({2: 0.3, 12: 1.0}, 0.1), threshold=0.2)
    assert [p.t for p in search.pivotal] == [2, 12]
    assert [(p.s_before, p.s_after) for p in search.pivotal] == [(0.1, 0.3), (0.3, 1.0)]
    # already certain at the prompt: nothing to estimate
    flat = bisect_oracle(16, step({}, 0.95), threshold=0.2)
    assert flat.estimates == {0: 0.95, 16: 1.0} and flat.pivotal == [] and flat.mc_targets() == []
    # a one-token response with a gap: that token is pivotal, no rollouts needed
    one = bisect_oracle(1, step({}, 0.0), threshold=0.2)
    assert one.pivotal == [PivotalToken(0, 0.0, 1.0)] and one.mc_targets() == []


def test_bisection_budget_spends_on_the_largest_gaps_first():
    oracle = step({3: 0.3, 28: 0.7}, 0.0)  # and the success at the end: S(32) = 1
    full = bisect_oracle(32, oracle, threshold=0.2)
    assert [p.t for p in full.pivotal] == [3, 28, 31] and not full.truncated
    cut = bisect_oracle(32, oracle, threshold=0.2, max_estimates=2)
    # level 1: 16 (S = 0.3); level 2 has (0,16) with gap 0.3 and (16,32) with gap 0.7: one estimate left,
    # it goes to the larger gap -> 24
    assert cut.truncated and sorted(cut.estimates) == [0, 16, 24, 32] and cut.pivotal == []


def recursive_reference(length, oracle, threshold):
    """Abdin et al.'s recursion, written plainly: the set of visited prefix lengths and the pivotal tokens."""
    seen = {0: oracle(0), length: 1.0}
    pivotal = []

    def subdivide(a, b):
        if abs(seen[b] - seen[a]) < threshold - 1e-9:
            return
        if b - a == 1:
            pivotal.append(a)
            return
        m = (a + b) // 2
        seen[m] = oracle(m)
        subdivide(a, m)
        subdivide(m, b)

    subdivide(0, length)
    return seen, sorted(pivotal)


def test_bisection_matches_plain_recursion_on_random_oracles():
    rng = random.Random(0)
    for _ in range(300):
        length = rng.randint(1, 80)
        values = [round(rng.random(), 1) for _ in range(length)] + [1.0]
        oracle = values.__getitem__  # arbitrary, non-monotone S(L)
        search = bisect_oracle(length, oracle, threshold=0.3)
        seen, pivotal = recursive_reference(length, oracle, 0.3)
        assert search.estimates == seen
        assert [p.t for p in search.pivotal] == pivotal


def test_bisection_rejects_bad_input_with_clear_messages():
    with pytest.raises(ValueError, match="length must be >= 1 response token, got 0"):
        BisectionSearch(0, 0.1, 1.0, 0.2, 10)
    with pytest.raises(ValueError, match="s_start must be a probability, got 1.5"):
        BisectionSearch(4, 1.5, 1.0, 0.2, 10)
    search = BisectionSearch(8, 0.0, 1.0, 0.2, 10)
    assert search.next_points() == [4]
    with pytest.raises(ValueError, match=r"S\(4\) = 2.0 is not a probability"):
        search.record([2.0])


# ---------------------------------------------------------------------------------------------
# A scripted engine: exact pass@k arithmetic
# ---------------------------------------------------------------------------------------------
class ScriptedClient:
    """generate() answers 'ok' for a prompt's first correct[prompt] samples (over all calls), 'bad' after."""

    def __init__(self, correct: dict[tuple, int]):
        self.correct, self.served, self.calls = correct, dict.fromkeys(correct, 0), 0

    async def generate(self, prompts, params, **kw):
        self.calls += 1
        key = tuple(prompts[0])
        first, self.served[key] = self.served[key], self.served[key] + params.n
        return [[Completion(f"r{i}", [5], "ok" if i < self.correct[key] else "bad", "stop", 1, 1, None, None)
                 for i in range(first, first + params.n)]]


class TextReward:
    """Passes when the text contains ``needle`` (hidden flag only reported)."""

    def __init__(self, needle: str, hidden: bool = False):
        self.needle, self.hidden = needle, hidden

    async def score(self, problem, text):
        ok = self.needle in text
        return RewardResult(0.0 if ok else -1.0, ok, {})


class P:  # a minimal code problem
    def __init__(self, pid, tests=(("1\n", "1\n"),), hidden=(("2\n", "2\n"), ("3\n", "3\n"))):
        self.id, self.tests, self.hidden_tests, self.kind = pid, tests, hidden, "code"


def test_eval_pass_at_k_arithmetic_from_known_counts(tmp_path):
    counts = [0, 1, 5, 20]
    prompts = [Prompt(f"p{i}", [1, 10 + i], P(f"p{i}")) for i in range(len(counts))]
    client = ScriptedClient({(1, 10 + i): c for i, c in enumerate(counts)})
    result = asyncio.run(evaluate(prompts, client, TextReward("ok", hidden=True), n=20, ks=(1, 10),
                                  sampling=ToolSamplingConfig(samples_per_request=8), out_path=tmp_path / "e.jsonl"))
    expected10 = [1 - math.comb(20 - c, 10) / math.comb(20, 10) for c in counts]
    assert [p.correct for p in result.problems] == counts
    assert [p.pass_at[1] for p in result.problems] == pytest.approx([c / 20 for c in counts], abs=1e-12)
    assert [p.pass_at[10] for p in result.problems] == pytest.approx(expected10, abs=1e-12)
    assert result.mean[1] == pytest.approx(26 / 80, abs=1e-12)
    assert result.mean[10] == pytest.approx(sum(expected10) / 4, abs=1e-12)
    assert client.calls == 4 * 3  # 20 samples in requests of at most 8
    assert result.problems[0].tests == {"reward": 1, "hidden": 2}
    summary = result.to_json()
    assert summary["mean"]["pass@1"] == pytest.approx(0.325) and len(summary["problems"]) == 4
    # a second run finds everything done: no engine calls, same result
    again = asyncio.run(evaluate(prompts, client, TextReward("ok", hidden=True), n=20, ks=(1, 10),
                                 out_path=tmp_path / "e.jsonl"))
    assert client.calls == 12 and again.to_json() == summary
    with pytest.raises(ValueError, match="was evaluated with n=20, ks=\\[1, 10\\]; this run asks n=5"):
        asyncio.run(evaluate(prompts, client, TextReward("ok"), n=5, ks=(1,), out_path=tmp_path / "e.jsonl"))
    with pytest.raises(ConfigError, match=r"ks \[10\] must lie in \[1, n = 5\]"):
        asyncio.run(evaluate(prompts, client, TextReward("ok"), n=5, ks=(1, 10)))


class TextsClient:
    """generate() answers the scripted texts of a prompt in order."""

    def __init__(self, texts: dict[tuple, list[str]]):
        self.texts, self.served = texts, dict.fromkeys(texts, 0)

    async def generate(self, prompts, params, **kw):
        key = tuple(prompts[0])
        first, self.served[key] = self.served[key], self.served[key] + params.n
        return [[Completion(f"r{i}", [5], self.texts[key][i], "stop", 1, 1, None, None)
                 for i in range(first, first + params.n)]]


def test_eval_counts_distinct_correct_programs_up_to_whitespace():
    texts = {(1, 10): ["ok = 1", "ok = 1  ", "\nok = 1\n\n", "ok = 2", "bad", "bad", "ok  = 1", "ok = 2\n"],
             (1, 11): ["bad"] * 8}
    prompts = [Prompt("a", [1, 10], P("a")), Prompt("b", [1, 11], P("b"))]
    result = asyncio.run(evaluate(prompts, TextsClient(texts), TextReward("ok"), n=8, ks=(1,)))
    # "ok = 1" thrice (trailing spaces, blank lines), "ok = 2" twice, "ok  = 1" differs inside the line
    assert [(p.correct, p.distinct_correct) for p in result.problems] == [(6, 3), (0, 0)]
    assert result.to_json()["problems"][0]["distinct_correct"] == 3
    old = {"prompt_id": "a", "n": 8, "correct": 6, "pass@1": 0.75, "tests": {}}  # a record from before the count
    assert ProblemEval.from_record(old, (1,)).distinct_correct is None


def test_problems_jsonl_errors_name_file_line_and_field(tmp_path):
    path = tmp_path / "problems.jsonl"
    path.write_text('{"id": "a", "prompt": "add", "tests": [["1 2\\n", "3\\n"]]}\n'
                    '{"id": "b", "prompt": "x", "tests": [["1"]]}\n')
    with pytest.raises(ValueError, match=r"problems.jsonl:2: field 'tests' must be a list of \[stdin, stdout\]"):
        read_problems_jsonl(path)
    path.write_text('{"id": "a", "prompt": "add", "tests": [["1 2\\n", "3\\n"]], "hidden_tests": [["0 0\\n", "0\\n"]]}\n')
    [p] = read_problems_jsonl(path)
    assert (p.id, p.tests, p.hidden_tests, p.kind) == ("a", (("1 2\n", "3\n"),), (("0 0\n", "0\n"),), "code")


# ---------------------------------------------------------------------------------------------
# A real engine: tiny random Llama + the project's character tokenizer, served over HTTP
# ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from megatron_spo.data.char_tokenizer import save_char_tokenizer

    path = str(tmp_path_factory.mktemp("tiny-char-llama"))
    tok = save_char_tokenizer(path)
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    LlamaForCausalLM(cfg).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def engine(model_dir):
    from megatron_spo.rollout.local_engine import LocalEngine

    with ServerThread(LocalEngine(model_dir, seed=0, deterministic=True)) as srv:
        yield srv


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


class Interrupted(Exception):
    pass


class CountingClient:
    """A real EngineClient that counts /generate calls and can fail the call number ``fail_at``."""

    def __init__(self, url, fail_at=None, engine_errors=(), error=None):
        from megatron_spo.rollout.client import EngineClient

        self.inner, self.calls, self.fail_at = EngineClient(url, timeout_s=60), 0, fail_at
        self.engine_errors, self.error = set(engine_errors), error  # the calls that raise ``error``
        self.seeds = []  # each call's sampling seed

    async def generate(self, prompts, params, **kw):
        self.calls += 1
        self.seeds.append(params.sampling_seed)
        if self.calls == self.fail_at:
            raise Interrupted(f"cut at call {self.calls}")
        if self.calls in self.engine_errors or self.engine_errors == {"all"}:
            raise self.error
        return await self.inner.generate(prompts, params, **kw)


def run_with(client, coro_fn):
    async def go():
        try:
            return await coro_fn(client)
        finally:
            await client.inner.close()
    return asyncio.run(go())


def test_estimate_q0_exact_values_and_interrupt_resume_equality(engine, tokenizer, tmp_path):
    from megatron_spo.data.toy_code import make_task

    problems = list(make_task(num_problems=12).train[:4])
    prompts = make_prompts(problems, tokenizer)
    assert prompts[0].tokens[0] == tokenizer.bos_token_id and tokenizer.decode(prompts[0].tokens[1:]) == problems[0].prompt
    sampling = ToolSamplingConfig(temperature=1.0, max_new_tokens=12, seed=7, samples_per_request=16, concurrency=1)
    reward = TextReward("e")

    def run(out, traj, client):
        return run_with(client, lambda c: estimate_q0(prompts, c, reward, samples=16, beta=BETA, sampling=sampling,
                                                      out_path=out, trajectories_out=traj, keep_successful=16))

    one = CountingClient(engine.url)
    full = run(tmp_path / "full.jsonl", tmp_path / "full-traj.jsonl", one)
    assert one.calls == 64  # seeded: one request per sample, each with its own seed

    # S0 = (correct + 1/2) / (n + 1) (Jeffreys' prior), Q0 = beta log(S0 + (1 - S0) e^(-1/beta)); every kept
    # trajectory really contains 'e'
    kept, _ = read_jsonl(tmp_path / "full-traj.jsonl")
    for p in prompts:
        est = full[p.prompt_id]
        mine = [t for t in kept if t.prompt_id == p.prompt_id]
        assert est.n == 16 and est.correct == len(mine) and est.s0 == (est.correct + 0.5) / 17
        assert est.q0_low < est.q0 < est.q0_high
        assert est.q0 == pytest.approx(BETA * math.log(est.s0 + (1 - est.s0) * math.exp(-1 / BETA)), abs=1e-6)
        assert all("e" in tokenizer.decode(t.response_tokens, skip_special_tokens=True) for t in mine)
        assert all(t.q0 == est.q0 and t.reward == 0.0 for t in mine)
    assert 0 < sum(e.correct for e in full.values()) < 64  # a non-trivial mix: the check above means something

    # interrupt at the 33rd engine call (two prompts done), tear the file's tail, resume
    cut = CountingClient(engine.url, fail_at=33)
    with pytest.raises(Interrupted):
        run(tmp_path / "cut.jsonl", tmp_path / "cut-traj.jsonl", cut)
    assert len(read_q0(tmp_path / "cut.jsonl")) == 2
    with open(tmp_path / "cut.jsonl", "a") as f:
        f.write('{"prompt_id": "half-writ')
    resumed = CountingClient(engine.url)
    run(tmp_path / "cut.jsonl", tmp_path / "cut-traj.jsonl", resumed)
    assert resumed.calls == 32  # only the two missing prompts
    assert (tmp_path / "cut.jsonl").read_bytes() == (tmp_path / "full.jsonl").read_bytes()
    assert (tmp_path / "cut-traj.jsonl").read_bytes() == (tmp_path / "full-traj.jsonl").read_bytes()
    with pytest.raises(ValueError, match="was estimated with n=16 samples; this run asks n=8"):
        run_with(CountingClient(engine.url), lambda c: estimate_q0(prompts, c, reward, samples=8, beta=BETA,
                                                                   sampling=sampling, out_path=tmp_path / "cut.jsonl"))

    # another beta resumes the same file without sampling: S0 and the counts do not depend on beta, Q0 does
    again = CountingClient(engine.url)
    other = run_with(again, lambda c: estimate_q0(prompts, c, reward, samples=16, beta=0.5, sampling=sampling,
                                                  out_path=tmp_path / "cut.jsonl"))
    assert again.calls == 0
    for p in prompts:
        s0 = full[p.prompt_id].s0
        assert other[p.prompt_id].s0 == s0
        assert other[p.prompt_id].q0 == pytest.approx(0.5 * math.log(s0 + (1 - s0) * math.exp(-1 / 0.5)), abs=1e-9)
        assert other[p.prompt_id].q0 != pytest.approx(full[p.prompt_id].q0)
    assert read_q0(tmp_path / "cut.jsonl", beta=0.5) == other  # what a trainer at beta 0.5 reads (training/online.py)
    assert read_q0(tmp_path / "cut.jsonl") == full  # the file's own values, all at BETA


def test_seeded_samples_of_one_prompt_differ_on_a_deterministic_engine(engine, tokenizer):
    """Q0 must not be estimated from n copies of one sample: SGLang's deterministic inference gives the n
    samples of a request one shared seed, so a seeded tool sends one request per sample
    (engine_tools/sampling.py sample)."""
    from megatron_spo.engine_tools.sampling import sample
    from megatron_spo.rollout.client import EngineClient

    tokens = tokenizer("# num: add 2\n")["input_ids"]

    async def go(sampling):
        async with EngineClient(engine.url) as client:
            return [tuple(c.output_ids) for c in await sample(client, tokens, 8, sampling, seed_key=("p",))]

    seeded = asyncio.run(go(ToolSamplingConfig(temperature=1.0, max_new_tokens=12, seed=5, samples_per_request=8)))
    assert len(set(seeded)) == 8
    assert seeded == asyncio.run(go(ToolSamplingConfig(temperature=1.0, max_new_tokens=12, seed=5)))  # reproducible
    one_request = SamplingParams(temperature=1.0, max_new_tokens=12, n=8, sampling_seed=5)  # what a tool must not do

    async def shared():
        async with EngineClient(engine.url) as client:
            [group] = await client.generate([tokens], one_request, return_logprob=False)
            return {tuple(c.output_ids) for c in group}

    assert len(asyncio.run(shared())) == 1


def test_a_stalled_request_is_sent_again_and_the_evaluation_ends_as_an_undisturbed_one(engine, tokenizer, tmp_path):
    """The offline tools (eval, estimate-q0, pts, sample) send a request that fails retryably again, with its seed:
    an engine timeout under load used to end a whole study run's evaluation."""
    from megatron_spo.data.toy_code import make_task
    from megatron_spo.rollout.client import EngineError

    prompts = make_prompts(list(make_task(num_problems=12).train[:3]), tokenizer)
    sampling = ToolSamplingConfig(max_new_tokens=12, seed=3, concurrency=1, max_retries=2, retry_backoff_s=0.01)

    def run(out, client):
        return run_with(client, lambda c: evaluate(prompts, c, TextReward("e"), n=4, ks=(1,), temperature=1.0,
                                                   sampling=sampling, out_path=out))

    calm = CountingClient(engine.url)
    run(tmp_path / "calm.jsonl", calm)
    assert calm.calls == 12
    timeout = EngineError("http://engine/generate", "timed out after 300 s")
    stalled = CountingClient(engine.url, engine_errors={2, 5, 7}, error=timeout)  # 5: 2's retry
    run(tmp_path / "stalled.jsonl", stalled)
    assert stalled.calls == 15 and (tmp_path / "stalled.jsonl").read_bytes() == (tmp_path / "calm.jsonl").read_bytes()
    assert stalled.seeds[1] == stalled.seeds[4] == stalled.seeds[5] and set(stalled.seeds) == set(calm.seeds)

    bad_request = EngineError("http://engine/generate", "HTTP 400: bad", status=400, retryable=False)
    refused = CountingClient(engine.url, engine_errors={2}, error=bad_request)
    with pytest.raises(EngineError, match="HTTP 400"):
        run(tmp_path / "refused.jsonl", refused)
    assert refused.seeds.count(refused.seeds[1]) == 1  # a request the engine refuses is not sent again
    down = CountingClient(engine.url, engine_errors={"all"}, error=timeout)
    with pytest.raises(EngineError, match="timed out after 300 s"):
        run(tmp_path / "down.jsonl", down)
    assert down.seeds.count(down.seeds[0]) == 3  # 1 + max_retries sends of a request, then the tool stops


def test_read_q0_at_a_beta_derives_q0_from_counts_and_refuses_a_mixed_file_without_one(tmp_path):
    """A file resumed at another beta holds lines of two betas: read as it stands, it would hand a trainer Q0
    values of two different soft values, so it is refused unless a beta is asked for."""
    path = tmp_path / "q0.jsonl"
    lines = [{"prompt_id": "a", "s0": 0.25, "q0": -0.3, "n": 4, "correct": 1, "beta": 0.25},
             {"prompt_id": "b", "s0": 0.5, "q0": -0.2, "n": 4, "correct": 2, "beta": 1.0}]
    path.write_text("".join(json.dumps(r) + "\n" for r in lines))
    with pytest.raises(ValueError, match=r"q0 values at several betas \[0.25, 1.0\]"):
        read_q0(path)
    at = read_q0(path, beta=0.5, prior=0)  # the plain rate: S0 = correct / n
    assert at["a"].q0 == pytest.approx(0.5 * math.log(0.25 + 0.75 * math.exp(-2.0)), abs=1e-12)
    assert at["b"].q0 == pytest.approx(0.5 * math.log(0.5 + 0.5 * math.exp(-2.0)), abs=1e-12)
    assert (at["a"].n, at["a"].correct, at["b"].s0) == (4, 1, 0.5)


def test_estimate_q0_greedy_gives_exact_s0_zero_and_one(engine, tokenizer):
    from megatron_spo.rollout.client import EngineClient

    prompt = Prompt("greedy", tokenizer("# num: add 2\n")["input_ids"], P("greedy"))
    greedy = ToolSamplingConfig(temperature=0.0, max_new_tokens=10, samples_per_request=3)

    async def go(reward):
        async with EngineClient(engine.url) as client:
            return await estimate_q0([prompt], client, reward, samples=6, beta=BETA, sampling=greedy, prior=0)

    async def greedy_text():
        async with EngineClient(engine.url) as client:
            from megatron_spo.rollout.protocol import SamplingParams

            [[c]] = await client.generate([prompt.tokens], SamplingParams(temperature=0.0, max_new_tokens=10))
            return c.text

    text = asyncio.run(greedy_text())
    present = text.strip()[0]
    absent = next(ch for ch in "abcdefghijklmnopqrstuvwxyz0123456789" if ch not in text)
    hit = asyncio.run(go(TextReward(present)))["greedy"]
    miss = asyncio.run(go(TextReward(absent)))["greedy"]
    assert (hit.s0, hit.q0, hit.correct) == (1.0, 0.0, 6)
    assert (miss.s0, miss.q0, miss.correct) == (0.0, -1.0, 0)


def test_pts_real_engine_success_probability_is_exactly_one_after_the_deciding_token(engine, tokenizer, tmp_path):
    """Reward: the text contains character X, the first occurrence of X in a sampled response being at
    token j. Every rollout from a prefix that includes token j succeeds, so S after tokens j.. is exactly 1,
    and j is the pivotal token."""
    from megatron_spo.rollout.client import EngineClient
    from megatron_spo.rollout.protocol import SamplingParams

    prompt = tokenizer("# str: rev\n")["input_ids"]

    async def one_response():
        async with EngineClient(engine.url) as client:
            [[c]] = await client.generate([prompt], SamplingParams(temperature=1.0, max_new_tokens=24,
                                                                   sampling_seed=3, ignore_eos=True))
            return c.output_ids

    response = asyncio.run(one_response())
    chars = [tokenizer.decode([t]) for t in response]
    j = next(i for i in range(10, len(chars)) if len(chars[i]) == 1 and chars[i] not in chars[:i])
    needle = chars[j]
    good = {"prompt_id": "s", "prompt_tokens": prompt, "response_tokens": response, "reward": 0.0,
            "source": "reference", "policy_version": 0}
    failed = {**good, "response_tokens": response[:5], "reward": -1.0}
    sampling = ToolSamplingConfig(temperature=1.0, max_new_tokens=24, seed=1, samples_per_request=8, concurrency=2)

    async def go():
        async with EngineClient(engine.url) as client:
            return await pivotal_token_search(
                [good, failed, good], {"s": P("s")}, client, TextReward(needle),
                lambda ids: tokenizer.decode(ids, skip_special_tokens=True), rollouts_per_point=8, threshold=0.3,
                max_rollouts=96, sampling=sampling, q0={"s": -0.5}, out_path=tmp_path / "mc.jsonl")

    report = asyncio.run(go())
    assert (report.searched, report.skipped_failed, report.duplicates) == (1, 1, 1)
    [record] = report.records
    traj = validate_record(record, "pts output")  # a valid trajectory for the mc objective
    assert traj.source == "mc" and traj.q0 == -0.5 and traj.response_tokens == response
    targets = {m["t"]: m["success_prob"] for m in record["mc_targets"]}
    assert sorted(targets) == [m["t"] for m in record["mc_targets"]] and targets
    assert all(p == 1.0 for t, p in targets.items() if t >= j)  # token j is in the prefix: certain success
    assert report.rollouts == 8 * (len(targets) + 1) <= 96  # + the prefix-0 estimate (no S0 given)
    # token j is the last pivotal token (others may show up before it: MC noise or real drops), and every
    # pivotal token's S values are the annotated ones, a threshold apart
    [found] = report.pivotal.values()
    assert found[-1] == PivotalToken(j, targets[j - 1], 1.0) and targets[j - 1] <= 0.7
    for p in found:
        assert p.s_after == targets[p.t] and abs(p.s_after - p.s_before) >= 0.3
        assert p.t == 0 or p.s_before == targets[p.t - 1]
    assert read_jsonl(tmp_path / "mc.jsonl")[0][0] == traj
    with pytest.raises(ValueError, match="trajectory 0: prompt_id 's' is not among the task's problems"):
        asyncio.run(pivotal_token_search([good], {}, None, None, str))


# ---------------------------------------------------------------------------------------------
# The command lines, with the real sandbox reward pool
# ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def sandbox_ok():
    import shutil

    if os.geteuid() != 0 or shutil.which("bwrap") is None:
        pytest.skip("the sandbox needs root (per-slot uids) and bubblewrap")


def test_cli_estimate_q0_and_eval_on_the_toy_task_with_the_sandbox(engine, sandbox_ok, tmp_path, capsys):
    """A random model surely fails the toy task: greedy samples give S0 = 0 and Q0 = -1 exactly, pass@k = 0,
    and eval reports that the hidden tests were used."""
    from megatron_spo.engine_tools import estimate_q0 as q0_tool
    from megatron_spo.engine_tools import eval as eval_tool

    common = ["--engine-url", engine.url, "--task", "toy", "--limit", "2", "--sandbox-slots", "2",
              "--temperature", "0", "--max-new-tokens", "16", "--no-progress"]
    assert q0_tool.main([*common, "--out", str(tmp_path / "q0.jsonl"), "--samples", "3", "--beta", "0.25",
                         "--prior", "0"]) == 0
    lines = [json.loads(x) for x in (tmp_path / "q0.jsonl").read_text().splitlines()]
    assert [(r["s0"], r["q0"], r["n"], r["correct"]) for r in lines] == [(0.0, -1.0, 3, 0)] * 2
    assert eval_tool.main([*common, "--out", str(tmp_path / "ev.jsonl"), "--json", str(tmp_path / "ev.json"),
                           "-n", "4", "--ks", "1", "2"]) == 0
    summary = json.loads((tmp_path / "ev.json").read_text())
    assert summary["mean"] == {"pass@1": 0.0, "pass@2": 0.0} and summary["num_problems"] == 2
    assert [p["tests"] for p in summary["problems"]] == [{"reward": 5, "hidden": 5}] * 2
    out = capsys.readouterr().out
    assert "pass@1 0.0000, pass@2 0.0000 over 2 problems" in out and "mean of 2" in out
    assert "3 samples each, S0 prior Beta(0, 0)" in out  # estimate-q0's summary: samples, prior, interval, warning
    assert "warning: Q0 of 2 of 2 prompts rests on fewer than 100 samples" in out
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:  # refused by the flag parser, naming --ks, before any sampling
        eval_tool.main([*common, "--out", str(tmp_path / "ev.jsonl"), "-n", "4", "--ks", "1", "8"])
    assert exit_info.value.code == 2 and "--ks" in capsys.readouterr().err


def test_cli_estimate_q0_from_a_training_config_feeds_the_trainer(engine, model_dir, sandbox_ok, tmp_path):
    """The SLURM Q0 stage's form: `estimate-q0 CONFIG --router-url URL --out DIR`; the task, tokenizer and beta
    come from the training config, DIR/q0.jsonl is written, and read_q0 (what the trainer's online source
    attaches to each trajectory) takes it."""
    from megatron_spo.engine_tools import estimate_q0 as q0_tool

    config = tmp_path / "train.yaml"
    config.write_text(f"beta: 0.5\ninit: {{hf: {model_dir}}}\ntask: {{kind: toy, toy: {{num_problems: 12}}}}\n")
    out_dir = tmp_path / "q0"
    assert q0_tool.main([str(config), "--router-url", engine.url, "--out", str(out_dir), "--limit", "2", "--samples", "2",
                         "--temperature", "0", "--max-new-tokens", "8", "--sandbox-slots", "1", "--no-progress",
                         "--prior", "0"]) == 0
    lines = [json.loads(x) for x in (out_dir / "q0.jsonl").read_text().splitlines()]
    from megatron_spo.data.toy_code import make_task

    assert [r["prompt_id"] for r in lines] == [p.id for p in make_task(num_problems=12).train[:2]]
    assert [(r["s0"], r["q0"], r["beta"]) for r in lines] == [(0.0, -1.0, 0.5)] * 2
    assert {k: v.q0 for k, v in read_q0(out_dir / "q0.jsonl").items()} == {r["prompt_id"]: -1.0 for r in lines}
    # the trainer reads the counts with its task.q0_prior (Jeffreys' 1/2): 0 of 2 is not -1
    assert all(-1.0 < v.q0 < -0.1 for v in read_q0(out_dir / "q0.jsonl", beta=0.5).values())


def test_cli_estimate_q0_stops_on_sigusr1_keeps_finished_prompts_and_resumes(model_dir, sandbox_ok, tmp_path):
    """SLURM's time-limit warning (spo.sbatch forwards SIGUSR1; srun delivers it to EVERY process of the step, the
    sandbox's too): estimate-q0 exits 0 with the prompts finished so far saved, so the job is requeued instead
    of failing (which would cancel the training job waiting on it with afterok); the re-run does only the rest
    and ends with the file an uninterrupted run writes."""
    import signal
    import subprocess
    import time

    from megatron_spo.rollout.local_engine import LocalEngine

    class PacedEngine(LocalEngine):  # the real engine, 0.1 s per sample admitted: the signal lands mid-run
        calls = 0

        def check(self, req):
            type(self).calls += 1
            time.sleep(0.1)
            return super().check(req)

    limit = 8
    # --seed: one request per sample with its own seed, reproducible on an engine with deterministic inference
    with ServerThread(PacedEngine(model_dir, seed=0, deterministic=True)) as srv:
        def cli(out: str) -> list[str]:
            return [sys.executable, "-m", "megatron_spo.cli", "estimate-q0", "--engine-url", srv.url, "--task", "toy",
                    "--limit", str(limit), "--samples", "4", "--samples-per-request", "4", "--concurrency", "1",
                    "--temperature", "1.0", "--seed", "3", "--max-new-tokens", "24", "--sandbox-slots", "2",
                    "--no-progress", "--out", str(tmp_path / out)]

        assert subprocess.run(cli("full.jsonl"), capture_output=True, text=True, timeout=300).returncode == 0
        proc = subprocess.Popen(cli("cut.jsonl"), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                start_new_session=True)
        cut = tmp_path / "cut.jsonl"
        deadline = time.monotonic() + 120
        while not (cut.exists() and cut.read_text().count("\n") >= 2) and proc.poll() is None:
            assert time.monotonic() < deadline, "estimate-q0 wrote nothing in 120 s"
            time.sleep(0.05)
        os.killpg(proc.pid, signal.SIGUSR1)  # the whole process group, as srun delivers it
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err[-3000:]
        assert "estimate-q0: stopped by SIGUSR1; the output keeps every finished item" in out
        assert "Traceback" not in err, err[-3000:]
        saved = [json.loads(line) for line in cut.read_text().splitlines()]
        assert 2 <= len(saved) < limit  # stopped mid-run, nothing finished was lost
        before = PacedEngine.calls
        resumed = subprocess.run(cli("cut.jsonl"), capture_output=True, text=True, timeout=300)
        assert resumed.returncode == 0, resumed.stderr[-3000:]
        assert PacedEngine.calls - before == 4 * (limit - len(saved))  # the missing prompts' samples, no more
    assert cut.read_bytes() == (tmp_path / "full.jsonl").read_bytes()


def test_cli_pts_through_megatron_spo_with_the_sandbox(engine, tokenizer, sandbox_ok, tmp_path, capsys):
    """A code problem passed by any program that prints nothing. A response starting with '#' is a comment
    (passes while no newline follows), so the first token decides: S(0) ~ 0 and S ~ 1 after it."""
    from megatron_spo import cli

    (tmp_path / "problems.jsonl").write_text('{"id": "quiet", "prompt": "Print nothing.", "tests": [["", ""]]}\n')
    prompt = tokenizer("Problem:\nPrint nothing.\n\nSolution:\n")["input_ids"]
    response = tokenizer("#abcdefg", add_special_tokens=False)["input_ids"]
    record = {"prompt_id": "quiet", "prompt_tokens": prompt, "response_tokens": response, "reward": 0.0,
              "source": "reference", "policy_version": 0}
    (tmp_path / "in.jsonl").write_text(json.dumps(record) + "\n")
    argv = ["pts", "--engine-url", engine.url, "--task", "jsonl", "--data", str(tmp_path / "problems.jsonl"),
            "--trajectories", str(tmp_path / "in.jsonl"), "--out", str(tmp_path / "mc.jsonl"), "-k", "8",
            "--threshold", "0.3", "--max-new-tokens", "8", "--sandbox-slots", "1", "--no-progress"]
    assert cli.main(argv) == 0
    stdout = capsys.readouterr().out
    assert "1 annotated trajectories" in stdout and "32 rollouts, 1 pivotal tokens" in stdout
    [out] = [json.loads(x) for x in (tmp_path / "mc.jsonl").read_text().splitlines()]
    # (0,8) -> 4; (0,4) -> 2; (0,2) -> 1; (0,1) is the pivotal first token; (4,8) and the rest are flat
    assert [m["t"] for m in out["mc_targets"]] == [0, 1, 3]
    assert all(m["success_prob"] >= 0.7 for m in out["mc_targets"]), out["mc_targets"]
    assert {k: out[k] for k in record if k != "source"} == {k: record[k] for k in record if k != "source"}
    # a re-run finds the trajectory done: nothing searched
    assert cli.main(argv) == 0
    assert "this run: 0 searched, 0 rollouts" in capsys.readouterr().out


def test_each_distinct_completion_is_scored_once():
    from megatron_spo.engine_tools.sampling import score_all

    class Counting(TextReward):
        def __init__(self, needle):
            super().__init__(needle)
            self.seen = []

        async def score(self, problem, text):
            self.seen.append(text)
            return await super().score(problem, text)

    reward = Counting("ok")
    results = asyncio.run(score_all(reward, None, ["ok", "bad", "ok", "ok", "bad", "x"]))
    assert [r.passed for r in results] == [True, False, True, True, False, False]
    assert reward.seen == ["ok", "bad", "x"]


def test_bad_tool_inputs_fail_with_one_line_naming_what_and_where(tmp_path):
    from megatron_spo.data.trajectory import RecordError

    bad = {"prompt_id": "s", "prompt_tokens": [1], "response_tokens": [5], "reward": "high", "source": "x",
           "policy_version": 0}
    with pytest.raises(RecordError, match="trajectory 0: field 'reward': must be a finite number, got 'high'"):
        asyncio.run(pivotal_token_search([bad], {"s": P("s")}, None, None, str))
    with pytest.raises(FileNotFoundError, match="q0 file '.*nope.jsonl' not found"):
        read_q0(tmp_path / "nope.jsonl")
    (tmp_path / "junk.jsonl").write_text('{"prompt_id": "a", "s0": 0.5, "q0": -0.1, "n": 2, "correct": 1}\nnot json\n')
    with pytest.raises(ValueError, match="junk.jsonl:2: not a result record of this tool: 'not json'"):
        read_q0(tmp_path / "junk.jsonl")
    with pytest.raises(ValueError, match="--task jsonl needs --data PATH"):
        from megatron_spo.data.problems import load_problems

        load_problems("jsonl")
