"""The local (no Transformer Engine) spec's RMSNorm, usable under sequence parallelism.

megatron-core's local spec builds its norms with ``WrappedTorchNorm``, a plain ``torch.nn.RMSNorm`` that asserts
``not config.sequence_parallel``: under SP a norm sees only its TP rank's share of the sequence, so its weight's
gradient is partial on every rank, and megatron-core sums such gradients over TP only for parameters marked
``sequence_parallel`` (distributed/finalize_model_grads.py, ``_allreduce_non_tensor_model_parallel_grads``, as TE's
and apex's norms mark theirs). ``SequenceParallelRMSNorm`` is that RMSNorm with the mark; ``HeadRMSNorm`` is the
q / k norm (over head_dim, after the QKV projection has gathered the sequence: never on a sequence shard; megatron
sums its gradient over TP by name when qk_layernorm). Both compute exactly what ``torch.nn.RMSNorm`` computes.
"""

from __future__ import annotations

import torch


def _check(config, normalization: str, zero_centered_gamma: bool) -> None:
    if config.normalization != "RMSNorm" or normalization not in ("RMSNorm", "LayerNorm"):
        raise ValueError(f"norms: the local spec's norm is RMSNorm (config.normalization {config.normalization!r})")
    if zero_centered_gamma or config.layernorm_zero_centered_gamma:
        raise ValueError("norms: zero-centred gamma is not supported by the local spec's RMSNorm")


class SequenceParallelRMSNorm(torch.nn.RMSNorm):
    """RMSNorm over the last dim of [s, b, h] (s: this TP rank's share under SP) whose weight carries
    ``sequence_parallel = config.sequence_parallel`` (its gradient is summed over TP by megatron-core)."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, persist_layer_norm: bool = False,
                 zero_centered_gamma: bool = False, normalization: str = "RMSNorm"):
        _check(config, normalization, zero_centered_gamma)
        super().__init__(normalized_shape=hidden_size, eps=eps)
        self.weight.sequence_parallel = bool(config.sequence_parallel)


class HeadRMSNorm(torch.nn.RMSNorm):
    """The per-head q / k RMSNorm [..., head_dim] (not on a sequence shard: no mark)."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, persist_layer_norm: bool = False,
                 zero_centered_gamma: bool = False, normalization: str = "RMSNorm"):
        _check(config, normalization, zero_centered_gamma)
        super().__init__(normalized_shape=hidden_size, eps=eps)
