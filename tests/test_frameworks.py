"""Data from other frameworks (data/frameworks.py): a verl parquet, a slime JSONL and a TRL save_to_disk folder of
chat prompts load as problems whose prompt is the chat template's and whose reward (chosen by data_source, or
named) scores a right and a wrong answer; bad rows are one line naming the field and file:line."""

from __future__ import annotations

import json
import os

import pytest

from megatron_spo.data.config import TaskConfig
from megatron_spo.data.frameworks import ImportOptions, load_framework
from megatron_spo.data.problems import held_out_problems, load_problems, problems_from_task_config
from megatron_spo.data.prompts import make_prompts, prompt_text
from megatron_spo.data.tasks import TaskFormatError

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
GSM8K_PROMPT = 'Tom has 6 bags of 7 apples. How many apples? Let\'s think step by step and output the final answer after "####".'


@pytest.fixture(scope="module")
def tok():
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    t = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(WordLevel({"[UNK]": 0}, unk_token="[UNK]")))
    t.chat_template = CHATML
    return t


def chatml(*messages: tuple[str, str]) -> str:
    return "".join(f"<|im_start|>{r}\n{c}<|im_end|>\n" for r, c in messages) + "<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def rewards():
    from megatron_spo.rewards.config import SandboxConfig
    from megatron_spo.rewards.reward import RewardPool
    from megatron_spo.rewards.sandbox import SandboxPool, SandboxUnavailableError

    if os.geteuid() != 0:
        pytest.skip("per-slot uids need root (the CI machine runs as root)")
    try:
        sandbox = SandboxPool(SandboxConfig(slots=2, uid_base=2_310_000))
    except SandboxUnavailableError as err:
        pytest.skip(f"no bubblewrap here: {err}")
    pool = RewardPool(sandbox)
    yield pool
    pool.close()
    sandbox.close()


def scores(rewards, problem, *completions) -> list[float]:
    return [rewards(problem, c).reward for c in completions]


def verl_rows() -> list[dict]:
    """Rows as verl's examples/data_preprocess scripts write them (gsm8k.py, math_dataset.py, a TACO-style code row)."""
    def row(source, messages, ability, truth, index):
        return {"data_source": source, "prompt": messages, "ability": ability,
                "reward_model": {"style": "rule", "ground_truth": truth},
                "extra_info": {"split": "train", "index": index, "answer": "", "question": ""}}

    fn_tests = {"inputs": [[2], [5]], "outputs": [[4], [10]], "fn_name": "double"}
    stdin_tests = {"inputs": ["1 2\n", "5 5\n"], "outputs": ["3\n", "10\n"]}
    return [
        row("openai/gsm8k", [{"role": "user", "content": GSM8K_PROMPT}], "math", "42", 0),
        row("lighteval/MATH", [{"role": "system", "content": "Be brief."},
                               {"role": "user", "content": "What is 1/2 + 1/4? Put it in \\boxed{}."}], "math",
            "\\frac{3}{4}", 1),
        row("taco", [{"role": "user", "content": "Write double(n)."}], "code", json.dumps(fn_tests), 2),
        row("codecontests", [{"role": "user", "content": "Read a and b, print a + b."}], "code",
            json.dumps(stdin_tests), 3),
    ]


def write_parquet(rows, path) -> str:
    import datasets

    datasets.Dataset.from_list(rows).to_parquet(str(path))
    return str(path)


def write_jsonl(rows, path) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


# ---------------------------------------------------------------------------------------------
# verl
# ---------------------------------------------------------------------------------------------
def test_verl_parquet_prompts_and_rewards_by_data_source(tmp_path, tok, rewards):
    path = write_parquet(verl_rows(), tmp_path / "train.parquet")
    gsm8k, math, double, add = problems_from_task_config(TaskConfig(kind="verl", paths=[path]))
    assert [p.id for p in (gsm8k, math, double, add)] == [
        "openai/gsm8k/train/0", "lighteval/MATH/train/1", "taco/train/2", "codecontests/train/3"]
    assert prompt_text(gsm8k, tok) == chatml(("user", GSM8K_PROMPT))  # the data's own instruction, nothing added
    assert prompt_text(math, tok) == chatml(("system", "Be brief."), ("user", "What is 1/2 + 1/4? Put it in \\boxed{}."))
    assert len(make_prompts([gsm8k, math, double, add], tok)) == 4
    assert (gsm8k.kind, gsm8k.answer, gsm8k.answer_format, math.answer) == ("math", "42", "gsm8k", "\\frac{3}{4}")
    assert gsm8k.metadata["ability"] == "math" and gsm8k.metadata["extra_info"]["index"] == 0
    assert scores(rewards, gsm8k, "6 * 7 = 42 apples.\n#### 42", "#### 1,042", "So \\boxed{42}.", "#### 41") == [
        0.0, -1.0, 0.0, -1.0]
    assert scores(rewards, math, "\\boxed{\\frac{3}{4}}", "\\boxed{0.75}", "\\boxed{\\frac{1}{2}}") == [0.0, 0.0, -1.0]
    assert double.harness is not None and double.tests == (("[2]", "[4]"), ("[5]", "[10]"))
    assert scores(rewards, double, "```python\ndef double(n):\n    return 2 * n\n```",
                  "```python\ndef double(n):\n    return n * n\n```") == [0.0, -1.0]
    assert add.harness is None and scores(rewards, add, "```python\nprint(sum(map(int, input().split())))\n```",
                                          "```python\nprint(3)\n```") == [0.0, -1.0]


