"""What an environment is, how one is found (a built-in name or a dotted-path hook) and checked, and the bounds every
observation text goes through.

    factory = environment_factory(cfg.name)              # ConfigError naming rollout.env.name if it cannot load
    env = make_environment(factory, EnvContext(cfg, sandbox=pool, reward=reward))
    first = await env.reset(problem)                     # observation text before the first model turn, or None
    observation, done, reward = step_result(await env.step(model_turn_text), cfg.name)

An environment is one object per conversation with two coroutine methods: ``reset(problem) -> str | None`` and
``step(model_turn_text) -> (observation: str | None, done: bool, reward: float | None)``. ``reward`` is the episode's
reward if it ended after this turn (None: not known yet; if the conversation ends there anyway, the task's reward
scores the model's turns). The rollout manager (rollout/manager.py) ends a conversation when ``done``, when the
observation is None, or at the config's limits (max_turns, max_total_tokens).
"""

from __future__ import annotations

import inspect
import math
import unicodedata
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol

from megatron_spo.config import ConfigError
from megatron_spo.environments.config import BUILT_IN, EnvConfig
from megatron_spo.hooks import load_hook

FIELD = "rollout.env.name"
KEPT_CONTROLS = "\n\t"  # the only control characters an observation keeps as they are


class Environment(Protocol):
    async def reset(self, problem: Any) -> str | None: ...

    async def step(self, model_turn: str) -> tuple[str | None, bool, float | None]: ...


@dataclass(frozen=True)
class EnvContext:
    """What an environment is built with: its config, the sandbox pool (None when the run has none) and the task's
    reward (``await reward(problem, text) -> float``; None outside a rollout)."""

    config: EnvConfig
    sandbox: Any = None
    reward: Callable[[Any, str], Awaitable[float]] | None = None


class EnvError(RuntimeError):
    """An environment broke its contract (a bad step result): one line naming it."""


def environment_factory(name: str, field: str = FIELD) -> Callable[[EnvContext], Environment]:
    """The class (or factory) a built-in name or a hook 'package.module:name' names; one-line ConfigError naming
    ``field`` when it cannot be imported, is not callable, or is a class without coroutine reset and step."""
    factory = load_hook(BUILT_IN.get(name, name), field=field)
    if isinstance(factory, type):
        _check_methods(factory, name, field)
    return factory


def make_environment(factory: Callable[[EnvContext], Environment], ctx: EnvContext, field: str = FIELD) -> Environment:
    """One conversation's environment, checked: ConfigError naming ``field`` when the factory fails or makes an
    object without coroutine reset and step."""
    try:
        env = factory(ctx)
    except ConfigError:
        raise
    except Exception as err:
        raise ConfigError(f"{field}: '{ctx.config.name}' failed to build ({type(err).__name__}: {err})") from None
    _check_methods(env, ctx.config.name, field)
    return env


def needs_sandbox(cfg: EnvConfig | None) -> bool:
    """Whether the environment runs programs (its class says ``needs_sandbox = True``)."""
    return cfg is not None and bool(getattr(environment_factory(cfg.name), "needs_sandbox", False))


def _check_methods(obj: Any, name: str, field: str) -> None:
    for method in ("reset", "step"):
        if not inspect.iscoroutinefunction(getattr(obj, method, None)):
            raise ConfigError(f"{field}: '{name}' has no coroutine method {method}() (an environment has "
                              "`async def reset(self, problem)` and `async def step(self, model_turn)`)")


def step_result(value: Any, name: str) -> tuple[str | None, bool, float | None]:
    """(observation, done, reward) of a step, or EnvError in one line naming the environment."""
    expected = "(observation: str | None, done: bool, reward: float | None)"
    if not isinstance(value, (tuple, list)) or len(value) != 3:
        raise EnvError(f"environment '{name}': step returned {_show(value)}, expected {expected}")
    observation, done, reward = value
    if observation is not None and not isinstance(observation, str):
        raise EnvError(f"environment '{name}': step's observation is {type(observation).__name__}, "
                                f"expected {expected}")
    if not isinstance(done, bool):
        raise EnvError(f"environment '{name}': step's done is {_show(done)}, expected {expected}")
    if reward is not None and (isinstance(reward, bool) or not isinstance(reward, (int, float))
                               or not math.isfinite(reward)):
        raise EnvError(f"environment '{name}': step's reward is {_show(reward)}, expected a finite number "
                                "or None")
    return observation, done, None if reward is None else float(reward)


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _escape(ch: str) -> str:
    if ch in KEPT_CONTROLS or unicodedata.category(ch)[0] != "C":
        return ch
    code = ord(ch)
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}"


def escape_text(text: str) -> str:
    """Control, format, surrogate, private and unassigned characters (all but newline and tab) as \\xNN / \\uNNNN /
    \\UNNNNNNNN escapes: terminal escape sequences, NULs and bidi controls in a program's output reach the model as
    visible text."""
    return "".join(map(_escape, text))


def bounded(text: str, limit: int) -> str:
    """``text`` escaped (escape_text) and cut to at most ``limit`` characters, a cut marked '... [N more characters]'
    (N: characters of ``text`` not shown). Reads at most limit + 1 characters of it."""
    out, used = [], 0
    for i, ch in enumerate(text):
        piece = _escape(ch)
        if used + len(piece) > limit:
            return "".join(out) + f"... [{len(text) - i} more characters]"
        out.append(piece)
        used += len(piece)
    return "".join(out)
