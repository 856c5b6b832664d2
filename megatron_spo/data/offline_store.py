"""The offline trajectory store: columnar shards of numpy arrays plus a checksummed index.

    write_store(records, "store/", rows_per_shard=65536)           # or OfflineStoreWriter to append
    store = OfflineStore("store/")                                 # verifies every shard it lists
    records = store.trajectories()                                 # the trainer reads through OfflineCursor

Layout of a store folder:

    index.json            {"format", "version", "shards": [{"name", "rows", "files": {file: sha256}}]}
    shard-00000/          one .npy per column, variable-length columns as flat values + offsets [rows + 1]:
        prompt_tokens.npy int32, prompt_offsets.npy int64, response_tokens.npy int32, response_offsets.npy,
        behaviour_logprobs.npy float64 + behaviour_offsets.npy + has_behaviour.npy uint8,
        reward.npy float64, policy_version.npy int64, q0.npy float64 (NaN = absent),
        mc_t.npy int64 + mc_p.npy float64 + mc_offsets.npy + has_mc.npy uint8,
        provenance_id.npy int32 (row -> strings.json "provenance" entry, -1 = none),
        temperature.npy, top_p.npy, created.npy float64 (NaN = unknown)          [version 2 shards]
        strings.json      {"prompt_id": [...], "source": [...],
                           "provenance": [{kind, model?, run_id?, origin?}, ...]}  [version 2 shards]
        routes.npy        every routed row's expert ids [prompt + response - 1, layers, top_k] flattened, in the
                          smallest of uint8 / uint16 / int32 that holds the shard's ids (4x smaller than the
                          engine's int32 for up to 256 experts), routes_offsets.npy int64 [rows + 1],
                          routes_shape.npy int32 [rows, 2] = (layers, top_k), (0, 0) = no routes  [version 3 shards]

        response_mask.npy uint8 per response token (1 = the model's, 0 = the environment's) + has_mask.npy uint8,
        turn_versions.npy int64 + turn_offsets.npy int64 [rows + 1]: multi-turn records  [with turns]

A shard holds the turn columns only when one of its records is multi-turn (a response_mask; the index's version 4),
whatever its version otherwise. A shard holds the route columns (version 3) only when one of its records carries routed_experts (rollout
routing replay, data/routes.py): a store of dense-model trajectories stays version 2. Routes read back
bit-exactly (the same int32 ids, the same base64) and are checked on read like a trajectory file's: a row whose
ids do not fill prompt + response - 1 tokens x layers x top_k is invalid, naming the row and field.

Version 1 (before provenance) shards have neither the provenance columns nor the "provenance" strings;
they still read (provenance None) and may share a store with version 2 shards: an append to a version 1
store writes version 2 shards and lists them in a version 2 index.

Writes are atomic: a shard is written into a temporary folder, fsynced, renamed, and only then listed in a
new index.json (itself written to a temporary file and renamed). A shard that is not in the index (an
interrupted write) is ignored with a warning; a listed shard whose files do not match their checksums or
shapes is an error naming the shard and file (``skip_invalid`` skips it, counted and reported). The checksums are
the store's digest manifest (checkpoint_digest.py): ``verify=False`` (`--no-verify`, checkpoint.verify=false) reads
a user's own hand-edited shards without comparing them.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import re
import shutil
import uuid
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np

from megatron_spo.checkpoint_digest import SKIP_HINT, digest_files, verify_enabled
from megatron_spo.config import DuplicateKeyError, loads_json
from megatron_spo.data.routes import RoutedExperts
from megatron_spo.data.trajectory import (
    LOGPROB_SLACK,
    PROVENANCE_NUMBERS,
    PROVENANCE_STRINGS,
    ImportReport,
    Provenance,
    RecordError,
    Trajectory,
    check_turns,
    iter_jsonl,
    read_jsonl,
    record_tokens,
    validate_provenance,
    validate_record,
)
from megatron_spo.fsutil import fsync_path, write_text_atomic

logger = logging.getLogger(__name__)

FORMAT, VERSION = "megatron-spo-offline-store", 3
BASE_VERSION = 2  # what a shard without routes is written as (readable by code before version 3)
TURNS_VERSION = 4  # an index with a multi-turn shard (readable only by code that knows the turn columns)
READABLE_VERSIONS = (1, 2, 3, 4)
INDEX = "index.json"
STRINGS = "strings.json"
# column -> dtype; "<name>_offsets" columns index the variable-length ones
COLUMNS_V1 = {
    "prompt_tokens": np.int32, "prompt_offsets": np.int64,
    "response_tokens": np.int32, "response_offsets": np.int64,
    "behaviour_logprobs": np.float64, "behaviour_offsets": np.int64, "has_behaviour": np.uint8,
    "reward": np.float64, "policy_version": np.int64, "q0": np.float64,
    "mc_t": np.int64, "mc_p": np.float64, "mc_offsets": np.int64, "has_mc": np.uint8,
}
PROVENANCE_COLUMNS = {"provenance_id": np.int32, "temperature": np.float64, "top_p": np.float64,
                      "created": np.float64}
COLUMNS = {**COLUMNS_V1, **PROVENANCE_COLUMNS}
ROUTE_FILES = {"routes.npy", "routes_offsets.npy", "routes_shape.npy"}
ROUTE_DTYPES = (np.uint8, np.uint16, np.int32)  # routes.npy: the smallest holding the shard's ids
SHARD_FILES = {1: {f"{c}.npy" for c in COLUMNS_V1} | {STRINGS}, 2: {f"{c}.npy" for c in COLUMNS} | {STRINGS}}
SHARD_FILES[3] = SHARD_FILES[2] | ROUTE_FILES
TURN_COLUMNS = {"response_mask": np.uint8, "has_mask": np.uint8, "turn_versions": np.int64, "turn_offsets": np.int64}
TURN_FILES = {f"{c}.npy" for c in TURN_COLUMNS}
RAGGED = {"prompt_tokens": "prompt_offsets", "response_tokens": "response_offsets",
          "behaviour_logprobs": "behaviour_offsets", "mc_t": "mc_offsets", "mc_p": "mc_offsets"}
PER_ROW = ("has_behaviour", "reward", "policy_version", "q0", "has_mc")


def _write_json_atomic(path: Path, obj) -> None:
    write_text_atomic(path, json.dumps(obj, indent=1))


# ---------------------------------------------------------------------------------------------
# Writing
# ---------------------------------------------------------------------------------------------
def _columns(records: list[Trajectory]) -> tuple[dict[str, np.ndarray], list[dict]]:
    """The shard's columns, and its provenance table (distinct {kind, model, run_id, origin})."""
    def ragged(lists: list[list]) -> tuple[np.ndarray, np.ndarray]:
        offsets = np.zeros(len(lists) + 1, dtype=np.int64)
        np.cumsum([len(x) for x in lists], out=offsets[1:])
        flat = [v for x in lists for v in x]
        return np.asarray(flat), offsets

    cols: dict[str, np.ndarray] = {}
    cols["prompt_tokens"], cols["prompt_offsets"] = ragged([r.prompt_tokens for r in records])
    cols["response_tokens"], cols["response_offsets"] = ragged([r.response_tokens for r in records])
    cols["behaviour_logprobs"], cols["behaviour_offsets"] = ragged([r.behaviour_logprobs or [] for r in records])
    cols["has_behaviour"] = np.array([r.behaviour_logprobs is not None for r in records])
    cols["reward"] = np.array([r.reward for r in records])
    cols["policy_version"] = np.array([r.policy_version for r in records])
    cols["q0"] = np.array([np.nan if r.q0 is None else r.q0 for r in records])
    mc = [r.mc_targets or [] for r in records]
    cols["mc_t"], cols["mc_offsets"] = ragged([[m["t"] for m in x] for x in mc])
    cols["mc_p"], _ = ragged([[m["success_prob"] for m in x] for x in mc])
    cols["has_mc"] = np.array([r.mc_targets is not None for r in records])
    table: dict[tuple, int] = {}
    ids = []
    for r in records:
        p = r.provenance
        ids.append(-1 if p is None else table.setdefault(tuple(getattr(p, k) for k in PROVENANCE_STRINGS), len(table)))
    cols["provenance_id"] = np.array(ids)
    for name in PROVENANCE_NUMBERS:
        cols[name] = np.array([np.nan if r.provenance is None or getattr(r.provenance, name) is None
                               else getattr(r.provenance, name) for r in records], dtype=np.float64)
    for name in ("prompt_tokens", "response_tokens"):
        if cols[name].size and cols[name].max() > np.iinfo(np.int32).max:
            raise StoreError(f"offline store: a token id in '{name}' does not fit int32")
    provenance = [{k: v for k, v in zip(PROVENANCE_STRINGS, key) if v is not None} for key in table]
    return {name: cols[name].astype(dtype, copy=False) for name, dtype in COLUMNS.items()}, provenance


