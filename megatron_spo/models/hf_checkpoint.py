"""Read and write real Hugging Face checkpoints of the registered families: config.json, (sharded) safetensors, index.

    cfg = read_hf_config(hf_dir)                  # ModelConfig; refuses unsupported architectures
    reader = HFReader(hf_dir); reader.validate(cfg)   # missing / extra / wrong-shape tensors -> HFCheckpointError
    t = reader.get("model.layers.0.mlp.up_proj.weight")    # one tensor at a time (lazy safetensors)
    v = reader.view("model.embed_tokens.weight")           # zero-copy: a private memory map of the file
    with HFWriter(out_dir, max_shard_bytes=5 * 2**30) as w: w.add(name, tensor)   # buffered shards + index
    with HFStreamWriter(out_dir, shapes, dtype) as w: w.add(name, tensor)  # planned: bytes go straight to disk
    write_hf_config(out_dir, cfg)

Both writers leave a digest manifest (digests.json: checkpoint_digest.py) next to the shards, which HFReader checks
before it reads; config.json and tokenizer files written afterwards by write_hf_config / copy_tokenizer_files are
added to it. Errors are one line naming the tensor or config.json field.
"""

from __future__ import annotations

import json
import mmap
import os
import shutil
from pathlib import Path

import torch
from pydantic import ValidationError
from safetensors import safe_open
from safetensors.torch import save_file

from megatron_spo.checkpoint_digest import (
    add_to_manifest,
    file_digest,
    new_hash,
    verify_checkpoint,
    write_manifest,
)
from megatron_spo.config import ConfigError
from megatron_spo.fsutil import fsync_path
from megatron_spo.models.arch import architecture, architecture_of_hf, supported_hf_classes
from megatron_spo.models.arch.base import HFConfigFields, UnsupportedHFConfig
from megatron_spo.models.config import ModelConfig
from megatron_spo.models.hf_map import hf_shapes

