"""Token log-probs of the LM head without materialising tokens x vocabulary (see token_logprobs.py).

Imports nothing of the project but megatron_spo.extras; the Triton kernels load only when used.
"""

from megatron_spo.ops.reference import token_logprobs_reference
from megatron_spo.ops.token_logprobs import (
    FP8UnavailableError,
    default_block_shape,
    fp8_available,
    token_logprobs,
)

__all__ = [
    "FP8UnavailableError",
    "default_block_shape",
    "fp8_available",
    "token_logprobs",
    "token_logprobs_reference",
]
