"""The experience store: build a training set from many stores, and see what a store holds.

    `megatron-spo offline build IN... --out STORE`   merge stores / JSONL files, keep passing trajectories,
                                                     drop duplicates per prompt, cap per source kind
    `megatron-spo offline stats IN...`               per-source counts, prompts and pass rates
    `megatron-spo offline import-text | import-codecontests | import-taco | import-expert`   (data/importers.py)

    stats = build_store(["runs/a/store", "human/"], "offline/", BuildOptions(cap={"human": 10000}))

Everything streams: inputs are read one shard (or one JSONL line) at a time, the output is written one shard at
a time into a temporary folder renamed into place at the end (a build that dies leaves no half store under the
output name). Deduplication keeps, per prompt id, the first occurrence of each response (inputs are read in the
order given), keyed by 64-bit hashes of (prompt id, response token ids) and, with a tokenizer, of (prompt id,
normalised response text): two responses with the same text but a different tokenization, or differing only in
whitespace, are one. The seen keys live in sorted numpy runs: 8 bytes per key, 16 per kept record with text
keys, so memory grows with the number of distinct kept records and nothing else (a 64-bit collision, which
would drop a record, has probability about n^2 / 2^65: 3e-8 at a million records).

Source kind = the record's provenance kind ("unknown" for records without provenance, or ``assume_kind``).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import uuid
from array import array
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from megatron_spo.cli import finite_float, positive_int
from megatron_spo.data.trajectory import (
    PROVENANCE_KINDS,
    ImportReport,
    Provenance,
    RecordError,
    Trajectory,
    iter_records_jsonl,
    record_tokens,
)

PASS_REWARD = 0.0  # megatron_spo.rewards.reward.PASS_REWARD: a passing response scores 0, a failing one -1
UNKNOWN = "unknown"
GROUP_FIELDS = ("kind", "model", "run_id", "origin", "source")


# ---------------------------------------------------------------------------------------------
# Reading inputs
# ---------------------------------------------------------------------------------------------
def iter_trajectories(paths: Iterable[str | Path], *, skip_invalid: bool = False,
                      report: ImportReport | None = None) -> Iterator[Trajectory]:
    """Records of offline stores (folders) and JSONL files, in the order given, streamed."""
    from megatron_spo.data.offline_store import iter_records

    report = ImportReport() if report is None else report
    for path in paths:
        path = Path(path)
        if path.is_dir():
            yield from iter_records(path, skip_invalid=skip_invalid, report=report)
        elif path.is_file():
            yield from iter_records_jsonl(path, skip_invalid=skip_invalid, report=report)
        else:
            raise FileNotFoundError(f"'{path}' is neither a JSONL file nor an offline store folder")


def kind_of(record: Trajectory, assume: str | None = None) -> str:
    return record.provenance.kind if record.provenance is not None else (assume or UNKNOWN)


def group_of(record: Trajectory, fields: Sequence[str], assume: str | None = None) -> tuple:
    p = record.provenance
    out = []
    for name in fields:
        if name == "kind":
            out.append(kind_of(record, assume))
        elif name == "source":
            out.append(record.source)
        else:
            out.append(getattr(p, name) if p is not None else None)
    return tuple(out)


# ---------------------------------------------------------------------------------------------
# Selection by provenance (what a training source would use)
# ---------------------------------------------------------------------------------------------
@dataclass
class ProvenanceFilter:
    """Select records by provenance: each given field must match one of its values (None = any)."""

    kinds: set[str] | None = None
    models: set[str] | None = None
    run_ids: set[str] | None = None
    assume_kind: str | None = None

    def __call__(self, record: Trajectory) -> bool:
        p = record.provenance
        if self.kinds is not None and kind_of(record, self.assume_kind) not in self.kinds:
            return False
        if self.models is not None and (p is None or p.model not in self.models):
            return False
        return self.run_ids is None or (p is not None and p.run_id in self.run_ids)


# ---------------------------------------------------------------------------------------------
# Deduplication keys
# ---------------------------------------------------------------------------------------------
def normalise_text(text: str) -> str:
    """Whitespace-insensitive form of a response: one newline style, no trailing spaces, no blank lines,
    no leading/trailing whitespace (indentation kept: it is Python's syntax)."""
    lines = (line.rstrip() for line in text.replace("\r\n", "\n").replace("\r", "\n").split("\n"))
    return "\n".join(line for line in lines if line).strip()


def _key(tag: bytes, prompt_id: Any, payload: bytes) -> int:
    pid = str(prompt_id).encode("utf-8", "surrogatepass")
    h = hashlib.blake2b(len(pid).to_bytes(8, "little"), digest_size=8, person=tag)
    h.update(pid)
    h.update(payload)
    return int.from_bytes(h.digest(), "little")


def token_key(record: Trajectory) -> int:
    """64-bit key of (prompt id, response token ids)."""
    return _key(b"tokens", record.prompt_id, array("i", record.response_tokens).tobytes())


def text_key(prompt_id: Any, text: str) -> int:
    """64-bit key of (prompt id, normalised response text)."""
    return _key(b"text", prompt_id, normalise_text(text).encode("utf-8", "surrogatepass"))


class HashSet64:
    """A set of uint64 keys in sorted numpy runs (8 bytes per key). Runs merge like a log-structured tree: at
    most log2(n) runs, each lookup a binary search per run."""

    def __init__(self):
        self.runs: list[np.ndarray] = []

    def __len__(self) -> int:
        return sum(len(r) for r in self.runs)

    def contains(self, keys: np.ndarray) -> np.ndarray:
        found = np.zeros(len(keys), dtype=bool)
        for run in self.runs:  # never empty
            pos = np.searchsorted(run, keys)
            pos[pos == len(run)] = 0
            found |= run[pos] == keys
        return found

    def add(self, keys: Iterable[int]) -> None:
        run = np.unique(np.fromiter(keys, dtype=np.uint64))
        run = run[~self.contains(run)]
        if not len(run):
            return
        self.runs.append(run)
        while len(self.runs) > 1 and len(self.runs[-2]) <= 2 * len(self.runs[-1]):
            top = self.runs.pop()
            self.runs[-1] = np.union1d(self.runs[-1], top)


# ---------------------------------------------------------------------------------------------
# build
# ---------------------------------------------------------------------------------------------
@dataclass
class BuildOptions:
    """verdict: keep "pass" (reward >= pass_reward), "fail" or "all". select: a provenance filter. cap: at
    most N records per source kind; cap_per_prompt: at most N per (prompt, kind). dedup: drop repeated
    responses per prompt (token ids, and normalised text when ``decode`` (token ids -> text) is given).
    assume_kind: the kind of records without provenance (they also get Provenance(kind=assume_kind))."""

    verdict: str = "pass"
    pass_reward: float = PASS_REWARD
    select: Callable[[Trajectory], bool] | None = None
    cap: dict[str, int] = field(default_factory=dict)
    cap_per_prompt: int | None = None
    dedup: bool = True
    decode: Callable[[list[list[int]]], list[str]] | None = None
    assume_kind: str | None = None
    batch: int = 4096


@dataclass
class KindCounts:
    read: int = 0
    passing: int = 0
    verdict_dropped: int = 0
    not_selected: int = 0
    duplicates: int = 0
    capped: int = 0
    written: int = 0
    written_passing: int = 0


@dataclass
class BuildStats:
    kinds: dict[str, KindCounts] = field(default_factory=lambda: defaultdict(KindCounts))
    report: ImportReport = field(default_factory=ImportReport)
    keys: int = 0

    def total(self) -> KindCounts:
        out = KindCounts()
        for counts in self.kinds.values():
            for name in out.__dataclass_fields__:
                setattr(out, name, getattr(out, name) + getattr(counts, name))
        return out

    def table(self) -> str:
        head = ("kind", "read", "pass rate", "verdict-", "select-", "duplicate", "capped", "written", "pass rate")
        rows = []
        for kind, c in sorted(self.kinds.items()) + [("total", self.total())]:
            rows.append((kind, c.read, _rate(c.passing, c.read), c.verdict_dropped, c.not_selected, c.duplicates,
                         c.capped, c.written, _rate(c.written_passing, c.written)))
        return _format(head, rows)


def _rate(k: int, n: int) -> str:
    return f"{k / n:.3f}" if n else "-"


def _format(head: Sequence[str], rows: Sequence[Sequence]) -> str:
    cells = [list(map(str, head))] + [[str(x) for x in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(head))]
    return "\n".join("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))
                     for row in cells)


def _batches(records: Iterable[Trajectory], n: int) -> Iterator[list[Trajectory]]:
    batch = []
    for record in records:
        batch.append(record)
        if len(batch) >= n:
            yield batch
            batch = []
    if batch:
        yield batch


def select_records(records: Iterable[Trajectory], options: BuildOptions,
                   stats: BuildStats | None = None) -> Iterator[Trajectory]:
    """The build's filter, dedup and caps over a stream of records (in order; the first occurrence wins).
    A record is a duplicate only of a record that was kept: one dropped by a cap does not shadow a later copy."""
    stats = BuildStats() if stats is None else stats
    seen = HashSet64()
    per_kind: Counter = Counter()
    per_prompt: Counter = Counter()
    if options.verdict not in ("pass", "fail", "all"):
        raise ValueError(f"verdict must be pass, fail or all, got {options.verdict!r}")
    for batch in _batches(records, options.batch):
        keep = []
        for r in batch:
            kind = kind_of(r, options.assume_kind)
            counts = stats.kinds[kind]
            counts.read += 1
            passed = r.reward >= options.pass_reward
            counts.passing += passed
            if options.verdict != "all" and passed != (options.verdict == "pass"):
                counts.verdict_dropped += 1
            elif options.select is not None and not options.select(r):
                counts.not_selected += 1
            else:
                keep.append((r, kind, passed))
        if not keep:
            continue
        keys = [[token_key(r)] for r, _, _ in keep]
        if options.dedup and options.decode is not None:
            for k, (r, _, _), text in zip(keys, keep, options.decode([r.response_tokens for r, _, _ in keep])):
                k.append(text_key(r.prompt_id, text))
        width = len(keys[0])
        flat = np.array(keys, dtype=np.uint64).reshape(-1, width)
        before = seen.contains(flat.ravel()).reshape(-1, width).any(axis=1) if options.dedup else None
        added: set[int] = set()
        for i, (r, kind, passed) in enumerate(keep):
            counts = stats.kinds[kind]
            if options.dedup and (before[i] or any(k in added for k in keys[i])):
                counts.duplicates += 1
                continue
            prompt_slot = (str(r.prompt_id), kind)
            if (kind in options.cap and per_kind[kind] >= options.cap[kind]) or (
                    options.cap_per_prompt is not None and per_prompt[prompt_slot] >= options.cap_per_prompt):
                counts.capped += 1
                continue
            per_kind[kind] += 1
            if options.cap_per_prompt is not None:
                per_prompt[prompt_slot] += 1
            if options.dedup:
                added.update(keys[i])
            if r.provenance is None and options.assume_kind is not None:
                r.provenance = Provenance(kind=options.assume_kind)
            counts.written += 1
            counts.written_passing += passed
            yield r
        seen.add(added)
        stats.keys = len(seen)


def build_store(inputs: Sequence[str | Path], out: str | Path, options: BuildOptions | None = None, *,
                skip_invalid: bool = False, rows_per_shard: int = 65536) -> BuildStats:
    """Write the selected records of ``inputs`` as a new store ``out`` (refused if it exists)."""
    from megatron_spo.data.offline_store import OfflineStoreWriter, remove_store

    options = options or BuildOptions()
    out = Path(out)
    if out.exists():
        raise FileExistsError(f"output '{out}' exists: build writes a new store (remove it, or pick another name)")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.{uuid.uuid4().hex}.building"
    stats = BuildStats()
    try:
        with OfflineStoreWriter(tmp, rows_per_shard) as writer:
            for record in select_records(iter_trajectories(inputs, skip_invalid=skip_invalid, report=stats.report),
                                         options, stats):
                writer.add(record)
        tmp.rename(out)
    except BaseException:
        if tmp.exists():
            remove_store(tmp)
        raise
    from megatron_spo.fsutil import fsync_path

    fsync_path(out.parent)
    return stats


# ---------------------------------------------------------------------------------------------
# stats
# ---------------------------------------------------------------------------------------------
@dataclass
class GroupStats:
    rows: int = 0
    passing: int = 0
    response_tokens: int = 0
    prompts: set = field(default_factory=set)
    solved: set = field(default_factory=set)

    def row(self) -> tuple:
        return (self.rows, len(self.prompts), self.passing, _rate(self.passing, self.rows), len(self.solved),
                f"{self.response_tokens / self.rows:.1f}" if self.rows else "-")


def store_stats(inputs: Sequence[str | Path], *, by: Sequence[str] = ("kind",), pass_reward: float = PASS_REWARD,
                skip_invalid: bool = False, assume_kind: str | None = None,
                report: ImportReport | None = None) -> dict[tuple, GroupStats]:
    """Per group (values of the ``by`` provenance fields): rows, distinct prompts, passing rows, prompts with a
    passing row, response length. Streams; memory is the distinct prompt ids per group."""
    groups: dict[tuple, GroupStats] = defaultdict(GroupStats)
    for r in iter_trajectories(inputs, skip_invalid=skip_invalid, report=report):
        g = groups[group_of(r, by, assume_kind)]
        g.rows += 1
        g.response_tokens += len(r.response_tokens)
        pid = str(r.prompt_id)
        g.prompts.add(pid)
        if r.reward >= pass_reward:
            g.passing += 1
            g.solved.add(pid)
    return dict(groups)


def stats_table(groups: dict[tuple, GroupStats], by: Sequence[str]) -> str:
    head = (*by, "rows", "prompts", "pass", "pass rate", "solved prompts", "mean response tokens")
    total = GroupStats()
    for g in groups.values():
        total.rows += g.rows
        total.passing += g.passing
        total.response_tokens += g.response_tokens
        total.prompts |= g.prompts
        total.solved |= g.solved
    rows = [tuple("-" if v is None else v for v in key) + g.row()
            for key, g in sorted(groups.items(), key=lambda kv: tuple(str(v) for v in kv[0]))]
    rows.append(("total",) + ("",) * (len(by) - 1) + total.row())
    return _format(head, rows)


# ---------------------------------------------------------------------------------------------
# `megatron-spo offline ...`
# ---------------------------------------------------------------------------------------------
def _caps(values: list[str], parser: argparse.ArgumentParser) -> dict[str, int]:
    caps = {}
    for value in values:
        kind, _, n = value.partition("=")
        if kind not in (*PROVENANCE_KINDS, UNKNOWN) or not n.isdigit():
            parser.error(f"--cap {value!r}: expected KIND=N with KIND one of {', '.join(PROVENANCE_KINDS)}, {UNKNOWN}")
        caps[kind] = int(n)
    return caps


def _split(value: str | None) -> set[str] | None:
    return None if value is None else {v for v in value.split(",") if v}


def main(argv: list[str]) -> int:
    from megatron_spo.checkpoint_digest import set_verify, verify_enabled
    from megatron_spo.data import importers

    parser = argparse.ArgumentParser(prog="megatron-spo offline",
                                     description="The experience store: import trajectories from any source, "
                                                 "build training sets, print what a store holds.")
    sub = parser.add_subparsers(dest="op", required=True)
    importers.add_import_args(sub, "import-text", "text responses of any producer (JSONL) -> store, re-scored")
    importers.add_import_args(sub, "import-codecontests", "Python 3 solutions of CodeContests rows -> store")
    importers.add_import_args(sub, "import-taco", "solutions of TACO rows -> store")
    importers.add_import_args(sub, "import-expert", "expert solutions of a generated task (data/expert.py) -> store")

    b = sub.add_parser("build", help="merge, filter, deduplicate and balance stores into a new store")
    b.add_argument("inputs", nargs="+", help="stores and JSONL files, read in this order (the first copy wins)")
    b.add_argument("--out", required=True, help="the new store")
    b.add_argument("--verdict", default="pass", choices=["pass", "fail", "all"],
                   help="keep passing (reward >= --pass-reward), failing, or all records")
    b.add_argument("--pass-reward", type=finite_float, default=PASS_REWARD,
                   help=f"a record passes when its reward is at least this (default {PASS_REWARD})")
    b.add_argument("--kind", default=None, help="only these provenance kinds (comma-separated)")
    b.add_argument("--model", default=None, help="only these producing models (comma-separated)")
    b.add_argument("--run-id", default=None, help="only these runs (comma-separated)")
    b.add_argument("--cap", action="append", default=[], metavar="KIND=N", help="at most N records of a kind")
    b.add_argument("--cap-per-prompt", type=positive_int, default=None, help="at most N records per prompt and kind")
    b.add_argument("--max-tokens", type=positive_int, default=None,
                   help="only records of at most N tokens, prompt + response (the trainer's batch.max_seq_length)")
    b.add_argument("--no-dedup", action="store_true")
    b.add_argument("--tokenizer", default=None,
                   help="the policy's tokenizer: also deduplicate on normalised response text")
    b.add_argument("--assume-kind", default=None, choices=PROVENANCE_KINDS,
                   help="provenance kind of records that have none (stores written before provenance)")
    b.add_argument("--rows-per-shard", type=positive_int, default=65536, help="records per shard")

    s = sub.add_parser("stats", help="per-source counts, prompts and pass rates of stores / JSONL files")
    s.add_argument("inputs", nargs="+")
    s.add_argument("--by", default="kind", help=f"group by these fields (comma-separated: {', '.join(GROUP_FIELDS)})")
    s.add_argument("--pass-reward", type=finite_float, default=PASS_REWARD,
                   help=f"a record passes when its reward is at least this (default {PASS_REWARD})")
    s.add_argument("--assume-kind", default=None, choices=PROVENANCE_KINDS)
    s.add_argument("--json", action="store_true", help="print JSON instead of a table")
    for p in (b, s):
        p.add_argument("--skip-invalid", action="store_true", help="skip bad records (counted and reported)")
        p.add_argument("--no-verify", action="store_true",
                       help="do not compare store files with their checksums (for a store you edited yourself); a "
                       "mismatch is otherwise refused naming the file")
    args = parser.parse_args(argv)

    if args.op.startswith("import-"):
        return importers.run_import_command(args)
    verify = verify_enabled()
    set_verify(verify and not getattr(args, "no_verify", False))
    try:
        if args.op == "build":
            decode = None
            if args.tokenizer and not args.no_dedup:
                tok = importers.load_tokenizer(args.tokenizer)

                def decode(batch):
                    return tok.batch_decode(batch, skip_special_tokens=True)

            select = ProvenanceFilter(_split(args.kind), _split(args.model), _split(args.run_id), args.assume_kind)
            if args.max_tokens is not None:
                provenance, limit = select, args.max_tokens

                def select(r: Trajectory) -> bool:
                    return record_tokens(r) <= limit and provenance(r)

            options = BuildOptions(verdict=args.verdict, pass_reward=args.pass_reward, select=select,
                                   cap=_caps(args.cap, parser), cap_per_prompt=args.cap_per_prompt,
                                   dedup=not args.no_dedup, decode=decode, assume_kind=args.assume_kind)
            stats = build_store(args.inputs, args.out, options, skip_invalid=args.skip_invalid,
                                rows_per_shard=args.rows_per_shard)
            print(stats.table())
            print(f"wrote {stats.total().written} records to {args.out}")
            report = stats.report
        else:
            by = [f.strip() for f in args.by.split(",") if f.strip()]
            bad = [f for f in by if f not in GROUP_FIELDS]
            if bad or not by:
                parser.error(f"--by: fields are {', '.join(GROUP_FIELDS)}")
            report = ImportReport()
            groups = store_stats(args.inputs, by=by, pass_reward=args.pass_reward, skip_invalid=args.skip_invalid,
                                 assume_kind=args.assume_kind, report=report)
            if args.json:
                print(json.dumps([dict(zip(by, key)) | {"rows": g.rows, "prompts": len(g.prompts), "pass": g.passing,
                                                         "solved_prompts": len(g.solved)}
                                  for key, g in sorted(groups.items(), key=lambda kv: str(kv[0]))]))
            else:
                print(stats_table(groups, by))
    except (RecordError, FileNotFoundError, FileExistsError, ValueError) as err:
        print(f"megatron-spo offline {args.op}: {err}", file=sys.stderr)
        return 1
    finally:
        set_verify(verify)
    report.print_skipped()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
