"""Push policy weights (full tensors with HF names) from the trainer to every rollout engine.

Two transports, both SGLang's own:
- broadcast: a process group spanning the sender (rank 0) and every engine (ranks 1..N, or
  rank_offset + tp_rank for TP engines), set up with /init_weights_update_group; then per bucket a
  POST /update_weights_from_distributed {names, dtypes, shapes, load_format: "flattened_bucket"} to every
  engine while rank 0 broadcasts the bucket's bytes (SGLang's FlattenedTensorBucket layout: tensors as
  uint8 back to back, no padding). NCCL on GPUs, gloo on CPU.
- disk: a safetensors directory (one file per bucket), then POST /update_weights_from_disk.

The input is any iterator of (hf_name, full tensor) pairs, e.g.
``megatron_spo.models.hf_map.iter_hf_tensors(model_chunks, model_cfg)`` on trainer rank 0, or a HF
state_dict's items. Only rank 0 of the trainer calls this module. Weights go to each engine directly:
sglang-router returns 404 for these endpoints.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import shutil
import socket
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from datetime import timedelta

import torch

from megatron_spo.rollout.client import get_json, post_json
from megatron_spo.rollout.protocol import (
    InitWeightsUpdateGroupRequest,
    UpdateWeightsFromDiskRequest,
    UpdateWeightsFromDistributedRequest,
)

log = logging.getLogger("megatron_spo.weight_sync")

DEFAULT_BUCKET_BYTES = 512 * 1024 * 1024


class WeightSyncError(RuntimeError):
    """An engine refused or missed a weight update."""


# -------------------------------------------------------------------------------------------------
# Process groups outside the default group (the trainer's megatron world is a different group)
# -------------------------------------------------------------------------------------------------
def init_custom_process_group(*, backend: str, master_address: str, master_port: int, rank: int,
                              world_size: int, group_name: str, timeout_s: float = 300.0):
    """A process group that does not touch the default one: what SGLang's init_custom_process_group
    builds (TCP rendezvous at master_address:master_port hosted by rank 0, a store prefixed by
    group_name), so a trainer using this joins real SGLang engines."""
    from torch.distributed.distributed_c10d import (
        Backend,
        PrefixStore,
        _new_process_group_helper,
        _world,
        rendezvous,
    )

    timeout = timedelta(seconds=timeout_s)
    store, rank, world_size = next(rendezvous(f"tcp://{master_address}:{master_port}", rank, world_size,
                                              timeout=timeout))
    store.set_timeout(timeout)
    store = PrefixStore(group_name, store)
    group, _ = _new_process_group_helper(world_size, rank, [], Backend(backend), store, group_name=group_name,
                                         timeout=timeout)
    _world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    return group


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# -------------------------------------------------------------------------------------------------
# Buckets (SGLang FlattenedTensorBucket layout)
# -------------------------------------------------------------------------------------------------
@dataclass
class Bucket:
    names: list[str] = field(default_factory=list)
    tensors: list[torch.Tensor] = field(default_factory=list)
    nbytes: int = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        self.names.append(name)
        self.tensors.append(tensor)
        self.nbytes += tensor.numel() * tensor.element_size()

    def request(self, **kw) -> UpdateWeightsFromDistributedRequest:
        return UpdateWeightsFromDistributedRequest(
            names=list(self.names), dtypes=[str(t.dtype).removeprefix("torch.") for t in self.tensors],
            shapes=[list(t.shape) for t in self.tensors], load_format="flattened_bucket", **kw)

    def flatten(self, staging: torch.Tensor | None = None) -> torch.Tensor:
        """All tensors as one uint8 vector, back to back (what the receiver allocates). With ``staging``
        (a uint8 buffer, grown when too small and returned) no new memory is mapped per bucket."""
        parts = [t.detach().contiguous().reshape(-1).view(torch.uint8) for t in self.tensors]
        if staging is None:
            return torch.cat(parts)
        if staging.numel() < self.nbytes or staging.device != parts[0].device:
            staging = torch.empty(self.nbytes, dtype=torch.uint8, device=parts[0].device)
        torch.cat(parts, out=staging[:self.nbytes])
        return staging


def iter_buckets(named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int) -> Iterator[Bucket]:
    """Group tensors into buckets of at most bucket_bytes (a larger tensor gets a bucket of its own).
    A tensor whose byte offset would not be a multiple of its element size starts a new bucket, because
    the receiver views each slice as its dtype without padding."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be > 0, got {bucket_bytes}")
    bucket = Bucket()
    for name, tensor in named_tensors:
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"weight '{name}' is a {type(tensor).__name__}, not a tensor")
        size = tensor.numel() * tensor.element_size()
        if bucket.names and (bucket.nbytes + size > bucket_bytes or bucket.nbytes % tensor.element_size()):
            yield bucket
            bucket = Bucket()
        bucket.add(name, tensor)
    if bucket.names:
        yield bucket


