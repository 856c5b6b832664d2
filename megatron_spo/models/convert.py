"""`megatron-spo convert`: HF <-> Megatron checkpoints of any registered family, streaming.

    megatron-spo convert hf-to-megatron --hf HF_DIR --out MEGATRON_DIR
    megatron-spo convert megatron-to-hf --megatron MEGATRON_DIR --out HF_DIR
    (megatron-spo check-conversion: models/check_conversion.py)

The Megatron side is a megatron-core dist checkpoint (loads under any TP/PP). megatron-to-hf also
reads the trainer's checkpoints: a step directory RUN_DIR/checkpoints/iter_NNNNNNN, the checkpoints
directory or RUN_DIR itself (the latest complete step); only the policy's weights are read, never the
optimizer state. Output is written to OUT.tmp, fsync'd, and renamed to OUT at the end, so nothing
half-written looks valid; an existing OUT is never overwritten. The HF input is validated (architecture,
config.json fields, safetensors headers and index, every tensor's presence, shape and float dtype, finite
values) before anything is written. A Megatron input is data, never code (models/dcp_metadata.py), and must
correspond to its model_config.json both ways: every implied tensor stored with its shape, every stored
policy tensor used. NaN / inf weights are refused by name unless --allow-nonfinite (forensics). Every input is
checked against its digest manifest before anything reads it (a flipped byte is one line naming the file;
--no-verify for a user's own hand-edited files), and every output carries one (checkpoint_digest.py).

Memory and passes: conversion never fills the model's own parameters (they only name and shape the
checkpoint's tensors). hf-to-megatron hands the checkpoint writer zero-copy views of the
memory-mapped HF files (page cache, not process memory); only the interleaved QKV weight is built in
memory, one layer at a time as the writer reaches it. megatron-to-hf views every stored chunk that is
exactly a tensor it needs in place (memory map) and writes its bytes straight into the HF shard;
anything else (a checkpoint written with TP > 1) is read one layer at a time into buffers reused from
layer to layer.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import sys
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path

from megatron_spo.checkpoint_digest import (
    CheckpointDigestError,
    complete_manifest,
    verification,
    verify_checkpoint,
)
from megatron_spo.config import ConfigError
from megatron_spo.fsutil import fsync_path, fsync_tree
from megatron_spo.memory import MemoryPreflightError
from megatron_spo.models.config import ModelConfig, ParallelConfig
from megatron_spo.models.hf_checkpoint import (
    HFCheckpointError,
    HFReader,
    HFStreamWriter,
    copy_tokenizer_files,
    read_hf_config,
    write_hf_config,
)

SOURCE_HF_CONFIG = "hf_config.json"  # the source config.json, kept in the Megatron dir for the way back


def _progress():
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=Console(stderr=True),
        disable=not sys.stderr.isatty(),  # a log file gets the result line, not every frame of a bar
    )


@contextmanager
def _atomic_dir(out: Path):
    """Yield OUT.tmp; list every file in its digest manifest, make it durable and rename it to OUT on success,
    remove it on failure."""
    if out.exists():
        raise ConfigError(f"output directory '{out}' already exists (remove it or choose another --out)")
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        yield tmp
        complete_manifest(tmp)  # the HF shards' digests were taken while writing; the rest are read here
        fsync_tree(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    os.replace(tmp, out)
    fsync_path(out.parent)  # make the rename itself durable


@contextmanager
def _single_process_world():
    """A world of one process (gloo/NCCL) with TP = PP = 1 on a store of its own, torn down afterwards."""
    from megatron_spo.models.parallel import destroy_parallel, init_parallel
    from megatron_spo.net import STORE_HOSTED_ENV

    keys = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", STORE_HOSTED_ENV)
    saved = {k: os.environ.get(k) for k in keys}
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    if os.environ["WORLD_SIZE"] == "1":  # init_parallel hosts the store on a port bound as it is chosen
        os.environ.pop("MASTER_PORT", None)
        os.environ.pop(STORE_HOSTED_ENV, None)
    try:
        yield init_parallel
    finally:
        destroy_parallel()
        for k, v in saved.items():  # a caller that launches ranks later must not look launched already
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _one_model(cfg: ModelConfig, init_parallel):
    """The TP = PP = 1 policy, parameters allocated but never written (conversion streams around them)."""
    from megatron_spo.models.builders import build_policy

    parallel = ParallelConfig()
    init_parallel(parallel, cfg)
    (model,) = build_policy(cfg, parallel, init_weights=False)
    return model


def _preflight(what: str, cfg: ModelConfig) -> None:
    """Conversion holds about one layer twice (the interleaved QKV, or a TP-sharded checkpoint's read
    buffers) and, for a TP-sharded checkpoint, one vocabulary tensor: never the model (measured at
    Llama-3.1-8B: 100 MB and 3 MB private)."""
    from megatron_spo.memory import BASELINE_BYTES, layer_and_vocab_bytes, preflight

    layer, vocab = layer_and_vocab_bytes(cfg)
    preflight(what, BASELINE_BYTES + 2 * layer + vocab, hint="conversion streams one layer at a time; free memory "
              "on this node or run on one with more")


def check_finite(tensor, name: str, where: Path) -> None:
    """Refuse NaN / inf weights by name (row blocks of ~16M elements: no model-sized temporary)."""
    import torch

    if tensor.dim() == 0:
        tensor = tensor.reshape(1)
    rows = max(1, (1 << 24) // max(1, tensor[0].numel()))  # views of the tensor (often strided): never a copy
    for start in range(0, tensor.shape[0], rows):
        block = tensor[start:start + rows]
        # a sum is NaN / inf when any element is (a finite overflow only sends it to the exact check); ~10x
        # faster than isfinite on every element
        if not bool(torch.isfinite(block.sum())) and not bool(torch.isfinite(block).all()):
            bad = (~torch.isfinite(block)).nonzero()[0]
            index = [start + int(bad[0]), *(int(i) for i in bad[1:])]
            raise HFCheckpointError(f"{where}: tensor '{name}' holds a non-finite value ({block[tuple(bad)].item()} "
                                    f"at {index}); --allow-nonfinite converts it anyway (forensics)")


def hf_to_megatron(hf_dir: str | Path, out: str | Path, allow_nonfinite: bool = False) -> None:
    hf_dir, out = Path(hf_dir), Path(out)
    if hf_dir.is_dir():
        verify_checkpoint(hf_dir)  # before config.json or any shard is read
    cfg = read_hf_config(hf_dir)
    reader = HFReader(hf_dir)
    reader.validate(cfg)
    if not allow_nonfinite:
        for name in reader.names():
            check_finite(reader.view(name), name, hf_dir)
    _preflight("convert hf-to-megatron", cfg)
    from megatron_spo.models.hf_map import checkpoint_parts, hf_names
    from megatron_spo.models.megatron_checkpoint import (
        mapped_sharded_tensors,
        save_sharded_state_dict,
        write_megatron_config,
    )

    def megatron_parts(entry, dtype):
        hf = [reader.view(name) for name in hf_names(entry.rule, entry.layer)]
        padded = entry.parts[0].local_shape[0] if entry.rule.kind == "vocab" else None
        return [t.to(dtype) for t in checkpoint_parts(entry.rule, hf, cfg, padded)]  # views, if same dtype

    with _atomic_dir(out) as tmp, _single_process_world() as init_parallel:
        sharded, entries = mapped_sharded_tensors(_one_model(cfg, init_parallel))
        deferred = {}  # QKV interleaving needs new memory: done layer by layer while writing
        for entry in entries:
            if entry.rule.kind == "qkv":  # the untouched parameter stays as the placeholder
                (st,) = entry.parts
                deferred[st.data.data_ptr()] = lambda entry=entry, dtype=st.dtype: megatron_parts(entry, dtype)[0]
                continue
            for st, tensor in zip(entry.parts, megatron_parts(entry, entry.parts[0].dtype)):
                if tuple(tensor.shape) != tuple(st.local_shape):  # (reader.validate makes this unreachable)
                    raise HFCheckpointError(
                        f"{hf_dir}: {hf_names(entry.rule, entry.layer)[0]} maps to shape {list(tensor.shape)} "
                        f"but the checkpoint stores {st.key} as {list(st.local_shape)}"
                    )
                st.data = tensor
        n_items = sum(len(e.parts) for e in entries)
        with _progress() as progress:
            task = progress.add_task("write megatron checkpoint", total=n_items)
            save_sharded_state_dict(sharded, tmp, on_item=lambda: progress.advance(task), deferred=deferred)
        write_megatron_config(tmp, cfg)
        shutil.copy2(hf_dir / "config.json", tmp / SOURCE_HF_CONFIG)
        copy_tokenizer_files(hf_dir, tmp)


# ---------------------------------------------------------------------------------------------
# megatron-to-hf: what a --megatron path is
# ---------------------------------------------------------------------------------------------
@dataclass
class MegatronSource:
    """Where the policy weights of a Megatron-side path live and how to name them."""

    dist_dir: Path  # the megatron dist checkpoint (metadata.json, .metadata, *.distcp)
    cfg: ModelConfig
    hf_extra: dict  # the original config.json (token ids ride along)
    tokenizer_dir: Path
    chunk_prefixes: tuple[str, ...] = ("",)  # key prefix of each model chunk ("policy.model0." ...)

    @functools.cached_property
    def stored(self) -> dict:
        """The checkpoint's tensor metadata by key (global size, chunks), from its .metadata file."""
        from megatron_spo.models.dcp_metadata import validate_dist_checkpoint

        return validate_dist_checkpoint(self.dist_dir).state_dict_metadata

    def key_prefix(self, key: str, layer: int | None) -> str:
        """The chunk prefix under which this checkpoint stores ``key`` (of ``layer``, stacked on dim 0)."""
        if self.chunk_prefixes == ("",):
            return ""
        for prefix in self.chunk_prefixes:
            meta = self.stored.get(prefix + key)
            if meta is not None and (layer is None or any(c.offsets[0] == layer for c in meta.chunks)):
                return prefix
        where = f" (layer {layer})" if layer is not None else ""
        raise HFCheckpointError(f"{self.dist_dir}: no policy tensor '{key}'{where} in the trainer checkpoint")

    def stored_shape(self, key: str) -> tuple[int, ...] | None:
        meta = self.stored.get(key)
        return tuple(meta.size) if meta is not None and hasattr(meta, "size") else None


