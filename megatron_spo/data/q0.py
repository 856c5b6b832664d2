"""Monte-Carlo S0 / Q0 per prompt (`megatron-spo estimate-q0`), and the pieces all offline tools share.

    prompts = make_prompts(load_problems("toy", split="train"), tokenizer)
    async with EngineClient(url) as client:
        est = await estimate_q0(prompts, client, RewardPool(SandboxPool()), samples=800, beta=beta,
                                sampling=ToolSamplingConfig(), out_path="q0.jsonl")
    est["num-001"].s0, est["num-001"].q0

S0 = fraction of the reference samples scored correct; Q0 = beta * log(S0 + (1 - S0) exp(-1/beta)) (SPO paper
3.1.3, MATH.md). The tools (estimate-q0, pts, eval) talk to engines only through EngineClient (one engine or a
router) and score in a RewardPool. Each appends one JSON line per finished item to its output file (flushed and
fsynced), skips the items already there when re-run, and rewrites the file in input order once every item is
done: an interrupted-then-resumed run ends with the same file as an uninterrupted one, without redoing work.
Per-item sampling seeds derive from (seed, item key), so results do not depend on scheduling.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import signal
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megatron_spo.config import ConfigError, Q0Config, ToolSamplingConfig, build_config
from megatron_spo.fsutil import write_lines_atomic
from megatron_spo.rollout.manager import Prompt
from megatron_spo.rollout.protocol import Completion, SamplingParams


# ---------------------------------------------------------------------------------------------
# Problems and prompts
# ---------------------------------------------------------------------------------------------
def read_problems_jsonl(path: str | Path) -> list:
    """Problems from a JSONL file, one per line: {id, prompt, tests: [[stdin, stdout], ...], hidden_tests?,
    kind? ("code" | "math"), answer?, time_limit_s?, memory_mb?}."""
    from megatron_spo.data.tasks import Problem

    problems = []
    allowed = {"id", "prompt", "tests", "hidden_tests", "kind", "answer", "time_limit_s", "memory_mb", "source"}
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                row = json.loads(line)
            except ValueError as err:
                raise ValueError(f"{where}: not valid JSON ({err})") from None
            if not isinstance(row, dict):
                raise ValueError(f"{where}: a problem must be a JSON object")
            for name in ("id", "prompt"):
                if not isinstance(row.get(name), str) or not row[name]:
                    raise ValueError(f"{where}: field '{name}' must be a non-empty string")
            unknown = sorted(set(row) - allowed)
            if unknown:
                raise ValueError(f"{where}: field '{unknown[0]}': unknown (known: {', '.join(sorted(allowed))})")
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
            problems.append(Problem(id=row["id"], prompt=row["prompt"], tests=tests["tests"],
                                    hidden_tests=tests["hidden_tests"], kind=kind, answer=row.get("answer"),
                                    source=row.get("source", "jsonl"), time_limit_s=row.get("time_limit_s"),
                                    memory_mb=row.get("memory_mb")))
    return problems


def load_problems(task: str, data: str | None = None, *, split: str = "all", toy_seed: int = 0) -> list:
    """Problems of a task kind (data/tasks.py TASK_KINDS): the generated toy task (split train | heldout | all),
    or a file (glob) of CodeContests / TACO / MATH in their published schemas, or a problems JSONL."""
    from megatron_spo.data.tasks import TASK_KINDS

    if task not in TASK_KINDS:
        raise ValueError(f"--task must be one of {', '.join(TASK_KINDS)}, got '{task}'")
    if task != "toy" and not data:
        raise ValueError(f"--task {task} needs --data PATH")
    return TASK_KINDS[task].load(data, split, toy_seed)


def prompt_text(problem: Any, tokenizer: Any = None, prompt_format: str = "auto") -> str:
    """The model input text. auto: the toy task's prompt as is (its models are trained on it), else
    build_prompt (chat template or a plain layout with the task instruction)."""
    from megatron_spo.data import toy_code
    from megatron_spo.data.tasks import build_prompt

    if prompt_format not in ("auto", "raw", "template"):
        raise ValueError(f"prompt_format must be auto, raw or template, got '{prompt_format}'")
    raw = prompt_format == "raw" or (prompt_format == "auto" and isinstance(problem, toy_code.Problem))
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


def load_tokenizer(path: str | None, engine_url: str) -> Any:
    """A HF tokenizer from ``path``, or from the engine's tokenizer_path (/model_info) when None."""
    from transformers import AutoTokenizer

    from megatron_spo.rollout.client import get_json

    if path is None:
        try:
            status, info = get_json(engine_url.rstrip("/") + "/model_info")
        except OSError as err:
            raise ValueError(f"cannot reach {engine_url} for its tokenizer ({err}); pass --tokenizer DIR") from None
        path = (info or {}).get("tokenizer_path") or (info or {}).get("model_path") if status == 200 else None
        if not path or not os.path.isdir(path):
            raise ValueError(f"{engine_url}/model_info names no local tokenizer folder ({path!r}); "
                             "pass --tokenizer DIR")
    return AutoTokenizer.from_pretrained(path)


