"""Per-file digests of every checkpoint the project writes, checked whenever one is read.

    write_manifest(dir)              # once its files are complete: DIR/digests.json (atomic), each file's size + CRC-32
    write_manifest(dir, collective=True)   # a multi-rank save: each rank digests its share, rank 0 writes
    add_to_manifest(dir, names)      # files written after it (an HF export's config.json, tokenizer)
    verify_checkpoint(path)          # the manifest of path (or of its parent, for a trainer step's dist/), checked once
    verify_checkpoint(path, collective=True)   # each rank checks its share, every rank raises the same one line
    with verification(False): ...    # --no-verify / checkpoint.verify=false: a user's own hand-edited files

torch.distributed.checkpoint stores no checksums and neither does safetensors: one flipped byte inside a .distcp
or .safetensors file reads as a slightly different weight, with exit 0. The manifest lists each file by its path
relative to the checkpoint directory:

    {"format": "megatron-spo-digests", "version": 1, "algorithm": "crc32",
     "files": {"dist/__0_0.distcp": {"size": 1234, "crc32": "9f86d081"}, ...}}

A listed file that is missing, of another size, or of another digest is a CheckpointDigestError, one line naming
the checkpoint and the file. A checkpoint without a manifest (written before checkpoints carried one, or not by
megatron-spo: a downloaded HF model) reads with a one-line note and is not verified. The offline store keeps a
SHA-256 per file in its own index.json (data/offline_store.py), verified under the same switch.

Why CRC-32: the manifest guards against corruption (bit rot, a truncated copy, a stray edit), not an attacker, who
would rewrite an unsigned manifest along with the file; a CRC detects every burst of up to 32 flipped bits and
misses a random corruption with probability 2^-32. zlib's CRC-32 reads 2.3 GB/s per core here against 1.2 for
SHA-256 (SHA-NI), 1.25 for SHA-1 and 0.65 for BLAKE2b, so a save pays half as much (tools/bench_checkpoint_digest.py,
docs/engineering-notes.md). A manifest naming "sha256" reads too. Files are read in 1 MiB chunks, several at once
on threads (zlib and hashlib release the GIL), and a multi-rank save or resume spreads the files over its ranks.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import sys
import threading
import zlib
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from megatron_spo.fsutil import write_text_atomic

logger = logging.getLogger(__name__)

MANIFEST = "digests.json"
FORMAT, VERSION, ALGORITHM = "megatron-spo-digests", 1, "crc32"
CHUNK = 1 << 20
MAX_MANIFEST_BYTES = 64 << 20
# What a refusal tells the user to do when the change is theirs.
SKIP_HINT = "--no-verify (checkpoint.verify=false in a training config) skips the check"


class CheckpointDigestError(ValueError):
    """A checkpoint file that does not match its manifest (or a manifest that is not one); one line naming it."""


# ---------------------------------------------------------------------------------------------
# The process-wide switch (--no-verify, checkpoint.verify)
# ---------------------------------------------------------------------------------------------
_enabled = True


def verify_enabled() -> bool:
    return _enabled


def set_verify(enabled: bool) -> None:
    """Verify checkpoints read by this process (the default), or not: a training rank sets it from
    checkpoint.verify before it loads anything."""
    global _enabled
    _enabled = bool(enabled)


@contextlib.contextmanager
def verification(enabled: bool) -> Iterator[None]:
    """set_verify(enabled) inside the block, the previous setting after it (a CLI's --no-verify)."""
    previous = _enabled
    set_verify(enabled)
    try:
        yield
    finally:
        set_verify(previous)


# ---------------------------------------------------------------------------------------------
# Digests
# ---------------------------------------------------------------------------------------------
class _Crc32:
    """zlib.crc32 behind hashlib's update / hexdigest."""

    def __init__(self):
        self._crc = 0

    def update(self, data) -> None:
        self._crc = zlib.crc32(data, self._crc)

    def hexdigest(self) -> str:
        return f"{self._crc:08x}"


_ALGORITHMS = {"crc32": (_Crc32, 8), "sha256": (hashlib.sha256, 64)}  # name -> (factory, hex digits)


def new_hash(algorithm: str = ALGORITHM):
    """A fresh digest object (update / hexdigest): a writer streams its bytes through it as it writes them."""
    return _ALGORITHMS[algorithm][0]()


# CRC-32s of consecutive pieces combine into the CRC-32 of the whole (zlib's crc32_combine, which Python's zlib does
# not expose): a large file is read as blocks on several threads and still gets the plain CRC-32 of its bytes.
_POLY = 0xEDB88320  # the reflected CRC-32 polynomial


def _multmodp(a: int, b: int) -> int:
    """a * b modulo the CRC polynomial (bit-reflected, as zlib's multmodp)."""
    m, p = 1 << 31, 0
    while True:
        if a & m:
            p ^= b
            if (a & (m - 1)) == 0:
                return p
        m >>= 1
        b = (b >> 1) ^ _POLY if b & 1 else b >> 1


_X2N = [1 << 30]  # x^(2^k) modulo the polynomial, k = 0..31
for _ in range(31):
    _X2N.append(_multmodp(_X2N[-1], _X2N[-1]))


def crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """The CRC-32 of A + B from crc32(A), crc32(B) and len(B)."""
    p, n, k = 1 << 31, len2, 3  # x^(8 * len2): the shift of A by len2 bytes
    while n:
        if n & 1:
            p = _multmodp(_X2N[k & 31], p)
        n >>= 1
        k += 1
    return _multmodp(p, crc1) ^ crc2


BLOCK = 32 << 20  # a large file's CRC-32 is read in blocks of this size, several at once


def _read_range(path: Path, start: int, length: int, h) -> int:
    """Feed ``length`` bytes of the file from ``start`` to ``h``; returns how many there were."""
    buf = bytearray(min(CHUNK, max(length, 1)))
    view, done = memoryview(buf), 0
    with open(path, "rb", buffering=0) as f:
        f.seek(start)
        while done < length:
            n = f.readinto(view[: min(len(buf), length - done)])
            if not n:
                break
            h.update(view[:n])
            done += n
    return done


def _crc_block(path: Path, start: int, length: int) -> tuple[int, int]:
    h = _Crc32()
    return _read_range(path, start, length, h), h._crc


def _threads(n_tasks: int) -> int:
    return max(1, min(n_tasks, os.cpu_count() or 1, 16))


def _digest_paths(paths: list[Path], algorithm: str) -> list[tuple[int, str]]:
    """(size, hex digest) of each file: CRC-32 as blocks of every file on a pool of threads, other digests a file
    per thread (largest first)."""
    sizes = [p.stat().st_size for p in paths]
    if algorithm == "crc32":
        tasks = [(i, start, min(BLOCK, size - start)) for i, size in enumerate(sizes)
                 for start in range(0, max(size, 1), BLOCK)]
        tasks.sort(key=lambda t: -t[2])
        if len(tasks) == 1:
            done = [_crc_block(paths[tasks[0][0]], *tasks[0][1:])]
        else:
            with ThreadPoolExecutor(_threads(len(tasks))) as pool:
                done = list(pool.map(lambda t: _crc_block(paths[t[0]], t[1], t[2]), tasks))
        pieces: dict[int, list[tuple[int, int, int]]] = {}
        for (i, start, _), (n, crc) in zip(tasks, done):
            pieces.setdefault(i, []).append((start, n, crc))
        out = []
        for i in range(len(paths)):
            total, crc = 0, 0
            for _, n, piece in sorted(pieces[i]):
                crc, total = crc32_combine(crc, piece, n), total + n
            out.append((total, f"{crc:08x}"))
        return out

    def whole(i: int) -> tuple[int, str]:
        h = new_hash(algorithm)
        return _read_range(paths[i], 0, sizes[i], h), h.hexdigest()

    order = sorted(range(len(paths)), key=lambda i: -sizes[i])
    if len(order) <= 1:
        return [whole(i) for i in range(len(paths))]
    with ThreadPoolExecutor(_threads(len(order))) as pool:
        done = dict(zip(order, pool.map(whole, order)))
    return [done[i] for i in range(len(paths))]


def file_digest(path: str | Path, algorithm: str = ALGORITHM) -> tuple[int, str]:
    """(size, hex digest) of a file (a large one read as blocks on several threads)."""
    return _digest_paths([Path(path)], algorithm)[0]


def digest_files(root: str | Path, names: Iterable[str], algorithm: str = ALGORITHM) -> dict[str, tuple[int, str]]:
    """{name: (size, digest)} of files under root, read on several threads."""
    root = Path(root)
    names = sorted(set(names))
    return dict(zip(names, _digest_paths([root / n for n in names], algorithm)))


def checkpoint_files(root: str | Path) -> list[str]:
    """Every regular file under root (relative, '/'-separated), the manifest itself aside."""
    root = Path(root)
    out = []
    for dirpath, _, files in os.walk(root):
        for name in files:
            path = Path(dirpath) / name
            rel = path.relative_to(root).as_posix()
            if rel != MANIFEST and path.is_file() and not path.is_symlink():
                out.append(rel)
    return sorted(out)


# ---------------------------------------------------------------------------------------------
# Several ranks: each digests a share of the files
# ---------------------------------------------------------------------------------------------
def _group():
    """torch.distributed when this process is one of several ranks, else None (torch is never imported here)."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized() or dist.get_world_size() <= 1:
        return None
    return dist


_OWNER = re.compile(r"(?:^|/)(?:__(\d+)_\d+\.distcp|rng_rank(\d+)\.pt)$")  # what torch_dist / the trainer name per rank


def _share(sizes: dict[str, int], rank: int, world: int) -> list[str]:
    """The files ``rank`` digests: those a rank wrote to its own name go to that rank (its page cache, its node),
    the rest to the least loaded rank, largest first. Every rank computes the same split from the same list."""
    load, owner = [0] * world, {}
    for name, size in sorted(sizes.items(), key=lambda kv: (-kv[1], kv[0])):
        found = _OWNER.search(name)
        r = int(found.group(1) or found.group(2)) % world if found else min(range(world), key=load.__getitem__)
        owner[name] = r
        load[r] += size
    return [n for n, r in owner.items() if r == rank]


def _gathered(dist, mine) -> list:
    out: list = [None] * dist.get_world_size()
    dist.all_gather_object(out, mine)
    return out


# ---------------------------------------------------------------------------------------------
# Writing
# ---------------------------------------------------------------------------------------------
def _write(root: Path, entries: dict[str, tuple[int, str]], algorithm: str = ALGORITHM) -> Path:
    body = {"format": FORMAT, "version": VERSION, "algorithm": algorithm,
            "files": {name: {"size": size, algorithm: digest} for name, (size, digest) in sorted(entries.items())}}
    write_text_atomic(root / MANIFEST, json.dumps(body, indent=1) + "\n")
    return root / MANIFEST


def write_manifest(root: str | Path, files: Iterable[str] | None = None,
                   known: dict[str, tuple[int, str]] | None = None, *, collective: bool = False) -> Path | None:
    """Write root/digests.json (atomically) for ``files`` (default: every file under root) once they are complete.
    ``known``: {name: (size, digest)} a writer computed while writing (not read again). ``collective``: every rank
    of torch.distributed's default group calls it after the files are written (a barrier); each digests its share
    and rank 0 writes the manifest (the others return None); each rank's ``known`` counts (a file of that size is
    not read again)."""
    root = Path(root)
    dist = _group() if collective else None
    if dist is None:
        names = checkpoint_files(root) if files is None else sorted(set(files))
        known = {n: v for n, v in (known or {}).items() if n in names}
        return _write(root, {**digest_files(root, [n for n in names if n not in known]), **known})
    plan: list = [None]
    if dist.get_rank() == 0:  # one listing (a shared file system may show ranks different views for a moment)
        names = checkpoint_files(root) if files is None else sorted(set(files))
        plan = [{n: (root / n).stat().st_size for n in names}]
    dist.broadcast_object_list(plan, src=0)
    told = {k: v for part in _gathered(dist, dict(known or {})) for k, v in part.items()}
    todo = {n: size for n, size in plan[0].items() if n not in told or told[n][0] != size}
    parts = _gathered(dist, digest_files(root, _share(todo, dist.get_rank(), dist.get_world_size())))
    if dist.get_rank() != 0:
        return None
    entries = {n: told[n] for n in plan[0] if n not in todo}
    return _write(root, {**entries, **{k: v for part in parts for k, v in part.items()}})


def add_to_manifest(root: str | Path, files: Iterable[str]) -> None:
    """List ``files`` (written after the manifest) in root's manifest too; nothing when root has none."""
    root = Path(root)
    if not (root / MANIFEST).is_file():
        return
    algorithm, entries = _read(root)
    entries.update(digest_files(root, files, algorithm))
    _write(root, entries, algorithm)


