"""A task's problem: the record every task yields (data/tasks.py loaders, the generated tasks toy_code and
toy_math), and the problems JSONL format users bring.

    problems = read_problems_jsonl(["mine/*.jsonl"])   # {id, prompt, tests, hidden_tests?, kind?, answer?, ...}
    files = expand_paths("code_contests/train-*.parquet")
"""

from __future__ import annotations

import glob
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from megatron_spo.config import DuplicateKeyError, loads_json, quote

if TYPE_CHECKING:
    from megatron_spo.rewards.sandbox import CallHarness

Test = tuple[str, str]


@dataclass(frozen=True)
class Problem:
    """One task prompt with what is needed to score a response.

    prompt: the problem statement (no instruction, no chat formatting: see build_prompt).
    tests / hidden_tests: (stdin, expected stdout) pairs; rewards use ``tests``, evaluation may add the
    hidden ones. answer: the reference final answer (math). time_limit_s / memory_mb: the problem's own
    limits when its source gives them. The generated tasks' problems (toy_code.Problem, toy_math.Problem) are
    Problems too, with the fields of how they were generated.
    messages: an imported chat prompt ((role, content), ...), sent through the chat template as it is (no task
    instruction added; ``prompt`` is then its last user message). answer_format: how a math completion marks its
    answer: boxed (the last \\boxed{}) or gsm8k (after the last '####', else \\boxed{}). harness: the
    sandbox.CallHarness of function-call tests (HumanEval, MBPP, TACO's fn_name): ``tests`` are then (code,
    "") or (JSON arguments, JSON result) pairs. instruction: what build_prompt appends to the statement (None: its
    kind's, e.g. tasks.MATH_INSTRUCTION; "": nothing; a chat prompt gets it only when set): task.instruction sets it.
    """

    id: str
    prompt: str
    tests: tuple[Test, ...] = ()
    hidden_tests: tuple[Test, ...] = ()
    source: str = ""
    kind: Literal["code", "math"] = "code"
    answer: str | None = None
    time_limit_s: float | None = None
    memory_mb: int | None = None
    messages: tuple[tuple[str, str], ...] | None = None
    answer_format: Literal["boxed", "gsm8k"] = "boxed"
    harness: CallHarness | None = None
    metadata: dict[str, Any] = field(default_factory=dict, compare=False)
    instruction: str | None = None


def expand_paths(paths: str | Sequence[str]) -> list[str]:
    """Files of a path, a glob, or a list of them (each must match something)."""
    items = [paths] if isinstance(paths, str) else list(paths)
    files: list[str] = []
    for item in items:
        matched = sorted(glob.glob(item))
        if not matched:
            raise FileNotFoundError(f"task file(s) '{item}' not found")
        files += matched
    return files


KNOWN_FIELDS = ("id", "prompt", "tests", "hidden_tests", "kind", "answer", "time_limit_s", "memory_mb", "source",
                "messages", "answer_format", "harness", "metadata", "instruction")
HARNESS_FIELDS = ("prefix", "setup", "fn_name")


def chat_messages(value: Any, where: str, name: str = "messages") -> tuple[tuple[str, str], ...]:
    """A chat prompt [{role, content}, ...] (at least one message, string contents) as ((role, content), ...)."""
    if not isinstance(value, (list, tuple)) or not value:
        raise ValueError(f"{where}: field '{name}' must be a non-empty list of {{role, content}} messages")
    out = []
    for i, m in enumerate(value):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise ValueError(f"{where}: field '{name}' message {i} must be {{'role': str, 'content': str}}, "
                             f"got {m!r:.80}")
        out.append((m["role"], m["content"]))
    return tuple(out)


def last_user_text(messages: Sequence[tuple[str, str]]) -> str:
    """The statement of a chat prompt: its last user message (else its last message)."""
    return next((c for r, c in reversed(messages) if r == "user"), messages[-1][1])


