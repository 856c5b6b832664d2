"""THE Hugging Face <-> Megatron map for Llama: names, layouts, TP split rules, vocab padding.

One module serves checkpoint conversion (``convert.py``) and live weight sync (the rollout
WeightBroadcaster consumes ``iter_hf_tensors``). Layouts, per decoder layer (H hidden, d head_dim,
G KV groups, n = heads / G query heads per group, F ffn):

  HF q_proj [n*G*d, H], k_proj [G*d, H], v_proj [G*d, H]
      <-> linear_qkv [G*(n+2)*d, H], interleaved per KV group: [q_g (n*d); k_g (d); v_g (d)] for g = 0..G-1
  HF gate_proj [F, H], up_proj [F, H]  <-> linear_fc1 [2F, H] = cat[gate, up]
  HF o_proj / down_proj                <-> linear_proj / linear_fc2 (same layout)
  HF embed_tokens / lm_head [V, H]     <-> word_embeddings / output_layer [V_pad, H] (zero rows appended)

TP split rules (rank r of T): qkv, fc1, embedding, output layer split dim 0; linear_proj and fc2 split
dim 1; norms are replicated. qkv splits contiguously (whole KV groups per rank: the interleaved layout
is what makes that right); fc1 splits gate and up separately (shard r = cat[gate_r, up_r]); the vocab
splits the PADDED rows contiguously.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import Tensor

from megatron_spo.config import ModelConfig

# ---------------------------------------------------------------------------------------------
# Names
# ---------------------------------------------------------------------------------------------
EMBED = "model.embed_tokens.weight"
FINAL_NORM = "model.norm.weight"
LM_HEAD = "lm_head.weight"


@dataclass(frozen=True)
class Rule:
    """One Megatron parameter and the HF tensors it is made of."""

    megatron: str  # name inside a layer (layer rules) or inside the GPTModel (model rules)
    hf: tuple[str, ...]  # HF names; '{i}' is the global layer index
    kind: str  # "replicated" | "qkv" | "fc1" | "row" (TP dim 1) | "vocab" (TP dim 0, padded)
    te_alias: str | None = None  # name in the Transformer Engine spec (norms fused into linears)


LAYER_RULES: tuple[Rule, ...] = (
    Rule(
        "input_layernorm.weight",
        ("model.layers.{i}.input_layernorm.weight",),
        "replicated",
        te_alias="self_attention.linear_qkv.layer_norm_weight",
    ),
    Rule(
        "self_attention.linear_qkv.weight",
        (
            "model.layers.{i}.self_attn.q_proj.weight",
            "model.layers.{i}.self_attn.k_proj.weight",
            "model.layers.{i}.self_attn.v_proj.weight",
        ),
        "qkv",
    ),
    Rule("self_attention.linear_proj.weight", ("model.layers.{i}.self_attn.o_proj.weight",), "row"),
    Rule(
        "pre_mlp_layernorm.weight",
        ("model.layers.{i}.post_attention_layernorm.weight",),
        "replicated",
        te_alias="mlp.linear_fc1.layer_norm_weight",
    ),
    Rule(
        "mlp.linear_fc1.weight",
        ("model.layers.{i}.mlp.gate_proj.weight", "model.layers.{i}.mlp.up_proj.weight"),
        "fc1",
    ),
    Rule("mlp.linear_fc2.weight", ("model.layers.{i}.mlp.down_proj.weight",), "row"),
)
EMBED_RULE = Rule("embedding.word_embeddings.weight", (EMBED,), "vocab")
FINAL_NORM_RULE = Rule("decoder.final_layernorm.weight", (FINAL_NORM,), "replicated")
LM_HEAD_RULE = Rule("output_layer.weight", (LM_HEAD,), "vocab")


def hf_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every HF tensor name of a Llama with this config, in checkpoint order, with its shape."""
    h, f, d = cfg.hidden_size, cfg.ffn_hidden_size, cfg.head_dim
    q_rows, kv_rows = cfg.num_attention_heads * d, cfg.num_query_groups * d
    shapes: dict[str, tuple[int, ...]] = {EMBED: (cfg.vocab_size, h)}
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (h,)
        shapes[p + "self_attn.q_proj.weight"] = (q_rows, h)
        shapes[p + "self_attn.k_proj.weight"] = (kv_rows, h)
        shapes[p + "self_attn.v_proj.weight"] = (kv_rows, h)
        shapes[p + "self_attn.o_proj.weight"] = (h, q_rows)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
        shapes[p + "mlp.gate_proj.weight"] = (f, h)
        shapes[p + "mlp.up_proj.weight"] = (f, h)
        shapes[p + "mlp.down_proj.weight"] = (h, f)
    shapes[FINAL_NORM] = (h,)
    if not cfg.tie_word_embeddings:
        shapes[LM_HEAD] = (cfg.vocab_size, h)
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
        g, d, h = cfg.num_query_groups, cfg.head_dim, cfg.hidden_size
        n = cfg.num_attention_heads // g
        return torch.cat([q.reshape(g, n * d, h), k.reshape(g, d, h), v.reshape(g, d, h)], dim=1).reshape(
            -1, h
        )
    if rule.kind == "fc1":
        return torch.cat(hf, dim=0)
    if rule.kind == "vocab" and padded_vocab is not None and padded_vocab > hf[0].shape[0]:
        pad = hf[0].new_zeros(padded_vocab - hf[0].shape[0], hf[0].shape[1])
        return torch.cat([hf[0], pad], dim=0)
    return hf[0]


