"""THE Hugging Face <-> Megatron map: names (the family's rule table), layouts, TP split rules, vocab padding.

One module serves checkpoint conversion (``convert.py``) and live weight sync (the rollout
WeightBroadcaster consumes ``iter_hf_tensors``). Each family (``models/arch/``) declares its layer's
rules; the layouts below are shared. Per decoder layer (H hidden, d head_dim, G KV groups,
n = heads / G query heads per group, F ffn):

  HF q_proj [n*G*d, H], k_proj [G*d, H], v_proj [G*d, H]   (and their biases [n*G*d], [G*d], [G*d])
      <-> linear_qkv [G*(n+2)*d, H] (bias [G*(n+2)*d]), interleaved per KV group:
          [q_g (n*d); k_g (d); v_g (d)] for g = 0..G-1
  HF gate_proj [F, H], up_proj [F, H]  <-> linear_fc1 [2F, H] = cat[gate, up]
  HF o_proj / down_proj                <-> linear_proj / linear_fc2 (same layout)
  HF q_norm / k_norm [d]               <-> q_layernorm / k_layernorm (replicated)
  HF embed_tokens / lm_head [V, H]     <-> word_embeddings / output_layer [V_pad, H] (zero rows appended)

TP split rules (rank r of T): qkv, fc1, embedding, output layer split dim 0; linear_proj and fc2 split
dim 1; norms are replicated. qkv splits contiguously (whole KV groups per rank: the interleaved layout
is what makes that right); fc1 splits gate and up separately (shard r = cat[gate_r, up_r]); the vocab
splits the PADDED rows contiguously.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
from torch import Tensor

from megatron_spo.models.arch import architecture
from megatron_spo.models.arch.base import (  # noqa: F401  (re-exported: the names every family shares)
    EMBED,
    EMBED_RULE,
    FINAL_NORM,
    FINAL_NORM_RULE,
    LM_HEAD,
    LM_HEAD_RULE,
    Rule,
)
from megatron_spo.models.config import ModelConfig


# ---------------------------------------------------------------------------------------------
# Names and shapes: the family's rule table (models/arch/)
# ---------------------------------------------------------------------------------------------
def layer_rules(cfg: ModelConfig) -> tuple[Rule, ...]:
    """The rules of one decoder layer of this config's family, in HF checkpoint order."""
    return architecture(cfg.architecture).layer_rules(cfg)


def hf_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every HF tensor name of a model with this config, in checkpoint order, with its shape."""
    shapes: dict[str, tuple[int, ...]] = {}
    for rule, layer in _global_items(cfg):
        shapes.update(zip(hf_names(rule, layer), rule.shapes(cfg)))
    return shapes


def hf_names(rule: Rule, layer: int | None = None) -> list[str]:
    return [n.format(i=layer) for n in rule.hf]


# ---------------------------------------------------------------------------------------------
# Layout: HF tensors <-> one full (TP-unsharded) Megatron tensor
# ---------------------------------------------------------------------------------------------
def to_megatron(rule: Rule, hf: list[Tensor], cfg: ModelConfig, padded_vocab: int | None = None) -> Tensor:
    """HF tensors of one rule -> the full Megatron tensor (vocab padded with zero rows to padded_vocab)."""
    if rule.kind == "qkv":
        q, k, v = hf
        g, d, rest = cfg.num_query_groups, cfg.head_dim, tuple(q.shape[1:])  # rest: (H,) or () for biases
        n = cfg.num_attention_heads // g
        grouped = [q.reshape(g, n * d, *rest), k.reshape(g, d, *rest), v.reshape(g, d, *rest)]
        return torch.cat(grouped, dim=1).reshape(-1, *rest)
    if rule.kind == "fc1":
        return torch.cat(hf, dim=0)
    if rule.kind == "vocab" and padded_vocab is not None and padded_vocab > hf[0].shape[0]:
        pad = hf[0].new_zeros(padded_vocab - hf[0].shape[0], hf[0].shape[1])
        return torch.cat([hf[0], pad], dim=0)
    return hf[0]


def from_megatron(rule: Rule, full: Tensor, cfg: ModelConfig) -> list[Tensor]:
    """The full Megatron tensor of one rule -> its HF tensors (vocab padding dropped)."""
    if rule.kind == "qkv":
        g, d, rest = cfg.num_query_groups, cfg.head_dim, tuple(full.shape[1:])
        n = cfg.num_attention_heads // g
        grouped = full.reshape(g, (n + 2) * d, *rest)
        q = grouped[:, : n * d].reshape(-1, *rest)
        k = grouped[:, n * d : (n + 1) * d].reshape(-1, *rest)
        v = grouped[:, (n + 1) * d :].reshape(-1, *rest)
        return [q.contiguous(), k.contiguous(), v.contiguous()]
    if rule.kind == "fc1":
        gate, up = full.chunk(2, dim=0)
        return [gate.contiguous(), up.contiguous()]
    if rule.kind == "vocab":
        return [full[: cfg.vocab_size].contiguous()]
    return [full]


def checkpoint_parts(rule: Rule, hf: list[Tensor], cfg: ModelConfig, padded_vocab: int | None = None) -> list[Tensor]:
    """HF tensors of one rule -> the tensors a dist checkpoint stores for it at TP = 1: linear_fc1 as
    its [gate, up] halves (megatron shards the two separately, so they need no concatenation), any
    other rule as to_megatron's full tensor."""
    if rule.kind == "fc1":
        return list(hf)
    return [to_megatron(rule, hf, cfg, padded_vocab)]


