"""Push policy weights (full tensors with HF names) from the trainer to every rollout engine.

One push, on every engine concurrently (sglang 0.5.23's order; slime does the same):
    /pause_generation {mode: retract | abort}   no request samples from half-loaded weights
    /begin_weight_update                         SGLang refuses distributed updates outside a session
    per bucket /update_weights_from_distributed  while rank 0 broadcasts the bucket (version + flush on the last)
    /end_weight_update
    /continue_generation                         retracted requests resume under the new weights
Two transports, both SGLang's own:
- broadcast: a process group spanning the sender (rank 0) and every engine rank (rank_offset + tp_rank, so
  the world is 1 + the engines' TP sizes, read from each engine's /server_info and checked against the launch
  config before anything is sent), set up with /init_weights_update_group; each bucket is SGLang's
  FlattenedTensorBucket layout (tensors as uint8 back to back, no padding). NCCL on GPUs, gloo on CPU.
- disk: a safetensors directory (one file per bucket), written before the pause, then
  /update_weights_from_disk inside the same pause.
A push never reports an engine as updated unless it took every bucket and the version: an engine that
missed it stays paused (its requests aborted, so clients retry elsewhere) and keeps its old weight_version,
so version gating gives it no work; the next push brings it back ("resynced"). An engine that was restarted
(rollout/fleet.py, slurm/launch_workers.sh) reports its initial weight_version, not the one the last push set: the
push finds it so, counts it (fleet/engine_restarts) and sends it everything in a group formed anew (the old group
died with it), which brings it to the current weights before version gating gives it work again.

The input is any iterator of (hf_name, full tensor) pairs, e.g.
``megatron_spo.models.hf_map.iter_hf_tensors(model_chunks, model_cfg)`` on trainer rank 0, or a HF
state_dict's items. Only rank 0 of the trainer calls this module. Weights go to each engine directly:
sglang-router returns 404 for these endpoints.
"""

from __future__ import annotations

import collections
import concurrent.futures
import logging
import os
import shutil
import signal
import threading
import time
import uuid
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from datetime import timedelta

import torch

from megatron_spo.net import hosted_store
from megatron_spo.rollout.client import get_json, post_json
from megatron_spo.rollout.protocol import (
    SYNC_PAUSE_MODES,
    InitWeightsUpdateGroupRequest,
    PauseGenerationRequest,
    UpdateWeightsFromDiskRequest,
    UpdateWeightsFromDistributedRequest,
)
from megatron_spo.run_layout import stop_signal, stopped_for

log = logging.getLogger("megatron_spo.weight_sync")

DEFAULT_BUCKET_BYTES = 512 * 1024 * 1024
PROBE_TIMEOUT_S = 10.0  # an engine that does not answer /server_info in this is left out of the push
STOP_POLL_S, STOP_GRACE_S = 0.25, 5.0  # a push's calls once SIGTERM arrived: answers awaited this much longer


class WeightSyncError(RuntimeError):
    """An engine refused or missed a weight update."""


# -------------------------------------------------------------------------------------------------
# Process groups outside the default group (the trainer's megatron world is a different group)
# -------------------------------------------------------------------------------------------------
def init_custom_process_group(*, backend: str, master_address: str, master_port: int, rank: int,
                              world_size: int, group_name: str, timeout_s: float = 300.0, store=None):
    """A process group that does not touch the default one: what SGLang's init_custom_process_group
    builds (TCP rendezvous at master_address:master_port hosted by rank 0, a store prefixed by
    group_name), so a trainer using this joins real SGLang engines.

    Several ranks of one group may live in one process (the local engine standing in for a TP engine,
    or a test holding the sender and an engine): torch registers group names per process, so a second
    local rank registers under its own name and reaches the group's store keys through a renaming store.
    ``store``: rank 0's own, already serving on master_port (``net.hosted_store``), instead of binding it here."""
    from torch.distributed.distributed_c10d import (
        Backend,
        PrefixStore,
        _new_process_group_helper,
        _world,
        rendezvous,
    )

    timeout = timedelta(seconds=timeout_s)
    if store is None:
        store, rank, world_size = next(rendezvous(f"tcp://{master_address}:{master_port}", rank, world_size,
                                                  timeout=timeout))
    store.set_timeout(timeout)
    store = PrefixStore(group_name, store)
    with _LOCAL_NAMES_LOCK:
        shared = group_name in _world.pg_names.values() or _local_names_in_creation[group_name] > 0
        _local_names_in_creation[group_name] += 1
    local_name = f"{group_name}#{rank}" if shared else group_name
    if shared:
        store = _RenamedKeys(store, f"{local_name}/", f"{group_name}/", timeout)
    try:
        group, _ = _new_process_group_helper(world_size, rank, [], Backend(backend), store, group_name=local_name,
                                             timeout=timeout)
    finally:
        with _LOCAL_NAMES_LOCK:
            _local_names_in_creation[group_name] -= 1
    _world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    _group_stores[group] = store  # torch keeps only the C++ side of a Python store: the wrapper must live on
    return group


