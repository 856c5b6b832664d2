"""SPO (MATH.md section 2): per data source its own objective and regression loss, no value model."""

from __future__ import annotations

from collections import defaultdict
from functools import partial

from torch import Tensor

from megatron_spo import algorithms
from megatron_spo.algorithms.spo_diagnostics import spo_diagnostics
from megatron_spo.algorithms.spo_transforms import CENTRINGS, TRANSFORMS, centre_groups, is_centring
from megatron_spo.algorithms.spo_transforms import coefficient_baseline as coefficient_baseline_transform
from megatron_spo.data.batching import TrainBatch
from megatron_spo.training.algos.base import Algorithm, StepInputs, Update


def _rows(batch: TrainBatch, rows: list[int], *tensors: Tensor | None) -> list[Tensor | None]:
    import torch

    idx = torch.tensor(rows, dtype=torch.long, device=batch.loss_mask.device)
    return [None if t is None else t.index_select(0, idx) for t in tensors]


def by_source(batch: TrainBatch) -> dict[str, list[int]]:
    """Row indices of the batch per data source, sources sorted by name."""
    rows: dict[str, list[int]] = defaultdict(list)
    for i, s in enumerate(batch.source):
        rows[s].append(i)
    return dict(sorted(rows.items()))


def seq_log_ratio_by_source(batch: TrainBatch, logp: Tensor, ref_logp: Tensor) -> dict:
    """{"mean_seq_log_ratio/SOURCE": (mean sequence log(pi / pi_0), sequences)}: the KL estimate on online
    samples, for algorithms whose loss does not report it itself."""
    from megatron_spo.algorithms.agro import sequence_logp
    from megatron_spo.algorithms.validation import upcast

    ratio = sequence_logp(upcast(logp.detach()) - upcast(ref_logp), batch.loss_mask.bool())
    return {f"mean_seq_log_ratio/{source}": (float(ratio[rows].mean()), len(rows))
            for source, rows in by_source(batch).items()}


def spo_batch_loss(batch: TrainBatch, logp: Tensor, ref_logp: Tensor, *, beta: float,
                   objectives: dict[str, tuple[str, object]], transforms: dict[str, tuple] | None = None,
                   coefficient_baseline: Tensor | None = None) -> tuple[Tensor, dict[str, float]]:
    """Mean over sequences of spo_loss, each source with its own (objective, loss) and transforms, plus drift
    diagnostics.

    objectives: source name -> (objective, loss), e.g. {"online": ("terminal", "cross_entropy"),
    "mc": ("mc", "cross_entropy")}; a loss may be a callable (a config hook). A source in the batch with no
    entry is an error naming it. transforms: source name -> its coefficient transforms (algorithms/spo_transforms.py;
    none without an entry). A centred source (centre_groups or coefficient_baseline) is centred on its prompt groups
    in this batch, or, with coefficient_baseline [B] given (step_coefficient_baselines: taken over the whole step),
    on those; the policy-gradient term takes the same groups (else the source's whole batch). Diagnostics per source
    (algorithms/spo_diagnostics.py): signed residual Q_T - r, its spread, KL(sampler || pi) from behaviour
    log-probs, log-ratio by position, response length.
    """
    total = logp.new_zeros(())
    metrics: dict[str, float | tuple[float, int]] = {}
    n = batch.num_sequences
    sources = by_source(batch)
    for source, rows in sources.items():
        if source not in objectives:
            raise ValueError(f"spo: the batch has trajectories of source '{source}' but the config names no "
                             f"objective for it (configured: {', '.join(sorted(objectives))})")
        objective, loss_name = objectives[source]
        lp, rlp, mask, reward, q0, group, behaviour, sampler, mc_pos, mc_succ, baseline = _rows(
            batch, rows, logp, ref_logp, batch.loss_mask, batch.reward, batch.q0, batch.group,
            batch.behaviour_logp, batch.sampler_logp, batch.mc_positions, batch.mc_success, coefficient_baseline)
        steps = (transforms or {}).get(source, ())
        centred = any(is_centring(t) for t in steps)
        step_wide = centred and baseline is not None
        if centred:  # the step's baselines where given, else this batch's groups
            centring = coefficient_baseline_transform if step_wide else centre_groups
            steps = tuple(centring if is_centring(t) else t for t in steps)
        # only centred sources keep groups whole, and with step-wide baselines not even they (the step reports it)
        whole_groups = group if centred and not step_wide else None
        mc = dict(mc_positions=mc_pos, mc_success=mc_succ) if objective == "mc" else {}
        inputs = algorithms.SPOInputs(lp, rlp, mask, reward, q0, group=whole_groups,
                                      coefficient_baseline=baseline if step_wide else None,
                                      behaviour_logp=behaviour, sampler_logp=sampler, **mc)
        loss, m = algorithms.spo_loss(inputs, beta=beta, objective=objective, loss=loss_name, transforms=steps)
        total = total + loss * (len(rows) / n)
        weights = {k: len(rows) for k in m}
        for k in ("mean_token_advantage", "trust_region_clipped"):  # means over response tokens
            weights[k] = int(mask.sum())
        for k, v in m.items():
            metrics[f"{k}/{source}"] = (v, weights[k])
        for k, pair in spo_diagnostics(lp, rlp, mask, reward, q0, beta=beta, group=whole_groups,
                                       behaviour_logp=behaviour).items():
            metrics[f"{k}/{source}"] = pair
    for k in algorithms.spo.METRIC_NAMES:  # over sources, with the same weights
        parts = [metrics[f"{k}/{source}"] for source in sources]
        weight = sum(w for _, w in parts)
        metrics[k] = (sum(v * w for v, w in parts) / max(weight, 1), weight)
    metrics["loss"] = float(total.detach())
    return total, metrics