def receive_broadcast(group, names: list[str], dtypes: list[str], shapes: list[list[int]],
                      load_format: str | None, device: torch.device) -> list[tuple[str, torch.Tensor]]:
    """Engine side of one /update_weights_from_distributed round (SGLang's receive path)."""
    if not (len(names) == len(dtypes) == len(shapes)):
        raise ValueError(f"names/dtypes/shapes lengths differ: {len(names)}/{len(dtypes)}/{len(shapes)}")
    torch_dtypes = [getattr(torch, d) for d in dtypes]
    if load_format == "flattened_bucket":
        sizes = [int(torch.Size(s).numel()) * d.itemsize for s, d in zip(shapes, torch_dtypes)]
        flat = torch.empty(sum(sizes), dtype=torch.uint8, device=device)
        torch.distributed.broadcast(flat, src=0, group=group)
        out, offset = [], 0
        for name, dtype, shape, size in zip(names, torch_dtypes, shapes, sizes):
            out.append((name, flat[offset:offset + size].view(dtype).reshape(shape)))
            offset += size
        return out
    out = []
    for name, dtype, shape in zip(names, torch_dtypes, shapes):
        tensor = torch.empty(shape, dtype=dtype, device=device)
        torch.distributed.broadcast(tensor, src=0, group=group)
        out.append((name, tensor))
    return out


# -------------------------------------------------------------------------------------------------
# Sender
# -------------------------------------------------------------------------------------------------
@dataclass
class SyncReport:
    version: str
    bytes_sent: int
    num_tensors: int
    num_buckets: int
    seconds: float
    engine_versions: dict[str, str]

    @property
    def bytes_per_s(self) -> float:
        return self.bytes_sent / max(self.seconds, 1e-9)


