"""Importers into the experience store: rows in the CodeContests / TACO schemas and text pairs, tokenized with
the policy's tokenizer and training's prompt builder, re-scored in the real sandbox (a wrong "solution" enters
with reward -1, never as a success), corrupt rows named by file:line with nothing lost."""

from __future__ import annotations

import json
import os
import time

import pytest

from megatron_spo.cli import main as cli
from megatron_spo.data.importers import (
    ProblemIndex,
    codecontests_candidates,
    fence,
    run_import,
    taco_candidates,
    text_candidates,
)
from megatron_spo.data.offline_store import OfflineStore, write_store
from megatron_spo.data.problem import read_problems_jsonl
from megatron_spo.data.prompts import make_prompts
from megatron_spo.data.trajectory import RecordError
from megatron_spo.rewards.config import SandboxConfig
from megatron_spo.rewards.reward import RewardPool
from megatron_spo.rewards.sandbox import SandboxPool, SandboxUnavailableError

ADD = "a, b = map(int, input().split())\nprint(a + b)\n"
SUB = "a, b = map(int, input().split())\nprint(a - b)\n"
THREE = "print(3)\n"  # right on the public test (1 2 -> 3), wrong on the hidden ones

CC_ADD = {"name": "1_A. Add", "description": "Add two numbers a and b.",
          "public_tests": {"input": ["1 2\n"], "output": ["3\n"]},
          "private_tests": {"input": ["5 7\n"], "output": ["12\n"]},
          "generated_tests": {"input": ["-1 1\n"], "output": ["0\n"]},
          "solutions": {"language": [3, 2, 3, 1, 3], "solution": [ADD, "int main() {}", THREE, "print 3", SUB]},
          "incorrect_solutions": {"language": [3], "solution": [SUB]},
          "time_limit": {"seconds": 2, "nanos": 0}, "memory_limit_bytes": 268435456, "source": 2, "difficulty": 7,
          "cf_rating": 800}
CC_CPP_ONLY = {**CC_ADD, "name": "2_B. Cpp", "description": "Print one.", "solutions": {"language": [2],
                                                                                       "solution": ["..."]}}
TACO_ROWS = [
    {"question": "Print the double of n.", "input_output": json.dumps({"inputs": ["2\n", "5\n"], "outputs": ["4\n", "10\n"]}),
     "solutions": json.dumps(["print(2 * int(input()))", "print(int(input()) + 2)"]), "name": "double",
     "time_limit": "1 second", "memory_limit": "256 megabytes"},
    {"question": "Call f.", "input_output": json.dumps({"inputs": [[1]], "outputs": [[2]], "fn_name": "f"}),
     "solutions": json.dumps(["def f(x): return 2 * x"])},
]


@pytest.fixture(scope="module")
def rewards():
    if os.geteuid() != 0:
        pytest.skip("per-slot uids need root (the CI machine runs as root)")
    try:
        sandbox = SandboxPool(SandboxConfig(slots=2, uid_base=2_100_000))
    except SandboxUnavailableError as err:
        pytest.skip(f"no bubblewrap here: {err}")
    yield RewardPool(sandbox), RewardPool(sandbox, hidden=True)
    sandbox.close()


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    from megatron_spo.data.char_tokenizer import save_char_tokenizer

    path = tmp_path_factory.mktemp("tok")
    tokenizer = save_char_tokenizer(path)
    tokenizer.path = str(path)
    return tokenizer


def write_rows(path, rows, *, bad_line: bytes | None = None, at: int = 1):
    lines = [json.dumps(r).encode() + b"\n" for r in rows]
    if bad_line is not None:
        lines.insert(at, bad_line)
    path.write_bytes(b"".join(lines))
    return path


def texts(tok, store) -> list[tuple[str, str, float]]:
    return [(r.prompt_id, tok.decode(r.response_tokens, skip_special_tokens=True), r.reward)
            for r in OfflineStore(store).trajectories()]


