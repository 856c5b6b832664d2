"""The quickstart's toy code task: correct reference programs, discriminating tests, a fixed split."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from megatron_spo.data import toy_code

# Runs (program, tests) pairs in ONE python subprocess: exec with stdin/stdout redirected, exact stdout.
_HARNESS = textwrap.dedent(
    """
    import contextlib, io, json, sys
    results = []
    for program, tests in json.load(sys.stdin):
        ok = True
        for stdin, expected in tests:
            sys.stdin = io.StringIO(stdin)
            out = io.StringIO()
            try:
                with contextlib.redirect_stdout(out):
                    exec(compile(program, "<program>", "exec"), {"__name__": "__main__"})
            except Exception:
                ok = False
                break
            if out.getvalue() != expected:
                ok = False
                break
        results.append(ok)
    sys.__stdout__.write(json.dumps(results))
    """
)


def run_programs(pairs: list[tuple[str, list[tuple[str, str]]]]) -> list[bool]:
    """Whether each program prints exactly the expected stdout on all its tests (python subprocess)."""
    proc = subprocess.run(
        [sys.executable, "-c", _HARNESS], input=json.dumps(pairs), capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


@pytest.fixture(scope="module")
def task() -> toy_code.ToyCodeTask:
    return toy_code.make_task()


def test_default_task_shape(task):
    assert len(task.problems) == 240
    assert len(task.train) == 120 and len(task.heldout) == 120
    assert len(task.sft_only) == 900 and all(p.id.startswith("sft-") for p in task.sft_only)
    assert {p.family for p in task.heldout} == set(toy_code.FAMILIES)
    for p in task.problems + task.sft_only:
        assert p.prompt == f"# {p.family}: {', '.join(p.ops)}\n"
        assert len(p.tests) == 5 and len(p.hidden_tests) == 5
        assert not {stdin for stdin, _ in p.tests} & {stdin for stdin, _ in p.hidden_tests}
        assert len(set(p.solutions)) == len(p.solutions) >= 7
    # many distinct correct programs per problem, for a soft policy to keep
    assert sum(len(p.solutions) for p in task.problems) / len(task.problems) >= 12


def test_split_is_disjoint_and_complete(task):
    train_ids = {p.id for p in task.train}
    heldout_ids = {p.id for p in task.heldout}
    assert not train_ids & heldout_ids
    assert train_ids | heldout_ids == {p.id for p in task.problems}
    assert not {p.prompt for p in task.train} & {p.prompt for p in task.heldout}
    # SFT sees the train split and SFT-only pipelines, never a held-out prompt
    sft_ids = {p.id for p in task.sft_problems}
    assert sft_ids == train_ids | {p.id for p in task.sft_only}
    assert not {p.prompt for p in task.sft_problems} & {p.prompt for p in task.heldout}
    # neighbours (the SFT noise) come from the SFT pool, same family, never the problem itself
    assert set(task.neighbour) == sft_ids
    for pid, nid in task.neighbour.items():
        p, q = task.by_id(pid), task.by_id(nid)
        assert nid in sft_ids and nid != pid and p.family == q.family


def test_reference_solutions_pass_reward_and_hidden_tests(task):
    pairs = [(s, list(p.tests + p.hidden_tests)) for p in task.problems + task.sft_only for s in p.solutions]
    results = run_programs(pairs)
    failures = [pairs[i][0] for i, ok in enumerate(results) if not ok]
    assert not failures, f"{len(failures)} reference programs fail, e.g.:\n{failures[0]}"


def test_tests_reject_a_neighbours_program(task):
    """Swapped SFT targets are wrong answers: a neighbour's program fails the problem's reward tests."""
    pairs = [(task.by_id(task.neighbour[p.id]).solutions[0], list(p.tests)) for p in task.sft_problems]
    passed = run_programs(pairs)
    assert sum(passed) <= 0.05 * len(pairs), f"{sum(passed)} of {len(pairs)} neighbour programs pass"


def test_input_slip_is_generic_and_fails_the_tests(task):
    """The slip is one fixed edit per family (whatever the operations), and a slipped program is wrong."""
    assert toy_code.with_input_slip("num", "n=int(input())\nprint(n+2)\n") == "n=input()\nprint(n+2)\n"
    assert toy_code.with_input_slip("str", "print(input()[::-1])\n") == "print(input().split()[::-1])\n"
    assert toy_code.with_input_slip("list", "a=list(map(int,input().split()))\nprint(*a)\n") == (
        "a=input().split()\nprint(*a)\n")
    assert toy_code.with_input_slip("list", "l=[int(v) for v in input().split()]\nprint(sum(l))\n") == (
        "l=[v for v in input().split()]\nprint(sum(l))\n")
    with pytest.raises(ValueError, match="no input to slip in this num program"):
        toy_code.with_input_slip("num", "print(3)\n")
    pairs = [(toy_code.with_input_slip(p.family, s), list(p.tests)) for p in task.problems for s in p.solutions[:2]]
    passed = run_programs(pairs)
    assert sum(passed) <= 0.03 * len(pairs), f"{sum(passed)} of {len(pairs)} slipped programs pass"


def test_generator_is_deterministic_across_processes(task):
    again = toy_code.make_task()
    assert again == task
    code = (
        "import hashlib, json; from megatron_spo.data import toy_code; t = toy_code.make_task(num_sft_problems=90); "
        "print(hashlib.sha256(json.dumps([[p.id, p.prompt, p.tests, p.hidden_tests, p.solutions] "
        "for p in t.problems + t.sft_only[:90]]).encode()).hexdigest())"
    )
    digests = {
        subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, check=True,
            env={**os.environ, "PYTHONHASHSEED": seed},
        ).stdout.strip()
        for seed in ("1", "2")
    }
    import hashlib

    here = hashlib.sha256(
        json.dumps([[p.id, p.prompt, p.tests, p.hidden_tests, p.solutions] for p in task.problems + task.sft_only[:90]]).encode()
    ).hexdigest()
    assert digests == {here}
    assert toy_code.make_task(seed=1, num_sft_problems=0).problems != task.problems
    # the task problems do not depend on how many SFT-only pipelines are drawn after them
    assert toy_code.make_task(num_sft_problems=0).problems == task.problems


def test_truth_and_programs_exact_values():
    assert toy_code.truth("num", ("mul 3", "add 2", "abs"))("-4\n") == "10\n"
    assert toy_code.truth("num", ("div 4",))("-7\n") == "-2\n"  # Python floor division
    assert toy_code.truth("str", ("rev", "upper", "head 3"))("hello\n") == "OLL\n"
    assert toy_code.truth("list", ("dbl", "even", "sum"))("1 2 3 4\n") == "20\n"
    assert toy_code.truth("list", ("odd", "rsort"))("3 -1 4 5\n") == "5 3 -1\n"
    # parentheses only where precedence needs them
    add_then_mul = toy_code.programs("num", ("add 2", "mul 3"))
    assert "print((int(input())+2)*3)\n" in add_then_mul
    assert not any("n+2*3" in s for s in add_then_mul)
    assert "n=int(input())\nn+=2\nn*=3\nprint(n)\n" in add_then_mul
    # x*x only for a bare name (int(input())*int(input()) would read twice)
    squares = toy_code.programs("num", ("sq",))
    assert "print(int(input())**2)\n" in squares and "x=int(input())\nprint(x*x)\n" in squares
    assert not any("input())*int(input" in s for s in squares)
    assert "print(' '.join(map(str,a)))" in toy_code.programs("list", ("sort",))[1]


def test_every_op_matters_on_the_tests(task):
    """Dropping any op of a pipeline changes some expected output: no op is a no-op on the tests."""
    for p in task.problems + task.sft_only:
        for i in range(len(p.ops)):
            shorter = toy_code.truth(p.family, p.ops[:i] + p.ops[i + 1 :])
            assert any(toy_code._safe(shorter, stdin) != out for stdin, out in p.tests), (p.id, p.ops[i])


def test_bad_arguments_name_the_parameter():
    with pytest.raises(ValueError, match=r"toy_code: num_problems must be >= 6, got 3"):
        toy_code.make_task(num_problems=3)
    with pytest.raises(ValueError, match=r"toy_code: heldout_fraction must be in \(0, 1\), got 1.0"):
        toy_code.make_task(heldout_fraction=1.0)
    with pytest.raises(ValueError, match=r"toy_code: unknown family 'sql'"):
        toy_code.programs("sql", ("select",))
    with pytest.raises(KeyError, match=r"no problem with id 'num-999'"):
        toy_code.make_task(num_problems=6, num_sft_problems=0).by_id("num-999")
    with pytest.raises(ValueError, match=r"toy_code: num_sft_problems must be >= 0, got -1"):
        toy_code.make_task(num_sft_problems=-1)


def test_reference_solutions_pass_in_the_sandbox(task):
    from megatron_spo.rewards import sandbox

    for p in task.heldout[:6]:
        report = sandbox.run_tests(p.solutions[0], list(p.tests + p.hidden_tests), time_limit_s=5.0, memory_mb=256)
        assert report.passed, (p.id, report)
    wrong = task.heldout[0]
    other = next(q for q in task.heldout if q.family == wrong.family and q.id != wrong.id)
    report = sandbox.run_tests(other.solutions[0], list(wrong.tests), time_limit_s=5.0, memory_mb=256)
    assert not report.passed