def complete_manifest(root: str | Path) -> Path:
    """A manifest of every file under root: the entries of root's manifest (if any) kept, the others digested."""
    root = Path(root)
    algorithm, known = _read(root) if (root / MANIFEST).is_file() else (ALGORITHM, {})
    return write_manifest(root, known=known if algorithm == ALGORITHM else {})


# ---------------------------------------------------------------------------------------------
# Reading
# ---------------------------------------------------------------------------------------------
def _read(root: Path) -> tuple[str, dict[str, tuple[int, str]]]:
    """(algorithm, entries) of root's manifest, each entry checked to be a plain relative path inside root with a
    size and a digest."""
    path = root / MANIFEST
    try:
        if path.stat().st_size > MAX_MANIFEST_BYTES:
            raise CheckpointDigestError(f"{path}: {path.stat().st_size} bytes, more than a digest manifest holds")
        raw = json.loads(path.read_bytes())
    except (ValueError, RecursionError) as err:
        raise CheckpointDigestError(f"{path}: not a digest manifest (invalid JSON: {type(err).__name__})") from None
    if not isinstance(raw, dict) or raw.get("format") != FORMAT or not isinstance(raw.get("files"), dict):
        raise CheckpointDigestError(f"{path}: not a digest manifest (format {FORMAT!r} with 'files' expected)")
    algorithm = raw.get("algorithm")
    if raw.get("version") != VERSION or algorithm not in _ALGORITHMS:
        raise CheckpointDigestError(f"{path}: version {raw.get('version')!r} / algorithm {algorithm!r} is not one "
                                    f"this code reads ({VERSION}; {', '.join(_ALGORITHMS)})")
    digits = _ALGORITHMS[algorithm][1]
    entries = {}
    for name, entry in raw["files"].items():
        parts = name.split("/")
        if not name or name.startswith("/") or any(p in ("", ".", "..") for p in parts) or "\\" in name:
            raise CheckpointDigestError(f"{path}: entry {name[:80]!r} is not a file name inside the checkpoint")
        size = entry.get("size") if isinstance(entry, dict) else None
        digest = entry.get(algorithm) if isinstance(entry, dict) else None
        if type(size) is not int or size < 0 or not isinstance(digest, str) or len(digest) != digits:
            raise CheckpointDigestError(f"{path}: entry '{name[:80]}' lacks a size and a {algorithm} digest")
        entries[name] = (size, digest.lower())
    return algorithm, entries


