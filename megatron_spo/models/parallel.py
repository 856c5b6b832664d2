"""torch.distributed + megatron parallel_state from a ParallelConfig (gloo on CPU, NCCL on GPU).

    init_parallel(parallel_cfg, model_cfg, seed=1234)   # reads RANK / WORLD_SIZE / MASTER_* (torchrun)
    ...
    destroy_parallel()

``spawn_local(fn, world_size, *args)`` runs ``fn(*args)`` on ``world_size`` local ranks with the torchrun
environment set (free port on 127.0.0.1): ``megatron-spo train`` (``start_local``) and tests use it on one machine.
Scripts that call it need an ``if __name__ == "__main__":`` guard (spawn re-imports the main module).
"""

from __future__ import annotations

import datetime
import os
import signal
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from megatron_spo.config import ConfigError
from megatron_spo.models.config import ModelConfig, ParallelConfig
from megatron_spo.models.cpu_shims import apply_cpu_shims
from megatron_spo.net import STORE_HOSTED_ENV, hosted_store


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ConfigError(f"environment variable {name}={raw!r} is not an integer") from None


def check_layout(parallel_cfg: ParallelConfig, model_cfg: ModelConfig, world_size: int) -> None:
    """Refuse layouts that cannot work, before any process group exists (one-line ConfigError)."""
    parallel_cfg.check(model_cfg, world_size)
    if model_cfg.fp8:
        from megatron_spo import extras

        if extras.transformer_engine() is None:
            raise ConfigError("model.fp8 needs transformer-engine and a GPU; neither is usable here")


def enable_deterministic() -> bool:
    """Bitwise-reproducible CUDA runs: torch's deterministic algorithms (an op that has no deterministic kernel
    raises, naming itself) and the fixed cuBLAS workspace they need, set before the first GEMM. CPU runs are
    deterministic already; this costs nothing there. Returns whether they were on before (to restore)."""
    before = torch.are_deterministic_algorithms_enabled()
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    return before


def init_parallel(
    parallel_cfg: ParallelConfig,
    model_cfg: ModelConfig,
    *,
    seed: int = 1234,
    timeout_minutes: int = 30,
) -> None:
    """Initialise the default process group and megatron's TP/PP/DP groups, then seed RNGs.

    The layout is checked first: a bad layout raises ConfigError and builds no group.
    """
    world_size = _env_int("WORLD_SIZE", 1)
    rank = _env_int("RANK", 0)
    check_layout(parallel_cfg, model_cfg, world_size)
    apply_cpu_shims()

    from megatron.core import parallel_state, tensor_parallel

    on_gpu = torch.cuda.is_available()
    if not dist.is_initialized():
        if on_gpu:
            torch.cuda.set_device(_env_int("LOCAL_RANK", rank % max(torch.cuda.device_count(), 1)))
        timeout = datetime.timedelta(minutes=timeout_minutes)
        dist.init_process_group(backend="nccl" if on_gpu else "gloo", rank=rank, world_size=world_size,
                                timeout=timeout, store=_rendezvous_store(world_size, timeout))
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=parallel_cfg.tensor_model_parallel_size,
        pipeline_model_parallel_size=parallel_cfg.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=parallel_cfg.virtual_pipeline_model_parallel_size,
        context_parallel_size=parallel_cfg.context_parallel_size,
        expert_model_parallel_size=parallel_cfg.expert_model_parallel_size,
        distributed_timeout_minutes=timeout_minutes,
    )
    torch.manual_seed(seed)
    if on_gpu:
        tensor_parallel.model_parallel_cuda_manual_seed(seed)
    else:
        # The plain call needs the CUDA RNG; the inference tracker keeps its states on the CPU.
        tensor_parallel.model_parallel_cuda_manual_seed(
            seed, inference_rng_tracker=True, force_reset_rng=True
        )


