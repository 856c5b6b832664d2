"""Trajectory records: the schema, validation, and JSONL import/export.

One record per sampled response (a JSONL line, or a row of the offline store):

    prompt_id           str | int      which prompt (groups samples of one prompt)
    prompt_tokens       [int]          non-empty
    response_tokens     [int]          non-empty
    reward              float          finite
    source              str            data source name (online / offline / mc / ...; selects the loss)
    policy_version      int >= 0       weights that sampled it
    behaviour_logprobs  [float] | None one log-prob <= 0 per response token (the sampler's)
    q0                  float | None   Monte-Carlo soft value of the prompt under the reference policy
    mc_targets          [{t, success_prob}] | None   t: 0-based response position, success_prob in [0, 1]
    provenance          {kind, model?, run_id?, temperature?, top_p?, created?, origin?} | None
                        where the trajectory came from (see Provenance); None in records written before it
    routed_experts      {tokens, layers, top_k, b64} | None   the experts the sampling engine's MoE routers chose
                        for each of the prompt + response - 1 tokens it ran (data/routes.py; routing replay)

Bad records raise RecordError naming file, line and field (a line that is not valid UTF-8 or JSON, or nested
too deeply, too; token ids must fit int32 and other integers int64, as the offline store keeps them);
with ``skip_invalid`` they are skipped, counted and reported (a warning per file and the ImportReport),
never dropped silently.
"""

from __future__ import annotations

import json
import logging
import math
import sys
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from megatron_spo.config import DuplicateKeyError, loads_json, quote
from megatron_spo.data.routes import RoutedExperts, RoutesError
from megatron_spo.fsutil import write_lines_atomic

logger = logging.getLogger(__name__)

REQUIRED_FIELDS = ("prompt_id", "prompt_tokens", "response_tokens", "reward", "source", "policy_version")
OPTIONAL_FIELDS = ("behaviour_logprobs", "q0", "mc_targets", "provenance", "routed_experts", "response_mask",
                   "turn_versions")
FIELDS = REQUIRED_FIELDS + OPTIONAL_FIELDS
LOGPROB_SLACK = 1e-4  # samplers report log-probs a hair above 0 in low precision
TOKEN_ID_LIMIT = 2**31  # the offline store keeps token ids as int32
INT_LIMIT = 2**63  # integers kept as int64 (policy_version, integer prompt ids)

# Where a trajectory came from (Provenance.kind):
PROVENANCE_KINDS = (
    "reference",       # samples of the reference policy pi_0 (estimate-q0 --trajectories-out)
    "online",          # rollouts of a training run (run_id, policy_version say which run and weights)
    "pts",             # pivotal-token-search trajectories with Monte-Carlo targets
    "human",           # human-written solutions of a dataset (CodeContests, TACO, a task's own solutions)
    "other-model",     # samples of another model (model says which), imported as text
    "offline-import",  # imported trajectories whose producer is not known more precisely
)
PROVENANCE_STRINGS = ("kind", "model", "run_id", "origin", "q0_basis")
PROVENANCE_NUMBERS = ("temperature", "top_p", "created")
PROVENANCE_FIELDS = PROVENANCE_STRINGS + PROVENANCE_NUMBERS


@dataclass(frozen=True)
class Provenance:
    """Where one trajectory came from.

    kind         one of PROVENANCE_KINDS
    model        the producing model (an HF name or checkpoint path), when known
    run_id       the training run (or import) that produced it, when known; the record's policy_version
                 says which weights of that run
    temperature  sampling temperature (>= 0), top_p sampling top-p (in (0, 1]), when known
    created      when the trajectory was produced (Unix seconds, UTC); for an import that cannot know,
                 when it was imported
    origin       a free label of the input it came from (a dataset name, a file)
    q0_basis     what the record's q0 is a soft value of: "beta=B reference=R" (data/q0.q0_basis), so a run at
                 another beta or from another reference recomputes or refuses it
    """

    kind: str
    model: str | None = None
    run_id: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    created: float | None = None
    origin: str | None = None
    q0_basis: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if v is not None}


@dataclass
class Trajectory:
    prompt_id: str | int
    prompt_tokens: list[int]
    response_tokens: list[int]
    reward: float
    source: str
    policy_version: int
    behaviour_logprobs: list[float] | None = None
    q0: float | None = None
    mc_targets: list[dict] | None = None
    provenance: Provenance | None = None
    routed_experts: RoutedExperts | None = None
    # multi-turn: 1 where the model sampled the response token (trained), 0 where the environment gave it (an
    # observation: context only, no behaviour log-prob); None: every response token is the model's
    response_mask: list[int] | None = None
    # the policy version of each model turn (a maximal run of 1s in response_mask), in order
    turn_versions: list[int] | None = None

    def to_dict(self) -> dict[str, Any]:
        """The JSON form; absent optional fields are omitted."""
        out = {k: v for k, v in asdict(self).items() if k in REQUIRED_FIELDS or v is not None}
        if self.provenance is not None:
            out["provenance"] = self.provenance.to_dict()
        if self.routed_experts is not None:
            out["routed_experts"] = self.routed_experts.to_json()
        return out


