"""Statistics inside prompt groups (the responses sampled for one prompt): leave-one-out baselines."""

from __future__ import annotations

import torch
from torch import Tensor


def leave_one_out_stats(
    values: Tensor, group: Tensor, min_group_size: int, where: str
) -> tuple[Tensor, Tensor, Tensor]:
    """Per element i, inside its group g: (values_i - mean_{j != i} values_j, the unbiased variance of
    {values_j : j != i}, the unbiased variance of the whole group), each [B].

    values, group: [B]. Centred on the group mean first, so nothing cancels catastrophically:
    with d_i = v_i - mean_g and n = |g|: v_i - b_i = d_i * n / (n - 1) and
    var_{-i} = (sum_g d^2 - d_i^2 * n / (n - 1)) / (n - 2) (NaN-free only for n >= 3).
    """
    _, index = torch.unique(group, return_inverse=True)
    n_groups = int(index.max()) + 1
    counts = torch.zeros(n_groups, dtype=values.dtype, device=values.device).index_add_(
        0, index, torch.ones_like(values)
    )
    smallest = int(counts.min())
    if smallest < min_group_size:
        raise ValueError(
            f"{where}: every prompt group needs >= {min_group_size} responses for leave-one-out baselines, "
            f"the smallest has {smallest}"
        )
    sums = torch.zeros_like(counts).index_add_(0, index, values)
    n = counts[index]
    centred = values - (sums / counts)[index]
    minus_baseline = centred * n / (n - 1)
    sq = torch.zeros_like(counts).index_add_(0, index, centred**2)[index]
    var_others = (sq - centred**2 * n / (n - 1)) / (n - 2).clamp(min=1)
    return minus_baseline, var_others, sq / (n - 1)


def centred_on_others(values: Tensor, group: Tensor) -> Tensor:
    """values_i - mean_{j in group(i), j != i} values_j, [B]; values, group [B].

    A sequence alone in its group (a group cut by the batch boundary, or shared with another source) is centred
    on the mean of every other sequence instead; a batch of one sequence is left as it is.
    """
    b = values.shape[0]
    if b == 1:
        return values
    _, index = torch.unique(group, return_inverse=True)
    counts = torch.zeros(int(index.max()) + 1, dtype=values.dtype, device=values.device).index_add_(
        0, index, torch.ones_like(values))
    sums = torch.zeros_like(counts).index_add_(0, index, values)
    n = counts[index]
    in_group = (values - (sums / counts)[index]) * n / (n - 1).clamp(min=1)  # = v_i - mean of the others
    in_batch = (values - values.mean()) * b / (b - 1)
    return torch.where(n > 1, in_group, in_batch)


def group_mean(values: Tensor, group: Tensor) -> Tensor:
    """The mean of each element's group, [B]; values, group [B]."""
    _, index = torch.unique(group, return_inverse=True)
    sums = torch.zeros(int(index.max()) + 1, dtype=values.dtype, device=values.device).index_add_(0, index, values)
    counts = torch.zeros_like(sums).index_add_(0, index, torch.ones_like(values))
    return (sums / counts)[index]
