"""Tasks in other frameworks' data formats: verl's parquet rows, slime's JSONL, TRL's prompt datasets, and
``datasets`` folders (``save_to_disk``) in any of them. Task kinds verl, slime, trl and hf (data/tasks.py).

    problems = load_framework("verl", "gsm8k/train.parquet")                       # reward by data_source
    problems = load_framework("slime", "dapo.jsonl", ImportOptions(input_key="prompt", label_key="label"))
    problems = load_framework("hf", "saved/train")                                # schema told by its columns

Files: parquet (``*.parquet``), JSONL (any other file; bad lines are named file:line), or a folder written by
``Dataset.save_to_disk`` (a DatasetDict folder: its only split, or the one asked for). Schemas:
  * verl: data_source (chooses the reward), prompt (chat messages [{role, content}]), ability, reward_model
    {style, ground_truth}, extra_info (its split and index name the problem). Rewards by data_source as verl's
    default_compute_score: openai/gsm8k -> gsm8k, the MATH sources -> math, codecontests / apps / codeforces /
    taco -> code (ground_truth: {"inputs", "outputs", "fn_name"?} as JSON).
  * slime: the prompt under ``input_key`` (slime's --input-key, default "input"), the label under ``label_key``
    (--label-key), a metadata dict under ``metadata_key`` (--metadata-key, default "metadata").
  * trl: prompt (a string, or chat messages: TRL's conversational format) and solution (the reference).
  * hf: any of the three, told by its columns (reward_model and data_source: verl; prompt and solution: trl;
    else slime's keys).
A prompt string becomes one user message (slime's --apply-chat-template); every prompt goes through the model's
chat template as it is, no task instruction added (tasks.build_prompt). Every column but the prompt is kept in
the problem's metadata (TRL passes them to its reward functions). The reward: ``reward_kind``
(task.reward_kind) when set, else verl's data_source, else math. math: the reference is the last \\boxed{} of the
label, or GSM8K's answer after '####' (then scored as gsm8k), or the label as it is; gsm8k: the completion's
answer after its last '####' (else its \\boxed{}); code: the label holds the tests. docs/data-formats.md.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megatron_spo.data.problem import Problem, chat_messages, expand_paths, last_user_text
from megatron_spo.data.tasks import TaskFormatError, io_tests

FRAMEWORKS = ("verl", "slime", "trl", "hf")
REWARD_KINDS = ("code", "math", "gsm8k")
VERL_MATH = ("lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval", "HuggingFaceH4/MATH-500", "math_dapo",
             "numina_aops_forum", "numina_synthetic_math", "numina_amc_aime", "numina_synthetic_amc", "numina_cn_k12",
             "numina_olympiads")
VERL_CODE = ("codecontests", "apps", "codeforces", "taco")


@dataclass(frozen=True)
class ImportOptions:
    """How rows of another framework become problems (the TaskConfig fields of the same names). custom_reward:
    a task.reward hook scores them, so rows need no built-in reward (an unknown data_source, no label)."""

    input_key: str | None = None
    label_key: str | None = None
    metadata_key: str = "metadata"
    reward_kind: str | None = None
    custom_reward: bool = False


def import_options(task: Any) -> ImportOptions:
    """The ImportOptions of a TaskConfig (or anything with its fields)."""
    return ImportOptions(input_key=getattr(task, "input_key", None), label_key=getattr(task, "label_key", None),
                         metadata_key=getattr(task, "metadata_key", None) or "metadata",
                         reward_kind=getattr(task, "reward_kind", None),
                         custom_reward=getattr(task, "reward", None) is not None)


# ---------------------------------------------------------------------------------------------
# Reading parquet, JSONL and save_to_disk folders
# ---------------------------------------------------------------------------------------------
def read_records(paths: str | Sequence[str], split: str | None = None) -> Iterator[tuple[str, str, int, dict]]:
    """(file, where, row index in the file, row) of every row: where = 'file:line' (JSONL) or 'file row i'."""
    from megatron_spo.data.trajectory import RecordError, iter_jsonl

    for path in expand_paths(paths):
        if os.path.isdir(path):
            yield from ((path, f"{path} row {i}", i, row) for i, row in enumerate(_saved_dataset(path, split)))
        elif path.endswith(".parquet"):
            import pyarrow.parquet as pq

            rows = (row for batch in pq.ParquetFile(path).iter_batches() for row in batch.to_pylist())
            yield from ((path, f"{path} row {i}", i, row) for i, row in enumerate(rows))
        else:
            for i, (where, row) in enumerate(iter_jsonl(path)):
                if isinstance(row, RecordError):
                    raise TaskFormatError(str(row))
                if not isinstance(row, dict):
                    raise TaskFormatError(f"{where}: a row must be a JSON object, got {type(row).__name__}")
                yield path, where, i, row


def _saved_dataset(path: str, split: str | None):
    """The rows of a save_to_disk folder: a Dataset, or a DatasetDict's ``split`` (or its only split)."""
    import datasets

    try:
        ds = datasets.load_from_disk(path)
    except (FileNotFoundError, ValueError) as err:
        raise TaskFormatError(f"{path}: not a folder written by datasets' save_to_disk ({err})") from None
    if isinstance(ds, datasets.DatasetDict):
        names = list(ds)
        if split in ds:
            return ds[split]
        if len(names) != 1:
            raise TaskFormatError(f"{path}: a DatasetDict with splits {', '.join(names)}; give one split's folder "
                                  f"({os.path.join(path, names[0])})")
        return ds[names[0]]
    return ds