def record_tokens(record) -> int:
    """A trajectory's length in a model's context: prompt + response tokens (any object with those two lists)."""
    return len(record.prompt_tokens) + len(record.response_tokens)


class RecordError(ValueError):
    """An invalid record. ``where`` is 'file:line' (or 'store shard row'), ``field`` the offending field."""

    def __init__(self, where: str, field_name: str | None, message: str):
        self.where, self.field = where, field_name
        super().__init__(f"{where}: " + (f"field '{field_name}': " if field_name else "") + message)


@dataclass
class ImportReport:
    """What an import read: valid records, and every skipped record's error message."""

    read: int = 0
    skipped: int = 0
    errors: list[str] = field(default_factory=list)

    def add(self, other: ImportReport) -> None:
        self.read += other.read
        self.skipped += other.skipped
        self.errors += other.errors

    def print_skipped(self, what: str = "record", shown: int = 20) -> None:
        """'skipped N invalid record(s):' and the first ``shown`` errors on stderr; nothing when none was."""
        if not self.skipped:
            return
        print(f"skipped {self.skipped} invalid {what}(s):", file=sys.stderr)
        for line in self.errors[:shown]:
            print(f"  {line}", file=sys.stderr)
        if len(self.errors) > shown:
            print(f"  ... and {len(self.errors) - shown} more", file=sys.stderr)


# ---------------------------------------------------------------------------------------------
# Validation
# ---------------------------------------------------------------------------------------------
def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x: Any) -> bool:
    return (isinstance(x, (int, float)) and not isinstance(x, bool)) and math.isfinite(x)


def _tokens(obj: dict, name: str, where: str) -> list[int]:
    value = obj[name]
    if not isinstance(value, list) or not value:
        raise RecordError(where, name, f"must be a non-empty list of token ids, got {_show(value)}")
    for i, tok in enumerate(value):
        if not _is_int(tok) or not 0 <= tok < TOKEN_ID_LIMIT:
            raise RecordError(where, name, f"item {i} must be a token id (int in [0, 2^31)), got {_show(tok)}")
    return value


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def validate_provenance(obj: Any, where: str, field_name: str = "provenance") -> Provenance:
    """A Provenance from its JSON form, or RecordError naming ``where`` and ``field_name``."""
    if isinstance(obj, Provenance):
        obj = obj.to_dict()
    if not isinstance(obj, dict):
        raise RecordError(where, field_name, f"must be an object {{kind, ...}}, got {_show(obj)}")
    unknown = sorted(set(obj) - set(PROVENANCE_FIELDS))
    if unknown:
        raise RecordError(where, field_name, f"unknown key '{unknown[0]}' (known: {', '.join(PROVENANCE_FIELDS)})")
    if obj.get("kind") not in PROVENANCE_KINDS:
        raise RecordError(where, field_name, f"kind must be one of {', '.join(PROVENANCE_KINDS)}, "
                          f"got {_show(obj.get('kind'))}")
    for key in PROVENANCE_STRINGS[1:]:
        value = obj.get(key)
        if value is not None and (not isinstance(value, str) or not value):
            raise RecordError(where, field_name, f"{key} must be a non-empty string, got {_show(value)}")
    checks = {"temperature": (lambda v: v >= 0, "a finite number >= 0"),
              "top_p": (lambda v: 0 < v <= 1, "a number in (0, 1]"),
              "created": (lambda v: v >= 0, "Unix seconds >= 0")}
    for key, (ok, what) in checks.items():
        value = obj.get(key)
        if value is not None and not (_is_number(value) and ok(value)):
            raise RecordError(where, field_name, f"{key} must be {what}, got {_show(value)}")
    return Provenance(kind=obj["kind"], **{k: obj.get(k) for k in PROVENANCE_STRINGS[1:]},
                      **{k: None if obj.get(k) is None else float(obj[k]) for k in PROVENANCE_NUMBERS})


