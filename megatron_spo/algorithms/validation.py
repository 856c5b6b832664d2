"""Cheap input checks shared by every loss: shapes (Python only) and one fused finiteness check.

On the happy path the whole check costs a few elementwise kernels and ONE device sync. Only when that
sync says something is wrong do we spend time building the message that names the argument.
"""

from __future__ import annotations

import torch
from torch import Tensor


def upcast(x: Tensor | None) -> Tensor | None:
    """Half-precision log-probs become float32: sums over thousands of tokens are meaningless in bf16.
    The upcast is differentiable, so gradients flow back in the input's dtype."""
    if x is not None and x.dtype in (torch.float16, torch.bfloat16):
        return x.float()
    return x


def check_token_inputs(
    where: str,
    mask: Tensor,
    token_tensors: dict[str, Tensor | None],
    row_tensors: dict[str, Tensor | None] | None = None,
    *,
    allow_empty_rows: bool = False,
) -> Tensor:
    """Validate [B, T] per-token tensors and [B] per-sequence tensors; return the mask as a bool tensor.

    where: the caller's name, the first word of every message ("spo_loss: ...").
    token_tensors: name -> [B, T] tensor; only response positions (mask != 0) must be finite, so padding
      may hold anything (an engine returns null log-probs there).
    row_tensors: name -> [B] tensor; every element must be finite.
    Raises ValueError naming the argument and the problem.
    """
    row_tensors = row_tensors or {}
    if mask.dim() != 2:
        raise ValueError(f"{where}: mask must be 2-D [batch, tokens], got shape {tuple(mask.shape)}")
    batch = mask.shape[0]
    for name, x in token_tensors.items():
        if x is not None and x.shape != mask.shape:
            raise ValueError(f"{where}: {name} shape {tuple(x.shape)} != mask shape {tuple(mask.shape)}")
    for name, x in row_tensors.items():
        if x is not None and tuple(x.shape) != (batch,):
            raise ValueError(f"{where}: {name} shape {tuple(x.shape)} != ({batch},) (one value per sequence)")
    if batch == 0:
        raise ValueError(f"{where}: empty batch (mask shape {tuple(mask.shape)})")

    valid = mask if mask.dtype == torch.bool else mask != 0
    # One probe for all tensors: a NaN or inf anywhere makes the sum non-finite (inf - inf is NaN), and
    # where() hides padding. Finite values overflowing the sum would be a false alarm; the detailed pass
    # below then finds nothing wrong and lets the call through.
    zero = torch.zeros((), dtype=torch.float32, device=mask.device)
    probe = zero
    for x in token_tensors.values():
        if x is not None:
            probe = probe + torch.where(valid, x, zero).sum()
    for x in row_tensors.values():
        if x is not None and x.is_floating_point():
            probe = probe + x.sum()
    flags = torch.isfinite(probe) if allow_empty_rows else torch.isfinite(probe) & valid.any(dim=1).all()
    if bool(flags):  # the single sync
        return valid
    _raise_detailed(where, valid, token_tensors, row_tensors, allow_empty_rows)
    return valid


def _describe_bad(x: Tensor) -> str:
    n_nan = int(torch.isnan(x).sum())
    n_inf = int(torch.isinf(x).sum())
    parts = [f"{n_nan} NaN values"] if n_nan else []
    parts += [f"{n_inf} inf values"] if n_inf else []
    return " and ".join(parts)


def _raise_detailed(where, valid, token_tensors, row_tensors, allow_empty_rows) -> None:
    for name, x in row_tensors.items():
        if x is not None and not bool(torch.isfinite(x).all()):
            raise ValueError(f"{where}: {name} has {_describe_bad(x)}")
    for name, x in token_tensors.items():
        if x is not None:
            on_response = x[valid]
            if not bool(torch.isfinite(on_response).all()):
                raise ValueError(f"{where}: {name} has {_describe_bad(on_response)} at response positions")
    if not allow_empty_rows:
        empty = (~valid.any(dim=1)).nonzero().flatten().tolist()
        if empty:
            shown = ", ".join(str(i) for i in empty[:8]) + (", ..." if len(empty) > 8 else "")
            raise ValueError(
                f"{where}: mask has {len(empty)} empty response(s) (rows {shown} have no tokens)"
            )