# ---------------------------------------------------------------------------------------------
# Rows -> problems
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Row:
    """One input row: its file, where (for errors), index in the file, and values."""

    path: str
    where: str
    index: int
    values: dict

    def default_id(self) -> str:
        """The row's own id column, else '<file stem>/<row index>'."""
        pid = self.values.get("id")
        if isinstance(pid, (str, int)) and not isinstance(pid, bool) and str(pid):
            return str(pid)
        return f"{Path(self.path).stem}/{self.index}"


def _prompt(row: Row, key: str) -> tuple[tuple[str, str], ...]:
    value = row.values.get(key)
    if value is None:
        raise TaskFormatError(f"{row.where}: missing field '{key}' (the prompt)")
    if isinstance(value, str):
        if not value.strip():
            raise TaskFormatError(f"{row.where}: field '{key}' is an empty prompt")
        return (("user", value),)
    try:
        return chat_messages(value, row.where, key)
    except ValueError as err:
        raise TaskFormatError(str(err)) from None


def math_reference(label: Any, where: str, key: str) -> tuple[str, str]:
    """(reference answer, answer_format) of a label: its last \\boxed{}, GSM8K's answer after '####' (format
    gsm8k), or the label itself (a number, or a string)."""
    from megatron_spo.rewards.gsm8k import gsm8k_answer
    from megatron_spo.rewards.math_answer import last_boxed

    if isinstance(label, (int, float)) and not isinstance(label, bool):
        return str(label), "boxed"
    if not isinstance(label, str) or not label.strip():
        raise TaskFormatError(f"{where}: field '{key}' should be the reference answer (a string or a number), "
                              f"got {label!r:.60}")
    if (boxed := last_boxed(label)) is not None:
        return boxed, "boxed"
    if (hashed := gsm8k_answer(label)) is not None:
        return hashed, "gsm8k"
    return label.strip(), "boxed"


def _problem(row: Row, pid: str, messages, label: Any, reward: str | None, key: str, source: str,
             metadata: dict) -> Problem:
    """The Problem of one row whose reference is ``label`` (field ``key``) under reward kind ``reward`` (None: a
    task.reward hook scores it: nothing to check)."""
    common = {"id": pid, "prompt": last_user_text(messages), "messages": messages, "source": source,
              "metadata": metadata}
    if reward is None:
        return Problem(**common, kind="math")
    if reward == "code":
        if label is None:
            raise TaskFormatError(f"{row.where}: missing field '{key}' (the tests of a code problem)")
        tests, harness = io_tests(label, row.where, key)
        if not tests:
            raise TaskFormatError(f"{row.where}: field '{key}' holds no tests")
        return Problem(**common, kind="code", tests=tests, harness=harness)
    if label is None:
        raise TaskFormatError(f"{row.where}: missing field '{key}' (the reference answer); name the label column "
                              "(task.label_key) or score with a task.reward hook")
    answer, answer_format = math_reference(label, row.where, key)
    return Problem(**common, kind="math", answer=answer, answer_format="gsm8k" if reward == "gsm8k" else answer_format)


