"""Held-out pass@k during training (config section ``eval``): after the weight push of every eval.interval-th
step, rank 0 evaluates the engines' (now current) policy with engine_tools/eval.py's ``evaluate`` and the
step logs eval/pass@K and eval/problems. The other ranks go on to the step's metrics gather and wait there,
as they do for a weight push.

    held_out = HeldOutEval.from_config(cfg)        # rank 0, once: prompts, reward pool, engine URL
    if held_out.due(step): metrics.update(held_out.run())
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from megatron_spo.config import ConfigError
from megatron_spo.training.config import TrainConfig


def held_out_problems(cfg: TrainConfig) -> list:
    """eval.paths read as task.kind reads task.paths, else the generated task's held-out split; cut to
    eval.limit."""
    from megatron_spo.data import tasks
    from megatron_spo.data.problems import load_problems

    ev = cfg.eval
    if ev.paths:
        problems = load_problems(cfg.task.kind, ev.paths)
    else:
        problems = list(tasks.generated_task(cfg.task.kind, cfg.task.toy).heldout)
    return problems[: ev.limit]


class HeldOutEval:
    """The prompts, reward pool and engine URL of one run's periodic evaluation (rank 0)."""

    def __init__(self, cfg: TrainConfig, prompts: list, reward_pool: Any, url: str, on_close: list):
        self.cfg = cfg
        self.prompts = prompts
        self.reward_pool = reward_pool
        self.url = url
        self._on_close = on_close
        self.best: tuple[int, float] | None = None  # (step, pass@k of the first k) since this (re)start

    @classmethod
    def from_config(cls, cfg: TrainConfig) -> HeldOutEval | None:
        """None when eval.interval is 0."""
        if not cfg.eval.interval:
            return None
        from transformers import AutoTokenizer

        from megatron_spo.data.prompts import make_prompts
        from megatron_spo.hooks import load_hook
        from megatron_spo.rewards.reward import RewardPool, needs_sandbox
        from megatron_spo.rewards.sandbox import SandboxPool
        from megatron_spo.run_layout import children_ignore_preemption_signals

        fleet = cfg.fleet.resolved()
        url = fleet.router_url or (fleet.engine_urls or [None])[0]
        if url is None:
            raise ConfigError("eval.interval: held-out evaluation runs through the engines; set fleet.router_url or "
                              "fleet.engine_urls (or SPO_ROUTER_URL / SPO_ENGINE_URLS)")
        if cfg.init.hf is None:
            raise ConfigError("eval.interval: held-out evaluation needs init.hf for the tokenizer")
        try:
            problems = held_out_problems(cfg)
        except (ValueError, FileNotFoundError) as err:
            raise ConfigError(f"eval.paths: {err}") from None
        if not problems:
            raise ConfigError("eval.paths: no held-out problems to evaluate")
        tokenizer = AutoTokenizer.from_pretrained(cfg.init.hf)
        prompts = [p for p in make_prompts(problems, tokenizer) if len(p.tokens) <= cfg.task.max_prompt_tokens]
        custom = load_hook(cfg.task.reward, field="task.reward") if cfg.task.reward else None
        sandbox = None
        if needs_sandbox(problems, custom):
            with children_ignore_preemption_signals():
                sandbox = SandboxPool(cfg.sandbox)
        pool = RewardPool(sandbox, hidden=cfg.eval.hidden_tests, custom=custom)
        return cls(cfg, prompts, pool, url, [pool.close] + ([sandbox.close] if sandbox is not None else []))

    def due(self, step: int) -> bool:
        return step % self.cfg.eval.interval == 0

    def sampling(self):
        from megatron_spo.engine_tools.config import ToolSamplingConfig

        ev, rollout = self.cfg.eval, self.cfg.rollout
        return ToolSamplingConfig(temperature=ev.temperature, top_p=ev.top_p, top_k=rollout.top_k,
                                  max_new_tokens=ev.max_new_tokens or rollout.max_new_tokens,
                                  max_retries=rollout.max_retries, retry_backoff_s=rollout.retry_backoff_s)

    async def evaluate(self):
        """engine_tools/eval.py's EvalResult of the engines' current weights on the held-out prompts."""
        from megatron_spo.engine_tools.eval import evaluate
        from megatron_spo.rollout.client import EngineClient

        ev = self.cfg.eval
        async with EngineClient(self.url, timeout_s=self.cfg.rollout.request_timeout_s) as client:
            sampler = client if self.lora_path is None else _WithAdapter(client, self.lora_path)
            return await evaluate(self.prompts, sampler, self.reward_pool, n=ev.n, temperature=ev.temperature,
                                  top_p=ev.top_p, ks=ev.ks, sampling=self.sampling())

    lora_path: str | None = None  # with LoRA adapter pushes: the adapter holding the current policy

    def run(self) -> dict[str, float]:
        """eval/pass@K (mean over problems), eval/problems and time/eval."""
        t0 = time.perf_counter()
        result = asyncio.run(self.evaluate())
        return {**{f"eval/pass@{k}": v for k, v in result.mean.items()},
                "eval/problems": float(len(result.problems)), "time/eval": time.perf_counter() - t0}

    def decline_warning(self, step: int, metrics: dict[str, float]) -> str | None:
        """A warning line when pass@k (the first of eval.ks) has fallen more than eval.warn_drop below its best
        since this (re)start: the slow decay that the divergence guards, which watch training signals, miss."""
        k = self.cfg.eval.ks[0]
        value = metrics.get(f"eval/pass@{k}")
        if value is None:
            return None
        if self.best is None or value > self.best[1]:
            self.best = (step, value)
            return None
        best_step, best = self.best
        drop = self.cfg.eval.warn_drop
        if drop is None or best - value <= drop:
            return None
        return (f"[megatron-spo] warning: step {step}: held-out pass@{k} {value:.3f} is {best - value:.3f} below its "
                f"best {best:.3f} (step {best_step}; eval.warn_drop {drop:g}): the policy has been decaying since "
                f"then (docs/spo-stability.md, 'What to watch')")

    def close(self) -> None:
        for fn in self._on_close:
            fn()


class _WithAdapter:
    """An EngineClient whose /generate requests select a LoRA adapter (lora_path)."""

    def __init__(self, client, lora_path: str):
        self.client, self.lora_path = client, lora_path

    def __getattr__(self, name: str):
        return getattr(self.client, name)

    async def generate(self, *args, **kwargs):
        return await self.client.generate(*args, lora_path=self.lora_path, **kwargs)
