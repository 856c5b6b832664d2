"""The rollout fleet's configs: where the engines are, and how the manager samples from them and pushes
weights to them (rollout/manager.py, rollout/weight_sync.py)."""

from __future__ import annotations

import os
from typing import Literal

from pydantic import Field, model_validator

from megatron_spo.config import ConfigError, StrictModel
from megatron_spo.environments.config import EnvConfig
from megatron_spo.rollout.protocol import SYNC_PAUSE_MODES


class FleetEndpoints(StrictModel):
    """Where the rollout engines are. Empty = read SPO_ROUTER_URL / SPO_ENGINE_URLS / ENGINE_TP (set by
    slurm/spo.sbatch)."""

    router_url: str | None = None
    engine_urls: list[str] = Field(default_factory=list)
    engine_tp_size: int | None = Field(None, gt=0, description="TP size every engine was launched with; checked "
                                       "against each engine's /server_info before a weight push (None: trust it)")

    def resolved(self) -> FleetEndpoints:

        router = self.router_url or os.environ.get("SPO_ROUTER_URL") or None
        engines = self.engine_urls or [u for u in os.environ.get("SPO_ENGINE_URLS", "").replace(",", " ").split() if u]
        tp = self.engine_tp_size
        if tp is None and os.environ.get("ENGINE_TP"):
            try:
                tp = int(os.environ["ENGINE_TP"])
            except ValueError:
                raise ConfigError(f"ENGINE_TP={os.environ['ENGINE_TP']!r} is not an integer") from None
        return FleetEndpoints(router_url=router, engine_urls=engines, engine_tp_size=tp)


class RolloutConfig(StrictModel):
    """Asynchronous rollout: sampling, flow control, staleness, retries, weight sync."""

    samples_per_prompt: int = Field(8, gt=0, description="n completions per prompt (one group)")
    temperature_range: tuple[float, float] = Field((0.1, 0.8), description="T ~ U(lo, hi) per request (paper)")
    top_p: float = Field(0.95, gt=0, le=1)
    top_k: int = Field(-1, description="-1 = off")
    max_new_tokens: int = Field(512, gt=0)
    max_inflight_requests: int = Field(8, gt=0, description="concurrent /generate requests")
    buffer_groups: int = Field(64, gt=0, description="bounded buffer of finished groups; full = backpressure")
    max_staleness: int = Field(4, ge=0, description="policy versions a trajectory may lag behind")
    stale_policy: Literal["drop", "tag"] = Field("drop", description="drop stale groups, or keep them (tagged)")
    request_timeout_s: float = Field(300.0, gt=0)
    wait_timeout_s: float = Field(1800.0, gt=0, description="the trainer stops with an error when an online batch "
                                  "does not arrive within this (dead engines, sandbox or rewards), never hangs")
    engine_wait_s: float = Field(600.0, gt=0, description="the trainer stops with a one-line error when no rollout "
                                 "engine has answered (a generated token, or a health check before the first push) "
                                 "this long after it started: a fleet that is down is not waited on for ever")
    max_retries: int = Field(5, ge=0, description="retries of one request on engine errors, then it fails")
    retry_backoff_s: float = Field(0.5, gt=0, description="first backoff; doubles per retry up to the max")
    retry_backoff_max_s: float = Field(10.0, gt=0)
    endpoint_max_failures: int = Field(3, gt=0, description="consecutive errors before an endpoint cools down")
    endpoint_cooldown_s: float = Field(5.0, gt=0, description="first cooldown; doubles while it keeps failing")
    seed: int = 0
    weight_sync: Literal["broadcast", "disk"] = "broadcast"
    weight_bucket_mb: float = Field(512.0, gt=0)
    weight_sync_dir: str | None = Field(None, description="shared directory for weight_sync=disk")
    weight_sync_backend: Literal["gloo", "nccl"] = "gloo"
    weight_sync_attempts: int = Field(3, gt=0, description="times a push that reached no engine is sent "
                                      "before the run stops (a push some engines took is not repeated: the "
                                      "others catch up at the next push)")
    weight_sync_pause: Literal[SYNC_PAUSE_MODES] = Field(
        "retract", description="how a weight push pauses the engines: retract (requests in flight resume under "
        "the new weights; their samples then span two versions) or abort (they end and are sent again)")
    mixed_version_policy: Literal["tag", "drop"] = Field(
        "tag", description="a sample whose tokens span a weight update: keep it (policy_version = its oldest "
        "token's version, counted) or generate it again; multi-turn: per model turn (a conversation's turns may come "
        "from different versions: turn_versions)")
    env: EnvConfig | None = Field(None, description="multi-turn rollouts: the environment each sample's conversation "
                                  "runs and its limits (docs/multi-turn.md); None: one /generate per sample")

    @model_validator(mode="after")
    def _check_rollout(self) -> RolloutConfig:
        lo, hi = self.temperature_range
        if not 0 <= lo <= hi:
            raise ValueError(f"temperature_range must satisfy 0 <= lo <= hi, got {list(self.temperature_range)}")
        if self.top_k != -1 and self.top_k < 1:
            raise ValueError(f"top_k must be -1 (off) or >= 1, got {self.top_k}")
        if self.weight_sync == "disk" and not self.weight_sync_dir:
            raise ValueError("weight_sync=disk needs weight_sync_dir")
        return self
