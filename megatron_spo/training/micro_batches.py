"""A training step's trajectories -> this data-parallel rank's micro-batches, cut by a token budget (padded rows,
or the packed tokens with batch.pack_sequences).

    mine = shard(trajectories, dp_rank, dp_size)        # whole prompt groups, dealt by tokens
    mbs = micro_batches(mine, cfg, keep_groups=..., pad_id=0, dp_rank=r, device=None)

Pipeline schedules put constraints on the cut (one shape per step with virtual stages, at least PP
micro-batches for the interleaved schedule, widths a multiple of TP under sequence parallelism): they live
here, next to the packing, not in the trainer loop.
"""

from __future__ import annotations

import torch

from megatron_spo.config import ConfigError
from megatron_spo.data.batching import TrainBatch, collate, group_numbers, split_by_token_budget
from megatron_spo.data.trajectory import record_tokens
from megatron_spo.training.config import TrainConfig
from megatron_spo.training.sources import GUIDE_SOURCE


def shard(trajs: list, dp_rank: int, dp_size: int) -> list:
    """This data-parallel rank's trajectories (shard_indices)."""
    return [trajs[i] for i in shard_indices(trajs, dp_rank, dp_size)]


def shard_indices(trajs: list, dp_rank: int, dp_size: int) -> list[int]:
    """This data-parallel rank's trajectories: whole prompt groups (trajectories of one prompt_id) dealt to the
    ranks by tokens (deal_by_tokens), so that no rank waits with the long tail of the responses. Every rank computes
    the same deal from the same global list: the shares are disjoint and cover it. A share lists its groups in
    the order of their first appearance, each group's trajectories in their order in the global list (with one
    rank: the global list, grouped), so the micro-batch cut stays deterministic."""
    groups: dict = {}
    for i, t in enumerate(trajs):
        groups.setdefault(t.prompt_id, []).append(i)
    if len(groups) < dp_size:
        raise ConfigError(f"batch: {len(groups)} prompt groups cannot feed {dp_size} data-parallel ranks; "
                          "raise batch.sequences_per_step")
    owner = deal_by_tokens([sum(record_tokens(trajs[i]) for i in g) for g in groups.values()], dp_size)
    return [i for g, r in zip(groups.values(), owner) if r == dp_rank for i in g]


def deal_by_tokens(loads: list[int], bins: int, *, refine: bool = True) -> list[int]:
    """Each item's bin (its rank), every bin given at least one item when there are as many items as bins:
    longest-processing-time first (items by load descending, ties by position; each to the least-loaded bin, ties
    to the emptiest then the lowest bin), then, with refine, moves and swaps that lower the most-loaded bin's load
    while one does. Integer arithmetic and fixed tie-breaks: the same deal on every rank."""
    owner = [0] * len(loads)
    load, count = [0] * bins, [0] * bins
    for i in sorted(range(len(loads)), key=lambda i: (-loads[i], i)):
        b = min(range(bins), key=lambda b: (count[b] > 0, load[b], b))
        owner[i] = b
        load[b] += loads[i]
        count[b] += 1
    if not refine or bins < 2:
        return owner
    members: list[list[int]] = [[] for _ in range(bins)]
    for i, b in enumerate(owner):
        members[b].append(i)
    # each accepted move or swap sends d > 0 from the top bin a to a bin b with load[b] + d < load[a]: the sum of
    # squared loads falls strictly, so this ends; the cap bounds the time on adversarial inputs
    for _ in range(4 * len(loads)):
        a = max(range(bins), key=lambda b: (load[b], -b))
        step = None
        for b in sorted(range(bins), key=lambda b: (load[b], b)):  # the lightest bin first, the first that helps
            if b == a:
                continue
            best = None  # (the pair's new maximum, item leaving a, item coming back or -1)
            for i in members[a]:
                # a move needs a to keep an item; a swap brings back a lighter item of b
                for j in ([-1] if len(members[a]) > 1 else []) + members[b]:
                    d = loads[i] - (loads[j] if j >= 0 else 0)
                    top = max(load[a] - d, load[b] + d)
                    if d > 0 and top < load[a] and (best is None or (top, i, j) < best):
                        best = (top, i, j)
            if best is not None:
                step = (b, best[1], best[2])
                break
        if step is None:
            break
        b, i, j = step
        d = loads[i] - (loads[j] if j >= 0 else 0)
        members[a].remove(i)
        members[b].append(i)
        owner[i] = b
        if j >= 0:
            members[b].remove(j)
            members[a].append(j)
            owner[j] = a
        load[a] -= d
        load[b] += d
    return owner