def validate_record(obj: Any, where: str) -> Trajectory:
    """A Trajectory from a parsed JSON object, or RecordError naming ``where`` and the field."""
    if not isinstance(obj, dict):
        raise RecordError(where, None, f"a record must be a JSON object, got {type(obj).__name__}")
    for name in REQUIRED_FIELDS:
        if name not in obj:
            raise RecordError(where, name, "missing")
    unknown = sorted(set(obj) - set(FIELDS))
    if unknown:
        raise RecordError(where, unknown[0], f"unknown field (known: {', '.join(FIELDS)})")
    prompt_id = obj["prompt_id"]
    if not (isinstance(prompt_id, str) or (_is_int(prompt_id) and -INT_LIMIT <= prompt_id < INT_LIMIT)):
        raise RecordError(where, "prompt_id", f"must be a string or an integer (64-bit), got {_show(prompt_id)}")
    prompt_tokens = _tokens(obj, "prompt_tokens", where)
    response_tokens = _tokens(obj, "response_tokens", where)
    if not _is_number(obj["reward"]):
        raise RecordError(where, "reward", f"must be a finite number, got {_show(obj['reward'])}")
    if not isinstance(obj["source"], str) or not obj["source"]:
        raise RecordError(where, "source", f"must be a non-empty string, got {_show(obj['source'])}")
    if not _is_int(obj["policy_version"]) or not 0 <= obj["policy_version"] < INT_LIMIT:
        raise RecordError(where, "policy_version", f"must be an integer >= 0 (and < 2^63), got {_show(obj['policy_version'])}")
    logprobs = obj.get("behaviour_logprobs")
    if logprobs is not None:
        if not isinstance(logprobs, list) or len(logprobs) != len(response_tokens):
            n = len(logprobs) if isinstance(logprobs, list) else type(logprobs).__name__
            raise RecordError(where, "behaviour_logprobs",
                              f"must hold one log-prob per response token ({len(response_tokens)}), got {n}")
        for i, lp in enumerate(logprobs):
            if not _is_number(lp) or lp > LOGPROB_SLACK:
                raise RecordError(where, "behaviour_logprobs", f"item {i} must be a finite log-prob <= 0, got {lp!r}")
    q0 = obj.get("q0")
    if q0 is not None and not _is_number(q0):
        raise RecordError(where, "q0", f"must be a finite number, got {_show(q0)}")
    mc = obj.get("mc_targets")
    if mc is not None:
        if not isinstance(mc, list):
            raise RecordError(where, "mc_targets", f"must be a list of {{t, success_prob}}, got {_show(mc)}")
        for i, item in enumerate(mc):
            if not isinstance(item, dict) or set(item) != {"t", "success_prob"}:
                raise RecordError(where, "mc_targets", f"item {i} must be {{t, success_prob}}, got {_show(item)}")
            if not _is_int(item["t"]) or not 0 <= item["t"] < len(response_tokens):
                raise RecordError(where, "mc_targets", f"item {i}: t = {item['t']!r} is not a response position "
                                  f"(0..{len(response_tokens) - 1})")
            p = item["success_prob"]
            if not _is_number(p) or not 0.0 <= p <= 1.0:
                raise RecordError(where, "mc_targets", f"item {i}: success_prob = {p!r} is not in [0, 1]")
    provenance = obj.get("provenance")
    if provenance is not None:
        provenance = validate_provenance(provenance, where)
    routes = obj.get("routed_experts")
    if routes is not None:
        try:
            routes = RoutedExperts.from_json(routes, where, len(prompt_tokens) + len(response_tokens) - 1)
        except RoutesError as err:
            raise RecordError(where, "routed_experts", err.detail) from None
    mask, versions = check_turns(obj.get("response_mask"), obj.get("turn_versions"), len(response_tokens), where)
    return Trajectory(
        prompt_id=prompt_id, prompt_tokens=prompt_tokens, response_tokens=response_tokens,
        reward=float(obj["reward"]), source=obj["source"], policy_version=obj["policy_version"],
        behaviour_logprobs=[float(x) for x in logprobs] if logprobs is not None else None,
        q0=float(q0) if q0 is not None else None,
        mc_targets=[{"t": m["t"], "success_prob": float(m["success_prob"])} for m in mc] if mc is not None else None,
        provenance=provenance, routed_experts=routes, response_mask=mask, turn_versions=versions,
    )


def model_tokens(record) -> int:
    """The response tokens the model sampled (a multi-turn record's response_mask 1s; else all of them)."""
    mask = getattr(record, "response_mask", None)
    return len(record.response_tokens) if mask is None else sum(mask)


