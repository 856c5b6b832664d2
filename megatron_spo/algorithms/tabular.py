"""Tabular soft-RL problems where every quantity is exact: pi*, Z, Q*, KL(pi || pi*).

A policy is a table of logits [num_states, vocab]; a state is a response prefix. Two problems:
  bandit(arms)                   one step, real-valued rewards
  autoregressive(vocab, length)  every token string of that length (vocab ** length sequences), binary
                                 rewards in {0 (success), -1}; an optional EOS token ends a response early.
Batches put each sampled response at a random offset inside a longer row (left and right padding), so the
losses see masks exactly as they do with real padded batches. Pure torch, float64, seeded generators.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import torch
from torch import Tensor

from megatron_spo.algorithms.agro import agro_loss, kl_pg_loss
from megatron_spo.algorithms.ppo import gae, kl_regularised_token_rewards, ppo_policy_loss, ppo_value_loss
from megatron_spo.algorithms.spo import (
    CENTRABLE_OBJECTIVES,
    SPOInputs,
    cumulative_q,
    spo_loss,
    supported_combinations,
)
from megatron_spo.algorithms.spo_transforms import centre_groups, coefficient_transforms


@dataclass
class TabularTask:
    """An enumerable response space. All tensors float64 / int64 on CPU.

    ref_logits [S, V]: pi_0 per state.  tokens, states [N, L]: every response (N of them), with the
    state (prefix id) in which each token is chosen; -1 after the end.  lengths [N].  rewards [N].
    prefix_q_star [N, L]: exact Q*_t = beta log E_{pi_0}[exp(r / beta) | a_<=t] after each token.
    """

    name: str
    ref_logits: Tensor
    tokens: Tensor
    states: Tensor
    lengths: Tensor
    rewards: Tensor
    beta: float
    binary_rewards: bool

    def __post_init__(self) -> None:
        self.ref_seq_logp = self.sequence_logp(self.ref_logits)
        # log Z = log sum_a pi_0(a) exp(r(a) / beta); V = beta log Z is the exact Q0.
        self.log_z = torch.logsumexp(self.ref_seq_logp + self.rewards / self.beta, dim=0)
        self.optimal_seq_logp = self.ref_seq_logp + self.rewards / self.beta - self.log_z
        self.prefix_q_star = self._prefix_q_star()

    @property
    def num_sequences(self) -> int:
        return self.tokens.shape[0]

    @property
    def max_length(self) -> int:
        return self.tokens.shape[1]

    @property
    def q0(self) -> float:
        return float(self.beta * self.log_z)

    @property
    def success_prob(self) -> float:
        """P_{pi_0}(r = 0) (binary rewards only)."""
        return float((self.ref_seq_logp.exp() * (self.rewards == 0)).sum())

    def token_logp(self, logits: Tensor) -> Tensor:
        """log pi(a_t | prefix) for every response and position, [N, L]; 0 after the end."""
        table = torch.log_softmax(logits, dim=-1)
        valid = self.states >= 0
        picked = table[self.states.clamp(min=0), self.tokens.clamp(min=0)]
        return torch.where(valid, picked, torch.zeros((), dtype=picked.dtype))

    def sequence_logp(self, logits: Tensor) -> Tensor:
        return self.token_logp(logits).sum(1)

    def kl_to_optimum(self, logits: Tensor) -> float:
        """KL(pi || pi*) in nats, summed exactly over all responses."""
        seq_logp = self.sequence_logp(logits.detach())
        kl = float((seq_logp.exp() * (seq_logp - self.optimal_seq_logp)).sum())
        return max(kl, 0.0)  # >= 0 mathematically; rounding can give -1e-17 at the optimum

    def _prefix_q_star(self) -> Tensor:
        """Q*_t after each token: beta log of the pi_0-weighted exp(r / beta) over continuations, [N, L]."""
        weights = self.ref_seq_logp + self.rewards / self.beta
        out = torch.zeros(self.tokens.shape, dtype=torch.float64)
        token_logp = self.token_logp(self.ref_logits)
        for i in range(self.num_sequences):
            for t in range(int(self.lengths[i])):
                prefix = self.tokens[i, : t + 1]
                same = (self.tokens[:, : t + 1] == prefix).all(1)
                prefix_logp = token_logp[i, : t + 1].sum()
                out[i, t] = self.beta * (torch.logsumexp(weights[same], 0) - prefix_logp)
        return out


def bandit(arms: int = 10, *, beta: float = 0.5, seed: int = 0) -> TabularTask:
    """One state, `arms` actions, pi_0 = softmax(N(0, 1) logits), rewards ~ U(-1, 0)."""
    gen = torch.Generator().manual_seed(seed)
    ref_logits = torch.randn(1, arms, generator=gen, dtype=torch.float64)
    rewards = -torch.rand(arms, generator=gen, dtype=torch.float64)
    tokens = torch.arange(arms).unsqueeze(1)
    return TabularTask(
        name=f"bandit-{arms}",
        ref_logits=ref_logits,
        tokens=tokens,
        states=torch.zeros_like(tokens),
        lengths=torch.ones(arms, dtype=torch.long),
        rewards=rewards,
        beta=beta,
        binary_rewards=False,
    )


def autoregressive(
    vocab: int = 3,
    length: int = 3,
    *,
    beta: float = 0.5,
    eos: int | None = None,
    success_rate: float = 0.35,
    seed: int = 0,
) -> TabularTask:
    """Every token string of `length` over `vocab` (ending early at `eos` if given), pi_0 logits
    N(0, 1) per prefix, each response succeeding (r = 0, else -1) with probability success_rate."""
    gen = torch.Generator().manual_seed(seed)
    responses: list[tuple[int, ...]] = []
    for full in itertools.product(range(vocab), repeat=length):
        cut = full.index(eos) + 1 if eos is not None and eos in full else length
        if full[:cut] not in responses:
            responses.append(full[:cut])
    prefixes = sorted({r[:t] for r in responses for t in range(len(r))}, key=lambda p: (len(p), p))
    state_of = {p: i for i, p in enumerate(prefixes)}
    n = len(responses)
    tokens = torch.full((n, length), -1, dtype=torch.long)
    states = torch.full((n, length), -1, dtype=torch.long)
    for i, resp in enumerate(responses):
        tokens[i, : len(resp)] = torch.tensor(resp)
        states[i, : len(resp)] = torch.tensor([state_of[resp[:t]] for t in range(len(resp))])
    ref_logits = torch.randn(len(prefixes), vocab, generator=gen, dtype=torch.float64)
    success = torch.rand(n, generator=gen, dtype=torch.float64) < success_rate
    return TabularTask(
        name=f"autoregressive-v{vocab}-l{length}" + ("-eos" if eos is not None else ""),
        ref_logits=ref_logits,
        tokens=tokens,
        states=states,
        lengths=(tokens >= 0).sum(1),
        rewards=torch.where(success, 0.0, -1.0).to(torch.float64),
        beta=beta,
        binary_rewards=True,
    )


@dataclass
class TabularBatch:
    """Sampled responses laid out as a padded LLM batch.

    sequence [B]: which response; mask [B, T]; states, tokens [B, T] (0 on padding); reward, q0 [B];
    mc_positions [B, L] (-1 = none) with mc_q [B, L] = exact Q* there (and mc_success for binary rewards).
    """

    sequence: Tensor
    mask: Tensor
    states: Tensor
    tokens: Tensor
    reward: Tensor
    q0: Tensor
    mc_positions: Tensor
    mc_q: Tensor
    mc_success: Tensor | None
    group: Tensor
    weights: Tensor | None = None

    def token_logp(self, logits: Tensor, *, padding_value: float = 0.0) -> Tensor:
        """[B, T] log-probs of the batch's tokens under `logits`; `padding_value` on padding."""
        picked = torch.log_softmax(logits, dim=-1)[self.states, self.tokens]
        return torch.where(self.mask, picked, torch.full((), padding_value, dtype=picked.dtype))


