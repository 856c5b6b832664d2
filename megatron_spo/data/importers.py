"""Importers into the offline store: text from any producer, and human solutions of CodeContests and TACO.

    pool = RewardPool(SandboxPool(), hidden=False)                 # the reward training uses (hidden: + hidden tests)
    summary = run_import(lambda: codecontests_candidates("cc.jsonl"), "store/", tokenizer=tok, rewards=pool)
    summary = run_import(lambda: text_candidates("samples.jsonl", problems, tokenizer=tok), "store/", ...)

Every importer turns input rows into candidates (problem, response text, provenance), then:
  * tokenizes the prompt with the policy's tokenizer and the prompt builder training uses
    (megatron_spo.data.prompts.make_prompts: chat template or plain layout, the toy task's raw prompt), and the
    response as ``tokenizer(text, add_special_tokens=False) + [eos]`` (what the engine returns for a finished
    sample);
  * re-runs the response against the problem's tests in the sandbox (the reward tests, or with ``hidden`` also
    the hidden ones) through the RewardPool training uses, and stores the verdict as the reward (0 pass,
    -1 fail): a wrong "solution" never enters as a success, whatever its row claims.

Input rows are JSONL. A corrupt row (not UTF-8, not JSON, a field outside the schema, an unknown problem) is a
RecordError naming file:line. All rows are checked before anything is scored or written, so a corrupt row
without ``skip_invalid`` leaves the store exactly as it was; with ``skip_invalid`` it is skipped, counted and
reported and every good row is imported. Shards are written as they fill (atomic, like every store write):
a run that dies while scoring keeps the complete shards it wrote; the records still buffered are written
when the import ends by an exception (they are scored and valid).

Row schemas:
  * text:          {problem_id | prompt, response, kind?, model?, run_id?, temperature?, top_p?, created?,
                    reward?, policy_version?}; ``prompt`` is matched to a problem of the task by its statement
                    (tasks.text_key) or its built prompt text; ``reward`` is the producer's claim (compared
                    with the verdict and counted, never stored).
  * CodeContests:  name, description, public_tests / private_tests / generated_tests {input: [...],
                    output: [...]}, solutions {language: [int], solution: [str]} (Python 3 = 3 in the
                    dataset's Language enum: UNKNOWN_LANGUAGE 0, PYTHON 1 (Python 2), CPP 2, PYTHON3 3,
                    JAVA 4), time_limit {seconds, nanos}, memory_limit_bytes. The problem is built as
                    tasks.load_codecontests builds it (id codecontests/<name>, the same reward and hidden tests).
  * TACO:          question, input_output (a JSON string {inputs, outputs, fn_name?}), solutions (a JSON
                    string: a list of Python programs), name?, time_limit?, memory_limit?; the problem as
                    tasks.load_taco builds it (id taco/<row>[/<name>], row = 0-based row of the file);
                    call-based problems (fn_name) are scored by their function-call tests.
"""

from __future__ import annotations

import logging
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megatron_spo.config import loads_json
from megatron_spo.data.expert import EXPERT_MODEL, EXPERT_ORIGIN, expert_solution
from megatron_spo.data.tasks import (
    GENERATED_TASKS,
    TASK_ALIASES,
    TASK_KINDS,
    codecontests_problem,
    taco_problem,
    task_kind_name,
)
from megatron_spo.data.trajectory import (
    PROVENANCE_KINDS,
    ImportReport,
    RecordError,
    Trajectory,
    iter_jsonl,
    validate_provenance,
)

logger = logging.getLogger(__name__)

CODECONTESTS_PYTHON3 = 3  # ContestProblem.Solution.Language.PYTHON3 (deepmind/code_contests, contest_problem.proto)
CODECONTESTS_LANGUAGES = {"UNKNOWN_LANGUAGE": 0, "PYTHON": 1, "CPP": 2, "PYTHON3": 3, "JAVA": 4}
TEXT_FIELDS = ("problem_id", "prompt", "response", "kind", "model", "run_id", "temperature", "top_p", "created",
               "reward", "policy_version")
SOURCE = "offline"  # the record's source name (a training source renames it to its own)


@dataclass
class Candidate:
    """One response to import: where it came from in the input, its problem, text and provenance."""

    where: str
    problem: Any
    response: str
    provenance: dict
    claimed_reward: float | None = None
    policy_version: int = 0
    tokens: list[int] | None = None  # the response's token ids, set when it is imported