def model_turns(mask: list[int]) -> list[tuple[int, int]]:
    """[start, end) of each model turn of a response_mask: its maximal runs of 1s."""
    turns, start = [], None
    for i, m in enumerate([*mask, 0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            turns.append((start, i))
            start = None
    return turns


def check_turns(mask: Any, versions: Any, response_length: int, where: str) -> tuple[list[int] | None, list[int] | None]:
    """A multi-turn record's response_mask (0 / 1 per response token, the first token the model's, at least one 1)
    and turn_versions (an integer >= 0 per model turn), or RecordError naming the field."""
    if mask is None:
        if versions is not None:
            raise RecordError(where, "turn_versions", "needs response_mask (which tokens are the model's turns)")
        return None, None
    if not isinstance(mask, list) or len(mask) != response_length or any(m not in (0, 1) or isinstance(m, bool)
                                                                          for m in mask):
        n = len(mask) if isinstance(mask, list) else type(mask).__name__
        raise RecordError(where, "response_mask", f"must be a 0 / 1 per response token ({response_length}), got {n}"
                          if not isinstance(mask, list) or len(mask) != response_length else
                          "must hold only 0 (environment) and 1 (model)")
    if response_length and mask[0] != 1:
        raise RecordError(where, "response_mask", "the response starts with the model's turn (the first token is 1)")
    turns = model_turns(mask)
    if versions is not None:
        if not isinstance(versions, list) or len(versions) != len(turns) or not all(
                _is_int(v) and 0 <= v < INT_LIMIT for v in versions):
            raise RecordError(where, "turn_versions", f"must be one integer >= 0 per model turn ({len(turns)}), "
                              f"got {_show(versions)}")
    return [int(m) for m in mask], None if versions is None else [int(v) for v in versions]


# ---------------------------------------------------------------------------------------------
# JSONL
# ---------------------------------------------------------------------------------------------
def iter_jsonl(path: str | Path, *, naming: bytes | None = None) -> Iterator[tuple[str, Any]]:
    """(where, value) per non-blank line of a JSONL file, where = 'file:line' and value the parsed JSON, or a
    RecordError for a line that is not valid UTF-8 or not valid JSON (the lines after it still read). ``naming``:
    only the lines holding these bytes (the others are passed over unparsed)."""
    path = Path(path)
    if path.is_dir():
        raise RecordError(str(path), None, "is a folder, not a JSONL file (an offline store is read as a folder "
                          "only where a store is expected)")
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, start=1):
            if naming is not None and naming not in raw:
                continue
            where = f"{path}:{lineno}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                yield where, RecordError(where, None, f"not valid UTF-8 (byte offset {err.start}: {err.reason})")
                continue
            if not line.strip():
                continue
            try:
                value = loads_json(line)
            except DuplicateKeyError as err:  # json.loads would keep the last value silently
                value = RecordError(where, None, f"duplicate key {quote(err.key)} (a record holds each key once)")
            except ValueError as err:
                value = RecordError(where, None, f"not valid JSON ({err})")
            except RecursionError:
                value = RecordError(where, None, "not a record: JSON nested too deeply")
            yield where, value


def iter_records_jsonl(path: str | Path, *, skip_invalid: bool = False,
                       report: ImportReport | None = None) -> Iterator[Trajectory]:
    """The records of a JSONL file, streamed; bad lines raise RecordError, or with ``skip_invalid`` are
    counted in ``report`` (when given) and skipped."""
    report = ImportReport() if report is None else report
    skipped, read = report.skipped, report.read
    for where, obj in iter_jsonl(path):
        try:
            if isinstance(obj, RecordError):
                raise obj
            record = validate_record(obj, where)
        except RecordError as err:
            if not skip_invalid:
                raise
            report.skipped += 1
            report.errors.append(str(err))
            continue
        report.read += 1
        yield record
    if report.skipped > skipped:
        logger.warning("%s: skipped %d invalid record(s), kept %d; first: %s", path, report.skipped - skipped,
                       report.read - read, report.errors[-(report.skipped - skipped)])


def read_jsonl(path: str | Path, *, skip_invalid: bool = False) -> tuple[list[Trajectory], ImportReport]:
    """All records of a JSONL file (blank lines are allowed and carry nothing)."""
    report = ImportReport()
    records = list(iter_records_jsonl(path, skip_invalid=skip_invalid, report=report))
    return records, report


def write_jsonl(records: Iterable[Trajectory | dict], path: str | Path) -> int:
    """Write records (validated) to a JSONL file atomically; returns how many."""
    count = 0

    def lines():
        nonlocal count
        for i, rec in enumerate(records):
            traj = rec if isinstance(rec, Trajectory) else validate_record(rec, f"record {i}")
            count += 1
            yield json.dumps(traj.to_dict(), allow_nan=False, separators=(",", ":")) + "\n"

    write_lines_atomic(path, lines())
    return count

