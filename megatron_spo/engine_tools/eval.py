"""pass@k evaluation (`megatron-spo eval`): n samples per problem through the engines, each scored on the
problem's reward tests plus its hidden tests when present, unbiased pass@k per problem and averaged.

SPO paper protocol (the defaults): n = 20 samples at temperature 0.4, top-p 0.95; pass@1 and pass@10.

    async with EngineClient(url) as client:
        result = await evaluate(prompts, client, RewardPool(SandboxPool(), hidden=True), n=20, ks=(1, 10))
    result.mean[1], result.to_json(), result.table()

    megatron-spo eval --engine-url URL --task toy --split heldout --out eval.jsonl --json eval.json
    megatron-spo eval CONFIG --out eval.jsonl       # the config's held-out problems, reward, tokenizer, engines

Beside the results, every sample (eval.completions.jsonl: prompt_id, sample, text, reward, passed, info): what
a pass@1 of 0 was made of. A config with an environment (rollout.env) also evaluates the problems as conversations
(engine_tools/eval_turns.py: pass@k at the first and the last model turn) into eval.turns.json, unless
--single-turn; that part is not resumable (a cut run evaluates the conversations again).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megatron_spo.cli import positive_int
from megatron_spo.config import build_config
from megatron_spo.data.prompts import Prompt
from megatron_spo.data.result_log import ItemLines, ResultLog
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
from megatron_spo.engine_tools.config import EvalConfig, ToolSamplingConfig
from megatron_spo.engine_tools.sampling import run_resumable, sample, score_all
from megatron_spo.eval.passk import pass_at_k


@dataclass(frozen=True)
class ProblemEval:
    """One problem: ``correct`` of ``n`` samples passed; pass_at[k]; tests: what was scored
    ({"reward": count, "hidden": count} for code, {"answer": 1} for math, {"custom": 1} for a reward hook);
    distinct_correct: how many different programs (normalised_program) among the correct ones, the diversity a
    "soft" policy keeps (None in records written before it was counted)."""

    prompt_id: str
    n: int
    correct: int
    pass_at: dict[int, float]
    tests: dict[str, int]
    distinct_correct: int | None = None

    def to_record(self) -> dict:
        return {"prompt_id": self.prompt_id, "n": self.n, "correct": self.correct,
                **{f"pass@{k}": v for k, v in self.pass_at.items()}, "tests": self.tests,
                "distinct_correct": self.distinct_correct}

    @classmethod
    def from_record(cls, record: dict, ks: Sequence[int]) -> ProblemEval:
        return cls(str(record["prompt_id"]), record["n"], record["correct"],
                   {k: record[f"pass@{k}"] for k in ks}, record["tests"], record.get("distinct_correct"))


def normalised_program(text: str) -> str:
    """A response with trailing spaces and blank lines dropped: two samples that differ only there are one
    program."""
    return "\n".join(line.rstrip() for line in text.strip().splitlines() if line.strip())


@dataclass(frozen=True)
class EvalResult:
    """Per-problem results (input order) and mean pass@k over problems."""

    problems: list[ProblemEval]
    ks: tuple[int, ...]
    n: int
    temperature: float
    top_p: float

    @property
    def mean(self) -> dict[int, float]:
        return {k: sum(p.pass_at[k] for p in self.problems) / len(self.problems) for k in self.ks}

    def to_json(self) -> dict:
        return {"n": self.n, "temperature": self.temperature, "top_p": self.top_p, "ks": list(self.ks),
                "num_problems": len(self.problems), "mean": {f"pass@{k}": v for k, v in self.mean.items()},
                "problems": [p.to_record() for p in self.problems]}

    def table(self, max_rows: int = 50):
        from rich.table import Table

        table = Table(title=f"pass@k: n = {self.n}, T = {self.temperature:g}, top-p = {self.top_p:g}")
        table.add_column("problem")
        table.add_column("correct", justify="right")
        for k in self.ks:
            table.add_column(f"pass@{k}", justify="right")
        table.add_column("tests")
        for p in self.problems[:max_rows]:
            tests = ", ".join(f"{name} {count}" for name, count in p.tests.items())
            table.add_row(p.prompt_id, f"{p.correct}/{p.n}", *(f"{p.pass_at[k]:.3f}" for k in self.ks), tests)
        if len(self.problems) > max_rows:
            table.add_row(f"... {len(self.problems) - max_rows} more", "", *("" for _ in self.ks), "")
        table.add_section()
        total = sum(p.correct for p in self.problems)
        table.add_row(f"mean of {len(self.problems)}", f"{total}/{self.n * len(self.problems)}",
                      *(f"{v:.3f}" for v in self.mean.values()), "")
        return table


def tests_used(problem: Any, hidden: bool, custom: bool = False) -> dict[str, int]:
    """What scored a problem: {"custom": 1} for a reward hook, {"answer": 1} for math, the test counts for code."""
    if custom:
        return {"custom": 1}
    if getattr(problem, "kind", "code") == "math":
        return {"answer": 1}
    return {"reward": len(problem.tests), "hidden": len(getattr(problem, "hidden_tests", ())) if hidden else 0}


def pass_at_ks(n: int, correct: int, ks: Sequence[int]) -> dict[int, float]:
    return {k: float(pass_at_k(n, correct, k)) for k in ks}


def beside(out_path: str | Path, suffix: str) -> Path:
    """A file next to eval's results: beside("eval.jsonl", ".turns.json") -> eval.turns.json."""
    out = Path(out_path)
    return out.with_name((out.stem if out.suffix == ".jsonl" else out.name) + suffix)


