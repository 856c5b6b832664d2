"""LoRA adapters on the policy's linear layers (issue 46): config, the tensor-parallel adapter layers, the switch
that turns them off (pi_0 without a reference model), their full tensors, and the base model's identity (their HF PEFT
export: models/peft_export.py).

    policy = builders.build_policy(model_cfg, parallel_cfg, lora=LoraConfig(rank=16), lora_seed=cfg.seed)
    with adapters_off(policy):               # the frozen base: pi_0, bitwise the separately built reference
        ...
    full = gather_adapters(policy)           # rank 0: {"decoder.layers.{i}.<target path>.lora_A": [r, in], ...}

A linear of the decoder layer y = W x becomes y = W x + s * B A dropout(x), s = alpha / rank (rsLoRA: alpha /
sqrt(rank)); A [r, in] starts Kaiming-uniform (PEFT's default), B [out, r] at zero, so the initial policy IS the base.
Everything else (embeddings, norms, LM head, the base linears) is frozen: requires_grad False, so megatron's DDP and
optimizer hold the adapters only.

Tensor-parallel layouts keep the base layer's split:
  column-parallel base (linear_qkv, linear_fc1; W split on its output rows):
      A replicated [r, in] (full input), B split like W's rows [out / T, r]; the adapter's hidden A x is identical on
      every rank, and its gradient is all-reduced (copy_to_tensor_model_parallel_region) so A's gradient is complete
      and equal on every rank. linear_fc1's B rows are [gate_r; up_r] like W's (checkpointed with megatron's swiglu
      factory, so a checkpoint reshards).
  row-parallel base (linear_proj, linear_fc2; W split on its input columns, the input already split):
      A split like W's columns [r, in / T], its partial product all-reduced (reduce_from_tensor_model_parallel_region)
      before B, which is replicated [out, r].
Replicated factors carry no tensor_model_parallel attribute, so megatron's grad norm counts them once.

Under sequence parallelism (the layer's input a share of the sequence on each TP rank) the column adapter gathers
A x over the sequence (r wide, cheaper than gathering x) and the row adapter reduce-scatters A x to sequence shards,
as the base does its output; the replicated factor (column A, row B) then sees one share of the tokens, so it is marked
``sequence_parallel`` and megatron-core sums its gradient over TP (as it does the norms').

Not here: Transformer Engine's spec (its linear_qkv / linear_fc1 fuse the input norm,
so the adapter's input would need TE's return_layernorm_output: a LoRA policy builds the local spec, on a GPU too),
folding adapters into the base (reference refresh is refused with LoRA).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Literal

import torch
import torch.nn.functional as F
from pydantic import Field, field_validator

from megatron_spo.config import StrictModel

# the decoder layer's linears an adapter can sit on, and where each is in a layer
TARGETS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
TARGET_PATHS = {"linear_qkv": "self_attention.linear_qkv", "linear_proj": "self_attention.linear_proj",
                "linear_fc1": "mlp.linear_fc1", "linear_fc2": "mlp.linear_fc2"}
COLUMN_TARGETS = ("linear_qkv", "linear_fc1")  # column-parallel bases; the others are row-parallel
ADAPTER_PARAMS = ("lora_A", "lora_B")
BASE_IDENTITY_FILE = "lora_base.json"


class LoraConfig(StrictModel):
    """LoRA on the policy: the base model frozen, low-rank adapters on the named linears of every decoder layer."""

    rank: int = Field(8, gt=0, description="r: the adapters' inner dimension")
    alpha: float = Field(16.0, gt=0, description="the adapters' output is scaled by alpha / rank (rslora: alpha / "
                         "sqrt(rank))")
    dropout: float = Field(0.0, ge=0, lt=1, description="dropout on the adapters' input while the policy trains (the "
                           "base's input is untouched)")
    rslora: bool = Field(False, description="rank-stabilised scaling alpha / sqrt(rank)")
    targets: list[str] = Field(default_factory=lambda: list(TARGETS),
                               description=f"the linears that get adapters: a subset of {', '.join(TARGETS)}")
    push: Literal["auto", "adapter", "merged"] = Field(
        "auto", description="what a weight push sends the rollout engines: adapter (the adapters alone, to engines "
        "started with --enable-lora: rollout/adapter_push.py), merged (full weights W + s B A, to any engine), auto "
        "(adapter when every engine was started with --enable-lora, else merged)")
    transport: Literal["auto", "tensors", "path"] = Field(
        "auto", description="how an adapter push reaches the engines: tensors (a base64 copy per engine GPU in the "
        "HTTP body, /load_lora_adapter_from_tensors, all from trainer rank 0), path (rank 0 writes the PEFT adapter "
        "once under lora.push_dir, a directory every engine can read, and each engine loads it with "
        "/load_lora_adapter), auto (tensors; slurm/spo.sbatch sets path, its run directory being shared)")
    push_dir: str | None = Field(
        None, description="lora.transport=path: the directory shared by the trainer and every engine where adapter "
        "pushes are written (one subdirectory per push, removed once the engines unloaded it); default "
        "<run_dir>/lora_push")

    @field_validator("targets")
    @classmethod
    def _known_targets(cls, targets: list[str]) -> list[str]:
        unknown = [t for t in targets if t not in TARGETS]
        if unknown:
            raise ValueError(f"unknown target {unknown[0]!r} (choose from {', '.join(TARGETS)})")
        if not targets:
            raise ValueError(f"name at least one target ({', '.join(TARGETS)})")
        if len(set(targets)) != len(targets):
            raise ValueError(f"a target is listed twice: {targets}")
        return targets

    @property
    def scaling(self) -> float:
        return self.alpha / math.sqrt(self.rank) if self.rslora else self.alpha / self.rank


# ---------------------------------------------------------------------------------------------
# The adapter layers
# ---------------------------------------------------------------------------------------------
class _Adapter:
    """What the column- and row-parallel adapter layers share (mixed into megatron's linear classes)."""

    lora_A: torch.nn.Parameter
    lora_B: torch.nn.Parameter
    adapters_on: bool = True
    column: bool

    def _init_adapter(self, lora: LoraConfig, target: str, a_shape: tuple[int, int], b_shape: tuple[int, int]):
        from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

        cfg = self.config
        device = torch.device("cpu") if cfg.use_cpu_initialization else torch.device("cuda", torch.cuda.current_device())
        self.target, self.lora_rank, self.lora_dropout = target, lora.rank, lora.dropout
        self.lora_scaling = lora.scaling
        # A is set by init_adapters (from the full tensor, so every layout starts alike); B stays zero
        self.lora_A = torch.nn.Parameter(torch.zeros(a_shape, dtype=cfg.params_dtype, device=device))
        self.lora_B = torch.nn.Parameter(torch.zeros(b_shape, dtype=cfg.params_dtype, device=device))
        split = self.lora_B if self.column else self.lora_A
        set_tensor_model_parallel_attributes(split, True, 0 if self.column else 1, 1)
        if cfg.sequence_parallel:  # the replicated factor sees this rank's share of the sequence: summed over TP
            (self.lora_A if self.column else self.lora_B).sequence_parallel = True

    def _adapter_input(self, x: torch.Tensor) -> torch.Tensor:
        if not (self.training and self.lora_dropout):
            return x
        sharded = not self.column or self.config.sequence_parallel  # a shard of the input (of features or tokens)
        if sharded and x.is_cuda:  # each TP rank its own mask (megatron's TP RNG)
            from megatron.core.tensor_parallel import get_cuda_rng_tracker

            with get_cuda_rng_tracker().fork():
                return F.dropout(x, self.lora_dropout, training=True)
        return F.dropout(x, self.lora_dropout, training=True)

    @torch.no_grad()
    def merged_weight(self) -> torch.Tensor:
        """This rank's shard of W + s * B A (the base's dtype; the adapters off: W)."""
        w = self.weight.detach()
        if not self.adapters_on:
            return w
        delta = self.lora_B.float() @ self.lora_A.float()
        return (w.float() + self.lora_scaling * delta).to(w.dtype)


_CLASSES: tuple | None = None


def adapter_classes():
    """(LoraColumnParallelLinear, LoraRowParallelLinear), made on first use (megatron imported then)."""
    global _CLASSES
    if _CLASSES is not None:
        return _CLASSES
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.tensor_parallel.mappings import (
        copy_to_tensor_model_parallel_region,
        gather_from_sequence_parallel_region,
        gather_from_tensor_model_parallel_region,
        reduce_from_tensor_model_parallel_region,
        reduce_scatter_to_sequence_parallel_region,
    )
    from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

    class LoraColumnParallelLinear(_Adapter, ColumnParallelLinear):
        """ColumnParallelLinear + LoRA: A replicated [r, in], B split like the output rows [out / T, r]."""

        column = True

        def __init__(self, input_size, output_size, *, lora: LoraConfig, target: str, **kwargs):
            super().__init__(input_size, output_size, **kwargs)
            self._init_adapter(lora, target, (lora.rank, self.input_size), (self.output_size_per_partition, lora.rank))

        def forward(self, input_, weight=None, runtime_gather_output=None):
            out, bias = super().forward(input_, weight, runtime_gather_output)
            if not self.adapters_on:
                return out, bias
            hidden = F.linear(self._adapter_input(input_), self.lora_A)
            if self.sequence_parallel:  # input_ is this rank's share of the sequence: gather A x (r wide, not in)
                hidden = gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=True,
                                                              group=self.tp_group)  # backward: reduce-scatter
            else:
                hidden = copy_to_tensor_model_parallel_region(hidden, group=self.tp_group)  # backward: all-reduce
            delta = F.linear(hidden, self.lora_B) * self.lora_scaling
            gather = self.gather_output if runtime_gather_output is None else runtime_gather_output
            if gather:
                delta = gather_from_tensor_model_parallel_region(delta, group=self.tp_group)
            return out + delta, bias

        def _base_sharded_state_dict(self, prefix, sharded_offsets, metadata):
            return make_sharded_tensors_for_checkpoint(
                self.state_dict(prefix="", keep_vars=True), prefix, {"weight": 0, "bias": 0, "lora_B": 0},
                sharded_offsets, tp_group=self.tp_group, dp_cp_group=metadata["dp_cp_group"])

        def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
            sd = self._base_sharded_state_dict(prefix, sharded_offsets, metadata)
            if self.target == "linear_fc1" and self.config.gated_linear_unit:
                from megatron.core.transformer.mlp import apply_swiglu_sharded_factory

                key = f"{prefix}lora_B"  # rows [gate_r; up_r], like the base's: resharded as gate and up
                sd[key] = apply_swiglu_sharded_factory(sd[key], sharded_offsets,
                                                       (metadata or {}).get("singleton_local_shards", False))
            return sd

    class LoraRowParallelLinear(_Adapter, RowParallelLinear):
        """RowParallelLinear + LoRA: A split like the input columns [r, in / T], its product all-reduced; B
        replicated [out, r]."""

        column = False

        def __init__(self, input_size, output_size, *, lora: LoraConfig, target: str, **kwargs):
            super().__init__(input_size, output_size, **kwargs)
            self._init_adapter(lora, target, (lora.rank, self.input_size_per_partition), (self.output_size, lora.rank))

        def forward(self, input_):
            out, bias = super().forward(input_)
            if not self.adapters_on:
                return out, bias
            x = input_ if self.input_is_parallel else None
            if x is None:
                from megatron.core.tensor_parallel.mappings import scatter_to_tensor_model_parallel_region

                x = scatter_to_tensor_model_parallel_region(input_, group=self.tp_group)
            hidden = F.linear(self._adapter_input(x), self.lora_A)
            if self.sequence_parallel:  # the base's output is reduce-scattered to sequence shards: so is A x
                hidden = reduce_scatter_to_sequence_parallel_region(hidden, group=self.tp_group)
            else:
                hidden = reduce_from_tensor_model_parallel_region(hidden, group=self.tp_group)  # the partial products
            return out + F.linear(hidden, self.lora_B) * self.lora_scaling, bias

        def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
            return make_sharded_tensors_for_checkpoint(
                self.state_dict(prefix="", keep_vars=True), prefix, {"weight": 1, "lora_A": 1},
                sharded_offsets, tp_group=self.tp_group, dp_cp_group=metadata["dp_cp_group"])

    _CLASSES = (LoraColumnParallelLinear, LoraRowParallelLinear)
    return _CLASSES


