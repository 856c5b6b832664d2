"""From trajectory records to training tensors: shift, pad, micro-batch by token budget, mix sources.

Layout of one sequence (prompt p_1..p_P, response a_1..a_T), as the model sees it:

    input_ids = [p_1 .. p_P, a_1 .. a_{T-1}]          (length P + T - 1)
    targets   = [p_2 .. p_P, a_1 .. a_T]              (the token predicted at each position)
    loss_mask = [0 .. 0,     1 .. 1]                  (1 where the target is a response token the model
                                                       sampled: a multi-turn record's environment tokens are 0)

so log pi(a_t | a_<t, x) sits at position P - 1 + (t - 1) and the algorithms' [B, T] tensors are these
rows with the prompt part masked out (cumulative_q holds q0 until the first response token).
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any, Protocol

import torch


class TrajectoryLike(Protocol):
    prompt_id: Any
    prompt_tokens: Sequence[int]
    response_tokens: Sequence[int]
    reward: float
    source: str
    policy_version: int


@dataclass
class TrainBatch:
    """One micro-batch. Shapes: [B, L] token tensors, [B] per-sequence values."""

    input_ids: torch.Tensor  # [B, L] long
    targets: torch.Tensor  # [B, L] long (pad positions hold pad_id; masked out)
    loss_mask: torch.Tensor  # [B, L] float, 1 = target is a response token
    position_ids: torch.Tensor  # [B, L] long
    reward: torch.Tensor  # [B] float
    q0: torch.Tensor  # [B] float (0 where unknown)
    group: torch.Tensor  # [B] long: prompt group ids (for leave-one-out baselines)
    source: list[str]  # [B]
    policy_version: torch.Tensor  # [B] long
    behaviour_logp: torch.Tensor  # [B, L] float (0 where not given)
    # [B] float: the temperature and top-p the behaviour log-probs were sampled at (NaN: none, or unknown)
    behaviour_temperature: torch.Tensor
    behaviour_top_p: torch.Tensor
    mc_positions: torch.Tensor  # [B, K] long positions in L (-1 = none)
    mc_success: torch.Tensor  # [B, K] float success probabilities S_t
    lengths: torch.Tensor  # [B] long: tokens of each row before its padding (prompt + response - 1)
    # [B, L, layers, top_k] int32: the experts the engine routed each input token to (routing replay); -1 where
    # the router chooses itself (rows without routes, padding). None: no row of the batch carries routes
    routes: torch.Tensor | None = None
    # [B, L] float, no grad: the policy's log-probs of the targets at each row's behaviour temperature (log softmax
    # (logits / T), as the engines report theirs), set by the trainer for a training pass's loss where a row was
    # sampled at T != 1 (its other rows: the T = 1 log-probs). None: every row's behaviour is of T = 1, or none
    sampler_logp: torch.Tensor | None = None

    @property
    def num_sequences(self) -> int:
        return self.input_ids.shape[0]

    @property
    def num_response_tokens(self) -> int:
        return int(self.loss_mask.sum().item())

    def to(self, device) -> TrainBatch:
        return TrainBatch(**{f.name: (v.to(device) if torch.is_tensor(v) else v)
                             for f in fields(self) for v in [getattr(self, f.name)]})

    def select(self, index: torch.Tensor | slice) -> TrainBatch:
        """Rows of this batch (for data-parallel shards)."""
        if isinstance(index, slice):
            idx = list(range(self.num_sequences))[index]
        else:
            idx = index.tolist()
        out = {}
        for f in fields(self):
            v = getattr(self, f.name)
            out[f.name] = v[idx] if torch.is_tensor(v) else None if v is None else [v[i] for i in idx]
        return TrainBatch(**out)


def group_numbers(prompt_ids: Sequence[Any]) -> list[int]:
    """0, 1, ... per distinct prompt id, in order of first appearance."""
    mapping: dict[Any, int] = {}
    return [mapping.setdefault(pid, len(mapping)) for pid in prompt_ids]


def collate(trajectories: Sequence[TrajectoryLike], pad_id: int, length: int | None = None,
            group_ids: Sequence[int] | None = None) -> TrainBatch:
    """Shift, right-pad to `length` (default: longest) and stack. Raises on an empty response.

    group_ids: each trajectory's prompt-group id (default: numbered by prompt_id inside this batch); the trainer
    numbers them over the whole step, so one group keeps one id in every micro-batch it is cut into."""
    if not trajectories:
        raise ValueError("collate: no trajectories")
    if group_ids is not None and len(group_ids) != len(trajectories):
        raise ValueError(f"collate: {len(group_ids)} group_ids for {len(trajectories)} trajectories")
    rows = []
    for i, tr in enumerate(trajectories):
        prompt, response = list(tr.prompt_tokens), list(tr.response_tokens)
        if not prompt:
            raise ValueError(f"collate: trajectory {i} (prompt_id {tr.prompt_id!r}) has an empty prompt")
        if not response:
            raise ValueError(f"collate: trajectory {i} (prompt_id {tr.prompt_id!r}) has an empty response")
        rows.append((prompt, response))
    longest = max(len(p) + len(r) - 1 for p, r in rows)
    length = length or longest
    if length < longest:
        raise ValueError(f"collate: length {length} is shorter than the longest sequence ({longest} tokens)")
    max_mc = max((len(getattr(tr, "mc_targets", None) or []) for tr in trajectories), default=0)
    b = len(rows)
    input_ids = torch.full((b, length), pad_id, dtype=torch.long)
    targets = torch.full((b, length), pad_id, dtype=torch.long)
    loss_mask = torch.zeros((b, length))
    behaviour = torch.zeros((b, length))
    mc_positions = torch.full((b, max(max_mc, 1)), -1, dtype=torch.long)
    mc_success = torch.zeros((b, max(max_mc, 1)))
    for i, ((prompt, response), tr) in enumerate(zip(rows, trajectories)):
        seq = prompt + response
        n = len(seq) - 1
        first = len(prompt) - 1  # position whose target is a_1
        input_ids[i, :n] = torch.tensor(seq[:-1])
        targets[i, :n] = torch.tensor(seq[1:])
        turns = getattr(tr, "response_mask", None)  # multi-turn: the environment's tokens are context, not trained
        if turns is not None and len(turns) != len(response):
            raise ValueError(f"collate: trajectory {i} has {len(turns)} response_mask entries for {len(response)} "
                             "response tokens")
        loss_mask[i, first:n] = 1.0 if turns is None else torch.tensor([float(m) for m in turns])
        blp = getattr(tr, "behaviour_logprobs", None)
        if blp is not None:
            if len(blp) != len(response):
                raise ValueError(f"collate: trajectory {i} has {len(blp)} behaviour_logprobs for "
                                 f"{len(response)} response tokens")
            behaviour[i, first:n] = torch.tensor([float(x) for x in blp])
        for k, mc in enumerate(getattr(tr, "mc_targets", None) or []):
            t, p = _mc_fields(mc)
            if not 0 <= t < len(response):
                raise ValueError(f"collate: trajectory {i} mc_targets[{k}].t = {t} is outside the response "
                                 f"(length {len(response)})")
            mc_positions[i, k] = first + t  # Q after response token t (0-based) sits at that token's position
            mc_success[i, k] = p
    return TrainBatch(
        input_ids=input_ids,
        targets=targets,
        loss_mask=loss_mask,
        position_ids=torch.arange(length).unsqueeze(0).expand(b, length).clone(),
        reward=torch.tensor([float(tr.reward) for tr in trajectories]),
        q0=torch.tensor([float(getattr(tr, "q0", None) or 0.0) for tr in trajectories]),
        group=torch.tensor(list(group_ids) if group_ids is not None else
                           group_numbers([tr.prompt_id for tr in trajectories]), dtype=torch.long),
        source=[tr.source for tr in trajectories],
        policy_version=torch.tensor([int(tr.policy_version) for tr in trajectories], dtype=torch.long),
        behaviour_logp=behaviour,
        behaviour_temperature=torch.tensor([sampling_settings(tr)[0] for tr in trajectories]),
        behaviour_top_p=torch.tensor([sampling_settings(tr)[1] for tr in trajectories]),
        mc_positions=mc_positions,
        mc_success=mc_success,
        lengths=torch.tensor([len(p) + len(r) - 1 for p, r in rows], dtype=torch.long),
        routes=collate_routes(trajectories, length),
    )


def collate_routes(trajectories: Sequence[TrajectoryLike], length: int) -> torch.Tensor | None:
    """[B, length, layers, top_k] int32 of the trajectories' routed_experts (data/routes.py; positions past a
    row's prompt + response - 1 and rows without routes hold -1), or None when none has any."""
    routed = [getattr(tr, "routed_experts", None) for tr in trajectories]
    shapes = {(r.layers, r.top_k) for r in routed if r is not None}
    if not shapes:
        return None
    if len(shapes) > 1:
        raise ValueError(f"collate: routed_experts of different shapes (layers, top_k) {sorted(shapes)} in one batch")
    (layers, top_k), = shapes
    out = torch.full((len(routed), length, layers, top_k), -1, dtype=torch.int32)
    for i, r in enumerate(routed):
        if r is not None:
            out[i, :r.tokens] = torch.from_numpy(r.array())
    return out