def make_batch(
    task: TabularTask,
    sequence: Tensor,
    *,
    group_size: int,
    max_padding: int = 2,
    mc_fraction: float = 0.75,
    generator: torch.Generator,
    weights: Tensor | None = None,
) -> TabularBatch:
    """Lay responses `sequence` [B] out with random left/right padding; annotate MC targets at a random
    subset (about mc_fraction, at least one) of each response's positions."""
    b = sequence.shape[0]
    lengths = task.lengths[sequence]
    width = task.max_length + max_padding
    offset = (torch.rand(b, generator=generator, dtype=torch.float64) * (width - lengths + 1)).long()
    cols = torch.arange(width).unsqueeze(0) - offset.unsqueeze(1)  # position inside the response
    mask = (cols >= 0) & (cols < lengths.unsqueeze(1))
    inside = cols.clamp(0, task.max_length - 1)
    states = torch.where(mask, task.states[sequence].gather(1, inside), 0)
    tokens = torch.where(mask, task.tokens[sequence].gather(1, inside), 0)

    pos = torch.arange(task.max_length).unsqueeze(0)
    in_response = pos < lengths.unsqueeze(1)
    chosen = (
        torch.rand(b, task.max_length, generator=generator, dtype=torch.float64) < mc_fraction
    ) & in_response
    # Guarantee one annotation per response: its last token if nothing was drawn.
    last = torch.nn.functional.one_hot(lengths - 1, task.max_length).bool()
    chosen = chosen | (last & ~chosen.any(1, keepdim=True))
    mc_positions = torch.where(chosen, pos + offset.unsqueeze(1), -1)
    mc_q = torch.where(chosen, task.prefix_q_star[sequence], 0.0)
    mc_success = None
    if task.binary_rewards:
        # Invert Q = beta log(S + (1 - S) e^{-1/beta}) for the exact success probability.
        floor = math.exp(-1.0 / task.beta)
        mc_success = ((mc_q / task.beta).exp() - floor) / (1.0 - floor)
        mc_success = torch.where(chosen, mc_success.clamp(0.0, 1.0), 0.0)
    return TabularBatch(
        sequence=sequence,
        mask=mask,
        states=states,
        tokens=tokens,
        reward=task.rewards[sequence],
        q0=torch.full((b,), task.q0, dtype=torch.float64),
        mc_positions=mc_positions,
        mc_q=mc_q,
        mc_success=mc_success,
        group=torch.arange(b) // group_size,
        weights=weights,
    )


