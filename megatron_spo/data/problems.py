"""Problems of a task as plain data: a problems JSONL (read by data/problem.py), a task kind's files (data/tasks.py
TASK_KINDS), or the training prompt set a TaskConfig names.

    problems = load_problems("toy", split="train")
    problems = load_problems("jsonl", ["mine/*.jsonl"])          # files, globs; extra fields -> metadata
    problems = problems_from_task_config(train_config.task)
    problems = held_out_problems(train_config.task, train_config.eval.paths, train_config.eval.limit)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def load_problems(task: str, data: str | Sequence[str] | None = None, *, split: str = "all", toy_seed: int = 0,
                  options: Any = None) -> list:
    """Problems of a task kind (data/tasks.py TASK_KINDS): the generated toy task (split train | heldout | all),
    or a file (glob) of CodeContests / TACO / MATH / HumanEval / MBPP in their published schemas, a problems
    JSONL, or verl / slime / TRL / datasets-folder rows (``options``: data/frameworks.py ImportOptions, the
    task's input_key, label_key, metadata_key and reward_kind)."""
    from megatron_spo.data.tasks import TASK_KINDS

    if task not in TASK_KINDS:
        raise ValueError(f"--task must be one of {', '.join(TASK_KINDS)}, got '{task}'")
    if TASK_KINDS[task].needs_files and not data:
        raise ValueError(f"--task {task} needs --data PATH")
    return TASK_KINDS[task].load(data, split, toy_seed, options)


def problems_from_task_config(task: Any) -> list:
    """The training problems a TaskConfig names (the trainer's prompt set: toy train split, or files minus
    the dedup_against set)."""
    from megatron_spo.data import tasks
    from megatron_spo.data.frameworks import import_options

    if not tasks.TASK_KINDS[task.kind].needs_files:  # generated: toy (code) or toy_math
        return with_instruction(list(tasks.generated_task(task.kind, task.toy).train)[: task.limit], task.instruction)
    if not task.paths:
        raise ValueError(f"task.paths: task kind '{task.kind}' needs data files")
    problems = load_problems(task.kind, task.paths, options=import_options(task))
    if task.dedup_against:
        problems, _ = tasks.dedup_against(problems, tasks.load_taco(task.dedup_against))
    return with_instruction(problems[: task.limit], task.instruction)


def held_out_problems(task: Any, paths: Sequence[str] = (), limit: int | None = None) -> list:
    """The held-out problems of a training config: ``paths`` (its eval.paths) read as task.kind reads task.paths,
    else the generated task's (toy / toy_math) held-out split; cut to ``limit``."""
    from megatron_spo.data import tasks
    from megatron_spo.data.frameworks import import_options

    if paths:
        problems = load_problems(task.kind, list(paths), options=import_options(task))
    elif tasks.TASK_KINDS[task.kind].needs_files:
        raise ValueError(f"eval.paths: task kind '{task.kind}' has no generated held-out split; name the "
                         "held-out files in eval.paths (or --data)")
    else:
        problems = list(tasks.generated_task(task.kind, task.toy).heldout)
    return with_instruction(problems[:limit], task.instruction)


def with_instruction(problems: list, instruction: str | None) -> list:
    """The problems with ``instruction`` (task.instruction) in place of their own (None: unchanged)."""
    import dataclasses

    if instruction is None:
        return problems
    return [dataclasses.replace(p, instruction=instruction) for p in problems]
