"""Task loaders on tiny files written here in the published schemas (no downloads)."""

from __future__ import annotations

import json

import pytest

from megatron_spo.data.tasks import (
    TaskFormatError,
    build_prompt,
    dedup_against,
    load_codecontests,
    load_math,
    load_taco,
    text_key,
)

STATEMENT = "Given two integers a and b, print a + b.\n\nInput\n\nOne line: a b.\n\nOutput\n\nThe sum."
TACO_SAME = "Given two integers a and b, print a+b.\n-----Input-----\nOne line: a b.\n-----Output-----\nThe sum.\n"


def codecontests_rows():
    tests = lambda i, o: {"input": i, "output": o}  # noqa: E731
    return [
        {"name": "1A. Sum", "description": STATEMENT, "public_tests": tests(["1 2\n"], ["3\n"]),
         "private_tests": tests(["5 5\n"], ["10\n"]), "generated_tests": tests(["0 0\n", "-1 1\n"], ["0\n", "0\n"]),
         "time_limit": {"seconds": 2, "nanos": 500000000}, "memory_limit_bytes": 256 << 20, "source": 2,
         "difficulty": 7, "cf_rating": 800},
        {"name": "1B. Reverse", "description": "Reverse a string.", "public_tests": tests(["ab\n"], ["ba\n"]),
         "private_tests": tests([], []), "generated_tests": tests([], []), "time_limit": None,
         "memory_limit_bytes": 0, "source": 2, "difficulty": 7, "cf_rating": 900},
        {"name": "1C. Empty", "description": "No tests at all.", "public_tests": tests([], []),
         "private_tests": tests([], []), "generated_tests": tests([], []), "time_limit": None,
         "memory_limit_bytes": 0, "source": 2, "difficulty": 7, "cf_rating": 900},
    ]


def write_parquet(rows, path):
    import datasets

    datasets.Dataset.from_list(rows).to_parquet(str(path))
    return str(path)


def write_jsonl(rows, path):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_codecontests_from_parquet(tmp_path):
    path = write_parquet(codecontests_rows(), tmp_path / "cc.parquet")
    problems = load_codecontests(path, cache_dir=str(tmp_path / "cache"))
    assert [p.id for p in problems] == ["codecontests/1A. Sum", "codecontests/1B. Reverse"]  # 1C has no tests
    first = problems[0]
    assert first.tests == (("1 2\n", "3\n"),)
    assert first.hidden_tests == (("5 5\n", "10\n"), ("0 0\n", "0\n"), ("-1 1\n", "0\n"))
    assert (first.time_limit_s, first.memory_mb, first.kind, first.source) == (2.5, 256, "code", "codecontests")
    assert problems[1].time_limit_s is None and problems[1].hidden_tests == ()


def test_taco_input_output_json(tmp_path):
    rows = [
        {"question": TACO_SAME, "input_output": json.dumps({"inputs": ["1 2\n", "3 4\n", "0 0\n"],
                                                            "outputs": ["3\n", "7\n", "0\n"]}),
         "name": "sum", "source": "codeforces", "difficulty": "EASY", "time_limit": "1 second",
         "memory_limit": "256 megabytes", "url": "u"},
        {"question": "Call-based.", "input_output": json.dumps({"inputs": [[1]], "outputs": [[2]], "fn_name": "f"}),
         "name": "", "source": "leetcode", "difficulty": "EASY", "time_limit": None, "memory_limit": None, "url": ""},
        {"question": "Lines.", "input_output": json.dumps({"inputs": [["1", "2"]], "outputs": [["3"]]}),
         "name": "lines", "source": "x", "difficulty": "EASY", "time_limit": None, "memory_limit": None, "url": ""},
    ]
    path = write_jsonl(rows, tmp_path / "taco.jsonl")
    problems = load_taco(path, n_reward_tests=2, cache_dir=str(tmp_path / "cache"))
    assert [p.id for p in problems] == ["taco/0/sum", "taco/1", "taco/2/lines"]
    assert problems[0].tests == (("1 2\n", "3\n"), ("3 4\n", "7\n")) and problems[0].hidden_tests == (("0 0\n", "0\n"),)
    assert (problems[0].time_limit_s, problems[0].memory_mb) == (1.0, 256)
    assert problems[0].harness is None and problems[1].harness.fn_name == "f"  # call-based: function-call tests
    assert problems[1].tests == (("[1]", "[2]"),)
    assert problems[2].tests == (("1\n2\n", "3\n"),)


