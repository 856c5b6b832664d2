"""megatron-core dist_checkpointing for the Llama chunks: written under one TP/PP layout, loadable under any.

    save_megatron(chunks, model_cfg, ckpt_dir)     # collective; writes ckpt_dir/model_config.json too
    load_megatron(chunks, ckpt_dir)                # collective; in place
    cfg = read_megatron_config(ckpt_dir)
    sd, entries = mapped_sharded_tensors(model)    # conversion: every mapped parameter's ShardedTensors
    MappedTorchDist(ckpt_dir).get(key, offsets, sizes, dtype)   # a stored chunk, viewed in place

Sharded tensors are keyed globally (layers stacked on a prepended axis), so the layout that wrote a
checkpoint does not constrain the one that reads it. The vocabulary dimension may differ (different
TP padding): megatron marks embeddings / LM head ``allow_shape_mismatch`` and zero-fills extra rows.

Saving uses megatron's torch_dist format (torch.distributed.checkpoint files + megatron's
metadata.json) written by the calling process itself, one fsync'd file per rank: megatron's default
writer forks worker processes and starts a spawn-based result queue, which on one process only costs
time (and needs an ``if __name__ == "__main__":`` guard in scripts). The records are written without
the zip CRC32 that torch.load never checks (it costs as much CPU as writing the bytes); save_megatron lists every
file in a digest manifest instead (checkpoint_digest.py), which load_megatron checks before reading.
"""

from __future__ import annotations

import collections
import io
import json
import math
import mmap
import pickle
import struct
import sys
import warnings
import zipfile
from dataclasses import dataclass
from pathlib import Path

import torch

from megatron_spo.models.config import ModelConfig

MODEL_CONFIG_NAME = "model_config.json"
# The sharded-strategy format every save here writes (megatron's default, loadable by any megatron-core).
TORCH_DIST = ("torch_dist", 1)


def _unwrap(model):
    while hasattr(model, "module"):
        model = model.module
    return model


def _sharded_state_dict(model_chunks, key_prefix: str = "") -> dict:
    return {f"chunk{i}": _unwrap(c).sharded_state_dict(prefix=key_prefix) for i, c in enumerate(model_chunks)}


def _in_process_save_strategy(on_item=None, deferred=None):
    """megatron's torch_dist save strategy, with the files written by this process (no fork, no spawn).
    ``on_item()`` (optional) is called as each tensor is handed to the writer (progress bars).
    ``deferred`` maps the data_ptr of a placeholder tensor to a function making the real one: it is
    called when the writer reaches that item and its result is dropped once written."""
    from megatron.core.dist_checkpointing.strategies.torch import (
        MCoreSavePlanner,
        TorchDistSaveShardedStrategy,
        _replace_state_dict_keys_with_sharded_keys,
        mcore_to_pyt_state_dict,
    )
    from torch.distributed import checkpoint as dcp

    reported: set = set()

    class ReportingPlanner(MCoreSavePlanner):
        def resolve_data(self, write_item):
            data = super().resolve_data(write_item)
            make = deferred.get(data.data_ptr()) if deferred and isinstance(data, torch.Tensor) else None
            if make is not None:
                made = make()
                if made.shape.numel() != data.numel() or made.dtype != data.dtype:
                    raise ValueError(f"megatron_checkpoint: deferred tensor for {write_item.index.fqn} "
                                     f"is {list(made.shape)} {made.dtype}, expected {list(data.shape)} {data.dtype}")
                data = made.view(data.shape)
            # tensors only (not extra-state bytes), once each (the writer may resolve an item twice)
            if on_item is not None and isinstance(data, torch.Tensor) and write_item.index not in reported:
                reported.add(write_item.index)
                on_item()
            return data

    class InProcessTorchDistSave(TorchDistSaveShardedStrategy):
        def save(self, sharded_state_dict, checkpoint_dir) -> None:
            flat, _, _ = _replace_state_dict_keys_with_sharded_keys(sharded_state_dict, self.keep_only_main_replica)
            writer = dcp.FileSystemWriter(
                str(checkpoint_dir), single_file_per_rank=True, sync_files=True, thread_count=1
            )
            planner = ReportingPlanner(
                dedup_replicated_tensors=not self.keep_only_main_replica, flatten_state_dict=False
            )
            # torch.load never checks the zip CRC32 of a record (torch.serialization.set_crc32_options),
            # and computing it costs about as much as writing the bytes on a fast disk: skip it here.
            crc32 = torch.serialization.get_crc32_options()
            torch.serialization.set_crc32_options(False)
            try:
                dcp.save(mcore_to_pyt_state_dict(flat, False), storage_writer=writer, planner=planner)
            finally:
                torch.serialization.set_crc32_options(crc32)

    return InProcessTorchDistSave(*TORCH_DIST)