def _turn_columns(records: list[Trajectory]) -> dict[str, np.ndarray] | None:
    """response_mask / has_mask / turn_versions / turn_offsets of a shard, None when no record is multi-turn."""
    masks = [getattr(r, "response_mask", None) for r in records]
    if all(m is None for m in masks):
        return None
    versions = [getattr(r, "turn_versions", None) or [] for r in records]
    offsets = np.zeros(len(records) + 1, dtype=np.int64)
    np.cumsum([len(v) for v in versions], out=offsets[1:])
    mask = [m if m is not None else [1] * len(r.response_tokens) for r, m in zip(records, masks)]
    return {"response_mask": np.array([x for m in mask for x in m], dtype=np.uint8),
            "has_mask": np.array([m is not None for m in masks], dtype=np.uint8),
            "turn_versions": np.array([x for v in versions for x in v], dtype=np.int64), "turn_offsets": offsets}


def _route_columns(records: list[Trajectory], first: int = 0) -> dict[str, np.ndarray] | None:
    """routes / routes_offsets / routes_shape of a shard (module docstring), None when no record has routes;
    ``first``: the writer's number of the first record (for errors)."""
    routes = [getattr(r, "routed_experts", None) for r in records]
    if all(x is None for x in routes):
        return None
    for i, (r, x) in enumerate(zip(records, routes)):
        positions = record_tokens(r) - 1
        if x is not None and x.tokens != positions:
            raise StoreError(f"offline store: record {first + i} (prompt_id {r.prompt_id!r}): field 'routed_experts': routes "
                             f"for {x.tokens} tokens, but prompt + response - 1 = {positions} tokens went through the "
                             "model")
    arrays = [np.zeros(0, np.int32) if x is None else x.array().reshape(-1) for x in routes]
    offsets = np.zeros(len(records) + 1, dtype=np.int64)
    np.cumsum([a.size for a in arrays], out=offsets[1:])
    flat = np.concatenate(arrays)
    low, high = (int(flat.min()), int(flat.max())) if flat.size else (0, 0)
    dtype = next(d for d in ROUTE_DTYPES if np.iinfo(d).min <= low and high <= np.iinfo(d).max)
    shape = np.array([(0, 0) if x is None else (x.layers, x.top_k) for x in routes], dtype=np.int32).reshape(-1, 2)
    return {"routes": flat.astype(dtype), "routes_offsets": offsets, "routes_shape": shape}