def completions_path(out_path: str | Path) -> Path:
    """Where eval's samples go beside its results: eval.jsonl -> eval.completions.jsonl."""
    return beside(out_path, ".completions.jsonl")


def turns_path(out_path: str | Path) -> Path:
    """Where eval's conversations' result goes beside its results: eval.jsonl -> eval.turns.json."""
    return beside(out_path, ".turns.json")


def completion_records(prompt_id: str, texts: Sequence[str], results: Sequence[Any]) -> list[dict]:
    """One record per sample: prompt_id, sample (its index), text, reward, passed and the reward's info."""
    return [{"prompt_id": prompt_id, "sample": i, "text": text, "reward": float(r.reward), "passed": bool(r.passed),
             "info": json.loads(json.dumps(r.info, default=str))} for i, (text, r) in enumerate(zip(texts, results))]


async def evaluate(prompts: Sequence[Prompt], client: Any, reward_pool: Any, *, n: int = 20, temperature: float = 0.4,
                   top_p: float = 0.95, ks: Sequence[int] = (1, 10), sampling: ToolSamplingConfig | None = None,
                   out_path: str | Path | None = None, completions_out: str | Path | None = None,
                   progress: bool = False) -> EvalResult:
    """pass@k of the engines' model on ``prompts``. Hidden tests count when ``reward_pool.hidden`` is set
    (RewardPool(..., hidden=True)); each problem's record says which tests were used. ``sampling`` sets the
    rest (max_new_tokens, seed, samples per request, concurrency); temperature and top_p override it.
    completions_out: a JSONL receiving every sample (completion_records), resumable with out_path."""
    base = (sampling or ToolSamplingConfig()).model_dump()
    cfg = build_config(EvalConfig, {"n": n, "ks": tuple(ks), "hidden_tests": bool(getattr(reward_pool, "hidden", False)),
                                    "sampling": {**base, "temperature": temperature, "top_p": top_p}})
    log = ResultLog(out_path) if out_path is not None else None
    if log is not None:
        for key, rec in log.records.items():
            had = [int(name[5:]) for name in rec if name.startswith("pass@")]
            if rec.get("n") != cfg.n or not set(cfg.ks) <= set(had):
                raise ValueError(f"{out_path}: problem '{key}' was evaluated with n={rec.get('n')}, ks={had}; "
                                 f"this run asks n={cfg.n}, ks={list(cfg.ks)} (use another output file)")
    if completions_out is not None and log is None:
        raise ValueError("evaluate: completions_out needs out_path (the results file is the resume state of both)")
    kept = ItemLines(completions_out, log.records) if completions_out is not None else None
    custom = getattr(reward_pool, "custom", None) is not None  # a reward hook: no tests to count

    async def work(prompt: Prompt) -> dict:
        completions = await sample(client, prompt.tokens, cfg.n, cfg.sampling, seed_key=("eval", prompt.prompt_id))
        results = await score_all(reward_pool, prompt.problem, [c.text for c in completions])
        correct = sum(r.passed for r in results)
        distinct = len({normalised_program(c.text) for c, r in zip(completions, results) if r.passed})
        if kept is not None:  # before the problem's result line: a cut run drops these on resume
            kept.add(completion_records(prompt.prompt_id, [c.text for c in completions], results))
        return ProblemEval(prompt.prompt_id, cfg.n, correct, pass_at_ks(cfg.n, correct, cfg.ks),
                           tests_used(prompt.problem, cfg.hidden_tests, custom), distinct).to_record()

    try:
        records = await run_resumable(prompts, lambda p: p.prompt_id, work, log, concurrency=cfg.sampling.concurrency,
                                      description="eval", progress=progress)
    finally:
        if log is not None:
            log.close()
    if kept is not None:  # every problem is done (a cut run raised above)
        kept.finalize([p.prompt_id for p in prompts])
    problems = [ProblemEval.from_record(r, cfg.ks) for r in records.values()]
    return EvalResult(problems, tuple(cfg.ks), cfg.n, cfg.sampling.temperature, cfg.sampling.top_p)