def _is_dist_checkpoint(path: Path) -> bool:
    return (path / "metadata.json").is_file()


def _latest_step(checkpoints: Path) -> Path | None:
    from megatron_spo.run_layout import CheckpointDir

    found = CheckpointDir(checkpoints).latest()
    return found[1] if found else None


def find_megatron_source(path: str | Path) -> MegatronSource:
    """A convert output, a trainer step directory, a trainer checkpoints directory or a run directory
    (the last two: the latest complete step). One-line error for anything else."""
    from megatron_spo.models.dcp_metadata import validate_dist_checkpoint
    from megatron_spo.models.megatron_checkpoint import read_megatron_config
    from megatron_spo.run_layout import COMPLETE

    path = Path(path)
    if not path.is_dir():
        raise HFCheckpointError(f"{path}: no such directory")
    if _is_dist_checkpoint(path):
        verify_checkpoint(path)  # every file against its digest, then
        validate_dist_checkpoint(path)  # data, never code: before anything reads it
        return MegatronSource(path, read_megatron_config(path), _source_hf_config(path), path)
    step = path
    if not (path / COMPLETE).is_file():
        for checkpoints in (path, path / "checkpoints"):
            step = _latest_step(checkpoints) if checkpoints.is_dir() else None
            if step is not None:
                break
    if step is None or not (step / COMPLETE).is_file() or not _is_dist_checkpoint(step / "dist"):
        raise HFCheckpointError(
            f"{path}: not a Megatron checkpoint (expected a convert output with metadata.json, a trainer "
            f"step dir iter_NNNNNNN with COMPLETE and dist/, or a run/checkpoints dir with a complete step)"
        )
    verify_checkpoint(step)  # the step's manifest lists dist/ and the model description beside it
    validate_dist_checkpoint(step / "dist")
    # The trainer writes the model config, the init model's config.json and tokenizer next to dist/.
    source = MegatronSource(step / "dist", read_megatron_config(step), _source_hf_config(step), step)
    chunks = {int(k.split(".")[1][len("model"):]) for k in source.stored if k.startswith("policy.model")}
    if not chunks:
        raise HFCheckpointError(f"{step}: trainer checkpoint without policy weights ('policy.model*' keys)")
    source.chunk_prefixes = tuple(f"policy.model{i}." for i in sorted(chunks))
    return source