@dataclass
class ImportSummary:
    """What an import did. report.read: rows that gave responses, report.skipped / errors: corrupt rows;
    skipped_rows: valid rows that gave no response, by reason (no Python 3 solution, no tests, ...);
    candidates / imported / passed: responses; claimed_pass_failed: responses whose row claimed a pass
    (reward >= 0) that the sandbox failed."""

    report: ImportReport = field(default_factory=ImportReport)
    candidates: int = 0
    imported: int = 0
    passed: int = 0
    dropped_failing: int = 0
    claimed_pass_failed: int = 0
    skipped_rows: Counter = field(default_factory=Counter)

    def lines(self, store: str | Path) -> list[str]:
        out = [f"imported {self.imported} of {self.candidates} responses into {store}: {self.passed} pass, "
               f"{self.imported - self.passed} fail (the sandbox's verdict is the reward)"]
        if self.dropped_failing:
            out.append(f"dropped {self.dropped_failing} failing responses (--only-passing)")
        if self.claimed_pass_failed:
            out.append(f"{self.claimed_pass_failed} responses claimed a pass and failed in the sandbox")
        out += [f"rows without a response to import ({why}): {n}" for why, n in sorted(self.skipped_rows.items())]
        return out


# ---------------------------------------------------------------------------------------------
# Rows -> candidates
# ---------------------------------------------------------------------------------------------
def _rows(path: str | Path) -> Iterator[tuple[str, int, dict | RecordError]]:
    """(where, row index, row dict or RecordError) per non-blank line; the row index counts every non-blank
    line (the row numbering of the datasets library, which names TACO problems)."""
    for i, (where, obj) in enumerate(iter_jsonl(path)):
        if not isinstance(obj, (dict, RecordError)):
            obj = RecordError(where, None, f"a row must be a JSON object, got {type(obj).__name__}")
        yield where, i, obj


def _task_error(err: Exception, where: str) -> RecordError:
    from megatron_spo.data.tasks import TaskFormatError

    if isinstance(err, TaskFormatError):
        return RecordError(where, None, str(err).removeprefix(f"{where}: "))
    return RecordError(where, None, f"{type(err).__name__}: {err}")


def _solution_list(value: Any, where: str, name: str) -> list[tuple[int, str]]:
    """CodeContests {language: [...], solution: [...]} -> [(language, program)]."""
    if value is None:
        return []
    if not isinstance(value, dict) or not {"language", "solution"} <= set(value):
        raise RecordError(where, name, "should be {'language': [...], 'solution': [...]}")
    languages, programs = value["language"] or [], value["solution"] or []
    if not isinstance(languages, list) or not isinstance(programs, list) or len(languages) != len(programs):
        raise RecordError(where, name, "should hold as many languages as solutions")
    out = []
    for i, (lang, program) in enumerate(zip(languages, programs)):
        lang = CODECONTESTS_LANGUAGES.get(lang, lang) if isinstance(lang, str) else lang
        if not isinstance(lang, int) or isinstance(lang, bool) or not isinstance(program, str):
            raise RecordError(where, name, f"item {i}: language must be an int (or its enum name) and solution a "
                              f"string")
        out.append((lang, program))
    return out


def fence(program: str) -> str:
    """A program as the prompt asks for it (tasks.CODE_INSTRUCTION: one ```python code block)."""
    return f"```python\n{program.rstrip()}\n```"


def codecontests_candidates(path: str | Path, *, max_per_problem: int | None = None, raw: bool = False,
                            skipped: Counter | None = None) -> Iterator[Candidate | RecordError]:
    """The Python 3 solutions of CodeContests rows (human, origin codecontests), fenced unless ``raw``."""
    skipped = Counter() if skipped is None else skipped
    for where, _, row in _rows(path):
        if isinstance(row, RecordError):
            yield row
            continue
        try:
            problem = codecontests_problem(row, where)
            solutions = _solution_list(row.get("solutions"), where, "solutions")
        except RecordError as err:
            yield err
            continue
        except Exception as err:  # TaskFormatError, and a row too odd for the task's own helpers
            yield _task_error(err, where)
            continue
        if problem is None:
            skipped["no tests"] += 1
            continue
        python = [s for lang, s in solutions if lang == CODECONTESTS_PYTHON3 and s.strip()]
        if not python:
            skipped["no Python 3 solution"] += 1
            continue
        for program in python[:max_per_problem]:
            yield Candidate(where, problem, program if raw else fence(program),
                            {"kind": "human", "origin": "codecontests"})


