"""code_feedback: the model writes a program, the sandbox runs it on the problem's public tests, a failure comes back
as the observation and the model revises; the episode's reward is from the hidden tests.

Each step runs the turn's program (rewards/code_reward.extract_program) once in the sandbox on the public tests and
the hidden ones (rollout.env.final_reward=hidden) together. Done when every public test passes or at max_turns; the
reward returned at every step is the one the episode would have if it ended there: 0 when every hidden test passes
(the public ones when the problem has no hidden tests, or with final_reward=tests), else -1. The observation of a
failure names the first failing public test (docs/multi-turn.md, "code_feedback"):

    Test 2 of 3 failed: wrong answer.
    Input:
    4
    Expected output:
    14
    Your output:
    13

Input, expected and actual output (and the error output of a crash or a timeout) are each escaped and cut to
rollout.env.feedback_chars characters (environments/base.bounded); the sandbox itself bounds what a program may
write and how long it may run. Function-call tests (a problem's harness) show the call's input and expected value and
the error output, not what the program printed.
"""

from __future__ import annotations

from typing import Any

from megatron_spo.config import ConfigError
from megatron_spo.environments.base import FIELD, EnvContext, bounded
from megatron_spo.rewards.code_reward import extract_program, reward_from_report
from megatron_spo.rewards.reward import FAIL_REWARD
from megatron_spo.rewards.sandbox import TestReport

STATUS_WORDS = {"wrong_answer": "wrong answer", "timeout": "time limit exceeded", "memory": "memory limit exceeded",
                "runtime_error": "runtime error", "output_limit": "output limit exceeded"}
NO_PROGRAM = "No program found in your answer: write the whole program again."


class CodeFeedback:
    """One conversation on one code problem (anything with ``tests`` and optionally ``hidden_tests``, ``harness``,
    ``time_limit_s``, ``memory_mb``: data/problem.Problem, the toy task's problems)."""

    needs_sandbox = True

    def __init__(self, ctx: EnvContext):
        if ctx.sandbox is None:
            raise ConfigError(f"{FIELD}: code_feedback runs programs: it needs the sandbox (a run with code problems "
                              "starts one from its sandbox: section)")
        self.ctx, self.problem, self.turns = ctx, None, 0

    async def reset(self, problem: Any) -> None:
        if getattr(problem, "kind", "code") != "code":
            raise ValueError(f"code_feedback: problem {problem.id} is a {problem.kind} problem, not a code problem")
        self.problem, self.turns = problem, 0
        return None

    async def step(self, model_turn: str) -> tuple[str | None, bool, float]:
        self.turns += 1
        last = self.turns >= self.ctx.config.max_turns
        p = self.problem
        harness = getattr(p, "harness", None)
        program = extract_program(model_turn, continuation=bool(harness is not None and harness.prefix))
        public = list(p.tests)
        hidden = list(getattr(p, "hidden_tests", ())) if self.ctx.config.final_reward == "hidden" else []
        if not (public or hidden):
            return None, True, FAIL_REWARD  # nothing to run it on
        if program is None:
            return (None, True, FAIL_REWARD) if last or not public else (NO_PROGRAM, False, FAIL_REWARD)
        limits = {k: v for k in ("time_limit_s", "memory_mb") if (v := getattr(p, k, None)) is not None}
        report = await self.ctx.sandbox.run(program, public + hidden, harness=harness, **limits)
        shown, scored = report.outcomes[:len(public)], report.outcomes[len(public):] if hidden else None
        reward = reward_from_report(TestReport(scored if scored is not None else shown))
        failing = next((i for i, o in enumerate(shown) if o.status != "ok"), None)
        if failing is None or last:
            return None, True, reward
        return self.feedback(failing, public[failing], shown[failing], len(public), harness is not None), False, reward

    def feedback(self, index: int, test: tuple[str, str], outcome, total: int, call: bool) -> str:
        """The observation of the failing public test ``index`` (0-based) of ``total``."""
        limit = self.ctx.config.feedback_chars
        lines = [f"Test {index + 1} of {total} failed: {STATUS_WORDS.get(outcome.status, outcome.status)}.",
                 "Input:", bounded(test[0].rstrip("\n"), limit)]
        if test[1]:
            lines += ["Expected output:", bounded(test[1].rstrip("\n"), limit)]
        if not call:
            lines += ["Your output:", bounded(outcome.stdout_head.rstrip("\n"), limit) or "(nothing)"]
        if outcome.stderr_tail.strip() and outcome.status != "wrong_answer":
            lines += ["Error output:", last_lines(outcome.stderr_tail, limit)]
        return "\n".join(lines)


def last_lines(text: str, limit: int) -> str:
    """The last lines of ``text`` that fit in ``limit`` characters (at least the last one, cut from its start: a
    traceback's exception line), bounded."""
    lines, used = [], 0
    for line in reversed(text.strip("\n").splitlines()):
        if lines and used + len(line) + 1 > limit:
            break
        lines.insert(0, line)
        used += len(line) + 1
    return bounded("\n".join(lines), limit)
