"""JSONL that refuses duplicate keys (issue 49): a trajectory, problem or Q0 line holding a key twice, at any depth,
is refused in one line naming the file, the line and the key (``json.loads`` keeps the last value silently: a
``{"reward": 0, "reward": -1}`` imported as -1). One reader for all: megatron_spo.config.loads_json."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from test_hostile_files import refused  # noqa: E402


def _record(**extra) -> str:
    return ('{"prompt_id": "p", "prompt_tokens": [1, 2], "response_tokens": [3], "reward": 0, "source": "offline", '
            '"policy_version": 0' + "".join(f", {v}" for v in extra.values()) + "}")


def test_a_trajectory_line_with_a_key_twice_is_refused_naming_file_line_and_key(tmp_path, capsys):
    from megatron_spo.data.trajectory import read_jsonl

    top = tmp_path / "top.jsonl"
    top.write_text(_record() + "\n" + _record(again='"reward": -1') + "\n")
    line = refused(capsys, "trajectories", "check", top, inputs=(top,),
                   names=(f"{top}:2: duplicate key 'reward' (a record holds each key once)",))
    assert line == f"megatron-spo trajectories: {top}:2: duplicate key 'reward' (a record holds each key once)"
    refused(capsys, "trajectories", "import", top, tmp_path / "store", names=(f"{top}:2: duplicate key 'reward'",))
    assert not (tmp_path / "store").exists()
    nested = tmp_path / "nested.jsonl"
    nested.write_text("\n" + _record(p='"provenance": {"kind": "reference", "kind": "pts"}') + "\n")
    refused(capsys, "trajectories", "check", nested, names=(f"{nested}:2: duplicate key 'kind'",))
    deep = tmp_path / "deep.jsonl"
    deep.write_text(_record(m='"mc_targets": [{"t": 0, "success_prob": 0.5, "t": 0}]') + "\n")
    refused(capsys, "trajectories", "check", deep, names=(f"{deep}:1: duplicate key 't'",))
    records, report = read_jsonl(top, skip_invalid=True)  # skippable like any bad line, and counted
    assert len(records) == 1 and report.skipped == 1 and "duplicate key 'reward'" in report.errors[0]


def test_a_problem_or_q0_line_with_a_key_twice_is_refused_naming_file_line_and_key(tmp_path):
    from megatron_spo.data.problem import read_problems_jsonl
    from megatron_spo.data.q0 import read_q0

    good = '{"id": "a", "prompt": "p", "tests": [["1", "2"]]}'
    problems = tmp_path / "problems.jsonl"
    problems.write_text(good + "\n" + '{"id": "b", "prompt": "p", "tests": [], "tests": [["1", "2"]]}\n')
    with pytest.raises(ValueError) as err:
        read_problems_jsonl(problems)
    assert str(err.value) == f"{problems}:2: duplicate key 'tests' (a problem holds each key once)"
    nested = tmp_path / "nested.jsonl"
    nested.write_text('{"id": "a", "prompt": "p", "metadata": {"level": 1, "level": 2}}\n')
    with pytest.raises(ValueError, match=rf"^{nested}:1: duplicate key 'level'"):
        read_problems_jsonl(nested)
    q0 = tmp_path / "q0.jsonl"
    q0.write_text('{"prompt_id": "a", "s0": 0.5, "q0": -0.1, "q0": -0.9, "n": 4, "correct": 2, "beta": 1.0}\n')
    with pytest.raises(ValueError, match=rf"^{q0}:1: duplicate key 'q0' \(a record holds each key once\)"):
        read_q0(q0)


def test_a_taco_row_whose_tests_hold_a_key_twice_is_refused():
    from megatron_spo.data.tasks import TaskFormatError, taco_problem

    row = {"question": "q", "input_output": '{"inputs": ["1\\n"], "outputs": ["2\\n"], "inputs": []}'}
    with pytest.raises(TaskFormatError) as err:
        taco_problem(row, 0, "taco.jsonl row 0")
    assert str(err.value) == "taco.jsonl row 0: field 'input_output' holds duplicate key 'inputs'"