def sampling_settings(traj) -> tuple[float, float]:
    """(temperature, top_p) its behaviour log-probs were taken at: NaN, NaN when it has none or they are unknown.
    Greedy samples (T = 0) report the raw log-probs: temperature 1. Online trajectories carry the settings
    themselves (rollout/manager.py), records in their provenance."""
    if getattr(traj, "behaviour_logprobs", None) is None:
        return math.nan, math.nan
    prov = getattr(traj, "provenance", None)
    t = getattr(traj, "temperature", None)
    p = getattr(traj, "top_p", None)
    if t is None and prov is not None:
        t, p = getattr(prov, "temperature", None), getattr(prov, "top_p", None)
    if t is None:
        return math.nan, math.nan
    return (float(t) or 1.0), (math.nan if p is None else float(p))


def _mc_fields(mc: Any) -> tuple[int, float]:
    if isinstance(mc, dict):
        return int(mc["t"]), float(mc["success_prob"])
    return int(mc.t), float(mc.success_prob)


def split_by_token_budget(lengths: Sequence[int], max_tokens: int, *, keep_groups: Sequence[Any] | None = None,
                          packed: bool = False) -> list[list[int]]:
    """Greedy micro-batches of sequence indices whose size stays <= max_tokens: count x longest (padded rows),
    or the sum of the lengths (packed: sequences back to back, models/packing.py).

    Sequences sharing a group id stay in one micro-batch when keep_groups is given (AGRO's and the
    leave-one-out baselines need a whole prompt group in one loss call). Order is preserved.
    """
    units: list[list[int]] = []
    if keep_groups is None:
        units = [[i] for i in range(len(lengths))]
    else:
        by_group: dict[Any, list[int]] = {}
        for i, g in enumerate(keep_groups):
            by_group.setdefault(g, []).append(i)
        units = list(by_group.values())

    def size(rows: list[int]) -> int:
        return sum(lengths[i] for i in rows) if packed else len(rows) * max(lengths[i] for i in rows)

    batches: list[list[int]] = []
    current: list[int] = []
    for unit in units:
        if size(unit) > max_tokens:
            raise ValueError(f"split_by_token_budget: a group of {len(unit)} sequences of up to "
                             f"{max(lengths[i] for i in unit)} tokens does not fit max_tokens {max_tokens}")
        if current and size(current + unit) > max_tokens:
            batches.append(current)
            current = []
        current = current + unit
    if current:
        batches.append(current)
    return batches