def _rendezvous_store(world_size: int, timeout: datetime.timedelta):
    """The store the default group meets on; None: torch's env:// (MASTER_ADDR/MASTER_PORT, rank 0 hosts).

    A launcher hosting the store (``start_local``) makes every rank a client of it. A lone process with no
    MASTER_PORT hosts its own on a port bound as it is chosen: two single-process jobs on one machine (the
    quickstart's conversion next to another run) neither share a fixed default nor race for a probed port."""
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if os.environ.get(STORE_HOSTED_ENV) == "1":
        return dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size,
                             is_master=False, timeout=timeout)
    if "MASTER_PORT" in os.environ:
        return None
    if world_size == 1:
        return hosted_store(1, timeout)
    os.environ["MASTER_PORT"] = "29500"  # torch's own default, for a launcher that set everything else
    return None


def destroy_parallel() -> None:
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def _spawn_entry(local_rank: int, world_size: int, port: int, fn: Callable, args: tuple) -> None:
    os.environ.update(
        RANK=str(local_rank),
        LOCAL_RANK=str(local_rank),
        WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        OMP_NUM_THREADS="1",
        **{STORE_HOSTED_ENV: "1"},  # start_local's caller hosts the store on the port
    )
    signal.pthread_sigmask(signal.SIG_UNBLOCK, FORWARDED_SIGNALS)  # a forked rank inherits its helper's mask
    whole_lines()
    torch.set_num_threads(1)
    fn(*args)


def whole_lines() -> None:
    """Each line a rank prints reaches the shared stdout / stderr in one write. Under ``python -u`` (pytest-xdist's
    workers, and a fork server they start) print writes its text and its newline apart, so two ranks' lines could
    join ("rank 1 on stdoutrank 2 on stdout", seen once in four CI runs); line buffering writes each whole line."""
    import sys

    for stream in (sys.stdout, sys.stderr):
        reconfigure = getattr(stream, "reconfigure", None)
        if reconfigure is not None:
            stream.flush()
            reconfigure(line_buffering=True, write_through=False)


# A process that starts many groups (the test suite) may set this: each group's helper is then forked from one
# long-lived server that imported RANK_IMPORTS once (multiprocessing's fork server, CPU only), not spawned and
# importing megatron-core again. The CLI's launches start one group each and keep the spawned helper.
FORK_SERVER = False

# What every rank imports before its first step (the optimizer's first param group imports torch._dynamo): imported
# once in the launch's helper, which then forks the ranks.
RANK_IMPORTS = ("megatron.core", "megatron.core.models.gpt", "megatron.core.optimizer",
                "megatron.core.pipeline_parallel", "torch._dynamo")
FORWARDED_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)


def forward_to(processes) -> Callable:
    """A signal handler that sends the signal it receives on to every live process of ``processes``."""

    def forward(signum, frame):
        for p in processes:
            if p.is_alive():
                os.kill(p.pid, signum)

    return forward


class _CallersFd:
    """One of the caller's file descriptors, arriving in a process forked from the fork server as a duplicate (an
    int): pickled while the process starts, as multiprocessing hands a pipe to its children."""

    def __init__(self, fd: int):
        self.fd = fd

    def __reduce__(self):
        from multiprocessing import reduction

        return _detach, (reduction.DupFd(self.fd),)


def _detach(dup) -> int:
    return dup.detach()