def verl_reward(data_source: str, where: str, opts: ImportOptions) -> str | None:
    """The reward kind of a verl row: task.reward_kind, else by data_source (verl's default_compute_score);
    None: an unknown data_source that a task.reward hook scores."""
    if opts.reward_kind:
        return opts.reward_kind
    if data_source == "openai/gsm8k":
        return "gsm8k"
    if data_source in VERL_MATH or data_source.startswith("aime"):
        return "math"
    if data_source in VERL_CODE:
        return "code"
    if opts.custom_reward:
        return None
    raise TaskFormatError(f"{where}: field 'data_source' {data_source!r} has no built-in reward (openai/gsm8k, "
                          f"{', '.join(VERL_MATH[:2])}, ..., {', '.join(VERL_CODE)}); set task.reward_kind "
                          f"({' | '.join(REWARD_KINDS)}) or a task.reward hook")


def verl_problem(row: Row, opts: ImportOptions) -> Problem:
    """One verl row -> Problem (id: data_source/split/index of extra_info, else its row)."""
    source = row.values.get("data_source")
    if not isinstance(source, str) or not source:
        raise TaskFormatError(f"{row.where}: field 'data_source' should be a non-empty string, got {source!r:.60}")
    key = opts.input_key or "prompt"
    messages = _prompt(row, key)
    reward_model = row.values.get("reward_model")
    if not isinstance(reward_model, dict):
        raise TaskFormatError(f"{row.where}: field 'reward_model' should be {{'style': ..., 'ground_truth': ...}}")
    info = row.values.get("extra_info") if isinstance(row.values.get("extra_info"), dict) else {}
    pid = "/".join(str(x) for x in (source, info.get("split"), info.get("index", row.index)) if x is not None)
    metadata = {k: v for k, v in row.values.items() if k != key}
    return _problem(row, pid, messages, reward_model.get("ground_truth"), verl_reward(source, row.where, opts),
                    "reward_model.ground_truth", source, metadata)


def _reward(opts: ImportOptions, label: Any) -> str | None:
    return None if label is None and opts.custom_reward else opts.reward_kind or "math"


def slime_problem(row: Row, opts: ImportOptions) -> Problem:
    """One slime row -> Problem: the prompt under input_key, the label under label_key; metadata_key's dict and
    the other columns are the metadata."""
    input_key, label_key = opts.input_key or "input", opts.label_key
    messages = _prompt(row, input_key)
    meta = row.values.get(opts.metadata_key)
    if meta is not None and not isinstance(meta, dict):
        raise TaskFormatError(f"{row.where}: field '{opts.metadata_key}' should be an object (the metadata)")
    metadata = {**{k: v for k, v in row.values.items() if k not in (input_key, opts.metadata_key)}, **(meta or {})}
    label = row.values.get(label_key) if label_key else None
    return _problem(row, row.default_id(), messages, label, _reward(opts, label), label_key or "label", "slime",
                    metadata)


def trl_problem(row: Row, opts: ImportOptions) -> Problem:
    """One TRL row -> Problem: prompt, solution (the reference); every column but the prompt is metadata."""
    input_key, label_key = opts.input_key or "prompt", opts.label_key or "solution"
    messages = _prompt(row, input_key)
    label = row.values.get(label_key)
    metadata = {k: v for k, v in row.values.items() if k != input_key}
    return _problem(row, row.default_id(), messages, label, _reward(opts, label), label_key, "trl", metadata)


def hf_problem(row: Row, opts: ImportOptions) -> Problem:
    """One row of any of the three schemas, told by its columns: reward_model and data_source: verl; prompt and
    solution (no task.input_key / label_key set): trl; else slime's keys."""
    if "reward_model" in row.values and "data_source" in row.values:
        return verl_problem(row, opts)
    if not (opts.input_key or opts.label_key) and {"prompt", "solution"} <= set(row.values):
        return trl_problem(row, opts)
    return slime_problem(row, opts)


PROBLEM_OF = {"verl": verl_problem, "slime": slime_problem, "trl": trl_problem, "hf": hf_problem}


def load_framework(kind: str, paths: str | Sequence[str], opts: ImportOptions | None = None, *,
                   split: str | None = None) -> list[Problem]:
    """The problems of ``kind`` (verl | slime | trl | hf) files or folders."""
    opts = opts or ImportOptions()
    if opts.reward_kind is not None and opts.reward_kind not in REWARD_KINDS:
        raise ValueError(f"task.reward_kind must be one of {', '.join(REWARD_KINDS)}, got {opts.reward_kind!r}")
    return [PROBLEM_OF[kind](Row(*record), opts) for record in read_records(paths, split)]