class StoreError(ValueError):
    """A store that cannot be written or read as asked (a path that is a file, a bad setting); one line."""


class OfflineStoreWriter:
    """Appends shards to a store folder (created if absent). Use as a context manager, or call close()."""

    def __init__(self, path: str | Path, rows_per_shard: int = 65536):
        if isinstance(rows_per_shard, bool) or not isinstance(rows_per_shard, int) or rows_per_shard < 1:
            raise StoreError(f"offline store: rows per shard must be an integer >= 1, got {rows_per_shard!r}")
        self.path = Path(path)
        if self.path.exists() and not self.path.is_dir():
            raise StoreError(f"offline store: '{self.path}' is a file, not a store folder")
        self.rows_per_shard = rows_per_shard
        self.path.mkdir(parents=True, exist_ok=True)
        self.index = _read_index(self.path) if (self.path / INDEX).exists() else {
            "format": FORMAT, "version": BASE_VERSION, "shards": []}
        self.buffer: list[Trajectory] = []
        self.written = 0

    def add(self, record: Trajectory | dict) -> None:
        if not isinstance(record, Trajectory):
            record = validate_record(record, f"record {self.written + len(self.buffer)}")
        self.buffer.append(record)
        if len(self.buffer) >= self.rows_per_shard:
            self.flush()

    def flush(self) -> None:
        """Write the buffered records as one shard and list it in the index."""
        if not self.buffer:
            return
        name = f"shard-{len(self.index['shards']):05d}"
        while (self.path / name).exists():  # a leftover of an interrupted write: never overwrite it
            name += "x"
        columns, provenance = _columns(self.buffer)  # before any file: a record that cannot be stored leaves none
        routes = _route_columns(self.buffer, self.written)
        if routes is not None:
            columns = {**columns, **routes}
        turns = _turn_columns(self.buffer)
        if turns is not None:
            columns = {**columns, **turns}
        tmp = self.path / f".{name}.{uuid.uuid4().hex}.tmp"
        tmp.mkdir()
        try:
            files = self._write_shard(tmp, columns, provenance)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        os.rename(tmp, self.path / name)
        fsync_path(self.path)
        # a version 1 store with a version 2 shard (or any with a version 3 one) reads only with this code
        self.index["version"] = max(self.index["version"], TURNS_VERSION if turns is not None else
                                    VERSION if routes is not None else BASE_VERSION)
        self.index["shards"].append({"name": name, "rows": len(self.buffer), "files": files})
        _write_json_atomic(self.path / INDEX, self.index)
        self.written += len(self.buffer)
        self.buffer = []

    def _write_shard(self, tmp: Path, columns: dict, provenance: list) -> dict[str, str]:
        """The shard's files in ``tmp``, fsync'd; returns {file: sha256}."""
        for col, array in columns.items():
            with open(tmp / f"{col}.npy", "wb") as f:
                np.save(f, array, allow_pickle=False)
                f.flush()
                os.fsync(f.fileno())
        with open(tmp / STRINGS, "w", encoding="utf-8") as f:
            json.dump({"prompt_id": [r.prompt_id for r in self.buffer], "source": [r.source for r in self.buffer],
                       "provenance": provenance}, f)
            f.flush()
            os.fsync(f.fileno())
        files = {file: digest for file, (_, digest) in digest_files(tmp, os.listdir(tmp), "sha256").items()}
        fsync_path(tmp)
        return files

    def close(self) -> None:
        self.flush()
        if not (self.path / INDEX).exists():
            _write_json_atomic(self.path / INDEX, self.index)

    def __enter__(self) -> OfflineStoreWriter:
        return self

    def __exit__(self, exc_type, *_) -> None:
        if exc_type is None:
            self.close()


