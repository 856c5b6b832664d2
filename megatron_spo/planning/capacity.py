"""Capacity plan (`megatron-spo plan`): per-GPU memory, weight-sync time and rollout throughput for a cluster.

    megatron-spo plan --preset llama3.1-70b                      # the 64 + 64 H100 layout, rich tables
    megatron-spo plan --preset llama3.1-8b --tp 2 seq_length=8192 --json   # CapacityConfig fields as overrides
    megatron-spo plan --validate-cpu                             # model vs a measured CPU training step

Memory model (bytes per GPU, worst pipeline stage), megatron-core mixed precision:
  weights       2 B/param (bf16), parameters of one TP x PP shard
  gradients     4 B/param (fp32 main-grad buffer, kept whole by the distributed optimizer too)
  optimizer     12 B/param (fp32 master copy + Adam m + v); / (DP x CP) with the distributed optimizer
  reference     2 B/param (bf16, no grads, same layout as the policy)
  activations   per layer per token (bf16 elements, flash attention: no s x s scores):
                  replicated over TP unless sequence parallel: 4h (input and output of both RMSNorms)
                  split over TP: Q h + K,V 2kv + attention output h + fc1 output 2f + SwiGLU output f
                x layers per stage x tokens per micro-batch x micro-batches in flight on stage 0
                (p for 1F1B, p(1 + (p-1)/(p v)) layers-worth with v virtual stages), plus one layer's
                backward working set. Recompute (shape.recompute; a training config's
                parallel.recompute_granularity): full keeps each recompute unit's input (h; uniform: one per
                recompute_num_layers layers, block: the first recompute_num_layers layers of each model chunk,
                the rest keep everything) plus the layers being recomputed; selective drops its
                recompute_modules' tensors (core_attn none: flash attention keeps no scores; mlp 3f; layernorm 2h)
  context par.  CP ranks share each micro-batch: a rank keeps 1/CP of its tokens' activations, plus each layer's
                all-gathered keys / values of the whole sequence in place of its own share (2kv x T (1 - 1/CP) more
                elements per layer); weights and gradients are replicated over CP as over DP; DP = world / (TP PP CP)
  log-prob      the fused log-prob op's backward workspace: one fp32 logits block (logprob_block_mb, at
                most micro-batch tokens / CP x V/TP x 4 B), its copy in the model dtype for the gradient GEMMs,
                and grad_hidden's fp32 accumulator (tokens / CP x h x 4 B)
  overhead      CUDA context, NCCL buffers, allocator fragmentation: a fixed allowance (assumed)
`megatron-spo validate` prices a training config with the same function as this plan's column of that config
(`config_memory`: its optimizer and recompute), so both give one figure.
Mixture of experts (model.moe; presets qwen3-30b-a3b, qwen3-235b-a22b): the experts' weights, gradients and reference
  copy are split over EP x expert-TP (= TP) x PP, and with the distributed optimizer their Adam state over the
  expert-data-parallel ranks DP x CP / EP; attention, norms, router and embeddings as a dense model's (TP x PP, state
  over DP x CP). Activations per token: attention and norms as above plus the router's fp32 logits and probabilities
  (2 x E) and, for each of the k dispatched copies (balanced routing), the expert input and fc2 output (2h, whole)
  and fc1 + SwiGLU outputs (3F / TP); a shared expert (Qwen2-MoE) is dense: its weights over TP x PP, replicated
  over EP, its fc1 + SwiGLU outputs 3Fs / TP (and its gate's output h) per token. FLOPs count the active parameters
  (all but each layer's E - k unrouted experts; the shared expert is active); a push sends every tensor, all
  L x E x 3 expert tensors included. The router's share of parameters and FLOPs is reported. The
  trainer itself refuses EP > 1 today (ParallelConfig.check_training).
The same accounting with the dtypes and saved tensors of a transformers Llama on CPU is checked against
the peak RSS of a real forward + backward + Adam step (`validate_on_cpu`, tests/test_capacity.py).

Weight sync: HF-named bf16 tensors broadcast in buckets; each engine GPU receives every byte through its
own NIC, so the floor is bytes / bandwidth (70B bf16 at 400 Gb/s: 2.8 s). The bucketed broadcast adds a
fixed cost per bucket (gather + HTTP update call + NCCL launch + engine copy-in): sequential buckets pay
n x latency + bytes / (efficiency x bandwidth); with double buffering the latency hides behind the
previous bucket's transfer when a bucket takes longer to send than its fixed cost.

LoRA (lora_rank > 0, adapters on every linear): the frozen base keeps its bf16 weights; gradients (4 B) and
optimizer state (12 B) are the adapters' (megatron's split: a column linear's A and a row linear's B replicated over
TP); no reference weights; the backward skips the base's weight gradients (4N + 2N for pi_0's forward with the
adapters off, instead of 6N + 2N). A push sends the adapters in HF PEFT names (q/k/v and gate/up each carry their
own copy of A), bf16, base64 in one HTTP body per engine with one copy per engine TP rank: trainer rank 0's NIC
sends worker_gpus copies (adapter_push.py).

Rollout throughput: trainer step time from model FLOPs (6N per token for forward + backward, +2N with full
recompute (selective: none counted), +2N reference forward, attention 6 L s h per token causal) at an assumed
achieved TFLOP/s per GPU; the engines must generate online_fraction x global_batch x response tokens per step in
that time.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal

from megatron_spo.cli import non_negative_int, positive_int
from megatron_spo.config import ConfigError, apply_overrides, build_config, read_yaml
from megatron_spo.models.config import ModelConfig, MoEConfig, ParallelConfig, RopeScaling
from megatron_spo.planning.config import CapacityConfig

GB = 1e9
EXAMPLES = Path(__file__).resolve().parents[2] / "examples"

# ---------------------------------------------------------------------------------------------
# Presets: published architectures (their HF config.json; examples/models/*.yaml win when present)
# ---------------------------------------------------------------------------------------------
_LLAMA31 = dict(vocab_size=128256, max_position_embeddings=131072, rope_theta=500000.0,
                rope_scaling=RopeScaling(), norm_epsilon=1e-5, params_dtype="bfloat16")
_QWEN25 = dict(architecture="qwen2", vocab_size=152064, max_position_embeddings=32768, rope_theta=1000000.0,
               norm_epsilon=1e-6, params_dtype="bfloat16")
_QWEN3 = dict(architecture="qwen3", vocab_size=151936, max_position_embeddings=40960, rope_theta=1000000.0,
              kv_channels=128, norm_epsilon=1e-6, params_dtype="bfloat16")
_QWEN3_MOE = dict(architecture="qwen3_moe", vocab_size=151936, max_position_embeddings=40960, rope_theta=1000000.0,
                  kv_channels=128, norm_epsilon=1e-6, params_dtype="bfloat16")
# 7-8B: TP 2 (one NVLink pair, no bubble); 32B: TP 8 inside one node (DP 8), as the 70B's TP but no PP.
_TP2 = ParallelConfig(tensor_model_parallel_size=2, sequence_parallel=True, use_distributed_optimizer=True)
_TP8 = ParallelConfig(tensor_model_parallel_size=8, sequence_parallel=True, use_distributed_optimizer=True)
BUILTIN_PRESETS: dict[str, tuple[ModelConfig, ParallelConfig]] = {
    "llama3.1-8b": (
        ModelConfig(num_layers=32, hidden_size=4096, ffn_hidden_size=14336, num_attention_heads=32,
                    num_query_groups=8, **_LLAMA31),
        ParallelConfig(tensor_model_parallel_size=2, pipeline_model_parallel_size=1, sequence_parallel=True,
                       use_distributed_optimizer=True),
    ),
    "llama3.1-70b": (
        ModelConfig(num_layers=80, hidden_size=8192, ffn_hidden_size=28672, num_attention_heads=64,
                    num_query_groups=8, **_LLAMA31),
        ParallelConfig(tensor_model_parallel_size=8, pipeline_model_parallel_size=2,
                       virtual_pipeline_model_parallel_size=4, sequence_parallel=True,
                       use_distributed_optimizer=True),
    ),
    "qwen2.5-7b": (ModelConfig(num_layers=28, hidden_size=3584, ffn_hidden_size=18944, num_attention_heads=28,
                               num_query_groups=4, **_QWEN25), _TP2),
    "qwen2.5-32b": (ModelConfig(num_layers=64, hidden_size=5120, ffn_hidden_size=27648, num_attention_heads=40,
                                num_query_groups=8, **_QWEN25), _TP8),
    "qwen3-8b": (ModelConfig(num_layers=36, hidden_size=4096, ffn_hidden_size=12288, num_attention_heads=32,
                             num_query_groups=8, **_QWEN3), _TP2),
    "qwen3-32b": (ModelConfig(num_layers=64, hidden_size=5120, ffn_hidden_size=25600, num_attention_heads=64,
                              num_query_groups=8, **_QWEN3), _TP8),
    # Qwen/Qwen3-30B-A3B config.json: 128 experts of 768, top-8, in all 48 layers. EP 8 inside a node, no TP (the
    # trainer needs sequence parallelism for MoE at TP > 1); experts' optimizer state over the 8 expert-DP ranks.
    "qwen3-30b-a3b": (ModelConfig(num_layers=48, hidden_size=2048, ffn_hidden_size=6144, num_attention_heads=32,
                                  num_query_groups=4, moe=MoEConfig(num_experts=128, router_topk=8, ffn_hidden_size=768),
                                  **_QWEN3_MOE),
                      ParallelConfig(expert_model_parallel_size=8, use_distributed_optimizer=True)),
    # Qwen/Qwen3-235B-A22B: 128 experts of 1536, top-8, 94 layers (= 2 x 47: PP 2 at most without uneven stages).
    # TP 4 + SP x PP 2 x EP 8 = 64 GPUs per expert replica: at 64 trainer GPUs no expert-DP sharding (does not fit
    # 80 GB); trainer_gpus=256 shards the experts' Adam state 4 ways.
    "qwen3-235b-a22b": (ModelConfig(num_layers=94, hidden_size=4096, ffn_hidden_size=12288, num_attention_heads=64,
                                    num_query_groups=4,
                                    moe=MoEConfig(num_experts=128, router_topk=8, ffn_hidden_size=1536), **_QWEN3_MOE),
                        ParallelConfig(tensor_model_parallel_size=4, pipeline_model_parallel_size=2,
                                       expert_model_parallel_size=8, sequence_parallel=True,
                                       use_distributed_optimizer=True)),
}


def load_preset(name: str) -> tuple[ModelConfig, ParallelConfig]:
    """(model, default parallel layout) of a preset: examples/models/NAME.yaml if present, else built in."""
    path = EXAMPLES / "models" / f"{name}.yaml"
    if path.is_file():
        data = read_yaml(path) or {}
        model = build_config(ModelConfig, data.get("model", {}), str(path))
        parallel = build_config(ParallelConfig, data.get("parallel", {}), str(path))
        return model, parallel
    if name not in BUILTIN_PRESETS:
        known = sorted(set(BUILTIN_PRESETS) | {p.stem for p in (EXAMPLES / "models").glob("*.yaml")})
        raise ConfigError(f"plan: unknown model preset '{name}' (known: {', '.join(known)})")
    return BUILTIN_PRESETS[name]


# ---------------------------------------------------------------------------------------------
# Memory
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Precision:
    """Bytes per parameter / activation element of one training recipe."""

    weight: float
    grad: float
    optimizer: float  # all optimizer state per parameter (master copy + moments)
    activation: float
    reference: float


MEGATRON_BF16 = Precision(weight=2, grad=4, optimizer=12, activation=2, reference=2)
TORCH_FP32_ADAM = Precision(weight=4, grad=4, optimizer=8, activation=4, reference=4)  # the CPU check


@dataclass
class MemoryBreakdown:
    """Bytes per GPU (worst pipeline stage)."""

    weights: float
    gradients: float
    optimizer: float
    activations: float
    reference: float
    value_model: float
    logprob_workspace: float
    overhead: float

    @property
    def total(self) -> float:
        return sum(asdict(self).values())

    def as_gb(self) -> dict[str, float]:
        return {**{k: v / GB for k, v in asdict(self).items()}, "total": self.total / GB}


stage_parameters = ModelConfig.stage_parameters  # (model, tp, pp): one GPU of the largest pipeline stage


@dataclass(frozen=True)
class StageParameters:
    """Parameters on one GPU of the largest pipeline stage, by how megatron-core shards them.

    dense: attention, norms, router, embedding / LM head: over TP x PP, replicated over DP (the whole model for a
    dense one). experts: routed experts' weights: over EP x expert-TP (= TP) x PP, replicated over the
    expert-data-parallel ranks (DP / EP)."""

    dense: int
    experts: int = 0

    @property
    def total(self) -> int:
        return self.dense + self.experts


def moe_stage_parameters(model: ModelConfig, tp: int = 1, pp: int = 1, ep: int = 1) -> StageParameters:
    """StageParameters of (model, TP, PP, EP); a dense model's are all dense. The router [E, H] is dense
    (replicated over TP and EP), and so is a shared expert (split over TP like a dense MLP, replicated over EP)."""
    whole = stage_parameters(model, tp, pp)
    if model.moe is None:
        return StageParameters(dense=whole)
    per_expert = 3 * model.hidden_size * model.moe.ffn_hidden_size  # gate, up [F, H], down [H, F]
    layers = math.ceil(model.num_layers / pp)
    all_experts = layers * model.moe.num_experts * per_expert // tp
    return StageParameters(dense=whole - all_experts, experts=layers * (model.moe.num_experts // ep) * per_expert // tp)


@dataclass(frozen=True)
class MoECounts:
    """Whole-model parameter counts of a mixture-of-experts model (HF names, unpadded vocabulary)."""

    total: int
    active: int  # what one token's forward touches: all but the (E - k) unrouted experts of each layer (a shared
    #              expert is active)
    experts: int  # every expert's gate / up / down
    router: int  # L x E x H
    expert_tensors: int  # pushed expert tensors: L x E x 3


def moe_counts(model: ModelConfig) -> MoECounts:
    moe, h, layers = model.moe, model.hidden_size, model.num_layers
    if moe is None:
        raise ConfigError("plan: moe_counts needs a mixture-of-experts model (model.moe is null)")
    per_expert = 3 * h * moe.ffn_hidden_size
    total = model.num_parameters()
    return MoECounts(total=total, active=total - layers * (moe.num_experts - moe.router_topk) * per_expert,
                     experts=layers * moe.num_experts * per_expert, router=layers * moe.num_experts * h,
                     expert_tensors=layers * moe.num_experts * 3)


def active_parameters(model: ModelConfig) -> int:
    """Parameters one token's forward multiplies by (the FLOP count's N): all of a dense model's."""
    return model.num_parameters() if model.moe is None else moe_counts(model).active


