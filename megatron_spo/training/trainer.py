"""The trainer: one loop for every registered algorithm, on megatron-core, from one CPU process to 128 GPUs.

    megatron-spo train CONFIG.yaml [key.path=value ...]

Each step:
  1. rank 0 draws the global batch from the configured sources (online rollout buffer, offline stores,
     MC-annotated sets) by their weights and broadcasts it; each data-parallel rank takes whole prompt
     groups; micro-batches are cut by a token budget and packed (whole sequences back to back, no padding);
  2. reference forward (no grad) -> ref log-probs; for PPO also the value model's old values;
  3. policy forward + backward through megatron's pipeline schedule; token log-probs come from the
     fused op on the final hidden states (no [tokens x vocab] tensor is kept), the loss per source;
  4. optimizer step (megatron optimizer: grad clipping, optional distributed optimizer), warm-up LR;
  5. every model_update_interval steps the policy weights go to the rollout fleet;
  6. metrics (metrics.jsonl, wandb), checkpoints every k steps and on SIGTERM / SIGUSR1.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_spo.collectives import all_reduce_
from megatron_spo.config import ConfigError
from megatron_spo.data.batching import (
    TrainBatch,
)
from megatron_spo.data.routes import RoutesError
from megatron_spo.data.trajectory import model_tokens
from megatron_spo.memory import reset_peak_rss
from megatron_spo.models.routing_replay import replayed
from megatron_spo.run_layout import CheckpointDir, PreemptionHandler, Stopped
from megatron_spo.training import checkpoint
from megatron_spo.training import loss as losses
from megatron_spo.training.algos import StepInputs
from megatron_spo.training.config import LogprobsConfig, TrainConfig
from megatron_spo.training.held_out_eval import HeldOutEval
from megatron_spo.training.logprob_gap import GapPass, GapTally, gap_metrics, gap_warning, measured_rows
from megatron_spo.training.logprob_gap import tally as gap_tally
from megatron_spo.training.metrics import MetricsLogger, progress_line
from megatron_spo.training.micro_batches import (
    idle_micro_batch,
    micro_batches,
    microbatch_group_size,
    pad_rows,
    shard,
    shard_indices,
)
from megatron_spo.training.online import FleetUnavailable, q0_from_own_groups
from megatron_spo.training.run_log import LIBRARY_WARNINGS, start_banner
from megatron_spo.training.sources import build_archive, build_sampler
from megatron_spo.training.stability import DivergenceGuard, TrainingDiverged, lr_at
from megatron_spo.training.step_metrics import StepTimes, step_metrics

LIBRARY_WARNINGS.install()  # megatron-core's import-time warnings: kept for RUN_DIR/warnings.log, not printed
WAIT_ENDED = (Stopped, FleetUnavailable)  # a wait of rank 0 that ends the run: all ranks raise it together
IGNORE_INDEX = -100  # targets the fused log-prob op skips: prompt and padding positions (outside loss_mask)


def check_before_start(cfg: TrainConfig, model_cfg, world_size: int) -> None:
    """Every check of a training config that needs the model's config but no process group or model: the log-prob op
    on this machine, the algorithm (a hook loads here), the layout against the model and the world size, what
    training adds to it (MoE, EP), FP8, routing replay's layout. ConfigError naming the field (one line). Run by
    `megatron-spo train` before any rank is spawned, and by each rank's Trainer."""
    from megatron_spo.models.parallel import check_layout

    check_logprobs(cfg.logprobs)
    make_algorithm(cfg)
    check_layout(cfg.parallel, model_cfg, world_size)
    cfg.parallel.check_training(model_cfg)
    if cfg.routing_replay == "engine" and model_cfg.moe is not None:
        from megatron_spo.models.routing_replay import check_replay_layout

        check_replay_layout(cfg.parallel)