def num_unannotated_prefixes(task: TabularTask, batch: TabularBatch) -> int:
    """How many distinct response prefixes (a_1..a_t) never carry an MC target in `batch`. With MC targets
    alone, pi* is identifiable only if this is 0."""
    annotated = set()
    for row, seq in enumerate(batch.sequence.tolist()):
        start = int(batch.mask[row].nonzero()[0])
        for col in batch.mc_positions[row].tolist():
            if col >= 0:
                annotated.add((seq, col - start))
    prefixes = {
        tuple(task.tokens[i, : t + 1].tolist()): (i, t)
        for i in range(task.num_sequences)
        for t in range(int(task.lengths[i]))
    }
    covered = {tuple(task.tokens[i, : t + 1].tolist()) for i, t in annotated}
    return len(set(prefixes) - covered)


def sample_sequences(task: TabularTask, logits: Tensor, n: int, generator: torch.Generator) -> Tensor:
    """n response ids drawn from the policy `logits`, [n]."""
    probs = task.sequence_logp(logits.detach()).exp()
    return torch.multinomial(probs, n, replacement=True, generator=generator)


# ---------------------------------------------------------------------------------------------
# Training a tabular policy with any of the project's losses
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Method:
    """What to train with. family: spo | agro | kl_pg | ppo. data: where responses come from:
    "offline" a fixed sample of pi_0 | "on_policy" fresh samples of the current pi every step |
    "exact" every response once, weighted by its pi_0 probability | "stale" a lagging tempered copy of pi
    (train_from_stale_sampler)."""

    family: str
    objective: str = ""
    loss: str = ""
    on_policy: bool = False
    data: str = "offline"
    centre: bool = False  # spo terminal / advantage: group-centred loss coefficient (MATH.md section 7)

    @property
    def label(self) -> str:
        if self.family == "spo":
            data = "" if self.data == "offline" else f" ({self.data.replace('_', '-')})"
            return f"spo {self.objective}/{self.loss}" + (" centred" if self.centre else "") + data
        if self.family == "agro":
            return "agro on-policy" if self.on_policy else "agro off-policy"
        if self.family == "ppo":
            return "ppo (kl reward, gae)"
        return "kl-regularised pg"


