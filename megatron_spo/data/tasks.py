"""Task loaders: CodeContests, TACO and MATH from local files in their published schemas, and prompts.

    problems = load_codecontests("code_contests/train-*.parquet")
    taco_test = load_taco("taco/test.jsonl")
    train, dropped = dedup_against(problems, taco_test)          # as the SPO paper does
    text = build_prompt(train[0], tokenizer)                       # chat template, or a plain fallback

Schemas (files are read with the ``datasets`` library, parquet or json/jsonl by extension):
  * CodeContests (deepmind/code_contests): name, description, public_tests / private_tests /
    generated_tests as {"input": [...], "output": [...]}, time_limit {"seconds", "nanos"} (nullable),
    memory_limit_bytes, source, difficulty.
  * TACO (BAAI/TACO): question, input_output (a JSON string {"inputs": [...], "outputs": [...],
    optional "fn_name"}), starter_code, name, source, difficulty, time_limit, memory_limit (strings). Call-based
    problems (fn_name) get function-call tests (rewards/sandbox.py CallHarness): each input is the call's
    argument list, each output its expected return value.
  * MATH (hendrycks competition_math): problem, solution (final answer in \\boxed{}), level, type.
  * HumanEval (openai/human-eval, HumanEval.jsonl(.gz)): task_id, prompt (signature and docstring),
    canonical_solution, test (defines check(candidate)), entry_point; one function-call test, check(entry_point),
    on prompt + completion.
  * MBPP (google-research/mbpp): task_id, text, code, test_list (assert statements), test_setup_code,
    challenge_test_list; each assert is a function-call test.
Other frameworks' formats (verl, slime, TRL, datasets folders) are read by data/frameworks.py.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from megatron_spo.config import DuplicateKeyError, loads_json
from megatron_spo.data.problem import Problem, Test, expand_paths, read_problems_jsonl

if TYPE_CHECKING:
    from megatron_spo.rewards.sandbox import CallHarness

logger = logging.getLogger(__name__)

CODE_INSTRUCTION = (
    "Write a Python 3 program that reads the input from standard input and prints the answer to standard "
    "output. Put the whole program in one ```python code block."
)
MATH_INSTRUCTION = "Reason step by step, and put your final answer within \\boxed{}."
CALL_INSTRUCTION = (
    "Write the Python function the problem asks for; the tests call it (nothing is read from standard input). "
    "Put the whole solution, with its imports, in one ```python code block."
)


class TaskFormatError(ValueError):
    """A task file row that does not fit its schema; the message names file, row and field."""


# ---------------------------------------------------------------------------------------------
# Reading files
# ---------------------------------------------------------------------------------------------
def read_rows(paths: str | Sequence[str], cache_dir: str | None = None) -> Iterable[tuple[str, int, dict]]:
    """(file, row index, row dict) for every row of parquet / json / jsonl files, via ``datasets``."""
    import datasets

    for path in expand_paths(paths):
        fmt = "parquet" if path.endswith(".parquet") else "json"
        ds = datasets.load_dataset(fmt, data_files=path, split="train", cache_dir=cache_dir)
        for i, row in enumerate(ds):
            yield path, i, row


def _field(row: dict, name: str, where: str, types: type | tuple[type, ...]) -> Any:
    if name not in row:
        raise TaskFormatError(f"{where}: missing field '{name}'")
    value = row[name]
    if not isinstance(value, types):
        raise TaskFormatError(f"{where}: field '{name}' should be {types}, got {type(value).__name__}")
    return value


def _tests(value: Any, where: str, name: str) -> tuple[Test, ...]:
    """CodeContests {"input": [...], "output": [...]} (None means no tests)."""
    if value is None:
        return ()
    if not isinstance(value, dict) or not {"input", "output"} <= set(value):
        raise TaskFormatError(f"{where}: field '{name}' should be {{'input': [...], 'output': [...]}}")
    inputs, outputs = value["input"] or [], value["output"] or []
    if len(inputs) != len(outputs):
        raise TaskFormatError(f"{where}: field '{name}' has {len(inputs)} inputs but {len(outputs)} outputs")
    return tuple((str(i), str(o)) for i, o in zip(inputs, outputs))


# ---------------------------------------------------------------------------------------------
# CodeContests
# ---------------------------------------------------------------------------------------------
def codecontests_problem(row: dict, where: str, *, hidden: Sequence[str] = ("private_tests", "generated_tests"),
                         min_tests: int = 1) -> Problem | None:
    """One CodeContests row -> Problem (None: fewer than ``min_tests`` tests in all). Reward tests = public tests
    (the hidden ones when a problem has none); hidden tests = the ``hidden`` groups."""
    name = _field(row, "name", where, str)
    description = _field(row, "description", where, str)
    public = _tests(row.get("public_tests"), where, "public_tests")
    hidden_tests = tuple(t for group in hidden for t in _tests(row.get(group), where, group))
    if len(public) + len(hidden_tests) < min_tests:
        return None
    limit = row.get("time_limit")
    time_limit_s = None
    if isinstance(limit, dict) and limit.get("seconds") is not None:
        time_limit_s = float(limit["seconds"]) + float(limit.get("nanos") or 0) / 1e9 or None
    memory = row.get("memory_limit_bytes")
    return Problem(
        id=f"codecontests/{name}", prompt=description.strip(), tests=public or hidden_tests,
        hidden_tests=hidden_tests, source="codecontests", kind="code", time_limit_s=time_limit_s,
        memory_mb=int(memory) >> 20 if memory else None,
        metadata={"difficulty": row.get("difficulty"), "cf_rating": row.get("cf_rating")},
    )


def load_codecontests(paths: str | Sequence[str], *, hidden: Sequence[str] = ("private_tests", "generated_tests"),
                      cache_dir: str | None = None, min_tests: int = 1) -> list[Problem]:
    """codecontests_problem of every row; problems with fewer than ``min_tests`` tests are skipped and counted
    in the log."""
    problems, skipped = [], 0
    for path, i, row in read_rows(paths, cache_dir):
        problem = codecontests_problem(row, f"{path} row {i}", hidden=hidden, min_tests=min_tests)
        if problem is None:
            skipped += 1
            continue
        problems.append(problem)
    if skipped:
        logger.info("codecontests: skipped %d problems with fewer than %d tests", skipped, min_tests)
    return problems


# ---------------------------------------------------------------------------------------------
# TACO
# ---------------------------------------------------------------------------------------------
def _limit_number(text: Any) -> float | None:
    match = re.search(r"[\d.]+", str(text or ""))
    try:
        return float(match.group()) if match else None
    except ValueError:
        return None


def io_tests(raw: Any, where: str, name: str) -> tuple[tuple[Test, ...], CallHarness | None]:
    """TACO / APPS tests {"inputs": [...], "outputs": [...], "fn_name"?} (a JSON string or the dict): stdin/stdout
    pairs, or with fn_name (JSON arguments, JSON result) pairs and the CallHarness that calls fn_name."""
    from megatron_spo.rewards.sandbox import CallHarness

    io = raw
    if isinstance(raw, str):
        try:
            io = loads_json(raw)
        except DuplicateKeyError as err:
            raise TaskFormatError(f"{where}: field '{name}' holds {err}") from None
        except ValueError as err:
            raise TaskFormatError(f"{where}: field '{name}' is not valid JSON ({err})") from None
    if not isinstance(io, dict) or not {"inputs", "outputs"} <= set(io):
        raise TaskFormatError(f"{where}: field '{name}' should hold 'inputs' and 'outputs'")
    if len(io["inputs"]) != len(io["outputs"]):
        raise TaskFormatError(f"{where}: field '{name}' has {len(io['inputs'])} inputs but "
                              f"{len(io['outputs'])} outputs")
    fn_name = io.get("fn_name")
    if not fn_name:
        return tuple((_text(x), _text(y)) for x, y in zip(io["inputs"], io["outputs"])), None
    if not isinstance(fn_name, str) or not fn_name.isidentifier():
        raise TaskFormatError(f"{where}: field '{name}' has fn_name {fn_name!r}, not a Python name")
    tests = tuple((json.dumps(x if isinstance(x, list) else [x]), json.dumps(y))
                  for x, y in zip(io["inputs"], io["outputs"]))
    return tests, CallHarness(fn_name=fn_name)


def taco_problem(row: dict, index: int, where: str, *, n_reward_tests: int | None = None) -> Problem:
    """One TACO row (row ``index`` of its file) -> Problem: stdin/stdout tests, or function-call tests for a
    call-based problem (fn_name; its starter code joins the prompt). The first ``n_reward_tests`` tests reward
    (all when None); the rest are hidden."""
    question = _field(row, "question", where, str)
    tests, harness = io_tests(_field(row, "input_output", where, str), where, "input_output")
    k = len(tests) if n_reward_tests is None else n_reward_tests
    name = row.get("name") or ""
    starter = (row.get("starter_code") or "").strip() if harness else ""
    return Problem(
        id=f"taco/{index}" + (f"/{name}" if name else ""),
        prompt=question.strip() + (f"\n\n```python\n{starter}\n```" if starter else ""), tests=tests[:k],
        hidden_tests=tests[k:], source="taco", kind="code", harness=harness,
        time_limit_s=_limit_number(row.get("time_limit")),
        memory_mb=int(_limit_number(row.get("memory_limit")) or 0) or None,
        metadata={"difficulty": row.get("difficulty"), "url": row.get("url")},
    )


def load_taco(paths: str | Sequence[str], *, n_reward_tests: int | None = None,
              cache_dir: str | None = None) -> list[Problem]:
    """taco_problem of every row (call-based ones with function-call tests)."""
    return [taco_problem(row, i, f"{path} row {i}", n_reward_tests=n_reward_tests)
            for path, i, row in read_rows(paths, cache_dir)]


def _text(value: Any) -> str:
    """TACO stores some tests as lists of lines."""
    return "\n".join(map(str, value)) + "\n" if isinstance(value, list) else str(value)


# ---------------------------------------------------------------------------------------------
# MATH
# ---------------------------------------------------------------------------------------------
def load_math(paths: str | Sequence[str], *, cache_dir: str | None = None) -> list[Problem]:
    """MATH problems; the reference answer is the last \\boxed{} of the solution."""
    from megatron_spo.rewards.math_answer import last_boxed

    problems = []
    for path, i, row in read_rows(paths, cache_dir):
        where = f"{path} row {i}"
        problem = _field(row, "problem", where, str)
        solution = _field(row, "solution", where, str)
        answer = last_boxed(solution)
        if answer is None:
            raise TaskFormatError(f"{where}: field 'solution' has no \\boxed{{}} answer")
        problems.append(Problem(
            id=f"math/{row.get('unique_id') or i}", prompt=problem.strip(), source="math", kind="math",
            answer=answer, metadata={"level": row.get("level"), "type": row.get("type")},
        ))
    return problems


# ---------------------------------------------------------------------------------------------
# HumanEval and MBPP: function-call tests
# ---------------------------------------------------------------------------------------------
def load_humaneval(paths: str | Sequence[str], *, cache_dir: str | None = None) -> list[Problem]:
    """HumanEval problems: the prompt (the function's signature and docstring) shown in a code block; the reward
    runs prompt + completion (a completion may be the body or the whole function), then the test's
    check(entry_point)."""
    from megatron_spo.rewards.sandbox import CallHarness

    problems = []
    for path, i, row in read_rows(paths, cache_dir):
        where = f"{path} row {i}"
        task_id, prompt, test, entry = (_field(row, k, where, str) for k in ("task_id", "prompt", "test", "entry_point"))
        if not entry.isidentifier():
            raise TaskFormatError(f"{where}: field 'entry_point' {entry!r} is not a Python name")
        problems.append(Problem(
            id=task_id, prompt=f"Complete the Python function `{entry}`:\n\n```python\n{prompt.rstrip()}\n```",
            tests=((f"check({entry})", ""),), source="humaneval", kind="code",
            harness=CallHarness(prefix=prompt, setup=test), metadata={"entry_point": entry},
        ))
    return problems


def load_mbpp(paths: str | Sequence[str], *, cache_dir: str | None = None) -> list[Problem]:
    """MBPP problems: the text and its asserts in the prompt (the MBPP paper's format: they name the function);
    each assert is a function-call test, challenge_test_list the hidden ones."""
    from megatron_spo.rewards.sandbox import CallHarness

    problems = []
    for path, i, row in read_rows(paths, cache_dir):
        where = f"{path} row {i}"
        text = _field(row, "text", where, str)
        asserts = _field(row, "test_list", where, list)
        hidden = row.get("challenge_test_list") or []
        if not asserts or not all(isinstance(a, str) for a in [*asserts, *hidden]):
            raise TaskFormatError(f"{where}: field 'test_list' should be a non-empty list of assert statements")
        problems.append(Problem(
            id=f"mbpp/{row.get('task_id', i)}",
            prompt=f"{text.strip()}\nYour code should pass these tests:\n\n" + "\n".join(asserts),
            tests=tuple((a, "") for a in asserts), hidden_tests=tuple((a, "") for a in hidden), source="mbpp",
            kind="code", harness=CallHarness(setup=row.get("test_setup_code") or ""),
        ))
    return problems


# ---------------------------------------------------------------------------------------------
# Deduplication and prompts
# ---------------------------------------------------------------------------------------------
def text_key(text: str) -> str:
    """Hash of the statement with case, whitespace and punctuation removed (section headers like
    '-----Input-----' vs 'Input' then agree)."""
    return hashlib.sha1(re.sub(r"[^0-9a-z]+", "", text.lower()).encode()).hexdigest()


def dedup_against(train: Sequence[Problem], held_out: Sequence[Problem]) -> tuple[list[Problem], list[str]]:
    """Training problems whose statement does not appear in ``held_out``, and the ids dropped."""
    held = {text_key(p.prompt) for p in held_out}
    kept, dropped = [], []
    for p in train:
        (dropped.append(p.id) if text_key(p.prompt) in held else kept.append(p))
    if dropped:
        logger.info("dedup: dropped %d of %d training problems found in the held-out set", len(dropped), len(train))
    return kept, dropped


def build_prompt(problem: Problem, tokenizer: Any = None, *, system: str | None = None,
                 instruction: str | None = None) -> str:
    """The model input text: the tokenizer's chat template when it has one, else a plain layout. An imported chat
    prompt (problem.messages) goes through the template as it is (an explicit ``instruction`` is appended to
    its last message); without a template its messages' text is the prompt. ``instruction`` None: the problem's
    (task.instruction, a JSONL row's), else its kind's (MATH_INSTRUCTION, CODE_INSTRUCTION, CALL_INSTRUCTION)."""
    chat_template = tokenizer is not None and getattr(tokenizer, "chat_template", None)
    if instruction is None:
        instruction = getattr(problem, "instruction", None)
    if getattr(problem, "messages", None):
        messages = [{"role": r, "content": c} for r, c in problem.messages]
        if instruction:
            messages[-1]["content"] += f"\n\n{instruction}"
        if system and messages[0]["role"] != "system":
            messages.insert(0, {"role": "system", "content": system})
        if chat_template:
            return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return "\n\n".join(m["content"] for m in messages)
    if instruction is None:
        instruction = (MATH_INSTRUCTION if getattr(problem, "kind", "code") == "math" else
                       CALL_INSTRUCTION if getattr(problem, "harness", None) else CODE_INSTRUCTION)
    user = f"{problem.prompt}\n\n{instruction}" if instruction else problem.prompt
    if chat_template:
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": user}]
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    head = f"{system}\n\n" if system else ""
    return f"{head}Problem:\n{user}\n\nSolution:\n"


# ---------------------------------------------------------------------------------------------
# THE list of task kinds: config choices (task.kind, --task) and the tools derive from it
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class TaskKind:
    """A kind of task: how its problems load, and which reward scores them (rewards/reward.py REWARD_KINDS,
    by each problem's ``kind``). A new kind = one entry here (+ its loader and tests)."""

    name: str
    load: Any  # (data paths or None, split, toy seed, frameworks.ImportOptions or None) -> list of problems
    summary: str
    needs_files: bool = True  # False: generated, no --data


def _load_toy(data, split: str, seed: int, options=None) -> list:
    from megatron_spo.data.toy_code import make_task

    toy = make_task(seed=seed)
    splits = {"train": toy.train, "heldout": toy.heldout, "all": toy.problems}
    if split not in splits:
        raise ValueError(f"--split must be one of {sorted(splits)} for the toy task, got '{split}'")
    return list(splits[split])


def _load_toy_math(data, split: str, seed: int, options=None) -> list:
    from megatron_spo.data.toy_math import make_task

    toy = make_task(seed=seed)
    splits = {"train": toy.train, "heldout": toy.heldout, "all": toy.problems}
    if split not in splits:
        raise ValueError(f"--split must be one of {sorted(splits)} for the toy_math task, got '{split}'")
    return list(splits[split])


def _from_files(loader):
    def load(data, split: str, seed: int, options=None) -> list:
        return list(loader(data))

    return load


def _load_jsonl(data, split: str, seed: int, options=None) -> list:
    return read_problems_jsonl(data)


def _from_framework(kind: str):
    def load(data, split: str, seed: int, options=None) -> list:
        from megatron_spo.data.frameworks import load_framework

        return load_framework(kind, data, options, split=None if split == "all" else split)

    return load


TASK_KINDS: dict[str, TaskKind] = {k.name: k for k in (
    TaskKind("toy", _load_toy, "the generated toy code task (no files)", needs_files=False),
    TaskKind("toy_math", _load_toy_math, "generated arithmetic word problems, math reward (no files)",
             needs_files=False),
    TaskKind("codecontests", _from_files(load_codecontests), "CodeContests rows (parquet / jsonl)"),
    TaskKind("taco", _from_files(load_taco), "TACO rows (parquet / jsonl)"),
    TaskKind("math", _from_files(load_math), "MATH rows (answer in \\boxed{})"),
    TaskKind("jsonl", _load_jsonl, "problems JSONL: {id, prompt, tests, hidden_tests?, kind?, answer?}"),
    TaskKind("humaneval", _from_files(load_humaneval), "HumanEval rows (function-call tests: check(entry_point))"),
    TaskKind("mbpp", _from_files(load_mbpp), "MBPP rows (function-call tests: its asserts)"),
    TaskKind("verl", _from_framework("verl"), "verl rows: data_source, prompt (chat), reward_model.ground_truth"),
    TaskKind("slime", _from_framework("slime"), "slime rows: task.input_key / label_key / metadata_key"),
    TaskKind("trl", _from_framework("trl"), "TRL rows: prompt (text or chat), solution, other columns"),
    TaskKind("hf", _from_framework("hf"), "datasets folders (save_to_disk) or files in verl / trl / slime schemas"),
)}

# The quickstart's generated tasks (its reference.task.kind) -> their TASK_KINDS entry
GENERATED_TASKS: dict[str, str] = {"toy_code": "toy", "toy_math": "toy_math"}


def task_kind_name(name: str) -> str:
    """The TASK_KINDS name a user's task name means: itself, or a generated task's kind (toy_code -> toy), so
    every command takes the name the quickstart uses. Unknown names come back unchanged (for the caller's error)."""
    return name if name in TASK_KINDS else GENERATED_TASKS.get(name, name)


TASK_ALIASES = ", ".join(f"{g} = {k}" for g, k in GENERATED_TASKS.items() if g != k)


def generated_task(kind: str, settings: Any):
    """The generated task of TASK_KINDS ``kind`` ("toy" or "toy_math") from a ToyCodeTaskConfig's settings
    (toy_math reads seed, num_problems, heldout_fraction, max_solutions, num_sft_problems)."""
    fields = settings.model_dump(exclude={"kind"})
    if kind == "toy":
        from megatron_spo.data.toy_code import make_task

        return make_task(**fields)
    if kind == "toy_math":
        from megatron_spo.data.toy_math import make_task

        return make_task(**{k: fields[k] for k in ("seed", "num_problems", "heldout_fraction", "max_solutions",
                                                   "num_sft_problems")})
    raise ValueError(f"task kind '{kind}' is not generated (the generated ones: {', '.join(GENERATED_TASKS.values())})")
