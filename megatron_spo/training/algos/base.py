"""What an RL algorithm is to the trainer: what it needs, how it updates the models, what it reports.

    class MyAlgorithm(Algorithm):
        name = "my_algo"
        def update(self, step: StepInputs) -> Update:
            return Update(*step.optimize("policy", "logp", lambda i, mb, logp: my_loss(mb, logp, step.ref[i])))

The trainer calls ``update`` once per step with the step's micro-batches, the reference log-probs and two
verbs: ``optimize(model, output, loss_fn)`` (one optimizer step of "policy" or "value" through megatron's
schedule; loss_fn(index, micro_batch, output) -> (scalar loss, metrics)) and ``forward(model, output)``
(no-grad outputs per micro-batch on the last pipeline stage). Metrics follow training/loss.py's
convention (a float is a mean over sequences, a (mean, weight) pair a weighted mean).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

from megatron_spo.data.q0 import PAPER_BETA

log = logging.getLogger("megatron_spo.algos")


@dataclass
class StepInputs:
    """One training step as an algorithm sees it."""

    cfg: Any  # TrainConfig
    step: int
    micro_batches: list  # [TrainBatch]
    ref: list  # per micro-batch: reference log-probs [B, L] (last pipeline stage; None elsewhere)
    lr: Callable[[str], float]  # lr("policy") / lr("value"): this step's learning rate of that model
    optimize: Callable[..., tuple[list, float]]  # (model, output, loss_fn) -> (loss_fn's reports, grad norm)
    forward: Callable[..., list]  # (model, output) -> per micro-batch outputs (last stage; None elsewhere)
    is_last_stage: bool
    global_sequences: int = 0  # sequences of the whole step (all data-parallel ranks)
    global_response_tokens: int = 0  # their response tokens the model sampled (token-mean losses normalise by this)
    # sum of a tensor over the data-parallel ranks (last pipeline stage; collective): batch-wide statistics
    sum_across_data_parallel: Callable[[Any], Any] = lambda t: t


@dataclass
class Update:
    reports: list  # what the loss functions reported per micro-batch (reduced by the trainer)
    grad_norm: float
    metrics: dict[str, float] = field(default_factory=dict)  # extra step metrics (e.g. grad_norm/value)


class Algorithm:
    """Base class: override ``update``; declare what the trainer must provide with the class flags."""

    name: ClassVar[str]
    uses_value_model: ClassVar[bool] = False  # build, checkpoint and optimise a value model (PPO)
    keeps_prompt_groups: ClassVar[bool] = False  # micro-batches hold whole prompt groups (leave-one-out)
    # whole prompt groups per micro-batch wherever each fits the token budget (cut only those that do not)
    prefers_prompt_groups: ClassVar[bool] = False
    on_policy: ClassVar[bool] = False  # only the online source; weights pushed every step
    # importance ratios against the engines' log-probs (which are log softmax(logits / T) of the sampling
    # temperature): every log-prob pass of the step (policy, pi_old, reference) is then of each row's own sampling
    # temperature, as verl and slime compute theirs; rows without a known temperature at T = 1
    uses_behaviour_logprobs: ClassVar[bool] = False
    # its loss reads each trajectory's Q0 (SPO): every prompt it trains on needs one, from task.q0_path or the
    # record itself (training/online.py, training/sources.py refuse a missing one; Q0 = 0 is not neutral)
    uses_q0: ClassVar[bool] = False
    # beta when the config leaves it unset; an algorithm whose default is 0 (no KL term: GRPO) accepts beta = 0,
    # the others need beta > 0 (SPO divides by it)
    default_beta: ClassVar[float] = PAPER_BETA

    def __init__(self, cfg):
        self.cfg = cfg

    @classmethod
    def required_update_interval(cls, cfg) -> int | None:
        """The model_update_interval (steps between weight pushes) this algorithm needs under ``cfg``; None: any.
        On-policy algorithms sample from the policy they train, so they need a push every step."""
        return 1 if cls.on_policy else None

    @classmethod
    def check_config(cls, cfg) -> None:
        """Refuse a TrainConfig this algorithm cannot run (ValueError naming the field); set what it needs and
        the user left unset (model_update_interval, with a logged line)."""
        if cls.on_policy and set(cfg.sources) != {"online"}:
            raise ValueError(f"algo {cls.name} is on-policy: use only the 'online' source "
                             f"(got {', '.join(sorted(cfg.sources))})")
        if cfg.beta is not None and cfg.beta <= 0 and cls.default_beta > 0:
            raise ValueError(f"beta: algo {cls.name} needs beta > 0, got {cfg.beta}")
        if cfg.reference_refresh_interval and cls.uses_q0:
            for name, src in cfg.sources.items():
                if not (src.centred(name) and src.loss == "squared"):
                    raise ValueError(
                        f"reference_refresh_interval: algo {cls.name} would train source '{name}' on a Q0 of the "
                        f"first reference; only a centred source with the squared loss does not depend on Q0 "
                        f"(sources.{name}.centre: true, sources.{name}.loss: squared; got centre "
                        f"{str(src.centred(name)).lower()}, loss {src.loss})")
        cls._enforce_update_interval(cfg)

    @classmethod
    def _enforce_update_interval(cls, cfg) -> None:
        need = cls.required_update_interval(cfg)
        if need is None or cfg.model_update_interval == need:
            return
        if "model_update_interval" in cfg.model_fields_set:
            raise ValueError(f"model_update_interval: algo {cls.name} needs a weight push every {need} step(s) "
                             f"(it samples from the policy it trains), got {cfg.model_update_interval}")
        log.warning("model_update_interval: %d for algo %s (it needs a weight push every %d step(s); the default "
                    "was %d)", need, cls.name, need, cfg.model_update_interval)
        cfg.__dict__["model_update_interval"] = need  # no re-validation: we are inside the config's validator

    def update(self, step: StepInputs) -> Update:
        raise NotImplementedError
