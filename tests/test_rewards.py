"""Rewards: program extraction, code reward through the sandbox, MATH answer extraction and equivalence."""

from __future__ import annotations

import asyncio
import os
import time

import pytest

from megatron_spo.data.tasks import Problem
from megatron_spo.rewards.code_reward import extract_program
from megatron_spo.rewards.config import SandboxConfig
from megatron_spo.rewards.math_answer import MathJudge, answers_match, last_boxed, math_reward
from megatron_spo.rewards.reward import RewardPool
from megatron_spo.rewards.sandbox import SandboxPool, SandboxUnavailableError


# ---------------------------------------------------------------------------------------------
# Program extraction
# ---------------------------------------------------------------------------------------------
def test_extract_program_takes_the_last_python_block():
    text = "Idea first.\n```python\nprint(1)\n```\nBetter:\n```python3\nprint(2)\n```\nDone."
    assert extract_program(text) == "print(2)\n"
    assert extract_program("```\nx = 1\nprint(x)\n```") == "x = 1\nprint(x)\n"
    assert extract_program("Here:\n```python\nprint(3)\n") == "print(3)\n"  # truncated generation
    assert extract_program("print(4)\n") == "print(4)\n"  # no fence: the raw completion
    assert extract_program("```cpp\nint main() {}\n```") is None
    assert extract_program("```cpp\nint main(){}\n```\n```python\nprint(5)\n```") == "print(5)\n"
    assert extract_program("   ") is None


# ---------------------------------------------------------------------------------------------
# MATH answers
# ---------------------------------------------------------------------------------------------
def test_last_boxed_handles_nesting_and_forms():
    assert last_boxed(r"first \boxed{1}, finally \boxed{\frac{1}{\sqrt{2}}}.") == r"\frac{1}{\sqrt{2}}"
    assert last_boxed(r"$\boxed{\{1, 2\}}$") == r"\{1, 2\}"
    assert last_boxed(r"so $\boxed 5$") == "5"
    assert last_boxed(r"\fbox{7}") == "7"
    assert last_boxed(r"\boxed{1") is None
    assert last_boxed("no answer") is None


@pytest.fixture(scope="module")
def judge():
    j = MathJudge(timeout_s=10.0)
    yield j
    j.close()


@pytest.mark.parametrize("a, b, same", [
    ("0.5", r"\frac12", True),
    (r"\frac{\sqrt{2}}{2}", r"\frac{1}{\sqrt{2}}", True),
    (r"2\pi", r"\pi \cdot 2", True),
    (r"\dfrac{3}{4}", "0.75", True),
    ("x^2+2x+1", "(x+1)^2", True),
    ("(1, 2)", "(1,2)", True),
    ("2", "3", False),
    ("(1,2)", "(2,1)", False),  # an ordered pair ("1,2" vs "2,1" is a set of solutions: tests/test_math_judge.py)
    (r"\text{Monday}", r"\text{Tuesday}", False),
    (r"\sqrt{8}", r"2\sqrt{2}", True),
])
def test_answers_match(judge, a, b, same):
    assert answers_match(a, b, judge=judge) is same


def test_untrusted_text_is_never_evaluated(tmp_path, judge):
    marker = tmp_path / "pwned"
    for evil in (f"__import__('os').system('touch {marker}')", "x.real", "lambda: 1"):
        assert judge.verdict(evil, "0")[0] is False
    assert not marker.exists()


def test_a_runaway_comparison_is_cut_at_the_timeout():
    judge = MathJudge(timeout_s=1.0, workers=1)
    try:
        judge.warm()  # start the worker outside the timing
        start = time.monotonic()
        assert answers_match("9^{9^{9^{9}}}", "1", judge=judge) is False
        assert time.monotonic() - start < 5.0
        assert judge.verdict("2", "1+1") == (True, "match")  # a fresh worker took over
    finally:
        judge.close()


