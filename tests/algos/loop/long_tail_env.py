"""A scripted environment with a long tail of slow episodes, for the asynchronous-training tests.

Every ``slow_every``-th problem (by seed) takes ``slow_turns`` turns and sleeps ``delay_s`` per
step; the others end after one turn. The reward (last turn only) is the parity of the reply's length, so a group
of a few samples usually has differing rewards (something to learn from). Registered as
``test/LongTail-v0`` when imported (``env.id=long_tail_env:test/LongTail-v0`` with this folder
on ``sys.path``)."""

from __future__ import annotations

import string
import time
from typing import Any

import gymnasium


class LongTailEnv(gymnasium.Env):  # type: ignore[type-arg]
    def __init__(self, slow_every: int = 3, slow_turns: int = 4, delay_s: float = 0.0) -> None:
        self.observation_space = gymnasium.spaces.Text(4000, charset=string.printable)
        self.action_space = gymnasium.spaces.Text(4000, charset=string.printable)
        self.slow_every, self.slow_turns, self.delay_s = slow_every, slow_turns, delay_s
        self.turns, self.t = 1, 0

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[str, dict[str, Any]]:
        super().reset(seed=seed)
        slow = seed is not None and seed % self.slow_every == 0
        self.turns, self.t = (self.slow_turns if slow else 1), 0
        return "Reply with a few words.", {"task": {"turns": self.turns}}

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        self.t += 1
        if self.turns > 1 and self.delay_s:
            time.sleep(self.delay_s)
        done = self.t >= self.turns
        return "Go on.", float(len(action) % 2) if done else 0.0, done, False, {}


if "test/LongTail-v0" not in gymnasium.registry:
    gymnasium.register("test/LongTail-v0", entry_point=LongTailEnv)
