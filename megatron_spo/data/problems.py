"""Problems of a task as plain data: a problems JSONL, a task kind's files (data/tasks.py TASK_KINDS), or the
training prompt set a TaskConfig names.

    problems = load_problems("toy", split="train")
    problems = load_problems("jsonl", ["mine/*.jsonl"])          # files, globs; extra fields -> metadata
    problems = problems_from_task_config(train_config.task)
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from megatron_spo.config import DuplicateKeyError, loads_json, quote

KNOWN_FIELDS = ("id", "prompt", "tests", "hidden_tests", "kind", "answer", "time_limit_s", "memory_mb", "source",
                "metadata")


def read_problems_jsonl(paths: str | Path | Sequence[str | Path]) -> list:
    """Problems from JSONL files (a path, a glob or a list of them), one per line: {id, prompt, tests: [[stdin,
    stdout], ...], hidden_tests?, kind? ("code" | "math"), answer?, time_limit_s?, memory_mb?, source?,
    metadata?}. Any other field (difficulty, tags, ...) goes into the problem's ``metadata`` dict, which rewards
    (a custom reward hook gets the problem) read as ``problem.metadata``."""
    from megatron_spo.data.tasks import expand_paths

    items = [paths] if isinstance(paths, (str, Path)) else list(paths)
    return [p for path in expand_paths([str(i) for i in items]) for p in _read_one_jsonl(path)]


def _read_one_jsonl(path: str) -> list:
    from megatron_spo.data.tasks import Problem

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


def load_problems(task: str, data: str | Sequence[str] | None = None, *, split: str = "all", toy_seed: int = 0) -> list:
    """Problems of a task kind (data/tasks.py TASK_KINDS): the generated toy task (split train | heldout | all),
    or a file (glob) of CodeContests / TACO / MATH in their published schemas, or a problems JSONL."""
    from megatron_spo.data.tasks import TASK_KINDS

    if task not in TASK_KINDS:
        raise ValueError(f"--task must be one of {', '.join(TASK_KINDS)}, got '{task}'")
    if TASK_KINDS[task].needs_files and not data:
        raise ValueError(f"--task {task} needs --data PATH")
    return TASK_KINDS[task].load(data, split, toy_seed)


def problems_from_task_config(task: Any) -> list:
    """The training problems a TaskConfig names (the trainer's prompt set: toy train split, or files minus
    the dedup_against set)."""
    from megatron_spo.data import tasks

    if not tasks.TASK_KINDS[task.kind].needs_files:  # generated: toy (code) or toy_math
        return list(tasks.generated_task(task.kind, task.toy).train)[: task.limit]
    if not task.paths:
        raise ValueError(f"task.paths: task kind '{task.kind}' needs data files")
    problems = load_problems(task.kind, task.paths)
    if task.dedup_against:
        problems, _ = tasks.dedup_against(problems, tasks.load_taco(task.dedup_against))
    return problems[: task.limit]