def expert_candidates(problems: Iterable[Any]) -> Iterator[Candidate]:
    """The expert solution of each generated problem (data/expert.py): provenance kind human, model
    expert-generator, origin megatron_spo.data.expert."""
    for p in problems:
        yield Candidate(f"expert:{p.id}", p, expert_solution(p),
                        {"kind": "human", "model": EXPERT_MODEL, "origin": EXPERT_ORIGIN})


def taco_candidates(path: str | Path, *, max_per_problem: int | None = None, raw: bool = False,
                    skipped: Counter | None = None) -> Iterator[Candidate | RecordError]:
    """The solutions of TACO rows (Python programs; human, origin taco), fenced unless ``raw``."""
    skipped = Counter() if skipped is None else skipped
    for where, index, row in _rows(path):
        if isinstance(row, RecordError):
            yield row
            continue
        try:
            problem = taco_problem(row, index, where)
            raw_solutions = row.get("solutions") or "[]"
            if not isinstance(raw_solutions, str):
                raise RecordError(where, "solutions", "should be a JSON string of a list of programs")
            try:
                solutions = loads_json(raw_solutions)
            except (ValueError, RecursionError) as err:
                raise RecordError(where, "solutions", f"is not valid JSON ({err})") from None
            if not isinstance(solutions, list) or not all(isinstance(s, str) for s in solutions):
                raise RecordError(where, "solutions", "should be a JSON list of programs (strings)")
        except RecordError as err:
            yield err
            continue
        except Exception as err:
            yield _task_error(err, where)
            continue
        programs = [s for s in solutions if s.strip()]
        if not programs:
            skipped["no solution"] += 1
            continue
        for program in programs[:max_per_problem]:
            yield Candidate(where, problem, program if raw else fence(program), {"kind": "human", "origin": "taco"})


class ProblemIndex:
    """The task's problems by id, by statement (tasks.text_key) and by built prompt text."""

    def __init__(self, problems: Sequence[Any], prompt_of: Callable[[Any], str] | None = None):
        from megatron_spo.data.tasks import text_key

        self.by_id = {str(p.id): p for p in problems}
        self.by_text: dict[str, list] = {}
        for p in problems:
            keys = {text_key(p.prompt)} | ({text_key(prompt_of(p))} if prompt_of else set())
            for key in keys:
                self.by_text.setdefault(key, []).append(p)

    def find(self, row: dict, where: str):
        from megatron_spo.data.tasks import text_key

        if "problem_id" in row:
            pid = row["problem_id"]
            if not isinstance(pid, (str, int)) or isinstance(pid, bool) or str(pid) not in self.by_id:
                raise RecordError(where, "problem_id", f"{pid!r} is not a problem of the task")
            return self.by_id[str(pid)]
        prompt = row.get("prompt")
        if not isinstance(prompt, str) or not prompt.strip():
            raise RecordError(where, "prompt", "give problem_id, or prompt as a non-empty string")
        found = self.by_text.get(text_key(prompt), [])
        if len({id(p) for p in found}) != 1:
            raise RecordError(where, "prompt", "matches no problem of the task" if not found else
                              f"matches {len(found)} problems of the task ({', '.join(str(p.id) for p in found[:3])})")
        return found[0]


def text_candidates(path: str | Path, problems: ProblemIndex, *,
                    default_kind: str = "other-model") -> Iterator[Candidate | RecordError]:
    """Text responses of any producer (see the module docstring for the row schema); origin = the file name."""
    for where, _, row in _rows(path):
        if isinstance(row, RecordError):
            yield row
            continue
        try:
            unknown = sorted(set(row) - set(TEXT_FIELDS))
            if unknown:
                raise RecordError(where, unknown[0], f"unknown field (known: {', '.join(TEXT_FIELDS)})")
            problem = problems.find(row, where)
            response = row.get("response")
            if not isinstance(response, str) or not response.strip():
                raise RecordError(where, "response", f"must be a non-empty string, got {response!r:.40}")
            claimed = row.get("reward")
            if claimed is not None and (isinstance(claimed, bool) or not isinstance(claimed, (int, float))):
                raise RecordError(where, "reward", f"must be a number, got {claimed!r:.40}")
            version = row.get("policy_version", 0)
            if not isinstance(version, int) or isinstance(version, bool) or version < 0:
                raise RecordError(where, "policy_version", f"must be an integer >= 0, got {version!r:.40}")
            provenance = {"kind": row.get("kind", default_kind), "origin": Path(path).name,
                          **{k: row[k] for k in ("model", "run_id", "temperature", "top_p", "created") if k in row}}
            validate_provenance(provenance, where)
        except RecordError as err:
            yield err
            continue
        yield Candidate(where, problem, response, provenance, claimed_reward=claimed, policy_version=version)


