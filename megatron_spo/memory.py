"""How much memory this process may use and has used, and a preflight that refuses a load that will not fit.

    avail = available_memory()            # Available(bytes, "MemAvailable" | "cgroup memory limit ...")
    preflight("check-conversion", need_bytes, hint="--vocab-chunk 8192 lowers it")   # MemoryPreflightError
    peak_rss_gb()                         # this process's peak resident set so far (the trainer's metric)
    reset_peak_rss()                      # ... counted from now (the trainer starts its own)
    result, peak = peak_anon_bytes(fn, *args)   # one call's peak private memory above its level before

The kernel's OOM killer gives no message of ours; a one-line refusal before the load does. The available
amount is the smallest of /proc/meminfo's MemAvailable and the room left under this process's cgroup
memory limit (v2 memory.max, or v1 memory.limit_in_bytes: what SLURM and containers set), each minus
what the cgroup already uses. Page cache of memory-mapped checkpoint files is not counted as need:
the kernel reclaims it.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

GB = 1e9
_UNLIMITED = 1 << 60  # cgroup v1 reports "no limit" as a huge number


class MemoryPreflightError(RuntimeError):
    """A load that would not fit in memory: one line with the need, what is available and what helps."""


@dataclass(frozen=True)
class Available:
    bytes: int
    source: str


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    if text == "max":
        return None
    try:
        return int(text)
    except ValueError:
        return None


def _meminfo_available() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _cgroup_room(root: Path = Path("/sys/fs/cgroup"), proc_cgroup: Path = Path("/proc/self/cgroup")) -> tuple[int, str] | None:
    """(bytes left under the tightest memory limit on this process's cgroup path, which file), or None."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return None
    best: tuple[int, str] | None = None
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, rel = parts
        rel = rel.lstrip("/")
        if controllers == "":  # cgroup v2 (unified)
            base, limit_name, usage_name = root, "memory.max", "memory.current"
            if not (root / "cgroup.controllers").is_file():
                base = root / "unified"
        elif "memory" in controllers.split(","):
            base, limit_name, usage_name = root / "memory", "memory.limit_in_bytes", "memory.usage_in_bytes"
        else:
            continue
        here = base / rel
        while True:  # a limit on any ancestor applies too
            limit = _read_int(here / limit_name)
            if limit is not None and limit < _UNLIMITED:
                used = _read_int(here / usage_name) or 0
                room = max(0, limit - used)
                if best is None or room < best[0]:
                    best = (room, f"cgroup memory limit {limit / GB:.1f} GB at {here / limit_name}")
            if here == base or here.parent == here:
                break
            here = here.parent
    return best


def available_memory() -> Available:
    """What a new allocation can use without the OOM killer stepping in (see the module docstring)."""
    override = os.environ.get("MEGATRON_SPO_MEMORY_LIMIT_BYTES")  # for machines whose limit is not visible
    candidates: list[tuple[int, str]] = []
    if override:
        candidates.append((int(override), "MEGATRON_SPO_MEMORY_LIMIT_BYTES"))
    meminfo = _meminfo_available()
    if meminfo is not None:
        candidates.append((meminfo, "MemAvailable in /proc/meminfo"))
    room = _cgroup_room()
    if room is not None:
        candidates.append(room)
    if not candidates:
        return Available(_UNLIMITED, "unknown (no /proc/meminfo or cgroup limit)")
    return Available(*min(candidates))


def preflight(what: str, need_bytes: float, hint: str = "") -> Available:
    """Raise MemoryPreflightError when ``need_bytes`` exceeds what is available; else return it."""
    avail = available_memory()
    if need_bytes > avail.bytes:
        more = f"; {hint}" if hint else ""
        raise MemoryPreflightError(
            f"{what} needs about {need_bytes / GB:.1f} GB of memory but {avail.bytes / GB:.1f} GB is available "
            f"({avail.source}){more}"
        )
    return avail


BASELINE_BYTES = 1.0 * GB  # torch + megatron-core + transformers imported, process groups, one model skeleton
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def layer_and_vocab_bytes(cfg, dtype: str | None = None) -> tuple[float, float]:
    """(bytes of one decoder layer, bytes of one [V, H] vocabulary tensor) of a ModelConfig in ``dtype``
    (default: its params_dtype)."""
    item = DTYPE_BYTES[dtype or cfg.params_dtype]
    h, f, d = cfg.hidden_size, cfg.ffn_hidden_size, cfg.head_dim
    q, kv = cfg.num_attention_heads * d, cfg.num_query_groups * d
    layer = 2 * h * q + 2 * h * kv + 3 * h * f + 2 * h
    return layer * item, cfg.vocab_size * h * item


def model_bytes(cfg, dtype: str | None = None) -> float:
    return cfg.num_parameters() * DTYPE_BYTES[dtype or cfg.params_dtype]


def release_large_frees() -> bool:
    """Make glibc give every freed allocation of 1 MB or more back to the kernel at once (mallopt
    M_MMAP_THRESHOLD): its default threshold grows with each large free, after which per-layer buffers of up
    to 32 MB are recycled on the heap and the process keeps several layers' worth (measured: 204 MB instead
    of 31 MB private for a streaming check of an 81M-parameter model). Returns False where not glibc."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    if not name:
        return False
    try:
        libc = ctypes.CDLL(name)
        return bool(libc.mallopt(-3, 1 << 20))  # M_MMAP_THRESHOLD = -3
    except (OSError, AttributeError):
        return False


def peak_rss_gb() -> float:
    """This process's peak resident set size so far, in GB: /proc/self/status VmHWM (ru_maxrss would carry a
    launcher's peak over the exec), getrusage elsewhere. On CPU this is the trainer's whole footprint, value model
    included; on GPU the device memory is apart."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024 / 1e9
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9


def reset_peak_rss() -> bool:
    """Start peak_rss_gb() over from the current resident set (Linux: "5" to /proc/self/clear_refs), so a trainer
    running inside a longer process (the quickstart builds its reference model first) reports its own peak.
    False where the kernel does not offer it (the peak then covers the whole process)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def anon_bytes() -> int:
    """This process's private resident memory now, in bytes: /proc/self/status RssAnon (page cache and memory-mapped
    files excluded); 0 where there is no such line."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    return 0


def peak_anon_bytes(fn: Callable[..., Any], *args, **kwargs) -> tuple[Any, int]:
    """(fn(*args, **kwargs), the peak of anon_bytes() during the call above its level before it), sampled every
    2 ms on a thread. Warm up first: imports and one-time set-up in the call count as its memory."""
    base = anon_bytes()
    peak = [base]
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], anon_bytes())
            time.sleep(0.002)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    try:
        result = fn(*args, **kwargs)
    finally:
        done.set()
        thread.join()
    return result, max(peak[0], anon_bytes()) - base