def pad_share(lengths: Sequence[int], parts: Sequence[Sequence[int]], *, packed: bool, width: int | None = None,
              multiple: int = 1) -> float:
    """Fraction of the tokens a step computes that are padding: micro-batches `parts` (indices into lengths) as
    padded rows (rows x the longest row, or x width) or packed streams (their tokens, or width), each rounded up to
    a multiple (sequence parallelism)."""
    real = sum(lengths[i] for part in parts for i in part)
    computed = 0
    for part in parts:
        size = sum(lengths[i] for i in part) if packed else max(lengths[i] for i in part)
        size = -(-(width or size) // multiple) * multiple
        computed += size if packed else size * len(part)
    return 1.0 - real / computed if computed else 0.0


def source_counts(weights: dict[str, float], total: int) -> dict[str, int]:
    """Integer counts per source summing to `total`, proportional to weights (largest remainder)."""
    if total < 0:
        raise ValueError(f"source_counts: total must be >= 0, got {total}")
    wsum = sum(weights.values())
    if not weights or wsum <= 0 or any(w < 0 for w in weights.values()):
        raise ValueError(f"source_counts: weights must be non-negative with a positive sum, got {weights}")
    exact = {k: total * w / wsum for k, w in weights.items()}
    counts = {k: math.floor(v) for k, v in exact.items()}
    rest = total - sum(counts.values())
    for k in sorted(exact, key=lambda k: (exact[k] - counts[k], weights[k]), reverse=True)[:rest]:
        counts[k] += 1
    return counts


class OfflineCursor:
    """Deterministic, resumable pass over an offline dataset in shuffled epochs.

    state_dict() / load_state_dict() capture (epoch, position) so a resumed run draws exactly the
    records the uninterrupted run would have drawn.
    """

    def __init__(self, size: int, seed: int = 0):
        if size <= 0:
            raise ValueError("OfflineCursor: the offline dataset is empty")
        self.size, self.seed = size, seed
        self.epoch, self.position = 0, 0
        self._order = self._permutation(0)

    def _permutation(self, epoch: int) -> list[int]:
        order = list(range(self.size))
        random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
        return order

    def take(self, k: int) -> list[int]:
        out = []
        while len(out) < k:
            if self.position == self.size:
                self.epoch += 1
                self.position = 0
                self._order = self._permutation(self.epoch)
            n = min(k - len(out), self.size - self.position)
            out.extend(self._order[self.position:self.position + n])
            self.position += n
        return out

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position, "size": self.size, "seed": self.seed}

    def load_state_dict(self, state: dict) -> None:
        if state["size"] != self.size:
            raise ValueError(f"OfflineCursor: checkpoint was taken over {state['size']} records, "
                             f"the offline dataset now has {self.size}")
        self.seed, self.epoch, self.position = state["seed"], state["epoch"], state["position"]
        self._order = self._permutation(self.epoch)
