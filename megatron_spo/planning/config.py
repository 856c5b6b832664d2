"""The capacity plan's config: cluster shape and workload (planning/capacity.py, `megatron-spo plan`)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from megatron_spo.config import StrictModel


class CapacityConfig(StrictModel):
    """Cluster shape and workload of a plan. Defaults: the 64 + 64 H100 layout of the SPO paper's scale."""

    trainer_gpus: int = Field(64, gt=0)
    worker_gpus: int = Field(64, gt=0)
    gpus_per_node: int = Field(8, gt=0)
    gpu_memory_gb: float = Field(80.0, gt=0)
    micro_batch_size: int = Field(1, gt=0, description="sequences per micro-batch")
    global_batch_size: int = Field(256, gt=0, description="sequences per optimizer step")
    seq_length: int = Field(4096, gt=0, description="prompt + response tokens per (packed) sequence")
    response_tokens: int = Field(2048, gt=0, description="generated tokens per sequence (rollout cost)")
    online_fraction: float = Field(1.0, ge=0, le=1, description="share of each batch generated online")
    recompute: Literal["none", "selective", "full"] = Field(
        "none", description="the run's activation recompute (a training config's parallel.recompute_granularity): "
        "its own memory column (what validate checks) and the step's FLOPs")
    reference_model: bool = True
    value_model: bool = Field(False, description="PPO critic of the same size (weights, grads, optimizer)")
    lora_rank: int = Field(0, ge=0, description="LoRA rank on every layer's linears (the trainer's lora, all four "
                           "targets); 0: full training. With LoRA the base is frozen (no gradients or optimizer "
                           "state of its own), pi_0 is the policy with the adapters off (no reference weights), "
                           "and a push sends the adapters alone")
    logprob_block_mb: float = Field(64.0, gt=0, description="one fp32 logits block of the fused log-prob op, "
                                    "MiB (a training config's logprobs.max_block_bytes; 64 is its default)")
    overhead_gb: float = Field(4.0, ge=0, description="CUDA context, NCCL buffers, fragmentation (assumed)")
    achieved_tflops_per_gpu: float = Field(400.0, gt=0, description="bf16 model TFLOP/s a trainer GPU sustains")
    model_update_interval: int = Field(10, gt=0, description="trainer steps between weight syncs")
    weight_sync_bandwidth_gbps: float = Field(400.0, gt=0, description="network Gb/s into each engine GPU")
    weight_sync_bucket_mb: float = Field(512.0, gt=0)
    weight_sync_bucket_latency_ms: float = Field(
        10.0, ge=0, description="fixed cost per bucket: gather, HTTP update call, NCCL launch (assumed)")
    weight_sync_efficiency: float = Field(0.9, gt=0, le=1, description="achieved share of link bandwidth")