def lora_parameters(model: ModelConfig, rank: int, tp: int = 1, pp: int = 1) -> int:
    """Adapter parameters on one GPU of the largest pipeline stage (models/lora.py's layout, every target); tp = pp
    = 1: the whole model's."""
    if model.moe is not None:
        raise ConfigError("plan: lora_rank prices adapters on dense layers; this model's MLP is experts")
    h, f, d = model.hidden_size, model.ffn_hidden_size, model.head_dim
    q, kv = model.num_attention_heads * d, model.num_query_groups * d
    replicated = rank * (h + h + h + h)  # A of linear_qkv / linear_fc1 [r, h], B of linear_proj / linear_fc2 [h, r]
    split = rank * ((q + 2 * kv) + q + 2 * f + f)  # B of qkv [q+2kv, r], A of proj [r, q], B of fc1, A of fc2
    return math.ceil(model.num_layers / pp) * (replicated + split // tp)


def lora_push_parameters(model: ModelConfig, rank: int) -> int:
    """Parameters of a pushed adapter in HF PEFT names: q, k, v (gate, up) each with its own A."""
    h, f, d = model.hidden_size, model.ffn_hidden_size, model.head_dim
    q, kv = model.num_attention_heads * d, model.num_query_groups * d
    a = rank * (3 * h + q + 2 * h + f)  # q/k/v [r, h] x 3, o [r, q], gate/up [r, h] x 2, down [r, f]
    b = rank * (q + 2 * kv + h + 2 * f + h)
    return model.num_layers * (a + b)


def layer_activation_elements(model: ModelConfig, tp: int, sequence_parallel: bool,
                              implementation: Literal["megatron", "transformers"] = "megatron") -> float:
    """Activation elements one transformer layer saves for backward, per token, on one GPU.

    megatron: TE/local spec with flash attention and the fused SwiGLU (saves fc1 output and its product).
    transformers: LlamaDecoderLayer with sdpa (unfused RMSNorm and SwiGLU save more); used to check the
    accounting on CPU.
    """
    h, f = model.hidden_size, model.ffn_hidden_size
    q, kv = model.num_attention_heads * model.head_dim, model.num_query_groups * model.head_dim
    if model.moe is not None:
        if implementation != "megatron":
            raise ConfigError("plan: the transformers activation accounting is a dense Llama's (the CPU check)")
        k, fe, e = model.moe.router_topk, model.moe.ffn_hidden_size, model.moe.num_experts
        fs, gated = model.moe.shared_expert_ffn_hidden_size or 0, model.moe.shared_expert_gate
        # the router's logits and probabilities [E] in fp32 (2 x 2 bf16 elements each), on the sequence-parallel rank;
        # a gated shared expert's output h and gate score kept for their product
        replicated = 4 * h + 4 * e + (h + 1 if gated else 0)
        split = q + 2 * kv + q + 3 * fs  # a shared expert (every token, TP-split): fc1 + SwiGLU outputs 3Fs
        # each token's k dispatched copies (balanced routing: an expert group receives k x its ranks' tokens and
        # each GPU holds 1/EP of them): the expert input h (whole: expert-TP splits F) and the fc2 output h kept
        # for the probability-weighted sum, fc1 output 2F and SwiGLU output F split over expert-TP
        routed = k * (2 * h + 3 * fe / tp)
        if sequence_parallel:
            return (replicated + split) / tp + routed
        return replicated + split / tp + routed
    if implementation == "megatron":
        replicated = 4 * h  # fused RMSNorms: inputs and outputs (the outputs are the QKV / fc1 GEMM inputs)
        split = q + 2 * kv + q + 2 * f + f
    else:
        replicated = 6 * h  # unfused RMSNorm also keeps x * rsqrt(var) for the weight's gradient
        split = q + 2 * kv + q + 4 * f  # q, k, v, sdpa output (= o_proj input); gate, silu, up, product
    if sequence_parallel:
        return (replicated + split) / tp
    return replicated + split / tp


def selective_dropped_elements(model: ModelConfig, tp: int, sequence_parallel: bool,
                               modules: list[str] | None) -> float:
    """Activation elements per token one layer no longer keeps under selective recompute of ``modules`` (None:
    megatron's default, core_attn). core_attn: none (flash / SDPA attention keeps no [s, s] scores, and its inputs
    Q, K, V and output stay as the checkpoint's inputs and linear_proj's input); mlp: a dense layer's fc1 output 2f
    and SwiGLU output f over TP (megatron-core does not recompute a MoE layer for mlp); layernorm: the two RMSNorms'
    outputs 2h (over TP with sequence parallelism)."""
    dropped = 0.0
    if "mlp" in (modules or ()) and model.moe is None:
        dropped += 3 * model.ffn_hidden_size / tp
    if "layernorm" in (modules or ()):
        dropped += 2 * model.hidden_size / (tp if sequence_parallel else 1)
    return dropped


def activation_bytes(model: ModelConfig, shape: CapacityConfig, parallel: ParallelConfig, recompute: str,
                     precision: Precision = MEGATRON_BF16,
                     implementation: Literal["megatron", "transformers"] = "megatron") -> float:
    """Saved activations of the first pipeline stage at the peak of the 1F1B schedule, bytes on one GPU.

    Context parallelism: a CP rank keeps its 1/CP share of each micro-batch's T tokens (E elements per token per
    layer, layer_activation_elements) and each layer's all-gathered keys and values of all T tokens in place of its
    own share: E x T / CP + 2 kv/TP x T x (1 - 1/CP) elements per layer (E x T at CP 1).
    recompute: none; selective (parallel.recompute_modules: selective_dropped_elements); full (parallel's
    recompute_method / recompute_num_layers where it sets recompute_granularity full, else uniform over 1 layer),
    megatron-core's units within each model chunk of L / (PP x VPP) layers."""
    tp, pp = parallel.tensor_model_parallel_size, parallel.pipeline_model_parallel_size
    cp = parallel.context_parallel_size
    vp = parallel.virtual_pipeline_model_parallel_size or 1
    sp = parallel.sequence_parallel
    tokens = shape.micro_batch_size * shape.seq_length
    local = tokens / cp  # this CP rank's share
    kv_gathered = 2 * model.num_query_groups * model.head_dim / tp * tokens * (1 - 1 / cp)
    elements = layer_activation_elements(model, tp, sp, implementation)
    per_layer = (elements * local + kv_gathered) * precision.activation
    microbatches = num_microbatches(shape, parallel)
    in_flight = min(pp, microbatches)
    # Korthikanti et al. 2022: stage 0 holds p micro-batches of L/p layers; interleaving adds (p-1)/(p v).
    layers_held = math.ceil(model.num_layers / pp) * in_flight
    if vp > 1 and pp > 1:
        layers_held *= 1 + (pp - 1) / (pp * vp)
    # Backward of one layer holds gradients about as large as that layer's saved activations.
    working_set = per_layer
    if recompute == "none":
        return layers_held * per_layer + working_set
    if recompute == "selective":
        dropped = selective_dropped_elements(model, tp, sp, parallel.recompute_modules) * local * precision.activation
        return layers_held * (per_layer - dropped) + dropped + working_set  # + the one layer's recomputed part
    if recompute != "full":
        raise ConfigError(f"plan: recompute must be 'none', 'selective' or 'full', got '{recompute}'")
    layer_input = model.hidden_size * local * precision.activation / (tp if sp else 1)
    method, unit = ("uniform", 1)
    if parallel.recompute_granularity == "full":
        method, unit = parallel.recompute_method, parallel.recompute_num_layers
    chunk = math.ceil(model.num_layers / (pp * (vp if pp > 1 else 1)))  # layers of one model chunk
    unit = min(unit, chunk)
    if method == "uniform":  # each unit of `unit` layers keeps its input; its backward re-runs `unit` layers
        return layers_held * layer_input * math.ceil(chunk / unit) / chunk + unit * per_layer + working_set
    # block: the first `unit` layers of each chunk keep their input, the others every activation
    return layers_held * (unit * layer_input + (chunk - unit) * per_layer) / chunk + per_layer + working_set


def num_microbatches(shape: CapacityConfig, parallel: ParallelConfig) -> int:
    dp = parallel.data_parallel_size(shape.trainer_gpus)
    per_step = shape.micro_batch_size * dp
    if shape.global_batch_size % per_step:
        raise ConfigError(
            f"plan: global_batch_size {shape.global_batch_size} is not divisible by micro_batch_size "
            f"{shape.micro_batch_size} x data-parallel size {dp}")
    return shape.global_batch_size // per_step


def logprob_workspace_bytes(model: ModelConfig, shape: CapacityConfig, tp: int, precision: Precision,
                            cp: int = 1) -> float:
    """Peak extra bytes of the fused log-prob op's backward (megatron_spo/ops/token_logprobs.py) on one GPU: its
    CP rank's 1/CP of the micro-batch's tokens."""
    tokens = shape.micro_batch_size * shape.seq_length / cp
    block = min(shape.logprob_block_mb * 2**20, tokens * model.padded_vocab_size(tp) / tp * 4)
    block_copy = 0.0 if precision.weight == 4 else block * precision.weight / 4
    return block + block_copy + tokens * model.hidden_size * 4


def memory_per_gpu(model: ModelConfig, shape: CapacityConfig, parallel: ParallelConfig, *,
                   distributed_optimizer: bool, recompute: str, precision: Precision = MEGATRON_BF16) -> MemoryBreakdown:
    """Bytes per GPU of the worst pipeline stage. Weights and gradients are replicated over DP and CP; the
    distributed optimizer shards the dense part's state over DP x CP (megatron-core's data-parallel group with
    context parallelism) and a MoE model's experts' (split over EP x TP x PP) over the expert-data-parallel ranks
    DP x CP / EP."""
    tp, pp = parallel.tensor_model_parallel_size, parallel.pipeline_model_parallel_size
    cp = parallel.context_parallel_size
    shards = parallel.data_parallel_size(shape.trainer_gpus) * cp
    ep = parallel.expert_model_parallel_size
    split = moe_stage_parameters(model, tp, pp, ep)
    params = split.total
    adapters = lora_parameters(model, shape.lora_rank, tp, pp) if shape.lora_rank else 0
    trained_params = adapters or params  # what has gradients and optimizer state
    # the full model's optimizer-state parameters on this GPU (a critic of the same size has them too)
    full_state = split.dense / shards + split.experts / (shards // ep) if distributed_optimizer else params
    optimizer = (adapters / (shards if distributed_optimizer else 1) if adapters else full_state) * precision.optimizer
    trained = params * (precision.weight + precision.grad) + full_state * precision.optimizer
    return MemoryBreakdown(
        weights=(params + adapters) * precision.weight,
        gradients=trained_params * precision.grad,
        optimizer=optimizer,
        activations=activation_bytes(model, shape, parallel, recompute, precision),
        reference=params * precision.reference if shape.reference_model and not shape.lora_rank else 0.0,
        value_model=trained if shape.value_model else 0.0,
        logprob_workspace=logprob_workspace_bytes(model, shape, tp, precision, cp),
        overhead=shape.overhead_gb * GB,
    )


# ---------------------------------------------------------------------------------------------
# Weight sync and throughput
# ---------------------------------------------------------------------------------------------
@dataclass
class WeightSync:
    bytes: float
    buckets: int
    floor_s: float  # bytes / bandwidth
    sequential_s: float  # n x latency + bytes / (efficiency x bandwidth)
    overlapped_s: float  # double-buffered: latency hidden behind the previous bucket's transfer

    @property
    def sequential_over_floor(self) -> float:
        return self.sequential_s / self.floor_s

    @property
    def overlapped_over_floor(self) -> float:
        return self.overlapped_s / self.floor_s


def weight_sync(model: ModelConfig, shape: CapacityConfig, bucket_mb: float | None = None) -> WeightSync:
    if shape.lora_rank:
        return adapter_sync(model, shape)
    total = model.num_parameters() * 2  # bf16, HF names, unpadded vocabulary
    bucket = (bucket_mb or shape.weight_sync_bucket_mb) * 1e6
    buckets = math.ceil(total / bucket)
    bandwidth = shape.weight_sync_bandwidth_gbps * 1e9 / 8  # bytes/s
    latency = shape.weight_sync_bucket_latency_ms / 1e3
    effective = bandwidth * shape.weight_sync_efficiency
    send_one = bucket / effective
    return WeightSync(
        bytes=total, buckets=buckets, floor_s=total / bandwidth,
        sequential_s=buckets * latency + total / effective,
        overlapped_s=latency + buckets * max(send_one, latency) - max(0.0, buckets * bucket - total) / effective,
    )


def adapter_sync(model: ModelConfig, shape: CapacityConfig) -> WeightSync:
    """A LoRA push: one body per engine (a base64 copy of the bf16 adapter per engine TP rank), all from trainer
    rank 0: worker_gpus copies through its NIC; no buckets, one fixed cost."""
    payload = 4 * math.ceil(lora_push_parameters(model, shape.lora_rank) * 2 / 3)
    total = shape.worker_gpus * payload
    bandwidth = shape.weight_sync_bandwidth_gbps * 1e9 / 8
    seconds = shape.weight_sync_bucket_latency_ms / 1e3 + total / (bandwidth * shape.weight_sync_efficiency)
    return WeightSync(bytes=total, buckets=1, floor_s=total / bandwidth, sequential_s=seconds, overlapped_s=seconds)


PATH_BODY_BYTES = 128  # {"lora_name": "policy-v12-ab12cd34", "lora_path": "<run dir>/lora_push/...", "pinned": false}


def adapter_path_sync(model: ModelConfig, shape: CapacityConfig) -> dict:
    """A LoRA push by path (lora.transport=path): trainer rank 0 writes the bf16 adapter once (safetensors, no
    base64) to the filesystem it shares with the engines and sends each engine GPU's server a JSON body of about
    PATH_BODY_BYTES (counted per engine GPU, an upper bound); every engine GPU reads the file itself. Seconds: the
    write through rank 0's link, then the reads, each engine GPU at its own link's rate (a filesystem that serves
    worker_gpus readers at once; a slower one makes the reads the bound), plus one fixed cost."""
    adapter = lora_push_parameters(model, shape.lora_rank) * 2
    effective = shape.weight_sync_bandwidth_gbps * 1e9 / 8 * shape.weight_sync_efficiency
    return {"bytes_written": adapter, "bytes_read": shape.worker_gpus * adapter,
            "http_bytes": shape.worker_gpus * PATH_BODY_BYTES,
            "rank0_bytes": adapter + shape.worker_gpus * PATH_BODY_BYTES,
            "seconds": shape.weight_sync_bucket_latency_ms / 1e3 + 2 * adapter / effective}


@dataclass
class Throughput:
    flops_per_step: float
    step_s: float
    trained_tokens_per_step: int
    generated_tokens_per_step: float
    rollout_tokens_per_s: float
    rollout_tokens_per_s_per_worker_gpu: float
    weight_sync_share: float  # of wall time, syncing every model_update_interval steps (trainer blocked)


def flops_per_parameter(shape: CapacityConfig, recompute: str) -> int:
    """Training FLOPs per token per (active) parameter: 6 forward + backward (4 with LoRA: no weight gradients of the
    frozen base), +2 full recompute, +2 reference forward, +6 a critic of the same size."""
    per = 4 if shape.lora_rank else 6
    return per + (2 if recompute == "full" else 0) + (2 if shape.reference_model else 0) + (
        6 if shape.value_model else 0)


def throughput(model: ModelConfig, shape: CapacityConfig, recompute: str, sync_s: float) -> Throughput:
    n = active_parameters(model)  # a MoE token multiplies by its k experts only (and the whole router)
    tokens = shape.global_batch_size * shape.seq_length
    per_token = flops_per_parameter(shape, recompute) * n
    per_token += 6 * model.num_layers * shape.seq_length * model.hidden_size  # causal attention, fwd + bwd
    flops = per_token * tokens
    step_s = flops / (shape.trainer_gpus * shape.achieved_tflops_per_gpu * 1e12)
    generated = shape.online_fraction * shape.global_batch_size * shape.response_tokens
    needed = generated / step_s
    return Throughput(
        flops_per_step=flops, step_s=step_s, trained_tokens_per_step=tokens, generated_tokens_per_step=generated,
        rollout_tokens_per_s=needed, rollout_tokens_per_s_per_worker_gpu=needed / shape.worker_gpus,
        weight_sync_share=sync_s / (shape.model_update_interval * step_s + sync_s),
    )


# ---------------------------------------------------------------------------------------------
# The plan
# ---------------------------------------------------------------------------------------------
SCENARIOS = [(False, "none"), (True, "none"), (False, "full"), (True, "full")]
RECOMPUTE_NAMES = {"none": "no recompute", "selective": "selective recompute", "full": "full recompute"}


def scenario_name(distributed: bool, recompute: str) -> str:
    return f"{'dist-opt' if distributed else 'plain opt'}, {RECOMPUTE_NAMES[recompute]}"


def config_memory(model: ModelConfig, shape: CapacityConfig, parallel: ParallelConfig) -> MemoryBreakdown:
    """Bytes per GPU of the run itself: its optimizer (parallel.use_distributed_optimizer) and recompute
    (shape.recompute: capacity_shape takes a training config's parallel.recompute_granularity). The plan's column
    of that config and `megatron-spo validate`'s figure, one function."""
    return memory_per_gpu(model, shape, parallel, distributed_optimizer=parallel.use_distributed_optimizer,
                          recompute=shape.recompute)


def moe_summary(model: ModelConfig, shape: CapacityConfig) -> dict | None:
    """A MoE model's counts for the plan: total / active / expert / router parameters, the router's share of the
    parameters and of the per-token training FLOPs (flops_per_parameter x router / the step's FLOPs per token),
    pushed expert tensors; None for a dense model."""
    if model.moe is None:
        return None
    c = moe_counts(model)
    flops_per_token = throughput(model, shape, shape.recompute, 0.0).flops_per_step / (
        shape.global_batch_size * shape.seq_length)
    router_flops = flops_per_parameter(shape, shape.recompute) * c.router
    return {"num_experts": model.moe.num_experts, "router_topk": model.moe.router_topk,
            "active_parameters": c.active, "expert_parameters": c.experts, "router_parameters": c.router,
            "router_share_of_parameters": c.router / c.total, "router_share_of_flops": router_flops / flops_per_token,
            "expert_tensors": c.expert_tensors}


def make_plan(model: ModelConfig, parallel: ParallelConfig, shape: CapacityConfig) -> dict:
    parallel.check(model, shape.trainer_gpus)
    sync = weight_sync(model, shape)
    memory = {}
    for distributed, recompute in SCENARIOS:
        m = memory_per_gpu(model, shape, parallel, distributed_optimizer=distributed, recompute=recompute)
        memory[scenario_name(distributed, recompute)] = {**m.as_gb(), "fits": m.total <= shape.gpu_memory_gb * GB}
    chosen = scenario_name(parallel.use_distributed_optimizer, shape.recompute)
    m = config_memory(model, shape, parallel)  # the figure validate gives (a selective column added here)
    memory[chosen] = {**m.as_gb(), "fits": m.total <= shape.gpu_memory_gb * GB}
    tput = throughput(model, shape, shape.recompute, sync.overlapped_s)
    bucket_sweep = {} if shape.lora_rank else {mb: weight_sync(model, shape, mb).overlapped_over_floor
                                                for mb in (64, 128, 256, 512, 1024, 2048)}
    dp, ep = parallel.data_parallel_size(shape.trainer_gpus), parallel.expert_model_parallel_size
    cp = parallel.context_parallel_size
    return {
        "model": {"parameters": model.num_parameters(), "layers": model.num_layers, "hidden": model.hidden_size,
                  "vocab": model.vocab_size,
                  "lora_parameters": lora_parameters(model, shape.lora_rank) if shape.lora_rank else 0,
                  "moe": moe_summary(model, shape)},
        "layout": {"tp": parallel.tensor_model_parallel_size, "pp": parallel.pipeline_model_parallel_size,
                   "vpp": parallel.virtual_pipeline_model_parallel_size or 1, "cp": cp,
                   "dp": dp, "ep": ep, "expert_dp": dp * cp // ep,
                   "sequence_parallel": parallel.sequence_parallel,
                   "microbatches": num_microbatches(shape, parallel)},
        "shape": shape.model_dump(),
        "memory_gb": memory,
        "config_scenario": chosen,  # the run's own column: its optimizer and recompute (config_memory)
        "weight_sync": {**asdict(sync), "sequential_over_floor": sync.sequential_over_floor,
                        "overlapped_over_floor": sync.overlapped_over_floor,
                        "overlapped_over_floor_by_bucket_mb": bucket_sweep,
                        **({"by_path": adapter_path_sync(model, shape)} if shape.lora_rank else {})},
        "throughput": asdict(tput),
        "notes": [] if ep == 1 else [
            f"expert_model_parallel_size {ep}: each rank of an expert group runs the step's most micro-batches (idle "
            "ones where it has fewer: batch/idle_micro_batches, a few pad tokens each, not priced here); the alltoall "
            "dispatcher (model.moe.token_dispatcher auto)"],
    }


def print_plan(plan: dict, title: str) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=max(Console().width, 132))
    lay, shape = plan["layout"], plan["shape"]
    console.print(f"[bold]{title}[/bold]: {plan['model']['parameters'] / 1e9:.2f}B params; trainer "
                  f"{shape['trainer_gpus']} GPUs = TP {lay['tp']} x PP {lay['pp']} (VPP {lay['vpp']})"
                  f"{'' if lay['cp'] == 1 else ' x CP ' + str(lay['cp'])} x DP {lay['dp']}"
                  f"{'' if lay['ep'] == 1 else ' (EP ' + str(lay['ep']) + ', expert-DP ' + str(lay['expert_dp']) + ')'}"
                  f"{', sequence parallel' if lay['sequence_parallel'] else ''}; micro-batch "
                  f"{shape['micro_batch_size']} x seq {shape['seq_length']}, global batch {shape['global_batch_size']} "
                  f"({lay['microbatches']} micro-batches per DP rank)")
    mem = Table(title=f"Memory per GPU (GB, worst pipeline stage) vs {shape['gpu_memory_gb']:.0f} GB")
    mem.add_column("component")
    for name in plan["memory_gb"]:
        mem.add_column(name, justify="right")
    rows = ["weights", "gradients", "optimizer", "activations", "reference", "value_model", "logprob_workspace",
            "overhead", "total"]
    for row in rows:
        mem.add_row(row, *[f"{v[row]:.1f}" for v in plan["memory_gb"].values()])
    mem.add_row("fits", *["[green]yes[/green]" if v["fits"] else "[red]no[/red]" for v in plan["memory_gb"].values()])
    console.print(mem)
    own = plan["memory_gb"][plan["config_scenario"]]
    console.print(f"this config ({plan['config_scenario']}): {own['total']:.1f} GB per GPU, "
                  f"{'fits' if own['fits'] else '[red]does not fit[/red]'} (what megatron-spo validate checks)")
    moe = plan["model"].get("moe")
    if moe:
        console.print(f"MoE: {moe['num_experts']} experts, top-{moe['router_topk']}; "
                      f"{moe['active_parameters'] / 1e9:.2f}B active of {plan['model']['parameters'] / 1e9:.2f}B "
                      f"(experts {moe['expert_parameters'] / 1e9:.2f}B over EP {lay['ep']} x TP {lay['tp']} x PP "
                      f"{lay['pp']}, their optimizer state over expert-DP {lay['expert_dp']}); router "
                      f"{moe['router_parameters'] / 1e6:.1f}M = {moe['router_share_of_parameters']:.3%} of the "
                      f"parameters, {moe['router_share_of_flops']:.2%} of the training FLOPs; the push carries all "
                      f"{moe['expert_tensors']} expert tensors")
    for note in plan.get("notes", []):
        console.print(f"[yellow]note[/yellow]: {note}")

    ws = plan["weight_sync"]
    if shape["lora_rank"]:
        console.print(f"LoRA rank {shape['lora_rank']}: {plan['model']['lora_parameters'] / 1e6:.1f}M adapter "
                      f"parameters; a push sends {ws['bytes'] / GB:.2f} GB from trainer rank 0 (bf16 base64, a copy "
                      f"per engine GPU) at {shape['weight_sync_bandwidth_gbps']:.0f} Gb/s: {ws['sequential_s']:.2f} s, "
                      "no pause")
        path = ws["by_path"]
        console.print(f"  by path (lora.transport=path, a shared filesystem): rank 0 writes the adapter once, "
                      f"{path['bytes_written'] / GB:.3f} GB, and sends {path['http_bytes'] / 1e3:.1f} kB of JSON; "
                      f"{shape['worker_gpus']} engine GPUs read it ({path['bytes_read'] / GB:.2f} GB from the "
                      f"filesystem): {path['seconds']:.2f} s; {ws['bytes'] / path['rank0_bytes']:.0f}x less from "
                      "rank 0")
    else:
        print_sync_table(console, ws, shape)
    print_throughput(console, plan, shape)


def print_sync_table(console, ws: dict, shape: dict) -> None:
    from rich.table import Table

    sync = Table(title=f"Weight sync: {ws['bytes'] / GB:.1f} GB bf16 at {shape['weight_sync_bandwidth_gbps']:.0f} Gb/s")
    for col in ("", "seconds", "x floor"):
        sync.add_column(col, justify="right")
    sync.add_row("floor (bytes / bandwidth)", f"{ws['floor_s']:.2f}", "1.00")
    sync.add_row(f"{ws['buckets']} buckets of {shape['weight_sync_bucket_mb']:.0f} MB, sequential",
                 f"{ws['sequential_s']:.2f}", f"{ws['sequential_over_floor']:.2f}")
    sync.add_row("same, double-buffered", f"{ws['overlapped_s']:.2f}", f"{ws['overlapped_over_floor']:.2f}")
    console.print(sync)
    sweep = ", ".join(f"{mb} MB: {r:.2f}x" for mb, r in ws["overlapped_over_floor_by_bucket_mb"].items())
    console.print(f"  double-buffered vs floor by bucket size ({shape['weight_sync_bucket_latency_ms']:.0f} ms per "
                  f"bucket, {shape['weight_sync_efficiency']:.0%} of link bandwidth): {sweep}")


def print_throughput(console, plan: dict, shape: dict) -> None:
    from rich.table import Table

    t = plan["throughput"]
    source = plan.get("throughput_source", "assumed")
    tp_table = Table(title=f"Throughput ({shape['achieved_tflops_per_gpu']:.0f} TFLOP/s achieved per trainer GPU, "
                     f"{source})")
    tp_table.add_column("")
    tp_table.add_column("value", justify="right")
    tp_table.add_row("trainer step", f"{t['step_s']:.1f} s ({t['trained_tokens_per_step'] / 1e6:.2f}M tokens)")
    tp_table.add_row("generated tokens per step", f"{t['generated_tokens_per_step'] / 1e3:.0f}k")
    tp_table.add_row("rollout tokens/s needed", f"{t['rollout_tokens_per_s']:,.0f}")
    tp_table.add_row("  per worker GPU", f"{t['rollout_tokens_per_s_per_worker_gpu']:,.0f}")
    tp_table.add_row(f"weight sync share (every {shape['model_update_interval']} steps)", f"{t['weight_sync_share']:.1%}")
    console.print(tp_table)


# ---------------------------------------------------------------------------------------------
# Validation on CPU: the same accounting vs a measured training step of a transformers Llama
# ---------------------------------------------------------------------------------------------
CPU_CHECK_MODEL = ModelConfig(num_layers=4, hidden_size=256, ffn_hidden_size=704, num_attention_heads=8,
                              num_query_groups=8, vocab_size=512, max_position_embeddings=1024,
                              make_vocab_size_divisible_by=1)
CPU_CHECK_BATCH, CPU_CHECK_SEQ = 4, 512


def predict_cpu_step(model: ModelConfig = CPU_CHECK_MODEL, batch: int = CPU_CHECK_BATCH,
                     seq: int = CPU_CHECK_SEQ) -> dict[str, float]:
    """Predicted peak bytes of an fp32 transformers Llama forward + backward + Adam step on one CPU process.

    The same terms as `activation_bytes` (layers as in `layer_activation_elements(..., 'transformers')`,
    plus one layer's backward working set); the head saves the final norm's 3 h and the log-softmax
    output, and in its backward also holds that output's gradient and the logits' gradient: 3 V per token.
    """
    shape = CapacityConfig(trainer_gpus=1, worker_gpus=1, micro_batch_size=batch, global_batch_size=batch,
                           seq_length=seq, overhead_gb=0.0)
    p = TORCH_FP32_ADAM
    params = model.num_parameters()
    tokens = batch * seq
    layers = activation_bytes(model, shape, ParallelConfig(), "none", p, "transformers")
    head = (3 * model.hidden_size + 3 * model.vocab_size) * tokens * p.activation
    out = {"weights": params * p.weight, "gradients": params * p.grad, "optimizer": params * p.optimizer,
           "activations": layers + head}
    out["total"] = sum(out.values())
    return out


_MEASURE = r"""
import json, resource, sys, torch
torch.set_num_threads(1)
cfg = json.loads(sys.argv[1])
from transformers import LlamaConfig, LlamaForCausalLM

def rss():  # current resident set, bytes
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()

torch.manual_seed(0)
ids = torch.randint(0, cfg["vocab"], (cfg["batch"], cfg["seq"] + 1))
x, y = ids[:, :-1], ids[:, 1:]
torch.ones(8, 8).sum()  # load kernels before the baseline
base = rss()
hf = LlamaConfig(hidden_size=cfg["h"], intermediate_size=cfg["f"], num_hidden_layers=cfg["layers"],
                 num_attention_heads=cfg["heads"], num_key_value_heads=cfg["kv"], vocab_size=cfg["vocab"],
                 max_position_embeddings=cfg["seq"], tie_word_embeddings=False, attn_implementation="sdpa")
model = LlamaForCausalLM(hf).float()
opt = torch.optim.Adam(model.parameters(), lr=1e-4, foreach=False)  # megatron's fused Adam has no big temporaries
def step():
    logp = torch.log_softmax(model(input_ids=x).logits, dim=-1).gather(-1, y.unsqueeze(-1))
    loss = -logp.mean()
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=False)  # megatron keeps its grad buffer
step()  # allocates Adam state and the gradient buffers
peak_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
step()
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(json.dumps({"base": base, "peak": peak, "peak_first_step": peak_before,
                  "params": sum(p.numel() for p in model.parameters())}))
"""


def measure_cpu_step(model: ModelConfig = CPU_CHECK_MODEL, batch: int = CPU_CHECK_BATCH,
                     seq: int = CPU_CHECK_SEQ, timeout_s: float = 300) -> dict[str, float]:
    """Peak RSS growth (bytes) of a real fp32 forward + backward + Adam step, in a fresh subprocess."""
    cfg = {"h": model.hidden_size, "f": model.ffn_hidden_size, "layers": model.num_layers,
           "heads": model.num_attention_heads, "kv": model.num_query_groups, "vocab": model.vocab_size,
           "batch": batch, "seq": seq}
    # A fixed mmap threshold: glibc otherwise raises it after frees and keeps freed blocks resident.
    env = dict(os.environ, OMP_NUM_THREADS="1", MALLOC_ARENA_MAX="1", MALLOC_MMAP_THRESHOLD_="65536",
               TRANSFORMERS_VERBOSITY="error")
    out = subprocess.run([sys.executable, "-c", _MEASURE, json.dumps(cfg)], capture_output=True, text=True,
                         env=env, timeout=timeout_s)
    if out.returncode != 0:
        raise RuntimeError(f"CPU memory measurement failed: {out.stderr.strip().splitlines()[-1:]}")
    rec = json.loads(out.stdout.strip().splitlines()[-1])
    return {"measured": float(rec["peak"] - rec["base"]), "params": rec["params"], **rec}


def validate_on_cpu() -> dict[str, float]:
    predicted = predict_cpu_step()
    measured = measure_cpu_step()
    return {"predicted": predicted["total"], "measured": measured["measured"],
            "ratio": predicted["total"] / measured["measured"], "params_model": CPU_CHECK_MODEL.num_parameters(),
            "params_measured": measured["params"], **{f"predicted_{k}": v for k, v in predicted.items()}}


# ---------------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------------
TRAIN_KEYS = ("init", "batch", "sources", "algo", "rollout")  # a training config, not a plan-only YAML


def capacity_shape(cfg, world_size: int, gpu_memory_gb: float | None = None) -> dict:
    """CapacityConfig fields of this training config: its batch, sequence length, micro-batch token budget (whole
    sequences, before the CP split), online share, rollout length, push interval, value model, recompute, log-prob
    block and bucket size."""
    from megatron_spo.training.algos import algorithm_class

    b, weights = cfg.batch, {n: s.weight for n, s in cfg.sources.items()}
    dp = cfg.parallel.data_parallel_size(world_size)
    # the trainer packs by tokens; the plan counts whole sequences per micro-batch, a divisor of each DP
    # rank's share of the batch (rounded up to a multiple of DP: memory does not depend on it)
    global_batch = -(-b.sequences_per_step // dp) * dp
    micro = max(m for m in range(1, max(1, b.max_tokens_per_micro_batch // b.max_seq_length) + 1)
                if (global_batch // dp) % m == 0)
    shape = dict(trainer_gpus=world_size, global_batch_size=global_batch, seq_length=b.max_seq_length,
                 micro_batch_size=micro,
                 response_tokens=cfg.rollout.max_new_tokens, online_fraction=weights.get("online", 0.0) / sum(
                     weights.values()), model_update_interval=cfg.model_update_interval,
                 value_model=algorithm_class(cfg.algo).uses_value_model, weight_sync_bucket_mb=cfg.rollout.weight_bucket_mb,
                 recompute=cfg.parallel.recompute_granularity or "none")
    if cfg.logprobs.max_block_bytes:
        shape["logprob_block_mb"] = cfg.logprobs.max_block_bytes / 2**20
    if gpu_memory_gb:
        shape["gpu_memory_gb"] = gpu_memory_gb
    return shape


def train_config_shape(path: str, data: dict) -> dict:
    """The CapacityConfig fields a training config fixes (its batch, sequence length, micro-batch token budget,
    online share, rollout length, push interval; capacity_shape), {} for a plan-only YAML; the file's
    `plan:` section and the command line's overrides win over them."""
    if not any(key in data for key in TRAIN_KEYS):
        return {}
    from megatron_spo.training.config import TrainConfig

    cfg = build_config(TrainConfig, {k: v for k, v in data.items() if k != "plan"}, str(path))
    world = (data.get("plan") or {}).get("trainer_gpus", CapacityConfig().trainer_gpus)
    return capacity_shape(cfg, world)


def measured_throughput(path: str) -> dict:
    """{"tflops", "source"} from tools/bench_step.py's step_bench.json: the SPO step of its first case (sequences of
    4096 tokens on a GPU), in this plan's FLOP count (spo_plan_tflops)."""
    file = Path(path)
    try:
        report = json.loads(file.read_text())
        case = report["cases"][0]
        tflops = float(case["spo_plan_tflops"])
        source = f"{file.name}: {report['device']}, {report['date']}, SPO step of {case['sequences']} x {case['seq']}"
    except (OSError, ValueError, KeyError, IndexError, TypeError) as err:
        raise ConfigError(f"plan --measured: '{path}' is not a readable step benchmark report "
                          f"(tools/bench_step.py's step_bench.json): {type(err).__name__}: {err}") from None
    if not math.isfinite(tflops) or tflops <= 0:
        raise ConfigError(f"plan --measured: '{path}' gives {tflops} TFLOP/s for its SPO step")
    return {"tflops": tflops, "source": source}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="megatron-spo plan", description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="llama3.1-70b", help=f"{' | '.join(BUILTIN_PRESETS)} (or examples/models/NAME.yaml)")
    parser.add_argument("--config", help="YAML with a `plan:` section (CapacityConfig) and optionally model/parallel")
    parser.add_argument("--tp", type=positive_int, help="tensor parallel size (default: the preset's)")
    parser.add_argument("--pp", type=positive_int, help="pipeline parallel size (default: the preset's)")
    parser.add_argument("--vpp", type=non_negative_int, help="virtual pipeline stages (0: none)")
    parser.add_argument("--cp", type=positive_int, help="context parallel size (default: the preset's)")
    parser.add_argument("overrides", nargs="*", help="dotted CapacityConfig overrides, e.g. seq_length=8192")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")
    parser.add_argument("--measured", metavar="STEP_BENCH_JSON",
                        help="take achieved_tflops_per_gpu from a GPU step benchmark (tools/bench_step.py's "
                        "step_bench.json: its SPO step's time, counted with this plan's FLOP formula) instead of "
                        "the assumed figure; the plan names the report it used")
    parser.add_argument("--validate-cpu", action="store_true",
                        help="measure a tiny Llama training step on CPU and compare with the memory model")
    args = parser.parse_args(argv)

    if args.validate_cpu:
        result = validate_on_cpu()
        if args.json:
            print(json.dumps(result, indent=1))
        else:
            print(f"CPU check ({result['params_measured'] / 1e6:.2f}M-param Llama, fp32, batch {CPU_CHECK_BATCH} x "
                  f"seq {CPU_CHECK_SEQ}): predicted {result['predicted'] / 1e6:.0f} MB, measured peak RSS growth "
                  f"{result['measured'] / 1e6:.0f} MB, ratio {result['ratio']:.2f}")
        return 0

    model, parallel = load_preset(args.preset)
    data: dict = {}
    if args.config:
        path = Path(args.config)
        if not path.is_file():
            raise ConfigError(f"plan: config file '{path}' does not exist")
        data = read_yaml(path) or {}
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: top level must be a mapping, got {type(data).__name__}")
        if "model" in data:
            model = build_config(ModelConfig, data["model"], str(path))
        if "parallel" in data:
            parallel = build_config(ParallelConfig, data["parallel"], str(path))
    updates = {}
    if args.tp:
        updates["tensor_model_parallel_size"] = args.tp
    if args.pp:
        updates["pipeline_model_parallel_size"] = args.pp
    if args.vpp is not None:
        updates["virtual_pipeline_model_parallel_size"] = args.vpp or None
    if args.cp:
        updates["context_parallel_size"] = args.cp
    if updates:
        parallel = build_config(ParallelConfig, {**parallel.model_dump(), **updates}, "command line")
    from_train = train_config_shape(args.config, data) if args.config else {}
    measured = measured_throughput(args.measured) if args.measured else None
    # the layout's own recompute unless the training config's (the same) or its plan section says otherwise
    base = {"recompute": parallel.recompute_granularity or "none", **from_train, **data.get("plan", {})}
    if measured is not None:
        base["achieved_tflops_per_gpu"] = measured["tflops"]
    shape = build_config(CapacityConfig, apply_overrides(base, args.overrides), args.config or "command line")
    plan = make_plan(model, parallel, shape)
    overridden = any(o.split("=", 1)[0].strip() == "achieved_tflops_per_gpu" for o in args.overrides)
    # the command line's override, then --measured, then the config's plan section, then the default
    plan["throughput_source"] = (
        "as given" if overridden else ("measured: " + measured["source"]) if measured
        else "as given" if "achieved_tflops_per_gpu" in data.get("plan", {}) else "assumed")
    if args.json:
        print(json.dumps(plan, indent=1))
    else:
        print_plan(plan, args.preset if not args.config else f"{args.preset} ({args.config})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