# ---------------------------------------------------------------------------------------------
# Candidates -> scored records in the store
# ---------------------------------------------------------------------------------------------
def response_tokens(tokenizer: Any, text: str, *, eos: bool = True) -> list[int]:
    """A response's token ids as the engine returns a finished sample: the text, then EOS."""
    ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    eos_id = getattr(tokenizer, "eos_token_id", None)
    if eos and eos_id is not None and (not ids or ids[-1] != eos_id):
        ids.append(eos_id)
    return ids


def run_import(candidates: Callable[[], Iterable[Candidate | RecordError]], store: str | Path, *, tokenizer: Any,
               rewards: Any, skip_invalid: bool = False, prompt_format: str = "auto", eos: bool = True,
               only_passing: bool = False, q0: dict[str, float] | None = None, origin: str | None = None,
               run_id: str | None = None, rows_per_shard: int = 65536, window: int | None = None,
               summary: ImportSummary | None = None) -> ImportSummary:
    """Check every row (``candidates()`` is called twice: check, then import), then tokenize, score in
    ``rewards`` (a RewardPool, or a function making one, called once every row is checked) and append the
    records to ``store``. Raises the first RecordError unless ``skip_invalid``; nothing is scored or written
    before every row has been checked."""
    from megatron_spo.data.offline_store import OfflineStoreWriter
    from megatron_spo.data.prompts import make_prompts

    summary = ImportSummary() if summary is None else summary
    report = summary.report
    rows, last = 0, None
    for item in candidates():  # pass 1: every row checked, nothing scored or written yet
        if isinstance(item, RecordError):
            if not skip_invalid:
                raise item
            report.skipped += 1
            report.errors.append(str(item))
            continue
        summary.candidates += 1
        rows += item.where != last  # a row's candidates come together
        last = item.where
    report.read = rows
    if not hasattr(rewards, "submit"):
        rewards = rewards()
    created = time.time()
    prompts: dict[str, list[int]] = {}
    window = window or 4 * int(getattr(getattr(rewards, "sandbox", None), "slots", 1) or 1)
    pending: deque = deque()

    def record(c: Candidate, result) -> Trajectory | None:
        if c.claimed_reward is not None and c.claimed_reward >= 0.0 and not result.passed:
            summary.claimed_pass_failed += 1
        if only_passing and not result.passed:
            summary.dropped_failing += 1
            return None
        summary.passed += bool(result.passed)
        pid = str(c.problem.id)
        given = {"created": created, "origin": origin, "run_id": run_id, **c.provenance}
        provenance = validate_provenance({k: v for k, v in given.items() if v is not None}, c.where)
        return Trajectory(prompt_id=pid, prompt_tokens=prompts[pid], response_tokens=c.tokens,
                          reward=float(result.reward), source=SOURCE, policy_version=c.policy_version,
                          q0=(q0 or {}).get(pid), provenance=provenance)

    with OfflineStoreWriter(store, rows_per_shard) as writer:

        def write_done() -> None:
            traj = record(*_done(pending.popleft()))
            if traj is not None:
                writer.add(traj)
                summary.imported += 1

        try:
            for item in candidates():  # pass 2
                if isinstance(item, RecordError):
                    continue
                pid = str(item.problem.id)
                if pid not in prompts:
                    prompts[pid] = list(make_prompts([item.problem], tokenizer, prompt_format=prompt_format)[0].tokens)
                item.tokens = response_tokens(tokenizer, item.response, eos=eos)
                pending.append((item, rewards.submit(item.problem, item.response)))
                while len(pending) >= window:
                    write_done()
            while pending:
                write_done()
        except BaseException:
            for _, future in pending:
                future.cancel()
            writer.close()  # what was scored is valid: keep it
            raise
    return summary