def hf_from_checkpoint_parts(rule: Rule, parts: list[Tensor], cfg: ModelConfig) -> list[Tensor]:
    """Inverse of checkpoint_parts: the HF tensors of one rule (vocab padding dropped), as views of
    the parts where possible. q, k and v come as [G, rows per group, H] (biases [G, rows]) strided views: their row-major
    element order is the HF tensor's (reshape(-1, H) would copy)."""
    if rule.kind == "fc1":
        return list(parts)
    if rule.kind == "qkv":
        g, d, rest = cfg.num_query_groups, cfg.head_dim, tuple(parts[0].shape[1:])
        n = cfg.num_attention_heads // g
        grouped = parts[0].view(g, (n + 2) * d, *rest)
        return [grouped[:, : n * d], grouped[:, n * d : (n + 1) * d], grouped[:, (n + 1) * d :]]
    return from_megatron(rule, parts[0], cfg)


# ---------------------------------------------------------------------------------------------
# TP split rules
# ---------------------------------------------------------------------------------------------
def tp_shard(rule: Rule, full: Tensor, tp_rank: int, tp_size: int) -> Tensor:
    """This TP rank's shard of a full Megatron tensor."""
    if rule.kind == "replicated" or tp_size == 1:
        return full
    if rule.kind == "fc1":
        gate, up = full.chunk(2, dim=0)
        return torch.cat([gate.chunk(tp_size, dim=0)[tp_rank], up.chunk(tp_size, dim=0)[tp_rank]], dim=0)
    dim = 1 if rule.kind == "row" else 0
    return full.chunk(tp_size, dim=dim)[tp_rank]


def tp_unshard(rule: Rule, shards: list[Tensor]) -> Tensor:
    """Full Megatron tensor from all TP shards (rank order)."""
    if rule.kind == "replicated" or len(shards) == 1:
        return shards[0]
    if rule.kind == "fc1":
        halves = [s.chunk(2, dim=0) for s in shards]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
    return torch.cat(shards, dim=1 if rule.kind == "row" else 0)


# ---------------------------------------------------------------------------------------------
# Model access
# ---------------------------------------------------------------------------------------------
def _unwrap(model):
    while hasattr(model, "module"):
        model = model.module
    return model


def _param(module, rule: Rule, local_expert: int | None = None):
    """The parameter a rule names inside ``module`` (local spec name, else the TE spec alias); an expert's rule
    as local expert ``local_expert`` of this EP rank (default: its global index, as at EP 1)."""
    params = dict(module.named_parameters())
    name = rule.megatron_name(local_expert)
    if name in params:
        return params[name]
    if rule.te_alias and rule.te_alias in params:
        return params[rule.te_alias]
    raise KeyError(f"hf_map: parameter '{name}' not found in {type(module).__name__}")


def experts_here(cfg: ModelConfig) -> range:
    """The global indices of the experts this EP rank holds (all of them for a dense model's empty range)."""
    if cfg.moe is None:
        return range(0)
    from megatron.core import parallel_state as ps

    n_local = cfg.moe.num_experts // ps.get_expert_model_parallel_world_size()
    start = ps.get_expert_model_parallel_rank() * n_local
    return range(start, start + n_local)