SUPPORTED_ARCHITECTURES = tuple(supported_hf_classes())
INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
# Files copied through conversions so the output loads in transformers / SGLang unchanged.
TOKENIZER_PATTERNS = (
    "tokenizer*",
    "special_tokens_map.json",
    "generation_config.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "*.tiktoken",
    "chat_template*",
)
# safetensors dtype names (the file format's own table).
_ST_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
_ST_NAMES = {dtype: name for name, dtype in _ST_DTYPES.items()}
# dtypes a safetensors file may hold that no weight we convert is in (8-bit floats, unsigned ints)
_ST_OTHER_ITEMSIZE = {"F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1, "U16": 2, "U32": 4, "U64": 8}
WEIGHT_DTYPES = ("F32", "F16", "BF16", "F64")
# Tensors some checkpoints carry that hold no weights (recomputed from config).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


class HFCheckpointError(ValueError):
    """A Hugging Face checkpoint that cannot be converted; the message names the tensor or field."""


# ---------------------------------------------------------------------------------------------
# config.json <-> ModelConfig
# ---------------------------------------------------------------------------------------------
def read_hf_config(hf_dir: str | Path) -> ModelConfig:
    """ModelConfig from config.json (a registered family; unsupported features are refused by field name)."""
    path = Path(hf_dir) / "config.json"
    if not path.is_file():
        raise HFCheckpointError(f"{path}: config.json not found")
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise HFCheckpointError(f"{path}: invalid JSON ({err.msg} at line {err.lineno})") from None
    except (ValueError, RecursionError) as err:  # undecodable bytes, absurd nesting
        raise HFCheckpointError(f"{path}: unreadable JSON ({type(err).__name__})") from None
    if not isinstance(raw, dict):
        raise HFCheckpointError(f"{path}: not a JSON object")
    return hf_config_to_model_config(raw, source=str(path))


# ModelConfig field -> the config.json field it is read from (the names the user sees in the file)
HF_FIELD_NAMES = {"num_layers": "num_hidden_layers", "ffn_hidden_size": "intermediate_size",
                  "num_query_groups": "num_key_value_heads", "norm_epsilon": "rms_norm_eps", "kv_channels": "head_dim"}


def pydantic_field_error(err, names: dict | None = None) -> str:
    """A pydantic ValidationError as one line naming its first field and value (``names`` renames fields)."""
    first = err.errors()[0]
    loc = ".".join(str(p) for p in first.get("loc", ()))
    field = (names or {}).get(loc, loc)
    value = repr(first.get("input"))
    value = value if len(value) <= 40 else value[:37] + "..."
    msg = first.get("msg", "invalid").removeprefix("Value error, ")
    return f"field '{field}': {msg} (got {value})" if loc else msg


def hf_config_to_model_config(raw: dict, source: str = "config.json") -> ModelConfig:
    """The family's reading of config.json (models/arch/); fields it cannot honour are refused by name."""
    try:
        family = architecture_of_hf(raw, source)
        fields = family.read_hf(HFConfigFields(raw, source))
        return ModelConfig(architecture=family.name, **fields)
    except UnsupportedHFConfig as err:
        raise HFCheckpointError(str(err)) from None
    except ValidationError as err:
        raise HFCheckpointError(f"{source}: {pydantic_field_error(err, HF_FIELD_NAMES)}") from None
    except (ValueError, ConfigError, KeyError) as err:
        if isinstance(err, KeyError):
            raise HFCheckpointError(f"{source}: missing field {err}") from None
        lines = [ln.strip() for ln in str(err).splitlines() if ln.strip() and "errors.pydantic.dev" not in ln]
        raise HFCheckpointError(f"{source}: {lines[-1] if lines else err}") from None


def model_config_to_hf_config(cfg: ModelConfig, extra: dict | None = None) -> dict:
    """config.json contents for the config's family; token ids of ``extra`` (the source config) ride along."""
    return architecture(cfg.architecture).hf_config(cfg, extra)


def write_hf_config(out_dir: str | Path, cfg: ModelConfig, extra: dict | None = None) -> None:
    (Path(out_dir) / "config.json").write_text(
        json.dumps(model_config_to_hf_config(cfg, extra), indent=2) + "\n"
    )
    add_to_manifest(out_dir, ["config.json"])  # an export's manifest (if the shards wrote one) lists it too


def copy_tokenizer_files(src: str | Path, dst: str | Path) -> list[str]:
    """Copy tokenizer / generation config files from src to dst; returns the names copied."""
    copied = []
    for pattern in TOKENIZER_PATTERNS:
        for path in sorted(Path(src).glob(pattern)):
            if path.is_file() and path.name not in copied:
                shutil.copy2(path, Path(dst) / path.name)
                copied.append(path.name)
    add_to_manifest(dst, copied)
    return copied


# ---------------------------------------------------------------------------------------------
# Tensors
# ---------------------------------------------------------------------------------------------
MAX_HEADER_BYTES = 100 * 2**20  # safetensors' own limit


def read_safetensors_header(path: str | Path) -> tuple[dict, int]:
    """The header of a .safetensors file, checked against the file before anything trusts it: length within
    the file, JSON object, known dtype, shape of non-negative ints, data offsets inside the data section and
    matching the shape. Returns (header without __metadata__, data start offset)."""
    path = Path(path)
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        n = int.from_bytes(head, "little") if len(head) == 8 else -1
        if n <= 0 or n > min(size - 8, MAX_HEADER_BYTES):
            raise HFCheckpointError(f"{path}: not a safetensors file (header length {n} for a file of {size} bytes)")
        raw = f.read(n)
    try:
        header = json.loads(raw)
    except (ValueError, RecursionError) as err:
        raise HFCheckpointError(f"{path}: not a safetensors file (header is not JSON: {type(err).__name__})") from None
    if not isinstance(header, dict):
        raise HFCheckpointError(f"{path}: not a safetensors file (header is not a JSON object)")
    header.pop("__metadata__", None)
    data_size = size - 8 - n
    for name, info in header.items():
        def bad(what: str, name=name):
            return HFCheckpointError(f"{path}: tensor '{name}' {what}")

        if not isinstance(info, dict):
            raise bad("has no header entry object")
        dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
        if dtype not in _ST_DTYPES and dtype not in _ST_OTHER_ITEMSIZE:
            raise bad(f"has unknown dtype {str(dtype)[:20]!r}")
        if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
            raise bad(f"has shape {str(shape)[:40]}")
        if (not isinstance(offsets, list) or len(offsets) != 2 or not all(type(o) is int for o in offsets)
                or not 0 <= offsets[0] <= offsets[1] <= data_size):
            raise bad(f"has data_offsets {str(offsets)[:40]} outside the data section ({data_size} bytes): "
                      f"truncated or corrupt")
        itemsize = _ST_DTYPES[dtype].itemsize if dtype in _ST_DTYPES else _ST_OTHER_ITEMSIZE[dtype]
        if offsets[1] - offsets[0] != _numel(shape) * itemsize:
            raise bad(f"spans {offsets[1] - offsets[0]} bytes, its shape {shape} of {dtype} needs "
                      f"{_numel(shape) * itemsize}")
    return header, 8 + n


class MappedSafetensors:
    """Zero-copy tensors of one .safetensors file, through a private (copy-on-write) memory map.

    The file format: 8 bytes little-endian header length N, N bytes of JSON {name: {dtype, shape,
    data_offsets: [begin, end]}} (offsets relative to byte 8 + N), then the data. A tensor returned by
    ``tensor()`` reads straight from the page cache: no allocation, no copy; the map lives as long as
    any tensor made from it. Writes to such a tensor stay private (the file never changes).
    """

    def __init__(self, path: str | Path):
        self.path = Path(path)
        header, self._data_start = read_safetensors_header(self.path)
        with open(self.path, "rb") as f:
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        self.header: dict[str, dict] = header

    def tensor(self, name: str) -> torch.Tensor:
        info = self.header[name]
        dtype = _ST_DTYPES.get(info["dtype"])
        if dtype is None:
            raise HFCheckpointError(f"{self.path}: tensor '{name}' has unsupported dtype {info['dtype']}")
        begin, end = info["data_offsets"]
        shape = tuple(info["shape"])
        count = (end - begin) // dtype.itemsize
        if count == 0:
            return torch.empty(shape, dtype=dtype)
        flat = torch.frombuffer(self._map, dtype=dtype, count=count, offset=self._data_start + begin)
        return flat.view(shape)


class HFReader:
    """Lazy access to the tensors of an HF checkpoint (single file or sharded with an index). Its files are checked
    against its digest manifest first (``verify``: None follows the process switch, --no-verify)."""

    def __init__(self, hf_dir: str | Path, verify: bool | None = None):
        self.dir = Path(hf_dir)
        if not self.dir.is_dir():
            raise HFCheckpointError(f"{self.dir}: not a directory")
        verify_checkpoint(self.dir, verify=verify)
        index = self.dir / INDEX_NAME
        self._headers: dict[str, dict] = {}
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (ValueError, KeyError, TypeError, RecursionError):
                raise HFCheckpointError(f"{index}: not a safetensors index (no 'weight_map')") from None
            if not isinstance(weight_map, dict) or not all(
                    isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()):
                raise HFCheckpointError(f"{index}: 'weight_map' is not an object of tensor name -> shard file")
            for name, file in weight_map.items():
                if Path(file).name != file or file in ("", ".", ".."):
                    raise HFCheckpointError(f"{index}: tensor '{name}' is indexed in '{file[:80]}', not a file "
                                            f"name in this directory")
        elif (self.dir / SINGLE_NAME).is_file():
            weight_map = {name: SINGLE_NAME for name in self._header(SINGLE_NAME)}
        else:
            raise HFCheckpointError(f"{self.dir}: no {INDEX_NAME} or {SINGLE_NAME}")
        self.weight_map: dict[str, str] = weight_map
        self._handles: dict[str, object] = {}
        self._maps: dict[str, MappedSafetensors] = {}

    def names(self) -> list[str]:
        return list(self.weight_map)

    def _header(self, file: str) -> dict:
        if file not in self._headers:
            self._headers[file] = read_safetensors_header(self.dir / file)[0]
        return self._headers[file]

    def _handle(self, name: str):
        if name not in self.weight_map:
            raise HFCheckpointError(f"{self.dir}: missing tensor '{name}'")
        file = self.weight_map[name]
        if file not in self._handles:
            path = self.dir / file
            if not path.is_file():
                raise HFCheckpointError(
                    f"{self.dir}: tensor '{name}' is indexed in '{file}', which does not exist"
                )
            self._header(file)  # validated before safetensors reads it
            try:
                self._handles[file] = safe_open(path, framework="pt")
            except Exception as err:  # safetensors' own checks (SafetensorError)
                raise HFCheckpointError(f"{path}: not a readable safetensors file ({err})") from None
        if name not in self._header(file):
            raise HFCheckpointError(f"{self.dir}: tensor '{name}' is indexed in '{file}', which does not hold it")
        return self._handles[file]

    def _header_of_shard(self, file: str) -> dict:
        if not (self.dir / file).is_file():
            name = next(n for n, f in self.weight_map.items() if f == file)
            raise HFCheckpointError(f"{self.dir}: tensor '{name}' is indexed in '{file}', which does not exist")
        return self._header(file)

    def dtype_name(self, name: str) -> str:
        """The tensor's safetensors dtype name (F32, BF16, I8 ...)."""
        self._handle(name)
        return self._header(self.weight_map[name])[name]["dtype"]

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._handle(name).get_slice(name).get_shape())

    def get(self, name: str) -> torch.Tensor:
        """The tensor, in memory of its own (a copy out of the file)."""
        return self._handle(name).get_tensor(name)

    def view(self, name: str) -> torch.Tensor:
        """The tensor as a zero-copy view of the memory-mapped file (see MappedSafetensors)."""
        self._handle(name)  # the same one-line errors for a missing tensor or shard as get()
        file = self.weight_map[name]
        if file not in self._maps:
            self._maps[file] = MappedSafetensors(self.dir / file)
        return self._maps[file].tensor(name)

    def validate(self, cfg: ModelConfig) -> None:
        """Every tensor config.json implies is present with the right shape, and nothing else is."""
        expected = hf_shapes(cfg)
        present = {n for n in self.names() if not n.endswith(_IGNORED_SUFFIXES)}
        if cfg.tie_word_embeddings:
            present.discard("lm_head.weight")  # some tied checkpoints store it anyway
        for name, shape in expected.items():
            if name not in present:
                raise HFCheckpointError(
                    f"{self.dir}: missing tensor '{name}' (config.json expects shape {list(shape)})"
                )
            got = self.shape(name)
            if got != shape:
                raise HFCheckpointError(
                    f"{self.dir}: tensor '{name}' has shape {list(got)} but config.json implies {list(shape)}"
                )
            dtype = self.dtype_name(name)
            if dtype not in WEIGHT_DTYPES:
                raise HFCheckpointError(f"{self.dir}: tensor '{name}' is stored as {dtype}: quantized / integer "
                                        f"weights are not converted (supported: {', '.join(WEIGHT_DTYPES)})")
        for file in sorted(set(self.weight_map.values())):  # the index against the shards, both ways
            unlisted = sorted(n for n in self._header_of_shard(file) if self.weight_map.get(n) != file)
            if unlisted:
                raise HFCheckpointError(f"{self.dir}: shard '{file}' holds tensor '{unlisted[0]}', which "
                                        f"{INDEX_NAME} does not list in it")
        extra = sorted(present - set(expected))
        if extra:
            more = f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""
            raise HFCheckpointError(
                f"{self.dir}: unexpected tensor '{extra[0]}'{more} not in a "
                f"{architecture(cfg.architecture).hf_class} with this config.json"
            )

    def total_bytes(self) -> int:
        return sum((self.dir / f).stat().st_size for f in set(self.weight_map.values()))


