"""The math judge (rewards/math_answer.py): math-verify held against the hand-written sympy judge it replaced
(normalisation + sympy, up to 91b76f0) on a battery where both should agree, the differences each explained, and
hostile answers as one bounded verdict each."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from megatron_spo.data.tasks import Problem
from megatron_spo.rewards.math_answer import MAX_ANSWER_CHARS, REASONS, MathJudge, math_reward
from megatron_spo.rewards.reward import RewardPool

# (predicted, reference, verdict): both judges give it. "kept" rows are decided by megatron_spo before
# math-verify, which alone gets them wrong (test_what_math_verify_misses_is_decided_before_it).
AGREE = [
    # integers
    ("42", "42", True), ("007", "7", True), ("42", "43", False), ("-7", "-7", True), ("-3", "3", False),
    ("1,000", "1000", True), ("1000000", "1,000,000", True), ("10,\\!000", "10000", True),
    ("1\\,000", "1000", True),  # kept: a thin space between digit groups (math-verify reads 1*000)
    ("1\\,000", "0", False),  # kept: the same, or 1\,000 would equal 0
    ("12345678901234567890", "12345678901234567891", False),
    # decimals
    ("2.50", "2.5", True), ("3.0", "3", True), (".5", "0.5", True), ("-0.5", "-.5", True), ("6", "6.0", True),
    ("0.333", "\\frac13", False), ("10", "10.0001", False), ("\\$18.90", "18.90", True),
    ("0.1234567", "0.1234568", False),  # kept: plain numbers compared exactly (math-verify rounds to 6 decimals)
    # fractions
    ("0.5", "\\frac12", True), ("\\frac{1}{2}", "0.5", True), ("1/2", "\\frac{1}{2}", True),
    ("\\dfrac{3}{4}", "0.75", True), ("\\tfrac34", "\\frac{3}{4}", True), ("\\frac{6}{4}", "\\frac{3}{2}", True),
    ("-\\frac{1}{2}", "-0.5", True), ("\\frac{-1}{2}", "-\\frac{1}{2}", True), ("\\frac92", "4.5", True),
    ("\\frac{1}{2}+\\frac{1}{3}", "\\frac{5}{6}", True), ("\\frac{1}{3}", "\\frac{1}{4}", False),
    ("0.875", "\\frac{7}{8}", True), ("\\frac{ 7 }{ 8 }", "\\frac78", True), ("2^{-1}", "\\frac12", True),
    # square roots
    ("\\frac{\\sqrt{2}}{2}", "\\frac{1}{\\sqrt{2}}", True), ("\\sqrt{8}", "2\\sqrt{2}", True),
    ("\\sqrt2", "\\sqrt{2}", True), ("\\sqrt[3]{8}", "2", True), ("2\\sqrt{3}", "\\sqrt{12}", True),
    ("\\sqrt{3}", "\\sqrt{2}", False), ("\\sqrt{2}/2", "\\frac{\\sqrt2}{2}", True), ("10\\sqrt{2}", "\\sqrt{200}", True),
    ("\\frac{1}{\\sqrt{3}}", "\\frac{\\sqrt3}{3}", True), ("\\dfrac{\\sqrt{5}-1}{2}", "\\frac{-1+\\sqrt5}{2}", True),
    # percentages
    ("50\\%", "50", True), ("50%", "50", True), ("25", "25\\%", True), ("40\\%", "50", False),
    # units, degrees, money, text around the answer
    ("5\\text{ cm}", "5", True), ("5 \\text{ cm}", "5", True), ("5\\text{ meters}", "5", True),
    ("5 \\mbox{ cm}", "5", True), ("5 \\text{ apples}", "5", True), ("4", "4\\text{ inches}", True),
    ("\\frac{1}{2}\\text{ inches}", "\\frac12", True), ("6\\text{ cm}", "5", False),
    ("10^\\circ", "10", True), ("10^{\\circ}", "10", True), ("120^\\circ", "120", True),
    ("\\$5", "5", True), ("\\$5.00", "5", True),
    ("\\$5.", "5", True), ("5.", "5", True),  # kept: a full stop ending the answer
    ("x = 5", "5", True), ("x = .5", "0.5", True), ("k = 5", "5", True), ("2x+3", "y=2x+3", True),
    ("\\text{Monday}", "\\text{Monday}", True), ("\\text{Monday}", "\\text{Tuesday}", False),
    ("\\text{Monday.}", "\\text{Monday}", True),  # kept: the full stop, inside the \text{}
    ("\\text{even}", "\\text{odd}", False), ("\\text{(A)}", "A", True), ("\\text{C}", "\\text{(C)}", True),
    # equivalent expressions
    ("2\\pi", "\\pi \\cdot 2", True), ("2\\pi", "6.28", False), ("x^2+2x+1", "(x+1)^2", True),
    ("x^2+1", "(x+1)^2", False), ("x^2 - 4", "(x-2)(x+2)", True), ("3\\cdot 4", "12", True), ("3\\times 4", "12", True),
    ("2^{10}", "1024", True), ("\\sin(\\pi/2)", "1", True), ("\\frac{a}{b}", "a/b", True), ("y = 2x+1", "2x+1", True),
    ("3+4i", "4i+3", True), ("\\dfrac{1}{2}x", "\\frac{x}{2}", True), ("\\frac{\\pi}{4}", "\\frac14\\pi", True),
    ("2 \\pi r", "2\\pi r", True), ("x^3", "x^2", False), ("\\frac{1}{e}", "e^{-1}", True), ("-\\infty", "-\\infty", True),
    # tuples, intervals, lists
    ("(1, 2)", "(1,2)", True), ("\\left( 1, 2 \\right)", "(1,2)", True), ("(2,1)", "(1,2)", False),
    ("1, 2, 3", "1,2,3", True), ("x = 1, 2", "1, 2", True), ("[1, 2]", "(1, 2)", False),
    ("(-\\infty, 3)", "(-\\infty,3)", True), ("[0, 1)", "[0,1)", True), ("\\left\\{ 1, 2 \\right\\}", "\\{1,2\\}", True),
    # no answer
    ("", "0", False),
]

# Where they differ: (predicted, reference, math-verify's verdict, the old judge's, which is right and why).
DIFFER = [
    ("1,2", "2,1", True, False, "math-verify: a bare list is a set of solutions (MATH's 'all solutions, separated by "
     "commas'); the old judge compared it in order. An ordered answer is a tuple, (2,1) vs (1,2): both reject"),
    ("\\{1, 2\\}", "\\{2, 1\\}", True, False, "math-verify: sets are unordered; the old judge compared in order"),
    ("\\pm 2", "2, -2", True, False, "math-verify: \\pm expands to both roots; the old judge could not parse it"),
    ("x=1 \\text{ or } x=2", "1, 2", True, False, "math-verify: solutions joined by 'or' and assignments"),
    ("1 \\text{ and } 2", "1, 2", True, False, "math-verify: a list joined by 'and'"),
    ("(2, \\infty)", "x > 2", True, False, "math-verify: the interval is the inequality's solution set (not the "
     "other way round: BOTH_MISS)"),
    ("\\emptyset", "\\{\\}", True, False, "math-verify: both are the empty set; the old judge knew no \\emptyset"),
    ("50\\%", "0.5", True, False, "math-verify: 50% is 0.5 (it accepts 50 too); the old judge dropped the %"),
    ("0.25", "25\\%", True, False, "math-verify, as above"),
    ("5\\text{ cm}^2", "5", True, False, "math-verify: a unit with a power; the old unit rule stopped at the ^2"),
    ("5\\,\\text{cm}", "5", True, False, "math-verify: a thin space before the unit; the old rule missed it"),
    ("\\text{monday}", "\\text{Monday}", True, False, "math-verify: a word's case; the old judge compared exactly"),
    ("\\textbf{(C)}", "C", True, False, "math-verify: a bold choice letter; the old judge knew no \\textbf"),
    ("\\ln(e)", "1", True, False, "math-verify: e is Euler's number; the old judge read it as a variable"),
    ("\\log_2 8", "3", True, False, "math-verify: a log's base; the old judge could not parse the subscript"),
    ("\\sqrt{x^2}", "|x|", True, False, "math-verify: equal for real x (it treats symbols as real); the old judge "
     "could not parse |x|"),
    ("3\\frac{1}{3}", "\\frac{10}{3}", True, False, "math-verify: a mixed number; the old judge read 3 * 1/3"),
    ("\\frac{3}{2}", "1\\frac{1}{2}", True, False, "math-verify, as above"),
    ("\\frac12", "1:2", True, False, "math-verify: a ratio is its quotient"),
    ("\\boxed{5}", "5", True, False, "math-verify: a box inside the box; the old judge could not parse it"),
    ("\\begin{pmatrix} 1 \\\\ 2 \\end{pmatrix}", "\\begin{pmatrix}1\\\\2\\end{pmatrix}", True, False,
     "math-verify: matrices; the old judge compared them as strings, spaces and all"),
    ("\\frac{1}{3}", "0.333333", True, False, "math-verify, by design: a reference rounded to 6 decimals accepts the "
     "exact value (0.333 does not: AGREE); the old judge wanted 1e-9"),
    ("\\pi", "3.14159265", True, False, "math-verify, as above (compared to 6 decimals)"),
]

# Equal answers that neither judge accepts (both wrong); held so that a math-verify upgrade that fixes one shows.
BOTH_MISS = [
    ("x > 2", "(2, \\infty)"),  # math-verify compares a relation with a set only when the prediction is the set
    ("e^{i\\pi}", "-1"),  # i is a symbol unless the text looks complex to math-verify
    ("\\sqrt{-4}", "2i"),  # symbols and roots are real
    ("\\text{4 inches}", "4"),  # a number inside \text{} is a word
    ("1e3", "1000"),  # e is Euler's number: 1 * e * 3
]


@pytest.fixture(scope="module")
def judge():
    j = MathJudge(timeout_s=10.0)
    yield j
    j.close()


def test_the_battery_agrees_with_the_old_judge(judge):
    wrong = [(a, b, want) for a, b, want in AGREE if judge.verdict(a, b)[0] is not want]
    assert not wrong
    assert (len(AGREE), len(DIFFER), len(BOTH_MISS)) == (101, 23, 5)  # the counts docs/engineering-notes.md gives


@pytest.mark.parametrize("a, b, new, old, why", DIFFER, ids=[f"{a} vs {b}" for a, b, *_ in DIFFER])
def test_where_the_judges_differ(judge, a, b, new, old, why):
    assert new is not old and why
    assert judge.verdict(a, b)[0] is new


def test_what_both_miss(judge):
    assert [judge.verdict(a, b) for a, b in BOTH_MISS] == [(False, "wrong")] * len(BOTH_MISS)


def test_what_math_verify_misses_is_decided_before_it(judge):
    """The raw answers straight to a worker (no _prepare, no exact numbers): math-verify alone is wrong on each."""
    worker = judge._workers[0]
    for a, b in [("5.", "5"), ("\\$5.", "5"), ("\\text{Monday.}", "\\text{Monday}"), ("1\\,000", "1000")]:
        assert worker.ask(a, b, 10.0)[0] is False, (a, b)
    for a, b in [("1\\,000", "0"), ("0.1234567", "0.1234568")]:
        assert worker.ask(a, b, 10.0) == (True, "match"), (a, b)


def test_math_reward_reads_the_last_box_only(judge):
    for text, reward, reason in [
        (r"... so the answer is $\boxed{\frac{1}{2}}$.", 0.0, "match"),
        (r"first \boxed{1}, finally \boxed{0.50}", 0.0, "match"),
        (r"\fbox{0.5}", 0.0, "match"),
        (r"\boxed{1/3}", -1.0, "wrong"),
        ("The answer is 0.5.", -1.0, "no_answer"),  # math-verify alone would take the last number: we ask for a box
        (r"\boxed{0.5", -1.0, "no_answer"),
        (r"\boxed{ }", -1.0, "no_answer"),
    ]:
        got, info = math_reward(text, r"\frac{1}{2}", judge=judge)
        assert (got, info["reason"], info["passed"]) == (reward, reason, reward == 0.0), text


def test_the_reward_pool_scores_math_concurrently(judge):
    pool = RewardPool(judge=judge)
    problem = Problem(id="m", prompt="1/2 = ?", kind="math", answer=r"\frac{1}{2}", source="math")
    texts = [r"\boxed{0.5}", r"\boxed{50\%}", r"\boxed{\frac{2}{4}}", r"\boxed{2}", "no box"] * 4

    async def score_all():
        return await asyncio.gather(*(pool.score(problem, t) for t in texts))

    results = asyncio.run(score_all())
    assert [r.reward for r in results] == [0.0, 0.0, 0.0, -1.0, -1.0] * 4
    assert [r.info["reason"] for r in results[:5]] == ["match", "match", "match", "wrong", "no_answer"]
    assert 1 <= judge.started <= 2


# ---------------------------------------------------------------------------------------------
# Hostile answers: one bounded verdict each
# ---------------------------------------------------------------------------------------------
TIMEOUT_S, SLACK_S = 2.0, 3.0  # slack: a killed worker's exit and a loaded CI machine (measured ~0.1 s alone)
HOSTILE = {
    "tower": "9^{9^{9^{9}}}",
    "huge power": "7^{123456789}",
    "huge factorial": "100000000!",
    "huge binomial": "\\binom{10^{7}}{5000000}",
    "999 parentheses": "(" * 999 + "1" + ")" * 999,
    "1000 braces": "{" * 1000 + "}" * 1000,
    "300 nested powers": "9^{" * 300 + "9" + "}" * 300,
    "1 MB of braces": "{" * 500_000 + "}" * 500_000,
    "1 MB sum": "x+" * 500_000 + "1",
    "python": "__import__('os').system('echo pwned')",
}


@pytest.fixture(scope="module")
def uncapped():
    j = MathJudge(timeout_s=TIMEOUT_S, workers=1, max_answer_chars=None)  # 1 MB answers reach the worker
    yield j
    j.close()


@pytest.mark.parametrize("name", list(HOSTILE))
def test_a_hostile_answer_is_one_bounded_verdict(uncapped, name):
    uncapped.warm()  # a worker's start-up is not verdict time
    start = time.monotonic()
    passed, reason = uncapped.verdict(HOSTILE[name], "1")
    elapsed = time.monotonic() - start
    assert passed is False and reason in REASONS and reason != "match"
    assert elapsed < TIMEOUT_S + SLACK_S, f"{name}: {elapsed:.2f} s"
    assert uncapped.verdict("1+1", "2") == (True, "match")  # the judge still works


def test_a_long_answer_is_wrong_unread(judge):
    start = time.monotonic()
    for answer in ("1" * 1_000_000, " " * 1_000_000, "{" * (MAX_ANSWER_CHARS + 1)):
        assert judge.verdict(answer, "1") == (False, "too_long")
    assert math_reward(f"\\boxed{{{'x+' * 500_000}1}}", "1", judge=judge)[1]["reason"] == "too_long"
    assert math_reward("\\boxed{" * 100_000, "1", judge=judge)[1]["reason"] == "no_answer"  # never closed
    assert time.monotonic() - start < 5.0


def test_a_verdict_past_the_deadline_kills_the_worker():
    """timeout_s under math-verify's 1 s alarm: the judge's own deadline cuts it, and a fresh worker follows."""
    judge = MathJudge(timeout_s=0.5, workers=1)
    try:
        judge.warm()
        start = time.monotonic()
        assert judge.verdict(HOSTILE["tower"], "1") == (False, "timeout")
        assert time.monotonic() - start < 0.5 + SLACK_S and judge.started == 0
        assert judge.verdict("1+1", "2") == (True, "match")
    finally:
        judge.close()


def test_a_worker_that_dies_mid_verdict_is_one_crashed_verdict():
    judge = MathJudge(timeout_s=10.0, workers=1)
    try:
        judge.warm()
        proc = judge._workers[0].proc
        threading.Timer(0.5, proc.kill).start()
        start = time.monotonic()
        assert judge.verdict(HOSTILE["tower"], "1") == (False, "crashed")
        assert time.monotonic() - start < 5.0
        assert judge.verdict("\\frac{2}{4}", "0.5") == (True, "match")
    finally:
        judge.close()


def test_the_address_space_limit_bounds_a_worker():
    judge = MathJudge(timeout_s=TIMEOUT_S, memory_mb=150, workers=1, max_answer_chars=None)  # idle: ~65 MB mapped
    try:
        judge.warm()
        start = time.monotonic()
        assert judge.verdict(HOSTILE["1 MB sum"], "1")[0] is False
        assert time.monotonic() - start < TIMEOUT_S + SLACK_S
        assert judge.verdict("1+1", "2") == (True, "match")
    finally:
        judge.close()