@dataclass
class RunResult:
    task: str
    method: Method
    data: str
    kl_start: float
    kl_end: float
    steps: list[int]
    kl_curve: list[float]

    @property
    def reduction(self) -> float:
        return self.kl_start / max(self.kl_end, 1e-300)


def method_loss(method: Method, task: TabularTask, logits: Tensor, ref_logits: Tensor, batch: TabularBatch):
    """(loss, metrics) of `method` on `batch` for the policy `logits`. Padding of ref_logp is NaN on
    purpose: the losses must never read it."""
    logp = batch.token_logp(logits)
    ref_logp = batch.token_logp(ref_logits, padding_value=float("nan"))
    if method.family == "spo":
        mc = {}
        if method.objective == "mc":
            mc = {"mc_positions": batch.mc_positions}
            if batch.mc_success is not None:
                mc["mc_success"] = batch.mc_success
            else:
                mc["mc_q"] = batch.mc_q
        inputs = SPOInputs(logp, ref_logp, batch.mask, batch.reward, batch.q0, weights=batch.weights,
                           group=batch.group if method.centre else None, **mc)
        return spo_loss(inputs, beta=task.beta, objective=method.objective, loss=method.loss,
                        transforms=[centre_groups] if method.centre else [])
    if method.family == "agro":
        return agro_loss(
            logp, ref_logp, batch.mask, batch.reward, batch.group, beta=task.beta, on_policy=method.on_policy
        )
    if method.family == "kl_pg":
        return kl_pg_loss(logp, ref_logp, batch.mask, batch.reward, batch.group, beta=task.beta)
    raise ValueError(f"unknown method family '{method.family}'")