def step_coefficient_baselines(micro_batches: list[TrainBatch], logps: list[Tensor], refs: list[Tensor], *,
                               beta: float, objectives: dict[str, tuple[str, object]],
                               centred: frozenset[str]) -> tuple[list[Tensor], dict[str, tuple[float, int]]]:
    """Prompt-group baselines of the centred sources over a whole step, however micro-batches cut the groups.

    logps: the policy's no-grad log-probs [B, L] per micro-batch at this step's weights (what the loss's own
    forward gives). Per micro-batch a [B] tensor: for a row of a centred source, the mean coefficient
    c = dL/dQ_T of the other sequences of its prompt group (a sequence alone in its group: of all the source's
    others, as centred_on_others), 0 elsewhere. Data-parallel shards keep prompt groups whole
    (training/micro_batches.shard), so this rank's micro-batches hold every group they touch. Also
    residual_group_var/SOURCE (its mean, its sequences) over the step's whole groups.
    """
    import torch

    from megatron_spo.algorithms.groups import centred_on_others, group_mean
    from megatron_spo.algorithms.spo_diagnostics import residuals

    out = [torch.zeros(mb.num_sequences, dtype=torch.float64, device=mb.loss_mask.device) for mb in micro_batches]
    report: dict[str, tuple[float, int]] = {}
    for source in sorted(centred):
        objective, loss_name = objectives[source]
        parts = []  # (micro-batch index, rows, coefficients, residuals, group ids)
        for i, (mb, logp, ref) in enumerate(zip(micro_batches, logps, refs, strict=True)):
            rows = by_source(mb).get(source)
            if not rows:
                continue
            lp, rlp, mask, reward, q0, group = _rows(mb, rows, logp, ref, mb.loss_mask, mb.reward, mb.q0, mb.group)
            c = algorithms.spo.terminal_coefficients(algorithms.SPOInputs(lp, rlp, mask, reward, q0), beta=beta,
                                                     objective=objective, loss=loss_name)
            parts.append((i, rows, c, residuals(lp, rlp, mask, reward, q0, beta), group))
        if not parts:
            continue
        c_all = torch.cat([p[2].double() for p in parts])
        group_all = torch.cat([p[4].to(c_all.device) for p in parts])
        baseline = c_all - centred_on_others(c_all, group_all)
        d_all = torch.cat([p[3].double() for p in parts])
        report[f"residual_group_var/{source}"] = (float(((d_all - group_mean(d_all, group_all)) ** 2).mean()),
                                                  len(d_all))
        start = 0
        for i, rows, *_ in parts:
            idx = torch.tensor(rows, dtype=torch.long, device=out[i].device)
            out[i].index_copy_(0, idx, baseline[start:start + len(rows)].to(out[i].device))
            start += len(rows)
    return out, report