def apply_to_spec(spec, lora: LoraConfig) -> None:
    """Put the adapter layers into a local layer spec's target slots (in place)."""
    from megatron.core.transformer.spec_utils import ModuleSpec

    column, row = adapter_classes()
    attention, mlp = spec.submodules.self_attention.submodules, spec.submodules.mlp.submodules
    slots = {"linear_qkv": attention, "linear_proj": attention, "linear_fc1": mlp, "linear_fc2": mlp}
    for target in lora.targets:
        cls = column if target in COLUMN_TARGETS else row
        setattr(slots[target], target, ModuleSpec(module=cls, params={"lora": lora, "target": target}))


# ---------------------------------------------------------------------------------------------
# Model-level helpers
# ---------------------------------------------------------------------------------------------
def _unwrap(model):
    while hasattr(model, "module"):
        model = model.module
    return model


def adapter_layers(chunks) -> Iterator[tuple[int, str, _Adapter]]:
    """(global layer index, target, adapter layer) of every adapter in the chunks."""
    for chunk in chunks:
        for layer in _unwrap(chunk).decoder.layers:
            for target, path in TARGET_PATHS.items():
                try:
                    module = layer.get_submodule(path)
                except AttributeError:  # a mixture-of-experts layer has no mlp.linear_fc1 (and no adapters)
                    continue
                if isinstance(module, _Adapter):
                    yield layer.layer_number - 1, target, module