def _covering(path: Path) -> tuple[Path, str] | None:
    """(directory holding the manifest, prefix of path's files in it): path's own manifest, else its parent's
    when that lists files under path (a trainer step's manifest covers its dist/)."""
    if (path / MANIFEST).is_file():
        return path, ""
    parent, prefix = path.parent, path.name + "/"
    if path.name and (parent / MANIFEST).is_file() and any(n.startswith(prefix) for n in _read(parent)[1]):
        return parent, prefix
    return None


def _check(root: Path, algorithm: str, entries: dict[str, tuple[int, str]]) -> str | None:
    """The one-line error for the first of these files (by name) that is missing, of another size or digest."""
    where = f"checkpoint {root}"
    for name, (size, _) in sorted(entries.items()):
        file = root / name
        if not file.is_file():
            return (f"{where}: file {name} is listed in {MANIFEST} but missing: the checkpoint is incomplete or was "
                    f"edited; {SKIP_HINT}")
        found = file.stat().st_size
        if found != size:
            return (f"{where}: file {name} has {found} bytes, {MANIFEST} lists {size}: the file is truncated, "
                    f"corrupt or was edited; {SKIP_HINT}")
    digests = digest_files(root, entries, algorithm)
    for name, (_, expected) in sorted(entries.items()):
        found = digests[name][1]
        if found != expected:
            return (f"{where}: file {name} digest mismatch (expected {algorithm} {expected[:16]}, found "
                    f"{found[:16]}): the file is corrupt or was edited; {SKIP_HINT}")
    return None


