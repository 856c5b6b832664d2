"""Rollout routing replay (R3) on megatron-core's routers: within ``replayed(chunk, routes)`` every MoE router of
the chunk sends each token to the experts ``routes`` names instead of its own top-k; the router's probabilities
of those experts (its softmax, hence its gradient) are kept, only the choice is forced.

    with replayed(chunk, routes):        # routes: int [N, layers, top_k] in the router's token order
        out = chunk(input_ids, position_ids, None)
    with recorded(chunks) as got:        # the routes the routers chose themselves
        chunk(...)
    got()                                # int64 [N, layers, top_k]

The router's token order is its input's: [S, B, H] flattened, token s * B + b (``router_order``); a packed
stream (B = 1) is its stream order (``Packed.gather``). Under sequence parallelism each TP rank routes its
contiguous 1 / TP of those tokens (``router_order`` cuts it). Layers are global layer numbers, so a pipeline
stage (or virtual stage) takes its own layers' routes from the full table.

This drives megatron-core's ``RouterReplay`` (one per router, built by ``moe_enable_routing_replay``) per router,
not through its process-global instance list, which also holds every other model's routers (the reference, a
checkpoint reload). The action is REPLAY_FORWARD: the backward pass needs nothing more unless activation
recompute re-runs the router; with full recompute the routes stay set through the micro-batch's backward
(``replayed(..., keep=True)``, then ``release``), which PP 1 orders right (``check_replay_layout``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
from torch import Tensor

from megatron_spo.config import ConfigError


def _unwrap(model):
    while hasattr(model, "module"):
        model = model.module
    return model


def moe_routers(chunks) -> list[tuple[int, object]]:
    """(global layer index, RouterReplay) of every MoE layer in these chunks (one chunk or a list)."""
    chunks = chunks if isinstance(chunks, (list, tuple)) else [chunks]
    found = []
    for chunk in chunks:
        for layer in _unwrap(chunk).decoder.layers:
            replay = getattr(getattr(layer.mlp, "router", None), "router_replay", None)
            if replay is not None:
                found.append((layer.layer_number - 1, replay))
    return found


def router_order(routes: Tensor, *, sequence_parallel: bool = False) -> Tensor:
    """[B, S, layers, k] (a padded micro-batch's rows) -> [S * B, layers, k] in the router's token order, this TP
    rank's contiguous share of it under sequence parallelism."""
    b, s = routes.shape[:2]
    flat = routes.transpose(0, 1).reshape(s * b, *routes.shape[2:])
    return tp_share(flat) if sequence_parallel else flat


def tp_share(flat: Tensor) -> Tensor:
    """This TP rank's contiguous 1 / TP of the router-order tokens (sequence parallelism)."""
    from megatron.core import parallel_state as ps

    tp, rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    if flat.shape[0] % tp:
        raise ValueError(f"routing replay: {flat.shape[0]} tokens do not split over {tp} sequence-parallel ranks")
    n = flat.shape[0] // tp
    return flat[rank * n:(rank + 1) * n]


@contextlib.contextmanager
def replayed(chunks, routes: Tensor | None, layers: list[int] | None = None, keep: bool = False) -> Iterator[None]:
    """Within: the MoE routers of ``chunks`` take ``routes`` [N, layers, k] (N tokens in router order) as their top-k;
    a token whose route holds -1 (a row without routes, padding) is routed by the router itself. layers: the global
    MoE layer index of each column of routes (a pipeline stage's share); None: column i is layer i (every layer).
    routes None: the routers choose (nothing changes). keep: the routes stay set after the context (full activation
    recompute re-runs the routers in the backward): the next call replaces them, ``release`` ends them."""
    if routes is None:
        if keep:  # a kept earlier micro-batch's routes must not route this one
            release(chunks)
        yield
        return
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    routers = moe_routers(chunks)
    column = {layer: i for i, layer in enumerate(layers)} if layers is not None else None
    missing = [layer for layer, _ in routers if (layer not in column if column is not None else layer >= routes.shape[1])]
    if missing:
        raise ValueError(f"routing replay: routes of {routes.shape[1]} layers hold none for layer {missing[0]}")
    release(chunks)  # a kept earlier micro-batch's (keep), or nothing
    for layer, replay in routers:
        target = routes[:, layer if column is None else column[layer]].to(torch.long)
        own = target[:, 0] < 0
        if bool(own.any()):  # megatron's REPLAY_FORWARD replays every token: choose, then overwrite the routed
            replay.get_replay_topk = _partial_topk(target, own)
        else:
            replay.set_target_indices(target)
        replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
    try:
        yield
    finally:
        if not keep:
            release(chunks)


def release(chunks) -> None:
    """Every MoE router of ``chunks`` chooses its own experts again (what ``replayed`` set is cleared)."""
    for _, replay in moe_routers(chunks):
        replay.__dict__.pop("get_replay_topk", None)
        replay.clear_indices()
        replay.clear_router_replay_action()


def _partial_topk(target: Tensor, own: Tensor) -> Callable:
    """RouterReplay.get_replay_topk for routes with gaps: the router's own top-k where ``own`` [N] is set, the
    target's elsewhere; the probabilities gathered from the router's scores as REPLAY_FORWARD gathers them."""

    def get_replay_topk(scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
        _, chosen = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
        indices = torch.where(own.to(scores.device)[:, None], chosen, target.to(scores.device))
        return scores.gather(1, indices), indices

    return get_replay_topk


@contextlib.contextmanager
def recorded(chunks) -> Iterator[Callable[[], Tensor]]:
    """Within: the routers choose as usual and keep their choice; the yielded function gives the last forward's
    routes int64 [N, layers, k] (layers: this stage's, numbered from its first)."""
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    routers = moe_routers(chunks)
    for _, replay in routers:
        replay.set_router_replay_action(RouterReplayAction.RECORD)
    try:
        yield lambda: torch.stack([replay.get_recorded_indices() for _, replay in routers], dim=1)
    finally:
        for _, replay in routers:
            replay.clear_indices()
            replay.clear_router_replay_action()


def check_replay_layout(parallel, field: str = "routing_replay") -> None:
    """Full activation recompute re-runs every router in the backward pass: a micro-batch's routes are kept set
    until the next micro-batch's forward (``replayed(keep=True)``), which is the order of its recompute only without
    pipelining (PP 1: each micro-batch's backward follows its forward). Under PP > 1 the schedule interleaves
    micro-batches (megatron's REPLAY_BACKWARD queue would need driving per stage): refused in one line."""
    if parallel.recompute_granularity == "full" and parallel.pipeline_model_parallel_size > 1:
        raise ConfigError(f"{field}: routing replay with parallel.recompute_granularity 'full' at "
                          f"pipeline_model_parallel_size {parallel.pipeline_model_parallel_size} is not built (the "
                          f"recomputed routers would take another micro-batch's routes); use PP 1, 'selective' or none")