def write_store(records: Iterable[Trajectory | dict], path: str | Path, rows_per_shard: int = 65536) -> int:
    with OfflineStoreWriter(path, rows_per_shard) as writer:
        for record in records:
            writer.add(record)
    return writer.written


# ---------------------------------------------------------------------------------------------
# Reading
# ---------------------------------------------------------------------------------------------
def _read_index(path: Path) -> dict:
    where = str(path / INDEX)
    if path.exists() and not path.is_dir():
        raise StoreError(f"offline store: '{path}' is a file, not a store folder")
    try:
        index = loads_json((path / INDEX).read_text())
    except DuplicateKeyError as err:
        raise RecordError(where, None, f"not valid JSON ({err})") from None
    except RecursionError:
        raise RecordError(where, None, "not valid JSON (nested too deeply)") from None
    except FileNotFoundError:
        raise FileNotFoundError(f"offline store: {where} not found (not a store folder, or nothing written)") from None
    except ValueError as err:
        raise RecordError(where, None, f"not valid JSON ({err})") from None
    if not isinstance(index, dict) or index.get("format") != FORMAT:
        raise RecordError(where, "format", f"not a megatron-spo offline store index (format {FORMAT!r} expected)")
    if index.get("version") not in READABLE_VERSIONS:
        raise RecordError(where, "version", f"version {index.get('version')!r} is not supported (this code reads "
                          f"{', '.join(map(str, READABLE_VERSIONS))})")
    if not isinstance(index.get("shards"), list):
        raise RecordError(where, "shards", "must be a list")
    return index


SHARD_NAME = re.compile(r"shard-\d{5,}x*")  # what OfflineStoreWriter names them