def test_math_reward_values(judge):
    assert math_reward(r"... so the answer is $\boxed{\frac{1}{2}}$.", "0.5", judge=judge)[0] == 0.0
    reward, info = math_reward(r"... $\boxed{3}$", "4", judge=judge)
    assert reward == -1.0 and info["predicted"] == "3" and info["reason"] == "wrong"
    assert math_reward("I don't know", "4", judge=judge) == (-1.0, {"predicted": None, "reference": "4",
                                                                   "passed": False, "reason": "no_answer"})


# ---------------------------------------------------------------------------------------------
# The reward pool (code in the sandbox, math with math-verify)
# ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def rewards(judge):
    if os.geteuid() != 0:
        pytest.skip("per-slot uids need root (the CI machine runs as root)")
    try:
        sandbox = SandboxPool(SandboxConfig(slots=2, uid_base=2_000_000))
    except SandboxUnavailableError as err:
        pytest.skip(f"no bubblewrap here: {err}")
    yield RewardPool(sandbox, judge=judge)
    sandbox.close()


ADD = Problem(id="add", prompt="Add two numbers.", tests=(("1 2\n", "3\n"), ("5 7\n", "12\n")),
              hidden_tests=(("-1 1\n", "0\n"),), time_limit_s=1.0, memory_mb=256)


def test_code_reward_is_zero_only_when_every_test_passes(rewards):
    good = "Read both and add:\n```python\na, b = map(int, input().split())\nprint(a + b)\n```"
    almost = "```python\na, b = map(int, input().split())\nprint(a + b if a < 5 else 0)\n```"
    r = rewards(ADD, good)
    assert (r.reward, r.passed, r.info["statuses"]) == (0.0, True, ["ok", "ok"])
    r = rewards(ADD, almost)
    assert (r.reward, r.passed, r.info["statuses"]) == (-1.0, False, ["ok", "wrong_answer"])
    r = rewards(ADD, "```cpp\nint main() {}\n```")
    assert (r.reward, r.passed, r.info) == (-1.0, False, {"error": "no_program"})


def test_code_reward_function(rewards):
    from megatron_spo.rewards.code_reward import code_reward

    tests = [("3\n", "9\n"), ("-2\n", "4\n")]
    good = "```python\nn = int(input())\nprint(n * n)\n```"
    assert code_reward(good, tests, time_limit_s=1, memory_mb=256, pool=rewards.sandbox) == (
        0.0, {"statuses": ["ok", "ok"], "wall_s": pytest.approx(0, abs=10)})
    reward, info = code_reward("```python\nprint(9)\n```", tests, pool=rewards.sandbox)
    assert (reward, info["statuses"]) == (-1.0, ["ok", "wrong_answer"])
    assert code_reward("no code here ```java\nclass A {}\n```", tests, pool=rewards.sandbox) == (
        -1.0, {"error": "no_program"})


def test_reward_pool_async_mixes_code_and_math(rewards):
    math = Problem(id="m", prompt="1/2 = ?", kind="math", answer=r"\frac{1}{2}", source="math")
    good = "```python\nprint(sum(map(int, input().split())))\n```"

    async def score_all():
        return await asyncio.gather(rewards.score(ADD, good), rewards.score(math, r"$\boxed{0.5}$"),
                                    rewards.score(math, r"$\boxed{2}$"))

    results = asyncio.run(score_all())
    assert [r.reward for r in results] == [0.0, 0.0, -1.0]
    hidden = RewardPool(rewards.sandbox, judge=rewards.judge, hidden=True)
    assert hidden(ADD, good).info["statuses"] == ["ok", "ok", "ok"]


def test_a_cancelled_reward_future_ignores_the_late_sandbox_result():
    """At shutdown the caller cancels pending rewards; the sandbox's late answer must not raise in its thread."""
    from concurrent.futures import Future

    from megatron_spo.rewards.reward import _resolve
    from megatron_spo.rewards.sandbox import SandboxError

    outer, inner = Future(), Future()
    assert outer.cancel()
    inner.set_exception(SandboxError("sandbox pool host process exited"))
    _resolve(outer, inner)  # before the fix: InvalidStateError from the callback
    assert outer.cancelled()
    live, failed = Future(), Future()
    failed.set_exception(SandboxError("boom"))
    _resolve(live, failed)
    with pytest.raises(SandboxError, match="boom"):
        live.result()
