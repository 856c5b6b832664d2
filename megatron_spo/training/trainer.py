"""The trainer: one loop for SPO, AGRO and PPO on megatron-core, from one CPU process to 128 GPUs.

    megatron-spo train CONFIG.yaml [key.path=value ...]

Each step:
  1. rank 0 draws the global batch from the configured sources (online rollout buffer, offline stores,
     MC-annotated sets) by their weights and broadcasts it; each data-parallel rank takes whole prompt
     groups; micro-batches are cut by a padded-token budget;
  2. reference forward (no grad) -> ref log-probs; for PPO also the value model's old values;
  3. policy forward + backward through megatron's pipeline schedule; token log-probs come from the
     fused op on the final hidden states (no [tokens x vocab] tensor is kept), the loss per source;
  4. optimizer step (megatron optimizer: grad clipping, optional distributed optimizer), warm-up LR;
  5. every model_update_interval steps the policy weights go to the rollout fleet;
  6. metrics (metrics.jsonl, wandb), checkpoints every k steps and on SIGTERM / SIGUSR1.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_spo.config import ConfigError, LogprobsConfig, TrainConfig, dump_config, load_config
from megatron_spo.data.batching import (
    OfflineCursor,
    TrainBatch,
    collate,
    source_counts,
    split_by_token_budget,
)
from megatron_spo.training import loss as losses
from megatron_spo.training.checkpoint import CheckpointDir, PreemptionHandler, rng_state, set_rng_state
from megatron_spo.training.metrics import MetricsLogger

IGNORE_INDEX = -100  # targets the fused log-prob op skips: prompt and padding positions (outside loss_mask)


class TrainingDiverged(RuntimeError):
    pass


# ---------------------------------------------------------------------------------------------
# Data sources (rank 0 only)
# ---------------------------------------------------------------------------------------------
class OfflineSource:
    """Trajectories from a JSONL file or an offline store, drawn in resumable shuffled epochs."""

    def __init__(self, name: str, path: str, seed: int):
        from megatron_spo.data.trajectory import load_trajectories

        self.name = name
        self.records = load_trajectories(path)
        for r in self.records:
            r.source = name  # the source name selects the loss, whatever the file said
        self.cursor = OfflineCursor(len(self.records), seed=seed)

    def take(self, k: int, timeout_s: float | None = None) -> list:
        return [self.records[i] for i in self.cursor.take(k)]

    def state_dict(self) -> dict:
        return self.cursor.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.cursor.load_state_dict(state)


class BatchSampler:
    """Mixes sources by weight into one global batch of trajectories."""

    def __init__(self, sources: dict, weights: dict[str, float]):
        self.sources, self.weights = sources, weights

    def next(self, n: int) -> list:
        out = []
        for name, k in source_counts(self.weights, n).items():
            if k:
                out.extend(self.sources[name].take(k))
        return out

    def state_dict(self) -> dict:
        return {name: s.state_dict() for name, s in self.sources.items() if hasattr(s, "state_dict")}

    def load_state_dict(self, state: dict) -> None:
        for name, s in self.sources.items():
            if name in state and hasattr(s, "load_state_dict"):
                s.load_state_dict(state[name])


def check_logprobs(cfg: LogprobsConfig) -> None:
    """Refuse, before any model is built, a log-prob op setting this machine cannot run (one-line ConfigError)."""
    from megatron_spo import extras
    from megatron_spo.ops import fp8_available

    if cfg.fp8 and not fp8_available():
        raise ConfigError("logprobs.fp8: the FP8 LM-head GEMM needs a GPU of compute capability >= 8.9; "
                          "none is usable here")
    if cfg.backend == "triton":
        if extras.triton() is None:
            raise ConfigError("logprobs.backend: 'triton' needs triton installed (pip install triton)")
        if not extras.cuda_available() and os.environ.get("TRITON_INTERPRET") != "1":
            raise ConfigError("logprobs.backend: 'triton' needs a GPU (or TRITON_INTERPRET=1, for tests); "
                              "use 'auto' or 'torch' on CPU")


# ---------------------------------------------------------------------------------------------
# The trainer
# ---------------------------------------------------------------------------------------------
class Trainer:
    def __init__(self, cfg: TrainConfig, *, online_source=None):
        """online_source: the 'online' source on rank 0 (default: OnlineSource.from_config(cfg), the
        rollout manager over cfg.fleet). It has take(k), and push_weights(version, hf_tensors) if it
        feeds engines that must receive the policy's weights."""
        from megatron.core import parallel_state

        from megatron_spo.models import builders
        from megatron_spo.models.parallel import init_parallel

        self.cfg = cfg
        check_logprobs(cfg.logprobs)
        # first of all: a SLURM warning signal during the (long) model build must not kill the rank
        self.preemption = PreemptionHandler()
        self.model_cfg = cfg.model or _model_config_from_init(cfg.init)
        init_parallel(cfg.parallel, self.model_cfg, seed=cfg.seed)
        self.ps = parallel_state
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()
        self.dp_rank = parallel_state.get_data_parallel_rank()
        self.dp_size = parallel_state.get_data_parallel_world_size()
        self.is_last_stage = parallel_state.is_pipeline_last_stage(ignore_virtual=True)
        self.device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None

        self.policy = self._schedule_ready(builders.build_policy(self.model_cfg, cfg.parallel))
        self.reference = self._schedule_ready(builders.build_reference(self.model_cfg, cfg.parallel))
        self._load_initial_weights()
        self.policy, self.optimizer = self._wrap_and_optimizer(self.policy, cfg.optimizer.lr)
        self.value = self.value_optimizer = None
        if cfg.algo == "ppo":
            value = self._schedule_ready(builders.build_value_model(self.model_cfg, cfg.parallel))
            self._load_initial_weights(value, keep_own=("value_head.",))  # the trunk from the init model
            self.value, self.value_optimizer = self._wrap_and_optimizer(value, cfg.optimizer.value_lr or cfg.optimizer.lr)

        self.run_dir = Path(cfg.run_dir)
        self.ckpt = CheckpointDir(cfg.checkpoint.dir or self.run_dir / "checkpoints", cfg.checkpoint.keep_last)
        self.step = 0
        self.policy_version = 0
        self.sampler = None
        self.online = None
        if self.rank == 0:
            sources = {}
            for name, src in cfg.sources.items():
                if name == "online":
                    if online_source is None:
                        from megatron_spo.training.online import OnlineSource

                        online_source = OnlineSource.from_config(cfg)
                    self.online = sources[name] = online_source
                else:
                    sources[name] = OfflineSource(name, src.path, seed=cfg.seed)
            self.sampler = BatchSampler(sources, {n: s.weight for n, s in cfg.sources.items()})
        self.pad_id = 0
        self._resume()
        self.metrics = MetricsLogger(self.run_dir, enabled=self.rank == 0,
                                     wandb_project=cfg.logging.wandb_project if cfg.logging.wandb_mode != "disabled"
                                     else None, wandb_mode=cfg.logging.wandb_mode,
                                     config=cfg.model_dump(mode="json"), resume_from_step=self.step)
        if self.rank == 0:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            (self.run_dir / "config.yaml").write_text(dump_config(cfg))

    # -- setup ---------------------------------------------------------------------------------
    def _load_initial_weights(self, chunks=None, keep_own: tuple[str, ...] = ()) -> None:
        """Policy and reference (or the given chunks) from init.megatron, else from the HF weights.
        keep_own: key prefixes the init checkpoint lacks, left as the model initialised them."""
        from megatron_spo.models import hf_checkpoint, hf_map

        targets = [chunks] if chunks is not None else [self.policy, self.reference]
        if self.cfg.init.megatron:
            from megatron_spo.models.megatron_checkpoint import load_megatron

            for target in targets:
                load_megatron(target, self.cfg.init.megatron, keep_own=keep_own)
        elif self.cfg.init.hf:
            reader = hf_checkpoint.HFReader(self.cfg.init.hf)
            reader.validate(self.model_cfg)
            with torch.no_grad():
                for target in targets:
                    hf_map.load_hf_into_model(target, self.model_cfg, reader.get)

    def _schedule_ready(self, chunks):
        """Pipeline micro-batches differ in shape (token-budget packing): p2p sends shapes first.

        Not with virtual stages: megatron exchanges shapes in one batched isend/irecv to the previous and
        the next rank, and with PP=2 both are the same rank, so the interleaved schedule's two-way steps
        mix the forward and backward shapes up (a deadlock on gloo). Here every micro-batch of a step
        has one shape instead (_micro_batches, _run), and the tensors themselves go through megatron's
        unbatched p2p, which keeps the two directions apart for PP=2 on separate groups (batched p2p
        mixes them up the same way: FIELD-NOTES, wrong gradients on gloo)."""
        pp = self.cfg.parallel.pipeline_model_parallel_size
        virtual = bool(self.cfg.parallel.virtual_pipeline_model_parallel_size)
        for chunk in chunks:
            chunk.config.variable_seq_lengths = pp > 1 and not virtual
            if virtual and pp == 2:
                chunk.config.batch_p2p_comm = chunk.config.batch_p2p_sync = False
        return chunks

    def _wrap_and_optimizer(self, chunks, lr: float):
        from megatron.core.distributed import (
            DistributedDataParallel,
            DistributedDataParallelConfig,
            finalize_model_grads,
        )
        from megatron.core.optimizer import OptimizerConfig as MegatronOptimizerConfig
        from megatron.core.optimizer import get_megatron_optimizer

        cfg = self.cfg
        ddp_cfg = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, overlap_grad_reduce=False,
            use_distributed_optimizer=cfg.parallel.use_distributed_optimizer)
        wrapped = []
        for i, chunk in enumerate(chunks):
            chunk.config.finalize_model_grads_func = finalize_model_grads
            wrapped.append(DistributedDataParallel(config=chunk.config, ddp_config=ddp_cfg, module=chunk,
                                                   disable_bucketing=i > 0))
        o = cfg.optimizer
        dtype = chunks[0].config.params_dtype
        opt = get_megatron_optimizer(
            MegatronOptimizerConfig(optimizer="adam", lr=lr, weight_decay=o.weight_decay, adam_beta1=o.adam_beta1,
                                    adam_beta2=o.adam_beta2, adam_eps=o.adam_eps, clip_grad=o.clip_grad,
                                    bf16=dtype == torch.bfloat16, fp16=False, params_dtype=dtype,
                                    use_distributed_optimizer=cfg.parallel.use_distributed_optimizer),
            wrapped)
        return wrapped, opt

    # -- the step ------------------------------------------------------------------------------
    def lr_at(self, step: int, base: float) -> float:
        """Linear warm-up over warmup_steps, then constant (the paper's schedule). step is 1-based."""
        w = self.cfg.optimizer.warmup_steps
        return base * min(1.0, step / w) if w > 0 else base

    def _global_batch(self) -> tuple[list, float]:
        t0 = time.perf_counter()
        payload = [None]
        if self.rank == 0:
            payload = [self.sampler.next(self.cfg.batch.sequences_per_step)]
        dist.broadcast_object_list(payload, src=0)
        return payload[0], time.perf_counter() - t0

    def _shard(self, trajs: list) -> list:
        """This data-parallel rank's trajectories: whole prompt groups, round-robin."""
        groups: dict = {}
        for t in trajs:
            groups.setdefault(t.prompt_id, []).append(t)
        mine = [g for i, g in enumerate(groups.values()) if i % self.dp_size == self.dp_rank]
        if not mine:
            raise ConfigError(f"batch: {len(groups)} prompt groups cannot feed {self.dp_size} data-parallel ranks; "
                              "raise batch.sequences_per_step")
        return [t for g in mine for t in g]

    def _micro_batches(self, trajs: list) -> list[TrainBatch]:
        lengths = [len(t.prompt_tokens) + len(t.response_tokens) - 1 for t in trajs]
        too_long = [i for i, n in enumerate(lengths) if n + 1 > self.cfg.batch.max_seq_length]
        if too_long:
            i = too_long[0]
            raise ValueError(f"batch: trajectory of prompt {trajs[i].prompt_id!r} has {lengths[i] + 1} tokens, "
                             f"over batch.max_seq_length {self.cfg.batch.max_seq_length}")
        keep = [t.prompt_id for t in trajs] if self.cfg.algo in ("agro",) else None
        pp = self.cfg.parallel.pipeline_model_parallel_size
        virtual = bool(self.cfg.parallel.virtual_pipeline_model_parallel_size)
        width = max(lengths) if virtual else None  # one shape per step with virtual stages (_schedule_ready)
        parts = split_by_token_budget([width] * len(lengths) if virtual else lengths,
                                      self.cfg.batch.max_tokens_per_micro_batch, keep_groups=keep)
        if virtual and len(parts) < pp:
            # megatron's interleaved schedule needs at least PP micro-batches per step
            parts = _split_to_count(parts, pp, keep)
            if len(parts) < pp:
                unit = "prompt groups" if keep else "sequences"
                raise ConfigError(f"batch: the interleaved pipeline schedule (parallel.virtual_pipeline_model_"
                                  f"parallel_size) needs at least {pp} micro-batches per step, but data-parallel "
                                  f"rank {self.dp_rank} has only {len(parts)} {unit}; raise batch.sequences_per_step")
        # sequence parallelism splits the sequence over TP ranks: widths must be a multiple of TP
        multiple = self.cfg.parallel.tensor_model_parallel_size if self.cfg.parallel.sequence_parallel else 1
        mbs = [collate([trajs[i] for i in rows], self.pad_id,
                       length=-(-(width or max(lengths[i] for i in rows)) // multiple) * multiple)
               for rows in parts]
        return [mb.to(self.device) if self.device is not None else mb for mb in mbs]

    def _token_logprobs(self, chunk, hidden: torch.Tensor, targets: torch.Tensor, loss_mask: torch.Tensor,
                        return_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """([B, L] log-probs of targets, [B, L] entropies or None) from final hidden states [B, L, H] via the
        fused vocab-parallel op; 0 where loss_mask [B, L] is 0 (prompt and padding positions skip the LM-head
        GEMMs). The entropy comes from the same blocks of logits (no extra GEMM) and takes no gradient.

        The op owns the LM-head matmul, so it also all-reduces the hidden gradient over TP ranks (under
        sequence parallelism the model has already gathered the sequence: builders.output_hidden_states)."""
        from megatron_spo.models.builders import lm_head_vocab_start, lm_head_weight
        from megatron_spo.ops import token_logprobs

        tp_group = self.ps.get_tensor_model_parallel_group() if self.cfg.parallel.tensor_model_parallel_size > 1 else None
        b, s, h = hidden.shape
        targets = targets.masked_fill(loss_mask == 0, IGNORE_INDEX)
        out = token_logprobs(hidden.reshape(b * s, h), lm_head_weight(chunk), targets.reshape(-1),
                             tp_group=tp_group, ignore_index=IGNORE_INDEX, vocab_start_index=lm_head_vocab_start(chunk),
                             valid_vocab_size=self.model_cfg.vocab_size, return_entropy=return_entropy,
                             **self.cfg.logprobs.op_kwargs())
        logp, entropy = out if return_entropy else (out, None)
        return logp.view(b, s), None if entropy is None else entropy.detach().view(b, s)

    def _run(self, chunks, mbs: list[TrainBatch], *, forward_only: bool, output: str,
             loss_fn: Callable | None) -> list:
        """One pass of megatron's schedule over the micro-batches. output: 'logp' | 'values'.

        Returns, on the last pipeline stage, what loss_fn reported per micro-batch (else [])."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        from megatron_spo.models.builders import output_hidden_states

        fb = get_forward_backward_func()
        seq_len = max(mb.input_ids.shape[1] for mb in mbs)
        mbs_size = max(mb.num_sequences for mb in mbs)
        virtual = bool(self.cfg.parallel.virtual_pipeline_model_parallel_size)
        # the policy's entropy, logged from its training pass (its gradient is never asked for: no extra work)
        want_entropy = output == "logp" and not forward_only and self.cfg.logging.policy_entropy

        def forward_step(data_iterator, model):
            index, mb = next(data_iterator)
            input_ids, position_ids = mb.input_ids, mb.position_ids
            if virtual:  # every micro-batch has the step's shape: pad rows (sliced off the output below)
                input_ids = _pad_rows(input_ids, mbs_size, self.pad_id)
                position_ids = _pad_rows(position_ids, mbs_size, 0)
            if output == "logp":
                with output_hidden_states(model):
                    out = model(input_ids, position_ids, None)
            else:
                out = model(input_ids, position_ids, None)
            if not _is_last(model):
                return out, None
            out, entropy = out[:mb.num_sequences], None
            if output == "logp":
                out, entropy = self._token_logprobs(model, out, mb.targets, mb.loss_mask, want_entropy)
            return out, partial(_loss_wrapper, loss_fn, index, mb, entropy=entropy)

        n_global = self.cfg.batch.sequences_per_step

        def _loss_wrapper(fn, index, mb, out, entropy=None):
            if fn is None:
                return out.new_zeros(()), {"index": index, "out": out.detach()}
            loss, metrics = fn(index, mb, out)
            if entropy is not None:
                metrics = {**metrics, "entropy": losses.mean_sequence_entropy(entropy, mb.loss_mask)}
            scale = losses.microbatch_scale(mb.num_sequences, len(mbs), self.dp_size, n_global)
            return loss * scale, {"index": index, "metrics": metrics, "n": mb.num_sequences}

        data = iter(list(enumerate(mbs)))
        if virtual:  # interleaved schedule: every virtual stage reads the micro-batches on its own
            data = [iter(list(enumerate(mbs))) for _ in chunks]
            group = _microbatch_group_size(len(mbs), self.cfg.parallel.pipeline_model_parallel_size)
            for chunk in chunks:
                chunk.config.microbatch_group_size_per_vp_stage = group
        ctx = torch.no_grad() if forward_only else contextlib.nullcontext()
        with ctx:
            store = fb(forward_step_func=forward_step, data_iterator=data, model=chunks,
                       num_microbatches=len(mbs), seq_length=seq_len, micro_batch_size=mbs_size,
                       forward_only=forward_only)
        return store if self.is_last_stage else []

    def _collect(self, store: list, n: int) -> list:
        """Per-micro-batch outputs of a forward-only pass, indexed by micro-batch (last pipeline stage;
        other stages get Nones, which is all they need: the loss runs on the last stage only)."""
        out = [None] * n
        for item in store:
            out[item["index"]] = item["out"]
        return out

    def train_step(self) -> dict[str, float]:
        cfg = self.cfg
        self.step += 1
        t_step = time.perf_counter()
        trajs, t_wait = self._global_batch()
        mbs = self._micro_batches(self._shard(trajs))

        t_fb = time.perf_counter()
        ref = self._collect(self._run(self.reference, mbs, forward_only=True, output="logp", loss_fn=None), len(mbs))
        lr = self.lr_at(self.step, cfg.optimizer.lr)
        metrics_store, value_grad_norm = [], None
        if cfg.algo == "ppo":
            old_values = self._collect(self._run(self.value, mbs, forward_only=True, output="values", loss_fn=None),
                                       len(mbs))
            adv_ret = [None] * len(mbs)
            if self.is_last_stage:
                adv_ret = [losses.ppo_advantages(mb, ref[i], old_values[i], beta=cfg.beta, gamma=cfg.ppo.gamma,
                                                 lam=cfg.ppo.lam, whiten=cfg.ppo.whiten_advantages)
                           for i, mb in enumerate(mbs)]
            store, grad_norm = self._optimize(self.policy, self.optimizer, mbs, lr, "logp",
                                              lambda i, mb, logp: losses.ppo_batch_loss(
                                                  mb, logp, adv_ret[i][0], clip_eps=cfg.ppo.clip_eps))
            metrics_store += store
            vlr = self.lr_at(self.step, cfg.optimizer.value_lr or cfg.optimizer.lr)
            store, value_grad_norm = self._optimize(self.value, self.value_optimizer, mbs, vlr, "values",
                                            lambda i, mb, v: losses.value_batch_loss(
                                                mb, v, old_values[i], adv_ret[i][1],
                                                clip_eps=cfg.ppo.value_clip_eps))
            metrics_store += store
        elif cfg.algo == "agro":
            store, grad_norm = self._optimize(self.policy, self.optimizer, mbs, lr, "logp",
                                              lambda i, mb, logp: losses.agro_batch_loss(
                                                mb, logp, ref[i], beta=cfg.beta, on_policy=cfg.agro.on_policy))
            metrics_store += store
        else:
            objectives = {name: (s.objective, s.loss) for name, s in cfg.sources.items()}
            store, grad_norm = self._optimize(self.policy, self.optimizer, mbs, lr, "logp",
                                              lambda i, mb, logp: losses.spo_batch_loss(
                                                mb, logp, ref[i], beta=cfg.beta, objectives=objectives))
            metrics_store += store
        t_fb = time.perf_counter() - t_fb

        t_sync = 0.0
        if self.step % cfg.model_update_interval == 0:
            t_sync = self.sync_weights()

        metrics = self._reduce_metrics(metrics_store)
        if self.rank == 0 and self.online is not None and hasattr(self.online, "stats"):
            metrics.update(self.online.stats())
            metrics.update(self._sync_metrics)
            self._sync_metrics = {}
        n_tokens = sum(len(t.response_tokens) for t in trajs)
        metrics.update({
            "lr": lr, "grad_norm": grad_norm, "reward": sum(t.reward for t in trajs) / len(trajs),
            "time/rollout_wait": t_wait, "time/forward_backward": t_fb, "time/weight_sync": t_sync,
            "time/step": time.perf_counter() - t_step, "policy_version": float(self.policy_version),
        })
        online = [t for t in trajs if t.source == "online"]
        if online:  # policy versions behind the trainer (offline data has no meaningful version)
            versions = [t.policy_version for t in online]
            metrics["staleness"] = self.policy_version - sum(versions) / len(versions)
            metrics["staleness/max"] = float(self.policy_version - min(versions))
            metrics["reward/online"] = sum(t.reward for t in online) / len(online)
        if value_grad_norm is not None:
            metrics["grad_norm/value"] = value_grad_norm
        metrics["tokens_per_s"] = n_tokens / max(metrics["time/step"], 1e-9)
        if "mean_seq_log_ratio/online" in metrics:
            # the k1 estimate of KL(pi || pi_0) is this mean on samples from pi itself: online trajectories only
            # (offline data such as pi_0's own samples gives -KL(pi_0 || pi)); still biased when the engines
            # sample below T=1 (rollout.temperature_range) or from a stale policy
            metrics["kl"] = metrics["mean_seq_log_ratio/online"]
        self.metrics.log(self.step, metrics)
        limit = cfg.logging.max_log_ratio
        if limit is not None and abs(metrics.get("mean_seq_log_ratio", 0.0)) > limit:
            raise TrainingDiverged(f"step {self.step}: mean sequence log(pi/pi_0) = "
                                   f"{metrics['mean_seq_log_ratio']:.3g} exceeds logging.max_log_ratio {limit}: "
                                   "the policy is collapsing (lower the LR, raise beta, or sample at T=1)")
        return metrics

    def _optimize(self, chunks, optimizer, mbs, lr: float, output: str, loss_fn) -> tuple[list, float]:
        """One optimizer step over the micro-batches: (the loss function's reports, grad norm)."""
        for chunk in chunks:
            chunk.zero_grad_buffer()
        optimizer.zero_grad()
        store = self._run(chunks, mbs, forward_only=False, output=output, loss_fn=loss_fn)
        for group in optimizer.param_groups:
            group["lr"] = lr
        ok, grad_norm, _ = optimizer.step()
        if not ok:
            raise TrainingDiverged(f"step {self.step}: the optimizer skipped the update (non-finite gradients)")
        return store, float(grad_norm or 0.0)

    def _reduce_metrics(self, store: list) -> dict[str, float]:
        """The loss metrics of the global batch (losses.metric_sums over micro-batches and data-parallel ranks),
        delivered on rank 0."""
        local: dict[str, list[float]] = {}
        if self.is_last_stage and self.ps.get_tensor_model_parallel_rank() == 0:
            local = losses.metric_sums(store)
        gathered = [None] * self.world
        dist.all_gather_object(gathered, local)
        total: dict[str, list[float]] = {}
        for part in gathered:
            for k, (s, n) in part.items():
                t = total.setdefault(k, [0.0, 0.0])
                t[0] += s
                t[1] += n
        return {k: s / n for k, (s, n) in total.items() if n}

    # -- weights to the fleet ------------------------------------------------------------------
    def sync_weights(self, new_version: bool = True) -> float:
        """Collective: the policy's HF-named weights to the fleet as version policy_version + 1 (or as the
        current version, to bring a restarted fleet up to a resumed policy).

        A push that reached no engine is sent again at once (rollout.weight_sync_attempts in all): every engine
        is then paused and serves nothing, so waiting for the next scheduled push would starve the run. After
        the last attempt the run stops with the reason. Engines that missed a push the others took stay out of
        service until the next push reaches them (weight_sync.py)."""
        from megatron_spo.models.hf_map import iter_hf_tensors

        t0 = time.perf_counter()
        self.policy_version += int(new_version)
        online = self.rank == 0 and hasattr(self.online, "push_weights")
        attempts = self.cfg.rollout.weight_sync_attempts
        for attempt in range(1, attempts + 1):
            tensors = iter_hf_tensors(self.policy, self.model_cfg)
            if online:
                self._sync_metrics = self.online.push_weights(self.policy_version, tensors) or {}
            else:
                for _ in tensors:  # every rank takes part in the gather
                    pass
            missed = [online and self._sync_metrics.get("weight_sync/engines_updated", 1.0) == 0
                      and (getattr(self.online, "last_sync_error", None) or "no engine took it")]
            dist.broadcast_object_list(missed, src=0)
            if not missed[0]:
                break
            if attempt == attempts:
                raise RuntimeError(f"weight sync to version {self.policy_version} reached no engine in {attempts} "
                                   f"attempts (rollout.weight_sync_attempts): {missed[0]}")
            if self.rank == 0:
                print(f"[megatron-spo] weight sync attempt {attempt} reached no engine; sending it again",
                      flush=True)
        return time.perf_counter() - t0

    _sync_metrics: dict = {}

    def export_hf(self, out_dir: str | Path) -> Path:
        """Collective: write the policy as an HF directory of its family (safetensors shards, config.json and the
        tokenizer of init.hf), atomically: out_dir appears complete or not at all."""
        import shutil

        from megatron_spo.models.hf_checkpoint import HFWriter, copy_tokenizer_files, write_hf_config
        from megatron_spo.models.hf_map import iter_hf_tensors

        out = Path(out_dir)
        tmp = out.with_name(out.name + ".partial")
        tensors = iter_hf_tensors(self.policy, self.model_cfg)
        if self.rank != 0:
            for _ in tensors:  # every rank takes part in the gather
                pass
            dist.barrier()
            return out
        if tmp.exists():
            shutil.rmtree(tmp)
        with HFWriter(tmp) as writer:
            for name, tensor in tensors:
                writer.add(name, tensor)
        extra = {}
        if self.cfg.init.hf and (Path(self.cfg.init.hf) / "config.json").is_file():
            extra = json.loads((Path(self.cfg.init.hf) / "config.json").read_text())
            copy_tokenizer_files(self.cfg.init.hf, tmp)
        write_hf_config(tmp, self.model_cfg, extra)
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
        dist.barrier()
        return out

    # -- checkpoints ---------------------------------------------------------------------------
    def _sharded_state_dict(self, is_loading: bool = False) -> dict:
        """Model and optimizer state of policy (and value) as one sharded dict. For loading, the
        optimizer first creates its state tensors (is_loading) so the template has something to fill.

        Every virtual-stage chunk stores its tensors under the same key prefix ("policy.model0."): a
        chunk's layers are slices of one [num_layers, ...] tensor per key, which the chunks of all
        pipeline ranks cover together (megatron-LM shares one prefix across chunks the same way)."""
        sd = {}
        for name, chunks, opt in (("policy", self.policy, self.optimizer), ("value", self.value, self.value_optimizer)):
            if chunks is None:
                continue
            model_sd = {f"model{i}": c.module.sharded_state_dict(prefix=_ckpt_prefix(name))
                        for i, c in enumerate(chunks)}
            sd[f"{name}_model"] = model_sd
            sd[f"{name}_optimizer"] = opt.sharded_state_dict(model_sd, is_loading=is_loading)
        return sd

    def save_checkpoint(self) -> Path:
        from megatron_spo.models.megatron_checkpoint import save_sharded_state_dict

        def write(d: Path) -> None:
            (d / "dist").mkdir(exist_ok=True) if self.rank == 0 else None
            dist.barrier()
            # megatron's torch_dist format, written by this process (no forked writer next to the rollout
            # thread), every file fsync'd before the checkpoint is marked complete
            save_sharded_state_dict(self._sharded_state_dict(), d / "dist")
            torch.save(rng_state(), d / f"rng_rank{self.rank:05d}.pt")
            if self.rank == 0:
                state = {"step": self.step, "policy_version": self.policy_version,
                         "sampler": self.sampler.state_dict()}
                (d / "trainer_state.json").write_text(json.dumps(state))
                self._write_model_description(d)

        return self.ckpt.save(self.step, write, {"world_size": self.world, "algo": self.cfg.algo})

    def _write_model_description(self, d: Path) -> None:
        """What `megatron-spo convert megatron-to-hf` needs besides the weights: the model config, and the
        init model's config.json and tokenizer files (a checkpoint directory converts on its own)."""
        from megatron_spo.models.convert import SOURCE_HF_CONFIG
        from megatron_spo.models.hf_checkpoint import copy_tokenizer_files
        from megatron_spo.models.megatron_checkpoint import write_megatron_config

        write_megatron_config(d, self.model_cfg)
        init = self.cfg.init.hf or self.cfg.init.megatron
        for name in ("config.json", SOURCE_HF_CONFIG) if init else ():  # an HF dir, or a converted one
            if (Path(init) / name).is_file():
                (d / SOURCE_HF_CONFIG).write_text((Path(init) / name).read_text())
                copy_tokenizer_files(init, d)
                break

    def _resume(self) -> None:
        from megatron.core import dist_checkpointing

        found = self.ckpt.latest() if self.rank == 0 else None
        payload = [None if found is None else (found[0], str(found[1]))]
        dist.broadcast_object_list(payload, src=0)
        if payload[0] is None:
            return
        step, path = payload[0]
        path = Path(path)
        sharded = self._sharded_state_dict(is_loading=True)
        state = dist_checkpointing.load(sharded, str(path / "dist"))
        for name, chunks, opt in (("policy", self.policy, self.optimizer), ("value", self.value, self.value_optimizer)):
            if chunks is None:
                continue
            for i, c in enumerate(chunks):
                c.module.load_state_dict(_strip_prefix(state[f"{name}_model"][f"model{i}"], _ckpt_prefix(name)))
            opt.load_state_dict(state[f"{name}_optimizer"])
        rng_file = path / f"rng_rank{self.rank:05d}.pt"
        if rng_file.exists():
            set_rng_state(torch.load(rng_file, weights_only=False))
        trainer_state = json.loads((path / "trainer_state.json").read_text())
        self.step = trainer_state["step"]
        self.policy_version = trainer_state["policy_version"]
        if self.rank == 0:
            self.sampler.load_state_dict(trainer_state["sampler"])
        if self.rank == 0:
            print(f"[megatron-spo] resumed from {path} at step {self.step}", flush=True)

    # -- the loop ------------------------------------------------------------------------------
    def train(self) -> int:
        """Run to cfg.steps (or until preempted). Returns the last completed step."""
        cfg = self.cfg
        progress = _progress(self.rank == 0 and cfg.logging.progress, cfg.steps, self.step)
        online = self.rank == 0 and hasattr(self.online, "push_weights")
        flags = [online]
        dist.broadcast_object_list(flags, src=0)
        if flags[0] and self.policy_version > 0:  # resumed: the fleet may still hold older weights
            self.sync_weights(new_version=False)
        try:
            while self.step < cfg.steps:
                metrics = self.train_step()
                progress(self.step, metrics)
                preempted = self.preemption.requested()
                if preempted or self.step % cfg.checkpoint.interval == 0 or self.step == cfg.steps:
                    self.save_checkpoint()
                if preempted:
                    if self.rank == 0:
                        print(f"[megatron-spo] preempted: checkpoint at step {self.step} saved, exiting", flush=True)
                    break
            if self.step >= cfg.steps and flags[0] and self.step % cfg.model_update_interval:
                self.sync_weights()  # the fleet ends with the final policy (for evaluation through it)
            if self.step >= cfg.steps and cfg.checkpoint.export_hf:
                path = self.export_hf(self.run_dir / "hf")
                if self.rank == 0:
                    print(f"[megatron-spo] final policy written to {path}", flush=True)
        finally:
            progress(None, None)
            self.metrics.close()
        return self.step

    def close(self, keep_process_group: bool = False) -> None:
        """Release signal handlers and megatron's groups (and the default group unless kept, e.g. to
        train another model in the same processes)."""
        from megatron.core import parallel_state

        from megatron_spo.models.parallel import destroy_parallel

        self.preemption.restore()
        if self.online is not None and hasattr(self.online, "close"):
            self.online.close()
        if keep_process_group:
            parallel_state.destroy_model_parallel()
        else:
            destroy_parallel()


def _is_last(model) -> bool:
    while hasattr(model, "module"):
        model = model.module
    return bool(model.post_process)


def _pad_rows(t: torch.Tensor, rows: int, value: int) -> torch.Tensor:
    """[b, L] -> [rows, L], the new rows filled with value."""
    if t.shape[0] == rows:
        return t
    return torch.cat([t, t.new_full((rows - t.shape[0], t.shape[1]), value)])


def _split_to_count(parts: list[list[int]], n: int, groups: list | None) -> list[list[int]]:
    """Halve the largest micro-batches (at prompt-group boundaries when groups is given) until there are
    n, keeping the order; fewer come back when no micro-batch holds two units any more."""
    parts = [list(p) for p in parts]

    def units(part):
        out: list[list[int]] = []
        for i in part:
            if groups is not None and out and groups[out[-1][-1]] == groups[i]:
                out[-1].append(i)
            else:
                out.append([i])
        return out

    while len(parts) < n:
        splittable = [(len(p), -i) for i, p in enumerate(parts) if len(units(p)) > 1]
        if not splittable:
            break
        i = -max(splittable)[1]
        u = units(parts[i])
        half = len(u) // 2
        parts[i:i + 1] = [[j for x in u[:half] for j in x], [j for x in u[half:] for j in x]]
    return parts


def _microbatch_group_size(num_microbatches: int, pp: int) -> int:
    """Contiguous micro-batches per virtual stage in megatron's interleaved schedule: the smallest N >= PP
    with M % N == 0 or M % N >= PP, which megatron accepts (its default N = PP needs M % PP == 0, and the
    token-budget packing gives any M). Needs M >= PP."""
    for n in range(pp, num_microbatches + 1):
        if num_microbatches % n == 0 or num_microbatches % n >= pp:
            return n
    raise ValueError(f"interleaved pipeline: {num_microbatches} micro-batches, fewer than PP={pp}")


def _ckpt_prefix(name: str) -> str:
    """Checkpoint key prefix of model `name` ("policy", "value"), shared by its virtual-stage chunks."""
    return f"{name}.model0."


def _strip_prefix(sd: dict, prefix: str) -> dict:
    return {(k[len(prefix):] if k.startswith(prefix) else k): v for k, v in sd.items()}


def _model_config_from_init(init):
    if init.megatron:
        from megatron_spo.models.megatron_checkpoint import read_megatron_config

        return read_megatron_config(init.megatron)
    from megatron_spo.models.hf_checkpoint import read_hf_config

    return read_hf_config(init.hf)


def _progress(enabled: bool, total: int, start: int):
    """A rich progress bar (rank 0): returns update(step, metrics); update(None, None) closes it."""
    if not enabled:
        return lambda step, metrics: None
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    bar = Progress(TextColumn("[bold]train"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                   TimeElapsedColumn(), TimeRemainingColumn(), TextColumn("{task.fields[info]}"),
                   transient=False, disable=not sys.stdout.isatty() and not os.environ.get("MEGATRON_SPO_PROGRESS"))
    task = bar.add_task("train", total=total, completed=start, info="")
    bar.start()

    def update(step, metrics):
        if step is None:
            bar.stop()
            return
        info = f"loss {metrics.get('loss', math.nan):.4f} reward {metrics.get('reward', math.nan):+.3f}"
        if "kl" in metrics:  # SPO / AGRO: mean sequence log(pi / pi_0) on online samples
            info += f" kl {metrics['kl']:.3f}"
        elif "mean_seq_log_ratio" in metrics:  # offline data only: not a KL estimate
            info += f" log_ratio {metrics['mean_seq_log_ratio']:.3f}"
        if "approx_kl_old_new" in metrics:  # PPO: against the policy that sampled
            info += f" kl(old) {metrics['approx_kl_old_new']:.4f} clip {metrics.get('clip_fraction', 0.0):.2f}"
        if "entropy" in metrics:  # nats per response token
            info += f" entropy {metrics['entropy']:.3f}"
        bar.update(task, completed=step, info=info)
        if not bar.live.is_started or bar.disable:
            print(f"step {step}/{total} {info}", flush=True)

    return update


# ---------------------------------------------------------------------------------------------
# Entry points
# ---------------------------------------------------------------------------------------------
def run(cfg_data: dict) -> int:
    """Train in this process (one rank of a torchrun / srun / spawn launch)."""
    cfg = TrainConfig.model_validate(cfg_data)
    trainer = Trainer(cfg)
    try:
        return trainer.train()
    finally:
        trainer.close()


def _preflight_cpu(cfg: TrainConfig, nproc: int) -> None:
    """CPU training holds every rank's share of the policy (weights, fp32 grads, Adam's fp32 master and two
    moments), the frozen reference and, for PPO, the value model on this one machine: refuse up front when
    that cannot fit. (GPU memory is planned by `megatron-spo plan`.)"""
    import torch

    from megatron_spo.memory import BASELINE_BYTES, DTYPE_BYTES, preflight

    if torch.cuda.is_available():
        return
    model = cfg.model or _model_config_from_init(cfg.init)
    item = DTYPE_BYTES[model.params_dtype]
    trained = item + 4 + (0 if item == 4 else 4) + 8  # weights, main grads, fp32 master (16-bit only), Adam m, v
    per_model = model.num_parameters()
    need = per_model * (trained + item) + (per_model * trained if cfg.algo == "ppo" else 0)
    stages = cfg.parallel.tensor_model_parallel_size * cfg.parallel.pipeline_model_parallel_size
    replicas = max(1, nproc // stages)  # data-parallel copies on this machine
    preflight(f"CPU training of a {per_model / 1e9:.2f}B-parameter {model.architecture} on {nproc} process(es)",
              need * replicas + BASELINE_BYTES * nproc,
              hint="train on GPUs (`megatron-spo plan` sizes the layout) or use a smaller model")


def launch(cfg: TrainConfig) -> None:
    """Under torchrun / srun (WORLD_SIZE set) train as this rank; otherwise spawn cfg.nproc ranks here.

    The spawning parent forwards SIGTERM / SIGUSR1 / SIGINT to its ranks (which checkpoint and exit),
    so a scheduler signalling only the launcher still gets a checkpoint and leaves no orphan."""
    if os.environ.get("WORLD_SIZE") or cfg.nproc == 1:
        if not os.environ.get("WORLD_SIZE"):
            _preflight_cpu(cfg, 1)
        run(cfg.model_dump(mode="json"))
        return
    _preflight_cpu(cfg, cfg.nproc)
    import signal

    import torch.multiprocessing as mp

    from megatron_spo.models.parallel import _spawn_entry, free_port

    ctx = mp.start_processes(_spawn_entry, args=(cfg.nproc, free_port(), run, (cfg.model_dump(mode="json"),)),
                             nprocs=cfg.nproc, join=False, start_method="spawn")

    def forward(signum, frame):
        for p in ctx.processes:
            if p.is_alive():
                os.kill(p.pid, signal.SIGINT if signum == signal.SIGINT else signum)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)}
    try:
        while not ctx.join(timeout=1.0):
            pass
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        for p in ctx.processes:
            if p.is_alive():
                p.terminate()


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="megatron-spo train", description=__doc__.split("\n\n")[0])
    parser.add_argument("config", help="YAML config (see examples/)")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. optimizer.lr=1e-6 algo=ppo")
    args = parser.parse_args(argv)
    cfg = load_config(TrainConfig, args.config, args.overrides)
    from megatron_spo.memory import MemoryPreflightError

    try:
        launch(cfg)
    except MemoryPreflightError as err:
        print(f"megatron-spo train: error: {err}", file=sys.stderr)
        return 2
    return 0
