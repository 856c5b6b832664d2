"""Weight-sync transport on this machine: the broadcast path vs a plain memcpy of the same bytes.

    python tools/bench_weight_sync.py [--params 1b|tiny] [--bucket-mb 512] [--dtype bfloat16]

Sender (this process, rank 0) and one receiver process (rank 1, the engine's role) join a gloo group
exactly as WeightBroadcaster and the engine do (init_custom_process_group), then every bucket of
synthetic tensors with Llama-3.2-1B names and shapes is flattened and broadcast; the receiver rebuilds
the tensors with the engine's receive_broadcast. HTTP and the engine's copy into its parameters are not
in this number (the copy is one more memcpy of the same bytes; the tiny end-to-end test covers HTTP).
Prints seconds, GB/s of both paths and their ratio, measured in one run.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import sys
import time
from datetime import timedelta

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_spo.net import hosted_store  # noqa: E402
from megatron_spo.rollout.weight_sync import (  # noqa: E402
    init_custom_process_group,
    iter_buckets,
    receive_broadcast,
)


def llama_1b_shapes(vocab=128256, hidden=2048, layers=16, heads=32, kv_heads=8, ffn=8192) -> list[tuple[str, tuple]]:
    """HF names/shapes of Llama-3.2-1B (tied embeddings: no lm_head)."""
    head_dim = hidden // heads
    shapes = [("model.embed_tokens.weight", (vocab, hidden))]
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes += [(p + "self_attn.q_proj.weight", (hidden, hidden)),
                   (p + "self_attn.k_proj.weight", (kv_heads * head_dim, hidden)),
                   (p + "self_attn.v_proj.weight", (kv_heads * head_dim, hidden)),
                   (p + "self_attn.o_proj.weight", (hidden, hidden)),
                   (p + "mlp.gate_proj.weight", (ffn, hidden)), (p + "mlp.up_proj.weight", (ffn, hidden)),
                   (p + "mlp.down_proj.weight", (hidden, ffn)),
                   (p + "input_layernorm.weight", (hidden,)), (p + "post_attention_layernorm.weight", (hidden,))]
    return shapes + [("model.norm.weight", (hidden,))]


def bucket_plan(shapes, dtype, bucket_bytes):
    """Bucket membership from shapes only (meta tensors), so both processes agree without messages."""
    metas = [(n, torch.empty(s, dtype=dtype, device="meta")) for n, s in shapes]
    return [(b.names, [str(t.dtype).removeprefix("torch.") for t in b.tensors], [list(t.shape) for t in b.tensors])
            for b in iter_buckets(metas, bucket_bytes)]


def receiver(port: int, shapes, dtype, bucket_bytes, threads: int) -> None:
    torch.set_num_threads(threads)
    group = init_custom_process_group(backend="gloo", master_address="127.0.0.1", master_port=port, rank=1,
                                      world_size=2, group_name="bench")
    torch.distributed.barrier(group=group)
    received = 0
    for names, dtypes, bshapes in bucket_plan(shapes, dtype, bucket_bytes):
        for _, t in receive_broadcast(group, names, dtypes, bshapes, "flattened_bucket", torch.device("cpu")):
            received += t.numel() * t.element_size()
    torch.distributed.barrier(group=group)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--params", choices=["1b", "tiny"], default="1b")
    parser.add_argument("--bucket-mb", type=float, default=512)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    shapes = llama_1b_shapes() if args.params == "1b" else llama_1b_shapes(4096, 256, 2, 8, 2, 512)
    bucket_bytes = int(args.bucket_mb * 2**20)
    tensors = [(n, torch.ones(s, dtype=dtype)) for n, s in shapes]  # touch the pages before timing
    nbytes = sum(t.numel() * t.element_size() for _, t in tensors)
    nparams = sum(t.numel() for _, t in tensors)

    # memcpy baseline: the same bytes copied once
    targets = [torch.zeros_like(t) for _, t in tensors]  # pages mapped: a true memcpy
    start = time.perf_counter()
    for (_, t), dst in zip(tensors, targets):
        dst.copy_(t)
    memcpy_s = time.perf_counter() - start
    del targets

    store = hosted_store(2, timedelta(seconds=300))  # listening before the receiver is told the port
    ctx = mp.get_context("spawn")
    proc = ctx.Process(target=receiver, args=(store.port, shapes, dtype, bucket_bytes, args.threads))
    proc.start()
    group = init_custom_process_group(backend="gloo", master_address="127.0.0.1", master_port=store.port, rank=0,
                                      world_size=2, group_name="bench", store=store)
    torch.distributed.barrier(group=group)  # both sides ready: time the transfer only
    start = time.perf_counter()
    num_buckets, flatten_s = 0, 0.0
    staging = torch.empty(0, dtype=torch.uint8)
    for bucket in iter_buckets(tensors, bucket_bytes):
        t0 = time.perf_counter()
        staging = bucket.flatten(staging)
        flatten_s += time.perf_counter() - t0
        torch.distributed.broadcast(staging[:bucket.nbytes], src=0, group=group)
        num_buckets += 1
    torch.distributed.barrier(group=group)
    broadcast_s = time.perf_counter() - start
    proc.join(60)

    gb = nbytes / 1e9
    print(f"weights: {nparams / 1e9:.3f} B params, {gb:.2f} GB {args.dtype}, {num_buckets} buckets of <= "
          f"{args.bucket_mb:g} MB, {args.threads} thread(s), gloo over loopback")
    print(f"memcpy:    {memcpy_s:7.3f} s  {gb / memcpy_s:6.2f} GB/s")
    print(f"broadcast: {broadcast_s:7.3f} s  {gb / broadcast_s:6.2f} GB/s  (flatten + send + receiver rebuild; "
          f"of which sender flatten {flatten_s:.3f} s)")
    print(f"ratio broadcast/memcpy bandwidth: {memcpy_s / broadcast_s:.3f} (time ratio {broadcast_s / memcpy_s:.1f}x)")


if __name__ == "__main__":
    main()
