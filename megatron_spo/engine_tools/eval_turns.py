"""pass@k of multi-turn conversations (an environment, rollout.env: docs/multi-turn.md) on held-out problems.

Each of n samples per problem is one conversation through the rollout manager's own code (token in, token out, the
environment's observations between the model's turns, its turn and token limits); every model turn's text is then
scored on the problem's tests, hidden ones included when the pool has them, as `eval` scores a sample. Reported:
pass@k at the first turn (what single-turn sampling of the same prompts gets), at the last (the answer the
conversation ends on), the mean model turns per conversation and the share of conversations whose first turn failed
and whose last passed (the feedback fixed it).

    result = await evaluate_turns(prompts, [url], tokenizer, RewardPool(sandbox, hidden=True), env, n=20)
    result.first.mean[1], result.last.mean[1], result.to_json()
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from megatron_spo.data.prompts import Prompt
from megatron_spo.data.trajectory import Trajectory, model_turns
from megatron_spo.engine_tools.eval import EvalResult, ProblemEval, pass_at_ks, tests_used
from megatron_spo.engine_tools.sampling import score_all


@dataclass(frozen=True)
class TurnsEval:
    """pass@k at the first and at the last model turn (each an EvalResult over the same conversations), mean model
    turns per conversation, and the share of conversations whose first turn failed and last passed."""

    first: EvalResult
    last: EvalResult
    mean_turns: float
    fixed_share: float

    def to_json(self) -> dict:
        return {"first_turn": self.first.to_json(), "last_turn": self.last.to_json(), "mean_turns": self.mean_turns,
                "fixed_share": self.fixed_share}


def turn_ids(tokens: Sequence[int], mask: Sequence[int] | None) -> list[list[int]]:
    """The model's turns of a response, as token ids (the whole response when it has no mask)."""
    if mask is None:
        return [list(tokens)]
    return [list(tokens[a:b]) for a, b in model_turns(list(mask))]


async def run_conversations(prompts: Sequence[Prompt], endpoints: Sequence[str], tokenizer: Any, reward_pool: Any,
                            env: Any, *, n: int, temperature: float, top_p: float, max_new_tokens: int = 512,
                            seed: int = 0, sandbox: Any = None,
                            max_inflight_requests: int = 8) -> dict[str, list[Trajectory]]:
    """prompt_id -> its n conversations (Trajectory, with the model/environment token mask) with environment ``env``
    (an EnvConfig) over the engines at ``endpoints``, through the rollout manager's own code. The task's reward
    (``reward_pool``) is the environment's fallback final word. ``sandbox``: the pool the environment runs programs in
    (code_feedback). ValueError naming the problems whose conversations failed (an engine that kept failing, an
    environment that broke its contract, a conversation longer than the engine's context: the manager's log says
    which), one line for the commands."""
    from megatron_spo.config import build_config
    from megatron_spo.rollout.config import RolloutConfig
    from megatron_spo.rollout.manager import RolloutManager

    cfg = build_config(RolloutConfig, {
        "samples_per_prompt": n, "temperature_range": [temperature, temperature], "top_p": top_p,
        "max_new_tokens": max_new_tokens, "env": env.model_dump() if hasattr(env, "model_dump") else env,
        "buffer_groups": max(1, len(prompts)), "seed": seed, "max_inflight_requests": max_inflight_requests},
        "conversations")

    async def reward(problem, text: str) -> float:
        return (await reward_pool.score(problem, text)).reward

    manager = RolloutManager(cfg, iter(prompts), reward, endpoints=list(endpoints), tokenizer=tokenizer,
                             sandbox=sandbox)
    await manager.start(max_requests=len(prompts))
    try:
        await manager.join()
        groups = []
        while not manager.buffer.empty():
            groups.append(manager.buffer.get_nowait())
    finally:
        await manager.stop()
    by_prompt = {str(g[0].prompt_id): g for g in groups}
    missing = [p.prompt_id for p in prompts if str(p.prompt_id) not in by_prompt]
    if missing:
        raise ValueError(f"conversations: none for {len(missing)} of {len(prompts)} problems "
                           f"({', '.join(map(str, missing[:5]))}{', ...' if len(missing) > 5 else ''}): their requests "
                           "or environments failed (the log above says why)")
    return by_prompt


async def evaluate_turns(prompts: Sequence[Prompt], endpoints: Sequence[str], tokenizer: Any, reward_pool: Any,
                         env: Any, *, n: int = 20, temperature: float = 0.4, top_p: float = 0.95,
                         ks: Sequence[int] = (1, 10), max_new_tokens: int = 512, seed: int = 0,
                         sandbox: Any = None, max_inflight_requests: int = 8) -> TurnsEval:
    """n conversations per prompt (run_conversations), each model turn scored with ``reward_pool``
    (RewardPool(..., hidden=True) for the hidden tests)."""
    if max(ks) > n:
        raise ValueError(f"evaluate_turns: each k of {list(ks)} must be at most n {n}")
    by_prompt = await run_conversations(prompts, endpoints, tokenizer, reward_pool, env, n=n, temperature=temperature,
                                        top_p=top_p, max_new_tokens=max_new_tokens, seed=seed, sandbox=sandbox,
                                        max_inflight_requests=max_inflight_requests)
    first, last, turns, fixed = [], [], 0, 0
    custom = getattr(reward_pool, "custom", None) is not None
    for prompt in prompts:
        texts = [[tokenizer.decode(ids, skip_special_tokens=True) for ids in turn_ids(t.response_tokens,
                                                                                      t.response_mask)]
                 for t in by_prompt[str(prompt.prompt_id)]]
        firsts = await score_all(reward_pool, prompt.problem, [ts[0] for ts in texts])
        lasts = await score_all(reward_pool, prompt.problem, [ts[-1] for ts in texts])
        turns += sum(len(ts) for ts in texts)
        fixed += sum(not a.passed and b.passed for a, b in zip(firsts, lasts))
        tests = tests_used(prompt.problem, getattr(reward_pool, "hidden", False), custom)
        for results, out in ((firsts, first), (lasts, last)):
            correct = sum(r.passed for r in results)
            out.append(ProblemEval(str(prompt.prompt_id), n, correct, pass_at_ks(n, correct, ks), tests))
    conversations = n * len(prompts)
    return TurnsEval(EvalResult(first, tuple(ks), n, temperature, top_p),
                     EvalResult(last, tuple(ks), n, temperature, top_p), turns / conversations, fixed / conversations)


def write_turns_eval(result: TurnsEval, path) -> None:
    """The whole result (both turns' per-problem records) as JSON at ``path``."""
    import json
    from pathlib import Path

    Path(path).write_text(json.dumps(result.to_json(), indent=1) + "\n")