def test_codecontests_python3_solutions_are_rescored_and_tokenized_as_training_does(rewards, tok, tmp_path):
    reward_tests, with_hidden = rewards
    rows = write_rows(tmp_path / "cc.jsonl", [CC_ADD, CC_CPP_ONLY])
    before = time.time()
    summary = run_import(lambda: codecontests_candidates(rows), tmp_path / "s", tokenizer=tok, rewards=reward_tests)
    assert (summary.candidates, summary.imported, summary.passed, summary.report.read) == (3, 3, 2, 1)
    got = OfflineStore(tmp_path / "s").trajectories()
    assert [(pid, text, reward) for pid, text, reward in texts(tok, tmp_path / "s")] == [
        ("codecontests/1_A. Add", fence(ADD), 0.0),
        ("codecontests/1_A. Add", fence(THREE), 0.0),  # passes the reward (public) test
        ("codecontests/1_A. Add", fence(SUB), -1.0)]   # the deliberately wrong one never enters as a success
    from megatron_spo.data.importers import codecontests_problem

    problem = codecontests_problem(CC_ADD, "row")
    assert got[0].prompt_tokens == make_prompts([problem], tok)[0].tokens  # training's prompt builder
    assert tok.decode(got[0].prompt_tokens, skip_special_tokens=True).startswith("Problem:\nAdd two numbers a and b.")
    assert got[0].response_tokens[-1] == tok.eos_token_id
    p = got[0].provenance
    assert (p.kind, p.origin, p.model, p.temperature) == ("human", "codecontests", None, None)
    assert before <= p.created <= time.time() and got[0].source == "offline" and got[0].policy_version == 0
    assert problem.time_limit_s == 2.0 and problem.memory_mb == 256 and problem.hidden_tests == (
        ("5 7\n", "12\n"), ("-1 1\n", "0\n"))

    # with the hidden tests too, print(3) fails
    summary = run_import(lambda: codecontests_candidates(rows), tmp_path / "h", tokenizer=tok, rewards=with_hidden)
    assert [reward for *_, reward in texts(tok, tmp_path / "h")] == [0.0, -1.0, -1.0] and summary.passed == 1
    # --only-passing keeps only the verdict's passes
    summary = run_import(lambda: codecontests_candidates(rows, raw=True), tmp_path / "p", tokenizer=tok,
                         rewards=with_hidden, only_passing=True)
    assert texts(tok, tmp_path / "p") == [("codecontests/1_A. Add", ADD, 0.0)] and summary.dropped_failing == 2


def test_a_corrupt_row_is_one_line_naming_file_line_and_nothing_is_lost(rewards, tok, tmp_path, capsys):
    earlier = [{"prompt_id": "x", "prompt_tokens": [1], "response_tokens": [2], "reward": 0.0, "source": "offline",
                "policy_version": 0}]
    write_store(earlier, tmp_path / "s")
    index = (tmp_path / "s" / "index.json").read_bytes()
    rows = write_rows(tmp_path / "cc.jsonl", [CC_ADD, {"name": "3_C. Broken", "public_tests": None}, CC_CPP_ONLY])
    args = ["offline", "import-codecontests", str(rows), "--store", str(tmp_path / "s"), "--tokenizer", tok.path,
            "--sandbox-slots", "1"]
    assert cli(args) == 1
    assert capsys.readouterr().err == (f"megatron-spo offline import-codecontests: {rows}:2: missing field "
                                       f"'description'\n")
    assert (tmp_path / "s" / "index.json").read_bytes() == index  # the store is as it was
    assert len(OfflineStore(tmp_path / "s")) == 1

    assert cli(args + ["--skip-invalid", "--hidden", "--run-id", "import-1"]) == 0
    out = capsys.readouterr()
    assert out.out.splitlines() == [
        f"imported 3 of 3 responses into {tmp_path / 's'}: 1 pass, 2 fail (the sandbox's verdict is the reward)",
        "rows without a response to import (no Python 3 solution): 1"]
    assert out.err == f"skipped 1 invalid row(s):\n  {rows}:2: missing field 'description'\n"
    got = OfflineStore(tmp_path / "s").trajectories()
    assert [r.reward for r in got] == [0.0, 0.0, -1.0, -1.0] and got[0].provenance is None  # the earlier record kept
    assert {r.provenance.run_id for r in got[1:]} == {"import-1"}


