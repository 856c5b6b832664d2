"""The training config: one ``TrainConfig`` assembling every floor's section, the training-only sections
(sources, optimizer, batch, algorithms, checkpoints, logging) and the checks against the algorithm
registry (training/algos/) and the SPO objectives and losses (algorithms/spo.py).

    cfg = load_config(TrainConfig, "examples/quickstart.yaml", ["model.num_layers=4", "algo=ppo"])
"""

from __future__ import annotations

import logging
from typing import Annotated, Literal

from pydantic import AfterValidator, Field, ValidationInfo, field_validator, model_validator

from megatron_spo.config import StrictModel
from megatron_spo.data.config import ProvenanceSelect, TaskConfig
from megatron_spo.data.q0 import PAPER_BETA
from megatron_spo.models.config import InitConfig, ModelConfig, ParallelConfig
from megatron_spo.models.lora import LoraConfig
from megatron_spo.rewards.config import SandboxConfig
from megatron_spo.rollout.config import FleetEndpoints, RolloutConfig

log = logging.getLogger("megatron_spo.config")


def _objective(value: str) -> str:
    from megatron_spo.algorithms.spo import OBJECTIVES

    if value not in OBJECTIVES:
        raise ValueError(f"unknown objective '{value}' (choose from {', '.join(OBJECTIVES)})")
    return value


def _loss_name(value: str) -> str:
    """A regression loss of algorithms/spo.py REGRESSION_LOSSES, or a hook 'package.module:function' with
    its signature L(pred_q, target_q, beta, eps) (imported when the trainer starts)."""
    from megatron_spo.algorithms.spo import LOSSES
    from megatron_spo.hooks import is_hook

    if value not in LOSSES and not is_hook(value):
        raise ValueError(f"unknown loss '{value}' (choose from {', '.join(LOSSES)}, or a hook "
                         "'package.module:function')")
    return value


def _algo_name(value: str) -> str:
    """A registered algorithm (training/algos/) or a hook 'package.module:Class' (imported by the trainer)."""
    from megatron_spo.training.algos import algorithm_class

    algorithm_class(value, field="algo", load_hooks=False)
    return value


def _transform_name(value: str) -> str:
    """An SPO coefficient transform of algorithms/spo_transforms.py TRANSFORMS, or a hook 'package.module:function'
    (a function SPOTerms -> SPOTerms, imported when the trainer starts)."""
    from megatron_spo.algorithms.spo_transforms import TRANSFORMS
    from megatron_spo.hooks import is_hook

    if value not in TRANSFORMS and not is_hook(value):
        raise ValueError(f"unknown transform '{value}' (choose from {', '.join(TRANSFORMS)}, or a hook "
                         "'package.module:function')")
    return value


Objective = Annotated[str, AfterValidator(_objective)]


TransformName = Annotated[str, AfterValidator(_transform_name)]


LossName = Annotated[str, AfterValidator(_loss_name)]


AlgoName = Annotated[str, AfterValidator(_algo_name)]


# the source name of demonstrations spliced into online prompt groups (grpo.guide_path, training/sources.py)
GUIDE_SOURCE = "guide"

# the online source's default trust region (sources.online.trust_region): with the centred coefficient it kept
# online-only SPO on its samples for 270 steps on both generated tasks (docs/spo-stability.md)
ONLINE_TRUST_REGION = 0.2