class HFWriter:
    """Streams tensors into safetensors shards of at most ``max_shard_bytes`` plus the index JSON."""

    def __init__(self, out_dir: str | Path, max_shard_bytes: int = 5 * 2**30):
        self.dir = Path(out_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.max_shard_bytes = max_shard_bytes
        self._pending: dict[str, torch.Tensor] = {}
        self._pending_bytes = 0
        self._shards: list[list[str]] = []
        self._digests: list[tuple[int, str]] = []
        self.total_bytes = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        nbytes = tensor.numel() * tensor.element_size()
        if self._pending and self._pending_bytes + nbytes > self.max_shard_bytes:
            self._flush()
        self._pending[name] = tensor.detach().contiguous()
        self._pending_bytes += nbytes
        self.total_bytes += nbytes

    def _flush(self) -> None:
        if not self._pending:
            return
        path = _shard_tmp_path(self.dir, len(self._shards))
        save_file(self._pending, path, metadata={"format": "pt"})
        fsync_path(path)
        self._digests.append(file_digest(path))  # just written: read from the page cache
        self._shards.append(list(self._pending))
        self._pending, self._pending_bytes = {}, 0

    def close(self) -> None:
        self._flush()
        _finalise_shards(self.dir, self._shards, self.total_bytes, self._digests)

    def __enter__(self) -> HFWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()


class HFStreamWriter:
    """Writes tensors whose names, shapes and dtype are known in advance straight into safetensors shards.

    The shard layout and every header are planned up front (consecutive tensors, at most
    ``max_shard_bytes`` per shard unless one tensor is larger), so each ``add`` writes its bytes at
    once and keeps no reference: peak memory is the caller's one tensor. ``add`` must follow the
    order of ``shapes``; a tensor may come in any shape with the planned number of elements (its
    row-major order is what is written), so strided views need no copy. Shards are fsync'd, then
    renamed to model-0000i-of-0000n.safetensors with the index written last.
    """

    def __init__(
        self,
        out_dir: str | Path,
        shapes: dict[str, tuple[int, ...]],
        dtype: torch.dtype,
        max_shard_bytes: int = 5 * 2**30,
    ):
        self.dir = Path(out_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.dtype = dtype
        self.shapes = dict(shapes)
        nbytes = {name: _numel(shape) * dtype.itemsize for name, shape in self.shapes.items()}
        self.total_bytes = sum(nbytes.values())
        self._shards: list[list[str]] = [[]]
        size = 0
        for name in self.shapes:
            if self._shards[-1] and size + nbytes[name] > max_shard_bytes:
                self._shards.append([])
                size = 0
            self._shards[-1].append(name)
            size += nbytes[name]
        self._order = list(self.shapes)
        self._next = 0
        self._shard_of = {name: i for i, names in enumerate(self._shards) for name in names}
        self._file = None
        self._hash = None  # the open shard's digest, updated with every byte written (no second read)
        self._size = 0
        self._digests: list[tuple[int, str]] = []

    def _tmp_path(self, shard: int) -> Path:
        return _shard_tmp_path(self.dir, shard)

    def _open_shard(self, shard: int) -> None:
        header: dict = {"__metadata__": {"format": "pt"}}
        offset = 0
        for name in self._shards[shard]:
            end = offset + _numel(self.shapes[name]) * self.dtype.itemsize
            header[name] = {"dtype": _ST_NAMES[self.dtype], "shape": list(self.shapes[name]),
                            "data_offsets": [offset, end]}
            offset = end
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned
        self._file = open(self._tmp_path(shard), "wb")
        self._hash, self._size = new_hash(), 0
        self._write(len(raw).to_bytes(8, "little"))
        self._write(raw)

    def _write(self, data) -> None:
        self._file.write(data)
        self._hash.update(data)
        self._size += memoryview(data).nbytes

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if self._next >= len(self._order) or name != self._order[self._next]:
            expected = self._order[self._next] if self._next < len(self._order) else "nothing more"
            raise HFCheckpointError(f"HFStreamWriter: got tensor '{name}', expected '{expected}'")
        shape = self.shapes[name]
        if tensor.numel() != _numel(shape) or tensor.dtype != self.dtype:
            raise HFCheckpointError(
                f"HFStreamWriter: tensor '{name}' is {list(tensor.shape)} {tensor.dtype}, "
                f"planned {list(shape)} {self.dtype}"
            )
        shard = self._shard_of[name]
        if self._file is None:
            self._open_shard(shard)
        for block in _contiguous_blocks(tensor.detach().cpu()):
            self._write(block.reshape(-1).view(torch.uint8).numpy())
        self._next += 1
        if name == self._shards[shard][-1]:
            self._file.flush()
            os.fsync(self._file.fileno())
            self._file.close()
            self._file = None
            self._digests.append((self._size, self._hash.hexdigest()))

    def close(self) -> None:
        if self._next != len(self._order):
            raise HFCheckpointError(
                f"HFStreamWriter: closed after {self._next} of {len(self._order)} tensors "
                f"(next: '{self._order[self._next]}')"
            )
        _finalise_shards(self.dir, self._shards, self.total_bytes, self._digests)

    def __enter__(self) -> HFStreamWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        if exc_type is None:
            self.close()


def _shard_tmp_path(out_dir: Path, shard: int) -> Path:
    return out_dir / f"shard-{shard:05d}.tmp"


def _finalise_shards(out_dir: Path, shards: list[list[str]], total_bytes: int,
                     digests: list[tuple[int, str]]) -> None:
    """Both writers' last step: the fsync'd temporary shards renamed to model-0000i-of-0000n.safetensors, then
    the index written (last, so a crash before it leaves no index pointing at missing files), then the digest
    manifest of both (``digests``: each shard's (size, digest), computed by the writer)."""
    n = len(shards)
    weight_map, known = {}, {}
    for i, names in enumerate(shards):
        final = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        _shard_tmp_path(out_dir, i).rename(out_dir / final)
        weight_map.update({name: final for name in names})
        known[final] = digests[i]
    index = {"metadata": {"total_size": total_bytes}, "weight_map": weight_map}
    (out_dir / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
    fsync_path(out_dir / INDEX_NAME)
    write_manifest(out_dir, [*known, INDEX_NAME], known=known)


def _contiguous_blocks(tensor: torch.Tensor):
    """Contiguous pieces of ``tensor`` in row-major order (the tensor itself if it is contiguous)."""
    if tensor.numel() == 0:
        return
    if tensor.is_contiguous():
        yield tensor
        return
    for row in tensor:
        yield from _contiguous_blocks(row)


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