class _Shard:
    """One verified shard: memory-mapped columns, its strings and provenance table (version 1 shards: none)."""

    def __init__(self, root: Path, entry: dict, verify: bool = True):
        self.name = str(entry.get("name"))[:80] if isinstance(entry, dict) else "?"
        self.rows = entry.get("rows") if isinstance(entry, dict) else None
        where = f"{root / self.name}"
        files = entry.get("files") if isinstance(entry, dict) else None
        if not isinstance(self.rows, int) or isinstance(self.rows, bool) or self.rows < 0 or not isinstance(files, dict):
            raise RecordError(str(root / INDEX), "shards", f"entry {self.name!r} lacks rows (an integer >= 0) / files")
        if not SHARD_NAME.fullmatch(self.name):  # a name like ../../x would read files outside the store
            raise RecordError(str(root / INDEX), "shards", f"entry {self.name!r} is not a shard folder name")
        self.turns = TURN_FILES <= set(files)  # multi-turn columns beside any version's
        base = set(files) - TURN_FILES if self.turns else set(files)
        self.version = next((v for v, expected in SHARD_FILES.items() if base == expected), None)
        if self.version is None:
            expected = SHARD_FILES[VERSION]
            missing = sorted(expected - set(files)) or sorted(set(files) - expected)
            raise RecordError(where, missing[0], "the index lists a different set of files")
        for file in sorted(files):
            if not (root / self.name / file).is_file():
                raise RecordError(where, file, "missing (half-written or deleted shard)")
        found = digest_files(root / self.name, files, "sha256") if verify else {}
        for file, (_, digest) in sorted(found.items()):
            if digest != files[file]:
                raise RecordError(where, file, f"checksum mismatch (expected sha256 {str(files[file])[:16]}, found "
                                  f"{digest[:16]}): the file is corrupt or was edited; {SKIP_HINT}")
        names = [*(COLUMNS if self.version >= 2 else COLUMNS_V1), *(
            f.removesuffix(".npy") for f in sorted(ROUTE_FILES) if self.version >= 3), *(
            TURN_COLUMNS if self.turns else ())]
        self.cols = {}
        for c in names:
            try:
                self.cols[c] = np.load(root / self.name / f"{c}.npy", mmap_mode="r", allow_pickle=False)
            except (ValueError, OSError, EOFError) as err:  # not an .npy, or one of objects (pickles)
                raise RecordError(where, f"{c}.npy", f"not a plain numpy array file ({str(err)[:80]})") from None
        try:
            strings = loads_json((root / self.name / STRINGS).read_text(encoding="utf-8"))
            self.prompt_ids, self.sources = strings["prompt_id"], strings["source"]
            table = strings["provenance"] if self.version >= 2 else []
        except (ValueError, KeyError, TypeError, RecursionError) as err:
            raise RecordError(where, STRINGS, f"not the strings of a version {self.version} shard ({err!r})") from None
        if not isinstance(table, list):
            raise RecordError(where, STRINGS, "'provenance' must be a list")
        self.provenance_table = [validate_provenance(e, where, f"{STRINGS} provenance {i}")
                                 for i, e in enumerate(table)]
        if any(p.temperature is not None or p.top_p is not None or p.created is not None
               for p in self.provenance_table):
            raise RecordError(where, STRINGS, "provenance entries hold only kind, model, run_id, origin")
        if self.version < 2:  # no provenance: every row reads as None
            self.cols["provenance_id"] = np.full(self.rows, -1, dtype=np.int32)
            for name in PROVENANCE_NUMBERS:
                self.cols[name] = np.full(self.rows, np.nan)
        if self.version < 3:  # no routes: every row routes itself
            self.cols["routes"] = np.zeros(0, dtype=np.int32)
            self.cols["routes_offsets"] = np.zeros(self.rows + 1, dtype=np.int64)
            self.cols["routes_shape"] = np.zeros((self.rows, 2), dtype=np.int32)
        if not self.turns:  # single-turn records
            self.cols["has_mask"] = np.zeros(self.rows, dtype=np.uint8)
            self.cols["response_mask"] = np.zeros(0, dtype=np.uint8)
            self.cols["turn_versions"] = np.zeros(0, dtype=np.int64)
            self.cols["turn_offsets"] = np.zeros(self.rows + 1, dtype=np.int64)
        self._check_shapes(where)

    def _check_shapes(self, where: str) -> None:
        for c, dtype in COLUMNS.items():
            if self.cols[c].dtype != dtype or self.cols[c].ndim != 1:
                raise RecordError(where, f"{c}.npy", f"expected a 1-d {np.dtype(dtype)} array")
        for c in (*PER_ROW, *PROVENANCE_COLUMNS):
            if len(self.cols[c]) != self.rows:
                raise RecordError(where, f"{c}.npy", f"has {len(self.cols[c])} rows, the index says {self.rows}")
        if (not isinstance(self.prompt_ids, list) or not isinstance(self.sources, list)
                or len(self.prompt_ids) != self.rows or len(self.sources) != self.rows):
            raise RecordError(where, STRINGS, f"does not hold {self.rows} prompt ids and sources")
        for row, (pid, source) in enumerate(zip(self.prompt_ids, self.sources)):
            if not (isinstance(pid, str) or (type(pid) is int and -2**63 <= pid < 2**63)):
                raise RecordError(where, STRINGS, f"row {row}: prompt_id must be a string or an integer, got "
                                  f"{type(pid).__name__}")
            if not isinstance(source, str) or not source:
                raise RecordError(where, STRINGS, f"row {row}: source must be a non-empty string")
        if self.cols["routes"].dtype not in ROUTE_DTYPES or self.cols["routes"].ndim != 1:
            raise RecordError(where, "routes.npy", "expected a 1-d uint8, uint16 or int32 array")
        if self.cols["routes_offsets"].dtype != np.int64 or self.cols["routes_offsets"].ndim != 1:
            raise RecordError(where, "routes_offsets.npy", "expected a 1-d int64 array")
        if self.cols["routes_shape"].dtype != np.int32 or self.cols["routes_shape"].shape != (self.rows, 2):
            raise RecordError(where, "routes_shape.npy", f"expected an int32 array [{self.rows}, 2] (layers, top_k)")
        for c, dtype in TURN_COLUMNS.items():
            if self.cols[c].dtype != dtype or self.cols[c].ndim != 1:
                raise RecordError(where, f"{c}.npy", f"expected a 1-d {np.dtype(dtype)} array")
        if len(self.cols["has_mask"]) != self.rows:
            raise RecordError(where, "has_mask.npy", f"has {len(self.cols['has_mask'])} rows, the index says {self.rows}")
        if self.turns and len(self.cols["response_mask"]) != len(self.cols["response_tokens"]):
            raise RecordError(where, "response_mask.npy", "does not hold one 0 / 1 per response token")
        for values, offsets in {**RAGGED, "routes": "routes_offsets", "turn_versions": "turn_offsets"}.items():
            off = self.cols[offsets]
            if len(off) != self.rows + 1 or off[0] != 0 or np.any(np.diff(off) < 0) or off[-1] != len(self.cols[values]):
                raise RecordError(where, f"{offsets}.npy", f"offsets do not index {values}.npy")

    def provenance(self, row: int) -> Provenance | None:
        k = int(self.cols["provenance_id"][row])
        if k < 0:
            return None
        numbers = {n: None if np.isnan(v := float(self.cols[n][row])) else v for n in PROVENANCE_NUMBERS}
        return dataclasses.replace(self.provenance_table[k], **numbers)

    def records(self, rows: Iterable[int] | None = None) -> Iterator[Trajectory]:
        """The shard's records (``rows``, or all), converted column-wise: far faster than record() per row."""
        c = self.cols
        lists = {name: np.asarray(c[name]).tolist() for name in RAGGED}
        off = {name: np.asarray(c[name]).tolist() for name in set(RAGGED.values())}
        per_row = {name: np.asarray(c[name]).tolist() for name in (*PER_ROW, *PROVENANCE_COLUMNS)}
        table = self.provenance_table

        def cut(name: str, r: int) -> list:
            o = off[RAGGED[name]]
            return lists[name][o[r] : o[r + 1]]

        ids, temperature, top_p, created = (per_row[n] for n in ("provenance_id", *PROVENANCE_NUMBERS))
        cache: dict[tuple, Provenance] = {}  # Provenance is frozen: rows with equal values share one

        def known(x: float) -> float | None:
            return None if math.isnan(x) else x

        routed = self.cols["routes_shape"][:, 0] > 0
        for r in range(self.rows) if rows is None else rows:
            q0, k = per_row["q0"][r], ids[r]
            provenance = None
            if k >= 0:
                key = (k, known(temperature[r]), known(top_p[r]), known(created[r]))
                provenance = cache.get(key)
                if provenance is None:
                    if len(cache) > 4096:
                        cache.clear()
                    provenance = cache[key] = dataclasses.replace(table[k], temperature=key[1], top_p=key[2],
                                                                  created=key[3])
            yield Trajectory(
                prompt_id=self.prompt_ids[r], prompt_tokens=cut("prompt_tokens", r),
                response_tokens=cut("response_tokens", r), reward=per_row["reward"][r], source=self.sources[r],
                policy_version=per_row["policy_version"][r],
                behaviour_logprobs=cut("behaviour_logprobs", r) if per_row["has_behaviour"][r] else None,
                q0=None if math.isnan(q0) else q0,
                mc_targets=[{"t": t, "success_prob": p} for t, p in zip(cut("mc_t", r), cut("mc_p", r))]
                if per_row["has_mc"][r] else None,
                provenance=provenance, routed_experts=self.routes(r) if routed[r] else None,
                **self.turns_of(r),
            )

    def record(self, r: int) -> Trajectory:
        """Row ``r`` alone (records() converts a whole shard's columns at once: faster for many rows)."""
        c = self.cols
        mc = None
        if c["has_mc"][r]:
            mc = [{"t": int(t), "success_prob": float(p)} for t, p in zip(self.slice("mc_t", r), self.slice("mc_p", r))]
        q0 = float(c["q0"][r])
        return Trajectory(
            prompt_id=self.prompt_ids[r], prompt_tokens=self.slice("prompt_tokens", r).tolist(),
            response_tokens=self.slice("response_tokens", r).tolist(), reward=float(c["reward"][r]),
            source=self.sources[r], policy_version=int(c["policy_version"][r]),
            behaviour_logprobs=self.slice("behaviour_logprobs", r).tolist() if c["has_behaviour"][r] else None,
            q0=None if np.isnan(q0) else q0, mc_targets=mc, provenance=self.provenance(r),
            routed_experts=self.routes(r), **self.turns_of(r),
        )

    def turns_of(self, row: int) -> dict:
        """{response_mask, turn_versions} of a multi-turn row ({} for a single-turn one)."""
        if not self.cols["has_mask"][row]:
            return {}
        off = self.cols["response_offsets"]
        toff = self.cols["turn_offsets"]
        versions = self.cols["turn_versions"][toff[row]:toff[row + 1]].tolist()
        return {"response_mask": self.cols["response_mask"][off[row]:off[row + 1]].tolist(),
                "turn_versions": versions or None}

    def routes(self, row: int) -> RoutedExperts | None:
        """The row's routed_experts (int32 ids [prompt + response - 1, layers, top_k]), None if it has none."""
        layers, top_k = (int(x) for x in self.cols["routes_shape"][row])
        if layers == 0:
            return None
        ids = self.slice("routes", row).astype(np.int32)
        return RoutedExperts.from_array(ids.reshape(-1, layers, top_k))

    def slice(self, name: str, row: int) -> np.ndarray:
        off = self.cols[RAGGED.get(name, "routes_offsets")]
        return self.cols[name][off[row] : off[row + 1]]

    def invalid_rows(self) -> list[tuple[int, str, str]]:
        """(row, field, why) for rows whose values break the record schema (vectorised checks)."""
        c, bad = self.cols, []

        def flag(mask: np.ndarray, field: str, why: str) -> None:
            bad.extend((int(r), field, why) for r in np.flatnonzero(mask))

        def per_row(name: str, values_bad: np.ndarray) -> np.ndarray:
            off = c[RAGGED[name]]
            rows = np.searchsorted(off, np.flatnonzero(values_bad), side="right") - 1
            return np.isin(np.arange(self.rows), rows)

        lengths = {n: np.diff(c[RAGGED[n]]) for n in ("prompt_tokens", "response_tokens", "behaviour_logprobs")}
        flag(lengths["prompt_tokens"] == 0, "prompt_tokens", "empty")
        flag(lengths["response_tokens"] == 0, "response_tokens", "empty")
        flag(per_row("prompt_tokens", c["prompt_tokens"] < 0), "prompt_tokens", "negative token id")
        flag(per_row("response_tokens", c["response_tokens"] < 0), "response_tokens", "negative token id")
        flag(~np.isfinite(c["reward"]), "reward", "not finite")
        flag(c["policy_version"] < 0, "policy_version", "negative")
        flag(np.isinf(c["q0"]), "q0", "not finite")
        has_b = c["has_behaviour"].astype(bool)
        flag(has_b & (lengths["behaviour_logprobs"] != lengths["response_tokens"]), "behaviour_logprobs",
             "length differs from response_tokens")
        flag(~has_b & (lengths["behaviour_logprobs"] != 0), "behaviour_logprobs", "values without has_behaviour")
        lp = c["behaviour_logprobs"]
        flag(per_row("behaviour_logprobs", ~np.isfinite(lp) | (lp > LOGPROB_SLACK)), "behaviour_logprobs",
             "not a finite log-prob <= 0")
        resp_len_per_mc = np.repeat(lengths["response_tokens"], np.diff(c["mc_offsets"]))
        flag(per_row("mc_t", (c["mc_t"] < 0) | (c["mc_t"] >= resp_len_per_mc)), "mc_targets", "t outside the response")
        flag(per_row("mc_p", ~((c["mc_p"] >= 0) & (c["mc_p"] <= 1))), "mc_targets", "success_prob not in [0, 1]")
        shape = c["routes_shape"]
        has_r = (shape[:, 0] > 0) | (shape[:, 1] > 0)
        flag(has_r & ((shape[:, 0] <= 0) | (shape[:, 1] <= 0)), "routed_experts",
             "layers and top_k must be positive integers")
        positions = np.maximum(lengths["prompt_tokens"] + lengths["response_tokens"] - 1, 0)
        n_ids = np.diff(c["routes_offsets"])
        flag(has_r & (n_ids != positions * shape[:, 0].astype(np.int64) * shape[:, 1]), "routed_experts",
             "the expert ids do not fill prompt + response - 1 tokens x layers x top_k")
        flag(~has_r & (n_ids != 0), "routed_experts", "expert ids without a shape (routes_shape 0, 0)")
        for r in np.flatnonzero(c["has_mask"]):  # multi-turn rows: the record schema's own check
            try:
                turns = self.turns_of(int(r))
                check_turns(turns["response_mask"], turns["turn_versions"], int(lengths["response_tokens"][r]), "")
            except RecordError as err:
                bad.append((int(r), err.field, str(err).partition(f"field '{err.field}': ")[2]))
        pid = c["provenance_id"]
        flag((pid < -1) | (pid >= len(self.provenance_table)), "provenance", "provenance_id is not an entry of "
             f"the shard's table ({len(self.provenance_table)} entries)")
        known = {n: ~np.isnan(c[n]) for n in PROVENANCE_NUMBERS}
        flag((pid == -1) & (known["temperature"] | known["top_p"] | known["created"]), "provenance",
             "values without a provenance entry")
        with np.errstate(invalid="ignore"):
            flag(known["temperature"] & ~(np.isfinite(c["temperature"]) & (c["temperature"] >= 0)), "provenance",
                 "temperature not a finite number >= 0")
            flag(known["top_p"] & ~((c["top_p"] > 0) & (c["top_p"] <= 1)), "provenance", "top_p not in (0, 1]")
            flag(known["created"] & ~(np.isfinite(c["created"]) & (c["created"] >= 0)), "provenance",
                 "created not Unix seconds >= 0")
        return sorted(set(bad))