def destroy_custom_process_group(group) -> None:
    try:
        torch.distributed.destroy_process_group(group)
    finally:
        _group_stores.pop(group, None)


_LOCAL_NAMES_LOCK = threading.Lock()
_local_names_in_creation: collections.Counter = collections.Counter()
_group_stores: dict = {}


class _RenamedKeys(torch.distributed.Store):
    """A store whose keys under ``local`` are the inner store's keys under ``shared``.

    Gloo calls it from C++ holding the GIL, so it never blocks inside the inner store (a blocking get or wait
    would hold the GIL while the rank that must set the key, in this same process, waits for it): it polls."""

    def __init__(self, inner, local: str, shared: str, timeout: timedelta):
        super().__init__()
        self.inner, self.local, self.shared, self.wait_limit = inner, local, shared, timeout

    def _key(self, key: str) -> str:
        return self.shared + key[len(self.local):] if key.startswith(self.local) else key

    def _await(self, keys: list[str], timeout: timedelta | None = None) -> None:
        deadline = time.monotonic() + (timeout or self.wait_limit).total_seconds()
        while not self.inner.check(keys):
            if time.monotonic() > deadline:
                raise RuntimeError(f"timed out waiting for store keys {keys}")
            time.sleep(0.002)

    def set(self, key, value):
        self.inner.set(self._key(key), value)

    def get(self, key):
        self._await([self._key(key)])
        return self.inner.get(self._key(key))

    def add(self, key, value):
        return self.inner.add(self._key(key), value)

    def compare_set(self, key, expected, desired):
        return self.inner.compare_set(self._key(key), expected, desired)

    def wait(self, keys, timeout=None):
        self._await([self._key(k) for k in keys], timeout)

    def check(self, keys):
        return self.inner.check([self._key(k) for k in keys])

    def delete_key(self, key):
        return self.inner.delete_key(self._key(key))

    def num_keys(self):
        return self.inner.num_keys()

    def set_timeout(self, timeout):
        self.wait_limit = timeout
        self.inner.set_timeout(timeout)


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
# SGLang answers these with {"message", "status"} (pause/continue) or an empty body (abort), not {"success"}
REPLIES_WITHOUT_SUCCESS = frozenset({"/pause_generation", "/continue_generation", "/abort_request"})


@dataclass
class SyncReport:
    version: str
    bytes_sent: int
    num_tensors: int
    num_buckets: int
    seconds: float  # the whole push
    pause_seconds: float  # from /pause_generation sent until every updated engine continued
    transfer_seconds: float  # buckets: gather + broadcast + load (disk: writing the files, before the pause)
    engines_updated: list[str]
    failed: dict[str, str] = field(default_factory=dict)  # url -> why; these engines stay out of service
    resynced: list[str] = field(default_factory=list)  # updated engines that had missed an earlier push
    restarted: list[str] = field(default_factory=list)  # engines found restarted since this sender's last push
    restarts_seen: int = 0  # engines found restarted by this sender so far (all pushes)

    @property
    def bytes_per_s(self) -> float:
        return self.bytes_sent / max(self.transfer_seconds, 1e-9)

    @property
    def engine_versions(self) -> dict[str, str]:
        return {u: self.version for u in self.engines_updated}

    def metrics(self) -> dict[str, float]:
        return {"weight_sync/seconds": self.seconds, "weight_sync/pause_seconds": self.pause_seconds,
                "weight_sync/transfer_seconds": self.transfer_seconds, "weight_sync/bytes_per_s": self.bytes_per_s,
                "weight_sync/bytes": float(self.bytes_sent), "weight_sync/engines_updated": float(len(self.engines_updated)),
                "weight_sync/engines_failed": float(len(self.failed)),
                "weight_sync/engines_resynced": float(len(self.resynced)),
                "weight_sync/engines_restarted": float(len(self.restarted)),
                "fleet/engine_restarts": float(self.restarts_seen), "weight_sync/failed": float(bool(self.failed))}


