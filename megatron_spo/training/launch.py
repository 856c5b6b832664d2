"""`megatron-spo train`: launching trainer ranks, forwarding signals, and refusing what cannot fit.

    megatron-spo train CONFIG.yaml [key.path=value ...]

Under torchrun / srun (WORLD_SIZE set) this process trains as its rank; otherwise it spawns cfg.nproc ranks
here and forwards SIGTERM / SIGUSR1 / SIGINT to them (they checkpoint and exit).
"""

from __future__ import annotations

import argparse
import glob
import os
import signal
import sys
from pathlib import Path

from megatron_spo.checkpoint_digest import CheckpointDigestError, set_verify
from megatron_spo.cli import STOP_SIGNALS, exit_while_starting
from megatron_spo.config import ConfigError, load_config
from megatron_spo.run_layout import CheckpointError, Stopped
from megatron_spo.training.config import TrainConfig
from megatron_spo.training.online import FleetUnavailable
from megatron_spo.training.trainer import Trainer, _model_config_from_init, check_before_start


class RankExited(RuntimeError):
    """A spawned rank ended without a Python exception (a signal, os._exit): one line naming it."""


def run(cfg_data: dict) -> int:
    """Train in this process (one rank of a torchrun / srun / spawn launch)."""
    cfg = TrainConfig.model_validate(cfg_data)
    set_verify(cfg.checkpoint.verify)  # what this rank reads (init checkpoint, offline stores) follows the config
    for sig in STOP_SIGNALS:  # a spawned rank starts with the default (die silently) until the trainer's handler
        signal.signal(sig, exit_while_starting)
    try:
        trainer = Trainer(cfg)
    except Stopped as stop:  # SIGTERM while starting up (waiting for the rollout side): nothing to save
        print(f"[megatron-spo] preempted: no step had finished, exiting ({stop}, starting up)", flush=True)
        return 0
    try:
        return trainer.train()
    finally:
        trainer.close()


TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")


def preflight_model(cfg: TrainConfig, world_size: int) -> None:
    """The init model (its config must read) and every check the ranks' trainers run before they build anything
    (trainer.check_before_start: the layout against the model and the world size, the algorithm, the log-prob op),
    here, before any process is spawned. ConfigError naming the field (one line)."""
    from megatron_spo.models.hf_checkpoint import HFCheckpointError

    init = cfg.init
    for field, value in (("init.hf", init.hf), ("init.megatron", init.megatron)):
        if value is not None and not Path(value).is_dir():
            raise ConfigError(f"{field}: '{value}' " + ("is not a folder" if Path(value).exists() else "does not exist"))
    try:
        model = cfg.model or _model_config_from_init(init)
    except (HFCheckpointError, OSError, ValueError) as err:
        raise ConfigError(f"{'init.megatron' if init.megatron else 'init.hf'}: {err}") from None
    check_before_start(cfg, model, world_size)


def preflight_data(cfg: TrainConfig) -> None:
    """What rank 0 reads once training starts, checked before any process is spawned: the offline sources'
    paths and routes (each record's routed_experts against the model: else the first step stops on it) and, with
    an online source, the tokenizer, the task's files, Q0 and the fleet's endpoints (else found only after the
    rollouts started)."""
    from megatron_spo.data.q0 import ESTIMATE_HINT
    from megatron_spo.training.algos import algorithm_needs_q0
    from megatron_spo.training.sources import check_source_routes

    for name, src in cfg.sources.items():
        if src.path is not None and not Path(src.path).exists():
            raise ConfigError(f"sources.{name}.path: '{src.path}' does not exist")
    offline = {name: src for name, src in cfg.sources.items() if name != "online" and src.path is not None}
    model = (cfg.model or _model_config_from_init(cfg.init)) if offline else None
    for name, src in offline.items():
        try:  # streamed: a store's shards without routes are not read
            check_source_routes(name, src, model, verify=cfg.checkpoint.verify)
        except (ValueError, OSError) as err:  # a RoutesError (names the source), or a record that does not read
            text, field = str(err), f"sources.{name}.path"
            raise ConfigError(text if text.startswith(field) else f"{field}: {text}") from None
    if cfg.grpo.guide_path is not None and not Path(cfg.grpo.guide_path).exists():
        raise ConfigError(f"grpo.guide_path: '{cfg.grpo.guide_path}' does not exist")
    if "online" not in cfg.sources:
        return
    hf = cfg.init.hf
    if hf is None:
        raise ConfigError("init.hf: the online source needs the HF directory for the tokenizer")
    if not any((Path(hf) / name).is_file() for name in TOKENIZER_FILES):
        raise ConfigError(f"init.hf: '{hf}' has no tokenizer (none of {', '.join(TOKENIZER_FILES)})")
    for field, paths in (("task.paths", cfg.task.paths), ("task.dedup_against", cfg.task.dedup_against)):
        for path in paths:
            if not (glob.glob(path) if glob.has_magic(path) else Path(path).exists()):
                raise ConfigError(f"{field}: '{path}' " + ("matches no file" if glob.has_magic(path)
                                                          else "does not exist"))
    if cfg.task.q0_path is not None and not Path(cfg.task.q0_path).exists():
        raise ConfigError(f"task.q0_path: '{cfg.task.q0_path}' does not exist")
    if cfg.task.q0_path is None and algorithm_needs_q0(cfg):
        raise ConfigError(f"task.q0_path: algo {cfg.algo} needs Q0 for every online prompt and none is set; "
                          f"{ESTIMATE_HINT}")
    endpoints = cfg.fleet.resolved()
    if not endpoints.engine_urls and not endpoints.router_url:
        raise ConfigError("fleet: no rollout endpoints for the online source (set fleet.router_url or "
                          "fleet.engine_urls, or SPO_ROUTER_URL / SPO_ENGINE_URLS)")