def train(
    task: TabularTask,
    method: Method,
    *,
    steps: int | None = None,
    lr: float = 0.1,
    final_lr_fraction: float = 0.01,
    dataset_size: int = 2048,
    on_policy_batch: int = 1024,
    group_size: int = 8,
    seed: int = 0,
    record_every: int = 10,
    max_grad_norm: float | None = 1.0,
    ppo_epochs: int = 2,
) -> RunResult:
    """Adam on the logits table from pi_0, learning rate decaying geometrically to lr * final_lr_fraction,
    gradient norm clipped to max_grad_norm (as in LLM training: the cross-entropy's straight-through clip
    can produce a rare (1 - x) / eps spike that would otherwise freeze Adam's step size).

    offline data is one fixed sample of dataset_size responses of pi_0 (every response must occur in it,
    else the optimum is not identifiable and this raises); on-policy data is a fresh sample of
    on_policy_batch responses of pi each step (in groups of group_size).
    """
    steps = default_steps(method) if steps is None else steps
    gen = torch.Generator().manual_seed(seed)
    ref_logits = task.ref_logits
    logits = ref_logits.clone().requires_grad_(True)
    # PPO's value model: one V per state (prefix), the value before the token chosen there.
    values = torch.zeros(ref_logits.shape[0], dtype=torch.float64, requires_grad=True)
    params = [logits, values] if method.family == "ppo" else [logits]
    optimizer = torch.optim.Adam(params, lr=lr)
    decay = final_lr_fraction ** (1.0 / max(steps - 1, 1))
    scheduler = torch.optim.lr_scheduler.ExponentialLR(optimizer, gamma=decay)

    fixed = None
    if method.data == "offline":
        seqs = sample_sequences(task, ref_logits, dataset_size, gen)
        missing = task.num_sequences - int(torch.unique(seqs).numel())
        if missing:
            raise ValueError(f"train: {missing} responses never occur in {dataset_size} samples of pi_0")
        fixed = make_batch(task, seqs, group_size=group_size, generator=gen)
        if method.objective == "mc":
            unannotated = num_unannotated_prefixes(task, fixed)
            if unannotated:
                raise ValueError(f"train: {unannotated} response prefixes carry no MC target in the data")
    elif method.data == "exact":
        seqs = torch.arange(task.num_sequences)
        fixed = make_batch(
            task, seqs, group_size=task.num_sequences, generator=gen, weights=task.ref_seq_logp.exp()
        )
    elif method.data != "on_policy":
        raise ValueError(f"train: unknown data '{method.data}' (offline | on_policy | exact)")
    if method.family == "ppo" and method.data != "on_policy":
        raise ValueError("train: ppo needs data 'on_policy'")

    kl_start = task.kl_to_optimum(logits)
    curve_steps, curve = [0], [kl_start]
    for step in range(1, steps + 1):
        batch = fixed
        if batch is None:
            seqs = sample_sequences(task, logits, on_policy_batch, gen)
            batch = make_batch(task, seqs, group_size=group_size, generator=gen)
        if method.family == "ppo":
            updates = ppo_updates(task, logits, values, batch, epochs=ppo_epochs)
        else:
            updates = (method_loss(method, task, logits, ref_logits, batch)[0] for _ in range(1))
        for loss in updates:
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            if max_grad_norm is not None:
                torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
            optimizer.step()
        scheduler.step()
        if step % record_every == 0 or step == steps:
            curve_steps.append(step)
            curve.append(task.kl_to_optimum(logits))
    return RunResult(task.name, method, method.data, kl_start, curve[-1], curve_steps, curve)


def train_from_stale_sampler(
    task: TabularTask,
    *,
    centre: bool,
    steps: int = 400,
    lr: float = 0.1,
    q0_error: float = 0.3,
    refresh_every: int = 10,
    temperature_range: tuple[float, float] = (0.7, 1.0),
    groups: int = 16,
    group_size: int = 8,
    seed: int = 0,
    record_every: int = 50,
    trust_region: float | None = None,
) -> RunResult:
    """SPO (terminal, squared) on the samples of a stale, tempered sampler, as asynchronous rollouts give them:
    the sampler is a copy of the policy refreshed every refresh_every steps, each group of group_size responses
    drawn at a temperature ~ U(temperature_range), Q0 off by q0_error (an estimate, not V). Adam at a constant
    lr, gradient norm clipped to 1 (the quickstart's optimizer). centre: the group-centred coefficient;
    trust_region: spo_loss's clip of log(pi / mu) against the sampler's own (tempered) log-probs.
    The plain loss drifts off pi* here (MATH.md section 7); the curve records KL(pi || pi*)."""
    gen = torch.Generator().manual_seed(seed)
    logits = task.ref_logits.clone().requires_grad_(True)
    optimizer = torch.optim.Adam([logits], lr=lr)
    method = Method("spo", "terminal", "squared", data="stale", centre=centre)
    kl_start = task.kl_to_optimum(logits)
    curve_steps, curve = [0], [kl_start]
    sampler = logits.detach().clone()
    low, high = temperature_range
    for step in range(1, steps + 1):
        if (step - 1) % refresh_every == 0:
            sampler = logits.detach().clone()
        temperatures = low + (high - low) * torch.rand(groups, generator=gen, dtype=torch.float64)
        seqs = torch.cat([sample_sequences(task, sampler / float(t), group_size, gen) for t in temperatures])
        batch = make_batch(task, seqs, group_size=group_size, generator=gen)
        tables = torch.stack([torch.log_softmax(sampler / float(t), dim=-1) for t in temperatures])  # [G, S, V]
        behaviour = torch.where(batch.mask, tables[batch.group.unsqueeze(1), batch.states, batch.tokens], 0.0)
        inputs = SPOInputs(batch.token_logp(logits), batch.token_logp(task.ref_logits, padding_value=float("nan")),
                           batch.mask, batch.reward, batch.q0 + q0_error, group=batch.group if centre else None,
                           behaviour_logp=behaviour if trust_region else None)
        loss, _ = spo_loss(inputs, beta=task.beta, objective="terminal", loss="squared",
                           transforms=coefficient_transforms(centre, trust_region))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_([logits], 1.0)
        optimizer.step()
        if step % record_every == 0 or step == steps:
            curve_steps.append(step)
            curve.append(task.kl_to_optimum(logits))
    return RunResult(task.name, method, "stale", kl_start, curve[-1], curve_steps, curve)


