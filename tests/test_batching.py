"""Trajectory -> training tensors: alignment of log-prob positions, token budgets, source mixing, cursors."""

from dataclasses import dataclass, field

import pytest
import torch

from megatron_spo.data.batching import OfflineCursor, collate, source_counts, split_by_token_budget


@dataclass
class Traj:
    prompt_tokens: list
    response_tokens: list
    reward: float = 0.0
    prompt_id: str = "p"
    source: str = "online"
    policy_version: int = 0
    q0: float | None = None
    behaviour_logprobs: list | None = None
    mc_targets: list = field(default_factory=list)


def test_collate_aligns_targets_mask_and_behaviour_logprobs():
    b = collate([Traj([1, 2, 3], [7, 8], reward=-1, prompt_id="a", q0=-0.5, behaviour_logprobs=[-0.1, -0.2]),
                 Traj([4], [9, 9, 5], prompt_id="b", mc_targets=[{"t": 1, "success_prob": 0.25}])], pad_id=0)
    assert b.input_ids.tolist() == [[1, 2, 3, 7], [4, 9, 9, 0]]
    assert b.targets.tolist() == [[2, 3, 7, 8], [9, 9, 5, 0]]
    assert b.loss_mask.tolist() == [[0, 0, 1, 1], [1, 1, 1, 0]]
    assert b.behaviour_logp[0].tolist() == pytest.approx([0, 0, -0.1, -0.2])
    assert b.reward.tolist() == [-1.0, 0.0] and b.q0.tolist() == [-0.5, 0.0]
    assert b.group.tolist() == [0, 1]
    # Q after response token index 1 of sequence 2 lives at position 1 (targets[1, 1] == a_2)
    assert b.mc_positions.tolist() == [[-1], [1]] and b.mc_success[1, 0].item() == 0.25
    assert b.num_response_tokens == 5


def test_collate_logprob_positions_match_a_real_causal_model():
    torch.manual_seed(0)
    emb = torch.nn.Embedding(11, 11)
    trajs = [Traj([1, 2], [3, 4, 5]), Traj([6, 7, 8], [9])]
    b = collate(trajs, pad_id=0)
    logp = torch.log_softmax(emb(b.input_ids), -1).gather(-1, b.targets.unsqueeze(-1)).squeeze(-1)
    # the masked log-probs are exactly the log-probs of each response token given its prefix
    for i, tr in enumerate(trajs):
        seq = tr.prompt_tokens + tr.response_tokens
        want = [torch.log_softmax(emb.weight[seq[j - 1]], -1)[seq[j]].item()
                for j in range(len(tr.prompt_tokens), len(seq))]
        assert logp[i][b.loss_mask[i].bool()].tolist() == pytest.approx(want)


def test_collate_rejects_bad_records_with_names():
    with pytest.raises(ValueError, match=r"trajectory 1 \(prompt_id 'x'\) has an empty response"):
        collate([Traj([1], [2]), Traj([1], [], prompt_id="x")], pad_id=0)
    with pytest.raises(ValueError, match="trajectory 0 has 1 behaviour_logprobs for 2 response tokens"):
        collate([Traj([1], [2, 3], behaviour_logprobs=[0.0])], pad_id=0)
    with pytest.raises(ValueError, match=r"mc_targets\[0\].t = 5 is outside the response"):
        collate([Traj([1], [2, 3], mc_targets=[{"t": 5, "success_prob": 0.5}])], pad_id=0)
    with pytest.raises(ValueError, match="length 2 is shorter than the longest sequence"):
        collate([Traj([1, 2], [3, 4])], pad_id=0, length=2)


def test_token_budget_split_keeps_groups_and_budget():
    lengths = [10, 10, 30, 30, 5, 5]
    batches = split_by_token_budget(lengths, 60)
    assert batches == [[0, 1], [2, 3], [4, 5]]
    assert all(len(b) * max(lengths[i] for i in b) <= 60 for b in batches)
    grouped = split_by_token_budget(lengths, 60, keep_groups=["a", "b", "a", "b", "c", "c"])
    assert grouped == [[0, 2], [1, 3], [4, 5]]
    with pytest.raises(ValueError, match="a group of 2 sequences of up to 30 tokens does not fit max_tokens 50"):
        split_by_token_budget(lengths, 50, keep_groups=["a", "b", "a", "b", "c", "c"])


def test_source_counts_largest_remainder():
    assert source_counts({"online": 0.5, "offline": 0.5}, 8) == {"online": 4, "offline": 4}
    assert source_counts({"online": 2, "offline": 1}, 8) == {"online": 5, "offline": 3}
    assert sum(source_counts({"a": 1, "b": 1, "c": 1}, 10).values()) == 10
    with pytest.raises(ValueError, match="positive sum"):
        source_counts({"a": 0.0}, 4)


def test_offline_cursor_resumes_exactly():
    straight = OfflineCursor(7, seed=3)
    drawn = [straight.take(3) for _ in range(6)]
    assert sorted(sum(drawn[:2], []) + straight._permutation(0)[6:7]) == list(range(7))  # epoch 0 is a permutation
    resumed = OfflineCursor(7, seed=3)
    first = [resumed.take(3) for _ in range(2)]
    state = resumed.state_dict()
    again = OfflineCursor(7, seed=3)
    again.load_state_dict(state)
    assert first + [again.take(3) for _ in range(4)] == drawn
    with pytest.raises(ValueError, match="taken over 7 records, the offline dataset now has 8"):
        OfflineCursor(8).load_state_dict(state)
