"""The trainer's loss dispatch: per-source SPO objectives and exact micro-batch weighting."""

from dataclasses import dataclass, field

import pytest
import torch

from megatron_spo import algorithms
from megatron_spo.data.batching import collate, split_by_token_budget
from megatron_spo.training.algos.agro import agro_batch_loss
from megatron_spo.training.algos.spo import spo_batch_loss
from megatron_spo.training.loss import metric_sums, microbatch_scale


@dataclass
class Traj:
    prompt_tokens: list
    response_tokens: list
    reward: float
    prompt_id: str
    source: str
    policy_version: int = 0
    q0: float = -0.3
    mc_targets: list = field(default_factory=list)


def _batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    trajs = []
    for i in range(8):
        plen = 2 + i % 3
        rlen = 1 + (i * 5) % 6
        toks = torch.randint(1, 9, (plen + rlen,), generator=g).tolist()
        src = ["online", "offline", "mc"][i % 3]
        mc = [{"t": rlen - 1, "success_prob": 0.4}] if src == "mc" else []
        trajs.append(Traj(toks[:plen], toks[plen:], reward=-float(i % 2), prompt_id=f"p{i // 4}", source=src,
                          mc_targets=mc))
    return trajs


OBJ = {"online": ("terminal", "cross_entropy"), "offline": ("reverse_q", "squared"), "mc": ("mc", "cross_entropy")}


def _logps(batch, seed):
    g = torch.Generator().manual_seed(seed)
    shape = batch.input_ids.shape
    return (-torch.rand(shape, generator=g, dtype=torch.float64)).requires_grad_(), \
        -torch.rand(shape, generator=g, dtype=torch.float64)


def test_per_source_loss_is_the_sequence_weighted_mean_of_spo_loss():
    trajs = _batch()
    b = collate(trajs, pad_id=0)
    logp, ref = _logps(b, 1)
    loss, metrics = spo_batch_loss(b, logp, ref, beta=0.5, objectives=OBJ)
    want = 0.0
    for src, (obj, ls) in OBJ.items():
        sub = collate([t for t in trajs if t.source == src], pad_id=0, length=b.input_ids.shape[1])
        rows = [i for i, t in enumerate(trajs) if t.source == src]
        kw = dict(mc_positions=sub.mc_positions, mc_success=sub.mc_success) if obj == "mc" else {}
        part, _ = algorithms.spo_loss(algorithms.SPOInputs(logp[rows], ref[rows], sub.loss_mask, sub.reward, sub.q0,
                                                           **kw), beta=0.5, objective=obj, loss=ls)
        want = want + part * len(rows) / len(trajs)
    assert loss.item() == pytest.approx(want.item(), rel=1e-12)
    assert set(metrics) >= {"loss", "loss/online", "loss/offline", "loss/mc", "terminal_q_abs_error"}


def test_token_budget_micro_batches_give_the_full_batch_gradient():
    trajs = _batch(3)
    full = collate(trajs, pad_id=0)
    logp_full, ref_full = _logps(full, 2)
    loss, _ = spo_batch_loss(full, logp_full, ref_full, beta=0.3, objectives=OBJ)
    loss.backward()
    lengths = [len(t.prompt_tokens) + len(t.response_tokens) - 1 for t in trajs]
    parts = split_by_token_budget(lengths, 24)
    assert len(parts) > 1
    grads = torch.zeros_like(logp_full)
    for rows in parts:
        mb = collate([trajs[i] for i in rows], pad_id=0, length=full.input_ids.shape[1])
        lp = logp_full.detach()[rows].clone().requires_grad_()
        l_mb, _ = spo_batch_loss(mb, lp, ref_full[rows], beta=0.3, objectives=OBJ)
        # what megatron does: divide by num_microbatches; DDP averages over dp ranks (1 here)
        (l_mb * microbatch_scale(len(rows), len(parts), 1, len(trajs)) / len(parts)).backward()
        grads[rows] += lp.grad
    torch.testing.assert_close(grads, logp_full.grad, rtol=1e-12, atol=1e-14)