class WeightBroadcaster:
    """Rank-0 sender of full HF-named weights to a set of engines.

        sync = WeightBroadcaster(["http://127.0.0.1:30001", ...], mode="broadcast")
        report = sync.push(model.state_dict().items(), version="3")

    ``push(..., engines=[...])`` targets a subset (e.g. a restarted engine that must catch up); the
    broadcast group is rebuilt whenever the set of engines changes. A failure raises WeightSyncError
    naming the engines that did not take the update, so the caller can stop routing to them.
    """

    def __init__(self, engine_urls: list[str], *, mode: str = "broadcast", bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                 backend: str = "gloo", master_address: str = "127.0.0.1", disk_dir: str | None = None,
                 engine_tp_sizes: list[int] | None = None, timeout_s: float = 600.0):
        if mode not in ("broadcast", "disk"):
            raise ValueError(f"weight sync mode must be 'broadcast' or 'disk', got '{mode}'")
        if mode == "disk" and not disk_dir:
            raise ValueError("weight sync mode 'disk' needs disk_dir (a directory every engine can read)")
        if not engine_urls:
            raise ValueError("WeightBroadcaster needs at least one engine url")
        self.engine_urls = [u.rstrip("/") for u in engine_urls]
        self.tp_sizes = dict(zip(self.engine_urls, engine_tp_sizes or [1] * len(self.engine_urls)))
        self.mode, self.bucket_bytes, self.backend = mode, bucket_bytes, backend
        self.master_address, self.disk_dir, self.timeout_s = master_address, disk_dir, timeout_s
        self.group = None
        self.group_name: str | None = None
        self.group_members: tuple[str, ...] = ()
        self._generation = 0
        self._last_disk_path: str | None = None
        self._staging: torch.Tensor | None = None
        self.pool = concurrent.futures.ThreadPoolExecutor(max_workers=max(4, 2 * len(self.engine_urls)))

    # --- broadcast group -------------------------------------------------------------------------
    def _ensure_group(self, members: tuple[str, ...]) -> None:
        if self.group is not None and members == self.group_members:
            return
        self._destroy_group()
        self._generation += 1
        name = f"megatron_spo_weights_{os.getpid()}_{self._generation}"
        port = free_port()
        world = 1 + sum(self.tp_sizes.get(u, 1) for u in members)
        futures, offset = [], 1
        for url in members:
            body = InitWeightsUpdateGroupRequest(master_address=self.master_address, master_port=port,
                                                 rank_offset=offset, world_size=world, group_name=name,
                                                 backend=self.backend).to_json()
            futures.append((url, self.pool.submit(post_json, f"{url}/init_weights_update_group", body,
                                                  self.timeout_s)))
            offset += self.tp_sizes.get(url, 1)
        try:
            group = init_custom_process_group(backend=self.backend, master_address=self.master_address,
                                              master_port=port, rank=0, world_size=world, group_name=name,
                                              timeout_s=min(self.timeout_s, 120.0))
        except Exception as err:
            raise WeightSyncError(f"weight group '{name}' with {list(members)} did not form: {err}") from err
        failed = _failures(futures)
        if failed:
            raise WeightSyncError(f"/init_weights_update_group failed on {failed}")
        self.group, self.group_name, self.group_members = group, name, members

    def _destroy_group(self) -> None:
        if self.group is None:
            return
        for url in self.group_members:  # best effort: an engine that died has nothing to destroy
            self.pool.submit(post_json, f"{url}/destroy_weights_update_group", {"group_name": self.group_name}, 10.0)
        try:
            torch.distributed.destroy_process_group(self.group)
        except Exception as err:  # a group with a dead peer may refuse a clean shutdown
            log.warning("destroying weight group %s: %s", self.group_name, err)
        self.group, self.group_members = None, ()

    # --- push ------------------------------------------------------------------------------------
    def push(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: str,
             engines: list[str] | None = None) -> SyncReport:
        """Send every tensor to ``engines`` (default: all) and set their weight_version to ``version``."""
        targets = tuple(u.rstrip("/") for u in (engines or self.engine_urls))
        start = time.perf_counter()
        if self.mode == "broadcast":
            nbytes, ntensors, nbuckets = self._push_broadcast(named_tensors, str(version), targets)
        else:
            nbytes, ntensors, nbuckets = self._push_disk(named_tensors, str(version), targets)
        seconds = time.perf_counter() - start
        return SyncReport(str(version), nbytes, ntensors, nbuckets, seconds, {u: str(version) for u in targets})

    def _check_alive(self, targets: tuple[str, ...]) -> None:
        """Fail fast on a dead engine: a broadcast to a group with a missing member hangs until timeout."""
        dead = {}
        for url, fut in [(u, self.pool.submit(get_json, f"{u}/health", 10.0)) for u in targets]:
            try:
                status, _ = fut.result()
                if status != 200:
                    dead[url] = f"HTTP {status}"
            except OSError as err:
                dead[url] = str(err)
        if dead:
            raise WeightSyncError(f"engines not healthy, no update sent: {dead}")

    def _push_broadcast(self, named_tensors, version: str, targets: tuple[str, ...]):
        self._check_alive(targets)
        try:
            self._ensure_group(targets)
        except WeightSyncError:
            self._destroy_group()
            raise
        nbytes = ntensors = nbuckets = 0
        buckets = iter_buckets(named_tensors, self.bucket_bytes)
        current = next(buckets, None)
        if current is None:
            raise ValueError("push: no tensors to send")
        while current is not None:
            following = next(buckets, None)  # look ahead: the last bucket carries the new weight_version
            last = following is None
            body = current.request(group_name=self.group_name, flush_cache=last,
                                   weight_version=version if last else None).to_json()
            futures = [(url, self.pool.submit(post_json, f"{url}/update_weights_from_distributed", body,
                                              self.timeout_s)) for url in targets]
            self._staging = current.flatten(self._staging)  # reused: no fresh pages per bucket
            flat = self._staging[:current.nbytes]
            if self.backend == "nccl" and not flat.is_cuda:
                flat = flat.cuda()
            try:
                torch.distributed.broadcast(flat, src=0, group=self.group)
            except Exception as err:
                self._destroy_group()
                raise WeightSyncError(f"broadcast of bucket {nbuckets} to {list(targets)} failed: {err}") from err
            failed = _failures(futures)
            if failed:
                self._destroy_group()
                raise WeightSyncError(f"/update_weights_from_distributed failed on {failed}")
            nbytes += flat.numel()
            ntensors += len(current.names)
            nbuckets += 1
            current = following
        return nbytes, ntensors, nbuckets

    def _push_disk(self, named_tensors, version: str, targets: tuple[str, ...]):
        from safetensors.torch import save_file

        path = os.path.join(self.disk_dir, f"weights_v{version}")
        os.makedirs(path, exist_ok=True)
        nbytes = ntensors = nbuckets = 0
        for bucket in iter_buckets(named_tensors, self.bucket_bytes):
            tensors = {n: t.detach().contiguous().cpu() for n, t in zip(bucket.names, bucket.tensors)}
            save_file(tensors, os.path.join(path, f"model-{nbuckets:05d}.safetensors"))
            nbytes += bucket.nbytes
            ntensors += len(bucket.names)
            nbuckets += 1
        body = UpdateWeightsFromDiskRequest(model_path=path, weight_version=version).to_json()
        futures = [(url, self.pool.submit(post_json, f"{url}/update_weights_from_disk", body, self.timeout_s))
                   for url in targets]
        failed = _failures(futures)
        if failed:
            raise WeightSyncError(f"/update_weights_from_disk failed on {failed}")
        if self._last_disk_path not in (None, path):  # keep only the newest directory
            shutil.rmtree(self._last_disk_path, ignore_errors=True)
        self._last_disk_path = path
        return nbytes, ntensors, nbuckets

    def close(self) -> None:
        self._destroy_group()
        self.pool.shutdown(wait=True)

    def __enter__(self) -> WeightBroadcaster:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _failures(futures) -> dict[str, str]:
    failed = {}
    for url, fut in futures:
        try:
            status, body = fut.result()
        except Exception as err:
            failed[url] = f"{type(err).__name__}: {err}"
            continue
        if status != 200 or not (isinstance(body, dict) and body.get("success")):
            failed[url] = f"HTTP {status}: {body}"
    return failed
