"""The trainer's checkpoints: what a step saves (models, optimizers, RNG, sampler, model description) and how a
run resumes from the latest complete one. The directory layout and its atomicity: run_layout.py.

    save(trainer) -> step dir        resume(trainer)        (both collective)
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from megatron_spo.config import dump_config
from megatron_spo.run_layout import CheckpointError, rng_state, set_rng_state, step_dir_name

CONFIG_NAME = "config.yaml"
HISTORY_DIR = "config-history"


def sharded_state_dict(trainer, is_loading: bool = False) -> dict:
    """Model and optimizer state of policy (and value) as one sharded dict. For loading, the
    optimizer first creates its state tensors (is_loading) so the template has something to fill.

    Every virtual-stage chunk stores its tensors under the same key prefix ("policy.model0."): a
    chunk's layers are slices of one [num_layers, ...] tensor per key, which the chunks of all
    pipeline ranks cover together (megatron-LM shares one prefix across chunks the same way)."""
    sd = {}
    for name, chunks, opt in (("policy", trainer.policy, trainer.optimizer), ("value", trainer.value, trainer.value_optimizer)):
        if chunks is None:
            continue
        model_sd = {f"model{i}": _model_state(trainer, name, c) for i, c in enumerate(chunks)}
        sd[f"{name}_model"] = model_sd
        sd[f"{name}_optimizer"] = opt.sharded_state_dict(model_sd, is_loading=is_loading)
    if trainer.cfg.reference_refresh_interval:  # the reference is a past policy, not the init weights
        sd["reference_model"] = {f"model{i}": c.sharded_state_dict(prefix=_ckpt_prefix("reference"))
                                 for i, c in enumerate(trainer.reference)}
    return sd


def _model_state(trainer, name: str, chunk) -> dict:
    """A model chunk's sharded state; a LoRA policy's is its adapters only (the frozen base is the init model's,
    named by the checkpoint's lora_base.json)."""
    sd = chunk.module.sharded_state_dict(prefix=_ckpt_prefix(name))
    if name == "policy" and trainer.cfg.lora is not None:
        from megatron_spo.models.lora import is_adapter_param

        sd = {k: v for k, v in sd.items() if is_adapter_param(k)}
    return sd


def lora_base(trainer) -> dict:
    """The init model's identity (models/lora.py base_identity), computed once per trainer."""
    from megatron_spo.models.lora import base_identity

    if getattr(trainer, "_lora_base", None) is None:
        trainer._lora_base = base_identity(trainer.cfg.init.hf, trainer.cfg.init.megatron)
    return trainer._lora_base


def check_lora_base(trainer, step_dir: Path) -> str | None:
    """Why the checkpoint's policy does not fit this run's (None: it does): adapters against a full model, or
    adapters trained on another base model than this run's init."""
    from megatron_spo.models.lora import BASE_IDENTITY_FILE

    saved_file = step_dir / BASE_IDENTITY_FILE
    if trainer.cfg.lora is None:
        return None if not saved_file.is_file() else (
            f"lora: {step_dir} holds LoRA adapters (written with lora set); resume with the lora it was written with, "
            "or train into another run_dir")
    if not saved_file.is_file():
        return (f"lora: {step_dir} holds a full policy (written without lora); resume without lora, or train into "
                "another run_dir")
    saved, current = json.loads(saved_file.read_text()), lora_base(trainer)
    if saved.get("digest") != current["digest"]:
        return (f"init: the adapters in {step_dir} were trained on the base model {saved.get('path')} (digest "
                f"{str(saved.get('digest'))[:12]}), not on this run's init {current['path']} (digest "
                f"{current['digest'][:12]}); resume with that base model, or train into another run_dir")
    return None


def save(trainer, *, background: bool = False) -> Path:
    """Collective: a complete checkpoint of the step (models, optimizers, RNG, sampler) under the run's
    checkpoint directory; returns its path. ``background`` (checkpoint.async_save): the model and optimizer shards
    are written by a thread while the next steps train; the checkpoint is complete (and `latest`) once
    complete_pending() finds every rank's shards written. A save still in flight is completed first."""
    from megatron_spo.models.megatron_checkpoint import save_sharded_state_dict

    complete_pending(trainer, wait=True)
    t0 = time.perf_counter()
    d = trainer.ckpt.begin(trainer.step)
    (d / "dist").mkdir(exist_ok=True) if trainer.rank == 0 else None
    dist.barrier()
    meta = {"world_size": trainer.world, "algo": trainer.cfg.algo}
    if background:
        from megatron_spo.models import async_save

        shards = async_save.start(sharded_state_dict(trainer), d / "dist")
    else:
        # megatron's torch_dist format, written by this process (no forked writer next to the rollout
        # thread), every file fsync'd before the checkpoint is marked complete
        save_sharded_state_dict(sharded_state_dict(trainer), d / "dist")
    _write_trainer_files(trainer, d)
    if background:
        trainer.pending_save = PendingCheckpoint(trainer.step, meta, shards, t0, time.perf_counter() - t0)
        return trainer.ckpt.root / step_dir_name(trainer.step)
    path = trainer.ckpt.commit(trainer.step, meta)
    trainer.checkpoint_metrics = {"checkpoint/blocked_s": time.perf_counter() - t0}
    return path


@dataclass
class PendingCheckpoint:
    """A checkpoint whose shards are being written (save(background=True)): its step, COMPLETE marker's fields,
    the shards' save (models/async_save.py), when it started (perf_counter) and the seconds the step was blocked."""

    step: int
    meta: dict
    shards: Any
    started: float
    blocked_s: float


def complete_pending(trainer, *, wait: bool) -> Path | None:
    """Collective: complete the checkpoint in flight, if any, once every rank's shards are written (``wait``:
    waiting for them); returns its path, or None (none in flight, or not written yet)."""
    from megatron_spo.models import async_save

    pending = getattr(trainer, "pending_save", None)
    if pending is None or not (wait or async_save.written(pending.shards)):
        return None
    t0 = time.perf_counter()
    trainer.pending_save = None  # completed here, or failed: never retried (its .partial is not `latest`)
    partial = trainer.ckpt.root / (step_dir_name(pending.step) + ".partial")
    try:
        async_save.finish(pending.shards, partial)
    except async_save.AsyncSaveError as err:
        latest = trainer.ckpt.latest()
        raise CheckpointError(f"{err}; the last complete checkpoint is "
                              + (f"step {latest[0]} ({latest[1]})" if latest else "none")) from None
    known = {path.relative_to(partial).as_posix(): v for path, v in pending.shards.digests.items()}
    path = trainer.ckpt.commit(pending.step, pending.meta, known)
    now = time.perf_counter()
    trainer.checkpoint_metrics = {"checkpoint/blocked_s": pending.blocked_s + (now - t0),
                                  "checkpoint/background_s": now - pending.started}
    if trainer.rank == 0:
        print(f"[megatron-spo] checkpoint at step {pending.step} complete: {path} (written in the background in "
              f"{now - pending.started:.1f} s; the steps were blocked {pending.blocked_s + now - t0:.2f} s)",
              flush=True)
    return path


def _write_trainer_files(trainer, d: Path) -> None:
    """Everything of a checkpoint but the model and optimizer shards: each rank's RNG; rank 0's step, policy version
    and sampler, the rollouts not yet trained, the config, the model description and a LoRA run's base model."""
    torch.save(rng_state(), d / f"rng_rank{trainer.rank:05d}.pt")
    if trainer.rank == 0:
        state = {"step": trainer.step, "policy_version": trainer.policy_version,
                 "reference_step": trainer.reference_step, "sampler": trainer.sampler.state_dict()}
        (d / "trainer_state.json").write_text(json.dumps(state))
        if hasattr(trainer.online, "buffered_groups"):  # finished rollouts not yet trained: trained next
            write_rollout_buffer(d / ROLLOUT_BUFFER, trainer.online.buffered_groups())
        (d / CONFIG_NAME).write_text(dump_config(trainer.cfg))  # what a resume compares its config with
        write_model_description(trainer, d)
        if trainer.cfg.lora is not None:  # the base model the adapters belong to
            from megatron_spo.models.lora import BASE_IDENTITY_FILE

            (d / BASE_IDENTITY_FILE).write_text(json.dumps(lora_base(trainer)) + "\n")


ROLLOUT_BUFFER = "rollout_buffer.jsonl"  # one finished rollout group per line (the online source's, not yet trained)


def write_rollout_buffer(path: Path, groups: list[list]) -> None:
    """Groups of rollout.manager.Trajectory, one JSON line each: every field (the record's and the sampling
    metadata: request id, temperature, weight versions, ...), routes in the engine's base64 form."""
    with open(path, "w", encoding="utf-8") as f:
        for group in groups:
            f.write(json.dumps([t.to_dict() for t in group]) + "\n")


def read_rollout_buffer(path: Path) -> list[list]:
    """write_rollout_buffer's groups back (their records validated as a trajectory file's; ValueError naming the
    line otherwise)."""
    from dataclasses import fields

    from megatron_spo.data.trajectory import FIELDS, validate_record
    from megatron_spo.rollout.manager import Trajectory

    extra = {f.name for f in fields(Trajectory)} - set(FIELDS)
    groups = []
    for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        group = []
        for item in json.loads(line):
            where = f"{path}:{lineno}"
            record = validate_record({k: v for k, v in item.items() if k in FIELDS}, where)
            meta = {k: v for k, v in item.items() if k in extra}
            group.append(Trajectory(**{f.name: getattr(record, f.name) for f in fields(record)}, **meta))
        groups.append(group)
    return groups


def write_model_description(trainer, d: Path) -> None:
    """What `megatron-spo convert megatron-to-hf` needs besides the weights: the model config, and the
    init model's config.json and tokenizer files (a checkpoint directory converts on its own)."""
    from megatron_spo.models.convert import SOURCE_HF_CONFIG
    from megatron_spo.models.hf_checkpoint import copy_tokenizer_files
    from megatron_spo.models.megatron_checkpoint import write_megatron_config

    write_megatron_config(d, trainer.model_cfg)
    init = trainer.cfg.init.hf or trainer.cfg.init.megatron
    for name in ("config.json", SOURCE_HF_CONFIG) if init else ():  # an HF dir, or a converted one
        if (Path(init) / name).is_file():
            (d / SOURCE_HF_CONFIG).write_text((Path(init) / name).read_text())
            copy_tokenizer_files(init, d)
            break


def _saved_param_groups(obj):
    """Every param_groups list inside a (nested, chained or distributed) optimizer state dict."""
    if isinstance(obj, dict):
        if isinstance(obj.get("param_groups"), list):
            yield obj["param_groups"]
        for value in obj.values():
            yield from _saved_param_groups(value)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            yield from _saved_param_groups(value)


def _with_current_lr_bounds(saved: dict, optimizer) -> dict:
    """The saved optimizer state with its groups' max_lr / min_lr set to the current optimizer's. megatron-core 0.19
    finds each saved group by a key that includes max_lr, so a resume allowed to change optimizer.lr failed there
    ('Could not find parameter group'); the trainer sets every group's lr itself each step, so the bounds carry
    nothing the new config should not override."""
    current = [g for g in getattr(optimizer, "param_groups", []) if "max_lr" in g]
    if not current:
        return saved
    bounds = {k: current[0][k] for k in ("max_lr", "min_lr") if k in current[0]}
    for groups in _saved_param_groups(saved):
        for group in groups:
            if isinstance(group, dict) and "max_lr" in group:
                group.update(bounds)
    return saved


def resume(trainer) -> None:
    """Collective: load the latest complete checkpoint, if any, into the trainer (models, optimizers, RNG,
    step, policy version, sampler)."""
    from megatron.core import dist_checkpointing

    found = trainer.ckpt.latest() if trainer.rank == 0 else None
    payload = [None if found is None else (found[0], str(found[1]))]
    dist.broadcast_object_list(payload, src=0)
    if payload[0] is None:
        return
    step, path = payload[0]
    path = Path(path)
    from megatron_spo.checkpoint_digest import verify_checkpoint

    # every file of the step (dist/, RNG, trainer state, config) against its digest before any is read: rank 0
    # reads them, every rank raises the same one-line error
    verify_checkpoint(path, verify=trainer.cfg.checkpoint.verify, collective=True)
    trainer.config_changes = check_resume_config(trainer.cfg, path, trainer.run_dir)
    problem = [check_lora_base(trainer, path) if trainer.rank == 0 else None]
    dist.broadcast_object_list(problem, src=0)
    if problem[0]:
        from megatron_spo.config import ConfigError

        raise ConfigError(problem[0])
    from megatron_spo.models.dcp_metadata import validate_dist_checkpoint

    # checked as data, never code, before megatron unpickles anything
    stored = validate_dist_checkpoint(path / "dist").state_dict_metadata
    sharded = sharded_state_dict(trainer, is_loading=True)
    if "reference_model" in sharded and not any(k.startswith(_ckpt_prefix("reference")) for k in stored):
        del sharded["reference_model"]  # saved before refreshes were on: the reference is still the init weights
    state = dist_checkpointing.load(sharded, str(path / "dist"))
    for name, chunks, opt in (("policy", trainer.policy, trainer.optimizer), ("value", trainer.value, trainer.value_optimizer)):
        if chunks is None:
            continue
        adapters_only = name == "policy" and trainer.cfg.lora is not None
        for i, c in enumerate(chunks):
            loaded = _strip_prefix(state[f"{name}_model"][f"model{i}"], _ckpt_prefix(name))
            missing, unexpected = c.module.load_state_dict(loaded, strict=not adapters_only)
            from megatron_spo.models.lora import is_adapter_param

            missing = [k for k in missing if is_adapter_param(k)]
            if missing or unexpected:  # (a LoRA policy's checkpoint holds its adapters only)
                raise ValueError(f"{path}: the checkpoint's policy does not fit the model (missing {missing[:3]}, "
                                 f"unexpected {unexpected[:3]})")
        opt.load_state_dict(_with_current_lr_bounds(state[f"{name}_optimizer"], opt))
    if "reference_model" in sharded:
        for i, c in enumerate(trainer.reference):
            c.load_state_dict(_strip_prefix(state["reference_model"][f"model{i}"], _ckpt_prefix("reference")))
    rng_file = path / f"rng_rank{trainer.rank:05d}.pt"
    if rng_file.exists():
        set_rng_state(load_rng_file(rng_file))
    trainer_state = json.loads((path / "trainer_state.json").read_text())
    trainer.step = trainer_state["step"]
    trainer.policy_version = trainer_state["policy_version"]
    if "reference_model" in sharded:  # else the reference is the init weights, whatever a past run did
        trainer.reference_step = trainer_state.get("reference_step", 0)
    if trainer.rank == 0:
        trainer.sampler.load_state_dict(trainer_state["sampler"])
        if (path / ROLLOUT_BUFFER).is_file() and hasattr(trainer.online, "restore_groups"):
            groups = read_rollout_buffer(path / ROLLOUT_BUFFER)
            trainer.online.restore_groups(groups)
            print(f"[megatron-spo] the checkpoint's {sum(map(len, groups))} rollouts not yet trained "
                  f"({len(groups)} groups) are trained first", flush=True)
    if trainer.rank == 0:
        print(f"[megatron-spo] resumed from {path} at step {trainer.step}", flush=True)


def load_rng_file(path: Path) -> dict:
    """An rng_rank*.pt as plain data (weights_only; numpy's RNG state is an ndarray of uint32)."""
    import numpy as np

    from megatron_spo.models.dcp_metadata import CheckpointFileError, weights_only_refusal

    core = np._core if hasattr(np, "_core") else np.core
    allowed = [np.ndarray, np.dtype, type(np.dtype(np.uint32)), core.multiarray._reconstruct]
    try:
        with torch.serialization.safe_globals(allowed):
            return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:
        raise CheckpointFileError(f"{path}: {weights_only_refusal(err)} (an RNG state file is data, never code)") \
            from None


# Fields a resume may change without checkpoint.allow_config_change: more steps, where the (re)started fleet
# is, how the run logs, how many checkpoints it keeps, and the allowance itself.
RESUME_FREE = ("steps", "fleet", "logging", "checkpoint.keep_last", "checkpoint.allow_config_change",
               "checkpoint.verify")


def flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    """{"a": {"b": 1}} -> {"a.b": 1}; lists and scalars are leaves."""
    if not isinstance(tree, dict):
        return {prefix: tree}
    out: dict[str, Any] = {}
    for key, value in tree.items():
        out.update(flatten(value, f"{prefix}.{key}" if prefix else str(key)))
    return out


def config_changes(old: dict, new: dict) -> list[str]:
    """'field: old -> new' for every field that differs between two config dumps (RESUME_FREE fields aside)."""
    a, b = flatten(old), flatten(new)
    changed = []
    for key in sorted(set(a) | set(b)):
        if any(key == f or key.startswith(f + ".") for f in RESUME_FREE) or a.get(key) == b.get(key):
            continue
        changed.append(f"{key}: {a.get(key, '(absent)')!r} -> {b.get(key, '(absent)')!r}")
    return changed


def check_resume_config(cfg, step_dir: Path, run_dir: Path) -> list[str]:
    """The changes of ``cfg`` against the config the checkpoint was written with (its config.yaml; the run's
    for checkpoints older than that). A change is refused (ConfigError listing them) unless
    checkpoint.allow_config_change: resuming with another lr, batch or data silently is a different run."""
    import yaml

    from megatron_spo.config import ConfigError

    saved = next((p for p in (step_dir / CONFIG_NAME, run_dir / CONFIG_NAME) if p.is_file()), None)
    if saved is None:
        return []
    old = yaml.safe_load(saved.read_text()) or {}
    new = cfg.model_dump(mode="json")
    try:  # through today's config class: a field added since (with its default) is no change of the user's
        old = type(cfg).model_validate(old).model_dump(mode="json")
        changes = config_changes(old, new)
    except ValueError:  # written by an older version whose config this one reads differently (a field changed
        # meaning or default): a difference where the new value is today's default is that, not the user's
        defaults = flatten(type(cfg).model_construct().model_dump(mode="json"))
        changes = config_changes(old, new)
        moved = [c for c in changes if flatten(new).get(c.split(":")[0]) == defaults.get(c.split(":")[0])]
        if moved:
            print(f"[megatron-spo] resume: {step_dir}'s config was written by another version; not compared, at "
                  f"today's defaults: {'; '.join(moved)}", flush=True)
        changes = [c for c in changes if c not in moved]
    if changes and not cfg.checkpoint.allow_config_change:
        raise ConfigError(f"resume: the config differs from the one {step_dir} was written with ({'; '.join(changes)})"
                          f"; to resume with it pass checkpoint.allow_config_change=true (megatron-spo train "
                          "--allow-config-change), or train into another run_dir")
    return changes


def record_config(trainer) -> Path:
    """Rank 0 at start: RUN_DIR/config.yaml keeps the run's first config (never overwritten); every start adds
    config-history/NNN-stepS.yaml, the config it ran with, headed by the changes it was allowed. Returns it."""
    import time

    run_dir = Path(trainer.run_dir)
    history = run_dir / HISTORY_DIR
    history.mkdir(parents=True, exist_ok=True)
    text = dump_config(trainer.cfg)
    if not (run_dir / CONFIG_NAME).exists():
        (run_dir / CONFIG_NAME).write_text(text)
    changes = getattr(trainer, "config_changes", [])
    head = [f"# started {time.strftime('%Y-%m-%d %H:%M:%S')} at step {trainer.step}"]
    head += [f"# changed on resume: {c}" for c in changes]
    entry = history / f"{len(list(history.glob('*.yaml'))):03d}-step{trainer.step}.yaml"
    entry.write_text("\n".join(head) + "\n" + text)
    if changes:
        print(f"[megatron-spo] resumed with a changed config ({'; '.join(changes)}); recorded in {entry}", flush=True)
    return entry


def _ckpt_prefix(name: str) -> str:
    """Checkpoint key prefix of model `name` ("policy", "value", "reference"), shared by its virtual-stage
    chunks."""
    return f"{name}.model0."


def _strip_prefix(sd: dict, prefix: str) -> dict:
    return {(k[len(prefix):] if k.startswith(prefix) else k): v for k, v in sd.items()}
