"""Plain reference for token log-probs: logits -> log_softmax -> gather. For tests and benchmarks only.

It materialises the [N, V] logits (and, under autograd, their gradient): exactly what the fused op in
``token_logprobs.py`` avoids. Computed in fp32 for fp32/bf16/fp16 inputs, in fp64 for fp64 inputs.
"""

from __future__ import annotations

import torch


def token_logprobs_reference(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    ignore_index: int = -100,
    valid_vocab_size: int | None = None,
    return_entropy: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """log p(targets) [N] fp32 or fp64 (and entropy [N]) from hidden [N, H] and the FULL LM head weight [V, H].

    Rows of ``weight`` at index >= valid_vocab_size are vocabulary padding and are left out of the
    softmax. Tokens whose target is ``ignore_index`` get log-prob 0 and entropy 0 (and no gradient).
    """
    dtype = torch.promote_types(hidden.dtype, torch.float32)  # fp64 inputs stay fp64 (a tighter truth)
    logits = hidden.to(dtype) @ weight.to(dtype).t()
    if valid_vocab_size is not None:
        logits = logits[:, :valid_vocab_size]  # padding never enters the softmax
    logprobs = torch.log_softmax(logits, dim=-1)
    ignored = targets == ignore_index
    safe_targets = targets.masked_fill(ignored, 0).long()
    logp = logprobs.gather(1, safe_targets[:, None]).squeeze(1).masked_fill(ignored, 0.0)
    if not return_entropy:
        return logp
    entropy = -(logprobs.exp() * logprobs).sum(-1).masked_fill(ignored, 0.0)
    return logp, entropy
