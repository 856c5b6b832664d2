"""Prompts as plain data: a Prompt is (prompt_id, token ids, problem); make_prompts builds them from problems
with the policy's tokenizer, as training and every tool do.

    prompts = make_prompts(load_problems("toy", split="train"), tokenizer)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


@dataclass
class Prompt:
    prompt_id: str
    tokens: list[int]
    problem: Any = None  # what the reward function needs (tests, answer, ...)


def prompt_text(problem: Any, tokenizer: Any = None, prompt_format: str = "auto") -> str:
    """The model input text. auto: a generated task's prompt as is (its models are trained on it), else
    build_prompt (chat template or a plain layout with the task instruction)."""
    from megatron_spo.data import toy_code, toy_math
    from megatron_spo.data.tasks import build_prompt

    if prompt_format not in ("auto", "raw", "template"):
        raise ValueError(f"prompt_format must be auto, raw or template, got '{prompt_format}'")
    generated = isinstance(problem, (toy_code.Problem, toy_math.Problem))
    raw = prompt_format == "raw" or (prompt_format == "auto" and generated)
    return problem.prompt if raw else build_prompt(problem, tokenizer)


def make_prompts(problems: Sequence[Any], tokenizer: Any, *, prompt_format: str = "auto") -> list[Prompt]:
    """Prompt(prompt_id, tokens, problem) per problem; ids must be unique."""
    prompts, seen = [], set()
    bos = getattr(tokenizer, "bos_token", None)
    for problem in problems:
        if problem.id in seen:
            raise ValueError(f"problem id '{problem.id}' appears twice: ids key the tools' outputs")
        seen.add(problem.id)
        text = prompt_text(problem, tokenizer, prompt_format)
        # a chat template usually writes BOS itself: do not add a second one
        ids = tokenizer(text, add_special_tokens=not (bos and text.startswith(bos)))["input_ids"]
        prompts.append(Prompt(prompt_id=str(problem.id), tokens=list(ids), problem=problem))
    return prompts
