"""The contenders of `megatron-spo compare` (experiments/study.py) and where each run of a study lives.

    ARMS["spo-data"]                     -> Arm(algo "spo", fixed overrides, swept coefficient and its grid, ...)
    RunSpec("runs", "grpo", 0, (("train.lr", 3e-5),)).run_dir(root) -> root/runs/grpo/lr3e-05_seed0/grpo
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megatron_spo.data.q0 import PAPER_BETA


@dataclass(frozen=True)
class Arm:
    """One contender: the quickstart algorithm, its fixed overrides, and the coefficient the sweep varies."""

    algo: str
    overrides: tuple[str, ...]
    coefficient: str  # dotted quickstart path of the swept KL coefficient (train.beta for every algorithm)
    grid: tuple[float, ...]
    about: str
    uses: tuple[str, ...] = ()  # the study's data: "data" (an SPO offline source), "sft" (the SFT stage first)
    lr_scale: float = 1.0  # the sweep tries sweep.lrs times this (LoRA: 10x full fine-tuning's grid)


ARMS: dict[str, Arm] = {
    "spo": Arm("spo", (), "train.beta", (PAPER_BETA, 0.5, 1.0), "SPO, online + offline (the quickstart)"),
    "spo-online": Arm("spo", ("train.online_fraction=1.0",), "train.beta", (PAPER_BETA, 0.5, 1.0),
                      "SPO, online rollouts only (centred coefficient, trust region 0.2)"),
    "spo-online-plain": Arm("spo", ("train.online_fraction=1.0", "train.centre=false", "train.trust_region=null"),
                            "train.beta", (PAPER_BETA, 0.5, 1.0),
                            "SPO, online only, uncentred coefficient and no trust region (before issue 26)"),
    "spo-online-refresh": Arm("spo", ("train.online_fraction=1.0", "train.reference_refresh_interval=30"),
                              "train.beta", (PAPER_BETA, 0.5, 1.0),
                              "SPO, online only, the reference refreshed to the policy every 30 steps (the paper's "
                              "suggestion: the fixed point moves from pi* towards the highest reward)"),
    "spo-paper": Arm("spo", ("train.loss=cross_entropy", "train.temperature_range=[0.1,0.8]", "train.top_p=0.95",
                             "train.online_fraction=0.5", "train.model_update_interval=10", "train.centre=false",
                             "train.trust_region=null"), "train.beta",
                     (PAPER_BETA,), "SPO at the paper's settings: terminal cross-entropy, beta 1/log(1e5), "
                     "T ~ U(0.1, 0.8), top-p 0.95, 50/50 online/offline, push every 10 steps, no centring or "
                     "trust region"),
    # issue 46: LoRA (rank 8, alpha 16, every linear; adapter pushes) at 10x SPO's lr 3e-5, not swept: LoRA's best
    # lr is commonly ~10x full fine-tuning's (Thinking Machines, "LoRA Without Regret", 2025; Biderman et al. 2024)
    "spo-lora": Arm("spo", ("train.lora={}", "train.lr=0.0003"), "train.beta", (PAPER_BETA, 0.5, 1.0),
                    "SPO (the quickstart's, online + offline) training LoRA adapters (rank 8, alpha 16, every linear; "
                    "pi_0 = the policy with its adapters off; pushes send the adapters alone) at lr 3e-4, 10x full "
                    "SPO's 3e-5 without a sweep; a sweep tries 10x its learning rates: LoRA's best lr is commonly ~10x "
                    "full fine-tuning's (Thinking Machines, \"LoRA Without Regret\", 2025; Biderman et al. 2024)",
                    lr_scale=10.0),
    # issue 62: what the Jeffreys prior on S0 changes (q0_prior 0.5, the default) against the plain success rate
    "spo-q0-rate": Arm("spo", ("q0_prior=0",), "train.beta", (PAPER_BETA, 0.5, 1.0),
                       "SPO (the quickstart's) with Q0 from the plain success rate of the Q0 samples (q0_prior 0: a "
                       "prompt with no success gets S0 = 0 and the clipped Q0, as before issue 62)"),
    # issue 63: the online rollouts as conversations with the sandbox's feedback (the code task)
    "spo-multi-turn": Arm("spo", ("env.name=code_feedback",), "train.beta", (PAPER_BETA, 0.5, 1.0),
                          "SPO (the quickstart's) on multi-turn rollouts: the model's program, the failing public "
                          "test's input / expected / actual output, a revision (env=code_feedback, up to 4 turns); "
                          "evaluated by single-turn samples (this table) and as conversations (the multi-turn section)"),
    "agro": Arm("agro", (), "train.beta", (PAPER_BETA, 0.5, 1.0), "AGRO, online"),
    "ppo": Arm("ppo", (), "train.beta", (0.05, 0.5), "PPO: value model, GAE, KL reward, push every step"),
    "grpo": Arm("grpo", (), "train.beta", (0.0, 0.04), "GRPO on megatron-core"),
    "grpo-tis": Arm("grpo", ("train.model_update_interval=10", "train.grpo.behaviour_correction=tis"),
                    "train.beta", (0.0, 0.04), "asynchronous GRPO: pushes every 10 steps like SPO, stale "
                    "samples weighted by min(pi_old / mu, 2) (TIS, as slime / AReaL / verl run it)"),
    "trl-grpo": Arm("grpo", ("trainer=trl",), "train.beta", (0.0, 0.04),
                    "TRL's GRPOTrainer (outside reference)"),
    # issue 48: the study's own data (StudyConfig.data: expert solutions, another policy's samples, ...)
    "sft-grpo": Arm("grpo", (), "train.beta", (0.0, 0.04), "SFT on the study's data (sft_steps), then GRPO: the "
                    "common recipe", uses=("sft",)),
    "grpo-guided": Arm("grpo", ("offline_data_guide=1",), "train.beta", (0.0, 0.04), "mixed-policy GRPO (LUFFY, "
                       "Yan et al. 2025): one record of the study's data added to each prompt's rollout group, "
                       "sharing its advantages, trained through the shaped term -p / (p + 0.1) x advantage",
                       uses=("data",)),
    "spo-data": Arm("spo", (), "train.beta", (PAPER_BETA, 0.5), "SPO with the study's data as an offline source "
                    "(quickstart offline_data_fraction of each batch, out of the offline share)", uses=("data",)),
    "spo-data-anneal": Arm("spo", ("offline_data_anneal_steps=30",), "train.beta", (PAPER_BETA, 0.5),
                           "SPO with the study's data as a source whose share falls linearly to 0 over the first 30 "
                           "steps (quickstart offline_data_anneal_steps; the freed share goes to the other sources)",
                           uses=("data",)),
    "sft-spo": Arm("spo", ("offline_data_fraction=0",), "train.beta", (PAPER_BETA, 0.5),
                   "SFT on the study's data (the same sft_steps), then SPO at its usual mix", uses=("sft",)),
}
DATA_ARMS = tuple(a for a, arm in ARMS.items() if arm.uses)  # need StudyConfig.data


@dataclass(frozen=True)
class RunSpec:
    kind: str  # sweep | runs | long
    arm: str
    seed: int
    settings: tuple[tuple[str, Any], ...]  # (dotted path, value) on top of the arm's overrides

    @property
    def tag(self) -> str:
        return "_".join(f"{path.split('.')[-1]}{value:g}" for path, value in self.settings) or "default"

    def run_dir(self, root: Path) -> Path:
        return root / self.kind / self.arm / f"{self.tag}_seed{self.seed}" / ARMS[self.arm].algo