def is_adapter_param(name: str) -> bool:
    return name.rsplit(".", 1)[-1] in ADAPTER_PARAMS


def freeze_base(chunks) -> None:
    """requires_grad only on the adapters."""
    for chunk in chunks:
        for name, param in chunk.named_parameters():
            param.requires_grad_(is_adapter_param(name))


@torch.no_grad()
def init_adapters(chunks, seed: int) -> None:
    """A from Kaiming-uniform (a = sqrt(5), PEFT's default) of the FULL [r, in] tensor drawn from a generator seeded
    by (seed, layer, target), then this rank's slice; B zero. So every TP / PP layout starts from the same adapters."""
    from megatron.core import parallel_state

    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    tp_size = parallel_state.get_tensor_model_parallel_world_size()
    for layer, target, module in adapter_layers(chunks):
        generator = torch.Generator().manual_seed(seed * 1_000_003 + layer * len(TARGETS) + TARGETS.index(target))
        in_full = module.lora_A.shape[1] * (1 if module.column else tp_size)
        full = torch.empty(module.lora_rank, in_full)
        torch.nn.init.kaiming_uniform_(full, a=math.sqrt(5), generator=generator)
        shard = full if module.column else full.chunk(tp_size, dim=1)[tp_rank]
        module.lora_A.copy_(shard)
        module.lora_B.zero_()