class SourceConfig(StrictModel):
    """One data source of the training batch. The source named 'online' is the rollout buffer; any other
    source reads trajectories from `path` (a JSONL file or an offline-store directory), optionally only those
    of some provenance (`select`)."""

    weight: float = Field(1.0, ge=0, description="share of each batch's trajectories (relative to the other "
                          "sources' weights)")
    weight_final: float | None = Field(None, ge=0, description="a schedule: the weight goes linearly from `weight` "
                                       "at step 1 to this at step weight_steps, then stays (e.g. off-policy data "
                                       "early, then less of it: docs/offpolicy-data.md). Unset: constant")
    weight_steps: int = Field(0, ge=0, description="the step weight_final is reached at (with weight_final; 2 or "
                              "later)")
    path: str | None = None
    select: ProvenanceSelect | None = None
    objective: Objective = "terminal"
    loss: LossName = Field("squared", description="squared (the default: with the online source's centring and "
                           "trust region it holds at pi* on every check, docs/spo-stability.md) | sigmoid_bce | "
                           "cross_entropy (the paper's: its clip and straight-through rule; on stale samples it ends "
                           "greedier than pi*) | a hook 'package.module:function'")
    centre: bool | None = Field(
        None, description="SPO: centre each sequence's loss coefficient dL/dQ_T on the leave-one-out mean of its "
        "prompt group (a control variate; docs/spo-stability.md). Samples of a stale or tempered sampler otherwise "
        "push the policy away from that sampler whenever the mean residual Q_T - r is positive. pi* stays the fixed "
        "point. Unset: on for the 'online' source, off for the others (their sampler is another model, and their "
        "negative mean residual is part of what SPO learns from them); terminal / advantage objectives only. The "
        "baselines come from one more no-grad forward pass over the step when it has several micro-batches, so these "
        "may cut prompt groups (one micro-batch centres inside the loss, without it)")
    trust_region: float | None = Field(
        None, ge=0, description="SPO: drop a token's gradient once log(pi / mu) against the sampler's log-prob "
        "(the trajectory's behaviour_logprobs) is past +-this in the direction its sequence is pushed (PPO's clip; "
        "terminal / advantage objectives; rows without behaviour log-probs are not clipped). Unset: "
        f"{ONLINE_TRUST_REGION} for the 'online' source, off for the others; 0: off")
    max_coefficient: float | None = Field(
        None, gt=0, description="SPO: clip each sequence's loss coefficient dL/dQ_T to +-this (coefficient_clip, "
        "after any centring): a guard for off-policy data with very low pi_0 log-probs, e.g. expert text under the "
        "cross-entropy loss (docs/offpolicy-data.md); terminal / advantage objectives. Unset: off")
    pg_coef: float = Field(0.0, ge=0, description="SPO: add this times a policy-gradient term with a leave-one-out "
                           "reward baseline (the paper's suggestion); moves the fixed point from pi* towards higher "
                           "reward")
    normalise: Literal["sequence", "token"] = Field(
        "sequence", description="SPO: each sequence's loss counts once (sequence) or divided by its response "
        "tokens (token: long responses no longer dominate the gradient); pi* stays the optimum either way")
    transforms: list[TransformName] = Field(
        default_factory=list, description="SPO: coefficient transforms in the order they apply, each a name of "
        "algorithms/spo_transforms.py TRANSFORMS or a hook 'package.module:function' of your own "
        "(docs/extending-spo.md). The fields above add theirs with their parameters (centre: centre_groups, "
        "trust_region, normalise token: token_normalise, pg_coef: policy_gradient) where the list does not name "
        "them: in TRANSFORMS order around the built-ins it names, before its hooks. coefficient_baseline instead of "
        "centre_groups: baselines over the whole step, every step (one more no-grad forward)")

    def weight_at(self, step: int) -> float:
        """The source's weight at training step ``step`` (1-based)."""
        if self.weight_final is None:
            return self.weight
        done = min(1.0, (step - 1) / max(1, self.weight_steps - 1))
        return self.weight + (self.weight_final - self.weight) * done

    @model_validator(mode="after")
    def _check_pair(self) -> SourceConfig:
        from megatron_spo.algorithms.spo import CENTRABLE_OBJECTIVES, UNSUPPORTED
        from megatron_spo.algorithms.spo_transforms import CENTRINGS, NEEDS_COEFFICIENT

        if (self.weight_final is None) != (self.weight_steps == 0) or self.weight_steps == 1:
            raise ValueError(f"weight_final {self.weight_final} with weight_steps {self.weight_steps}: a schedule "
                             "needs both (the final weight and the step it is reached at, 2 or later: step 1 has "
                             "`weight`)")
        why = UNSUPPORTED.get((self.objective, self.loss))
        if why:
            raise ValueError(f"objective '{self.objective}' with loss '{self.loss}' is not supported ({why})")
        for name, given in (("centre", self.centre), ("trust_region", bool(self.trust_region)),
                            ("max_coefficient", self.max_coefficient is not None)):
            if given and self.objective not in CENTRABLE_OBJECTIVES:
                raise ValueError(f"{name}: needs objective {' or '.join(CENTRABLE_OBJECTIVES)}, not "
                                 f"'{self.objective}' (its loss is not a function of Q_T alone)")
        listed = self.transforms
        for name in listed:
            if listed.count(name) > 1:
                raise ValueError(f"transforms: '{name}' is listed twice")
            if name in NEEDS_COEFFICIENT and self.objective not in CENTRABLE_OBJECTIVES:
                raise ValueError(f"transforms: {name} needs objective {' or '.join(CENTRABLE_OBJECTIVES)}, not "
                                 f"'{self.objective}' (its loss is not a function of Q_T alone)")
        # a listed built-in its own field turns off explicitly
        off = {"centre_groups": ("centre", self.centre is False),
               "coefficient_baseline": ("centre", self.centre is False),
               "trust_region": ("trust_region", self.trust_region == 0),
               "policy_gradient": ("pg_coef", not self.pg_coef),
               "token_normalise": ("normalise", "normalise" in self.model_fields_set and self.normalise != "token")}
        for name in listed:
            field, is_off = off.get(name, ("", False))
            if is_off:
                raise ValueError(f"transforms: {name} is listed but {field} is {getattr(self, field)!r} (off)")
        if len(set(CENTRINGS) & set(listed)) > 1:
            raise ValueError(f"transforms: list one of {', '.join(CENTRINGS)} (each centres the coefficient)")
        return self

    def transform_specs(self, name: str) -> list[tuple[str, dict]]:
        """Source `name`'s SPO coefficient transforms in order, each (a TRANSFORMS name or a hook, its parameters):
        the list, joined by the transforms the fields turn on that it does not name, in TRANSFORMS order: each
        right after the last listed built-in that precedes it there (else first). So the trust region follows
        whichever centring runs, and a hook runs after the fields' transforms unless the list places them."""
        from megatron_spo.algorithms.spo import CENTRABLE_OBJECTIVES
        from megatron_spo.algorithms.spo_transforms import CENTRINGS, TRANSFORMS

        names = list(self.transforms)
        centrable = self.objective in CENTRABLE_OBJECTIVES
        centre = self.centre if self.centre is not None else name == "online" and centrable
        on = {"centre_groups": centre and not set(CENTRINGS) & set(names),
              "trust_region": self.clip(name) is not None,
              "coefficient_clip": self.max_coefficient is not None,
              "token_normalise": self.normalise == "token",
              "policy_gradient": self.pg_coef > 0}
        order = {n: k for k, n in enumerate(TRANSFORMS)}
        for n in sorted((n for n, is_on in on.items() if is_on and n not in names), key=order.get):
            after = [j + 1 for j, m in enumerate(names) if order.get(m, len(order)) < order[n]]
            names.insert(max(after, default=0), n)
        if "trust_region" in names and self.clip(name) is None:
            raise ValueError(f"sources.{name}.transforms: trust_region needs sources.{name}.trust_region > 0 "
                             "(off by default for a source other than 'online')")
        if "coefficient_clip" in names and self.max_coefficient is None:
            raise ValueError(f"sources.{name}.transforms: coefficient_clip needs sources.{name}.max_coefficient")
        params = {"trust_region": {"limit": self.clip(name)}, "policy_gradient": {"coef": self.pg_coef},
                  "coefficient_clip": {"limit": self.max_coefficient}}
        return [(n, params.get(n, {})) for n in names]

    def centred(self, name: str) -> bool:
        """Whether source `name` trains with the group-centred coefficient."""
        from megatron_spo.algorithms.spo_transforms import CENTRINGS

        return any(n in CENTRINGS for n, _ in self.transform_specs(name))

    def clip(self, name: str) -> float | None:
        """Source `name`'s trust region (None: off)."""
        from megatron_spo.algorithms.spo import CENTRABLE_OBJECTIVES

        if self.trust_region is not None:
            return self.trust_region or None
        return ONLINE_TRUST_REGION if name == "online" and self.objective in CENTRABLE_OBJECTIVES else None