def _open_shards(path: Path, skip_invalid: bool, report: ImportReport,
                 verify: bool | None = None) -> Iterator[tuple[_Shard, np.ndarray]]:
    """Each verified shard of a store with its valid rows, one at a time; bad shards and rows raise
    RecordError, or with ``skip_invalid`` are counted and reported in ``report``. ``verify``: compare each file
    with its checksum (None: the process's checkpoint_digest switch, on unless --no-verify)."""
    verify = verify_enabled() if verify is None else verify
    index = _read_index(path)
    listed = {str(e.get("name")) for e in index["shards"] if isinstance(e, dict)}
    for entry in sorted(p.name for p in path.iterdir() if p.is_dir()):
        if entry not in listed:
            logger.warning("%s: ignoring folder '%s' not listed in %s (an interrupted write)", path, entry, INDEX)
    for entry in index["shards"]:
        try:
            shard = _Shard(path, entry if isinstance(entry, dict) else {}, verify)
        except RecordError as err:
            if not skip_invalid:
                raise
            n = entry.get("rows", 0) if isinstance(entry, dict) else 0
            report.skipped += n if isinstance(n, int) else 0
            report.errors.append(f"{err} ({n} rows skipped)")
            continue
        invalid = {}
        for row, field, why in shard.invalid_rows():
            invalid.setdefault(row, (field, why))
        if invalid and not skip_invalid:
            row, (field, why) = min(invalid.items())
            raise RecordError(f"{path / shard.name} row {row}", field, why)
        for row, (field, why) in sorted(invalid.items()):
            report.skipped += 1
            report.errors.append(f"{path / shard.name} row {row}: field '{field}': {why}")
        valid = np.ones(shard.rows, dtype=bool)
        valid[list(invalid)] = False
        report.read += int(valid.sum())
        yield shard, np.flatnonzero(valid)


