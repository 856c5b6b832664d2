"""Where a tensor handed to a torch.distributed collective must live.

NCCL takes CUDA tensors only (a CPU tensor fails with "No backend type associated with device type cpu",
found by the first GPU check, 2026-11-26); gloo takes CPU tensors. Flags, counters and gathered results
that the code makes on the CPU go through `all_reduce_`, which reduces them on the group's device and copies
the result back. The move-and-copy path runs only on NCCL (the GPU check's training part); CI's gloo takes the
tensor as it is.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def collective_device(group=None) -> torch.device:
    """The device `group`'s backend reduces on: CUDA (this rank's current device) for NCCL, else the CPU.
    Without an initialised process group: the CPU."""
    if not (dist.is_available() and dist.is_initialized()):
        return torch.device("cpu")
    if str(dist.get_backend(group)) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_reduce_(t: torch.Tensor, op=None, group=None) -> torch.Tensor:
    """In-place all-reduce of `t` (SUM unless `op`) on whatever device it lives on: moved to the group's
    device for the collective and copied back. Returns `t`."""
    op = dist.ReduceOp.SUM if op is None else op
    device = collective_device(group)
    if t.device == device:
        dist.all_reduce(t, op=op, group=group)
        return t
    moved = t.to(device)
    dist.all_reduce(moved, op=op, group=group)
    t.copy_(moved)
    return t