class OptimizerConfig(StrictModel):
    lr: float = Field(6e-8, gt=0, description="paper: 6e-8 for Llama-3.1-8B, constant after warm-up")
    warmup_steps: int = Field(200, ge=0)
    weight_decay: float = Field(0.0, ge=0)
    adam_beta1: float = Field(0.9, ge=0, lt=1)
    adam_beta2: float = Field(0.95, ge=0, lt=1)
    adam_eps: float = Field(1e-8, gt=0)
    clip_grad: float = Field(1.0, gt=0)
    decay: Literal["constant", "linear", "cosine"] = Field(
        "constant", description="after the warm-up: constant (the paper's), or linear / cosine down to "
        "min_lr_fraction * lr at the last step")
    min_lr_fraction: float = Field(0.1, ge=0, le=1, description="the decay's final lr as a fraction of lr")
    value_lr: float | None = Field(None, gt=0, description="PPO value model (default: lr)")


class BatchConfig(StrictModel):
    sequences_per_step: int = Field(128, gt=0, description="global batch: trajectories per optimizer step")
    max_tokens_per_micro_batch: int = Field(16384, gt=0, description="tokens per micro-batch: the packed tokens "
                                            "with pack_sequences, else rows x the longest row")
    pack_sequences: bool = Field(
        True, description="micro-batches carry whole sequences back to back with no padding (THD: "
        "models/packing.py); needs parallel.attention_kernel sdpa or Transformer Engine's attention")
    max_seq_length: int = Field(4096, gt=1, description="prompt + response tokens; longer ones are refused")


