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
from typing import Any, Literal

from megatron_spo.config import DuplicateKeyError, loads_json, quote

Test = tuple[str, str]


@dataclass(frozen=True)
class Problem:
    """One task prompt with what is needed to score a response.

    prompt: the problem statement (no instruction, no chat formatting: see build_prompt).
    tests / hidden_tests: (stdin, expected stdout) pairs; rewards use ``tests``, evaluation may add the
    hidden ones. answer: the reference final answer (math). time_limit_s / memory_mb: the problem's own
    limits when its source gives them. The generated tasks' problems (toy_code.Problem, toy_math.Problem) are
    Problems too, with the fields of how they were generated.
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
    metadata: dict[str, Any] = field(default_factory=dict, compare=False)


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
                "metadata")


def read_problems_jsonl(paths: str | Path | Sequence[str | Path]) -> list:
    """Problems from JSONL files (a path, a glob or a list of them), one per line: {id, prompt, tests: [[stdin,
    stdout], ...], hidden_tests?, kind? ("code" | "math"), answer?, time_limit_s?, memory_mb?, source?,
    metadata?}. Any other field (difficulty, tags, ...) goes into the problem's ``metadata`` dict, which rewards
    (a custom reward hook gets the problem) read as ``problem.metadata``."""
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
            metadata = row.get("metadata") or {}
            if not isinstance(metadata, dict):
                raise ValueError(f"{where}: field 'metadata' must be a JSON object")
            metadata = {**{k: v for k, v in row.items() if k not in KNOWN_FIELDS}, **metadata}
            problems.append(Problem(id=row["id"], prompt=row["prompt"], tests=tests["tests"],
                                    hidden_tests=tests["hidden_tests"], kind=kind, answer=row.get("answer"),
                                    source=row.get("source", "jsonl"), time_limit_s=row.get("time_limit_s"),
                                    memory_mb=row.get("memory_mb"), metadata=metadata))
    return problems