class WeightBroadcaster:
    """Rank-0 sender of full HF-named weights to a set of engines.

        sync = WeightBroadcaster(["http://127.0.0.1:30001", ...], mode="broadcast")
        report = sync.push(model.state_dict().items(), version="3")   # report.failed: engines that missed it

    ``push(..., engines=[...])`` targets a subset; the broadcast group is rebuilt whenever its members change.
    ``engine_tp_sizes`` (the launch config, e.g. ENGINE_TP) is checked against what each engine reports.
    The tensors are always consumed to the end, even when the push fails: they usually come from a
    collective gather that every trainer rank runs. WeightSyncError only when no engine took the update.
    """

    def __init__(self, engine_urls: list[str], *, mode: str = "broadcast", bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                 backend: str = "gloo", master_address: str = "127.0.0.1", disk_dir: str | None = None,
                 engine_tp_sizes: list[int] | None = None, pause_mode: str = "retract", timeout_s: float = 600.0):
        if mode not in ("broadcast", "disk"):
            raise ValueError(f"weight sync mode must be 'broadcast' or 'disk', got '{mode}'")
        if mode == "disk" and not disk_dir:
            raise ValueError("weight sync mode 'disk' needs disk_dir (a directory every engine can read)")
        if pause_mode not in SYNC_PAUSE_MODES:
            raise ValueError(f"weight sync pause mode must be one of {list(SYNC_PAUSE_MODES)}, got '{pause_mode}' "
                             "(in_place keeps requests running, and SGLang then refuses the update's cache flush)")
        if not engine_urls:
            raise ValueError("WeightBroadcaster needs at least one engine url")
        self.engine_urls = [u.rstrip("/") for u in engine_urls]
        if engine_tp_sizes is not None and len(engine_tp_sizes) != len(self.engine_urls):
            raise ValueError(f"{len(engine_tp_sizes)} engine TP sizes for {len(self.engine_urls)} engines")
        self.launch_tp_sizes = dict(zip(self.engine_urls, engine_tp_sizes or []))
        self.tp_sizes: dict[str, int] = {}
        self.mode, self.bucket_bytes, self.backend, self.pause_mode = mode, bucket_bytes, backend, pause_mode
        self.master_address, self.disk_dir, self.timeout_s = master_address, disk_dir, timeout_s
        self.lagging: dict[str, str] = {}  # engines that missed a push -> why (kept paused until resynced)
        self.versions: dict[str, str] = {}  # engine -> the weight_version this sender's last push to it set
        self.restarts_seen = 0
        self.group = None
        self.group_name: str | None = None
        self.group_members: tuple[str, ...] = ()
        self._generation = 0
        self._last_disk_path: str | None = None
        self._staging: torch.Tensor | None = None
        self.pool = _DaemonCalls()

    # --- engine calls ----------------------------------------------------------------------------
    def _post_all(self, urls, path: str, body: dict, failed: dict[str, str], timeout_s: float | None = None) -> list:
        """POST to every url concurrently; the ones that succeed, in order. Failures go into ``failed``."""
        futures = [(u, self.pool.submit(post_json, f"{u}{path}", body, timeout_s or self.timeout_s)) for u in urls]
        bad = _failures(futures, needs_success=path not in REPLIES_WITHOUT_SUCCESS, stoppable=True)
        for url, why in bad.items():
            failed.setdefault(url, f"{path}: {why}")
        return [u for u in urls if u not in bad]

    def _restarted(self, urls: list[str]) -> list[str]:
        """The engines among ``urls`` whose /model_info weight_version is no longer the one this sender set (they
        were restarted, and hold their launch weights); an engine that does not answer is not judged here."""
        def changed(url: str) -> bool:
            try:
                status, info = get_json(f"{url}/model_info", PROBE_TIMEOUT_S)
            except OSError:
                return False
            return status == 200 and isinstance(info, dict) and info.get("weight_version") != self.versions[url]

        known = [u for u in urls if u in self.versions]
        return [u for u, moved in zip(known, self.pool.map(changed, known)) if moved]

    def needs_weights(self) -> list[str]:
        """Engines that answer but lack the weights this sender last pushed: a push missed them (lagging) or they were
        restarted since. ``push(..., engines=these)`` (the current version again) brings them back without waiting for
        the next scheduled push."""
        restarted = set(self._restarted(self.engine_urls))
        behind = tuple(u for u in self.engine_urls if u in self.lagging or u in restarted)
        return self._ready(behind, {}) if behind else []

    def _ready(self, targets: tuple[str, ...], failed: dict[str, str]) -> list[str]:
        """Engines that answer /server_info and, for a broadcast, report a TP size (dp_size 1) that agrees
        with the launch config: checked before anything is sent, so the group's world size is right.

        Not /health: SGLang's runs a one-token generation, which waits while generation is paused and answers
        503 after 20 s, so an engine a failed push left paused would be found 'unreachable' on every later
        push and never resynced. /server_info is answered while paused."""
        def probe(url: str) -> str | None:
            try:
                status, info = get_json(f"{url}/server_info", PROBE_TIMEOUT_S)
            except OSError as err:
                return f"unreachable: {err}"
            if status != 200 or not isinstance(info, dict):
                return f"/server_info: HTTP {status}"
            if self.mode != "broadcast":
                return None
            tp, dp = info.get("tp_size"), info.get("dp_size", 1)
            if not isinstance(tp, int) or tp < 1:
                return f"/server_info has no valid tp_size ({tp!r})"
            if dp not in (None, 1):
                return f"/server_info reports dp_size {dp}: SGLang refuses distributed weight updates with DP > 1"
            launch = self.launch_tp_sizes.get(url)
            if launch is not None and launch != tp:
                return f"/server_info reports tp_size {tp}, the launch config says {launch}"
            self.tp_sizes[url] = tp
            return None

        reasons = list(self.pool.map(probe, targets))
        for url, why in zip(targets, reasons):
            if why is not None:
                failed[url] = why
        return [u for u, why in zip(targets, reasons) if why is None]

    # --- broadcast group -------------------------------------------------------------------------
    def _ensure_group(self, members: tuple[str, ...]) -> None:
        if self.group is not None and members == self.group_members:
            return
        self._destroy_group()
        self._generation += 1
        name = f"megatron_spo_weights_{os.getpid()}_{self._generation}_{uuid.uuid4().hex[:8]}"
        world = 1 + sum(self.tp_sizes[u] for u in members)
        timeout_s = min(self.timeout_s, 120.0)
        store = hosted_store(world, timedelta(seconds=timeout_s))  # listening before any engine is told its port
        port = store.port
        futures, offset = [], 1
        for url in members:
            body = InitWeightsUpdateGroupRequest(master_address=self.master_address, master_port=port,
                                                 rank_offset=offset, world_size=world, group_name=name,
                                                 backend=self.backend).to_json()
            futures.append((url, self.pool.submit(post_json, f"{url}/init_weights_update_group", body,
                                                  self.timeout_s)))
            offset += self.tp_sizes[url]
        try:
            group = init_custom_process_group(backend=self.backend, master_address=self.master_address,
                                              master_port=port, rank=0, world_size=world, group_name=name,
                                              timeout_s=timeout_s, store=store)
        except Exception as err:
            failed = _failures(futures)
            raise WeightSyncError(f"weight group '{name}' with {list(members)} did not form: {err}"
                                  + (f"; /init_weights_update_group failed on {failed}" if failed else "")) from err
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
            destroy_custom_process_group(self.group)
        except Exception as err:  # a group with a dead peer may refuse a clean shutdown
            log.warning("destroying weight group %s: %s", self.group_name, err)
        self.group, self.group_members = None, ()

    # --- push ------------------------------------------------------------------------------------
    def push(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: str,
             engines: list[str] | None = None) -> SyncReport:
        """Send every tensor to ``engines`` (default: all) and set their weight_version to ``version``."""
        targets = tuple(u.rstrip("/") for u in (self.engine_urls if engines is None else engines))
        tensors = iter(named_tensors)
        start = time.perf_counter()
        try:
            report = self._push(tensors, str(version), targets, start)
        finally:
            for _ in tensors:  # a collective gather: every rank must see it through, whatever happened here
                pass
        for url, why in report.failed.items():
            self.lagging[url] = why
            log.error("weight sync to version %s: %s missed it (%s); it serves nothing until a later push "
                      "reaches it", version, url, why)
        if not report.engines_updated:
            raise WeightSyncError(f"weight sync to version {version} reached no engine: {report.failed}")
        return report

    def _push(self, tensors, version: str, targets: tuple[str, ...], start: float) -> SyncReport:
        failed: dict[str, str] = {}
        ready = self._ready(targets, failed)
        restarted = self._restarted(ready)
        for url in restarted:
            log.warning("weight sync to version %s: %s was restarted (weight_version %s was set, it reports another):"
                        " it gets the whole push, in a new group", version, url, self.versions.pop(url))
            self.lagging.setdefault(url, "restarted")
        self.restarts_seen += len(restarted)
        if set(restarted) & set(self.group_members):
            self._destroy_group()  # its end of the group died with the old process
        buckets = iter_buckets(tensors, self.bucket_bytes)
        nbytes = ntensors = nbuckets = 0
        transfer = pause = 0.0
        updated: list[str] = []
        if self.mode == "disk" and ready:
            t0 = time.perf_counter()
            path, nbytes, ntensors, nbuckets = self._write_disk(buckets, version)
            transfer = time.perf_counter() - t0
        first = next(buckets, None) if self.mode == "broadcast" else None
        if self.mode == "broadcast" and first is None and ready:
            raise ValueError("push: no tensors to send")
        if ready:
            if self.mode == "broadcast":
                try:
                    self._ensure_group(tuple(ready))
                except WeightSyncError as err:
                    self._destroy_group()
                    failed.update({u: str(err) for u in ready})
                    ready = []
            t_pause = time.perf_counter()
            paused = self._post_all(ready, "/pause_generation", PauseGenerationRequest(self.pause_mode).to_json(),
                                    failed)
            try:
                if self.mode == "broadcast":
                    t0 = time.perf_counter()
                    updated, nbytes, ntensors, nbuckets = self._broadcast(first, buckets, version, paused, failed)
                    transfer = time.perf_counter() - t0
                else:
                    body = UpdateWeightsFromDiskRequest(model_path=path, weight_version=version).to_json()
                    updated = self._post_all(paused, "/update_weights_from_disk", body, failed)
            finally:
                updated = self._post_all([u for u in updated if u not in failed], "/continue_generation", {}, failed)
                # missed the update: abort what it holds (clients retry elsewhere) and leave it paused
                self._post_all([u for u in paused if u in failed], "/abort_request", {"abort_all": True}, {}, 30.0)
                pause = time.perf_counter() - t_pause
        resynced = [u for u in updated if self.lagging.pop(u, None) is not None]
        self.versions.update({u: version for u in updated})
        return SyncReport(version, nbytes, ntensors, nbuckets, time.perf_counter() - start, pause, transfer,
                          updated, failed, resynced, restarted, self.restarts_seen)

    def _broadcast(self, current: Bucket, buckets: Iterator[Bucket], version: str, paused: list[str],
                   failed: dict[str, str]):
        """begin -> buckets -> end on the paused engines; returns (engines that took all, bytes, tensors, buckets)."""
        stale = {}  # a session left open by an interrupted push: close it and begin again
        begun = self._post_all(paused, "/begin_weight_update", {}, stale)
        if stale:
            self._post_all(list(stale), "/end_weight_update", {}, {})
            begun += self._post_all(list(stale), "/begin_weight_update", {}, failed)
        members = [u for u in paused if u in begun]
        nbytes = ntensors = nbuckets = 0
        try:
            while current is not None and members:
                following = next(buckets, None)  # look ahead: the last bucket carries the new weight_version
                last = following is None
                if tuple(members) != self.group_members:
                    self._ensure_group(tuple(members))  # an engine dropped out: the others go on without it
                body = current.request(group_name=self.group_name, flush_cache=last,
                                       weight_version=version if last else None).to_json()
                futures = [(url, self.pool.submit(post_json, f"{url}/update_weights_from_distributed", body,
                                                  self.timeout_s)) for url in members]
                self._staging = current.flatten(self._staging)  # reused: no fresh pages per bucket
                flat = self._staging[:current.nbytes]
                if self.backend == "nccl" and not flat.is_cuda:
                    flat = flat.cuda()
                try:
                    torch.distributed.broadcast(flat, src=0, group=self.group)
                except Exception as err:
                    self._destroy_group()
                    log.error("broadcast of bucket %d to %s failed: %s", nbuckets, members, err)
                bad = _failures(futures)
                for url, why in bad.items():
                    failed[url] = f"bucket {nbuckets}: {why}"
                members = [u for u in members if u not in bad]
                nbytes += flat.numel()
                ntensors += len(current.names)
                nbuckets += 1
                current = following
        except WeightSyncError as err:  # the group did not re-form
            failed.update({u: str(err) for u in members})
            members = []
        finally:
            self._post_all(begun, "/end_weight_update", {}, failed if current is None else {})
        return [u for u in members if u not in failed], nbytes, ntensors, nbuckets

    def _write_disk(self, buckets: Iterator[Bucket], version: str):
        from safetensors.torch import save_file

        path = os.path.join(self.disk_dir, f"weights_v{version}")
        os.makedirs(path, exist_ok=True)
        nbytes = ntensors = nbuckets = 0
        for bucket in buckets:
            tensors = {n: t.detach().contiguous().cpu() for n, t in zip(bucket.names, bucket.tensors)}
            save_file(tensors, os.path.join(path, f"model-{nbuckets:05d}.safetensors"))
            nbytes += bucket.nbytes
            ntensors += len(bucket.names)
            nbuckets += 1
        if not nbuckets:
            raise ValueError("push: no tensors to send")
        if self._last_disk_path not in (None, path):  # keep only the newest directory
            shutil.rmtree(self._last_disk_path, ignore_errors=True)
        self._last_disk_path = path
        return path, nbytes, ntensors, nbuckets

    def close(self) -> None:
        self._destroy_group()
        self.pool.shutdown()

    def __enter__(self) -> WeightBroadcaster:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class _DaemonCalls:
    """submit(fn, *args) -> Future, each call on its own daemon thread. A ThreadPoolExecutor's threads are
    joined when the interpreter exits, so one HTTP call to a hung engine (timeout 600 s) would keep a trainer
    that SIGTERM stopped alive that long; these die with the process."""

    def __init__(self):
        self._live: set[concurrent.futures.Future] = set()
        self._lock = threading.Lock()

    def submit(self, fn, *args) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()

        def run() -> None:
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(*args))
                except BaseException as err:  # handed to whoever waits on the future
                    future.set_exception(err)
            with self._lock:
                self._live.discard(future)

        with self._lock:
            self._live.add(future)
        threading.Thread(target=run, name="weight-sync-call", daemon=True).start()
        return future

    def map(self, fn, items) -> list:
        return [f.result() for f in [self.submit(fn, item) for item in items]]

    def shutdown(self) -> None:
        """Wait (at most PROBE_TIMEOUT_S; not at all once a stop signal arrived) for the calls in flight, e.g.
        destroying a group; a call to a hung engine is left to die with the process."""
        with self._lock:
            live = list(self._live)
        concurrent.futures.wait(live, timeout=0 if stop_signal() is not None else PROBE_TIMEOUT_S)


def _failures(futures, needs_success: bool = True, stoppable: bool = False) -> dict[str, str]:
    """url -> why, for calls that raised, answered >= 300, or (``needs_success``) lacked success: true.

    stoppable: once SIGTERM / SIGUSR1 arrived, answers are awaited until STOP_GRACE_S after the signal, then
    the calls still unanswered count as failed (their engines stay paused and a later push resyncs them), so a
    hung engine does not hold a stopping trainer for the call's whole timeout."""
    if stoppable:
        pending = {fut for _, fut in futures}
        while pending:
            _, pending = concurrent.futures.wait(pending, timeout=STOP_POLL_S)
            if pending and (stopped_for() or 0.0) >= STOP_GRACE_S:
                break
    failed = {}
    for url, fut in futures:
        if stoppable and not fut.done():
            failed[url] = f"no answer before the trainer stopped ({signal.Signals(stop_signal()).name})"
            continue
        try:
            status, body = fut.result()
        except Exception as err:
            failed[url] = f"{type(err).__name__}: {err}"
            continue
        if status >= 300 or (needs_success and not (isinstance(body, dict) and body.get("success"))):
            failed[url] = f"HTTP {status}: {body}"
    return failed