class LogprobsConfig(StrictModel):
    """How the trainer runs the fused LM-head log-prob op (megatron_spo.ops.token_logprobs)."""

    backend: Literal["auto", "torch", "triton"] = Field(
        "auto", description="per-block softmax kernels: auto = Triton on a GPU when installed, else torch")
    fp8: bool = Field(False, description="LM-head logits GEMM in FP8 E4M3 (per-tensor scales; softmax statistics "
                      "and gradient GEMMs keep their precision); needs a GPU of compute capability >= 8.9")
    chunk_size: int | None = Field(None, gt=0, description="tokens per block (default min(N, 4096) on CPU, "
                                   "min(N, 16384) on a GPU)")
    max_block_bytes: int | None = Field(None, ge=4096, description="bytes of one fp32 logits block (default 64 "
                                        "MiB; on an H200, 128 MiB ran 5% faster for 0.09 GiB more at Llama-3's head)")

    def op_kwargs(self) -> dict:
        """Keyword arguments for token_logprobs (unset sizes left to its defaults)."""
        return {k: v for k, v in self.model_dump().items() if v is not None}


class BehaviourCorrectionConfig(StrictModel):
    """How PPO and GRPO weigh samples of a stale sampler mu (their shared fields)."""

    behaviour_correction: Literal["none", "tis", "mis"] = Field(
        "none", description="stale samples (algorithms/behaviour_correction.py): the ratio against the policy at "
        "the start of the step (one more forward pass), each token weighted by min(pi_old/mu, C) (tis) or dropped "
        "outside [1/C, C] (mis); weights may then be pushed every model_update_interval steps. none: on-policy, "
        "a push every step")
    correction_cap: float = Field(2.0, gt=1, description="C of behaviour_correction")
    correction_level: Literal["token", "sequence"] = Field(
        "token", description="sequence: one ratio pi_old/mu per sequence, the geometric mean of its tokens'")


class PPOConfig(BehaviourCorrectionConfig):
    clip_eps: float = Field(0.2, gt=0)
    value_clip_eps: float | None = Field(0.2, gt=0)
    gamma: float = Field(1.0, ge=0, le=1)
    lam: float = Field(1.0, ge=0, le=1, description="GAE lambda. 1 (verl's default): every token's advantage "
                       "carries the terminal reward, G - V_t. At 0.95 a fresh critic's noise dominates the early "
                       "tokens (0.95^60 ~ 0.05 of the reward reaches token 0 of a 60-token answer): quickstart PPO "
                       "pass@1 +0.035 at 0.95, +0.137 at 1 (README)")
    whiten_advantages: bool = True
    critic_warmup_steps: int = Field(0, ge=0, description="first steps train only the value model (verl's "
                                     "critic_warmup): a fresh value head makes GAE advantages noise")


