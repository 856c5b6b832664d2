"""The multi-turn environment's config (rollout.env): which environment each conversation runs, and its limits."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from megatron_spo.config import StrictModel
from megatron_spo.hooks import is_hook

# THE built-in environments, by name: each a hook path (loaded only when a run uses it)
BUILT_IN = {
    "code_feedback": "megatron_spo.environments.code_feedback:CodeFeedback",
    "calculator": "megatron_spo.environments.calculator:Calculator",
}


class EnvConfig(StrictModel):
    """A conversation per sample: the model's turn, the environment's observation, the model's next turn, ...
    (docs/multi-turn.md). ``rollout.env: code_feedback`` is ``rollout.env: {name: code_feedback}``."""

    name: str = Field(..., description="a built-in environment (code_feedback, calculator) or a hook "
                      "'package.module:name': a class (or factory) called with an EnvContext, one per conversation")
    max_turns: int = Field(4, gt=0, description="model turns per conversation")
    max_total_tokens: int = Field(1024, gt=0, description="tokens per conversation (prompt + every turn, the model's "
                                  "and the environment's); each model turn's max_new_tokens is cut to what is left")
    max_observation_tokens: int = Field(256, gt=0, description="tokens of one observation's text (the turn markers "
                                        "around it aside); a longer one is cut and marked")
    feedback_chars: int = Field(400, gt=0, description="code_feedback: characters of each of a failing test's input, "
                                "expected and actual output (and error output) shown, after escaping")
    final_reward: Literal["hidden", "tests"] = Field(
        "hidden", description="code_feedback: the episode's reward from the problem's hidden tests (the public ones "
        "when it has none), or from the public tests the feedback shows")
    options: dict[str, Any] = Field(default_factory=dict, description="free settings for a hook environment "
                                    "(EnvContext.config.options)")

    @model_validator(mode="before")
    @classmethod
    def _name_shortcut(cls, data: Any) -> Any:
        return {"name": data} if isinstance(data, str) else data

    @field_validator("name")
    @classmethod
    def _known(cls, name: str) -> str:
        if name not in BUILT_IN and not is_hook(name):
            raise ValueError(f"unknown environment '{name}' (built in: {', '.join(BUILT_IN)}; or a hook "
                             "'package.module:name')")
        return name