def save_sharded_state_dict(sharded_state_dict: dict, ckpt_dir: str | Path, on_item=None, deferred=None) -> None:
    """Collective save of a megatron sharded state dict into an existing ``ckpt_dir``.

    ``deferred``: {placeholder.data_ptr(): make_tensor} for tensors built only when written (one at a
    time, so a converted weight that needs new memory never exists for all layers at once)."""
    from megatron.core import dist_checkpointing

    strategy = _in_process_save_strategy(on_item, deferred)
    dist_checkpointing.save(sharded_state_dict, str(ckpt_dir), sharded_strategy=strategy)


def save_megatron(model_chunks, cfg: ModelConfig, ckpt_dir: str | Path) -> None:
    """Collective save of all chunks of all ranks into ``ckpt_dir`` (created)."""
    import torch.distributed as dist

    ckpt_dir = Path(ckpt_dir)
    rank = dist.get_rank() if dist.is_initialized() else 0
    if rank == 0:
        ckpt_dir.mkdir(parents=True, exist_ok=True)
    if dist.is_initialized():
        dist.barrier()
    save_sharded_state_dict(_sharded_state_dict(model_chunks), ckpt_dir)
    if rank == 0:
        write_megatron_config(ckpt_dir, cfg)
    if dist.is_initialized():
        dist.barrier()
    from megatron_spo.checkpoint_digest import write_manifest

    write_manifest(ckpt_dir, collective=True)  # each rank digests its share of the files, rank 0 writes it
    if dist.is_initialized():
        dist.barrier()


def write_megatron_config(ckpt_dir: str | Path, cfg: ModelConfig) -> None:
    (Path(ckpt_dir) / MODEL_CONFIG_NAME).write_text(cfg.model_dump_json(indent=2) + "\n")


def load_megatron(
    model_chunks, ckpt_dir: str | Path, *, assign: bool = False, key_prefix: str = "", keep_own: tuple[str, ...] = (),
    keep_own_names: tuple[str, ...] = (),
) -> None:
    """Collective load into the chunks (any TP/PP layout).

    ``assign=True`` makes the loaded tensors the parameters' storage (no copy); only before any DDP
    wrapping or optimizer exists (offline conversion). ``key_prefix``: the model's keys in the
    checkpoint start with it (a trainer checkpoint stores its policy under "policy.model0.").
    ``keep_own``: model keys starting with one of these are not read and keep the model's own
    initialisation (the PPO value head, which a language-model checkpoint does not have); ``keep_own_names``: the
    same for keys whose last part is one of these (LoRA's lora_A / lora_B in every layer). The files are checked
    against the checkpoint's digest manifest first, by rank 0 (the process switch: --no-verify)."""
    from megatron.core import dist_checkpointing

    from megatron_spo.checkpoint_digest import verify_checkpoint
    from megatron_spo.models.dcp_metadata import validate_dist_checkpoint

    ckpt_dir = Path(ckpt_dir)
    if not (ckpt_dir / "metadata.json").is_file():
        raise FileNotFoundError(f"{ckpt_dir}: not a megatron dist checkpoint (no metadata.json)")
    verify_checkpoint(ckpt_dir, collective=True)
    validate_dist_checkpoint(ckpt_dir)  # before megatron unpickles anything in it
    own = tuple(key_prefix + k for k in keep_own)

    def kept(key: str, prefixes: tuple[str, ...]) -> bool:
        return bool(prefixes and key.startswith(prefixes)) or key.rsplit(".", 1)[-1] in keep_own_names

    request = {name: {k: v for k, v in sd.items() if not kept(k, own)}
               for name, sd in _sharded_state_dict(model_chunks, key_prefix).items()}
    _check_keys_present(request, ckpt_dir)
    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException

    try:
        loaded = dist_checkpointing.load(request, str(ckpt_dir))
    except CheckpointException as err:  # a damaged record: every rank's traceback in one exception
        from megatron_spo.models.dcp_metadata import CheckpointFileError, load_failure

        raise CheckpointFileError(f"{ckpt_dir}: reading the checkpoint failed: {load_failure(err)}") from None
    for i, chunk in enumerate(model_chunks):
        state = {k[len(key_prefix):]: v for k, v in loaded[f"chunk{i}"].items() if not k.endswith("._extra_state")}
        missing, unexpected = _unwrap(chunk).load_state_dict(state, strict=False, assign=assign)
        missing = [k for k in missing if not k.endswith("._extra_state") and not kept(k, keep_own)]
        if missing or unexpected:
            raise ValueError(
                f"{ckpt_dir}: checkpoint does not fit the model (missing {missing[:3]}, unexpected {unexpected[:3]})"
            )