class GRPOConfig(BehaviourCorrectionConfig):
    """GRPO (training/algos/grpo.py): TRL's GRPOTrainer defaults where it has them."""

    clip_eps: float = Field(0.2, gt=0, description="lower clip of the importance ratio: 1 - clip_eps")
    clip_eps_high: float | None = Field(None, gt=0, description="upper clip 1 + clip_eps_high (DAPO); default clip_eps")
    kl_coef: float | None = Field(None, ge=0, description="deprecated: the KL coefficient of every algorithm is "
                                  "`beta` (GRPO's k3 KL(pi || pi_0) penalty; read as beta, with a warning)")
    scale_rewards: bool = Field(True, description="divide group-centred rewards by the group std")
    aggregation: Literal["sequence_mean", "token_mean"] = Field(
        "token_mean", description="token_mean: over all response tokens of the batch (DAPO / TRL); "
        "sequence_mean: per sequence, then over sequences (the GRPO paper)")
    guide_path: str | None = Field(
        None, description="mixed-policy GRPO (LUFFY, Yan et al. 2025; algorithms/grpo.py): a JSONL file or offline "
        "store of demonstrations (expert text, another model's samples, with their rewards); each online prompt group "
        "gets guide_per_prompt of its prompt's records, which share the group's advantage normalisation and train "
        "through the shaped term -f(pi) A, f(p) = p / (p + guide_shaping). Prompts without a record stay on-policy")
    guide_per_prompt: int = Field(1, gt=0, description="demonstrations added to each prompt group (LUFFY: 1 beside "
                                  "7 rollouts); a prompt's records are taken round-robin, resumably")
    guide_shaping: float = Field(0.1, gt=0, description="gamma of the shaping f(p) = p / (p + gamma) of the "
                                 "demonstrations' token probabilities (LUFFY's 0.1)")


class AGROConfig(StrictModel):
    on_policy: bool = False


class ArchiveConfig(StrictModel):
    """The trainer's experience archive (data/archive.py): every online trajectory it trains on, kept for
    later runs (SPO learns from them offline)."""

    enabled: bool = True
    path: str | None = Field(None, description="an offline store; default RUN_DIR/experience")
    run_id: str | None = Field(None, description="provenance run id of the archived records; default the "
                               "run_dir's name")
    rows_per_shard: int = Field(4096, gt=0, description="records per shard (also flushed at every checkpoint)")


class CheckpointConfig(StrictModel):
    interval: int = Field(100, gt=0, description="save every this many steps (and on SIGTERM / SIGUSR1)")
    keep_last: int = Field(2, gt=0)
    dir: str | None = Field(None, description="default: RUN_DIR/checkpoints")
    async_save: bool = Field(False, description="write the model and optimizer shards in a background thread while "
                             "the next steps train (megatron-core's torch_dist format and planning); the step blocks "
                             "for the planning and a copy to host memory (as much host memory as this rank's shards), "
                             "and the checkpoint becomes complete and `latest` once every rank has written it. The "
                             "last step's and a preemption's checkpoints are written before the run exits")
    export_hf: bool = Field(True, description="write the final policy as an HF directory RUN_DIR/hf")
    allow_config_change: bool = Field(False, description="resume with a config that differs from the checkpoint's "
                                      "(the changes are logged and kept in RUN_DIR/config-history); else refused")
    verify: bool = Field(True, description="check the files this run reads (the init checkpoint, the checkpoint it "
                         "resumes, offline stores) against their digests, refusing a corrupt one by name; false "
                         "(train --no-verify) for files you edited yourself")


class LoggingConfig(StrictModel):
    wandb_project: str | None = None
    wandb_mode: Literal["online", "offline", "disabled"] = "offline"
    wandb_entity: str | None = Field(None, description="wandb team or user (default: wandb's own default)")
    wandb_name: str | None = Field(None, description="wandb run name (default: the run directory's name)")
    wandb_group: str | None = Field(None, description="wandb group, e.g. one per sweep or study")
    wandb_tags: list[str] = Field(default_factory=list, description="wandb tags")
    progress: bool = True
    max_log_ratio: float | None = Field(
        50.0, gt=0, description="stop when the mean sequence log(pi / pi_0) exceeds this (a collapse; docs/engineering-notes.md)"
    )
    max_residual: float | None = Field(
        1.0, gt=0, description="stop when the signed mean residual Q_T - r of an SPO source stays above this for "
        "residual_patience steps: the drift that precedes a collapse (MATH.md section 7), which rises long before "
        "the log-ratio does. Rewards in [-1, 0] give residuals of order beta * KL(pi || pi*) near the optimum")
    max_residual_rms: float | None = Field(
        1.5, gt=0, description="stop when the root-mean-square residual Q_T - r of an SPO source stays above this for "
        "residual_patience steps (rewards and Q0 lie in [-1, 0]: above 1, Q_T has left the reward range)")
    residual_patience: int = Field(5, gt=0, description="consecutive steps over max_residual / max_residual_rms "
                                   "before stopping")
    policy_entropy: bool = Field(
        True, description="log the policy's mean per-token entropy (nats) from its log-prob pass: no extra GEMM"
    )
    max_logprob_gap: float | None = Field(
        0.1, gt=0, description="warn (one line naming the step) when the mean per-token |log-prob| gap between "
        "the engines and the trainer on samples of the current weights exceeds this: a broken weight push, "
        "conversion or precision mismatch (training/logprob_gap.py; bf16 noise is ~1e-2)"
    )


