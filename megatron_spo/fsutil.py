"""Durable file writes shared by checkpoints, trajectory files, the offline store and the tools' results.

A reader sees either the old file or the complete new one: write to a temporary file in the same folder,
fsync it, rename it over the target, fsync the folder (so the rename itself survives a crash).
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from collections.abc import Iterable
from pathlib import Path


def fsync_path(path: str | Path) -> None:
    """Flush a file, or a folder's entries (so renames in it survive a crash), to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: str | Path) -> None:
    """fsync every file and folder under root, deepest first, then root (clean files cost next to nothing)."""
    root = Path(root)
    for path in sorted(root.rglob("*"), reverse=True) + [root]:
        fsync_path(path)


def write_lines_atomic(path: str | Path, lines: Iterable[str]) -> None:
    """Write the lines (each carrying its own newline) to `path` atomically and durably."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.writelines(lines)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    fsync_path(path.parent)


def write_text_atomic(path: str | Path, text: str) -> None:
    write_lines_atomic(path, [text])


def sha256_file(path: str | Path) -> str:
    """The file's SHA-256 (hex), read in 1 MiB chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()