def _check_keys_present(request: dict, ckpt_dir: Path) -> None:
    """One-line error naming a tensor the model needs and the checkpoint lacks (megatron's loader reports it
    as a KeyError deep inside a multi-rank CheckpointException)."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    stored = dist_checkpointing.load_tensors_metadata(str(ckpt_dir))
    wanted = [v.key for v in nested_values(request) if isinstance(v, (ShardedTensor, ShardedTensorFactory))]
    missing = sorted({k for k in wanted if k not in stored})
    if missing:
        raise ValueError(f"{ckpt_dir}: checkpoint does not fit the model: it has no tensor '{missing[0]}'"
                         + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))


def read_megatron_config(ckpt_dir: str | Path) -> ModelConfig:
    path = Path(ckpt_dir) / MODEL_CONFIG_NAME
    if not path.is_file():
        raise FileNotFoundError(
            f"{ckpt_dir}: no {MODEL_CONFIG_NAME} (written by megatron-spo convert and with trainer checkpoints)"
        )
    from pydantic import ValidationError

    from megatron_spo.models.dcp_metadata import CheckpointFileError
    from megatron_spo.models.hf_checkpoint import pydantic_field_error

    try:
        raw = json.loads(path.read_text())
    except (ValueError, RecursionError) as err:
        raise CheckpointFileError(f"{path}: invalid JSON ({type(err).__name__}: {str(err)[:100]})") from None
    if not isinstance(raw, dict):
        raise CheckpointFileError(f"{path}: not a JSON object")
    try:
        return ModelConfig.model_validate(raw)
    except ValidationError as err:
        raise CheckpointFileError(f"{path}: {pydantic_field_error(err)}") from None


def checkpoint_dtype(cfg: ModelConfig) -> torch.dtype:
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[cfg.params_dtype]


# ---------------------------------------------------------------------------------------------
# Conversion: the ShardedTensors of every mapped parameter, to read or write them one at a time
# ---------------------------------------------------------------------------------------------
@dataclass
class MappedEntry:
    """One hf_map rule at one layer and the ShardedTensors that hold it in a checkpoint.

    ``parts`` has one ShardedTensor, or two for linear_fc1 (megatron stores the gate and up halves as
    separate shards: part 0 is exactly HF gate_proj, part 1 up_proj)."""

    rule: object  # hf_map.Rule
    layer: int | None
    parts: list


def mapped_sharded_tensors(model) -> tuple[dict, list[MappedEntry]]:
    """The sharded state dict of one TP = PP = 1 model with its factories applied, and an entry per
    mapped parameter in HF checkpoint order (embeddings, layers, final norm, LM head).

    Replacing a part's ``data`` redirects what a save writes or where a load reads into: conversion
    streams tensors through it without ever filling the model's own parameters. Raises if the state
    dict holds a tensor no rule maps (it would be saved uninitialised)."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories

    from megatron_spo.models.hf_map import local_entries

    model = _unwrap(model)
    entries: list[MappedEntry] = []
    by_address: dict[int, tuple[MappedEntry, int]] = {}
    for rule, layer, param in local_entries([model]):
        entry = MappedEntry(rule, layer, [])
        entries.append(entry)
        by_address[param.data_ptr()] = (entry, 0)
        if rule.kind == "fc1":
            by_address[param.data_ptr() + param.numel() // 2 * param.element_size()] = (entry, 1)
    sharded = model.sharded_state_dict()
    apply_factories(sharded)
    for st in nested_values(sharded):
        if not isinstance(st, ShardedTensor):
            continue
        found = by_address.get(st.data.data_ptr()) if st.data is not None else None
        if found is None:
            raise ValueError(f"megatron_checkpoint: sharded tensor '{st.key}' is not covered by hf_map")
        entry, part = found
        entry.parts.append((part, st))
    for entry in entries:
        entry.parts = [st for _, st in sorted(entry.parts, key=lambda p: p[0])]
        expected = 2 if entry.rule.kind == "fc1" else 1
        if len(entry.parts) != expected:
            raise ValueError(
                f"megatron_checkpoint: {entry.rule.megatron} (layer {entry.layer}) has {len(entry.parts)} "
                f"sharded tensors, expected {expected}"
            )
    return sharded, entries


def load_parts(parts: list, ckpt_dir: str | Path, key_prefix: str = "") -> None:
    """Fill the ``data`` of these ShardedTensors from the checkpoint (only their bytes are read).

    ``key_prefix`` is prepended to every key (a trainer checkpoint stores the policy under
    "policy.model0." and so on, next to optimizer state that is never read)."""
    from dataclasses import replace

    from megatron.core import dist_checkpointing

    from megatron_spo.models.dcp_metadata import validate_dist_checkpoint

    validate_dist_checkpoint(ckpt_dir)  # cached: once per checkpoint
    request = {}
    for i, st in enumerate(parts):
        # A layer's tensor is one slice of a stacked [num_layers, ...] tensor. Stated with explicit unit
        # axes instead of megatron's prepended ones, it may be requested alone (the prepended form
        # expects every layer of the stack on some rank).
        ones = (1,) * st.prepend_axis_num
        request[f"t{i}"] = replace(
            st,
            key=key_prefix + st.key,
            data=st.data.view(ones + tuple(st.local_shape)),
            local_shape=ones + tuple(st.local_shape),
            prepend_axis_num=0,
        )
    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException

    try:
        loaded = dist_checkpointing.load(request, str(ckpt_dir), validate_access_integrity=False)
    except (Exception, CheckpointException) as err:  # a damaged record: every rank's traceback in one exception
        from megatron_spo.models.dcp_metadata import CheckpointFileError, load_failure

        keys = sorted({key_prefix + st.key for st in parts})
        raise CheckpointFileError(f"{ckpt_dir}: reading tensor '{keys[0]}'" + (f" (or {len(keys) - 1} more)" if
                                  len(keys) > 1 else "") + f" failed: {load_failure(err)}") from None
    for i, st in enumerate(parts):
        if loaded[f"t{i}"].data_ptr() != st.data.data_ptr():  # the strategy fills the given tensors in place
            st.data.copy_(loaded[f"t{i}"].view(st.data.shape))


# ---------------------------------------------------------------------------------------------
# Zero-copy reads of a torch_dist checkpoint (conversion to HF)
# ---------------------------------------------------------------------------------------------
class _ViewFile(io.RawIOBase):
    """A read-only, seekable file over a memoryview (zipfile reads the blob's directory through it)."""

    def __init__(self, view: memoryview):
        self._view, self._pos = view, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, pos: int, whence: int = 0) -> int:
        self._pos = {0: 0, 1: self._pos, 2: len(self._view)}[whence] + pos
        return self._pos

    def readinto(self, buffer) -> int:
        n = max(0, min(len(buffer), len(self._view) - self._pos))
        buffer[:n] = self._view[self._pos : self._pos + n]
        self._pos += n
        return n