def ppo_updates(task: TabularTask, logits: Tensor, values: Tensor, batch: TabularBatch, *, epochs: int):
    """PPO on one on-policy batch: advantages from the behaviour log-probs (the policy when sampled) and
    the KL-regularised token rewards, then `epochs` losses (each followed by an optimizer step by the
    caller), so from the second epoch on the importance weights differ from 1 and clipping is live."""
    behaviour_logp = batch.token_logp(logits).detach()
    ref_logp = batch.token_logp(task.ref_logits, padding_value=float("nan"))
    token_rewards = kl_regularised_token_rewards(
        batch.reward, behaviour_logp, ref_logp, batch.mask, beta=task.beta
    )
    old_values = values.detach()[batch.states]
    advantages, returns = gae(token_rewards, old_values, batch.mask, gamma=1.0, lam=1.0)
    for _ in range(epochs):
        policy_loss, _ = ppo_policy_loss(batch.token_logp(logits), behaviour_logp, advantages, batch.mask)
        value_loss = ppo_value_loss(values[batch.states], old_values, returns, batch.mask, clip_eps=None)
        yield policy_loss + value_loss


def default_steps(method: Method) -> int:
    """Steps that reach KL < 1e-3 with margin. The cross-entropy's relu term puts a kink at the optimum
    (successes only bound Q from below), so those runs need the long tail of the learning-rate decay."""
    if method.loss == "cross_entropy":
        return 400
    if method.family == "ppo":  # two optimizer steps per batch
        return 150
    if method.data == "on_policy":
        return 300
    return 200


def all_methods() -> list[Method]:
    """Every supported SPO objective x loss on offline pi_0 data, the centred SPO coefficient off- and on-policy,
    AGRO off- and on-policy, and the KL-regularised policy gradient on the same offline data."""
    methods = [Method("spo", o, loss) for o, loss in supported_combinations()]
    # the group-centred coefficient (the online default) keeps pi* as the optimum, off- and on-policy, for every
    # centrable objective x loss but cross_entropy, which on-policy ends greedier than pi* centred or not (its
    # successes above Q_T = 0 are never pulled back; docs/spo-stability.md)
    methods += [Method("spo", "terminal", "squared", centre=True)]
    methods += [Method("spo", o, loss, data="on_policy", centre=True) for o, loss in supported_combinations()
                if o in CENTRABLE_OBJECTIVES and loss != "cross_entropy"]
    methods += [Method("agro"), Method("agro", on_policy=True, data="on_policy")]
    methods += [Method("ppo", data="on_policy"), Method("kl_pg")]
    return methods


# ---------------------------------------------------------------------------------------------
# Numeric checks of the SPO paper's theorems on the real code path (cumulative_q)
# ---------------------------------------------------------------------------------------------
def prefix_q_table(
    task: TabularTask, logits: Tensor, q0: float
) -> tuple[dict[tuple[int, ...], float], float]:
    """Q^theta of every prefix from cumulative_q over all responses; also the largest disagreement between
    two responses that share a prefix (must be 0: Q_t depends on a_<=t only)."""
    valid = task.states >= 0
    q = cumulative_q(
        task.token_logp(logits), task.token_logp(task.ref_logits), valid,
        torch.full((task.num_sequences,), q0, dtype=torch.float64), task.beta,
    )  # fmt: skip
    table: dict[tuple[int, ...], float] = {(): q0}
    disagreement = 0.0
    for i in range(task.num_sequences):
        for t in range(int(task.lengths[i])):
            key = tuple(task.tokens[i, : t + 1].tolist())
            value = float(q[i, t])
            if key in table:
                disagreement = max(disagreement, abs(table[key] - value))
            table[key] = value
    return table, disagreement