# ---------------------------------------------------------------------------------------------
# Resumable per-item results
# ---------------------------------------------------------------------------------------------
def _dump(record: dict) -> str:
    return json.dumps(record, allow_nan=False, separators=(",", ":")) + "\n"


class ResultLog:
    """An append-only JSONL of per-item results keyed by ``record[key]`` (or ``key(record)``): a tool's output and
    resume state.

    A torn last line (a write cut by a kill) is dropped; any other unreadable line is an error naming it.
    """

    def __init__(self, path: str | Path, key: str | Callable[[dict], str] = "prompt_id"):
        self.path = Path(path)
        self.key_of = key if callable(key) else (lambda record, _name=key: str(record[_name]))
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.records: dict[str, dict] = {}
        if self.path.exists():
            self.records, torn = self.read(self.path, self.key_of)
            if torn:
                write_lines_atomic(self.path, [_dump(r) for r in self.records.values()])
        self._file = open(self.path, "a", encoding="utf-8")

    @staticmethod
    def read(path: Path, key_of: Callable[[dict], str]) -> tuple[dict[str, dict], bool]:
        """(records by key, whether a torn last line was dropped)."""
        lines = path.read_text(encoding="utf-8").split("\n")
        complete, torn = lines[:-1], lines[-1]  # text after the last newline was never finished
        records = {}
        for lineno, line in enumerate(complete, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                records[key_of(record)] = record
            except (ValueError, KeyError, TypeError):
                raise ValueError(f"{path}:{lineno}: not a result record of this tool: {line[:80]!r}; "
                                 "fix or remove the file") from None
        return records, bool(torn)

    def __contains__(self, item_key: str) -> bool:
        return item_key in self.records

    def append(self, record: dict) -> None:
        self._file.write(_dump(record))
        self._file.flush()
        os.fsync(self._file.fileno())
        self.records[self.key_of(record)] = record

    def finalize(self, order: Sequence[str]) -> bool:
        """Once every key of ``order`` is present, rewrite the file in that order (atomically). Returns
        whether the log is complete."""
        if not all(k in self.records for k in order):
            return False
        self._file.close()
        write_lines_atomic(self.path, [_dump(self.records[k]) for k in order])
        self._file = open(self.path, "a", encoding="utf-8")
        return True

    def close(self) -> None:
        self._file.close()


def derive_seed(seed: int | None, *parts: Any) -> int | None:
    """A 31-bit sampling seed from (seed, parts): stable across runs and machines; None stays None."""
    if seed is None:
        return None
    digest = hashlib.sha256(repr((seed, *parts)).encode()).digest()
    return int.from_bytes(digest[:4], "little") & 0x7FFFFFFF


async def sample(client: Any, tokens: list[int], n: int, sampling: ToolSamplingConfig, *,
                 seed_key: tuple) -> list[Completion]:
    """n completions of one prompt, sent concurrently: requests of at most samples_per_request samples, or,
    with sampling.seed, one request per sample with its own sampling_seed. SGLang gives every sample of one
    request the same seed (under deterministic inference; seeds do nothing otherwise), so n seeded samples
    in one request would be n copies of one: Q0 from them would be degenerate."""
    if sampling.seed is None:
        chunk = sampling.samples_per_request
        sizes = [min(chunk, n - start) for start in range(0, n, chunk)]
    else:
        sizes = [1] * n

    async def request(i: int, m: int) -> list[Completion]:
        params = SamplingParams(max_new_tokens=sampling.max_new_tokens, temperature=sampling.temperature,
                                top_p=sampling.top_p, top_k=sampling.top_k, n=m,
                                sampling_seed=derive_seed(sampling.seed, *seed_key, i))
        [group] = await client.generate([tokens], params, return_logprob=False)
        return group

    groups = await gather_or_cancel([request(i, m) for i, m in enumerate(sizes)])
    return [c for group in groups for c in group]


async def score_all(reward_pool: Any, problem: Any, texts: Sequence[str]) -> list:
    """RewardResult per text, each distinct text scored once (samples of one prompt repeat a lot), concurrently
    (the pool bounds the parallelism)."""
    unique = list(dict.fromkeys(texts))
    results = await gather_or_cancel([reward_pool.score(problem, t) for t in unique])
    by_text = dict(zip(unique, results))
    return [by_text[t] for t in texts]


async def gather_or_cancel(aws: Sequence[Awaitable]) -> list:
    """asyncio.gather that cancels the siblings when one fails (then re-raises that failure)."""
    tasks = [asyncio.ensure_future(a) for a in aws]
    try:
        return await asyncio.gather(*tasks)
    except BaseException:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


def progress_bar(enabled: bool):
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                    console=Console(stderr=True), disable=not enabled)


