"""Atomic checkpoint directories and preemption signals.

Layout under a run's checkpoint root:

    iter_0000020/            a complete checkpoint: digests.json (every file's size and CRC-32, checkpoint_digest.py)
                             and then its COMPLETE marker are written last
    iter_0000030.partial/    being written (or left by a crash): never loaded, removed on the next save
    latest                   text "iter_0000030", replaced atomically after the directory is complete

A crash at any point leaves either the previous checkpoint as `latest` or the new one fully written:
the rename of the partial directory and the replace of `latest` are the only commit points.
All ranks call save/load collectively; only rank 0 touches the directory structure.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_spo.checkpoint_digest import write_manifest
from megatron_spo.collectives import all_reduce_
from megatron_spo.fsutil import fsync_path, fsync_tree, write_text_atomic

COMPLETE = "COMPLETE"
LATEST = "latest"


class CheckpointError(RuntimeError):
    pass


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def step_dir_name(step: int) -> str:
    return f"iter_{step:07d}"


class CheckpointDir:
    """Manages complete / partial checkpoint directories under `root`."""

    def __init__(self, root: str | Path, keep_last: int = 2):
        if keep_last < 1:
            raise CheckpointError(f"checkpoint keep_last must be >= 1, got {keep_last}")
        self.root = Path(root)
        self.keep_last = keep_last

    def complete_steps(self) -> list[int]:
        steps = []
        if self.root.is_dir():
            for p in self.root.iterdir():
                if p.is_dir() and p.name.startswith("iter_") and p.name[5:].isdigit() and (p / COMPLETE).is_file():
                    steps.append(int(p.name[5:]))
        return sorted(steps)

    def latest(self) -> tuple[int, Path] | None:
        """The newest complete checkpoint, or None. A `latest` pointing at an incomplete dir is ignored."""
        pointer = self.root / LATEST
        if pointer.is_file():
            name = pointer.read_text().strip()
            path = self.root / name
            if (path / COMPLETE).is_file():
                return int(name[5:]), path
        steps = self.complete_steps()
        return (steps[-1], self.root / step_dir_name(steps[-1])) if steps else None

    def metadata(self, path: Path) -> dict:
        try:
            return json.loads((path / COMPLETE).read_text())
        except (OSError, json.JSONDecodeError) as err:
            raise CheckpointError(f"{path / COMPLETE}: unreadable checkpoint marker ({err})") from None

    def save(self, step: int, write: Callable[[Path], None], meta: dict | None = None) -> Path:
        """Collective: every rank calls write(partial_dir); rank 0 then commits. Returns the final path."""
        partial = self.begin(step)
        write(partial)
        return self.commit(step, meta)

    def begin(self, step: int) -> Path:
        """Collective: a fresh partial directory for the step (a left-over one removed); commit() completes it."""
        partial = self.root / (step_dir_name(step) + ".partial")
        if _rank() == 0:
            self.root.mkdir(parents=True, exist_ok=True)
            if partial.exists():
                shutil.rmtree(partial)
            partial.mkdir()
        _barrier()
        return partial

    def commit(self, step: int, meta: dict | None = None, known: dict | None = None) -> Path:
        """Collective, once every rank has written its files into begin(step)'s directory: flushed, digested
        (``known``: {name under the directory: (size, digest)} this rank has already computed), marked complete,
        renamed to the step's directory and made `latest`. Returns the final path."""
        final = self.root / step_dir_name(step)
        partial = self.root / (step_dir_name(step) + ".partial")
        fsync_tree(partial)  # each rank flushes what it wrote (and the folders) before rank 0 marks it complete
        _barrier()
        write_manifest(partial, known=known, collective=True)  # each rank digests its share, rank 0 writes it
        if _rank() == 0:
            marker = {"step": step, "time": time.time(), **(meta or {})}
            write_text_atomic(partial / COMPLETE, json.dumps(marker, indent=1))
            if final.exists():  # re-saving a step after a resume: replace it
                stale = final.with_name(final.name + ".stale")
                if stale.exists():
                    shutil.rmtree(stale)
                os.replace(final, stale)
                os.replace(partial, final)
                shutil.rmtree(stale)
            else:
                os.replace(partial, final)
            fsync_path(self.root)
            write_text_atomic(self.root / LATEST, final.name)
            self._prune(keep=step)
        _barrier()
        return final

    def _prune(self, keep: int) -> None:
        steps = [s for s in self.complete_steps() if s != keep]
        for s in steps[: max(0, len(steps) - (self.keep_last - 1))]:
            shutil.rmtree(self.root / step_dir_name(s), ignore_errors=True)
        for p in self.root.glob("iter_*.partial"):
            if p.name != step_dir_name(keep) + ".partial":
                shutil.rmtree(p, ignore_errors=True)