def call_harness(value: Any, where: str, name: str = "harness") -> CallHarness:
    """A JSONL {prefix?, setup?, fn_name?} as the sandbox's CallHarness."""
    from megatron_spo.rewards.sandbox import CallHarness

    if not isinstance(value, dict) or set(value) - set(HARNESS_FIELDS) or not all(
            isinstance(v, str) for v in value.values()):
        raise ValueError(f"{where}: field '{name}' must be an object of strings with keys among "
                         f"{', '.join(HARNESS_FIELDS)}")
    return CallHarness(**value)


def read_problems_jsonl(paths: str | Path | Sequence[str | Path]) -> list:
    """Problems from JSONL files (a path, a glob or a list of them), one per line: {id, prompt, tests: [[stdin,
    stdout], ...], hidden_tests?, kind? ("code" | "math"), answer?, time_limit_s?, memory_mb?, source?,
    messages? ([{role, content}, ...]: a chat prompt; prompt may then be left out), answer_format? ("boxed" |
    "gsm8k"), harness? ({prefix?, setup?, fn_name?}: function-call tests), instruction? (replaces the kind's
    instruction; "": none), metadata?}. Any other field
    (difficulty, tags, ...) goes into the problem's ``metadata`` dict, which rewards (a custom reward hook gets
    the problem) read as ``problem.metadata``."""
    items = [paths] if isinstance(paths, (str, Path)) else list(paths)
    return [p for path in expand_paths([str(i) for i in items]) for p in _read_one_jsonl(path)]


def _read_one_jsonl(path: str) -> list:
    problems = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                row = loads_json(line)
            except DuplicateKeyError as err:  # json.loads would keep the last value silently
                raise ValueError(f"{where}: duplicate key {quote(err.key)} (a problem holds each key once)") from None
            except ValueError as err:
                raise ValueError(f"{where}: not valid JSON ({err})") from None
            if not isinstance(row, dict):
                raise ValueError(f"{where}: a problem must be a JSON object")
            messages = chat_messages(row["messages"], where) if row.get("messages") is not None else None
            if messages and "prompt" not in row:
                row = {**row, "prompt": last_user_text(messages)}
            for name in ("id", "prompt"):
                if not isinstance(row.get(name), str) or not row[name]:
                    raise ValueError(f"{where}: field '{name}' must be a non-empty string")
            tests = {}
            for name in ("tests", "hidden_tests"):
                value = row.get(name) or []
                if not isinstance(value, list) or not all(
                        isinstance(t, list) and len(t) == 2 and all(isinstance(s, str) for s in t) for t in value):
                    raise ValueError(f"{where}: field '{name}' must be a list of [stdin, stdout] string pairs")
                tests[name] = tuple((a, b) for a, b in value)
            kind = row.get("kind", "code")
            if kind not in ("code", "math"):
                raise ValueError(f"{where}: field 'kind' must be 'code' or 'math', got {kind!r}")
            if kind == "math" and not isinstance(row.get("answer"), str):
                raise ValueError(f"{where}: field 'answer' is required (a string) for a math problem")
            answer_format = row.get("answer_format", "boxed")
            if answer_format not in ("boxed", "gsm8k"):
                raise ValueError(f"{where}: field 'answer_format' must be 'boxed' or 'gsm8k', got {answer_format!r}")
            harness = call_harness(row["harness"], where) if row.get("harness") is not None else None
            metadata = row.get("metadata") or {}
            if not isinstance(metadata, dict):
                raise ValueError(f"{where}: field 'metadata' must be a JSON object")
            metadata = {**{k: v for k, v in row.items() if k not in KNOWN_FIELDS}, **metadata}
            if row.get("instruction") is not None and not isinstance(row["instruction"], str):
                raise ValueError(f"{where}: field 'instruction' must be a string")
            problems.append(Problem(id=row["id"], prompt=row["prompt"], tests=tests["tests"],
                                    hidden_tests=tests["hidden_tests"], kind=kind, answer=row.get("answer"),
                                    source=row.get("source", "jsonl"), time_limit_s=row.get("time_limit_s"),
                                    memory_mb=row.get("memory_mb"), messages=messages, answer_format=answer_format,
                                    harness=harness, metadata=metadata, instruction=row.get("instruction")))
    return problems
