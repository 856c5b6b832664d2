"""An SPO regression loss of your own, named per data source in the training config:

    sources:
      online: {objective: terminal, loss: examples.custom_loss:huber}

Signature: L(pred_q, target_q, beta, eps) -> elementwise loss tensor (Q values in reward units), like the
built-in losses in megatron_spo/algorithms/spo.py REGRESSION_LOSSES.
"""

import torch


def huber(pred_q: torch.Tensor, target_q: torch.Tensor, beta: float, eps: float) -> torch.Tensor:
    return torch.nn.functional.huber_loss(pred_q, target_q.detach(), reduction="none", delta=0.5)