def micro_batches(trajs: list, cfg: TrainConfig, *, keep_groups: bool, pad_id: int, dp_rank: int,
                  device=None, prefer_groups: bool = False) -> list[TrainBatch]:
    """keep_groups: a prompt group never straddles two micro-batches (group-wise algorithms). prefer_groups: keep
    them whole when every group fits the budget (and the interleaved schedule still gets its micro-batches), else
    cut them (SPO's centred coefficient: whole groups spare it a forward pass)."""
    if prefer_groups and not keep_groups:
        try:
            return micro_batches(trajs, cfg, keep_groups=True, pad_id=pad_id, dp_rank=dp_rank, device=device)
        except (ValueError, ConfigError):
            pass
    lengths = [record_tokens(t) - 1 for t in trajs]
    too_long = [i for i, n in enumerate(lengths) if n + 1 > cfg.batch.max_seq_length]
    if too_long:
        i = too_long[0]
        raise ValueError(f"batch: trajectory of prompt {trajs[i].prompt_id!r} has {lengths[i] + 1} tokens, "
                         f"over batch.max_seq_length {cfg.batch.max_seq_length}")
    # a group is one source's responses to one prompt: another source's records of the same prompt (offline data,
    # an earlier run's experience) need not share its micro-batch; demonstrations spliced into an online group
    # (grpo.guide_path) are part of it
    keep = [("online" if t.source == GUIDE_SOURCE else t.source, t.prompt_id) for t in trajs] if keep_groups else None
    pp = cfg.parallel.pipeline_model_parallel_size
    virtual = bool(cfg.parallel.virtual_pipeline_model_parallel_size)
    packed = cfg.batch.pack_sequences
    # one shape per step with virtual stages (trainer._schedule_ready): padded rows all take the longest row's
    # width; packed micro-batches are padded to one stream length by the trainer (models/packing.py)
    width = max(lengths) if virtual and not packed else None
    parts = split_by_token_budget([width] * len(lengths) if width else lengths,
                                  cfg.batch.max_tokens_per_micro_batch, keep_groups=keep, packed=packed)
    if virtual and len(parts) < pp:
        # megatron's interleaved schedule needs at least PP micro-batches per step
        parts = split_to_count(parts, pp, keep)
        if len(parts) < pp:
            unit = "prompt groups" if keep else "sequences"
            raise ConfigError(f"batch: the interleaved pipeline schedule (parallel.virtual_pipeline_model_"
                              f"parallel_size) needs at least {pp} micro-batches per step, but data-parallel "
                              f"rank {dp_rank} has only {len(parts)} {unit}; raise batch.sequences_per_step")
    # context parallelism cuts every row into 2 x CP chunks, sequence parallelism each rank's share over TP: widths
    # are a multiple of both (a packed stream is padded when it is packed)
    multiple = cfg.parallel.sequence_multiple() if not packed else 1
    # one id per prompt group over the whole step: a group cut into two micro-batches keeps its id in both (SPO's
    # centred coefficient takes its baseline over the whole group)
    groups = group_numbers([t.prompt_id for t in trajs])
    mbs = [collate([trajs[i] for i in rows], pad_id,
                   length=-(-(width or max(lengths[i] for i in rows)) // multiple) * multiple,
                   group_ids=[groups[i] for i in rows])
           for rows in parts]
    return [mb.to(device) if device is not None else mb for mb in mbs]


def idle_micro_batch(cfg: TrainConfig, pad_id: int, device=None) -> TrainBatch:
    """A micro-batch that trains nothing: one row of parallel.sequence_multiple() (at least 2) pad tokens and no
    response token (loss_mask 0). The data-parallel ranks of an expert group exchange tokens in every MoE layer's
    forward and backward, so a rank with fewer micro-batches than the others of its group runs these to keep in step
    (trainer._lockstep): each costs its tokens' forward and backward."""
    from types import SimpleNamespace

    n = max(2, cfg.parallel.sequence_multiple())
    row = SimpleNamespace(prompt_id="(idle)", prompt_tokens=[pad_id] * n, response_tokens=[pad_id], reward=0.0,
                          source="(idle)", policy_version=0)
    mb = collate([row], pad_id, length=n)
    mb.loss_mask.zero_()
    return mb.to(device) if device is not None else mb


def pad_rows(t: torch.Tensor, rows: int, value: int) -> torch.Tensor:
    """[b, L, ...] -> [rows, L, ...], the new rows filled with value."""
    if t.shape[0] == rows:
        return t
    return torch.cat([t, t.new_full((rows - t.shape[0], *t.shape[1:]), value)])


def split_to_count(parts: list[list[int]], n: int, groups: list | None) -> list[list[int]]:
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


def microbatch_group_size(num_microbatches: int, pp: int) -> int:
    """Contiguous micro-batches per virtual stage in megatron's interleaved schedule: the smallest N >= PP
    with M % N == 0 or M % N >= PP, which megatron accepts (its default N = PP needs M % PP == 0, and the
    token-budget packing gives any M). Needs M >= PP."""
    for n in range(pp, num_microbatches + 1):
        if num_microbatches % n == 0 or num_microbatches % n >= pp:
            return n
    raise ValueError(f"interleaved pipeline: {num_microbatches} micro-batches, fewer than PP={pp}")