def _source_hf_config(path: Path) -> dict:
    file = path / SOURCE_HF_CONFIG
    if not file.is_file():
        return {}
    try:
        raw = json.loads(file.read_text())
    except (ValueError, RecursionError) as err:
        raise HFCheckpointError(f"{file}: invalid JSON ({type(err).__name__})") from None
    if not isinstance(raw, dict):
        raise HFCheckpointError(f"{file}: not a JSON object")
    return raw


# Which model_config.json field decides a tensor's presence or shape (first match), for error lines.
_FIELD_OF = (("output_layer", "tie_word_embeddings"), ("q_layernorm", "qk_layernorm"), ("k_layernorm", "qk_layernorm"),
             ("linear_qkv.bias", "qkv_bias"), ("linear_fc", "ffn_hidden_size"),
             ("linear_qkv.weight", "num_attention_heads / num_query_groups / kv_channels"),
             ("linear_proj", "num_attention_heads / kv_channels"), ("embedding", "vocab_size / hidden_size"))
FLOAT_DTYPES = ("torch.float32", "torch.bfloat16", "torch.float16", "torch.float64")


def _field_of(key: str) -> str:
    return next((f for pattern, f in _FIELD_OF if pattern in key), "hidden_size")


def check_correspondence(source: MegatronSource, entries: list) -> None:
    """Both ways: every tensor the model config implies is stored with its shape and a float dtype, and every
    stored policy tensor is one of them. A disagreement names the tensor and the model_config.json field."""
    where = f"{source.dist_dir}: model_config.json"
    expected: dict[str, object] = {}
    for entry in entries:
        for st in entry.parts:
            expected.setdefault(source.key_prefix(st.key, entry.layer) + st.key, st)
    for key, st in expected.items():
        meta = source.stored.get(key)
        size = tuple(meta.size) if meta is not None and hasattr(meta, "size") else None
        if size is None:
            raise HFCheckpointError(f"{where} implies tensor '{key}', which the checkpoint lacks "
                                    f"(field '{_field_of(key)}')")
        if str(meta.properties.dtype) not in FLOAT_DTYPES:
            raise HFCheckpointError(f"{source.dist_dir}: tensor '{key}' is stored as {meta.properties.dtype}: "
                                    f"quantized / integer weights are not converted")
        want = tuple(st.global_shape)
        if st.prepend_axis_num and size[:1] != want[:1] and size[1:] == want[1:]:
            raise HFCheckpointError(f"{where} field 'num_layers' says {want[0]}, the checkpoint's tensor '{key}' "
                                    f"holds {size[0]} layers")
        if st.allow_shape_mismatch:  # vocabulary rows: padded for whatever TP wrote it
            ok = len(size) == len(want) and size[1:] == want[1:] and size[0] >= source.cfg.vocab_size
        else:
            ok = size == want
        if not ok:
            raise HFCheckpointError(f"{where} implies tensor '{key}' of shape {list(want)}, the checkpoint stores "
                                    f"{list(size)} (field '{_field_of(key)}')")
    prefixes = tuple(p for p in source.chunk_prefixes if p)
    stored = [k for k, m in source.stored.items() if hasattr(m, "size") and (not prefixes or k.startswith(prefixes))]
    unused = sorted(k for k in stored if k not in expected)
    if unused:
        more = f" (and {len(unused) - 1} more)" if len(unused) > 1 else ""
        raise HFCheckpointError(f"{source.dist_dir}: stored tensor '{unused[0]}'{more} is not used by the model "
                                f"model_config.json describes (field '{_field_of(unused[0])}')")