def _done(item: tuple[Candidate, Any]) -> tuple[Candidate, Any]:
    candidate, future = item
    return candidate, future.result()


# ---------------------------------------------------------------------------------------------
# Command lines (under `megatron-spo offline`, see megatron_spo.data.experience)
# ---------------------------------------------------------------------------------------------
def add_import_args(sub, name: str, help_text: str):
    from megatron_spo.cli import non_negative_int, positive_int

    p = sub.add_parser(name, help=help_text)
    if name != "import-expert":
        p.add_argument("inputs", nargs="+", help="JSONL file(s) of rows")
    p.add_argument("--store", required=True, help="offline store folder (created, or appended to)")
    p.add_argument("--config", default=None, help="a training config: its tokenizer (init.hf)"
                   + (" and its task's problems" if name == "import-text" else ""))
    p.add_argument("--tokenizer", default=None, help="the policy's HF tokenizer folder")
    p.add_argument("--prompt-format", default="auto", choices=["auto", "raw", "template"],
                   help="as training builds prompts (auto: chat template, plain layout, toy task raw)")
    p.add_argument("--hidden", action="store_true", help="also run the hidden tests (default: reward tests only)")
    p.add_argument("--only-passing", action="store_true", help="import only responses the sandbox passes")
    p.add_argument("--no-eos", action="store_true", help="do not end responses with the tokenizer's EOS")
    p.add_argument("--q0", default=None, help="a Q0 file (estimate-q0 output) to attach q0 per prompt")
    p.add_argument("--run-id", default=None, help="provenance run_id (the import's name)")
    p.add_argument("--skip-invalid", action="store_true", help="skip corrupt rows (counted and reported)")
    p.add_argument("--rows-per-shard", type=positive_int, default=65536, help="records per shard")
    p.add_argument("--sandbox-slots", type=non_negative_int, default=0, help="concurrent sandboxes (0 = CPUs)")
    p.add_argument("--isolation", default="bubblewrap", choices=["bubblewrap", "rlimits-only"])
    if name == "import-text":
        p.add_argument("--task", default=None, type=task_kind_name, choices=list(TASK_KINDS),
                       help=f"the task ({TASK_ALIASES})")
        p.add_argument("--data", default=None, help="task file(s) (glob); not for --task toy")
        p.add_argument("--split", default="all", help="toy task split, or a DatasetDict folder's split")
        p.add_argument("--toy-seed", type=non_negative_int, default=0)
        p.add_argument("--kind", default="other-model", choices=PROVENANCE_KINDS,
                       help="provenance kind of rows that do not say")
    elif name == "import-expert":
        p.add_argument("--task", required=True, choices=list(GENERATED_TASKS), help="the generated task")
        p.add_argument("--split", default="train", help="toy task split: train | heldout | all (train: the "
                       "quickstart keeps only its training prompts of it, never its validation ones)")
        p.add_argument("--toy-seed", type=non_negative_int, default=0)
    else:
        p.add_argument("--max-per-problem", type=positive_int, default=None, help="at most N solutions per problem")
        p.add_argument("--raw", action="store_true", help="the program as is, not in a ```python block")
    return p