def verify_manifest(root: str | Path, prefix: str = "") -> int:
    """Check every file root's manifest lists (those under ``prefix`` only, when given): present, of its size
    and digest. Returns how many were checked; CheckpointDigestError names the first that is not."""
    root = Path(root)
    algorithm, entries = _read(root)
    entries = {n: v for n, v in entries.items() if n.startswith(prefix)}
    error = _check(root, algorithm, entries)
    if error:
        raise CheckpointDigestError(error)
    return len(entries)


_VERIFIED: set[tuple] = set()
_NOTED: set[str] = set()
_lock = threading.Lock()


def _state(root: Path, names: list[str]) -> tuple | None:
    """What a repeated check of the same files in this process may skip on: the manifest's and every listed
    file's size, modification time and inode (None when a file is gone)."""
    try:
        stats = [(root / MANIFEST).stat()] + [(root / n).stat() for n in names]
    except OSError:
        return None
    return (str(root.resolve()), tuple(names), tuple((s.st_size, s.st_mtime_ns, s.st_ino) for s in stats))


def _plan(path: Path) -> dict:
    """What checking ``path`` takes: {"status": "unverified"} (no manifest: noted once), {"status": "verified"}
    (checked already in this process, unchanged since), or the files to check."""
    covering = _covering(path)
    if covering is None:
        key = str(path.resolve())
        with _lock:
            first = key not in _NOTED
            _NOTED.add(key)
        dist = sys.modules.get("torch.distributed")
        if first and not (dist is not None and dist.is_available() and dist.is_initialized() and dist.get_rank()):
            logger.warning("note: %s has no %s (written before checkpoints carried digests, or not by megatron-spo): "
                           "its files are not verified", path, MANIFEST)
        return {"status": "unverified"}
    root, prefix = covering
    algorithm, entries = _read(root)
    entries = {n: v for n, v in entries.items() if n.startswith(prefix)}
    state = _state(root, sorted(entries))
    if state is not None and state in _VERIFIED:
        return {"status": "verified"}
    return {"status": "check", "root": str(root), "algorithm": algorithm, "entries": entries, "state": state}