# ---------------------------------------------------------------------------------------------
# RNG state (per rank: each rank draws its own dropout / sampling streams)
# ---------------------------------------------------------------------------------------------
def rng_state() -> dict:
    import random

    import numpy as np

    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    import random

    import numpy as np

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


# ---------------------------------------------------------------------------------------------
# Preemption: SLURM sends SIGTERM (time limit / scancel) or a configured --signal (USR1) first.
# ---------------------------------------------------------------------------------------------
@contextlib.contextmanager
def children_ignore_preemption_signals():
    """Processes started inside inherit SIG_IGN for SIGUSR1 and SIGTERM.

    SLURM delivers a signal forwarded by srun (or scancel) to every process of the job step, not only to the
    trainer; the reward sandbox must outlive it, because the trainer finishes its step, scoring rollouts,
    before it checkpoints and exits; the offline tools (estimate-q0, eval, pts) save what is scored before
    they exit. (Main thread only: a signal disposition cannot be set elsewhere.)"""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    saved = {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGUSR1, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)


class Stopped(Exception):
    """A preemption signal arrived while the run waited (for rollouts, engines, a push): the wait gives up
    so the run can checkpoint what finished and exit within seconds. The message is the one-line reason."""


_handlers: list[PreemptionHandler] = []  # installed and not yet restored


def stop_signal() -> int | None:
    """The preemption signal a live PreemptionHandler of this process received, if any: what long waits
    poll (every ~0.5 s) so SIGTERM is honoured while waiting, not only between steps."""
    return next((h.received for h in _handlers if h.received is not None), None)


def stopped_for() -> float | None:
    """Seconds since a live PreemptionHandler received its signal (None: none received)."""
    times = [h.received_at for h in _handlers if h.received_at is not None]
    return time.monotonic() - min(times) if times else None


def raise_if_stopped(waiting_for: str) -> None:
    """Stopped('SIGTERM received while waiting for ...') once a preemption signal has arrived."""
    signum = stop_signal()
    if signum is not None:
        raise Stopped(f"{signal.Signals(signum).name} received while waiting for {waiting_for}")


class PreemptionHandler:
    """Records that a checkpoint-and-exit was requested; the train loop polls `requested()` each step,
    and long waits poll `stop_signal()` (raising Stopped).

    `requested()` is collective when torch.distributed is initialised (a MAX all-reduce), so all ranks
    stop at the same step even if the signal reached only some of them.
    """

    def __init__(self, signals: tuple[int, ...] = (signal.SIGTERM, signal.SIGUSR1)):
        self.received: int | None = None
        self.received_at: float | None = None  # time.monotonic() of the first signal
        self._previous = {}
        for sig in signals:
            self._previous[sig] = signal.signal(sig, self._on_signal)
        _handlers.append(self)

    def _on_signal(self, signum, frame) -> None:
        self.received = signum
        self.received_at = self.received_at or time.monotonic()

    def requested(self, group=None) -> bool:
        flag = torch.tensor([1 if self.received is not None else 0], dtype=torch.int32)
        if dist.is_available() and dist.is_initialized():
            all_reduce_(flag, op=dist.ReduceOp.MAX, group=group)
        return bool(flag.item())

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            # a start-up handler ("nothing to save") is not put back: after the run it would say the run was starting
            # when a launcher ends a rank whose peer died (seen: torch's spawn SIGTERMs the survivors)
            signal.signal(sig, signal.SIG_DFL if getattr(handler, "start_up_only", False) else handler)
        self._previous.clear()
        if self in _handlers:
            _handlers.remove(self)