def run_import_command(args) -> int:
    """`megatron-spo offline import-text | import-codecontests | import-taco | import-expert`."""
    import sys

    from megatron_spo.rewards.sandbox import SandboxError

    summary = ImportSummary()
    try:
        tokenizer, problems = _tokenizer_and_problems(args)
        for path in getattr(args, "inputs", ()):
            if Path(path).is_dir():
                raise FileNotFoundError(f"'{path}' is a folder, not a JSONL file of rows")
            if not Path(path).is_file():
                raise FileNotFoundError(f"'{path}' not found")
        if args.op == "import-expert":
            def candidates():
                return expert_candidates(problems)
        elif args.op == "import-text":
            from megatron_spo.data.prompts import prompt_text

            index = ProblemIndex(problems, lambda p: prompt_text(p, tokenizer, args.prompt_format))

            def candidates():
                for path in args.inputs:
                    yield from text_candidates(path, index, default_kind=args.kind)
        else:
            reader = codecontests_candidates if args.op == "import-codecontests" else taco_candidates

            def candidates():
                summary.skipped_rows.clear()
                for path in args.inputs:
                    yield from reader(path, max_per_problem=args.max_per_problem, raw=args.raw,
                                      skipped=summary.skipped_rows)
        q0 = None
        if args.q0:
            from megatron_spo.data.q0 import read_q0

            q0 = {pid: est.q0 for pid, est in read_q0(args.q0).items()}
        pools = []

        def rewards():  # started only once every row is checked
            pools.append(_reward_pool(args, problems))
            return pools[-1]

        try:
            run_import(candidates, args.store, tokenizer=tokenizer, rewards=rewards, skip_invalid=args.skip_invalid,
                       prompt_format=args.prompt_format, eos=not args.no_eos, only_passing=args.only_passing,
                       q0=q0, run_id=args.run_id, rows_per_shard=args.rows_per_shard, summary=summary)
        finally:
            for pool in pools:
                pool.close()
                if pool.sandbox is not None:
                    pool.sandbox.close()
    except (RecordError, FileNotFoundError, ValueError, SandboxError) as err:
        print(f"megatron-spo offline {args.op}: {err}", file=sys.stderr)
        return 1
    for line in summary.lines(args.store):
        print(line)
    summary.report.print_skipped("row")
    return 0


def _tokenizer_and_problems(args) -> tuple[Any, list]:
    """The policy tokenizer (--tokenizer, else the config's init.hf) and, for import-text, the task's problems
    (--task/--data, else the config's task: the trainer's prompt set)."""
    cfg = None
    if args.config:
        from megatron_spo.config import load_config
        from megatron_spo.data.config import TrainTaskView

        cfg = load_config(TrainTaskView, args.config)
    path = args.tokenizer or (cfg.init_hf if cfg is not None else None)
    if not path and args.op == "import-expert":  # the generated tasks' models all use the character vocabulary
        from megatron_spo.data.char_tokenizer import build_char_tokenizer

        tokenizer = build_char_tokenizer()
    elif not path:
        raise ValueError("give --tokenizer DIR (the policy's tokenizer) or --config with init.hf")
    else:
        tokenizer = load_tokenizer(path)
    problems: list = []
    if args.op == "import-expert":
        from megatron_spo.data.problems import load_problems

        problems = load_problems(GENERATED_TASKS[args.task], split=args.split, toy_seed=args.toy_seed)
    elif args.op == "import-text":
        from megatron_spo.data.problems import load_problems, problems_from_task_config

        if args.task is not None:
            problems = load_problems(args.task, args.data, split=args.split, toy_seed=args.toy_seed)
        elif cfg is not None:
            problems = problems_from_task_config(cfg.task)
        else:
            raise ValueError("import-text needs the task's problems: --task (and --data), or --config")
    return tokenizer, problems


# Files of which a tokenizer folder holds at least one (fast tokenizers, sentencepiece, BPE / WordPiece vocabularies)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model", "tokenizer.tiktoken")


def load_tokenizer(path: str | Path):
    """AutoTokenizer.from_pretrained(path), or ValueError in one line naming the folder: a folder without
    tokenizer files, or whatever transformers says (its messages run over several lines), shortened."""
    folder = Path(path)
    if folder.exists() and not folder.is_dir():
        raise ValueError(f"tokenizer '{folder}' is a file; give the tokenizer's folder")
    if folder.is_dir() and not any((folder / f).is_file() for f in TOKENIZER_FILES):
        raise ValueError(f"tokenizer folder '{folder}' holds no tokenizer files (none of {', '.join(TOKENIZER_FILES)})")
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(path))
    except Exception as err:  # OSError, ValueError, JSON errors of a damaged tokenizer.json, ...
        text = " ".join(str(err).split())
        raise ValueError(f"tokenizer '{path}' does not load ({type(err).__name__}: "
                         f"{text[:160] + '...' if len(text) > 160 else text})") from None


def _reward_pool(args, problems: Sequence[Any]):
    from megatron_spo.rewards.config import SandboxConfig
    from megatron_spo.rewards.reward import RewardPool
    from megatron_spo.rewards.sandbox import SandboxPool

    sandbox = None
    if args.op not in ("import-text", "import-expert") or any(getattr(p, "kind", "code") == "code"
                                                               for p in problems):
        sandbox = SandboxPool(SandboxConfig(slots=args.sandbox_slots, isolation=args.isolation))
    return RewardPool(sandbox, hidden=args.hidden)