def _fork_ranks(_index: int, world_size: int, port: int, fn: Callable, args: tuple,
                caller: tuple[dict[str, str], str, tuple[int, int, int]] | None = None) -> None:
    """The launch's helper process: import what the ranks need once, fork ``world_size`` ranks from here, forward
    SIGTERM / SIGUSR1 / SIGINT to them, and raise what the first failing rank raised. A fresh (spawned) process,
    on a machine without a CUDA device, that has run no torch op: forking it is safe. Each rank saves the ~10 CPU
    seconds of importing megatron-core on its own (measured on 2 cores).

    Preempted while importing (SIGTERM / SIGUSR1), it ends as a starting rank does: one line, exit 0 (SLURM
    requeues on 0). Across the fork the signals are blocked, so none is lost or lands on the default action: the
    ranks unblock them (``_spawn_entry``), the helper once its forwarding handler is in place.

    Forked from the fork server instead (``FORK_SERVER``), the helper takes the caller's environment, working
    directory and standard streams (``caller``): the server's are those of when it started."""
    import importlib

    import torch.multiprocessing as mp

    from megatron_spo.cli import STOP_SIGNALS, exit_while_starting

    if caller is not None:
        environ, cwd, stdio = caller
        os.environ.clear()
        os.environ.update(environ)
        os.chdir(cwd)
        for target, fd in enumerate(stdio):
            os.dup2(fd, target)
            os.close(fd)

    for sig in STOP_SIGNALS:
        signal.signal(sig, exit_while_starting)
    for name in RANK_IMPORTS:
        importlib.import_module(name)
    signal.pthread_sigmask(signal.SIG_BLOCK, FORWARDED_SIGNALS)
    for sig in STOP_SIGNALS:  # the ranks start with the default, as spawned ones do, until their own handlers
        signal.signal(sig, signal.SIG_DFL)
    ctx = mp.start_processes(_spawn_entry, args=(world_size, port, fn, args), nprocs=world_size, join=False,
                             start_method="fork")
    for sig in FORWARDED_SIGNALS:
        signal.signal(sig, forward_to(ctx.processes))
    signal.pthread_sigmask(signal.SIG_UNBLOCK, FORWARDED_SIGNALS)  # one that came meanwhile is forwarded now
    try:
        while not ctx.join(timeout=1.0):
            pass
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.terminate()


def start_local(fn: Callable[..., Any], world_size: int, *args: Any):
    """Start ``fn(*args)`` on ``world_size`` local ranks with a torchrun-style environment; returns torch's
    ProcessContext (``join()`` it). Without a CUDA device several ranks are forked from one spawned helper that
    has imported megatron-core (``_fork_ranks``); one rank, or any number on a machine with a CUDA device, is
    spawned directly (CUDA's driver state does not survive a fork, and Transformer Engine touches the device when
    megatron-core imports it). With ``FORK_SERVER`` (CPU) the helper, for one rank too, is forked from a server
    that imported megatron-core once per calling process. A failing rank's error reaches ``join()`` as a
    ProcessRaisedException whose last line is the rank's (for a rank ended by a signal or ``os._exit``:
    ``...ProcessExitedException: process R terminated with ...``); ``rank_failure`` reads it.
    ``fn`` must be importable (module level)."""
    import torch.multiprocessing as mp

    # the ranks meet on a store this process hosts, bound before any rank starts, and kept with the context
    store = hosted_store(world_size, datetime.timedelta(minutes=30))
    if torch.cuda.is_available() or (world_size == 1 and not FORK_SERVER):
        ctx = mp.start_processes(_spawn_entry, args=(world_size, store.port, fn, args), nprocs=world_size,
                                 join=False, start_method="spawn")
    elif FORK_SERVER:
        mp.get_context("forkserver").set_forkserver_preload([__name__, *RANK_IMPORTS])
        caller = (dict(os.environ), os.getcwd(), tuple(_CallersFd(fd) for fd in (0, 1, 2)))
        ctx = mp.start_processes(_fork_ranks, args=(world_size, store.port, fn, args, caller), nprocs=1,
                                 join=False, start_method="forkserver")
    else:
        ctx = mp.start_processes(_fork_ranks, args=(world_size, store.port, fn, args), nprocs=1, join=False,
                                 start_method="spawn")
    ctx.rendezvous_store = store
    return ctx


def rank_failure(err: Exception) -> tuple[str, str]:
    """(exception class name, its message) of the failing rank, from the exception ``join()`` raised."""
    import torch.multiprocessing as mp

    if isinstance(err, mp.ProcessExitedException):  # the one spawned process ended without a Python exception
        return "ProcessExitedException", str(err)
    last = str(err).strip().splitlines()[-1]
    name, _, reason = last.partition(": ")
    return name.rpartition(".")[2], reason


def spawn_local(fn: Callable[..., Any], world_size: int, *args: Any) -> None:
    """Run ``fn(*args)`` on ``world_size`` local ranks (``start_local``) and wait. Raises if any rank fails."""
    ctx = start_local(fn, world_size, *args)
    while not ctx.join(timeout=1.0):
        pass
