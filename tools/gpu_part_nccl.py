"""GPU check, item 4: the weight push between two processes over NCCL, as the trainer pushes to an engine:
rank 0 (the trainer) flattens buckets of Llama-3.2-1B-shaped bf16 tensors (tools/bench_weight_sync.py's
shapes and bucket plan) and broadcasts them over megatron_spo.rollout.weight_sync's custom group; rank 1
(the engine) rebuilds them with receive_broadcast on its own GPU and checks every value. Reported: GB/s of
the push (flatten, broadcast, the receiver's rebuild; between two barriers) against a device-to-device
copy of the same bytes on GPU 0 (read + write).

Needs two GPUs: with one it is skipped and says so. --device cpu runs the same code over gloo at a tiny
size (to debug it here; that is no NCCL measurement).
"""

from __future__ import annotations

import json
import multiprocessing as mp
import time
from datetime import timedelta

import torch
from gpu_result import PartResult, part_main

BUCKET_BYTES = 512 * 2**20


def shapes_for(size: str):
    from bench_weight_sync import llama_1b_shapes

    return llama_1b_shapes() if size == "full" else llama_1b_shapes(4096, 256, 2, 8, 2, 512)


def value_of(index: int) -> float:
    return float(index % 7 + 1)  # exact in bf16: the receiver can check every element


def receiver(port: int, size: str, backend: str, device: str, out_path: str) -> None:
    from bench_weight_sync import bucket_plan

    from megatron_spo.rollout.weight_sync import init_custom_process_group, receive_broadcast

    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))
    group = init_custom_process_group(backend=backend, master_address="127.0.0.1", master_port=port, rank=1,
                                      world_size=2, group_name="gpu-check-push")
    torch.distributed.barrier(group=group)  # the sender's clock starts here
    tensors = []
    for names, dtypes, bshapes in bucket_plan(shapes_for(size), torch.bfloat16, BUCKET_BYTES):
        tensors += receive_broadcast(group, names, dtypes, bshapes, "flattened_bucket", torch.device(device))
    torch.distributed.barrier(group=group)  # ... and stops here: the checks below are not timed
    wrong = sum(int((t != value_of(i)).sum().item()) for i, (_, t) in enumerate(tensors))
    index, received = len(tensors), sum(t.numel() * t.element_size() for _, t in tensors)
    with open(out_path, "w") as f:
        json.dump({"tensors": index, "wrong_elements": wrong, "bytes": received}, f)


def body(result: PartResult, args) -> None:
    from megatron_spo.net import hosted_store
    from megatron_spo.rollout.weight_sync import init_custom_process_group, iter_buckets

    if args.device == "cuda":
        count = torch.cuda.device_count()
        result.number("gpus", count)
        if count < 2:
            result.skip(f"{count} GPU visible: the NCCL push needs two (trainer and engine on their own GPUs)")
            return
        backend, send_device, recv_device = "nccl", "cuda:0", "cuda:1"
        torch.cuda.set_device(0)
    else:
        backend, send_device, recv_device = "gloo", "cpu", "cpu"
        result.note("gloo on the CPU: the code path only, not an NCCL measurement")
    tensors = [(name, torch.full(shape, value_of(i), dtype=torch.bfloat16, device=send_device))
               for i, (name, shape) in enumerate(shapes_for(args.size))]
    nbytes = sum(t.numel() * t.element_size() for _, t in tensors)
    copies = [torch.empty_like(t) for _, t in tensors]
    sync = torch.cuda.synchronize if backend == "nccl" else (lambda: None)
    sync()
    start = time.perf_counter()
    for (_, t), dst in zip(tensors, copies):
        dst.copy_(t)
    sync()
    copy_s = time.perf_counter() - start
    del copies
    store = hosted_store(2, timedelta(seconds=300))  # listening before the receiver is told the port
    out_path = f"{args.work}/receiver.json"
    proc = mp.get_context("spawn").Process(target=receiver, args=(store.port, args.size, backend, recv_device,
                                                                  out_path))
    proc.start()
    group = init_custom_process_group(backend=backend, master_address="127.0.0.1", master_port=store.port, rank=0,
                                      world_size=2, group_name="gpu-check-push", store=store)
    staging = None
    torch.distributed.barrier(group=group)
    start = time.perf_counter()
    for bucket in iter_buckets(tensors, BUCKET_BYTES):
        staging = bucket.flatten(staging)
        torch.distributed.broadcast(staging[: bucket.nbytes], src=0, group=group)
    torch.distributed.barrier(group=group)  # the receiver holds every tensor
    push_s = time.perf_counter() - start
    proc.join(120)
    result.require("receiver exited 0", proc.exitcode == 0, f"exit code {proc.exitcode}")
    if proc.exitcode != 0:
        return
    with open(out_path) as f:
        got = json.load(f)
    result.require("every tensor received", got["tensors"] == len(tensors) and got["bytes"] == nbytes, str(got))
    result.check("wrong elements received", got["wrong_elements"], at_most=0)
    result.number("bytes", nbytes)
    result.number(f"push GB/s ({backend}: flatten + broadcast + rebuild)", round(nbytes / push_s / 1e9, 3))
    result.number("device copy GB/s (read + write)", round(2 * nbytes / copy_s / 1e9, 3))


if __name__ == "__main__":
    raise SystemExit(part_main(body))