def test_taco_rows(rewards, tok, tmp_path):
    from collections import Counter

    bad = json.dumps({"question": "q", "input_output": json.dumps({"inputs": ["1\n"], "outputs": ["1\n"]}),
                      "solutions": "[not json"}).encode() + b"\n"
    rows = write_rows(tmp_path / "taco.jsonl", TACO_ROWS, bad_line=bad, at=1)
    skipped = Counter()
    items = list(taco_candidates(rows, skipped=skipped))
    assert [type(i).__name__ for i in items] == ["Candidate", "Candidate", "RecordError", "Candidate"]
    assert str(items[2]).startswith(f"{rows}:2: field 'solutions': is not valid JSON (Expecting value")
    assert skipped == {} and items[3].problem.harness is not None  # row 3: call-based, function-call tests
    with pytest.raises(RecordError, match=r"taco\.jsonl:2: field 'solutions'"):
        run_import(lambda: taco_candidates(rows), tmp_path / "s", tokenizer=tok, rewards=rewards[0])
    summary = run_import(lambda: taco_candidates(rows), tmp_path / "s", tokenizer=tok, rewards=rewards[0],
                         skip_invalid=True)
    assert (summary.report.read, summary.report.skipped, summary.imported, summary.passed) == (2, 1, 3, 2)
    assert texts(tok, tmp_path / "s") == [("taco/0/double", fence("print(2 * int(input()))"), 0.0),
                                          ("taco/0/double", fence("print(int(input()) + 2)"), -1.0),
                                          ("taco/2", fence("def f(x): return 2 * x"), 0.0)]
    assert OfflineStore(tmp_path / "s").record(0).provenance.origin == "taco"


def test_text_pairs_from_any_producer(rewards, tok, tmp_path):
    task = tmp_path / "problems.jsonl"
    task.write_text(json.dumps({"id": "add", "prompt": "Add two numbers.", "tests": [["1 2\n", "3\n"]],
                                "hidden_tests": [["5 7\n", "12\n"]]}) + "\n"
                    + json.dumps({"id": "neg", "prompt": "Negate n.", "tests": [["4\n", "-4\n"]]}) + "\n")
    problems = read_problems_jsonl(task)
    index = ProblemIndex(problems)
    rows = [
        {"problem_id": "add", "response": "Sum them.\n" + fence(ADD), "model": "m70b", "temperature": 0.6,
         "top_p": 0.95, "reward": 0.0},
        {"prompt": "  add TWO numbers ", "response": fence(THREE), "model": "m70b", "reward": 0.0},  # statement match
        {"problem_id": "neg", "response": fence("print(-int(input()))"), "kind": "online", "run_id": "r9",
         "policy_version": 12, "created": 1700000000.0},
        {"problem_id": "neg", "response": fence("print(int(input()))"), "reward": 0},  # claims a pass: it fails
    ]
    path = write_rows(tmp_path / "samples.jsonl", rows, bad_line=b'{"problem_id": "add", "response": "\xff"}\n', at=2)
    items = list(text_candidates(path, index))
    assert str(items[2]) == f"{path}:3: not valid UTF-8 (byte offset 35: invalid start byte)"
    with pytest.raises(RecordError, match=r"samples\.jsonl:3: not valid UTF-8"):
        run_import(lambda: text_candidates(path, index), tmp_path / "s", tokenizer=tok, rewards=rewards[1])
    assert not (tmp_path / "s").exists()  # checked before anything was written
    summary = run_import(lambda: text_candidates(path, index), tmp_path / "s", tokenizer=tok, rewards=rewards[1],
                         skip_invalid=True)
    assert (summary.imported, summary.passed, summary.claimed_pass_failed, summary.report.skipped) == (4, 2, 2, 1)
    got = OfflineStore(tmp_path / "s").trajectories()
    assert [(r.prompt_id, r.reward) for r in got] == [("add", 0.0), ("add", -1.0), ("neg", 0.0), ("neg", -1.0)]
    assert tok.decode(got[0].response_tokens, skip_special_tokens=True) == "Sum them.\n" + fence(ADD)
    p0, p2 = got[0].provenance, got[2].provenance
    assert (p0.kind, p0.model, p0.temperature, p0.top_p, p0.origin) == ("other-model", "m70b", 0.6, 0.95, "samples.jsonl")
    assert (p2.kind, p2.run_id, p2.created, got[2].policy_version) == ("online", "r9", 1700000000.0, 12)

    for row, message in [({"problem_id": "nope", "response": "x"}, "field 'problem_id': 'nope' is not a problem"),
                         ({"prompt": "Multiply.", "response": "x"}, "field 'prompt': matches no problem"),
                         ({"problem_id": "add", "response": ""}, "field 'response': must be a non-empty string"),
                         ({"problem_id": "add", "response": "x", "kind": "robot"}, "field 'provenance': kind must"),
                         ({"problem_id": "add", "response": "x", "score": 1}, "field 'score': unknown field")]:
        write_rows(tmp_path / "one.jsonl", [row])
        (item,) = text_candidates(tmp_path / "one.jsonl", index)
        assert str(item).startswith(f"{tmp_path / 'one.jsonl'}:1: {message}"), item