@contextlib.contextmanager
def adapters_off(chunks):
    """Inside, the chunks compute the frozen base model: pi_0."""
    layers = [module for _, _, module in adapter_layers(chunks)]
    before = [m.adapters_on for m in layers]
    for m in layers:
        m.adapters_on = False
    try:
        yield
    finally:
        for m, on in zip(layers, before):
            m.adapters_on = on


def count_parameters(chunks) -> dict[str, int]:
    """This rank's parameters: {"trainable": ..., "frozen": ...}."""
    out = {"trainable": 0, "frozen": 0}
    for chunk in chunks:
        for param in chunk.parameters():
            out["trainable" if param.requires_grad else "frozen"] += param.numel()
    return out


def merged_weights(chunks) -> dict:
    """{hf_map item key "layer.<target path>.weight": a function giving this rank's shard of W + s * B A}."""
    return {f"{layer}.{TARGET_PATHS[target]}.weight": module.merged_weight
            for layer, target, module in adapter_layers(chunks)}


def adapter_key(layer: int, target: str, factor: str) -> str:
    return f"decoder.layers.{layer}.{TARGET_PATHS[target]}.{factor}"


def gather_adapters(chunks, dst_rank: int = 0) -> dict[str, torch.Tensor] | None:
    """Collective: every adapter's full (TP-unsharded) factor, fp32 on the CPU, on dst_rank ({adapter_key: tensor});
    None elsewhere. Small (r x hidden per factor), so each rank of the first data-parallel replica sends its
    shards in one gather_object."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    local: dict[str, torch.Tensor] = {}
    if ps.get_data_parallel_rank(with_context_parallel=True) == 0:
        for layer, target, module in adapter_layers(chunks):
            for factor in ADAPTER_PARAMS:
                local[adapter_key(layer, target, factor)] = getattr(module, factor).detach().float().cpu()
    tp_rank = ps.get_tensor_model_parallel_rank()
    if not dist.is_initialized() or dist.get_world_size() == 1:
        parts = [(tp_rank, local)]
    else:
        gathered = [None] * dist.get_world_size() if dist.get_rank() == dst_rank else None
        dist.gather_object((tp_rank, local), gathered, dst=dst_rank)
        if dist.get_rank() != dst_rank:
            return None
        parts = gathered
    shards: dict[str, dict[int, torch.Tensor]] = {}
    for rank, tensors in parts:
        for key, tensor in tensors.items():
            shards.setdefault(key, {})[rank] = tensor
    return {key: _unshard(key, [by_rank[r] for r in sorted(by_rank)]) for key, by_rank in sorted(shards.items())}


def split_of(key: str) -> tuple[str, bool]:
    """(target, whether this factor is split over TP) of an adapter key."""
    target = next(t for t in TARGETS if f".{TARGET_PATHS[t]}." in key)
    return target, (target in COLUMN_TARGETS) != (key.rsplit(".", 1)[-1] == "lora_A")


def _shard(key: str, full: torch.Tensor, tp_rank: int, tp_size: int) -> torch.Tensor:
    """This TP rank's slice of an adapter factor's full tensor (inverse of _unshard)."""
    target, split = split_of(key)
    if not split or tp_size == 1:
        return full
    if target == "linear_fc1":
        gate, up = full.chunk(2, dim=0)
        return torch.cat([gate.chunk(tp_size, dim=0)[tp_rank], up.chunk(tp_size, dim=0)[tp_rank]], dim=0)
    return full.chunk(tp_size, dim=0 if key.endswith("lora_B") else 1)[tp_rank]


@torch.no_grad()
def load_adapters(chunks, tensors: dict[str, torch.Tensor]) -> None:
    """Set this rank's adapter shards from full tensors keyed as gather_adapters gives them (every rank passes
    all of them; no communication). A key the chunks hold and ``tensors`` lacks is an error naming it."""
    from megatron.core import parallel_state

    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    tp_size = parallel_state.get_tensor_model_parallel_world_size()
    for layer, target, module in adapter_layers(chunks):
        for factor in ADAPTER_PARAMS:
            key = adapter_key(layer, target, factor)
            if key not in tensors:
                raise KeyError(f"lora: no tensor for adapter {key}")
            param = getattr(module, factor)
            shard = _shard(key, tensors[key], tp_rank, tp_size)
            if shard.shape != param.shape:
                raise ValueError(f"lora: {key} has shape {tuple(tensors[key].shape)}, which does not fit "
                                 f"{tuple(param.shape)} on TP rank {tp_rank} of {tp_size}")
            param.copy_(shard)


def _unshard(key: str, shards: list[torch.Tensor]) -> torch.Tensor:
    target, split = split_of(key)
    factor = key.rsplit(".", 1)[-1]
    if len(shards) == 1 or not split:
        return shards[0]  # replicated
    if target == "linear_fc1":  # [gate_r; up_r] per rank -> [gate; up]
        halves = [s.chunk(2, dim=0) for s in shards]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
    return torch.cat(shards, dim=0 if factor == "lora_B" else 1)


# ---------------------------------------------------------------------------------------------
# The base model's identity (checkpoints of adapters name the base they belong to)
# ---------------------------------------------------------------------------------------------
SAMPLE_BYTES = 64  # of each tensor's data: a fine-tune of the same architecture differs there


def base_identity(hf: str | None, megatron: str | None) -> dict:
    """{"path": ..., "digest": sha256 hex} of the init model. HF: config.json, every safetensors header (names,
    dtypes, shapes, offsets) and the first SAMPLE_BYTES of each tensor; a megatron checkpoint: its digest manifest
    (every file's size and CRC-32) or, without one, its metadata and file sizes. Reads kilobytes, not the weights."""
    h = hashlib.sha256()
    path = Path(megatron or hf)
    if megatron:
        manifest = path / "digests.json"
        if manifest.is_file():
            h.update(manifest.read_bytes())
        else:
            for f in sorted(p for p in path.iterdir() if p.is_file()):
                h.update(f"{f.name}:{f.stat().st_size}\n".encode())
            h.update((path / "metadata.json").read_bytes())
    else:
        h.update((path / "config.json").read_bytes())
        for f in sorted(path.glob("*.safetensors")):
            with open(f, "rb") as fh:
                (n,) = struct.unpack("<Q", fh.read(8))
                header = fh.read(n)
                h.update(f.name.encode() + header)
                for name, meta in sorted(json.loads(header).items()):
                    if name == "__metadata__":
                        continue
                    fh.seek(8 + n + meta["data_offsets"][0])
                    h.update(fh.read(min(SAMPLE_BYTES, meta["data_offsets"][1] - meta["data_offsets"][0])))
    return {"path": str(path), "digest": h.hexdigest()}