def test_bad_rows_name_file_row_and_field(tmp_path):
    bad = write_jsonl([{"question": "q", "input_output": "{not json"}], tmp_path / "bad.jsonl")
    with pytest.raises(TaskFormatError, match=r"bad\.jsonl row 0: field 'input_output' is not valid JSON"):
        load_taco(bad, cache_dir=str(tmp_path / "cache"))
    rows = codecontests_rows()[:1]
    rows[0]["public_tests"] = {"input": ["1\n", "2\n"], "output": ["1\n"]}
    bad_cc = write_jsonl(rows, tmp_path / "cc_bad.jsonl")
    with pytest.raises(TaskFormatError, match=r"cc_bad\.jsonl row 0: field 'public_tests' has 2 inputs but 1 outputs"):
        load_codecontests(bad_cc, cache_dir=str(tmp_path / "cache"))
    with pytest.raises(FileNotFoundError, match="nowhere"):
        load_codecontests(str(tmp_path / "nowhere*.parquet"))


def test_math_answers_come_from_the_last_box(tmp_path):
    rows = [{"problem": "1/2 + 1/2?", "solution": r"We get $\boxed{1}$.", "level": "Level 1", "type": "Algebra"},
            {"problem": "Frac?", "solution": r"First \boxed{2}, no: $\boxed{\frac{1}{2}}$", "level": "Level 2",
             "type": "Algebra"}]
    problems = load_math(write_jsonl(rows, tmp_path / "math.jsonl"), cache_dir=str(tmp_path / "cache"))
    assert [(p.answer, p.kind) for p in problems] == [("1", "math"), (r"\frac{1}{2}", "math")]
    rows.append({"problem": "?", "solution": "no box", "level": "", "type": ""})
    with pytest.raises(TaskFormatError, match=r"math2\.jsonl row 2: field 'solution' has no \\boxed"):
        load_math(write_jsonl(rows, tmp_path / "math2.jsonl"), cache_dir=str(tmp_path / "cache"))


def test_codecontests_training_set_is_deduplicated_against_taco_test(tmp_path):
    cc = load_codecontests(write_parquet(codecontests_rows(), tmp_path / "cc.parquet"), cache_dir=str(tmp_path / "c"))
    taco_rows = [{"question": TACO_SAME, "input_output": json.dumps({"inputs": ["1 2"], "outputs": ["3"]})}]
    taco = load_taco(write_jsonl(taco_rows, tmp_path / "t.jsonl"), cache_dir=str(tmp_path / "c"))
    assert text_key(STATEMENT) == text_key(TACO_SAME)  # headers, spacing and case do not matter
    kept, dropped = dedup_against(cc, taco)
    assert dropped == ["codecontests/1A. Sum"] and [p.id for p in kept] == ["codecontests/1B. Reverse"]


def test_prompts_use_the_chat_template_or_a_plain_layout():
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(WordLevel({"[UNK]": 0}, unk_token="[UNK]")))
    tok.chat_template = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                         "{% if add_generation_prompt %}<|assistant|>{% endif %}")
    from megatron_spo.data.tasks import CODE_INSTRUCTION, Problem

    p = Problem(id="x", prompt="Add two numbers.")
    assert build_prompt(p, tok, system="Be brief.") == (
        f"<|system|>Be brief.\n<|user|>Add two numbers.\n\n{CODE_INSTRUCTION}\n<|assistant|>")
    assert build_prompt(p) == f"Problem:\nAdd two numbers.\n\n{CODE_INSTRUCTION}\n\nSolution:\n"
    m = Problem(id="m", prompt="1+1?", kind="math", answer="2")
    assert build_prompt(m, instruction="").endswith("1+1?\n\nSolution:\n")
    assert "\\boxed{}" in build_prompt(m)


def test_every_command_takes_the_quickstarts_task_names():
    """The quickstart says task=toy_code; sample, eval, import-text and a training config's task.kind take that
    name too (it means TASK_KINDS' toy), and an unknown one is refused naming the choices."""
    import argparse

    from pydantic import ValidationError

    from megatron_spo.data.config import TaskConfig
    from megatron_spo.data.importers import add_import_args
    from megatron_spo.engine_tools.command_line import add_task_args

    tools = argparse.ArgumentParser()
    add_task_args(tools, default_split="train")
    offline = argparse.ArgumentParser().add_subparsers(dest="cmd")
    add_import_args(offline, "import-text", "")
    text = offline.choices["import-text"]
    for name, kind in (("toy_code", "toy"), ("toy", "toy"), ("toy_math", "toy_math"), ("math", "math")):
        assert tools.parse_args(["--task", name]).task == kind
        assert text.parse_args(["--task", name, "--store", "s", "f"]).task == kind
        assert TaskConfig(kind=name).kind == kind
    with pytest.raises(SystemExit):
        tools.parse_args(["--task", "toy_kode"])
    with pytest.raises(ValidationError, match="unknown task kind 'toy_kode' .*toy_code = toy"):
        TaskConfig(kind="toy_kode")
