"""What the checkpoint digests cost against the write they follow (megatron_spo/checkpoint_digest.py).

    python tools/bench_checkpoint_digest.py [--mb 400] [--repeats 3] [--dir /tmp]

Writes a model-sized checkpoint (``--mb`` of float32 tensors of 32 MiB, the size of a large layer's weight)
the two ways the project writes one, each fsync'd as the writers do, and times the digest manifest after it:

  torch_dist   megatron's dist-checkpoint writer in this process (save_sharded_state_dict: the trainer's
               checkpoints and `convert hf-to-megatron`), then write_manifest over the directory
  safetensors  safetensors' save_file of shards of at most 200 MiB (HFWriter: the trainer's HF export), then
               write_manifest over the shards

Each round writes into a fresh directory (after one untimed round: imports, first allocations); the digest reads
what was just written (the page cache, as at save time). Printed: median write, digest and verify seconds over the
rounds, and digest / write, the fraction a save gets slower; then the throughput of the candidate digests on 256 MiB
in memory on one core, which is why the manifest uses CRC-32. A verify on load is the same read as the digest (and
warms the page cache for the load). The CRC-32 of a file is read as 32 MiB blocks on up to 16 threads: on a machine
whose cores are busy with other work the digest rate stays one core's.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import zlib
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo, when run as a script

TENSOR_BYTES = 32 * 2**20
SHARD_BYTES = 200 * 2**20


def tensors(mb: int) -> dict:
    import torch

    torch.manual_seed(0)
    n = max(1, mb * 2**20 // TENSOR_BYTES)
    return {f"layers.{i}.weight": torch.randn(TENSOR_BYTES // 4) for i in range(n)}


def write_torch_dist(named: dict, out: Path) -> None:
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    from megatron_spo.models.megatron_checkpoint import save_sharded_state_dict

    out.mkdir()
    sharded = {k: ShardedTensor.from_rank_offsets(k, t, replica_id=0) for k, t in named.items()}
    save_sharded_state_dict(sharded, out)


def write_safetensors(named: dict, out: Path) -> None:
    from safetensors.torch import save_file

    from megatron_spo.fsutil import fsync_path

    out.mkdir()
    shard, size, i = {}, 0, 0
    for name, t in list(named.items()) + [(None, None)]:
        if name is None or (shard and size + t.numel() * 4 > SHARD_BYTES):
            path = out / f"model-{i:05d}.safetensors"
            save_file(shard, path)
            fsync_path(path)
            shard, size, i = {}, 0, i + 1
        if name is not None:
            shard[name], size = t, size + t.numel() * 4
    fsync_path(out)


def throughput() -> dict[str, float]:
    """GB/s of each candidate digest over 256 MiB in 1 MiB updates (best of 3, one core)."""
    data = memoryview(os.urandom(256 * 2**20))
    chunk = 2**20

    def hashed(name):
        h = hashlib.new(name)
        for i in range(0, len(data), chunk):
            h.update(data[i:i + chunk])

    def crc():
        c = 0
        for i in range(0, len(data), chunk):
            c = zlib.crc32(data[i:i + chunk], c)

    out = {}
    for name, fn in (("sha256", lambda: hashed("sha256")), ("blake2b", lambda: hashed("blake2b")),
                     ("sha1", lambda: hashed("sha1")), ("crc32", crc)):
        best = min(_timed(fn) for _ in range(3))
        out[name] = round(len(data) / best / 1e9, 2)
    return out


def _timed(fn, *args) -> float:
    t0 = time.perf_counter()
    fn(*args)
    return time.perf_counter() - t0


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, default=400, help="checkpoint size in MiB (default 400)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", default=None, help="where to write (default: the system's temporary folder)")
    args = parser.parse_args(argv)

    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from megatron_spo.checkpoint_digest import checkpoint_files, digest_files, verify_manifest, write_manifest
    from megatron_spo.net import hosted_store

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=0, world_size=1, store=hosted_store(1, timedelta(minutes=5)))
    named = tensors(args.mb)
    size = sum(t.numel() * 4 for t in named.values())
    root = Path(tempfile.mkdtemp(prefix="bench_digest.", dir=args.dir))
    results: dict[str, dict[str, list[float]]] = {}
    try:
        for kind, write in (("torch_dist", write_torch_dist), ("safetensors", write_safetensors)):
            write(named, root / f"{kind}-warm")
            write_manifest(root / f"{kind}-warm")
            shutil.rmtree(root / f"{kind}-warm")
        for r in range(args.repeats):
            for kind, write in (("torch_dist", write_torch_dist), ("safetensors", write_safetensors)):
                out = root / f"{kind}-{r}"
                row = results.setdefault(kind, {"write_s": [], "digest_s": [], "verify_s": [], "sha256_s": []})
                row["write_s"].append(_timed(write, named, out))
                row["digest_s"].append(_timed(write_manifest, out))  # what a save adds (CRC-32)
                row["verify_s"].append(_timed(verify_manifest, out))  # what a load adds
                row["sha256_s"].append(_timed(digest_files, out, checkpoint_files(out), "sha256"))  # the alternative
                shutil.rmtree(out)
    finally:
        shutil.rmtree(root, ignore_errors=True)
        dist.destroy_process_group()
    print(json.dumps({"checkpoint_mb": round(size / 2**20), "cpus": os.cpu_count(), "repeats": args.repeats}))
    for kind, row in results.items():
        med = {k: statistics.median(v) for k, v in row.items()}
        print(json.dumps({"writer": kind, **{k: round(v, 3) for k, v in med.items()},
                          "digest_over_write": round(med["digest_s"] / med["write_s"], 3),
                          "sha256_over_write": round(med["sha256_s"] / med["write_s"], 3),
                          "digest_over_write_range": [round(d / w, 3) for d, w in zip(row["digest_s"], row["write_s"])],
                          "write_GBps": round(size / med["write_s"] / 1e9, 2),
                          "digest_GBps": round(size / med["digest_s"] / 1e9, 2)}))
    print(json.dumps({"digest_GBps_in_memory_one_core": throughput()}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
