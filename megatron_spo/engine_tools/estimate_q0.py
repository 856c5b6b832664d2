"""Monte-Carlo S0 / Q0 per prompt (`megatron-spo estimate-q0`) from reference samples through the engines.

    prompts = make_prompts(load_problems("toy", split="train"), tokenizer)
    async with EngineClient(url) as client:
        est = await estimate_q0(prompts, client, RewardPool(SandboxPool()), samples=800, beta=beta,
                                sampling=ToolSamplingConfig(), out_path="q0.jsonl")
    est["num-001"].s0, est["num-001"].q0

S0 and Q0 as in data/q0.py; the output is resumable like every engine tool's (engine_tools/sampling.py).

With an environment (``env``, a config's rollout.env; docs/multi-turn.md) each sample is a conversation, and a success
is a conversation whose final reward is 0 (of {0, -1}): the Q0 of what a multi-turn run trains on. Each line then names
the environment (``env``), and a file made with another environment (or none) does not resume.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from megatron_spo.config import build_config
from megatron_spo.data.prompts import Prompt
from megatron_spo.data.q0 import Q0_PRIOR, Q0Estimate, few_samples_warning, q0_from_counts
from megatron_spo.data.result_log import ResultLog, json_line
from megatron_spo.data.trajectory import Trajectory
from megatron_spo.engine_tools.command_line import (
    add_sampling_args,
    add_task_args,
    apply_train_config,
    close_reward_pool,
    load_tokenizer,
    prompts_from_args,
    reward_pool_from_args,
    run_cli,
    sampling_from_args,
)
from megatron_spo.engine_tools.config import Q0Config, ToolSamplingConfig
from megatron_spo.engine_tools.eval_turns import run_conversations
from megatron_spo.engine_tools.sampling import run_resumable, sample, score_all
from megatron_spo.fsutil import write_lines_atomic


async def estimate_q0(prompts: Sequence[Prompt], client: Any, reward_pool: Any, *, samples: int = 800,
                      beta: float, sampling: ToolSamplingConfig | None = None, out_path: str | Path | None = None,
                      trajectories_out: str | Path | None = None, keep_successful: int = 0,
                      progress: bool = False, prior: float = Q0_PRIOR, env: Any = None, tokenizer: Any = None,
                      sandbox: Any = None) -> dict[str, Q0Estimate]:
    """prompt_id -> Q0Estimate from ``samples`` reference samples per prompt, each scored by reward_pool.

    out_path: the resumable result file ({prompt_id, s0, q0, n, correct, beta, prior, q0_low, q0_high} per line;
    TaskConfig.q0_path). prior: S0's Beta(prior, prior) prior (data/q0.py).
    A file made at another beta resumes (S0 and the counts do not depend on beta); the returned Q0 is at ``beta``.
    trajectories_out: a trajectory JSONL that receives up to ``keep_successful`` correct samples per prompt
    (source "reference", q0 at the beta of the run that sampled them): inputs for pivotal token search.
    env (an EnvConfig): conversations instead of single samples (run_conversations over client.base_url, with
    ``tokenizer`` and the environment's ``sandbox``); the kept successes are whole conversations with their mask.
    """
    cfg = build_config(Q0Config, {"samples": samples, "beta": beta, "prior": prior,
                                  "sampling": (sampling or ToolSamplingConfig()).model_dump()})
    env_name = None if env is None else env.name
    log = ResultLog(out_path) if out_path is not None else None
    if log is not None:
        for key, rec in log.records.items():  # another beta is fine: Q0 is derived from the counts below
            if rec.get("n") != cfg.samples:
                raise ValueError(f"{out_path}: prompt '{key}' was estimated with n={rec.get('n')} samples; this "
                                 f"run asks n={cfg.samples} (use another output file)")
            if rec.get("env") != env_name:
                raise ValueError(f"{out_path}: prompt '{key}' was estimated "
                                 + (f"as conversations with {rec['env']}" if rec.get("env") else "single-turn")
                                 + "; this run asks " + (f"conversations with {env_name}" if env_name else
                                                         "single-turn samples") + " (use another output file)")
    if trajectories_out is not None and log is None:
        raise ValueError("estimate_q0: trajectories_out needs out_path (the Q0 file is the resume state of both)")
    kept = _TrajectorySink(trajectories_out, log) if trajectories_out is not None and keep_successful > 0 else None

    async def samples_of(prompt: Prompt) -> tuple[int, list]:
        """(successes, up to keep_successful successful trajectories) of the prompt's samples or conversations."""
        if env is not None:
            convs = (await run_conversations(
                [prompt], [client.base_url], tokenizer, reward_pool, env, n=cfg.samples,
                temperature=cfg.sampling.temperature, top_p=cfg.sampling.top_p,
                max_new_tokens=cfg.sampling.max_new_tokens, seed=cfg.sampling.seed or 0, sandbox=sandbox,
                max_inflight_requests=cfg.sampling.concurrency))[str(prompt.prompt_id)]
            odd = next((t.reward for t in convs if t.reward not in (0.0, -1.0)), None)
            if odd is not None:
                raise ValueError(f"a conversation of prompt '{prompt.prompt_id}' ended with reward {odd}: "
                                 f"Q0 from success counts needs final rewards of 0 or -1 ({env.name})")
            good = [dataclasses.replace(t, source="reference", policy_version=0) for t in convs if t.reward == 0.0]
            return len(good), good[:keep_successful]
        completions = await sample(client, prompt.tokens, cfg.samples, cfg.sampling, seed_key=(prompt.prompt_id,))
        results = await score_all(reward_pool, prompt.problem, [c.text for c in completions])
        good = [Trajectory(prompt_id=prompt.prompt_id, prompt_tokens=list(prompt.tokens),
                           response_tokens=list(c.output_ids), reward=r.reward, source="reference", policy_version=0)
                for c, r in zip(completions, results) if r.passed and c.output_ids]
        return sum(r.passed for r in results), good[:keep_successful]

    async def work(prompt: Prompt) -> dict:
        correct, good = await samples_of(prompt)
        est = q0_from_counts(correct, cfg.samples, cfg.beta, cfg.prior)
        if kept is not None:
            kept.add([dataclasses.replace(t, q0=est.q0) for t in good])
        record = {"prompt_id": prompt.prompt_id, "s0": est.s0, "q0": est.q0, "n": est.n, "correct": est.correct,
                  "beta": cfg.beta, "prior": est.prior, "q0_low": est.q0_low, "q0_high": est.q0_high}
        return {**record, "env": env_name} if env_name else record

    try:
        records = await run_resumable(prompts, lambda p: p.prompt_id, work, log,
                                      concurrency=cfg.sampling.concurrency, description="estimate-q0",
                                      progress=progress)
    finally:
        if log is not None:
            log.close()
    if kept is not None:  # every prompt is done (a cut run raised above)
        kept.finalize([p.prompt_id for p in prompts])
    return {k: q0_from_counts(r["correct"], r["n"], cfg.beta, cfg.prior) for k, r in records.items()}


class _TrajectorySink:
    """Successful samples as trajectory records, appended per prompt BEFORE the prompt's Q0 line; on resume the
    lines of prompts without a Q0 line (a cut run) are dropped, so none is duplicated."""

    def __init__(self, path: str | Path, log: ResultLog | None):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if self.path.exists():
            lines = [ln + "\n" for ln in self.path.read_text(encoding="utf-8").split("\n")[:-1] if ln.strip()]
            done = log.records if log is not None else {}
            write_lines_atomic(self.path, [ln for ln in lines if str(json.loads(ln)["prompt_id"]) in done])

    def add(self, trajectories: list) -> None:
        with open(self.path, "a", encoding="utf-8") as f:
            for traj in trajectories:
                f.write(json_line(traj.to_dict()))
            f.flush()
            os.fsync(f.fileno())

    def finalize(self, order: list[str]) -> None:
        rank = {k: i for i, k in enumerate(order)}
        lines = [ln + "\n" for ln in self.path.read_text(encoding="utf-8").split("\n")[:-1] if ln.strip()]
        lines.sort(key=lambda ln: rank.get(str(json.loads(ln)["prompt_id"]), len(rank)))  # stable within a prompt
        write_lines_atomic(self.path, lines)


def main(argv: list[str]) -> int:
    defaults = Q0Config()
    parser = argparse.ArgumentParser(prog="megatron-spo estimate-q0",
                                     description="Monte-Carlo S0 and Q0 per prompt from reference samples.")
    add_task_args(parser, default_split="train")
    parser.add_argument("--out", required=True, help="result JSONL (resumable; a path without .jsonl is a folder "
                        "receiving q0.jsonl): prompt_id, s0, q0, n, correct, beta, prior, q0_low, q0_high")
    parser.add_argument("--samples", type=int, default=defaults.samples, help="samples per prompt (paper: 800)")
    parser.add_argument("--beta", type=float, default=None, help=f"default: the config's, else {defaults.beta:.6f}")
    parser.add_argument("--prior", type=float, default=defaults.prior, help="S0 = (correct + prior) / (samples + 2 "
                        "prior), a Beta(prior, prior) prior (0.5: Jeffreys'; 0: the plain rate; the trainer applies "
                        "its task.q0_prior to the counts)")
    parser.add_argument("--trajectories-out", default=None, help="also save correct samples as trajectories here")
    parser.add_argument("--keep-successful", type=int, default=4, help="correct samples saved per prompt")
    parser.add_argument("--single-turn", action="store_true",
                        help="with a config whose rollout.env names an environment: single samples (default: "
                             "conversations with it, the Q0 of what a multi-turn run trains on)")
    add_sampling_args(parser, defaults.sampling)
    args = parser.parse_args(argv)
    apply_train_config(args, parser)
    if not args.out.endswith(".jsonl"):
        args.out = os.path.join(args.out, "q0.jsonl")
    beta = defaults.beta if args.beta is None else args.beta
    cfg = build_config(Q0Config, {"samples": args.samples, "beta": beta, "prior": args.prior,
                                  "sampling": sampling_from_args(args)})

    env = None if args.single_turn else args.env

    async def body() -> int:
        from megatron_spo.rollout.client import EngineClient

        tokenizer = load_tokenizer(args.tokenizer, args.engine_url)
        prompts = prompts_from_args(args, tokenizer)
        pool = reward_pool_from_args(args, [p.problem for p in prompts], prog="estimate-q0", env=env)
        try:
            async with EngineClient(args.engine_url, timeout_s=args.request_timeout) as client:
                est = await estimate_q0(prompts, client, pool, samples=cfg.samples, beta=cfg.beta,
                                        sampling=cfg.sampling, out_path=args.out,
                                        trajectories_out=args.trajectories_out,
                                        keep_successful=args.keep_successful, progress=not args.no_progress,
                                        prior=cfg.prior, env=env, tokenizer=tokenizer,
                                        sandbox=getattr(pool, "sandbox", None))
        finally:
            close_reward_pool(pool)
        mean_s0 = sum(e.s0 for e in est.values()) / len(est)
        width = sorted((e.q0_high - e.q0_low) / cfg.beta for e in est.values())[len(est) // 2]
        what = "samples" if env is None else f"conversations with {env.name} (up to {env.max_turns} model turns)"
        print(f"estimate-q0: {len(est)} prompts, mean S0 {mean_s0:.4f}, {cfg.samples} {what} each, S0 prior "
              f"Beta({cfg.prior:g}, {cfg.prior:g}); median 95% interval of Q0 {width:.2f} nats (/ beta) -> {args.out}")
        warning = few_samples_warning(est, cfg.beta)
        if warning:
            print(f"estimate-q0: {warning}")
        return 0

    return run_cli("megatron-spo estimate-q0", body)