def iter_records(path: str | Path, *, skip_invalid: bool = False,
                 report: ImportReport | None = None, verify: bool | None = None) -> Iterator[Trajectory]:
    """The records of a store, streamed one shard at a time (memory: one shard, whatever the store's size).
    Each shard is verified before any of its rows is yielded; ``report`` (when given) counts what was read."""
    path, report = Path(path), ImportReport() if report is None else report
    skipped, read, errors = report.skipped, report.read, len(report.errors)
    for shard, rows in _open_shards(path, skip_invalid, report, verify):
        yield from shard.records(rows.tolist())
    if report.skipped > skipped:
        logger.warning("%s: skipped %d invalid row(s), kept %d; first: %s", path, report.skipped - skipped,
                       report.read - read, report.errors[errors])


class OfflineStore:
    """A verified, read-only view of a store folder. Rows number 0..len-1 across shards (valid rows only)."""

    def __init__(self, path: str | Path, *, skip_invalid: bool = False, verify: bool | None = None):
        self.path = Path(path)
        self.report = ImportReport()
        self.shards: list[_Shard] = []
        rows = []
        for k, (shard, valid) in enumerate(_open_shards(self.path, skip_invalid, self.report, verify)):
            self.shards.append(shard)
            rows.append(np.stack([np.full(len(valid), k, dtype=np.int64), valid.astype(np.int64)], axis=1))
        self._rows = np.concatenate(rows) if rows else np.zeros((0, 2), dtype=np.int64)
        if self.report.skipped:
            logger.warning("%s: skipped %d invalid row(s), kept %d; first: %s", self.path, self.report.skipped,
                           self.report.read, self.report.errors[0])

    def __len__(self) -> int:
        return len(self._rows)

    def _locate(self, i: int) -> tuple[_Shard, int]:
        k, r = self._rows[i]
        return self.shards[k], int(r)

    def prompt_id(self, i: int) -> str | int:
        shard, r = self._locate(i)
        return shard.prompt_ids[r]

    def record(self, i: int) -> Trajectory:
        shard, r = self._locate(i)
        return shard.record(r)

    def trajectories(self) -> list[Trajectory]:
        out = []
        for k, shard in enumerate(self.shards):
            out += shard.records(self._rows[self._rows[:, 0] == k, 1].tolist())
        return out