def from_megatron(rule: Rule, full: Tensor, cfg: ModelConfig) -> list[Tensor]:
    """The full Megatron tensor of one rule -> its HF tensors (vocab padding dropped)."""
    if rule.kind == "qkv":
        g, d, h = cfg.num_query_groups, cfg.head_dim, cfg.hidden_size
        n = cfg.num_attention_heads // g
        grouped = full.reshape(g, (n + 2) * d, h)
        q = grouped[:, : n * d].reshape(-1, h)
        k = grouped[:, n * d : (n + 1) * d].reshape(-1, h)
        v = grouped[:, (n + 1) * d :].reshape(-1, h)
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
    the parts where possible. q, k and v come as [G, rows per group, H] strided views: their row-major
    element order is the HF tensor's (reshape(-1, H) would copy)."""
    if rule.kind == "fc1":
        return list(parts)
    if rule.kind == "qkv":
        g, d, h = cfg.num_query_groups, cfg.head_dim, cfg.hidden_size
        n = cfg.num_attention_heads // g
        grouped = parts[0].view(g, (n + 2) * d, h)
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


def _param(module, rule: Rule):
    """The parameter a rule names inside ``module`` (local spec name, else the TE spec alias)."""
    params = dict(module.named_parameters())
    if rule.megatron in params:
        return params[rule.megatron]
    if rule.te_alias and rule.te_alias in params:
        return params[rule.te_alias]
    raise KeyError(f"hf_map: parameter '{rule.megatron}' not found in {type(module).__name__}")


def local_entries(model_chunks) -> Iterator[tuple[Rule, int | None, torch.nn.Parameter]]:
    """(rule, global layer index or None, this rank's parameter) for every mapped parameter here."""
    for chunk in model_chunks:
        model = _unwrap(chunk)
        if model.pre_process:
            yield EMBED_RULE, None, _param(model, EMBED_RULE)
        for layer in model.decoder.layers:
            for rule in LAYER_RULES:
                yield rule, layer.layer_number - 1, _param(layer, rule)
        if model.post_process:
            yield FINAL_NORM_RULE, None, _param(model, FINAL_NORM_RULE)
            if (
                not model.share_embeddings_and_output_weights
                and getattr(model, "output_layer", None) is not None
            ):
                yield LM_HEAD_RULE, None, _param(model, LM_HEAD_RULE)


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

    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    tp_size = parallel_state.get_tensor_model_parallel_world_size()
    for rule, layer, param in local_entries(model_chunks):
        hf = [get_tensor(n) for n in hf_names(rule, layer)]
        padded = param.shape[0] * tp_size if rule.kind == "vocab" else None
        shard = tp_shard(rule, to_megatron(rule, hf, cfg, padded), tp_rank, tp_size)
        if shard.shape != param.shape:
            raise ValueError(
                f"hf_map: {hf_names(rule, layer)[0]} maps to shape {tuple(shard.shape)} but "
                f"{rule.megatron} is {tuple(param.shape)} on this rank"
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
    items += [(rule, i) for i in range(cfg.num_layers) for rule in LAYER_RULES]
    items.append((FINAL_NORM_RULE, None))
    if not cfg.tie_word_embeddings:
        items.append((LM_HEAD_RULE, None))
    return items


def _item_key(rule: Rule, layer: int | None) -> str:
    return rule.megatron if layer is None else f"{layer}.{rule.megatron}"


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
    tp_size = ps.get_tensor_model_parallel_world_size()
    tp_group = ps.get_tensor_model_parallel_group()
    is_sender_group = ps.get_data_parallel_rank(with_context_parallel=True) == 0
    mine = {_item_key(rule, layer): param for rule, layer, param in local_entries(model_chunks)}

    # Who sends each item: the global rank of TP rank 0 in the owning stage's DP-rank-0 group.
    sender = {}
    if world > 1:
        keys = list(mine) if is_sender_group and ps.get_tensor_model_parallel_rank() == 0 else []
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
        if key in mine and is_sender_group:
            param = mine[key]
            local = _param_value(param, grads)
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
