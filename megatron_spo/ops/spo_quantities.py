"""From LM-head inputs to SPO's per-token quantities in one call: log-probs, advantages, cumulative Q.

    out = spo_token_quantities(hidden, weight, targets, mask, q0, beta, ref_hidden=..., ref_weight=...)
    out.q  # [B, T]: Q_t = q0 + sum_{t' <= t} A_t', A_t = beta * (log pi_theta - log pi_0)(a_t)

Only response positions (mask != 0) go through the fused log-prob op, so prompt and padding tokens cost
no LM-head GEMM at all. The reference log-probs are computed under no_grad (or passed in), so gradients
flow only through the policy's hidden states and LM head. Same semantics as
``megatron_spo.algorithms.cumulative_q`` (MATH.md section 2): A_t is exactly 0 on masked positions, so a
masked position holds the last valid Q (q0 before the first response token).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_spo.ops.token_logprobs import token_logprobs


@dataclass
class SPOTokenQuantities:
    """All [B, T] fp32; logp, advantages and q carry gradients to the policy, ref_logp does not."""

    logp: torch.Tensor  # log pi_theta(a_t | a_<t, x) on response tokens, 0 elsewhere
    ref_logp: torch.Tensor  # log pi_0(a_t | a_<t, x) on response tokens, 0 elsewhere
    advantages: torch.Tensor  # beta * (logp - ref_logp) on response tokens, 0 elsewhere
    q: torch.Tensor  # q0 + cumsum(advantages) along T


def spo_token_quantities(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    mask: torch.Tensor,
    q0: torch.Tensor | float,
    beta: float,
    *,
    ref_hidden: torch.Tensor | None = None,
    ref_weight: torch.Tensor | None = None,
    ref_logp: torch.Tensor | None = None,
    tp_group: dist.ProcessGroup | None = None,
    **logprob_kwargs,
) -> SPOTokenQuantities:
    """Policy hidden [B, T, H] and LM head shard weight [V_local, H]; targets, mask [B, T]; q0 [B] or a float.

    The reference is either ref_logp [B, T] (already computed, detached here) or ref_hidden [B, T, H]
    with its own LM head shard ref_weight [V_local, H]. logprob_kwargs go to token_logprobs
    (chunk_size, vocab_tile, vocab_start_index, valid_vocab_size, backend, fp8, ...).
    """
    if hidden.dim() != 3:
        raise ValueError(f"spo_token_quantities: hidden must be [B, T, H], got shape {tuple(hidden.shape)}")
    batch, seq, hidden_size = hidden.shape
    for name, value in (("targets", targets), ("mask", mask)):
        if value.shape != (batch, seq):
            raise ValueError(
                f"spo_token_quantities: {name} must be [B, T] = {(batch, seq)}, got shape {tuple(value.shape)}"
            )
    if not (isinstance(beta, (int, float)) and math.isfinite(beta) and beta > 0):
        raise ValueError(f"spo_token_quantities: beta must be a finite number > 0, got {beta!r}")
    if (ref_logp is None) == (ref_hidden is None):
        raise ValueError("spo_token_quantities: pass exactly one of ref_logp or ref_hidden (with ref_weight)")
    if ref_hidden is not None and ref_weight is None:
        raise ValueError(
            "spo_token_quantities: ref_hidden needs ref_weight, the reference model's LM head shard"
        )
    if ref_hidden is not None and ref_hidden.shape != hidden.shape:
        raise ValueError(
            f"spo_token_quantities: ref_hidden must have hidden's shape {tuple(hidden.shape)}, got {tuple(ref_hidden.shape)}"
        )
    if ref_logp is not None and ref_logp.shape != (batch, seq):
        raise ValueError(
            f"spo_token_quantities: ref_logp must be [B, T] = {(batch, seq)}, got shape {tuple(ref_logp.shape)}"
        )
    q0 = torch.as_tensor(q0, dtype=torch.float32, device=hidden.device)
    if q0.dim() == 0:
        q0 = q0.expand(batch)
    if q0.shape != (batch,):
        raise ValueError(
            f"spo_token_quantities: q0 must be a float or [B] = ({batch},), got shape {tuple(q0.shape)}"
        )

    valid = mask if mask.dtype == torch.bool else mask != 0
    flat_valid = valid.reshape(-1)
    positions = torch.nonzero(flat_valid).squeeze(1)  # response tokens only: prompts/padding skip the GEMM
    response_targets = targets.reshape(-1).index_select(0, positions)

    def scatter(values: torch.Tensor) -> torch.Tensor:
        full = torch.zeros(batch * seq, dtype=torch.float32, device=hidden.device)
        return full.index_copy(0, positions, values).view(batch, seq)

    policy_hidden = hidden.reshape(-1, hidden_size).index_select(0, positions)
    logp = scatter(
        token_logprobs(policy_hidden, weight, response_targets, tp_group=tp_group, **logprob_kwargs)
    )
    if ref_logp is None:
        with torch.no_grad():
            reference_hidden = ref_hidden.reshape(-1, hidden_size).index_select(0, positions)
            ref_logp = scatter(
                token_logprobs(
                    reference_hidden, ref_weight, response_targets, tp_group=tp_group, **logprob_kwargs
                )
            )
    else:
        ref_logp = torch.where(valid, ref_logp.detach().float(), torch.zeros((), device=hidden.device))
    advantages = torch.where(valid, beta * (logp - ref_logp), torch.zeros((), device=hidden.device))
    q = q0[:, None] + advantages.cumsum(dim=1)
    return SPOTokenQuantities(logp=logp, ref_logp=ref_logp, advantages=advantages, q=q)