async def run_resumable(items: Sequence[Any], key_of: Callable[[Any], str],
                        work: Callable[[Any], Awaitable[dict]], log: ResultLog | None, *, concurrency: int,
                        description: str, progress: bool = False) -> dict[str, dict]:
    """Run ``work(item) -> record`` for every item not yet in ``log``, ``concurrency`` at a time; each record is
    appended as soon as it is done. Returns every record (earlier runs' included) by key."""
    keys = [key_of(it) for it in items]
    if len(set(keys)) != len(keys):
        dup = next(k for k in keys if keys.count(k) > 1)
        raise ValueError(f"{description}: item key '{dup}' appears twice")
    results = {k: log.records[k] for k in keys if log is not None and k in log}
    todo = [(k, it) for k, it in zip(keys, items) if k not in results]
    gate = asyncio.Semaphore(concurrency)
    with progress_bar(progress) as bar:
        task_id = bar.add_task(description, total=len(items), completed=len(items) - len(todo))

        async def one(key: str, item: Any) -> None:
            async with gate:
                record = await work(item)
            if log is not None:
                log.append(record)
            results[key] = record
            bar.advance(task_id)

        await gather_or_cancel([one(k, it) for k, it in todo])
    if log is not None:
        log.finalize(keys)
    return {k: results[k] for k in keys}


# ---------------------------------------------------------------------------------------------
# Q0 estimation
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Q0Estimate:
    """S0: success rate of n reference samples (correct of n); Q0: the soft value at beta."""

    s0: float
    q0: float
    n: int
    correct: int


def q0_from_counts(correct: int, n: int, beta: float) -> Q0Estimate:
    from megatron_spo.algorithms import q0_from_success

    s0 = correct / n
    return Q0Estimate(s0=s0, q0=float(q0_from_success(s0, beta)), n=n, correct=correct)


