"""The math of the algorithms, one module each: pure torch, no megatron, no I/O (MATH.md).

Every loss takes token log-probs [B, T] of the sampled tokens, a response mask [B, T] and per-sequence
tensors [B], validates them cheaply, and returns (scalar loss, dict of float metrics).
"""

from megatron_spo.algorithms.agro import agro_loss, kl_pg_loss, regularised_reward
from megatron_spo.algorithms.groups import leave_one_out_stats
from megatron_spo.algorithms.ppo import (
    gae,
    kl_regularised_token_rewards,
    ppo_policy_loss,
    ppo_value_loss,
    whiten_over_batch,
)
from megatron_spo.algorithms.spo import (
    LOSSES,
    OBJECTIVES,
    SPOInputs,
    SPOTerms,
    cross_entropy_log_space,
    cumulative_q,
    q0_from_rewards,
    q0_from_success,
    regression_loss,
    reverse_q_targets,
    spo_loss,
    straight_through_clamp_max,
    supported_combinations,
    token_advantages,
)
from megatron_spo.algorithms.spo_transforms import TRANSFORMS
from megatron_spo.algorithms.validation import check_token_inputs

__all__ = [
    "LOSSES",
    "OBJECTIVES",
    "SPOInputs",
    "SPOTerms",
    "TRANSFORMS",
    "agro_loss",
    "check_token_inputs",
    "cross_entropy_log_space",
    "cumulative_q",
    "gae",
    "kl_pg_loss",
    "kl_regularised_token_rewards",
    "leave_one_out_stats",
    "ppo_policy_loss",
    "ppo_value_loss",
    "q0_from_rewards",
    "q0_from_success",
    "regression_loss",
    "regularised_reward",
    "reverse_q_targets",
    "spo_loss",
    "straight_through_clamp_max",
    "supported_combinations",
    "token_advantages",
    "whiten_over_batch",
]