def cuts_a_group(micro_batches: list[TrainBatch], sources: frozenset[str]) -> bool:
    """Whether a prompt group of one of these sources has sequences in two micro-batches."""
    seen: dict[tuple[str, int], int] = {}
    for i, mb in enumerate(micro_batches):
        for source, group in zip(mb.source, mb.group.tolist()):
            if source in sources and seen.setdefault((source, group), i) != i:
                return True
    return False


def resolve_loss(name: str, field: str):
    """A REGRESSION_LOSSES name as is, or a config hook 'package.module:function' loaded and checked."""
    from megatron_spo.hooks import is_hook, load_hook

    return load_hook(name, field=field) if is_hook(name) else name


def resolve_transforms(specs: list[tuple[str, dict]], field: str) -> tuple:
    """The transforms SourceConfig.transform_specs names: TRANSFORMS entries with their parameters bound, hooks
    'package.module:function' loaded and checked."""
    from megatron_spo.hooks import is_hook, load_hook

    return tuple(load_hook(name, field=field) if is_hook(name) else
                 partial(TRANSFORMS[name], **params) if params else TRANSFORMS[name] for name, params in specs)


class SPO(Algorithm):
    name = "spo"
    uses_q0 = True

    def __init__(self, cfg):
        super().__init__(cfg)
        self.objectives = {name: (s.objective, resolve_loss(s.loss, f"sources.{name}.loss"))
                           for name, s in cfg.sources.items()}
        specs = {name: s.transform_specs(name) for name, s in cfg.sources.items()}
        self.transforms = {name: resolve_transforms(spec, f"sources.{name}.transforms") for name, spec in specs.items()}
        self.centred = frozenset(name for name, spec in specs.items() if any(n in CENTRINGS for n, _ in spec))
        # sources that list coefficient_baseline take their baselines over the whole step every step
        step_wide = any(n == "coefficient_baseline" for spec in specs.values() for n, _ in spec)
        # only a centred source's policy-gradient term needs prompt groups whole; the centred coefficient prefers
        # them whole (each micro-batch then centres inside its own loss), and where a group does not fit the
        # budget its baselines come from one no-grad forward over the whole step (step_coefficient_baselines)
        self.keeps_prompt_groups = any(n == "policy_gradient" for name in self.centred for n, _ in specs[name])
        self.prefers_prompt_groups = bool(self.centred)
        self.always_step_wide = step_wide

    def update(self, step: StepInputs) -> Update:
        beta, objectives = self.cfg.beta, self.objectives
        baselines, group_var = [None] * len(step.micro_batches), {}
        # micro-batches that hold their centred groups whole (data-parallel shards do) centre inside the loss:
        # exactly the step-wide baselines, without the third pass over every token
        if self.centred and (self.always_step_wide or cuts_a_group(step.micro_batches, self.centred)):
            logps = step.forward("policy", "logp")  # this step's weights: the loss's forward gives the same
            if step.is_last_stage:
                baselines, group_var = step_coefficient_baselines(step.micro_batches, logps, step.ref, beta=beta,
                                                                  objectives=objectives, centred=self.centred)

        def loss_fn(i, mb, logp):
            loss, metrics = spo_batch_loss(mb, logp, step.ref[i], beta=beta, objectives=objectives,
                                           transforms=self.transforms, coefficient_baseline=baselines[i])
            if i == 0:  # step-wide statistics ride on the first micro-batch's report (weighted by their count)
                metrics.update(group_var)
            return loss, metrics

        reports, grad_norm = step.optimize("policy", "logp", loss_fn)
        return Update(reports, grad_norm)