def _read_units(entries: list) -> list[list]:
    """Entries in checkpoint order grouped into what one load call reads: a layer, or one other tensor.
    (Per layer, the buffers of one layer are reused by the next: warm memory beats fewer calls.)"""
    units: list[list] = []
    for entry in entries:
        if units and entry.layer is not None and units[-1][0].layer == entry.layer:
            units[-1].append(entry)
        else:
            units.append([entry])
    return units


def megatron_to_hf(megatron_dir: str | Path, out: str | Path, max_shard_bytes: int = 5 * 2**30,
                   allow_nonfinite: bool = False) -> None:
    """Stream a Megatron checkpoint (a convert output or a trainer checkpoint) to an HF directory: each
    tensor is viewed in place (a stored chunk) or read with its layer into reused buffers, and its
    bytes go straight into its shard file."""
    out = Path(out)
    import torch

    from megatron_spo.models.hf_map import hf_from_checkpoint_parts, hf_names, hf_shapes
    from megatron_spo.models.megatron_checkpoint import (
        MappedTorchDist,
        checkpoint_dtype,
        load_parts,
        mapped_sharded_tensors,
    )

    source = find_megatron_source(megatron_dir)
    cfg = source.cfg
    _preflight("convert megatron-to-hf", cfg)
    dtype = checkpoint_dtype(cfg)
    in_place = MappedTorchDist(source.dist_dir)
    with _atomic_dir(out) as tmp, _single_process_world() as init_parallel:
        _, entries = mapped_sharded_tensors(_one_model(cfg, init_parallel))
        check_correspondence(source, entries)
        free: dict[tuple, list] = {}  # (shape, dtype) -> buffers a previous group is done with
        with _progress() as progress, HFStreamWriter(tmp, hf_shapes(cfg), dtype, max_shard_bytes) as writer:
            task = progress.add_task("convert tensors", total=len(entries))
            for group in _read_units(entries):
                by_prefix: dict[str, list] = {}  # parts read into buffers (not stored as one chunk)
                for entry in group:
                    for st in entry.parts:
                        prefix = source.key_prefix(st.key, entry.layer)
                        stored = (1,) * st.prepend_axis_num + tuple(st.local_shape)
                        view = in_place.get(prefix + st.key, st.global_offset, stored, st.dtype)
                        if view is not None:
                            st.data = view.view(st.local_shape)
                            continue
                        spare = free.get((tuple(st.local_shape), st.dtype))
                        st.data = spare.pop() if spare else torch.empty(st.local_shape, dtype=st.dtype)
                        if st.allow_shape_mismatch and source.stored_shape(prefix + st.key) == st.global_shape:
                            st.allow_shape_mismatch = False  # same vocab padding: no zero-filling pass
                        by_prefix.setdefault(prefix, []).append(st)
                for prefix, parts in by_prefix.items():
                    load_parts(parts, source.dist_dir, prefix)
                buffers = [st for parts in by_prefix.values() for st in parts]
                for entry in group:
                    hf = hf_from_checkpoint_parts(entry.rule, [st.data for st in entry.parts], cfg)
                    for name, tensor in zip(hf_names(entry.rule, entry.layer), hf):
                        if not allow_nonfinite:
                            check_finite(tensor, name, source.dist_dir)
                        writer.add(name, tensor.to(dtype))  # norms are kept in float32 inside megatron
                    progress.advance(task)
                for st in buffers:
                    free.setdefault((tuple(st.local_shape), st.dtype), []).append(st.data)
        write_hf_config(tmp, cfg, source.hf_extra)
        copy_tokenizer_files(source.tokenizer_dir, tmp)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="megatron-spo convert", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="direction", required=True)
    a = sub.add_parser("hf-to-megatron", help="HF dir (Llama, Qwen2/2.5, Qwen3, Mistral) -> megatron-core dist checkpoint")
    a.add_argument("--hf", required=True, help="HF checkpoint dir (config.json + safetensors)")
    a.add_argument("--out", required=True, help="output dir (must not exist)")
    b = sub.add_parser("megatron-to-hf", help="megatron-core dist checkpoint -> HF dir of the same family")
    b.add_argument(
        "--megatron",
        required=True,
        help="dir written by hf-to-megatron, or a trainer step dir / checkpoints dir / run dir (latest step)",
    )
    b.add_argument("--out", required=True, help="output dir (must not exist)")
    b.add_argument("--max-shard-gb", type=float, default=5.0, help="max safetensors shard size (GB)")
    for p in (a, b):
        p.add_argument("--allow-nonfinite", action="store_true",
                       help="convert NaN / inf weights instead of refusing them (forensics)")
        p.add_argument("--no-verify", action="store_true",
                       help="do not check the input's files against its digest manifest (digests.json): for "
                            "checkpoint files you edited yourself; a mismatch is otherwise refused naming the file")
    args = parser.parse_args(argv)
    from megatron_spo.library_warnings import LIBRARY_WARNINGS
    from megatron_spo.models.dcp_metadata import CheckpointFileError

    out = Path(args.out)  # megatron-core / apex fallback warnings: to OUT.warnings.log, one line here (as train)
    library = LIBRARY_WARNINGS.attach(out.parent, enabled=True, name=f"{out.name}.warnings.log")
    try:
        with verification(False) if args.no_verify else nullcontext():
            _convert(args)
    except (HFCheckpointError, CheckpointFileError, CheckpointDigestError, FileNotFoundError,
            MemoryPreflightError) as err:
        print(f"megatron-spo convert: error: {err}", file=sys.stderr)
        return 2
    finally:
        if line := library.summary():
            print(line, flush=True)
        library.close()
    print(f"wrote {args.out}")
    return 0


def _convert(args) -> None:
    if args.direction == "hf-to-megatron":
        hf_to_megatron(args.hf, args.out, allow_nonfinite=args.allow_nonfinite)
        return
    if not (args.max_shard_gb > 0 and args.max_shard_gb < 1e6):
        raise HFCheckpointError(f"--max-shard-gb must be a positive number, got {args.max_shard_gb}")
    megatron_to_hf(args.megatron, args.out, int(args.max_shard_gb * 2**30), allow_nonfinite=args.allow_nonfinite)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