class HeldOutEvalConfig(StrictModel):
    """Held-out pass@k during training (training/held_out_eval.py): right after the weight push of every
    `interval`-th step, rank 0 samples n completions per problem through the engines and scores them with
    engine_tools/eval.py; logged as eval/pass@K and eval/problems."""

    interval: int = Field(0, ge=0, description="evaluate every this many steps (0: off); a multiple of "
                          "model_update_interval, so the engines hold the step's weights")
    paths: list[str] = Field(default_factory=list, description="held-out problem files, read as task.kind reads "
                             "task.paths; empty: the generated task's (toy / toy_math) held-out split")
    n: int = Field(8, gt=0, description="samples per problem")
    ks: tuple[int, ...] = Field((1,), min_length=1, description="the k of pass@k, each at most n")
    temperature: float = Field(0.4, ge=0, description="0 = greedy (SPO paper: 0.4)")
    top_p: float = Field(0.95, gt=0, le=1)
    max_new_tokens: int | None = Field(None, gt=0, description="default: rollout.max_new_tokens")
    limit: int | None = Field(64, gt=0, description="only the first N held-out problems (None: all)")
    hidden_tests: bool = Field(True, description="score with the problems' hidden tests too, when present")
    warn_drop: float | None = Field(0.1, gt=0, description="warn when pass@k of the first of ks falls this far below "
                                    "its best since the run (re)started: the slow decay the divergence guards miss "
                                    "(None: no warning)")

    @field_validator("ks")
    @classmethod
    def _ks_at_most_n(cls, ks: tuple[int, ...], info: ValidationInfo) -> tuple[int, ...]:
        n = info.data.get("n")
        bad = [k for k in ks if k < 1 or (n is not None and k > n)]
        if bad:
            raise ValueError(f"each k must lie in [1, n = {n}] (samples per problem), got {list(bad)}")
        return ks


def kl_coef_as_beta(grpo: GRPOConfig, beta: float | None, algo: str, where: str = "") -> float | None:
    """beta, with the deprecated grpo.kl_coef read as it acted before the rename: for algo grpo it was the KL
    coefficient, so it is beta (a beta beside it, as every config dump of those days carried, was unused by
    GRPO); for any other algorithm it never acted and is dropped. One warning line when it mattered; kl_coef is
    then cleared, so a config dumped and read again (the ranks', a checkpoint's) does not warn twice."""
    kl = grpo.kl_coef
    if kl is None:
        return beta
    grpo.__dict__["kl_coef"] = None
    if algo != "grpo":
        if kl != 0.0:  # 0.0, its old default, is in every old dump: nothing to say
            log.warning("%sgrpo.kl_coef is deprecated and acted only for algo grpo: ignored", where)
        return beta
    unused = f"; {where}beta {beta:g} beside it is replaced" if beta is not None and beta != kl else ""
    log.warning("%sgrpo.kl_coef is deprecated: the KL coefficient of every algorithm is %sbeta (read as beta = %g%s)",
                where, where, kl, unused)
    return kl