def test_centred_baselines_over_the_step_give_the_whole_batchs_gradient_when_micro_batches_cut_groups():
    """A centred source with groups cut across micro-batches: the step-wide baselines (one no-grad pass over
    every micro-batch, as SPO.update takes them) give exactly the gradient and residual_group_var of the whole
    batch with its groups intact, for the squared and the cross-entropy loss. Within each micro-batch alone the
    groups would be centred on what the cut left there, a different gradient."""
    from megatron_spo.algorithms.spo_transforms import centre_groups
    from megatron_spo.data.batching import group_numbers
    from megatron_spo.training.algos.spo import step_coefficient_baselines

    trajs = _batch(11)
    for i, t in enumerate(trajs):  # groups of 4, 3 online + 1 offline: the online rows of a group, cut below
        t.source = "offline" if i % 4 == 3 else "online"
        t.reward = -float(i % 3 == 0)
    ids = group_numbers([t.prompt_id for t in trajs])
    full = collate(trajs, pad_id=0)
    for loss_name in ("squared", "cross_entropy"):
        obj = {"online": ("terminal", loss_name), "offline": ("reverse_q", "squared")}
        logp_full, ref_full = _logps(full, 4)
        loss, want = spo_batch_loss(full, logp_full, ref_full, beta=0.4, objectives=obj,
                                    transforms={"online": (centre_groups,)})
        loss.backward()
        parts = [[0, 1, 4], [2, 3, 5, 6], [7]]  # group p0 split 2 + 1 online rows, p1 1 + 2
        mbs = [collate([trajs[i] for i in rows], pad_id=0, length=full.input_ids.shape[1],
                       group_ids=[ids[i] for i in rows]) for rows in parts]
        baselines, step_stats = step_coefficient_baselines(
            mbs, [logp_full.detach()[rows] for rows in parts], [ref_full[rows] for rows in parts], beta=0.4,
            objectives=obj, centred=frozenset({"online"}))
        grads, local = torch.zeros_like(logp_full), torch.zeros_like(logp_full)
        for mb, rows, baseline in zip(mbs, parts, baselines):
            for given, into in ((baseline, grads), (None, local)):
                lp = logp_full.detach()[rows].clone().requires_grad_()
                l_mb, _ = spo_batch_loss(mb, lp, ref_full[rows], beta=0.4, objectives=obj,
                                         transforms={"online": (centre_groups,)}, coefficient_baseline=given)
                (l_mb * microbatch_scale(len(rows), len(parts), 1, len(trajs)) / len(parts)).backward()
                into[rows] += lp.grad
        torch.testing.assert_close(grads, logp_full.grad, rtol=1e-10, atol=1e-13)
        assert (local - logp_full.grad).abs().max() > 1e-3  # centring inside each micro-batch alone differs
        var, n = step_stats["residual_group_var/online"]
        assert n == 6 and var == pytest.approx(want["residual_group_var/online"][0], rel=1e-10)


def _micro_batch_metrics(trajs, parts, loss_fn):
    """(full-batch metrics, the trainer's reduction of per-micro-batch metrics) for one batch."""
    full = collate(trajs, pad_id=0)
    logp, ref = _logps(full, 5)
    _, want = loss_fn(full, logp, ref)
    store = []
    for rows in parts:
        mb = collate([trajs[i] for i in rows], pad_id=0, length=full.input_ids.shape[1])
        store.append({"metrics": loss_fn(mb, logp[rows], ref[rows])[1], "n": mb.num_sequences})
    got = {k: s / n for k, (s, n) in metric_sums(store).items() if n}
    want = {k: v[0] if isinstance(v, tuple) else v for k, v in want.items()}
    return want, got


def test_logged_metrics_are_the_full_batchs_however_micro_batches_split_it():
    """Per-source metrics (a micro-batch may hold 1 of its 3 offline rows) and per-token ones reduce to the
    value the whole batch gives; a plain per-micro-batch sequence weighting would not."""
    trajs = _batch(7)
    parts = split_by_token_budget([len(t.prompt_tokens) + len(t.response_tokens) - 1 for t in trajs], 13)
    assert len(parts) >= 3
    want, got = _micro_batch_metrics(trajs, parts, lambda b, lp, r: spo_batch_loss(
        b, lp, r, beta=0.5, objectives=OBJ))
    assert {"loss/offline", "mean_seq_log_ratio/online", "mean_token_advantage/mc"} <= set(want)
    assert got.keys() == want.keys()
    for k in want:
        assert got[k] == pytest.approx(want[k], rel=1e-9, abs=1e-12), k
    # AGRO: micro-batches hold whole prompt groups (pairs here); the per-source log-ratios reduce exactly too
    for i, t in enumerate(trajs):
        t.prompt_id = f"g{i // 2}"
    want, got = _micro_batch_metrics(trajs, [[0, 1, 2, 3], [4, 5], [6, 7]], lambda b, lp, r: agro_batch_loss(
        b, lp, r, beta=0.5, on_policy=False))
    assert {"mean_seq_log_ratio/online", "mean_seq_log_ratio/offline"} <= set(want)
    for k in ("mean_seq_log_ratio", "mean_seq_log_ratio/online", "mean_seq_log_ratio/offline",
              "mean_seq_log_ratio/mc"):
        assert got[k] == pytest.approx(want[k], rel=1e-9), k


def test_unconfigured_source_is_named():
    b = collate(_batch(), pad_id=0)
    logp, ref = _logps(b, 0)
    with pytest.raises(ValueError, match="source 'mc' but the config names no objective for it"):
        spo_batch_loss(b, logp, ref, beta=0.5, objectives={k: v for k, v in OBJ.items() if k != "mc"})


def test_agro_dispatch_uses_prompt_groups():
    trajs = _batch()
    b = collate(trajs, pad_id=0)
    logp, ref = _logps(b, 4)
    loss, _ = agro_batch_loss(b, logp, ref, beta=0.5, on_policy=False)
    want, _ = algorithms.agro_loss(logp, ref, b.loss_mask, b.reward, torch.tensor([0] * 4 + [1] * 4),
                                   beta=0.5, on_policy=False)
    assert loss.item() == pytest.approx(want.item(), rel=1e-12)
