"""The quickstart reference model's config: a tiny HF model and its SFT on the toy task
(experiments/reference_model.py)."""

from __future__ import annotations

from typing import Any

from pydantic import Field, model_validator

from megatron_spo.config import StrictModel
from megatron_spo.data.config import ToyCodeTaskConfig
from megatron_spo.models.config import MoEConfig

# the tiny MoE a mixture-of-experts family gets when reference.moe is unset: odd sizes, top-2 of 6 (issue 47)
TINY_MOE = MoEConfig(num_experts=6, router_topk=2, ffn_hidden_size=96)
# ... and a family with a gated shared expert (Qwen2-MoE): the same experts beside a shared one of 96
TINY_SHARED_MOE = MoEConfig(num_experts=6, router_topk=2, ffn_hidden_size=96, shared_expert_ffn_hidden_size=96,
                            shared_expert_gate=True)
MATH_SFT_STEPS = 1200  # the math reference's default: its arithmetic needs twice the code task's SFT


class QuickstartModelConfig(StrictModel):
    """A tiny HF model of a registered family (Llama by default; character vocabulary) and its supervised
    fine-tuning on the toy task.

    Half the SFT targets carry their family's input-parsing slip (slip_fraction; toy_code.with_input_slip), so
    the reference fails on about 40% of its samples whatever the problem, for a reason RL can remove on
    problems it never trains on. swap_fraction adds problem-specific noise (a neighbour's solution) instead.
    """

    task: ToyCodeTaskConfig = Field(default_factory=ToyCodeTaskConfig)
    architecture: str = Field("llama", description="model family: a module of models/arch/ (its model_type)")
    hidden_size: int = Field(128, gt=0)
    num_layers: int = Field(3, gt=0)
    num_attention_heads: int = Field(4, gt=0)
    num_key_value_heads: int = Field(2, gt=0)
    intermediate_size: int = Field(384, gt=0)
    max_position_embeddings: int = Field(256, gt=0)
    rope_theta: float = Field(10000.0, gt=0)
    norm_epsilon: float = Field(1e-5, gt=0)
    seed: int = 0
    sft_steps: int = Field(600, ge=0, description=f"600 for toy_code; unset, {MATH_SFT_STEPS} for toy_math (at 600 "
                           "its reference solved 12% of held-out problems, at 1200 41%)")
    batch_size: int = Field(32, gt=0, description="sequences per SFT step")
    lr: float = Field(3e-3, gt=0)
    warmup_steps: int = Field(50, ge=0)
    min_lr_ratio: float = Field(0.1, ge=0, le=1, description="cosine decay floor, as a fraction of lr")
    weight_decay: float = Field(0.0, ge=0)
    grad_clip: float = Field(1.0, gt=0)
    swap_fraction: float = Field(0.0, ge=0, lt=1, description="SFT targets replaced by a neighbour's solution")
    slip_fraction: float = Field(0.5, ge=0, lt=1, description="SFT targets with their task's slip (toy_code: the "
                                 "input-parsing slip; toy_math: the last step dropped): a generic error RL can "
                                 "remove on unseen problems too")
    num_threads: int = Field(2, gt=0, description="torch CPU threads during SFT (not part of the cache key)")
    moe: MoEConfig | None = Field(None, description="the experts of a mixture-of-experts family (architecture="
                                  "qwen3_moe, qwen2_moe): unset there, TINY_MOE (6 experts of 96, top-2; qwen2_moe: "
                                  "TINY_SHARED_MOE, a shared expert of 96 beside them); must stay unset for "
                                  "a dense family. The quickstart then starts its engines with "
                                  "--enable-return-routed-experts and trains with routing replay")

    @model_validator(mode="before")
    @classmethod
    def _math_sft_steps(cls, data: Any) -> Any:
        if isinstance(data, dict) and "sft_steps" not in data:
            task = data.get("task")
            kind = task if isinstance(task, str) else (task.get("kind") if isinstance(task, dict)
                                                         else getattr(task, "kind", None))
            if kind == "toy_math":
                return {**data, "sft_steps": MATH_SFT_STEPS}
        return data

    @model_validator(mode="after")
    def _check_heads(self) -> QuickstartModelConfig:
        from megatron_spo.models.arch import architecture, registry

        try:
            family = architecture(self.architecture)
        except ValueError as err:  # the registry's message lists the known families
            raise ValueError(f"architecture: {err}") from None
        if family.experts and self.moe is None:
            object.__setattr__(self, "moe", TINY_SHARED_MOE if family.shared_expert else TINY_MOE)
        elif not family.experts and self.moe is not None:
            moe_families = " | ".join(n for n, a in registry().items() if a.experts)
            raise ValueError(f"moe: architecture {self.architecture!r} has no experts (a mixture-of-experts family: "
                             f"architecture={moe_families})")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"hidden_size {self.hidden_size} is not divisible by num_attention_heads {self.num_attention_heads}"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads {self.num_attention_heads} is not divisible by "
                f"num_key_value_heads {self.num_key_value_heads}"
            )
        return self
