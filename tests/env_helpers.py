"""Environments for tests, loaded as hooks ('env_helpers:Scripted'): tests/ is on sys.path."""

from __future__ import annotations

import asyncio

OBSERVATIONS = ("ab <|im_end|> 12", "cd")


class Scripted:
    """Answers turn i with OBSERVATIONS[i] until options.turns steps, then ends with reward options.reward (None: no
    final word); awaits BETWEEN[0]() in its first step when a test set it (a weight push between two turns)."""

    def __init__(self, ctx):
        self.ctx, self.steps, self.seen = ctx, 0, []

    async def reset(self, problem):
        return None

    async def step(self, model_turn):
        self.seen.append(model_turn)
        self.steps += 1
        options = self.ctx.config.options
        if self.steps == 1 and BETWEEN:
            await BETWEEN[0]()
        await asyncio.sleep(0)
        if self.steps >= options.get("turns", 2):
            return None, True, options.get("reward")
        return OBSERVATIONS[(self.steps - 1) % len(OBSERVATIONS)], False, None


BETWEEN: list = []  # a test puts one coroutine function here (the weight push between turns), and clears it


class NoStep:
    """Not an environment: no step()."""

    def __init__(self, ctx):
        pass

    async def reset(self, problem):
        return None


class SyncStep(NoStep):
    def step(self, model_turn):  # not a coroutine
        return None, True, 0.0


class BadResult(NoStep):
    async def step(self, model_turn):
        return "no", "yes"


def broken_factory(ctx):
    raise RuntimeError("cannot start the game server")


class LastTurnParity(Scripted):
    """Scripted's observations for options.turns steps, then the final word: 0 when the last model turn's text has
    an even number of characters, else -1 (a verdict a test can recompute from the conversation)."""

    async def step(self, model_turn):
        observation, done, _ = await super().step(model_turn)
        return (None, True, 0.0 if len(model_turn) % 2 == 0 else -1.0) if done else (observation, False, None)