async def evaluate_conversations(prompts: Sequence[Prompt], tokenizer: Any, pool: Any, env: Any, cfg: EvalConfig,
                                 args: argparse.Namespace):
    """`eval CONFIG` with rollout.env: the problems as conversations (eval_turns.evaluate_turns) at the command's
    sampling, written to OUT.turns.json."""
    from megatron_spo.engine_tools.eval_turns import evaluate_turns, write_turns_eval

    sampling = cfg.sampling
    turns = await evaluate_turns(prompts, [args.engine_url], tokenizer, pool, env, n=cfg.n,
                                 temperature=sampling.temperature, top_p=sampling.top_p, ks=cfg.ks,
                                 max_new_tokens=sampling.max_new_tokens, seed=sampling.seed or 0,
                                 sandbox=getattr(pool, "sandbox", None), max_inflight_requests=sampling.concurrency)
    write_turns_eval(turns, turns_path(args.out))
    return turns


def main(argv: list[str]) -> int:
    defaults = EvalConfig()
    parser = argparse.ArgumentParser(prog="megatron-spo eval", description="pass@k of a model on a task (with a "
                                     "training config: its held-out problems, eval.paths or the generated task's "
                                     "held-out split, scored with its reward).")
    add_task_args(parser, default_split="heldout")
    parser.add_argument("--out", required=True, help="per-problem results JSONL (resumable); every sample goes "
                        "beside it (OUT.completions.jsonl: prompt_id, sample, text, reward, passed, info)")
    parser.add_argument("--json", default=None, help="also write the whole result (mean + per problem) as JSON")
    parser.add_argument("-n", "--n", type=positive_int, default=defaults.n, help="samples per problem")
    parser.add_argument("--ks", type=positive_int, nargs="+", default=list(defaults.ks),
                        help=f"the k of pass@k, each at most -n (default {' '.join(map(str, defaults.ks))})")
    parser.add_argument("--no-hidden-tests", action="store_true",
                        help="score on the reward tests only (default: with the hidden tests, unless the config's "
                             "eval.hidden_tests is false)")
    parser.add_argument("--single-turn", action="store_true",
                        help="with a config whose rollout.env names an environment: evaluate single-turn samples "
                             "only (default: also as conversations, OUT.turns.json)")
    add_sampling_args(parser, defaults.sampling)
    args = parser.parse_args(argv)
    if max(args.ks) > args.n:
        parser.error(f"--ks {' '.join(map(str, args.ks))}: each k must be at most -n {args.n} (samples per problem)")
    apply_train_config(args, parser, held_out=True)
    hidden = not args.no_hidden_tests and (args.held_out is None or args.held_out.hidden_tests)
    cfg = build_config(EvalConfig, {"n": args.n, "ks": tuple(args.ks), "hidden_tests": hidden,
                                    "sampling": sampling_from_args(args)})
    completions = completions_path(args.out)
    env = None if args.single_turn else args.env

    async def body() -> int:
        from rich.console import Console

        from megatron_spo.rollout.client import EngineClient

        tokenizer = load_tokenizer(args.tokenizer, args.engine_url)
        prompts = prompts_from_args(args, tokenizer)
        pool = reward_pool_from_args(args, [p.problem for p in prompts], prog="eval", hidden=cfg.hidden_tests,
                                     env=env)
        try:
            async with EngineClient(args.engine_url, timeout_s=args.request_timeout) as client:
                result = await evaluate(prompts, client, pool, n=cfg.n, temperature=cfg.sampling.temperature,
                                        top_p=cfg.sampling.top_p, ks=cfg.ks, sampling=cfg.sampling, out_path=args.out,
                                        completions_out=completions, progress=not args.no_progress)
            turns = None if env is None else await evaluate_conversations(prompts, tokenizer, pool, env, cfg, args)
        finally:
            close_reward_pool(pool)
        if args.json:
            Path(args.json).write_text(json.dumps(result.to_json(), indent=1) + "\n")
        Console().print(result.table())
        print("eval: " + ", ".join(f"pass@{k} {v:.4f}" for k, v in result.mean.items())
              + f" over {len(result.problems)} problems -> {args.out} (samples: {completions})")
        if turns is not None:
            print(f"eval: as conversations with {env.name} (up to {env.max_turns} model turns): "
                  + ", ".join(f"pass@{k} {turns.first.mean[k]:.4f} at the first turn, {turns.last.mean[k]:.4f} at "
                              "the last" for k in cfg.ks)
                  + f"; {turns.mean_turns:.2f} model turns a conversation, {100 * turns.fixed_share:.1f}% fixed by "
                  f"the feedback -> {turns_path(args.out)}")
        return 0

    return run_cli("megatron-spo eval", body)