def test_verl_unknown_data_source_needs_a_named_reward(tmp_path):
    rows = verl_rows()[:1]
    rows[0]["data_source"] = "my/arith"
    path = write_parquet(rows, tmp_path / "mine.parquet")
    with pytest.raises(TaskFormatError, match=r"mine\.parquet row 0: field 'data_source' 'my/arith' has no built-in "
                                              r"reward .*set task\.reward_kind \(code \| math \| gsm8k\)"):
        load_problems("verl", path)
    (named,) = problems_from_task_config(TaskConfig(kind="verl", paths=[path], reward_kind="gsm8k"))
    assert (named.kind, named.answer, named.answer_format) == ("math", "42", "gsm8k")
    (hooked,) = problems_from_task_config(TaskConfig(kind="verl", paths=[path], reward="tests.x:reward"))
    assert hooked.answer is None and hooked.metadata["reward_model"]["ground_truth"] == "42"  # the hook reads it
    rows[0]["reward_model"] = "42"
    with pytest.raises(TaskFormatError, match=r"bad\.parquet row 0: field 'reward_model' should be"):
        load_problems("verl", write_parquet(rows, tmp_path / "bad.parquet"), options=ImportOptions(reward_kind="math"))


# ---------------------------------------------------------------------------------------------
# slime
# ---------------------------------------------------------------------------------------------
def test_slime_jsonl_with_its_input_label_and_metadata_keys(tmp_path, tok, rewards):
    rows = [
        {"question": "Ann has 3 pens and buys 15 more. How many pens?",
         "answer": "3 + 15 = <<3+15=18>>18\n#### 18", "meta": {"difficulty": 1}, "source": "gsm8k"},
        {"question": [{"role": "system", "content": "Answer in \\boxed{}."}, {"role": "user", "content": "2^10?"}],
         "answer": "1024", "meta": {"difficulty": 2}},
    ]
    path = write_jsonl(rows, tmp_path / "slime.jsonl")
    task = TaskConfig(kind="slime", paths=[path], input_key="question", label_key="answer", metadata_key="meta")
    pens, power = problems_from_task_config(task)
    assert [p.id for p in (pens, power)] == ["slime/0", "slime/1"]
    assert prompt_text(pens, tok) == chatml(("user", rows[0]["question"]))  # a string prompt: one user message
    assert prompt_text(power, tok) == chatml(("system", "Answer in \\boxed{}."), ("user", "2^10?"))
    assert pens.metadata == {"answer": rows[0]["answer"], "source": "gsm8k", "difficulty": 1}
    assert (pens.answer, pens.answer_format, power.answer, power.answer_format) == ("18", "gsm8k", "1024", "boxed")
    assert scores(rewards, pens, "3 + 15 = 18\n#### 18", "#### 45") == [0.0, -1.0]
    assert scores(rewards, power, "2^10 = \\boxed{1024}", "\\boxed{1000}", "#### 1024") == [0.0, -1.0, -1.0]


def test_slime_bad_rows_name_the_field_and_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"input": "1+1?", "label": "2"}) + "\n\n" + json.dumps({"input": "2+2?"}) + "\n")
    with pytest.raises(TaskFormatError, match=r"bad\.jsonl:3: missing field 'label' \(the reference answer\)"):
        load_framework("slime", str(path), ImportOptions(label_key="label"))
    path.write_text(json.dumps({"input": [{"role": "user"}], "label": "2"}) + "\n")
    with pytest.raises(TaskFormatError, match=r"bad\.jsonl:1: field 'input' message 0 must be \{'role': str"):
        load_framework("slime", str(path), ImportOptions(label_key="label"))
    path.write_text('{"input": "1+1?", "label": "2"}\n{not json\n')
    with pytest.raises(TaskFormatError, match=r"bad\.jsonl:2: not valid JSON"):
        load_framework("slime", str(path), ImportOptions(label_key="label"))
    path.write_text(json.dumps({"prompt": "1+1?"}) + "\n")
    with pytest.raises(TaskFormatError, match=r"bad\.jsonl:1: missing field 'input' \(the prompt\)"):
        load_framework("slime", str(path))