def make_algorithm(cfg: TrainConfig):
    """The configured algorithm object: a registered one, or a hook 'package.module:Class' loaded now (its
    config check runs here; for a registered one it repeats the check the config ran, which changes nothing)."""
    from megatron_spo.training.algos import algorithm_class

    try:
        cls = algorithm_class(cfg.algo)
        cls.check_config(cfg)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    return cls(cfg)


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
        from megatron_spo.models.parallel import enable_deterministic, init_parallel

        self.cfg = cfg
        reset_peak_rss()  # memory/peak_rss_gb: this trainer's peak, not the launching process's earlier stages
        # megatron-core's import-time and model-build warnings go to RUN_DIR/warnings.log, summarised in one line
        self.library_warnings = LIBRARY_WARNINGS.attach(cfg.run_dir, enabled=os.environ.get("RANK", "0") == "0")
        check_logprobs(cfg.logprobs)  # what needs no model first
        self.algorithm = make_algorithm(cfg)
        self.model_cfg = cfg.model or _model_config_from_init(cfg.init)
        check_before_start(cfg, self.model_cfg, int(os.environ.get("WORLD_SIZE") or 1))
        # first of all: a SLURM warning signal during the (long) model build must not kill the rank
        self.preemption = PreemptionHandler()
        # routing replay: the policy's MoE routers take the engines' routes (models/routing_replay.py)
        self.replay_routes = cfg.routing_replay == "engine" and self.model_cfg.moe is not None
        self._deterministic_before = enable_deterministic() if cfg.deterministic else None
        init_parallel(cfg.parallel, self.model_cfg, seed=cfg.seed)
        self.ps = parallel_state
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()
        self.dp_rank = parallel_state.get_data_parallel_rank()
        self.dp_size = parallel_state.get_data_parallel_world_size()
        self.is_last_stage = parallel_state.is_pipeline_last_stage(ignore_virtual=True)
        self.device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None

        self.policy = self._schedule_ready(builders.build_policy(self.model_cfg, cfg.parallel, lora=cfg.lora,
                                                                 lora_seed=cfg.seed))
        # with LoRA pi_0 is the policy with its adapters off (forward): no second model
        self.reference = None if cfg.lora else self._schedule_ready(builders.build_reference(self.model_cfg,
                                                                                             cfg.parallel))
        self._load_initial_weights()
        self._route_layers, self._route_plan = self._routes_plan()
        self.policy, self.optimizer = self._wrap_and_optimizer(self.policy, cfg.optimizer.lr)
        self.value = self.value_optimizer = None
        if self.algorithm.uses_value_model:
            value = self._schedule_ready(builders.build_value_model(self.model_cfg, cfg.parallel))
            self._load_initial_weights(value, keep_own=("value_head.",))  # the trunk from the init model
            self.value, self.value_optimizer = self._wrap_and_optimizer(value, cfg.optimizer.value_lr or cfg.optimizer.lr)

        self.run_dir = Path(cfg.run_dir)
        self.ckpt = CheckpointDir(cfg.checkpoint.dir or self.run_dir / "checkpoints", cfg.checkpoint.keep_last)
        self.step = 0
        self.policy_version = 0
        self.reference_step = 0  # the step whose policy the reference is (0: the init weights)
        self._gap_pass: GapPass | None = None  # the log-prob gap of this step's first policy pass
        self._holds_pushed_weights = True  # the policy is still the version last pushed (no update since)
        self.sampler = None
        self.online = None
        self.archive = None
        self.held_out: HeldOutEval | None = None  # rank 0, when eval.interval is set
        if self.rank == 0:
            self.sampler, self.online = build_sampler(cfg, online_source)
            self.archive = build_archive(cfg)
            self.held_out = HeldOutEval.from_config(cfg)
        self.pad_id = 0
        self._resume()
        log_cfg = cfg.logging
        self.divergence_guard = DivergenceGuard(log_cfg.max_log_ratio, log_cfg.max_residual, log_cfg.residual_patience,
                                                log_cfg.max_residual_rms)
        self.metrics = MetricsLogger(self.run_dir, enabled=self.rank == 0,
                                     wandb_project=log_cfg.wandb_project if log_cfg.wandb_mode != "disabled" else None,
                                     wandb_mode=log_cfg.wandb_mode, run_name=log_cfg.wandb_name,
                                     wandb_entity=log_cfg.wandb_entity, wandb_group=log_cfg.wandb_group,
                                     wandb_tags=log_cfg.wandb_tags, config=cfg.model_dump(mode="json"),
                                     resume_from_step=self.step)
        if self.rank == 0:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            checkpoint.record_config(self)  # config.yaml stays the first; config-history/ gets this start's
            print(start_banner(cfg, self.model_cfg, self.world, self.step), flush=True)
            if cfg.lora is not None:
                from megatron_spo.models.lora import count_parameters

                n = count_parameters(self.policy)
                print(f"[megatron-spo] lora: {n['trainable']:,} trainable parameters of {n['trainable'] + n['frozen']:,} "
                      "on rank 0; pi_0 is the policy with its adapters off (no reference model)", flush=True)
            self._print_library_warnings()

    # -- setup ---------------------------------------------------------------------------------
    def _routes_plan(self) -> tuple[list[int] | None, list | None]:
        """Routing replay: the global MoE layer indices this rank's chunks hold (the columns of the routes it is
        sent), and every rank's (data-parallel rank, those layers), which rank 0 deals routes by (_deal_routes)."""
        if not self.replay_routes:
            return None, None
        from megatron_spo.models.routing_replay import moe_routers

        layers = sorted(layer for layer, _ in moe_routers(self.policy))
        plan = [None] * self.world
        dist.all_gather_object(plan, (self.dp_rank, layers))
        return layers, plan

    def _load_initial_weights(self, chunks=None, keep_own: tuple[str, ...] = ()) -> None:
        """Policy and reference (or the given chunks) from init.megatron, else from the HF weights.
        keep_own: key prefixes the init checkpoint lacks, left as the model initialised them."""
        from megatron_spo.models import hf_checkpoint, hf_map

        targets = [chunks] if chunks is not None else [m for m in (self.policy, self.reference) if m is not None]
        if self.cfg.init.megatron:
            from megatron_spo.models.lora import ADAPTER_PARAMS
            from megatron_spo.models.megatron_checkpoint import load_megatron

            for target in targets:
                load_megatron(target, self.cfg.init.megatron, keep_own=keep_own,
                              keep_own_names=ADAPTER_PARAMS if self.cfg.lora else ())
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
        mixes them up the same way: wrong gradients on gloo, docs/engineering-notes.md)."""
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
        """Linear warm-up, then optimizer.decay (constant by default: the paper's schedule). step is 1-based."""
        o = self.cfg.optimizer
        return lr_at(step, base, warmup_steps=o.warmup_steps, total_steps=self.cfg.steps, decay=o.decay,
                     min_lr_fraction=o.min_lr_fraction)

    def _global_batch(self) -> tuple[list, float]:
        t0 = time.perf_counter()
        payload = [None]
        if self.rank == 0:
            try:
                payload = [self.sampler.next(self.cfg.batch.sequences_per_step, self.step)]
            except WAIT_ENDED as err:  # SIGTERM, or no engine ever answered: every rank learns it below
                payload = [err]
            else:
                if self.archive is not None:
                    self.archive.add(t for t in payload[0] if t.source == "online")
                try:
                    check_routes(payload[0], self.model_cfg)
                except RoutesError as err:  # every rank raises it below
                    payload = [err]
                else:  # routes travel on their own, each rank's share only (_deal_routes)
                    payload[0], routes = _without_routes(payload[0])
        dist.broadcast_object_list(payload, src=0)
        if isinstance(payload[0], (*WAIT_ENDED, RoutesError)):
            self.step -= 1  # this step never ran: its batch did not come
            raise payload[0]
        return self._deal_routes(payload[0], routes if self.rank == 0 else None), time.perf_counter() - t0

    def _deal_routes(self, trajs: list, routes: list | None) -> list:
        """The step's trajectories with the engine's routes of the rows this rank trains (its data-parallel shard,
        training/micro_batches.shard_indices) and of the MoE layers its model chunks hold (its pipeline stage),
        each in the smallest integer type (data/routes.py): rank 0 sends every other rank its share. Nothing when
        the step has no routes or the policy does not replay them (routing_replay off, a dense model)."""
        has = [self.replay_routes and routes is not None and any(r is not None for r in routes)]
        dist.broadcast_object_list(has, src=0)
        if not has[0]:
            return trajs

        def share(dp_rank: int, layers: list[int]) -> dict:
            return {i: routes[i].select_layers(layers) for i in shard_indices(trajs, dp_rank, self.dp_size)
                    if routes[i] is not None}

        if self.rank == 0:
            for rank in range(1, self.world):
                dist.send_object_list([share(*self._route_plan[rank])], dst=rank)
            mine = share(*self._route_plan[0])
        else:
            box = [None]
            dist.recv_object_list(box, src=0)
            mine = box[0]
        return [dataclasses.replace(t, routed_experts=mine[i]) if i in mine else t for i, t in enumerate(trajs)]

    def _token_logprobs(self, chunk, hidden: torch.Tensor, targets: torch.Tensor, loss_mask: torch.Tensor,
                        layout, return_entropy: bool = False, temperature: torch.Tensor | None = None
                        ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """([B, L] log-probs of targets, [B, L] entropies or None) from final hidden states [N, H] of the layout's
        tokens (models/packing.py: Packed, or Padded with N = B * L) via the fused vocab-parallel op; 0 where
        loss_mask [B, L] is 0 (prompt and padding positions skip the LM-head GEMMs). The entropy comes from the
        same blocks of logits (no extra GEMM) and takes no gradient. temperature [B]: log softmax(logits / T_b) of
        each row (logits are linear in the hidden state: the hidden states are divided, with their gradient).

        The op owns the LM-head matmul, so it also all-reduces the hidden gradient over TP ranks (under
        sequence parallelism the model has already gathered the sequence: builders.output_hidden_states)."""
        from megatron_spo.models.builders import lm_head_vocab_start, lm_head_weight
        from megatron_spo.ops import token_logprobs

        tp_group = self.ps.get_tensor_model_parallel_group() if self.cfg.parallel.tensor_model_parallel_size > 1 else None
        if temperature is not None and bool((temperature != 1.0).any()):
            per_token = layout.gather(temperature.to(hidden)[:, None].expand(targets.shape).contiguous(), fill=1.0)
            hidden = hidden / per_token[:, None]
        targets = layout.gather(targets.masked_fill(loss_mask == 0, IGNORE_INDEX), fill=IGNORE_INDEX)
        out = token_logprobs(hidden, lm_head_weight(chunk), targets,
                             tp_group=tp_group, ignore_index=IGNORE_INDEX, vocab_start_index=lm_head_vocab_start(chunk),
                             valid_vocab_size=self.model_cfg.vocab_size, return_entropy=return_entropy,
                             **self.cfg.logprobs.op_kwargs())
        logp, entropy = out if return_entropy else (out, None)
        return layout.unpack(logp), None if entropy is None else layout.unpack(entropy.detach())

    def _layouts(self, mbs: list[TrainBatch]) -> list:
        """Each micro-batch's token layout: Packed (batch.pack_sequences; with virtual stages every stream padded
        to the step's longest; rounded up to TP under sequence parallelism, to 16 under FP8) or Padded; under
        context parallelism this CP rank's share of it (models/context_parallel.py: every sequence a multiple of
        2 CP tokens, padded rows by micro_batches, packed ones here)."""
        from megatron_spo.models.context_parallel import ContextShard
        from megatron_spo.models.packing import Packed, Padded

        par = self.cfg.parallel
        cp = par.context_parallel_size
        if not self.cfg.batch.pack_sequences:
            whole = [Padded(tuple(mb.input_ids.shape)) for mb in mbs]
        else:
            multiple = par.sequence_multiple()  # each CP rank's share splits over TP under sequence parallelism
            if self.model_cfg.fp8:  # Transformer Engine's FP8 GEMMs take token counts in multiples of 16
                multiple = math.lcm(multiple, 16 * cp)
            seq_multiple = 2 * cp if cp > 1 else 1
            width = None
            if par.virtual_pipeline_model_parallel_size:
                width = max(int((-(-mb.lengths // seq_multiple) * seq_multiple).sum()) for mb in mbs)
            whole = [Packed.of(mb.input_ids, mb.lengths, multiple=multiple, width=width, seq_multiple=seq_multiple)
                     for mb in mbs]
        if cp == 1:
            return whole
        rank = self.ps.get_context_parallel_rank()
        return [ContextShard.of(w, cp, rank) for w in whole]

    def _pad_share(self, mbs: list[TrainBatch]) -> float:
        """Share of the tokens this rank's model passes compute that are padding (the rows added for one shape per
        step with virtual stages not counted), expert parallelism's idle micro-batches included (_lockstep)."""
        real = sum(int(mb.lengths.sum()) for mb in mbs)
        mbs = mbs + [self._idle_mb] * self._idle
        computed = sum(getattr(lay, "whole", lay).num_tokens for lay in self._layouts(mbs)) \
            if self.cfg.batch.pack_sequences else sum(mb.input_ids.numel() for mb in mbs)
        return 1.0 - real / computed

    def _run(self, chunks, mbs: list[TrainBatch], *, forward_only: bool, output: str,
             loss_fn: Callable | None, measure_gap: bool = True) -> list:
        """One pass of megatron's schedule over the micro-batches. output: 'logp' | 'values'. measure_gap False: not
        the policy's own log-probs (its adapters are off), so not the pass that measures the engines' gap.

        Returns, on the last pipeline stage, what loss_fn reported per micro-batch (else [])."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        from megatron_spo.models.builders import output_hidden_states

        fb = get_forward_backward_func()
        gap = None  # the first policy log-prob pass of a step measures the engines' log-prob gap
        if output == "logp" and chunks is self.policy and measure_gap and self._gap_pass is not None:
            gap, self._gap_pass = self._gap_pass, None
        # log-prob passes replay the engines' routes, pi_0's too (TrainConfig.routing_replay); the value model routes itself
        replay = self.replay_routes and output == "logp"
        # full activation recompute re-runs the routers in the backward: a micro-batch's routes stay set until the next
        keep_routes = replay and self.cfg.parallel.recompute_granularity == "full"
        real = len(mbs)
        mbs = mbs + [self._idle_mb] * self._idle  # in step with the expert group (_lockstep): trains nothing
        layouts = self._layouts(mbs)
        packed = self.cfg.batch.pack_sequences
        cp = self.cfg.parallel.context_parallel_size > 1
        # the whole sequence's length (megatron-core's schedule divides it by CP and, under SP, by TP)
        seq_len = max(getattr(lay, "whole", lay).num_tokens for lay in layouts) if packed else max(
            mb.input_ids.shape[1] for mb in mbs)
        mbs_size = 1 if packed else max(mb.num_sequences for mb in mbs)
        virtual = bool(self.cfg.parallel.virtual_pipeline_model_parallel_size)
        # the policy's entropy, logged from its training pass (its gradient is never asked for: no extra work)
        want_entropy = output == "logp" and not forward_only and self.cfg.logging.policy_entropy
        # importance ratios against the engines' log-probs: every log-prob pass at the rows' sampling temperatures
        tempered = self.algorithm.uses_behaviour_logprobs

        def forward_step(data_iterator, model):
            index, mb = next(data_iterator)
            layout = layouts[index]
            if packed:  # one stream [1, T] of whole sequences (models/packing.py)
                args, kwargs = (layout.input_ids, layout.position_ids, None), {"packed_seq_params": layout.params()}
            else:  # with virtual stages every micro-batch has the step's shape: pad rows (sliced off the output below)
                ids, pos = ((pad_rows(mb.input_ids, mbs_size, self.pad_id), pad_rows(mb.position_ids, mbs_size, 0))
                            if virtual else (mb.input_ids, mb.position_ids))
                if cp:  # this CP rank's positions of every row
                    ids, pos = layout.columns(ids), layout.columns(pos)
                args, kwargs = (ids, pos, None), {}
            rows = mbs_size if virtual else mb.num_sequences
            routes = self._router_routes(mb, layout, rows) if replay and mb.routes is not None else None
            with output_hidden_states(model) if output == "logp" else contextlib.nullcontext(), \
                    replayed(model, routes, self._route_layers, keep=keep_routes):
                out = model(*args, **kwargs)
            if not _is_last(model):
                return out, None
            if index >= real:  # an idle micro-batch: its backward runs every layer's exchanges, its gradient is 0
                return out, partial(_idle_loss, index)
            # [rows, S, ...] -> the layout's tokens [N, ...] (this CP rank's)
            out, entropy = layout.model_output(out, rows), None
            sampler = None
            if output == "logp":
                hidden = out
                temperature = sampling_temperature(mb)
                out, entropy = self._token_logprobs(model, hidden, mb.targets, mb.loss_mask, layout, want_entropy,
                                                    temperature=temperature if tempered else None)
                if tempered:  # already of the samplers' temperatures
                    sampler = out.detach()
                elif (not forward_only or gap is not None) and bool((temperature != 1.0).any()):
                    with torch.no_grad():  # one LM-head pass over the rows sampled at T != 1
                        hot = (temperature != 1.0).to(mb.loss_mask.dtype)[:, None]
                        tempered_rows, _ = self._token_logprobs(model, hidden.detach(), mb.targets,
                                                                mb.loss_mask * hot, layout, temperature=temperature)
                    sampler = torch.where(hot.bool(), tempered_rows, out.detach())
                if gap is not None:
                    self._measure_gap(gap, mb, out.detach() if sampler is None else sampler)
            else:
                out = layout.unpack(out)
            # the loss compares the samplers' log-probs with the policy's at their temperature (algorithms' rule)
            loss_mb = mb if sampler is None or tempered else dataclasses.replace(mb, sampler_logp=sampler)
            return out, partial(_loss_wrapper, loss_fn, index, loss_mb, entropy=entropy)

        n_global = self.cfg.batch.sequences_per_step

        def _idle_loss(index, out):
            return out.sum() * 0.0, {"index": index, "idle": True}

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
            group = microbatch_group_size(len(mbs), self.cfg.parallel.pipeline_model_parallel_size)
            for chunk in chunks:
                chunk.config.microbatch_group_size_per_vp_stage = group
        ctx = torch.no_grad() if forward_only else contextlib.nullcontext()
        try:
            with ctx:
                store = fb(forward_step_func=forward_step, data_iterator=data, model=chunks,
                           num_microbatches=len(mbs), seq_length=seq_len, micro_batch_size=mbs_size,
                           forward_only=forward_only)
        finally:
            if keep_routes:
                from megatron_spo.models.routing_replay import release

                release(chunks)
        return [s for s in store if not s.get("idle")] if self.is_last_stage else []

    def _router_routes(self, mb: TrainBatch, layout, rows: int) -> torch.Tensor:
        """The micro-batch's routes [N, layers, k] in its routers' token order (this TP rank's share under sequence
        parallelism): the packed stream's order, or the padded rows' (rows: the rows the model is fed)."""
        from megatron_spo.models.context_parallel import ContextShard
        from megatron_spo.models.routing_replay import router_order, tp_share

        sp = self.cfg.parallel.sequence_parallel
        if self.cfg.batch.pack_sequences:  # the stream's order (this CP rank's tokens under CP)
            flat = layout.gather(mb.routes, fill=-1)
            return tp_share(flat) if sp else flat
        routes = pad_rows(mb.routes, rows, -1)
        return router_order(layout.columns(routes) if isinstance(layout, ContextShard) else routes,
                            sequence_parallel=sp)

    def _measure_gap(self, gap: GapPass, mb: TrainBatch, sampler_logp: torch.Tensor) -> None:
        """Add this micro-batch's engine-vs-trainer log-prob gap (training/logprob_gap.py) to gap. The engines
        report log softmax(logits / T): sampler_logp [B, L] is the trainer's at each row's sampling temperature."""
        rows, current, kl = measured_rows(mb, gap.version)
        if not bool(rows.any()):
            return
        gap.current = gap.current.add(gap_tally(sampler_logp, mb.behaviour_logp, mb.loss_mask, current, kl))
        gap.every = gap.every.add(gap_tally(sampler_logp, mb.behaviour_logp, mb.loss_mask, rows, kl))

    def _collect(self, store: list, n: int) -> list:
        """Per-micro-batch outputs of a forward-only pass, indexed by micro-batch (last pipeline stage;
        other stages get Nones, which is all they need: the loss runs on the last stage only)."""
        out = [None] * n
        for item in store:
            out[item["index"]] = item["out"]
        return out

    def train_step(self) -> dict[str, float]:
        """One step: batch, reference, update, push, log. Returns the step's metrics (rank 0's are complete)."""
        self.step += 1
        t_step = time.perf_counter()
        trajs, mbs, t_wait = self.batch()
        t_fb = time.perf_counter()
        gap = self._gap_pass = GapPass(self.policy_version if self._holds_pushed_weights else None)
        ref = self.forward("reference", mbs, "logp")
        update, lr = self.update(trajs, mbs, ref)
        t_fb = time.perf_counter() - t_fb
        t_sync, evaluation = self.push()
        self._gap_pass = None
        if self.pending_save is not None:  # a background checkpoint: complete once every rank has written it
            checkpoint.complete_pending(self, wait=False)
        return self.log(trajs, update, gap, lr=lr, pad_share=self._pad_share(mbs), t_step=t_step, t_wait=t_wait,
                        t_fb=t_fb, t_sync=t_sync, evaluation=evaluation)

    def batch(self) -> tuple[list, list[TrainBatch], float]:
        """The global batch (rank 0 draws, every rank gets it), this data-parallel rank's packed micro-batches,
        and the seconds waited for rollouts."""
        cfg = self.cfg
        trajs, t_wait = self._global_batch()
        if self.reference_step and self.algorithm.uses_q0:
            q0_from_own_groups(trajs, cfg.beta)  # the Q0 table is of the first reference
        mbs = micro_batches(shard(trajs, self.dp_rank, self.dp_size), cfg, pad_id=self.pad_id, dp_rank=self.dp_rank,
                            keep_groups=self.algorithm.keeps_prompt_groups, device=self.device,
                            prefer_groups=self.algorithm.prefers_prompt_groups)
        self._idle = self._lockstep(len(mbs))
        return trajs, mbs, t_wait

    _idle = _idle_total = 0  # this step's idle micro-batches (expert parallelism: _lockstep): this rank's, all ranks'
    _idle_mb: TrainBatch | None = None

    def _lockstep(self, count: int) -> int:
        """Expert parallelism: every rank of an expert group must run as many micro-batches as the others (each MoE
        layer's forward and backward exchange tokens over the group, which spans data-parallel ranks), so a rank runs
        idle micro-batches (micro_batches.idle_micro_batch) up to the most any data-parallel rank has this step.
        Returns how many (0 without expert parallelism: nothing is exchanged); self._idle_total: over every
        data-parallel rank (the step's metric batch/idle_micro_batches). CP ranks of a replica share its count."""
        self._idle_total = 0
        if self.cfg.parallel.expert_model_parallel_size == 1 or self.dp_size == 1:
            return 0
        counts = [None] * self.dp_size
        dist.all_gather_object(counts, count, group=self.ps.get_data_parallel_group())
        if self._idle_mb is None:
            self._idle_mb = idle_micro_batch(self.cfg, self.pad_id, self.device)
        self._idle_total = max(counts) * len(counts) - sum(counts)
        return max(counts) - count

    def update(self, trajs: list, mbs: list[TrainBatch], ref: list) -> tuple:
        """The algorithm's update of this step's micro-batches given the reference's log-probs (and the
        reference refresh when due): (algos.Update, the policy's learning rate)."""
        cfg = self.cfg
        lr = self.lr_at(self.step, cfg.optimizer.lr)
        rates = {"policy": lr, "value": self.lr_at(self.step, cfg.optimizer.value_lr or cfg.optimizer.lr)}
        update = self.algorithm.update(StepInputs(
            cfg=cfg, step=self.step, micro_batches=mbs, ref=ref, lr=rates.__getitem__,
            optimize=lambda model, output, loss_fn: self.optimize(model, mbs, rates[model], output, loss_fn),
            forward=lambda model, output: self.forward(model, mbs, output), is_last_stage=self.is_last_stage,
            global_sequences=len(trajs), global_response_tokens=sum(model_tokens(t) for t in trajs),
            sum_across_data_parallel=self._sum_across_data_parallel))
        refresh = cfg.reference_refresh_interval
        if refresh and self.step % refresh == 0:
            self.refresh_reference()
        return update, lr

    def push(self) -> tuple[float, dict[str, float]]:
        """Every model_update_interval steps the policy's weights to the fleet, then the held-out evaluation
        when due (the engines hold this step's weights): (seconds pushing, eval metrics). Between those steps, an
        engine that answers without the weights the fleet holds (restarted, or a push missed it) brings the next push
        forward to this step: pushing it the pushed version's weights is impossible (the policy has trained on since),
        and the current weights under that version would mislabel its samples."""
        if self.step % self.cfg.model_update_interval and not self._engines_behind():
            return 0.0, {}
        t_sync = self.sync_weights()
        # the other ranks wait at the metrics gather in log()
        due = self.held_out is not None and self.held_out.due(self.step)
        return t_sync, self._evaluate_held_out() if due else {}

    def log(self, trajs: list, update, gap: GapPass, *, lr: float, pad_share: float, t_step: float,
            t_wait: float, t_fb: float, t_sync: float, evaluation: dict) -> dict[str, float]:
        """Gather the step's metrics (training/step_metrics.py) to rank 0, log them, warn, and guard."""
        cfg = self.cfg
        loss_metrics = self._reduce_metrics(update.reports, gap)
        fleet: dict[str, float] = {}
        if self.rank == 0 and self.online is not None and hasattr(self.online, "stats"):
            fleet = {**self.online.stats(), **self._sync_metrics}
            self._sync_metrics = {}
        times = StepTimes(rollout_wait=t_wait, forward_backward=t_fb, weight_sync=t_sync,
                          step=time.perf_counter() - t_step)
        metrics = step_metrics(trajs, loss=loss_metrics, fleet=fleet, update=update.metrics, evaluation=evaluation,
                               times=times, lr=lr, grad_norm=update.grad_norm, policy_version=self.policy_version,
                               pad_share=pad_share,
                               reference_step=self.reference_step if cfg.reference_refresh_interval else None)
        if self._idle_total:
            metrics["batch/idle_micro_batches"] = float(self._idle_total)
        metrics.update(self.checkpoint_metrics)
        self.checkpoint_metrics = {}
        self.metrics.log(self.step, metrics)
        warning = gap_warning(self.step, metrics, cfg.logging.max_logprob_gap)
        if warning and self.rank == 0:
            print(warning, flush=True)
        self.divergence_guard.check(self.step, metrics)
        return metrics

    def refresh_reference(self) -> None:
        """The reference becomes a copy of the policy's current weights (each rank copies its own shards: both
        models have one layout)."""
        with torch.no_grad():
            for ref_chunk, policy_chunk in zip(self.reference, self.policy):
                weights = dict(policy_chunk.module.named_parameters())
                for name, param in ref_chunk.named_parameters():
                    param.copy_(weights[name])
        self.reference_step = self.step

    def _evaluate_held_out(self) -> dict[str, float]:
        """Rank 0: eval/pass@K of the engines' current weights; a failed evaluation is one warning line, not
        the end of the run (it is a measurement, not part of training)."""
        from megatron_spo.rollout.client import EngineError

        self.held_out.lora_path = getattr(self.online, "lora_path", None)  # adapter pushes: the current adapter
        try:
            metrics = self.held_out.run()
        except (EngineError, OSError, TimeoutError, ValueError) as err:
            print(f"[megatron-spo] warning: held-out eval at step {self.step} failed: {type(err).__name__}: {err}",
                  flush=True)
            return {}
        warning = self.held_out.decline_warning(self.step, metrics)
        if warning:
            print(warning, flush=True)
        return metrics

    def _sum_across_data_parallel(self, t: torch.Tensor) -> torch.Tensor:
        if self.dp_size > 1:
            all_reduce_(t, group=self.ps.get_data_parallel_group())
        return t

    def forward(self, model: str, mbs: list[TrainBatch], output: str) -> list:
        """No-grad outputs of "reference" / "policy" / "value" per micro-batch (output 'logp' | 'values'), on
        the last pipeline stage (Nones elsewhere: the loss runs on the last stage only)."""
        if model == "reference" and self.reference is None:  # LoRA: pi_0 is the frozen base, the adapters off
            from megatron_spo.models.lora import adapters_off

            with adapters_off(self.policy):
                store = self._run(self.policy, mbs, forward_only=True, output=output, loss_fn=None, measure_gap=False)
            return self._collect(store, len(mbs))
        chunks = {"reference": self.reference, "policy": self.policy, "value": self.value}[model]
        return self._collect(self._run(chunks, mbs, forward_only=True, output=output, loss_fn=None), len(mbs))

    def optimize(self, model: str, mbs: list[TrainBatch], lr: float, output: str, loss_fn) -> tuple[list, float]:
        """One optimizer step of "policy" or "value" over the micro-batches: (the loss function's reports,
        grad norm). loss_fn(index, micro_batch, output) -> (scalar loss, metrics)."""
        chunks, optimizer = {"policy": (self.policy, self.optimizer), "value": (self.value, self.value_optimizer)}[model]
        for chunk in chunks:
            chunk.zero_grad_buffer()
        optimizer.zero_grad()
        store = self._run(chunks, mbs, forward_only=False, output=output, loss_fn=loss_fn)
        for group in optimizer.param_groups:
            group["lr"] = lr
        ok, grad_norm, _ = optimizer.step()
        self._holds_pushed_weights &= model != "policy"
        if not ok:
            raise TrainingDiverged(f"step {self.step}: the optimizer skipped the update (non-finite gradients)")
        return store, float(grad_norm or 0.0)

    def _reduce_metrics(self, store: list, gap: GapPass | None = None) -> dict[str, float]:
        """The loss metrics of the global batch (losses.metric_sums over micro-batches and data-parallel ranks),
        and the log-prob gap of gap's tallies, delivered on rank 0."""
        local: dict[str, list[float]] = {}
        local_gap = (GapTally(), GapTally())
        # one rank of each data-parallel replica's last stage (its TP and CP ranks computed the same loss)
        if self.is_last_stage and self.ps.get_tensor_model_parallel_rank() == 0 \
                and self.ps.get_context_parallel_rank() == 0:
            local = losses.metric_sums(store)
            if gap is not None:
                local_gap = (gap.current, gap.every)
        gathered = [None] * self.world
        dist.all_gather_object(gathered, (local, local_gap))
        total: dict[str, list[float]] = {}
        current, every = GapTally(), GapTally()
        for part, (part_current, part_every) in gathered:
            current, every = current.add(part_current), every.add(part_every)
            for k, (s, n) in part.items():
                t = total.setdefault(k, [0.0, 0.0])
                t[0] += s
                t[1] += n
        return {**{k: s / n for k, (s, n) in total.items() if n}, **gap_metrics(current, every)}

    # -- weights to the fleet ------------------------------------------------------------------
    def sync_weights(self, new_version: bool = True) -> float:
        """Collective: the policy's HF-named weights to the fleet as version policy_version + 1 (or as the
        current version, to bring a restarted fleet up to a resumed policy).

        A push that reached no engine is sent again at once (rollout.weight_sync_attempts in all): every engine
        is then paused and serves nothing, so waiting for the next scheduled push would starve the run. After
        the last attempt the run stops with the reason. Engines that missed a push the others took stay out of
        service until the next push reaches them (weight_sync.py). With LoRA and adapter pushes (lora.push) only
        the adapters go, in HF PEFT names (rollout/adapter_push.py)."""
        from megatron_spo.models.hf_map import gather_hf_tensors

        t0 = time.perf_counter()
        self.policy_version += int(new_version)
        online = self.rank == 0 and hasattr(self.online, "push_weights")
        adapters = self._push_mode() == "adapter"
        attempts = self.cfg.rollout.weight_sync_attempts
        for attempt in range(1, attempts + 1):
            push = partial(self.online.push_weights, self.policy_version) if online else None
            try:
                if adapters:
                    self._sync_metrics = self._push_adapters() or {}
                else:
                    self._sync_metrics = gather_hf_tensors(self.policy, self.model_cfg, push) or {}
                missed = [online and self._sync_metrics.get("weight_sync/engines_updated", 1.0) == 0
                          and (getattr(self.online, "last_sync_error", None) or "no engine took it")]
            except WAIT_ENDED as err:  # rank 0, waiting for the engines before the push
                self._sync_metrics, missed = {}, [err]
            dist.broadcast_object_list(missed, src=0)
            if isinstance(missed[0], WAIT_ENDED):
                raise missed[0]
            if not missed[0]:
                self._holds_pushed_weights = True
                self._pushed_step = self.step
                if self._early_pushes:
                    self._sync_metrics["weight_sync/early_pushes"] = float(self._early_pushes)
                break
            if attempt == attempts:
                raise RuntimeError(f"weight sync to version {self.policy_version} reached no engine in {attempts} "
                                   f"attempts (rollout.weight_sync_attempts): {missed[0]}")
            if self.rank == 0:
                print(f"[megatron-spo] weight sync attempt {attempt} reached no engine; sending it again",
                      flush=True)
        return time.perf_counter() - t0

    _sync_metrics: dict = {}
    _decided_push_mode: str | None = None
    _early_pushes = 0  # pushes brought forward for an engine behind (the run's total)
    _pushed_step = -1  # the step the fleet's weights are of
    _early_step: int | None = None  # the step of the last push brought forward

    def _engines_behind(self) -> bool:
        """Collective: does an engine answer without the weights the fleet holds (rank 0 asks the sender)? Then a
        line says which, and the push is brought forward (fleet/early_pushes counts them)."""
        if "online" not in self.cfg.sources:  # every rank knows: no collective for an offline run
            return False
        if self._early_step is not None and self.step - self._early_step < self.cfg.model_update_interval:
            return False  # one early push per interval: an engine every push misses does not make each step push
        online = self.rank == 0 and hasattr(self.online, "engines_needing_weights")
        behind = [self.online.engines_needing_weights() if online else []]
        dist.broadcast_object_list(behind, src=0)
        if behind[0]:
            self._early_pushes, self._early_step = self._early_pushes + 1, self.step
            if self.rank == 0:
                print(f"[megatron-spo] fleet: {', '.join(behind[0])} answer without weight version "
                      f"{self.policy_version} (restarted, or a push missed them): the next push is sent now, at step "
                      f"{self.step}", flush=True)
        return bool(behind[0])

    def _push_mode(self) -> str:
        """Collective, decided at the first push: 'adapter' (LoRA adapters alone) or 'merged' (full weights), by
        lora.push and what the engines were started with (rank 0 asks them; its error stops every rank)."""
        if self.cfg.lora is None:
            return "merged"
        if self._decided_push_mode is None:
            decided: list = ["merged"]
            if self.rank == 0 and hasattr(self.online, "push_mode"):
                try:
                    decided = [self.online.push_mode(self.cfg.lora, self.model_cfg, self.cfg.init.hf,
                                                     run_dir=self.cfg.run_dir)]
                except Exception as err:  # raised on every rank below
                    decided = [err]
            dist.broadcast_object_list(decided, src=0)
            if isinstance(decided[0], BaseException):
                raise decided[0]
            self._decided_push_mode = decided[0]
            if self.rank == 0 and hasattr(self.online, "push_mode"):
                sends = "the adapters alone" if decided[0] == "adapter" else "merged full weights"
                if decided[0] == "adapter" and self.cfg.lora.transport == "path":
                    sends += " by path (written once to lora.push_dir, /load_lora_adapter)"
                print(f"[megatron-spo] lora: weight pushes send {sends} (lora.push={self.cfg.lora.push})", flush=True)
        return self._decided_push_mode

    def _push_adapters(self) -> dict | None:
        """Collective: the adapters gathered to rank 0, pushed there in HF PEFT names and the policy's dtype."""
        from megatron_spo.models.lora import gather_adapters
        from megatron_spo.models.peft_export import peft_tensors

        adapters = gather_adapters(self.policy)
        if self.rank != 0 or not hasattr(self.online, "push_adapter"):
            return None
        dtype = next(self.policy[0].parameters()).dtype
        tensors = {k: v.to(dtype) for k, v in peft_tensors(adapters, self.model_cfg).items()}
        return self.online.push_adapter(self.policy_version, tensors)

    def export_hf(self, out_dir: str | Path) -> Path:
        """Collective: write the policy as an HF directory of its family (safetensors shards, config.json and the
        tokenizer of init.hf), atomically: out_dir appears complete or not at all."""
        import shutil

        from megatron_spo.models.hf_checkpoint import HFWriter, copy_tokenizer_files, write_hf_config
        from megatron_spo.models.hf_map import gather_hf_tensors

        out = Path(out_dir)
        tmp = out.with_name(out.name + ".partial")

        def write(tensors) -> None:
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

        gather_hf_tensors(self.policy, self.model_cfg, write if self.rank == 0 else None)
        dist.barrier()
        return out

    def export_peft(self, out_dir: str | Path) -> Path:
        """Collective (LoRA): the adapters as an HF PEFT directory (adapter_config.json + adapter_model.safetensors,
        the policy's dtype) that peft.PeftModel.from_pretrained loads onto init.hf's model."""
        from megatron_spo.models.lora import gather_adapters
        from megatron_spo.models.peft_export import write_peft_adapter

        adapters = gather_adapters(self.policy)
        if self.rank == 0:
            write_peft_adapter(out_dir, adapters, self.cfg.lora, self.model_cfg, self.cfg.init.hf,
                               dtype=next(self.policy[0].parameters()).dtype)
        dist.barrier()
        return Path(out_dir)

    # -- checkpoints (training/checkpoint.py) -------------------------------------------------
    pending_save = None  # a checkpoint whose shards are being written (checkpoint.async_save)
    checkpoint_metrics: dict = {}  # the last save's seconds, logged with the next step's metrics

    def save_checkpoint(self, background: bool = False) -> Path:
        if self.archive is not None:  # what a checkpoint has trained on is archived for good
            self.archive.flush()
        return checkpoint.save(self, background=background)

    def _resume(self) -> None:
        checkpoint.resume(self)

    # -- the loop ------------------------------------------------------------------------------
    def train(self) -> int:
        """Run to cfg.steps (or until preempted). Returns the last completed step."""
        cfg = self.cfg
        progress = progress_line(self.rank == 0 and cfg.logging.progress, cfg.steps, self.step)
        online = self.rank == 0 and hasattr(self.online, "push_weights")
        flags = [online, None]  # and why the engines may hold other weights than this policy (None: they do not)
        if online and hasattr(self.online, "check_engines"):  # before the first sample (training/online.py)
            try:
                flags[1], dtypes = self.online.check_engines(self.model_cfg.params_dtype)
                if dtypes:
                    print(f"[megatron-spo] {dtypes}", flush=True)
            except WAIT_ENDED as err:  # every rank raises it (below)
                flags[1] = err
        dist.broadcast_object_list(flags, src=0)
        try:
            if isinstance(flags[1], WAIT_ENDED):
                raise flags[1]
            if flags[0] and (self.policy_version > 0 or flags[1]):  # resumed, or engines that may hold other weights
                if flags[1] and self._push_mode() == "adapter":
                    raise RuntimeError(f"fleet: {flags[1]}; adapter pushes (lora.push) cannot replace the engines' base "
                                       "weights: restart the engines, or set lora.push=merged")
                if flags[1] and self.rank == 0:
                    print(f"[megatron-spo] fleet: {flags[1]}: pushing this run's weights (version "
                          f"{self.policy_version}) before the first sample", flush=True)
                self.sync_weights(new_version=False)
                if self.policy_version == 0:
                    self._sync_metrics = {}  # not a step's push: step 1's metrics stay those of step 1
            if online and hasattr(self.online, "start"):
                self.online.start()
            while self.step < cfg.steps:
                metrics = self.train_step()
                progress(self.step, metrics)
                preempted = self.preemption.requested()
                last = preempted or self.step == cfg.steps  # the process exits next: written before it does
                if last or self.step % cfg.checkpoint.interval == 0:
                    self.save_checkpoint(background=cfg.checkpoint.async_save and not last)
                if preempted:
                    if self.rank == 0:
                        print(f"[megatron-spo] preempted: checkpoint at step {self.step} saved, exiting", flush=True)
                    break
            if self.step >= cfg.steps and flags[0] and self._pushed_step != self.step:
                self.sync_weights()  # the fleet ends with the final policy (for evaluation through it)
            if self.step >= cfg.steps and cfg.checkpoint.export_hf:
                path = self.export_hf(self.run_dir / "hf")
                if self.rank == 0:
                    print(f"[megatron-spo] final policy written to {path}", flush=True)
                if cfg.lora is not None:
                    path = self.export_peft(self.run_dir / "adapter")
                    if self.rank == 0:
                        print(f"[megatron-spo] final adapters written to {path} (HF PEFT)", flush=True)
        except Stopped as stop:  # a preemption signal while waiting (rollouts, engines): exit in seconds
            saved = self._checkpoint_finished_step()
            if self.rank == 0:
                print(f"[megatron-spo] preempted: {saved}, exiting ({stop})", flush=True)
        except FleetUnavailable:
            self._checkpoint_finished_step()
            raise
        finally:
            progress(None, None)
            self.metrics.close()
            self._print_library_warnings()
        return self.step

    def _print_library_warnings(self) -> None:
        line = self.library_warnings.summary()
        if line and self.rank == 0:
            print(line, flush=True)

    def _checkpoint_finished_step(self) -> str:
        """Save the last finished step unless a checkpoint of it exists; says what was done."""
        checkpoint.complete_pending(self, wait=True)
        latest = self.ckpt.latest()
        if self.step == 0 or (latest is not None and latest[0] == self.step):
            return f"step {self.step} is already checkpointed" if self.step else "no step had finished"
        self.save_checkpoint()
        return f"checkpoint at step {self.step} saved"

    def close(self, keep_process_group: bool = False) -> None:
        """Release signal handlers and megatron's groups (and the default group unless kept, e.g. to
        train another model in the same processes)."""
        from megatron.core import parallel_state

        from megatron_spo.models.parallel import destroy_parallel

        self.preemption.restore()
        if self.pending_save is not None and self.pending_save.shards.thread is not None:
            self.pending_save.shards.thread.join()  # never completed (the run failed): left a .partial, not `latest`
        if self._deterministic_before is not None:  # the flag is the process's: the next trainer picks its own
            torch.use_deterministic_algorithms(self._deterministic_before)
        self.library_warnings.close()
        if self.archive is not None:
            self.archive.close()
        if self.held_out is not None:
            self.held_out.close()
        if self.online is not None and hasattr(self.online, "close"):
            self.online.close()
        if keep_process_group:
            parallel_state.destroy_model_parallel()
        else:
            destroy_parallel()


def sampling_temperature(mb: TrainBatch) -> torch.Tensor:
    """[B] the temperature each row's behaviour log-probs are of (the engines report log softmax(logits / T)); 1
    for rows without behaviour log-probs or a known temperature (greedy rows report the raw log-probs: 1)."""
    t = mb.behaviour_temperature.to(mb.loss_mask.device)
    has = (mb.behaviour_logp != 0).any(1).to(t.device)
    return torch.where(has & torch.isfinite(t) & (t > 0), t, torch.ones_like(t))


def _without_routes(trajs: list) -> tuple[list, list | None]:
    """(the trajectories without their routed_experts, each one's routes or None; None when none has routes)."""
    routes = [getattr(t, "routed_experts", None) for t in trajs]
    if all(r is None for r in routes):
        return trajs, None
    return [t if r is None else dataclasses.replace(t, routed_experts=None) for t, r in zip(trajs, routes)], routes


def check_routes(trajs: list, model_cfg) -> None:
    """Every trajectory's routed_experts can be this model's (layer count, top_k, expert ids): else one line naming
    the trajectory and the field (routes from another model, or a corrupted record)."""
    for i, t in enumerate(trajs):
        routes = getattr(t, "routed_experts", None)
        if routes is not None:
            routes.check_for(model_cfg, f"trajectory {i} of the step (prompt_id {t.prompt_id!r}, source {t.source!r})")


def _is_last(model) -> bool:
    while hasattr(model, "module"):
        model = model.module
    return bool(model.post_process)


def _model_config_from_init(init):
    if init.megatron:
        from megatron_spo.models.megatron_checkpoint import read_megatron_config

        return read_megatron_config(init.megatron)
    from megatron_spo.models.hf_checkpoint import read_hf_config

    return read_hf_config(init.hf)