def bellman_residual(task: TabularTask, logits: Tensor, q0: float) -> float:
    """max over non-terminal prefixes of |Q_t - beta log sum_a pi_0(a | prefix) exp(Q_{t+1}(a) / beta)|
    (Theorem 2.2: 0 for ANY theta and q0)."""
    table, disagreement = prefix_q_table(task, logits, q0)
    ref_table = torch.log_softmax(task.ref_logits, -1)
    worst = disagreement
    prefixes: dict[tuple[int, ...], int] = {}
    for i in range(task.num_sequences):
        for t in range(int(task.lengths[i])):
            prefixes[tuple(task.tokens[i, :t].tolist())] = int(task.states[i, t])
    vocab = task.ref_logits.shape[1]
    for prefix, state in prefixes.items():
        next_q = torch.tensor([table[prefix + (a,)] for a in range(vocab)], dtype=torch.float64)
        soft = task.beta * torch.logsumexp(ref_table[state] + next_q / task.beta, 0)
        worst = max(worst, abs(float(soft) - table[prefix]))
    return worst


def path_consistency_residual(
    task: TabularTask, logits: Tensor, q0: float, *, samples: int = 256, seed: int = 0
):
    """max over random padded responses and random intervals [t1, tk] of
    |sum_{t=t1..tk} A_t - (Q_tk - Q_{t1-1})| (Theorem 2.3), A_t summed directly in Python."""
    gen = torch.Generator().manual_seed(seed)
    seqs = sample_sequences(task, logits, samples, gen)
    batch = make_batch(task, seqs, group_size=1, generator=gen)
    logp, ref_logp = batch.token_logp(logits), batch.token_logp(task.ref_logits)
    q = cumulative_q(logp, ref_logp, batch.mask, batch.q0.fill_(q0), task.beta)
    worst = 0.0
    for b in range(samples):
        cols = batch.mask[b].nonzero().flatten().tolist()
        i, k = sorted(torch.randint(len(cols), (2,), generator=gen).tolist())
        direct = sum(task.beta * (float(logp[b, c]) - float(ref_logp[b, c])) for c in cols[i : k + 1])
        before = q0 if i == 0 else float(q[b, cols[i - 1]])
        worst = max(worst, abs(direct - (float(q[b, cols[k]]) - before)))
    return worst


def optimal_logits(task: TabularTask) -> Tensor:
    """Logits of pi* per state: log pi*(a | s) = log pi_0(a | s) + (Q*(s, a) - Q*(s)) / beta, [S, V]."""
    ref_table = torch.log_softmax(task.ref_logits, -1)
    logits = ref_table.clone()
    for i in range(task.num_sequences):
        for t in range(int(task.lengths[i])):
            before = task.q0 if t == 0 else float(task.prefix_q_star[i, t - 1])
            state, token = int(task.states[i, t]), int(task.tokens[i, t])
            logits[state, token] = (
                ref_table[state, token] + (float(task.prefix_q_star[i, t]) - before) / task.beta
            )
    return logits


def optimum_q_residual(task: TabularTask) -> float:
    """max |Q^theta_t - Q*_t| over all prefixes at theta = pi*, q0 = exact V (Theorem 2.1: Q^theta = Q
    when pi = pi*); Q* comes from the reward table directly, Q^theta from cumulative_q."""
    table, _ = prefix_q_table(task, optimal_logits(task), task.q0)
    worst = 0.0
    for i in range(task.num_sequences):
        for t in range(int(task.lengths[i])):
            key = tuple(task.tokens[i, : t + 1].tolist())
            worst = max(worst, abs(table[key] - float(task.prefix_q_star[i, t])))
    return worst