class _TensorPickle(pickle.Unpickler):
    """Reads the data.pkl of a torch.save'd plain tensor without building it: returns
    (storage key, dtype, storage_offset, size, stride). Anything else raises (callers fall back)."""

    def find_class(self, module: str, name: str):
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return lambda storage, offset, size, stride, *rest: (storage, offset, tuple(size), tuple(stride))
        if (module, name) == ("collections", "OrderedDict"):
            return collections.OrderedDict
        if module == "torch" and name.endswith("Storage"):
            return name
        raise pickle.UnpicklingError(f"{module}.{name}")

    def persistent_load(self, pid):
        kind, storage_type, key, _location, numel = pid
        if kind != "storage":
            raise pickle.UnpicklingError(kind)
        return (key, storage_type, numel)


_STORAGE_DTYPES = {
    "FloatStorage": torch.float32,
    "BFloat16Storage": torch.bfloat16,
    "HalfStorage": torch.float16,
    "DoubleStorage": torch.float64,
}


def _record_start(blob: memoryview, record: zipfile.ZipInfo) -> int:
    """Offset in the blob of an uncompressed zip record's bytes (after its local header). Read directly:
    checkpoints written here skip the zip CRC32 (torch.load never checks it), which zipfile refuses."""
    header = bytes(blob[record.header_offset : record.header_offset + 30])
    if header[:4] != b"PK\x03\x04" or record.compress_type != zipfile.ZIP_STORED:
        raise ValueError("not an uncompressed zip record")
    name_len, extra_len = struct.unpack("<HH", header[26:30])
    return record.header_offset + 30 + name_len + extra_len


