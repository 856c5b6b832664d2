"""`megatron-spo convert` and `megatron-spo check-conversion`.

    megatron-spo convert hf-to-megatron --hf HF_DIR --out MEGATRON_DIR
    megatron-spo convert megatron-to-hf --megatron MEGATRON_DIR --out HF_DIR
    megatron-spo check-conversion --hf HF_DIR --megatron MEGATRON_DIR [--tp N --pp M] [--tol 1e-3]

The Megatron side is a megatron-core dist checkpoint (loads under any TP/PP). Conversion runs in one
process: it holds one copy of the model plus one tensor in flight (never two full copies); HF tensors
are read lazily one at a time and HF output is written in bounded shards. Output is written to
OUT.tmp and renamed to OUT at the end, so nothing half-written looks valid. The HF input is validated
(architecture, config.json fields, every tensor's presence and shape) before anything is written.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path

from megatron_spo.config import ConfigError, ParallelConfig
from megatron_spo.models.hf_checkpoint import (
    HFCheckpointError,
    HFReader,
    HFWriter,
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
    )


@contextmanager
def _atomic_dir(out: Path):
    """Yield OUT.tmp; rename it to OUT on success, remove it on failure."""
    if out.exists():
        raise ConfigError(f"output directory '{out}' already exists (remove it or choose another --out)")
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    os.replace(tmp, out)
    dir_fd = os.open(out.parent, os.O_RDONLY)  # make the rename itself durable
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


@contextmanager
def _single_process_world():
    """A world of one process (gloo/NCCL) with TP = PP = 1, torn down afterwards."""
    from megatron_spo.models.parallel import destroy_parallel, free_port, init_parallel

    keys = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    saved = {k: os.environ.get(k) for k in keys}
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    try:
        yield init_parallel
    finally:
        destroy_parallel()
        for k, v in saved.items():  # a caller that launches ranks later must not look launched already
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def hf_to_megatron(hf_dir: str | Path, out: str | Path) -> None:
    hf_dir, out = Path(hf_dir), Path(out)
    cfg = read_hf_config(hf_dir)
    reader = HFReader(hf_dir)
    reader.validate(cfg)
    from megatron_spo.models.builders import build_policy
    from megatron_spo.models.hf_map import load_hf_into_model
    from megatron_spo.models.megatron_checkpoint import save_megatron

    with _atomic_dir(out) as tmp, _single_process_world() as init_parallel:
        parallel = ParallelConfig()
        init_parallel(parallel, cfg)
        chunks = build_policy(cfg, parallel, init_weights=False)
        with _progress() as progress:
            task = progress.add_task("read HF tensors", total=len(reader.names()))

            def get(name):
                progress.advance(task)
                return reader.get(name)

            load_hf_into_model(chunks, cfg, get, assign=True)
        save_megatron(chunks, cfg, tmp)
        shutil.copy2(hf_dir / "config.json", tmp / SOURCE_HF_CONFIG)
        copy_tokenizer_files(hf_dir, tmp)


def megatron_to_hf(megatron_dir: str | Path, out: str | Path, max_shard_bytes: int = 5 * 2**30) -> None:
    megatron_dir, out = Path(megatron_dir), Path(out)
    from megatron_spo.models.builders import build_policy
    from megatron_spo.models.hf_map import hf_shapes, iter_hf_tensors
    from megatron_spo.models.megatron_checkpoint import load_megatron, read_megatron_config

    cfg = read_megatron_config(megatron_dir)
    source_cfg = megatron_dir / SOURCE_HF_CONFIG
    extra = json.loads(source_cfg.read_text()) if source_cfg.is_file() else {}
    with _atomic_dir(out) as tmp, _single_process_world() as init_parallel:
        parallel = ParallelConfig()
        init_parallel(parallel, cfg)
        chunks = build_policy(cfg, parallel, init_weights=False)
        load_megatron(chunks, megatron_dir, assign=True)
        with _progress() as progress, HFWriter(tmp, max_shard_bytes) as writer:
            task = progress.add_task("write HF tensors", total=len(hf_shapes(cfg)))
            for name, tensor in iter_hf_tensors(chunks, cfg):
                writer.add(name, tensor)
                progress.advance(task)
        write_hf_config(tmp, cfg, extra)
        copy_tokenizer_files(megatron_dir, tmp)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="megatron-spo convert", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="direction", required=True)
    a = sub.add_parser("hf-to-megatron", help="HF Llama dir -> megatron-core dist checkpoint")
    a.add_argument("--hf", required=True, help="HF checkpoint dir (config.json + safetensors)")
    a.add_argument("--out", required=True, help="output dir (must not exist)")
    b = sub.add_parser("megatron-to-hf", help="megatron-core dist checkpoint -> HF Llama dir")
    b.add_argument("--megatron", required=True, help="dir written by hf-to-megatron or the trainer")
    b.add_argument("--out", required=True, help="output dir (must not exist)")
    b.add_argument("--max-shard-gb", type=float, default=5.0, help="max safetensors shard size (GB)")
    args = parser.parse_args(argv)
    try:
        if args.direction == "hf-to-megatron":
            hf_to_megatron(args.hf, args.out)
        else:
            megatron_to_hf(args.megatron, args.out, int(args.max_shard_gb * 2**30))
    except (HFCheckpointError, FileNotFoundError) as err:
        print(f"megatron-spo convert: error: {err}", file=sys.stderr)
        return 2
    print(f"wrote {args.out}")
    return 0


# ---------------------------------------------------------------------------------------------
# check-conversion
# ---------------------------------------------------------------------------------------------
def _check_worker(
    hf_dir: str, megatron_dir: str, tp: int, pp: int, batch: int, seq: int, seed: int, result: str
):
    import torch

    from megatron_spo.models.builders import build_policy
    from megatron_spo.models.megatron_checkpoint import load_megatron, read_megatron_config
    from megatron_spo.models.parallel import destroy_parallel, init_parallel
    from megatron_spo.models.pipeline import gather_logits_to_rank0

    cfg = read_megatron_config(megatron_dir)
    parallel = ParallelConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    init_parallel(parallel, cfg)
    chunks = build_policy(cfg, parallel, init_weights=False)
    load_megatron(chunks, megatron_dir)
    ids = torch.randint(0, cfg.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(seed))
    logits = gather_logits_to_rank0(chunks, ids, cfg.vocab_size)
    if logits is not None:
        from transformers import LlamaForCausalLM

        hf = LlamaForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
        with torch.no_grad():
            ref = hf(ids).logits.float()
        diff = (logits - ref).abs().max().item()
        Path(result).write_text(json.dumps({"max_abs_logit_diff": diff}))
    destroy_parallel()


def check_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="megatron-spo check-conversion",
        description="max |logit difference| between an HF and a Megatron checkpoint",
    )
    parser.add_argument("--hf", required=True)
    parser.add_argument("--megatron", required=True)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument(
        "--tol",
        type=float,
        default=None,
        help="fail (exit 1) above this max abs difference (default: 1e-3 for float32 checkpoints, 0.5 for 16-bit)",
    )
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    from megatron_spo.models.megatron_checkpoint import read_megatron_config
    from megatron_spo.models.parallel import check_layout, spawn_local

    try:
        hf_cfg = read_hf_config(args.hf)
        cfg = read_megatron_config(args.megatron)
    except (HFCheckpointError, FileNotFoundError) as err:
        print(f"megatron-spo check-conversion: error: {err}", file=sys.stderr)
        return 2
    shape_fields = (
        "num_layers",
        "hidden_size",
        "ffn_hidden_size",
        "num_attention_heads",
        "num_query_groups",
        "vocab_size",
    )
    for field in shape_fields:
        if getattr(hf_cfg, field) != getattr(cfg, field):
            print(
                f"megatron-spo check-conversion: error: {field} differs: HF {getattr(hf_cfg, field)} vs "
                f"Megatron {getattr(cfg, field)}",
                file=sys.stderr,
            )
            return 2
    if args.tol is None:
        args.tol = 1e-3 if cfg.params_dtype == "float32" else 0.5
    world = args.tp * args.pp
    check_layout(
        ParallelConfig(tensor_model_parallel_size=args.tp, pipeline_model_parallel_size=args.pp), cfg, world
    )
    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp) / "result.json"
        worker_args = (
            args.hf,
            args.megatron,
            args.tp,
            args.pp,
            args.batch,
            args.seq_len,
            args.seed,
            str(result),
        )
        if world > 1:
            spawn_local(_check_worker, world, *worker_args)
        else:
            _run_single(worker_args)
        diff = json.loads(result.read_text())["max_abs_logit_diff"]
    status = "OK" if diff <= args.tol else "FAIL"
    print(f"max abs logit diff {diff:.3e} (TP={args.tp} PP={args.pp}, tol {args.tol:g}): {status}")
    return 0 if diff <= args.tol else 1


def _run_single(worker_args: tuple) -> None:
    from megatron_spo.models.parallel import free_port

    os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    _check_worker(*worker_args)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
