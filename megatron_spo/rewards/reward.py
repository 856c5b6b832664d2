"""The reward interface the rollout manager calls.

    rewards = RewardPool(SandboxPool())
    result = await rewards.score(problem, completion_text)     # RewardResult(reward=0.0 | -1.0, passed, info)

A problem is anything with ``id``, ``tests`` and optionally ``kind`` ("code" / "math"), ``answer``,
``answer_format`` ("gsm8k": the completion's answer after '####', else its \\boxed{}), ``harness`` (a
sandbox.CallHarness: function-call tests), ``time_limit_s``, ``memory_mb`` (megatron_spo.data.tasks.Problem, or the
toy task's problems).
Code is scored in the sandbox pool; math answers by math-verify in the judge's worker processes (MathJudge, called
from a worker thread, never in the event loop).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field
from typing import Any, Protocol

from megatron_spo.rewards.code_reward import extract_program, reward_from_report
from megatron_spo.rewards.gsm8k import gsm8k_answer
from megatron_spo.rewards.math_answer import MathJudge, math_reward
from megatron_spo.rewards.sandbox import SandboxPool, TestReport

PASS_REWARD, FAIL_REWARD = 0.0, -1.0


@dataclass(frozen=True)
class RewardResult:
    reward: float
    passed: bool
    info: dict[str, Any] = field(default_factory=dict)


class RewardFn(Protocol):
    def __call__(self, problem: Any, completion_text: str) -> RewardResult: ...


def _code_result(report: TestReport) -> RewardResult:
    return RewardResult(reward_from_report(report), report.passed,
                        {"statuses": list(report.statuses), "wall_s": round(report.wall_s, 4)})


def _resolve(outer: Future, inner: Future) -> None:
    """Copy the sandbox's outcome to the caller's future, unless the caller cancelled it (e.g. at shutdown)."""
    if outer.cancelled():
        return
    try:
        if inner.exception() is not None:
            outer.set_exception(inner.exception())
        else:
            outer.set_result(_code_result(inner.result()))
    except InvalidStateError:  # cancelled between the check and the set
        pass


@dataclass(frozen=True)
class RewardKind:
    """How the problems of one ``kind`` are scored; ``sandbox``: it runs programs (needs a SandboxPool)."""

    name: str
    sandbox: bool


# THE list of reward kinds, by a problem's ``kind``; a user's own reward is a hook (task.reward) instead.
REWARD_KINDS: dict[str, RewardKind] = {k.name: k for k in (RewardKind("code", True), RewardKind("math", False))}


def needs_sandbox(problems: Sequence[Any], custom_reward: Any = None) -> bool:
    """Whether scoring these problems runs programs (a custom reward, or only math problems, never does)."""
    if custom_reward is not None:
        return False
    return any(REWARD_KINDS[getattr(p, "kind", "code")].sandbox for p in problems)


class RewardPool:
    """Scores completions: programs in the sandbox pool, math answers with math-verify, or every problem with a
    custom reward (``custom(problem, completion_text) -> float``, a config hook; run in a worker thread).
    Thread- and asyncio-safe. hidden=True also runs the problem's hidden tests (evaluation); rewards use only
    ``tests``."""

    def __init__(self, sandbox: SandboxPool | None = None, *, judge: MathJudge | None = None,
                 hidden: bool = False, custom=None):
        self.sandbox = sandbox
        self.judge = judge or MathJudge()
        self.hidden = hidden
        self.custom = custom

    def _custom(self, problem: Any, completion_text: str) -> RewardResult:
        value = self.custom(problem, completion_text)
        if isinstance(value, RewardResult):
            return value
        try:
            reward = float(value)
        except (TypeError, ValueError):
            raise TypeError(f"custom reward returned {type(value).__name__} for problem {problem.id}, "
                            "expected a float") from None
        return RewardResult(reward, reward >= PASS_REWARD, {"custom": True})

    def submit(self, problem: Any, completion_text: str) -> Future:
        """Future[RewardResult]. A code completion without a program fails without running anything."""
        future: Future = Future()
        if self.custom is not None:
            future.set_result(self._custom(problem, completion_text))
            return future
        if getattr(problem, "kind", "code") == "math":
            future.set_result(self._math(problem, completion_text))
            return future
        harness = getattr(problem, "harness", None)
        program = extract_program(completion_text, continuation=bool(harness is not None and harness.prefix))
        tests = list(problem.tests) + (list(getattr(problem, "hidden_tests", ())) if self.hidden else [])
        if program is None or not tests:
            why = "no_program" if program is None else "no_tests"
            future.set_result(RewardResult(FAIL_REWARD, False, {"error": why}))
            return future
        if self.sandbox is None:
            raise ValueError(f"RewardPool: problem {problem.id} is a code problem but no SandboxPool was given")
        limits = {k: v for k in ("time_limit_s", "memory_mb") if (v := getattr(problem, k, None)) is not None}
        if harness is not None:
            limits["harness"] = harness
        inner = self.sandbox.submit(program, tests, **limits)
        inner.add_done_callback(lambda f: _resolve(future, f))
        return future

    def __call__(self, problem: Any, completion_text: str) -> RewardResult:
        return self.submit(problem, completion_text).result()

    async def score(self, problem: Any, completion_text: str) -> RewardResult:
        if self.custom is not None:  # user code may block: keep it off the event loop
            return await asyncio.to_thread(self._custom, problem, completion_text)
        if getattr(problem, "kind", "code") == "math":  # a verdict may take seconds: keep it off the event loop
            return await asyncio.to_thread(self._math, problem, completion_text)
        return await asyncio.wrap_future(self.submit(problem, completion_text))

    def _math(self, problem: Any, completion_text: str) -> RewardResult:
        if getattr(problem, "answer", None) is None:
            raise ValueError(f"RewardPool: math problem {problem.id} has no reference answer")
        if getattr(problem, "answer_format", "boxed") == "gsm8k" and (hashed := gsm8k_answer(completion_text)):
            completion_text = f"\\boxed{{{hashed}}}"  # GSM8K's '#### 42', judged as the boxed answer would be
        reward, info = math_reward(completion_text, problem.answer, judge=self.judge)
        return RewardResult(reward, reward == PASS_REWARD, info)

    def close(self) -> None:
        self.judge.close()