class TrainConfig(StrictModel):
    run_dir: str = "runs/spo"
    seed: int = 1234
    deterministic: bool = Field(
        False, description="bitwise reruns on a GPU (slower): torch's deterministic algorithms, an op without a "
        "deterministic CUDA kernel raising with its name, and cuBLAS's fixed workspace (CUBLAS_WORKSPACE_CONFIG "
        ":4096:8 unless set). Off, an H100 rerun of PPO differed by 4e-9 in the weights at step 3 (2026-11-26)")
    steps: int = Field(100_000, gt=0)
    algo: AlgoName = Field("spo", description="a registered algorithm (training/algos/) or a hook "
                           "'package.module:Class'")
    beta: float | None = Field(
        None, ge=0, description="KL strength of every algorithm (SPO / AGRO: the soft value's temperature; PPO: the KL "
        "reward; GRPO: the k3 penalty). Unset: the algorithm's default_beta (training/algos/): 1/log(1e5), the SPO "
        "paper's, for SPO / AGRO / PPO; 0 for GRPO (TRL's default: no KL term)")
    model_update_interval: int = Field(10, gt=0, description="steps between weight pushes to the rollout fleet")
    reference_refresh_interval: int | None = Field(
        None, gt=0, description="every this many steps the reference model becomes a copy of the policy (the SPO "
        "paper's suggestion): the KL term then holds the policy near its recent self instead of pi_0, so the fixed "
        "point moves from pi* towards the highest reward (docs/spo-stability.md). From the first refresh on, "
        "online groups take Q0 = beta log mean exp(r / beta) over their own rewards. SPO needs every source centred "
        "with the squared loss (where Q0 cancels from the gradient): offline data's Q0 is of the first reference. "
        "The reference is checkpointed with the policy")
    init: InitConfig = Field(default_factory=InitConfig)
    routing_replay: Literal["engine", "off"] = Field(
        "engine", description="mixture-of-experts models (model.moe): engine = rollouts carry the experts the engine "
        "routed each token to (engines started with --enable-return-routed-experts) and the policy's routers replay "
        "them in its forward and backward passes, so its log-probs of the engine's tokens are computed through the "
        "same experts; trajectories without routes (offline data, an earlier run's experience) route themselves. "
        "pi_0's log-probs (the reference model, or the policy with its LoRA adapters off) replay the same routes: "
        "the log-ratio log pi - log pi_0 then measures how the weights moved, not where two routings disagree (at "
        "the initial weights it is exactly 0; a reference routing itself makes it nonzero wherever routes differ). "
        "The PPO value model routes itself. off = every pass routes itself. Dense models: no effect")
    lora: LoraConfig | None = Field(
        None, description="train LoRA adapters on the policy's linears instead of the whole model (models/lora.py): "
        "the base is frozen, the optimizer holds the adapters only, and pi_0 is the policy with its adapters off "
        "(no reference model is built). Weight pushes and the HF export carry the merged weights W + s * B A")
    model: ModelConfig | None = Field(None, description="default: read from init.hf/config.json (or init.megatron's "
                                      "model_config.json); a partial section (model.params_dtype=float32) overrides "
                                      "those fields of it")
    parallel: ParallelConfig = Field(default_factory=ParallelConfig)
    optimizer: OptimizerConfig = Field(default_factory=OptimizerConfig)
    batch: BatchConfig = Field(default_factory=BatchConfig)
    logprobs: LogprobsConfig = Field(default_factory=LogprobsConfig)
    sources: dict[str, SourceConfig] = Field(default_factory=lambda: {"online": SourceConfig()})
    ppo: PPOConfig = Field(default_factory=PPOConfig)
    agro: AGROConfig = Field(default_factory=AGROConfig)
    grpo: GRPOConfig = Field(default_factory=GRPOConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    archive: ArchiveConfig = Field(default_factory=ArchiveConfig)
    logging: LoggingConfig = Field(default_factory=LoggingConfig)
    eval: HeldOutEvalConfig = Field(default_factory=HeldOutEvalConfig)
    task: TaskConfig = Field(default_factory=TaskConfig)
    fleet: FleetEndpoints = Field(default_factory=FleetEndpoints)
    rollout: RolloutConfig = Field(default_factory=lambda: RolloutConfig())
    sandbox: SandboxConfig = Field(default_factory=lambda: SandboxConfig())
    nproc: int = Field(1, gt=0, description="trainer processes when launched without torchrun/srun")

    @model_validator(mode="before")
    @classmethod
    def _model_over_init(cls, data):
        """A ``model:`` section without a required field is read as overrides of the init model's config
        (init.megatron's model_config.json, else init.hf's config.json): ``model.params_dtype=float32`` alone trains in
        fp32. ValueError naming the field when there is no init model to read."""
        model = data.get("model") if isinstance(data, dict) else None
        if not isinstance(model, dict):
            return data
        required = [n for n, f in ModelConfig.model_fields.items() if f.is_required()]
        if all(n in model for n in required):
            return data
        init = data.get("init") or {}
        init = init if isinstance(init, dict) else getattr(init, "model_dump", dict)()
        if not (init.get("megatron") or init.get("hf")):
            raise ValueError(f"model: a partial section ({', '.join(sorted(model))}) overrides the init model's "
                             f"config, and init names none; give init.hf, or the whole model section ({', '.join(required)})")
        field = "init.megatron" if init.get("megatron") else "init.hf"
        try:
            if init.get("megatron"):
                from megatron_spo.models.megatron_checkpoint import read_megatron_config

                base = read_megatron_config(init["megatron"])
            else:
                from megatron_spo.models.hf_checkpoint import read_hf_config

                base = read_hf_config(init["hf"])
        except (OSError, ValueError) as err:
            raise ValueError(f"model: a partial section overrides {field}'s model config, which cannot be read: "
                             f"{err}") from None
        return {**data, "model": {**base.model_dump(), **model}}

    @model_validator(mode="after")
    def _check(self) -> TrainConfig:
        if not self.sources:
            raise ValueError("sources: at least one data source is needed")
        if sum(s.weight for s in self.sources.values()) <= 0:
            raise ValueError("sources: the weights must have a positive sum")
        final = {n: s.weight if s.weight_final is None else s.weight_final for n, s in self.sources.items()}
        if sum(final.values()) <= 0:
            raise ValueError(f"sources: the weights at the end of their schedules {final} must have a positive sum")
        if GUIDE_SOURCE in self.sources:
            raise ValueError(f"sources.{GUIDE_SOURCE}: the name '{GUIDE_SOURCE}' is reserved for grpo.guide_path's "
                             "demonstrations; name the source otherwise")
        for name, src in self.sources.items():
            if name == "online" and src.path is not None:
                raise ValueError("sources.online.path: the online source reads the rollout buffer, not a path")
            if name != "online" and src.path is None:
                raise ValueError(f"sources.{name}.path: an offline source needs a path")
            src.transform_specs(name)  # refuses a listed transform its fields leave without a parameter
        from megatron_spo.training.algos import algorithm_class

        algo = algorithm_class(self.algo, load_hooks=False)  # a hook is loaded (and checked) by the trainer
        beta = kl_coef_as_beta(self.grpo, self.beta, self.algo)
        # resolved here, so a config dumped for the ranks (or a checkpoint) carries the number itself
        self.__dict__["beta"] = beta if beta is not None else algo.default_beta if algo is not None else PAPER_BETA
        if algo is not None:
            algo.check_config(self)
        if self.grpo.guide_path and self.algo != "grpo":
            raise ValueError(f"grpo.guide_path: demonstrations join GRPO's prompt groups (mixed-policy GRPO); algo is "
                             f"'{self.algo}' (SPO takes other data as a source: sources.NAME.path)")
        self._check_eval()
        env = self.rollout.env
        if env is not None and env.max_total_tokens > self.batch.max_seq_length:
            raise ValueError(f"rollout.env.max_total_tokens: a conversation of up to {env.max_total_tokens} tokens "
                             f"does not fit batch.max_seq_length {self.batch.max_seq_length} (the trainer refuses "
                             "longer records); lower it or raise batch.max_seq_length")
        if self.batch.pack_sequences and self.parallel.attention_kernel == "dot_product":
            raise ValueError("batch.pack_sequences: megatron-core's DotProductAttention (parallel.attention_kernel "
                             "dot_product) refuses packed sequences; use attention_kernel sdpa, or pack_sequences false")
        if self.lora is not None and self.reference_refresh_interval:
            raise ValueError("reference_refresh_interval: with lora the reference is the base model (the adapters "
                             "off); refreshing it would fold the adapters into the base, which is not implemented")
        if self.init.hf is None and self.init.megatron is None:
            raise ValueError("init: give init.hf (an HF model directory) or init.megatron (a converted checkpoint)")
        return self

    def _check_eval(self) -> None:
        from megatron_spo.data.tasks import TASK_KINDS

        ev = self.eval
        if ev.interval and ev.interval % self.model_update_interval:
            raise ValueError(f"eval.interval: {ev.interval} is not a multiple of model_update_interval "
                             f"{self.model_update_interval} (the engines hold a step's weights only after its push)")
        if ev.interval and not ev.paths and TASK_KINDS[self.task.kind].needs_files:
            raise ValueError(f"eval.paths: task kind '{self.task.kind}' has no held-out split; give held-out "
                             "problem files")
