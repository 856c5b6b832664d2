"""The offline tools' configs: estimate-q0, pts and eval, and how they sample from the engines."""

from __future__ import annotations

from pydantic import Field, model_validator

from megatron_spo.config import ConfigView, StrictModel
from megatron_spo.data.config import TaskConfig
from megatron_spo.data.q0 import PAPER_BETA
from megatron_spo.environments.config import EnvConfig
from megatron_spo.models.config import InitConfig
from megatron_spo.rewards.config import SandboxConfig
from megatron_spo.rollout.config import FleetEndpoints


class ToolSamplingConfig(StrictModel):
    """How an offline tool samples from the engines (one SamplingParams per request)."""

    temperature: float = Field(1.0, ge=0, description="0 = greedy")
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(-1, description="-1 = off")
    max_new_tokens: int = Field(512, gt=0)
    seed: int | None = Field(None, description="None: engine randomness, n samples per request. A seed: every "
                             "sample gets its own sampling_seed (one request each), reproducible only on engines "
                             "with deterministic inference (SGLang --enable-deterministic-inference, which shares "
                             "one seed among the n samples of a request and ignores seeds otherwise)")
    samples_per_request: int = Field(64, gt=0, description="n of one /generate call; more samples = more calls")
    concurrency: int = Field(8, gt=0, description="prompts in flight at once")
    max_retries: int = Field(3, ge=0, description="a request that fails retryably (timeout, lost connection, 5xx) "
                             "is sent again up to this many times, then the tool stops (its finished items kept)")
    retry_backoff_s: float = Field(2.0, gt=0, description="wait before the first retry; doubles per retry (to 60 s)")

    @model_validator(mode="after")
    def _check_top_k(self) -> ToolSamplingConfig:
        if self.top_k != -1 and self.top_k < 1:
            raise ValueError(f"top_k must be -1 (off) or >= 1, got {self.top_k}")
        return self


class Q0Config(StrictModel):
    """Monte-Carlo S0 / Q0 per prompt from reference samples (SPO paper 3.1.3: 800 samples at T = 1)."""

    samples: int = Field(800, gt=0, description="samples per prompt")
    beta: float = Field(PAPER_BETA, gt=0)
    prior: float = Field(0.5, ge=0, description="S0 = (correct + prior) / (samples + 2 prior): the posterior mean "
                         "under a Beta(prior, prior) prior (0.5 Jeffreys'; 0 the plain rate; data/q0.py)")
    sampling: ToolSamplingConfig = Field(default_factory=ToolSamplingConfig)


class PTSConfig(StrictModel):
    """Pivotal token search (Abdin et al. 2024, as used by the SPO paper for Monte-Carlo targets)."""

    rollouts_per_point: int = Field(10, gt=0, description="K rollouts estimating S_t at one prefix")
    threshold: float = Field(0.2, gt=0, le=1, description="recurse while |S(end) - S(start)| >= threshold")
    max_rollouts: int = Field(200, gt=0, description="rollout budget per trajectory")
    success_reward: float = Field(0.0, description="a trajectory with reward >= this is successful")
    source: str = Field("mc", min_length=1, description="source name of the annotated records")
    sampling: ToolSamplingConfig = Field(default_factory=lambda: ToolSamplingConfig(samples_per_request=16))

    @model_validator(mode="after")
    def _check_budget(self) -> PTSConfig:
        if self.max_rollouts < self.rollouts_per_point:
            raise ValueError(f"max_rollouts ({self.max_rollouts}) < rollouts_per_point ({self.rollouts_per_point}): "
                             "not one estimate fits the budget")
        return self


class EvalConfig(StrictModel):
    """pass@k from n samples per problem (SPO paper: n = 20, T = 0.4, top-p 0.95, k = 1 and 10)."""

    n: int = Field(20, gt=0, description="samples per problem")
    ks: tuple[int, ...] = Field((1, 10), min_length=1)
    hidden_tests: bool = Field(True, description="score with the problems' hidden tests too, when present")
    sampling: ToolSamplingConfig = Field(default_factory=lambda: ToolSamplingConfig(temperature=0.4, top_p=0.95))

    @model_validator(mode="after")
    def _check_ks(self) -> EvalConfig:
        bad = [k for k in self.ks if not 1 <= k <= self.n]
        if bad:
            raise ValueError(f"ks {list(bad)} must lie in [1, n = {self.n}]")
        return self


class HeldOutView(ConfigView):
    """What `eval CONFIG` reads of a training config's eval section (training/config.py HeldOutEvalConfig, whose
    defaults these are): the held-out problems and whether hidden tests count."""

    paths: list[str] = Field(default_factory=list)
    limit: int | None = Field(64, gt=0)
    hidden_tests: bool = True


class RolloutEnvView(ConfigView):
    """What the offline tools read of a training config's rollout section: its environment (multi-turn), if any."""

    env: EnvConfig | None = None


class TrainConfigView(ConfigView):
    """What the offline tools read of a training config: its task and reward (task.reward), the sandbox that
    runs code rewards, tokenizer (init.hf), engines, beta, held-out problems and the environment (rollout.env) the
    conversations run (the trainer checks the rest of the file)."""

    task: TaskConfig = Field(default_factory=TaskConfig)
    init: InitConfig = Field(default_factory=InitConfig)
    fleet: FleetEndpoints = Field(default_factory=FleetEndpoints)
    sandbox: SandboxConfig = Field(default_factory=SandboxConfig)
    beta: float = Field(PAPER_BETA, gt=0)
    eval: HeldOutView = Field(default_factory=HeldOutView)
    rollout: RolloutEnvView = Field(default_factory=RolloutEnvView)