def remove_store(path: str | Path) -> None:
    """Delete a store folder (its index first, so a half-deleted store never reads as valid)."""
    path = Path(path)
    (path / INDEX).unlink(missing_ok=True)
    shutil.rmtree(path)


def iter_routed(path: str | Path, *, verify: bool | None = None) -> Iterator[tuple[str, Trajectory]]:
    """(where, record) of each record of a JSONL file or an offline store that carries routed_experts, in order;
    where = 'FILE:LINE', or 'STORE record N' (N: the record's number in the store, as OfflineStore numbers them).
    Streamed, for a check of every route (training/sources.py check_source_routes): a store one verified shard at a
    time, a shard without route columns (version < 3) not opened and only routed rows built; a JSONL file line by
    line, only the lines that name routed_experts parsed. A record that cannot be read raises RecordError."""
    path = Path(path)
    if not path.is_dir():
        for where, obj in iter_jsonl(path, naming=b'"routed_experts"'):
            if isinstance(obj, RecordError):
                raise obj
            record = validate_record(obj, where)
            if record.routed_experts is not None:
                yield where, record
        return
    first = 0
    for entry in _read_index(path)["shards"]:
        rows, files = (entry.get("rows"), entry.get("files")) if isinstance(entry, dict) else (None, None)
        if type(rows) is int and rows >= 0 and isinstance(files, dict) and not ROUTE_FILES & set(files):
            first += rows  # no route columns: nothing of it is read
            continue
        shard = _Shard(path, entry, verify_enabled() if verify is None else verify)
        invalid = shard.invalid_rows()
        if invalid:
            row, field, why = invalid[0]
            raise RecordError(f"{path / shard.name} row {row}", field, why)
        for r in np.flatnonzero(shard.cols["routes_shape"][:, 0] > 0).tolist():
            yield f"{path} record {first + r}", shard.record(r)
        first += shard.rows


def load_trajectories(path: str | Path, *, skip_invalid: bool = False) -> list[Trajectory]:
    """Records from a JSONL file or an offline store folder (this module's format)."""
    path = Path(path)
    if path.is_dir():
        return OfflineStore(path, skip_invalid=skip_invalid).trajectories()
    if not path.is_file():
        raise FileNotFoundError(f"trajectories: '{path}' is neither a JSONL file nor an offline store folder")
    return read_jsonl(path, skip_invalid=skip_invalid)[0]
