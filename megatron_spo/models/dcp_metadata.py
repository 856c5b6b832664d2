"""A torch.distributed.checkpoint directory we did not write, checked before torch or megatron reads it.

    md = read_dcp_metadata(dist_dir)          # the .metadata, unpickled with only DCP's metadata classes
    validate_dist_checkpoint(dist_dir)        # + every file range, byte item and common.pt: data, never code

torch reads ``.metadata`` with plain ``pickle.load`` and every byte item (megatron's ``_extra_state``) with
``torch.load(weights_only=False)``: a downloaded checkpoint could run code when opened. Here the pickle may
name only the classes torch's own metadata is made of (collected from torch.distributed.checkpoint.metadata
and from unpickling checkpoints written by our tests), byte items must load with ``weights_only=True``, and
every stored range must lie inside its file. Anything else is a CheckpointFileError: one line naming the
file (and the tensor or the forbidden global).
"""

from __future__ import annotations

import io
import json
import math
import os
import pickle
import re
from pathlib import Path

import torch

METADATA_NAME = ".metadata"
# (module, name) pairs a DCP .metadata pickle may name. Our checkpoints (torch 2.13, megatron-core 0.16) need 12 of
# them plus torch dtypes (17 with an async save's plans), collected by unpickling the tests' checkpoints; MCore*,
# _StoragePrefix, the _shard pair, PurePosixPath and OrderedDict are what other torch / megatron versions write. All are plain data holders:
# building one runs no code of the file's choosing.
_ALLOWED = frozenset({
    ("torch.distributed.checkpoint.metadata", "Metadata"),
    ("torch.distributed.checkpoint.metadata", "MetadataIndex"),
    ("torch.distributed.checkpoint.metadata", "StorageMeta"),
    ("torch.distributed.checkpoint.metadata", "TensorProperties"),
    ("torch.distributed.checkpoint.metadata", "TensorStorageMetadata"),
    ("torch.distributed.checkpoint.metadata", "BytesStorageMetadata"),
    ("torch.distributed.checkpoint.metadata", "ChunkStorageMetadata"),
    ("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING"),
    # megatron-core's async save keeps every rank's save plan in the metadata (Metadata.all_local_plans)
    ("torch.distributed.checkpoint.planner", "SavePlan"),
    ("torch.distributed.checkpoint.planner", "WriteItem"),
    ("torch.distributed.checkpoint.planner", "WriteItemType"),
    ("torch.distributed.checkpoint.planner", "TensorWriteData"),
    ("torch.distributed.checkpoint.planner", "BytesIOWriteData"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.distributed.checkpoint.filesystem", "_StoragePrefix"),
    ("megatron.core.dist_checkpointing.strategies.torch", "MCoreMetadata"),
    ("megatron.core.dist_checkpointing.strategies.torch", "MCoreSavePlan"),  # older megatron-core checkpoints
    ("torch.distributed._shard.sharded_tensor.metadata", "TensorProperties"),  # older torch's metadata
    ("torch.distributed._shard.sharded_tensor.metadata", "MEM_FORMAT_ENCODING"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("collections", "OrderedDict"),
})


class CheckpointFileError(ValueError):
    """A checkpoint file that is unsafe or inconsistent; the message is one line naming the file."""


class _Forbidden(Exception):
    pass


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if (module, name) in _ALLOWED:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise _Forbidden(f"{module}.{name}")

    def persistent_load(self, pid):
        raise _Forbidden(f"persistent id {str(pid)[:40]!r}")


def _short(err: BaseException) -> str:
    text = " ".join(str(err).split())
    return f"{type(err).__name__}: {text[:120]}" if text else type(err).__name__


def weights_only_refusal(err: BaseException) -> str:
    """torch.load(weights_only=True)'s multi-paragraph refusal as a few words naming the global it blocked."""
    text = str(err)
    found = re.search(r"unsupported (?:global: )?GLOBAL (\S+)", text, re.IGNORECASE)
    if found:
        return f"refused: it asks for global '{found.group(1)}'"
    detail = re.search(r"WeightsUnpickler error:\s*([^\n]+)", text)
    return f"unreadable ({type(err).__name__}: {detail.group(1)[:120]})" if detail else f"unreadable ({_short(err)})"


def load_failure(err: BaseException) -> str:
    """The first rank's original exception of a torch CheckpointException (whose text is every rank's
    traceback), in a few words."""
    failures = getattr(err, "failures", None)
    if isinstance(failures, dict) and failures:
        first = next(iter(failures.values()))
        err = first[0] if isinstance(first, tuple) else first
    return weights_only_refusal(err) if "weights_only" in str(err) or "Unpickl" in type(err).__name__ \
        else _short(err)


def read_dcp_metadata(dist_dir: str | Path):
    """The checkpoint's torch.distributed.checkpoint Metadata, read without running anything it names."""
    from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

    path = Path(dist_dir) / METADATA_NAME
    if not path.is_file():
        raise CheckpointFileError(f"{path}: missing (not a torch_dist checkpoint directory)")
    try:
        with open(path, "rb") as f:
            md = _MetadataUnpickler(f).load()
    except _Forbidden as err:
        raise CheckpointFileError(
            f"{path}: refused: its pickle asks for global '{err}', which is no checkpoint metadata class "
            f"(a checkpoint is data, never code)") from None
    except Exception as err:  # a truncated or garbage pickle fails in many ways
        raise CheckpointFileError(f"{path}: not a torch.distributed.checkpoint metadata file ({_short(err)})") from None
    if not isinstance(md, Metadata):
        raise CheckpointFileError(f"{path}: holds a {type(md).__name__}, not torch.distributed.checkpoint Metadata")
    _check_structure(path, md)
    if getattr(md, "storage_meta", None) is None:
        md.storage_meta = StorageMeta()
    return md


def _check_structure(path: Path, md) -> None:
    """Types and ranges torch and megatron trust without checking: chunks inside their tensor, file ranges."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        MetadataIndex,
        TensorStorageMetadata,
    )

    def bad(what: str):
        return CheckpointFileError(f"{path}: {what}")

    if not isinstance(md.state_dict_metadata, dict) or not isinstance(md.storage_data, dict):
        raise bad("state_dict_metadata / storage_data are not dicts")
    for key, meta in md.state_dict_metadata.items():
        if not isinstance(key, str):
            raise bad(f"a key of type {type(key).__name__}")
        if isinstance(meta, BytesStorageMetadata):
            continue
        if not isinstance(meta, TensorStorageMetadata):
            raise bad(f"tensor '{key}' has metadata of type {type(meta).__name__}")
        size = tuple(meta.size)
        if not all(isinstance(d, int) and d >= 0 for d in size) or not isinstance(meta.properties.dtype, torch.dtype):
            raise bad(f"tensor '{key}' has size {list(size)[:8]} / dtype {meta.properties.dtype!r}")
        for chunk in meta.chunks:
            off, sz = tuple(chunk.offsets), tuple(chunk.sizes)
            if len(off) != len(size) or len(sz) != len(size) or any(
                    not isinstance(o, int) or not isinstance(s, int) or o < 0 or s < 0 or o + s > d
                    for o, s, d in zip(off, sz, size)):
                raise bad(f"tensor '{key}' has a chunk at {list(off)} of {list(sz)} outside its size {list(size)}")
    root = path.parent.resolve()
    sizes: dict[str, int] = {}
    for index, info in md.storage_data.items():
        if not isinstance(index, MetadataIndex) or not isinstance(info, _StorageInfo):
            raise bad(f"storage entry of type {type(index).__name__} -> {type(info).__name__}")
        if index.fqn not in md.state_dict_metadata:
            raise bad(f"stored item '{index.fqn}' has no metadata")
        rel = info.relative_path
        if not isinstance(rel, str) or not isinstance(info.offset, int) or not isinstance(info.length, int) \
                or info.offset < 0 or info.length < 0:
            raise bad(f"item '{index.fqn}' has file {rel!r} at offset {info.offset!r} length {info.length!r}")
        if rel not in sizes:
            file = (root / rel).resolve()
            if file.parent != root and root not in file.parents:
                raise bad(f"item '{index.fqn}' points outside the checkpoint ('{rel}')")
            if not file.is_file():
                raise bad(f"item '{index.fqn}' is stored in '{rel}', which does not exist")
            sizes[rel] = file.stat().st_size
        if info.offset + info.length > sizes[rel]:
            raise CheckpointFileError(
                f"{root / rel}: truncated: item '{index.fqn}' needs bytes up to {info.offset + info.length}, "
                f"the file has {sizes[rel]}")
        meta = md.state_dict_metadata[index.fqn]
        if isinstance(meta, TensorStorageMetadata) and index.offset is not None and not getattr(
                info, "transform_descriptors", None):
            chunk = next((c for c in meta.chunks if tuple(c.offsets) == tuple(index.offset)), None)
            need = math.prod(chunk.sizes) * meta.properties.dtype.itemsize if chunk is not None else 0
            if info.length < need:
                raise bad(f"tensor '{index.fqn}' chunk at {list(index.offset)} has {info.length} bytes stored, "
                          f"its shape needs at least {need}")


def _check_byte_items(dist_dir: Path, md) -> None:
    """Byte items (megatron's _extra_state) are unpickled by torch with weights_only=False: each must load
    with weights_only=True here first."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    for index, info in md.storage_data.items():
        if not isinstance(md.state_dict_metadata.get(index.fqn), BytesStorageMetadata):
            continue
        file = dist_dir / info.relative_path
        if getattr(info, "transform_descriptors", None):
            raise CheckpointFileError(f"{file}: byte item '{index.fqn}' is stored transformed "
                                      f"({list(info.transform_descriptors)}), which is not checked here")
        with open(file, "rb") as f:
            f.seek(info.offset)
            blob = f.read(info.length)
        try:
            torch.load(io.BytesIO(blob), map_location="cpu", weights_only=True)
        except Exception as err:
            raise CheckpointFileError(f"{file}: byte item '{index.fqn}': {weights_only_refusal(err)}") from None


def _check_common(dist_dir: Path) -> None:
    """megatron's metadata.json (JSON object naming a backend) and common.pt (plain data)."""
    meta = dist_dir / "metadata.json"
    if meta.is_file():
        try:
            raw = json.loads(meta.read_text())
        except (ValueError, UnicodeDecodeError, RecursionError) as err:
            raise CheckpointFileError(f"{meta}: invalid JSON ({_short(err)})") from None
        if not isinstance(raw, dict) or not isinstance(raw.get("sharded_backend"), str):
            raise CheckpointFileError(f"{meta}: not megatron's checkpoint metadata (no 'sharded_backend')")
    common = dist_dir / "common.pt"
    if common.is_file():
        try:
            torch.load(common, map_location="cpu", weights_only=True)
        except Exception as err:
            raise CheckpointFileError(f"{common}: {weights_only_refusal(err)}") from None


_VALIDATED: dict[tuple, object] = {}


def validate_dist_checkpoint(dist_dir: str | Path):
    """Everything torch / megatron would unpickle or trust in a dist checkpoint, checked; returns its Metadata.
    Cached per directory while its .metadata is unchanged (conversion opens one many times)."""
    dist_dir = Path(dist_dir)
    try:
        st = os.stat(dist_dir / METADATA_NAME)
        key = (str(dist_dir.resolve()), st.st_mtime_ns, st.st_size, st.st_ino)
    except OSError:
        key = None
    if key is not None and key in _VALIDATED:
        return _VALIDATED[key]
    md = read_dcp_metadata(dist_dir)
    _check_common(dist_dir)
    _check_byte_items(dist_dir, md)
    if key is not None:
        _VALIDATED[key] = md
    return md