def _record(blob: memoryview, record: zipfile.ZipInfo) -> bytes:
    start = _record_start(blob, record)
    return bytes(blob[start : start + record.file_size])


class MappedTorchDist:
    """Tensors of a torch_dist checkpoint viewed in place through a memory map (no read into new memory).

    Every stored chunk is one torch.save blob (an uncompressed zip) inside a .distcp file. When a
    request is exactly one stored chunk (same key, offsets and sizes: the common case of a checkpoint
    read under the layout, or the TP = 1 split, it was written with), ``get`` returns a read-only view
    of its bytes in the page cache; otherwise None, and the caller reads it the regular way
    (dist_checkpointing.load: resharding, other formats). Views must not be written to.
    """

    def __init__(self, dist_dir: str | Path):
        from megatron_spo.models.dcp_metadata import validate_dist_checkpoint

        self.dir = Path(dist_dir)
        metadata = validate_dist_checkpoint(self.dir)
        self._where = {(index.fqn, tuple(index.offset or ())): info for index, info in metadata.storage_data.items()}
        self._maps: dict[str, mmap.mmap] = {}

    def get(self, key: str, offsets: tuple[int, ...], sizes: tuple[int, ...], dtype: torch.dtype):
        info = self._where.get((key, tuple(offsets)))
        if info is None or getattr(info, "transform_descriptors", None):
            return None
        try:
            return self._blob_tensor(info, tuple(sizes), dtype)
        except (KeyError, ValueError, pickle.UnpicklingError, zipfile.BadZipFile, TypeError):
            return None

    def _blob_tensor(self, info, sizes: tuple[int, ...], dtype: torch.dtype):
        if info.relative_path not in self._maps:
            with open(self.dir / info.relative_path, "rb") as f:
                self._maps[info.relative_path] = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        mm = self._maps[info.relative_path]
        blob = memoryview(mm)[info.offset : info.offset + info.length]
        with zipfile.ZipFile(_ViewFile(blob)) as archive:  # only its directory is read through zipfile
            records = {r.filename: r for r in archive.infolist()}
        root = next(iter(records)).split("/")[0]
        if f"{root}/byteorder" in records and _record(blob, records[f"{root}/byteorder"]) != sys.byteorder.encode():
            return None
        pickled = _TensorPickle(io.BytesIO(_record(blob, records[f"{root}/data.pkl"])))
        (key, storage_type, numel), offset, size, stride = pickled.load()
        data = records[f"{root}/data/{key}"]
        contiguous = tuple(int(s) for s in torch.empty(size, device="meta").stride())
        if (_STORAGE_DTYPES.get(storage_type) != dtype or offset != 0 or size != sizes or stride != contiguous
                or numel != math.prod(sizes) or data.file_size != numel * dtype.itemsize):
            return None
        start = info.offset + _record_start(blob, data)
        if numel == 0:
            return torch.empty(sizes, dtype=dtype)
        with warnings.catch_warnings():  # the map is read-only, and so is every use of these views
            warnings.simplefilter("ignore", UserWarning)
            flat = torch.frombuffer(mm, dtype=dtype, count=numel, offset=start)
        return flat.view(sizes)
