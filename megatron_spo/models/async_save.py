"""A megatron sharded state dict saved while training goes on (checkpoint.async_save).

    pending = start(sharded_state_dict, dir)   (collective: megatron-core's save planning, tensors copied to host)
    written(pending) -> bool                   (collective: has every rank's writer finished?)
    finish(pending, dir)                       (collective: waits, then megatron's finalize writes the metadata)

The format and the planning are megatron-core's own (dist_checkpointing.save with async_sharded_save=True and its
TorchDistSaveShardedStrategy); what differs is who writes the shards. megatron's AsyncCallsQueue forks a writer
process (and all-reduces on CUDA); the trainer runs a rollout thread (HTTP clients, an asyncio loop), and a fork of a
multi-threaded process inherits whatever locks those threads hold, so here a thread of this process runs the function
megatron's forked writer runs (FileSystemWriterAsync.write_preloaded_data), one bucket after another. The copy to
host memory is a real copy on every device: megatron's preload is `tensor.to("cpu")`, which on the CPU returns the
tensor itself, and the next optimizer step would then change it under the writer.
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_spo.collectives import all_reduce_


@dataclass
class PendingSave:
    """One rank's share of a save in flight: megatron's request (its finalize functions), the writer thread (None:
    nothing to write on this rank), the seconds the caller was blocked for in start() and the bytes staged."""

    request: object
    thread: threading.Thread | None
    blocked_s: float
    staged_bytes: int
    results_queue: object = None
    errors: list = field(default_factory=list)
    digests: dict = field(default_factory=dict)  # {file written: (size, digest)}, checkpoint_digest's, by the thread


def start(sharded_state_dict: dict, ckpt_dir: str | Path) -> PendingSave:
    """Collective: plan the save of ``sharded_state_dict`` into the existing ``ckpt_dir`` (megatron's common state is
    written now), copy this rank's tensors to host memory and start the thread writing them. The model and the
    optimizer may change as soon as this returns."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.strategies import filesystem_async
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

    t0 = time.perf_counter()
    if filesystem_async._results_queue is None:  # the writer is a thread: a thread queue, not a spawned Manager's
        filesystem_async._results_queue = queue.Queue()
    strategy = TorchDistSaveShardedStrategy("torch_dist", 1, thread_count=1)
    request = dist_checkpointing.save(sharded_state_dict, str(ckpt_dir), sharded_strategy=strategy,
                                      async_sharded_save=True)
    if request.async_fn is None:  # nothing of this rank's is written (every tensor a replica another rank saves)
        return PendingSave(request, None, time.perf_counter() - t0, 0)
    transforms, _use_msc = request.async_fn.args
    _rank, buckets, results_queue = request.async_fn_args
    staged, nbytes = _stage(buckets)
    pending = PendingSave(request, None, 0.0, nbytes, results_queue)
    pending.thread = threading.Thread(target=_write, args=(transforms, staged, results_queue, pending),
                                      name="megatron-spo-checkpoint-writer", daemon=True)
    pending.thread.start()
    pending.blocked_s = time.perf_counter() - t0
    return pending


def written(pending: PendingSave) -> bool:
    """Collective (every rank of WORLD): True once every rank's writer thread has finished."""
    done = torch.tensor([0 if pending.thread is not None and pending.thread.is_alive() else 1], dtype=torch.int32)
    if dist.is_available() and dist.is_initialized():
        all_reduce_(done, op=dist.ReduceOp.MIN)
    return bool(done.item())


class AsyncSaveError(RuntimeError):
    """A writer that failed, raised on every rank: one line naming the ranks, their reasons and the directory."""


def finish(pending: PendingSave, ckpt_dir: str | Path) -> None:
    """Collective: wait for this rank's writer, then run megatron's finalize (the ranks' write results gathered,
    the checkpoint's metadata written by rank 0). A writer that failed on any rank raises AsyncSaveError on every
    rank, before the finalize (whose own exception tells only the coordinator rank why) and with the metadata
    unwritten."""
    if pending.thread is not None:
        pending.thread.join()
    mine = "; ".join(f"{type(e).__name__}: {e}" for e in pending.errors) or None
    reasons = [mine]
    if dist.is_available() and dist.is_initialized():
        reasons = [None] * dist.get_world_size()
        dist.all_gather_object(reasons, mine)
    failed = {rank: why for rank, why in enumerate(reasons) if why}
    if failed:
        if pending.results_queue is not None:  # the failed writer's result: not left for the next save to read
            pending.results_queue.get_nowait()
        raise AsyncSaveError(f"checkpoint: writing {ckpt_dir} in the background failed on "
                             + ", ".join(f"rank {rank} ({why})" for rank, why in failed.items()))
    for fn in pending.request.finalize_fns:
        fn()


def _stage(buckets: list) -> tuple[list, int]:
    """megatron's write buckets [(file, storage key, (bytes items, [(item, tensor)]))] with every tensor copied to
    (pinned, where there is CUDA) host memory; and the bytes copied."""
    staged, nbytes, cuda = [], 0, False
    for file_name, storage_key, (bytes_data, tensor_data) in buckets:
        copies = []
        for item, tensor in tensor_data:
            host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=tensor.is_cuda)
            host.copy_(tensor.detach(), non_blocking=tensor.is_cuda)
            cuda = cuda or tensor.is_cuda
            nbytes += host.numel() * host.element_size()
            copies.append((item, host))
        staged.append((file_name, storage_key, (bytes_data, copies)))
    if cuda:
        torch.cuda.synchronize()
    return staged, nbytes


def _write(transforms: list, buckets: list, results_queue, pending: PendingSave) -> None:
    """The thread: each bucket through megatron's writer function (its gc-disabling wrapper left out: gc is the
    process's, and the training thread runs on), the results handed to megatron's finalize by its queue; then each
    file's digest for the checkpoint's manifest, read back while it is in the page cache (not at the commit)."""
    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

    from megatron_spo.checkpoint_digest import digest_files

    errors = pending.errors

    write = FileSystemWriterAsync.write_preloaded_data
    write = getattr(write, "__wrapped__", write)
    results: dict | Exception = {}
    try:
        for i, bucket in enumerate(buckets):
            local, count = queue.Queue(), queue.Queue()
            count.put(i)
            write(transforms, i, bucket, local, count, use_fsync=True)
            _, out = local.get_nowait()
            if isinstance(out, Exception):
                results = out
                errors.append(out)
                break
            results[i] = out
    except Exception as err:  # a failure here must reach finalize, which fails every rank with it
        results = err
        errors.append(err)
    results_queue.put(results)
    if not errors:
        for file_name, _key, _items in buckets:
            path = Path(file_name)
            pending.digests[path] = digest_files(path.parent, [path.name])[path.name]