def local_entries(model_chunks) -> Iterator[tuple[Rule, int | None, torch.nn.Parameter]]:
    """(rule, global layer index or None, this rank's parameter) for every mapped parameter here (an expert's
    only on the EP rank that holds it). The rules are those of the family each chunk was built for
    (``builders`` records its ModelConfig)."""
    for chunk in model_chunks:
        model = _unwrap(chunk)
        rules = layer_rules(model.model_cfg)
        experts = experts_here(model.model_cfg)
        if model.pre_process:
            yield EMBED_RULE, None, _param(model, EMBED_RULE)
        for layer in model.decoder.layers:
            for rule in rules:
                if rule.expert is None:
                    yield rule, layer.layer_number - 1, _param(layer, rule)
                elif rule.expert in experts:
                    yield rule, layer.layer_number - 1, _param(layer, rule, rule.expert - experts.start)
        if model.post_process:
            yield FINAL_NORM_RULE, None, _param(model, FINAL_NORM_RULE)
            head = getattr(model, "output_layer", None)
            if head is not None and not model.share_embeddings_and_output_weights:
                yield LM_HEAD_RULE, None, _param(model, LM_HEAD_RULE)
            elif head is not None and not model.pre_process:
                # Tied embeddings under PP: the last stage keeps its own copy of the embedding as the
                # LM head (megatron syncs the two only at construction), so it loads embed_tokens too.
                yield EMBED_RULE, None, head.weight


@torch.no_grad()
def load_hf_into_model(
    model_chunks, cfg: ModelConfig, get_tensor: Callable[[str], Tensor], *, assign: bool = False
) -> None:
    """Copy HF tensors into this rank's shards. ``get_tensor(hf_name)`` returns the full HF tensor.

    Every rank reads only the tensors it holds (no communication). ``assign=True`` (TP=1 only, before
    any DDP wrapping or optimizer exists) makes the converted tensor the parameter's storage instead of
    copying it: one memory pass less, used by offline conversion.
    """
    from megatron.core import parallel_state

    dense = (parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_tensor_model_parallel_world_size())
    expert = dense if cfg.moe is None else (parallel_state.get_expert_tensor_parallel_rank(),
                                            parallel_state.get_expert_tensor_parallel_world_size())
    for rule, layer, param in local_entries(model_chunks):
        tp_rank, tp_size = dense if rule.expert is None else expert
        hf = [get_tensor(n) for n in hf_names(rule, layer)]
        padded = param.shape[0] * tp_size if rule.kind == "vocab" else None
        shard = tp_shard(rule, to_megatron(rule, hf, cfg, padded), tp_rank, tp_size)
        if shard.shape != param.shape:
            raise ValueError(
                f"hf_map: {hf_names(rule, layer)[0]} maps to shape {tuple(shard.shape)} but "
                f"{rule.key()} is {tuple(param.shape)} on this rank"
            )
        if assign and tp_size == 1 and shard.dtype == param.dtype:
            param.data = shard.contiguous()
        else:
            param.copy_(shard.to(param.dtype))


# ---------------------------------------------------------------------------------------------
# Streaming gather to one rank (checkpoint export and live weight sync)
# ---------------------------------------------------------------------------------------------
def _global_items(cfg: ModelConfig) -> list[tuple[Rule, int | None]]:
    items: list[tuple[Rule, int | None]] = [(EMBED_RULE, None)]
    items += [(rule, i) for i in range(cfg.num_layers) for rule in layer_rules(cfg)]
    items.append((FINAL_NORM_RULE, None))
    if not cfg.tie_word_embeddings:
        items.append((LM_HEAD_RULE, None))
    return items


def _item_key(rule: Rule, layer: int | None) -> str:
    return rule.key() if layer is None else f"{layer}.{rule.key()}"


