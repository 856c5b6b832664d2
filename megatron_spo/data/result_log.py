"""The resumable result file of the engine tools (estimate-q0, pts, eval): an append-only JSONL, one record per
finished item, keyed by one of its fields. Each line is flushed and fsynced when appended; a torn last line (a
write cut by a kill) is dropped on reopening; once every item is done the file is rewritten in input order, so
an interrupted-then-resumed run ends with the same file as an uninterrupted one. ItemLines: several lines per item
beside it (eval's completions), kept consistent with it on resume.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Container, Sequence
from pathlib import Path

from megatron_spo.config import DuplicateKeyError, loads_json, quote
from megatron_spo.fsutil import write_lines_atomic


def json_line(record: dict) -> str:
    """One compact JSON line (NaN and infinities refused)."""
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
                write_lines_atomic(self.path, [json_line(r) for r in self.records.values()])
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
                record = loads_json(line)
                records[key_of(record)] = record
            except DuplicateKeyError as err:  # json.loads would keep the last value silently
                raise ValueError(f"{path}:{lineno}: duplicate key {quote(err.key)} (a record holds each key once); "
                                 "fix or remove the file") from None
            except (ValueError, KeyError, TypeError):
                raise ValueError(f"{path}:{lineno}: not a result record of this tool: {line[:80]!r}; "
                                 "fix or remove the file") from None
        return records, bool(torn)

    def __contains__(self, item_key: str) -> bool:
        return item_key in self.records

    def append(self, record: dict) -> None:
        self._file.write(json_line(record))
        self._file.flush()
        os.fsync(self._file.fileno())
        self.records[self.key_of(record)] = record

    def finalize(self, order: Sequence[str]) -> bool:
        """Once every key of ``order`` is present, rewrite the file in that order (atomically). Returns
        whether the log is complete."""
        if not all(k in self.records for k in order):
            return False
        self._file.close()
        write_lines_atomic(self.path, [json_line(self.records[k]) for k in order])
        self._file = open(self.path, "a", encoding="utf-8")
        return True

    def close(self) -> None:
        self._file.close()


class ItemLines:
    """A JSONL of several lines per item beside a ResultLog (eval's completions): each item's lines are appended
    BEFORE its result record, so on reopening the lines of items without a result (a cut run) are dropped and
    none is duplicated; ``finalize`` orders the lines as the items (stable within an item)."""

    def __init__(self, path: str | Path, done: Container[str], key: str = "prompt_id"):
        self.path, self.key = Path(path), key
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if self.path.exists():
            write_lines_atomic(self.path, [ln for ln in self._lines() if self._key(ln) in done])

    def _lines(self) -> list[str]:
        """The complete lines (a torn last one dropped)."""
        return [ln + "\n" for ln in self.path.read_text(encoding="utf-8").split("\n")[:-1] if ln.strip()]

    def _key(self, line: str) -> str:
        try:
            return str(loads_json(line)[self.key])
        except (ValueError, KeyError, TypeError):
            raise ValueError(f"{self.path}: not a file of this tool: {line[:80]!r}; fix or remove the file") from None

    def add(self, records: Sequence[dict]) -> None:
        with open(self.path, "a", encoding="utf-8") as f:
            f.write("".join(json_line(r) for r in records))
            f.flush()
            os.fsync(f.fileno())

    def finalize(self, order: Sequence[str]) -> None:
        rank = {k: i for i, k in enumerate(order)}
        lines = self._lines() if self.path.exists() else []
        lines.sort(key=lambda ln: rank.get(self._key(ln), len(rank)))
        write_lines_atomic(self.path, lines)