def read_q0(path: str | Path) -> dict[str, Q0Estimate]:
    """prompt_id -> Q0Estimate from an estimate-q0 output file."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"q0 file '{path}' not found")
    records, _ = ResultLog.read(path, lambda r: str(r["prompt_id"]))
    try:
        return {key: Q0Estimate(r["s0"], r["q0"], r["n"], r["correct"]) for key, r in records.items()}
    except KeyError as err:
        raise ValueError(f"{path}: not an estimate-q0 output (a record lacks {err})") from None


async def estimate_q0(prompts: Sequence[Prompt], client: Any, reward_pool: Any, *, samples: int = 800,
                      beta: float, sampling: ToolSamplingConfig | None = None, out_path: str | Path | None = None,
                      trajectories_out: str | Path | None = None, keep_successful: int = 0,
                      progress: bool = False) -> dict[str, Q0Estimate]:
    """prompt_id -> Q0Estimate from ``samples`` reference samples per prompt, each scored by reward_pool.

    out_path: the resumable result file ({prompt_id, s0, q0, n, correct, beta} per line; TaskConfig.q0_path).
    trajectories_out: a trajectory JSONL that receives up to ``keep_successful`` correct samples per prompt
    (source "reference", q0 set): inputs for pivotal token search.
    """
    cfg = build_config(Q0Config, {"samples": samples, "beta": beta,
                                  "sampling": (sampling or ToolSamplingConfig()).model_dump()})
    log = ResultLog(out_path) if out_path is not None else None
    if log is not None:
        for key, rec in log.records.items():
            if rec.get("n") != cfg.samples or rec.get("beta") != cfg.beta:
                raise ValueError(f"{out_path}: prompt '{key}' was estimated with n={rec.get('n')}, "
                                 f"beta={rec.get('beta')}; this run asks n={cfg.samples}, beta={cfg.beta} "
                                 "(use another output file)")
    if trajectories_out is not None and log is None:
        raise ValueError("estimate_q0: trajectories_out needs out_path (the Q0 file is the resume state of both)")
    kept = _TrajectorySink(trajectories_out, log) if trajectories_out is not None and keep_successful > 0 else None

    async def work(prompt: Prompt) -> dict:
        completions = await sample(client, prompt.tokens, cfg.samples, cfg.sampling, seed_key=(prompt.prompt_id,))
        results = await score_all(reward_pool, prompt.problem, [c.text for c in completions])
        correct = sum(r.passed for r in results)
        est = q0_from_counts(correct, cfg.samples, cfg.beta)
        if kept is not None:
            good = [(c, r.reward) for c, r in zip(completions, results) if r.passed and c.output_ids]
            kept.add(prompt, good[:keep_successful], est.q0)
        return {"prompt_id": prompt.prompt_id, "s0": est.s0, "q0": est.q0, "n": est.n, "correct": est.correct,
                "beta": cfg.beta}

    try:
        records = await run_resumable(prompts, lambda p: p.prompt_id, work, log,
                                      concurrency=cfg.sampling.concurrency, description="estimate-q0",
                                      progress=progress)
    finally:
        if log is not None:
            log.close()
    if kept is not None:  # every prompt is done (a cut run raised above)
        kept.finalize([p.prompt_id for p in prompts])
    return {k: Q0Estimate(r["s0"], r["q0"], r["n"], r["correct"]) for k, r in records.items()}


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

    def add(self, prompt: Prompt, samples: list[tuple[Completion, float]], q0: float) -> None:
        """samples: (completion, reward) pairs."""
        from megatron_spo.data.trajectory import Trajectory

        with open(self.path, "a", encoding="utf-8") as f:
            for c, reward in samples:
                traj = Trajectory(prompt_id=prompt.prompt_id, prompt_tokens=list(prompt.tokens),
                                  response_tokens=list(c.output_ids), reward=reward, source="reference",
                                  policy_version=0, q0=q0)
                f.write(_dump(traj.to_dict()))
            f.flush()
            os.fsync(f.fileno())

    def finalize(self, order: list[str]) -> None:
        rank = {k: i for i, k in enumerate(order)}
        lines = [ln + "\n" for ln in self.path.read_text(encoding="utf-8").split("\n")[:-1] if ln.strip()]
        lines.sort(key=lambda ln: rank.get(str(json.loads(ln)["prompt_id"]), len(rank)))  # stable within a prompt
        write_lines_atomic(self.path, lines)


# ---------------------------------------------------------------------------------------------
# Command lines (shared by estimate-q0, pts and eval)
# ---------------------------------------------------------------------------------------------
def add_task_args(parser: argparse.ArgumentParser, *, default_split: str) -> None:
    parser.add_argument("--engine-url", "--router-url", dest="engine_url", default=None,
                        help="an engine or the router, e.g. http://127.0.0.1:30000")
    from megatron_spo.data.tasks import TASK_KINDS

    parser.add_argument("--task", default=None, choices=list(TASK_KINDS))
    parser.add_argument("--data", default=None, help="task file(s) (glob); not for --task toy")
    parser.add_argument("--split", default=default_split, help="toy task split: train | heldout | all")
    parser.add_argument("--toy-seed", type=int, default=0, help="seed of the generated toy task")
    parser.add_argument("--limit", type=int, default=None, help="only the first N problems")
    parser.add_argument("--tokenizer", default=None, help="HF tokenizer folder (default: the engine's)")
    parser.add_argument("--prompt-format", default="auto", choices=["auto", "raw", "template"])
    parser.add_argument("--sandbox-slots", type=int, default=0, help="concurrent sandboxes (0 = CPUs)")
    parser.add_argument("--isolation", default="bubblewrap", choices=["bubblewrap", "rlimits-only"])
    parser.add_argument("--request-timeout", type=float, default=600.0, help="seconds per /generate call")
    parser.add_argument("--no-progress", action="store_true")


def add_sampling_args(parser: argparse.ArgumentParser, defaults: ToolSamplingConfig) -> None:
    g = parser.add_argument_group("sampling")
    g.add_argument("--temperature", type=float, default=defaults.temperature)
    g.add_argument("--top-p", type=float, default=defaults.top_p)
    g.add_argument("--top-k", type=int, default=defaults.top_k)
    g.add_argument("--max-new-tokens", type=int, default=defaults.max_new_tokens)
    g.add_argument("--seed", type=int, default=defaults.seed,
                   help="per-sample sampling seeds derive from it (one request per sample; reproducible only on "
                        "engines with deterministic inference). Default: engine randomness, n per request")
    g.add_argument("--samples-per-request", type=int, default=defaults.samples_per_request)
    g.add_argument("--concurrency", type=int, default=defaults.concurrency, help="prompts in flight")


def sampling_from_args(args: argparse.Namespace) -> dict:
    return {"temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k,
            "max_new_tokens": args.max_new_tokens, "seed": args.seed,
            "samples_per_request": args.samples_per_request, "concurrency": args.concurrency}


def apply_train_config(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """Fill what the command line left open from a training config (``args.config``, a TrainConfig YAML): its
    task (kind, paths, dedup, toy settings), tokenizer (init.hf), engines (fleet / SPO_ROUTER_URL) and beta.
    Then check that the task and the engine URL are known."""
    args.task_config = None
    if getattr(args, "config", None):
        from megatron_spo.config import TrainConfig, load_config

        cfg = load_config(TrainConfig, args.config)
        args.task_config = cfg.task if args.task is None else None
        args.task = args.task or cfg.task.kind
        args.tokenizer = args.tokenizer or cfg.init.hf
        fleet = cfg.fleet.resolved()
        args.engine_url = args.engine_url or fleet.router_url or (fleet.engine_urls or [None])[0]
        if getattr(args, "beta", None) is None:
            args.beta = cfg.beta
    if args.task is None:
        parser.error("--task is required (or give a training config)")
    if args.engine_url is None:
        parser.error("--engine-url is required (or a training config with fleet endpoints / SPO_ROUTER_URL)")


def problems_from_task_config(task: Any) -> list:
    """The training problems a TaskConfig names (the trainer's prompt set: toy train split, or files minus
    the dedup_against set)."""
    from megatron_spo.data import tasks

    if task.kind == "toy":
        from megatron_spo.data.toy_code import make_task

        return list(make_task(**task.toy.model_dump()).train)[: task.limit]
    if not task.paths:
        raise ValueError(f"task.paths: task kind '{task.kind}' needs data files")
    problems = load_problems(task.kind, task.paths)
    if task.dedup_against:
        problems, _ = tasks.dedup_against(problems, tasks.load_taco(task.dedup_against))
    return problems[: task.limit]


def problems_from_args(args: argparse.Namespace) -> list:
    if getattr(args, "task_config", None) is not None:
        problems = problems_from_task_config(args.task_config)
    else:
        problems = load_problems(args.task, args.data, split=args.split, toy_seed=args.toy_seed)
    if args.limit is not None:
        problems = problems[: args.limit]
    if not problems:
        raise ValueError(f"--task {args.task}: no problems to process")
    return problems


def prompts_from_args(args: argparse.Namespace) -> list[Prompt]:
    problems = problems_from_args(args)
    return make_prompts(problems, load_tokenizer(args.tokenizer, args.engine_url), prompt_format=args.prompt_format)


def reward_pool_from_args(args: argparse.Namespace, problems: Sequence[Any], *, hidden: bool = False):
    """A RewardPool; a sandbox pool is started only when some problem is code. Close with close_reward_pool."""
    from megatron_spo.config import SandboxConfig
    from megatron_spo.rewards.reward import RewardPool
    from megatron_spo.rewards.sandbox import SandboxPool
    from megatron_spo.run_layout import children_ignore_preemption_signals

    code = needs_sandbox(problems)
    sandbox = None
    if code:
        with children_ignore_preemption_signals():  # a stop signal for the tool must not kill its scorer
            sandbox = SandboxPool(SandboxConfig(slots=args.sandbox_slots, isolation=args.isolation))
    return RewardPool(sandbox, hidden=hidden)


def needs_sandbox(problems: Sequence[Any], custom_reward: Any = None) -> bool:
    """Whether scoring these problems runs programs (a custom reward, or only math problems, never does)."""
    from megatron_spo.rewards.reward import REWARD_KINDS

    if custom_reward is not None:
        return False
    return any(REWARD_KINDS[getattr(p, "kind", "code")].sandbox for p in problems)


def close_reward_pool(pool: Any) -> None:
    if pool is None:
        return
    pool.close()
    if getattr(pool, "sandbox", None) is not None:
        pool.sandbox.close()


STOP_SIGNALS = (signal.SIGUSR1, signal.SIGTERM)  # SLURM's --signal (time limit), scancel / preemption


def run_cli(prog: str, body: Callable[[], Awaitable[int]]) -> int:
    """asyncio.run(body()) with one-line errors for bad input, Ctrl-C and SIGUSR1 / SIGTERM.

    A stop signal cancels the work in flight and the tool exits once its output holds every item finished so far
    (a re-run resumes): exit 0 after SIGUSR1 (SLURM's "save and exit" warning: spo.sbatch then requeues the job,
    as after the trainer's checkpoint), 128 + 15 after SIGTERM, 130 after Ctrl-C.
    """
    from megatron_spo.rollout.client import EngineError

    stopped_by: list[int] = []

    def record(signum: int, _frame: Any) -> None:  # outside the event loop: starting up, shutting down
        stopped_by.append(signum)

    previous = {sig: signal.signal(sig, record) for sig in STOP_SIGNALS}

    async def guarded() -> int:
        loop, task = asyncio.get_running_loop(), asyncio.current_task()

        def stop(signum: int) -> None:
            stopped_by.append(signum)
            task.cancel()

        for sig in STOP_SIGNALS:
            loop.add_signal_handler(sig, stop, sig)
        try:
            if stopped_by:  # it came while the tool was starting
                raise asyncio.CancelledError
            return await body()
        finally:
            for sig in STOP_SIGNALS:
                loop.remove_signal_handler(sig)
                signal.signal(sig, record)

    try:
        return asyncio.run(guarded())
    except asyncio.CancelledError:
        if not stopped_by:
            raise
        name = signal.Signals(stopped_by[0]).name
        print(f"{prog}: stopped by {name}; the output keeps every finished item: re-run the same command to resume",
              flush=True)
        return 0 if stopped_by[0] == signal.SIGUSR1 else 128 + stopped_by[0]
    except KeyboardInterrupt:
        print(f"{prog}: interrupted; re-run the same command to resume", flush=True)
        return 130
    except (ValueError, FileNotFoundError, EngineError) as err:
        if isinstance(err, ConfigError):
            raise
        print(f"{prog}: error: {err}", flush=True)
        return 2
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def main(argv: list[str]) -> int:
    defaults = Q0Config()
    parser = argparse.ArgumentParser(prog="megatron-spo estimate-q0",
                                     description="Monte-Carlo S0 and Q0 per prompt from reference samples.")
    parser.add_argument("config", nargs="?", default=None,
                        help="a training config (YAML): task, tokenizer, engines and beta come from it unless given")
    add_task_args(parser, default_split="train")
    parser.add_argument("--out", required=True, help="result JSONL (resumable; a path without .jsonl is a folder "
                        "receiving q0.jsonl): prompt_id, s0, q0, n, correct, beta")
    parser.add_argument("--samples", type=int, default=defaults.samples, help="samples per prompt (paper: 800)")
    parser.add_argument("--beta", type=float, default=None, help=f"default: the config's, else {defaults.beta:.6f}")
    parser.add_argument("--trajectories-out", default=None, help="also save correct samples as trajectories here")
    parser.add_argument("--keep-successful", type=int, default=4, help="correct samples saved per prompt")
    add_sampling_args(parser, defaults.sampling)
    args = parser.parse_args(argv)
    apply_train_config(args, parser)
    if not args.out.endswith(".jsonl"):
        args.out = os.path.join(args.out, "q0.jsonl")
    beta = defaults.beta if args.beta is None else args.beta
    cfg = build_config(Q0Config, {"samples": args.samples, "beta": beta, "sampling": sampling_from_args(args)})

    async def body() -> int:
        from megatron_spo.rollout.client import EngineClient

        prompts = prompts_from_args(args)
        pool = reward_pool_from_args(args, [p.problem for p in prompts])
        try:
            async with EngineClient(args.engine_url, timeout_s=args.request_timeout) as client:
                est = await estimate_q0(prompts, client, pool, samples=cfg.samples, beta=cfg.beta,
                                        sampling=cfg.sampling, out_path=args.out,
                                        trajectories_out=args.trajectories_out,
                                        keep_successful=args.keep_successful, progress=not args.no_progress)
        finally:
            close_reward_pool(pool)
        mean_s0 = sum(e.s0 for e in est.values()) / len(est)
        print(f"estimate-q0: {len(est)} prompts, mean S0 {mean_s0:.4f}, {cfg.samples} samples each -> {args.out}")
        return 0

    return run_cli("megatron-spo estimate-q0", body)