def _preflight_cpu(cfg: TrainConfig, nproc: int) -> None:
    """CPU training holds every rank's share of the policy (weights, fp32 grads, Adam's fp32 master and two
    moments), the frozen reference and, for PPO, the value model on this one machine: refuse up front when
    that cannot fit. (GPU memory is planned by `megatron-spo plan`.)"""
    import torch

    from megatron_spo.memory import BASELINE_BYTES, DTYPE_BYTES, preflight
    from megatron_spo.training.algos import algorithm_class

    if torch.cuda.is_available():
        return
    model = cfg.model or _model_config_from_init(cfg.init)
    item = DTYPE_BYTES[model.params_dtype]
    trained = item + 4 + (0 if item == 4 else 4) + 8  # weights, main grads, fp32 master (16-bit only), Adam m, v
    per_model = model.num_parameters()
    algo = algorithm_class(cfg.algo, load_hooks=False)  # a hook's value model is not counted here
    value_model = algo is not None and algo.uses_value_model
    need = per_model * (trained + item) + (per_model * trained if value_model else 0)
    stages = cfg.parallel.tensor_model_parallel_size * cfg.parallel.pipeline_model_parallel_size
    replicas = max(1, nproc // stages)  # data-parallel copies on this machine
    preflight(f"CPU training of a {per_model / 1e9:.2f}B-parameter {model.architecture} on {nproc} process(es)",
              need * replicas + BASELINE_BYTES * nproc,
              hint="train on GPUs (`megatron-spo plan` sizes the layout) or use a smaller model")


def launch(cfg: TrainConfig) -> None:
    """Under torchrun / srun (WORLD_SIZE set) train as this rank; otherwise start cfg.nproc ranks here
    (``start_local``: several are forked from one helper that imports megatron-core once).

    The launching parent forwards SIGTERM / SIGUSR1 / SIGINT to its ranks (which checkpoint and exit),
    so a scheduler signalling only the launcher still gets a checkpoint and leaves no orphan."""
    if os.environ.get("WORLD_SIZE") or cfg.nproc == 1:
        preflight_model(cfg, int(os.environ.get("WORLD_SIZE") or 1))
        if not os.environ.get("WORLD_SIZE"):
            _preflight_cpu(cfg, 1)
        if os.environ.get("RANK", "0") == "0":  # rank 0 alone reads them
            preflight_data(cfg)
        run(cfg.model_dump(mode="json"))
        return
    preflight_model(cfg, cfg.nproc)
    _preflight_cpu(cfg, cfg.nproc)
    preflight_data(cfg)
    import torch.multiprocessing as mp

    from megatron_spo.models.parallel import FORWARDED_SIGNALS, forward_to, rank_failure, start_local

    ctx = start_local(run, cfg.nproc, cfg.model_dump(mode="json"))
    # to the ranks, or to their helper, which forwards them to the ranks
    previous = {sig: signal.signal(sig, forward_to(ctx.processes)) for sig in FORWARDED_SIGNALS}
    try:
        while not ctx.join(timeout=1.0):
            pass
    except (mp.ProcessRaisedException, mp.ProcessExitedException) as err:  # a rank's one-line reason
        name, reason = rank_failure(err)
        if name == "FleetUnavailable":
            raise FleetUnavailable(reason) from None
        if name == "CheckpointDigestError":  # a corrupt init / resume checkpoint or store: the rank's one line
            raise CheckpointDigestError(reason) from None
        if name == "ConfigError":  # what only a rank finds (its data, its micro-batches): its one line
            raise ConfigError(reason) from None
        if name == "CheckpointError":  # a checkpoint that could not be written (every rank says why)
            raise CheckpointError(reason) from None
        if name == "ProcessExitedException":  # e.g. SIGTERM forwarded before the rank could handle it
            raise RankExited(f"rank {reason.removeprefix('process ')}") from None
        raise
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        for p in ctx.processes:
            if p.is_alive():
                p.terminate()


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="megatron-spo train", description=__doc__.splitlines()[0])
    parser.add_argument("config", help="YAML config (see examples/)")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. optimizer.lr=1e-6 algo=ppo")
    parser.add_argument("--allow-config-change", action="store_true",
                        help="resume even though the config differs from the checkpoint's (checkpoint."
                        "allow_config_change=true): the changes are listed and kept in RUN_DIR/config-history")
    parser.add_argument("--no-verify", action="store_true",
                        help="do not check the init checkpoint, the checkpoint resumed and offline stores against "
                        "their digests (checkpoint.verify=false): for files you edited yourself; a corrupt file is "
                        "otherwise refused naming it")
    args = parser.parse_intermixed_args(argv)
    if args.allow_config_change:
        args.overrides.append("checkpoint.allow_config_change=true")
    if args.no_verify:
        args.overrides.append("checkpoint.verify=false")
    from megatron_spo.memory import MemoryPreflightError

    # until the trainer's PreemptionHandler takes over (Trainer.__init__), SIGTERM exits at once in one line
    previous = {sig: signal.signal(sig, exit_while_starting) for sig in STOP_SIGNALS}
    try:
        launch(load_config(TrainConfig, args.config, args.overrides))
    except MemoryPreflightError as err:
        print(f"megatron-spo train: error: {err}", file=sys.stderr)
        return 2
    except (FleetUnavailable, RankExited, CheckpointError) as err:
        print(f"megatron-spo train: error: {err}", file=sys.stderr)
        return 1
    except CheckpointDigestError as err:
        print(f"megatron-spo train: error: {err}", file=sys.stderr)
        return 2
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 0
