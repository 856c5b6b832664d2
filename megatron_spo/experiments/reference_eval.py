"""Held-out pass@k of a built reference with transformers' own sampling: no engines, for `megatron-spo reference
--eval N` (the quickstart measures the same thing through its engines).

    result = evaluate_reference(path, task.heldout, n=20)     # EvalResult: result.mean[1], result.mean[10]

Samples n completions per problem (temperature 0.4, top-p 0.95: the quickstart's evaluation), scores them with
the problems' own reward (math answers, or programs on reward + hidden tests in the sandbox) and averages the
unbiased pass@k over problems.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any


def sample_completions(model, tokenizer, prompts: Sequence[str], n: int, *, temperature: float, top_p: float,
                       max_new_tokens: int, seed: int, batch_problems: int = 8) -> list[list[str]]:
    """n completions of each prompt (texts without special tokens), prompts in batches of batch_problems."""
    import torch

    out: list[list[str]] = []
    torch.manual_seed(seed)
    for start in range(0, len(prompts), batch_problems):
        chunk = [p for p in prompts[start:start + batch_problems] for _ in range(n)]
        enc = tokenizer(chunk, return_tensors="pt", padding=True)
        with torch.no_grad():
            ids = model.generate(**enc, do_sample=True, temperature=temperature, top_p=top_p,
                                 max_new_tokens=max_new_tokens, eos_token_id=tokenizer.eos_token_id,
                                 pad_token_id=tokenizer.pad_token_id)
        texts = tokenizer.batch_decode(ids[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
        out += [texts[i:i + n] for i in range(0, len(texts), n)]
    return out


def evaluate_reference(path: str | Path, problems: Sequence[Any], *, n: int = 20, temperature: float = 0.4,
                       top_p: float = 0.95, max_new_tokens: int = 96, ks: Sequence[int] = (1, 10), seed: int = 0,
                       threads: int = 2):
    """EvalResult of the reference at ``path`` on ``problems`` (hidden tests count for code)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from megatron_spo.engine_tools.eval import EvalResult, ProblemEval, pass_at_ks, tests_used
    from megatron_spo.rewards.config import SandboxConfig
    from megatron_spo.rewards.reward import RewardPool, needs_sandbox
    from megatron_spo.rewards.sandbox import SandboxPool

    torch.set_num_threads(threads)
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    completions = sample_completions(model, tokenizer, [p.prompt for p in problems], n, temperature=temperature,
                                     top_p=top_p, max_new_tokens=max_new_tokens, seed=seed)
    sandbox = SandboxPool(SandboxConfig(time_limit_s=1.0, memory_mb=256)) if needs_sandbox(problems) else None
    rewards = RewardPool(sandbox, hidden=True)
    try:
        evals = []
        for problem, texts in zip(problems, completions):
            correct = sum(rewards.submit(problem, t).result().passed for t in texts)
            evals.append(ProblemEval(str(problem.id), n, correct, pass_at_ks(n, correct, ks),
                                     tests_used(problem, True)))
    finally:
        rewards.close()
        if sandbox is not None:
            sandbox.close()
    return EvalResult(evals, tuple(ks), n, temperature, top_p)