def iter_hf_tensors(
    model_chunks, cfg: ModelConfig, *, dst_rank: int = 0, grads: bool = False
) -> Iterator[tuple[str, Tensor]]:
    """Yield (HF name, full HF tensor) on global rank ``dst_rank``, one tensor at a time.

    A collective over the whole world: EVERY rank must exhaust the iterator (ranks other than
    ``dst_rank`` yield nothing). The owning pipeline stage's DP-rank-0 TP group all-gathers one
    parameter, its TP rank 0 converts it to HF layout (vocab padding dropped) and sends it to
    ``dst_rank``. Peak extra memory: one full parameter. Order: embeddings, layers 0..L-1, final
    norm, LM head. With ``grads=True`` the gradients (``main_grad`` if present, else ``.grad``) are
    gathered instead of the weights.
    """
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    # an expert's parameter is split over expert-TP and replicated over expert-DP (EP: other ranks hold other
    # experts); every other parameter over TP and DP
    dense = (ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_group(),
             ps.get_tensor_model_parallel_rank(), ps.get_data_parallel_rank(with_context_parallel=True) == 0)
    expert = dense if cfg.moe is None else (
        ps.get_expert_tensor_parallel_world_size(), ps.get_expert_tensor_parallel_group(),
        ps.get_expert_tensor_parallel_rank(), ps.get_expert_data_parallel_rank() == 0)
    entries = list(local_entries(model_chunks))
    mine = {_item_key(rule, layer): param for rule, layer, param in entries}
    groups = {_item_key(rule, layer): expert if rule.expert is not None else dense for rule, layer, _ in entries}
    # linears with LoRA adapters (models/lora.py) hand out W + s * B A: pushes and exports carry the policy
    from megatron_spo.models.lora import merged_weights

    merged = {} if grads else merged_weights(model_chunks)

    # Who sends each item: the global rank of TP rank 0 in the owning stage's DP-rank-0 group.
    sender = {}
    if world > 1:
        keys = [k for k in mine if groups[k][3] and groups[k][2] == 0]
        gathered: list = [None] * world
        dist.all_gather_object(gathered, keys)
        for r, ks in enumerate(gathered):
            for k in ks:
                sender.setdefault(k, r)

    for rule, layer in _global_items(cfg):
        key = _item_key(rule, layer)
        names = hf_names(rule, layer)
        src = sender.get(key, rank)
        hf: list[Tensor] | None = None
        if key in mine and groups[key][3]:
            tp_size, tp_group = groups[key][:2]
            param = mine[key]
            local = merged[key]() if key in merged else _param_value(param, grads)
            if tp_size > 1 and rule.kind != "replicated":
                shards = [torch.empty_like(local) for _ in range(tp_size)]
                dist.all_gather(shards, local.contiguous(), group=tp_group)
                full = tp_unshard(rule, shards)
            else:
                full = local
            if rank == src:
                hf = from_megatron(rule, full, cfg)
        if rank == dst_rank:
            if hf is None:  # owned by another stage: receive in HF layout
                shapes = hf_shapes(cfg)
                dtype, device = _recv_spec(mine, grads)
                hf = [torch.empty(shapes[n], dtype=dtype, device=device) for n in names]
                for t in hf:
                    dist.recv(t, src=src)
            for n, t in zip(names, hf):
                yield n, t.detach()
        elif rank == src and hf is not None:
            for t in hf:
                dist.send(t.detach().contiguous(), dst=dst_rank)


def gather_hf_tensors(model_chunks, cfg: ModelConfig, consume: Callable | None = None, *, dst_rank: int = 0):
    """Collective, THE way to hand the policy's HF tensors to someone: every rank runs the gather
    (iter_hf_tensors); on ``dst_rank`` ``consume(iterator)`` (a weight push, an HF export) uses them, and its
    result is returned. Whatever ``consume`` leaves unread, by returning early or raising, is drained here so
    the other ranks' collectives complete. Ranks other than dst_rank pass consume=None and get None."""
    tensors = iter_hf_tensors(model_chunks, cfg, dst_rank=dst_rank)
    try:
        return consume(tensors) if consume is not None else None
    finally:
        for _ in tensors:
            pass


def _param_value(param: torch.nn.Parameter, grads: bool) -> Tensor:
    if not grads:
        return param.detach()
    grad = getattr(param, "main_grad", None)
    if grad is None:
        grad = param.grad
    if grad is None:
        return torch.zeros_like(param)
    return grad.detach()


def _recv_spec(mine: dict, grads: bool) -> tuple[torch.dtype, torch.device]:
    """dtype/device of tensors sent by other stages: the same as this rank's (all stages share params_dtype)."""
    any_param = next(iter(mine.values()))
    value = _param_value(any_param, grads)
    return value.dtype, value.device