def test_cli_import_text_then_build_keeps_only_verified_passes(rewards, tok, tmp_path, capsys):
    task = tmp_path / "problems.jsonl"
    task.write_text(json.dumps({"id": "add", "prompt": "Add two numbers.", "tests": [["1 2\n", "3\n"]]}) + "\n")
    samples = write_rows(tmp_path / "samples.jsonl", [
        {"problem_id": "add", "response": fence(ADD), "model": "m"},
        {"problem_id": "add", "response": fence(ADD) + "\n\n", "model": "m"},  # the same text, other whitespace
        {"problem_id": "add", "response": fence(SUB), "model": "m", "reward": 0.0}])
    assert cli(["offline", "import-text", str(samples), "--store", str(tmp_path / "s"), "--tokenizer", tok.path,
                "--task", "jsonl", "--data", str(task), "--sandbox-slots", "1"]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == "1 responses claimed a pass and failed in the sandbox"
    assert cli(["offline", "build", str(tmp_path / "s"), "--out", str(tmp_path / "b"), "--tokenizer", tok.path]) == 0
    total = capsys.readouterr().out.splitlines()[-2].split()
    assert total == ["total", "3", "0.667", "1", "0", "1", "0", "1", "1.000"]
    assert texts(tok, tmp_path / "b") == [("add", fence(ADD), 0.0)]


def test_an_import_that_dies_while_scoring_keeps_what_it_scored(tok, tmp_path):
    """No sandbox needed: a reward pool that fails on the third response (a crashed scorer)."""
    from concurrent.futures import Future

    from megatron_spo.rewards.reward import RewardResult

    class Dying:
        def __init__(self):
            self.calls = 0

        def submit(self, problem, text):
            self.calls += 1
            if self.calls == 3:
                raise RuntimeError("sandbox host died")
            future = Future()
            future.set_result(RewardResult(0.0 if "+" in text else -1.0, "+" in text))
            return future

    many = {**CC_ADD, "solutions": {"language": [3] * 4, "solution": [ADD, SUB, ADD + "\n", SUB + "\n"]}}
    rows = write_rows(tmp_path / "cc.jsonl", [many])
    with pytest.raises(RuntimeError, match="sandbox host died"):
        run_import(lambda: codecontests_candidates(rows), tmp_path / "s", tokenizer=tok, rewards=Dying(), window=1)
    assert texts(tok, tmp_path / "s") == [("codecontests/1_A. Add", fence(ADD), 0.0),
                                          ("codecontests/1_A. Add", fence(SUB), -1.0)]