# ---------------------------------------------------------------------------------------------
# TRL and datasets folders
# ---------------------------------------------------------------------------------------------
def trl_rows() -> list[dict]:
    return [
        {"prompt": [{"role": "system", "content": "Think, then answer in \\boxed{}."},
                    {"role": "user", "content": "How many primes are below 10?"}],
         "solution": "2, 3, 5 and 7: $\\boxed{4}$.", "level": "easy"},
        {"prompt": [{"role": "user", "content": "What is 12 * 12?"}], "solution": "144", "level": "easy"},
    ]


def test_trl_save_to_disk_folder_conversational_prompts_and_solution(tmp_path, tok, rewards):
    import datasets

    folder = tmp_path / "primes"
    datasets.DatasetDict({"train": datasets.Dataset.from_list(trl_rows())}).save_to_disk(str(folder))
    primes, square = problems_from_task_config(TaskConfig(kind="trl", paths=[str(folder)]))
    assert [p.id for p in (primes, square)] == ["primes/0", "primes/1"]
    assert prompt_text(primes, tok) == chatml(("system", "Think, then answer in \\boxed{}."),
                                              ("user", "How many primes are below 10?"))
    assert (primes.answer, square.answer) == ("4", "144")
    assert primes.metadata == {"solution": trl_rows()[0]["solution"], "level": "easy"}  # TRL's reward kwargs
    assert scores(rewards, primes, "2, 3, 5, 7: \\boxed{4}", "\\boxed{5}") == [0.0, -1.0]
    assert scores(rewards, square, "\\boxed{144}", "\\boxed{124}") == [0.0, -1.0]
    # hf: the same folder, the schema told by its columns
    assert load_problems("hf", str(folder)) == [primes, square]
    # a plain-text prompt (TRL's standard format): one user message through the template, as is without one
    text = write_jsonl([{"prompt": "Q: 3 + 4 =", "solution": "7"}], tmp_path / "plain.jsonl")
    (plain,) = load_problems("trl", text)
    assert prompt_text(plain, tok) == chatml(("user", "Q: 3 + 4 =")) and prompt_text(plain) == "Q: 3 + 4 ="


def test_datasets_folders_and_hf_schemas(tmp_path):
    import datasets

    both = tmp_path / "both"
    datasets.DatasetDict({"train": datasets.Dataset.from_list(trl_rows()),
                          "test": datasets.Dataset.from_list(trl_rows()[:1])}).save_to_disk(str(both))
    with pytest.raises(TaskFormatError, match=r"both: a DatasetDict with splits train, test; give one split's folder"):
        load_problems("hf", str(both))
    assert len(load_problems("hf", str(both), split="test")) == 1
    assert len(load_problems("hf", str(both / "train"))) == 2
    datasets.Dataset.from_list(verl_rows()[:2]).save_to_disk(str(tmp_path / "verl"))
    assert [p.answer for p in load_problems("hf", str(tmp_path / "verl"))] == ["42", "\\frac{3}{4}"]
    slime = write_jsonl([{"text": "1+2?", "label": "3"}], tmp_path / "s.jsonl")
    (p,) = load_framework("hf", slime, ImportOptions(input_key="text", label_key="label"))
    assert (p.source, p.answer) == ("slime", "3")
    with pytest.raises(TaskFormatError, match=r"nothing: not a folder written by datasets' save_to_disk"):
        (tmp_path / "nothing").mkdir()
        load_problems("hf", str(tmp_path / "nothing"))


# ---------------------------------------------------------------------------------------------
# Our own JSONL carries the same: messages, answer_format, harness
# ---------------------------------------------------------------------------------------------
def test_problems_jsonl_takes_chat_messages_answer_formats_and_call_harnesses(tmp_path, tok):
    from megatron_spo.data.problem import read_problems_jsonl
    from megatron_spo.rewards.sandbox import CallHarness

    rows = [{"id": "chat", "messages": [{"role": "user", "content": "6*7?"}], "kind": "math", "answer": "42",
             "answer_format": "gsm8k"},
            {"id": "fn", "prompt": "Write add(a, b).", "tests": [["[1, 2]", "3"]], "harness": {"fn_name": "add"}}]
    chat, fn = read_problems_jsonl(write_jsonl(rows, tmp_path / "mine.jsonl"))
    assert (chat.prompt, chat.messages, chat.answer_format) == ("6*7?", (("user", "6*7?"),), "gsm8k")
    assert prompt_text(chat, tok) == chatml(("user", "6*7?")) and fn.harness == CallHarness(fn_name="add")
    rows[1]["harness"] = {"fn": "add"}
    with pytest.raises(ValueError, match=r"bad\.jsonl:2: field 'harness' must be an object of strings with keys among"):
        read_problems_jsonl(write_jsonl(rows, tmp_path / "bad.jsonl"))


def test_held_out_files_read_with_the_tasks_keys(tmp_path):
    path = write_jsonl([{"q": "1+1?", "a": "2"}, {"q": "2+2?", "a": "4"}], tmp_path / "held.jsonl")
    task = TaskConfig(kind="slime", paths=[path], input_key="q", label_key="a")
    assert [p.answer for p in held_out_problems(task, [path], limit=1)] == ["2"]