def _done(plan: dict) -> str:
    if plan["state"] is not None:
        with _lock:
            _VERIFIED.add(plan["state"])
    return "verified"


def verify_checkpoint(path: str | Path, *, verify: bool | None = None, collective: bool = False) -> str:
    """Check the files of the checkpoint at ``path`` against its manifest (see _covering), once per process while
    they are unchanged. Returns "verified", "unverified" (no manifest: a one-line note, once) or "skipped"
    (``verify`` False, or None and the process switch off). ``collective``: every rank of torch.distributed's
    default group calls it; rank 0 reads the manifest, each rank checks its share of the files, and every rank
    raises the same one-line error (the first file by name that fails)."""
    if not (_enabled if verify is None else verify):
        return "skipped"
    path = Path(path)
    dist = _group() if collective else None
    if dist is None:
        plan = _plan(path)
        if plan["status"] != "check":
            return plan["status"]
        error = _check(Path(plan["root"]), plan["algorithm"], plan["entries"])
        if error:
            raise CheckpointDigestError(error)
        return _done(plan)
    box: list = [None]
    if dist.get_rank() == 0:
        try:
            box = [_plan(path)]
        except CheckpointDigestError as err:  # a manifest that is not one: every rank raises it
            box = [{"status": "error", "error": str(err)}]
    dist.broadcast_object_list(box, src=0)
    plan = box[0]
    if plan["status"] == "error":
        raise CheckpointDigestError(plan["error"])
    if plan["status"] != "check":
        return plan["status"]
    entries = plan["entries"]
    mine = _share({n: size for n, (size, _) in entries.items()}, dist.get_rank(), dist.get_world_size())
    errors = _gathered(dist, _check(Path(plan["root"]), plan["algorithm"], {n: entries[n] for n in mine}))
    failed = sorted(e for e in errors if e)
    if failed:
        raise CheckpointDigestError(failed[0])
    return _done(plan)
