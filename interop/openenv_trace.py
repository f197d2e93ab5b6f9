"""A veriloop episode as an OpenEnv ``TrainingTrace`` (``pip install 'veriloop[openenv]'``, 0.10).

OpenEnv 0.10's token-faithful training record (``openenv.core.harness.TrainingTrace``) holds one
``TrainingTurn`` per engine call: the prompt's token ids, the sampled ids, their log-probs, and a
loss mask over prompt plus completion (0 on the prompt). A :class:`~veriloop.agents.trajectory.Trajectory`
keeps exactly those numbers, so turn ``k`` of an episode becomes::

    prompt_token_ids     = the tokens of turn k's context before its sample (template, task,
                           earlier samples, the environment's replies): what the policy was fed
    completion_token_ids = token_ids[start:end]                (what it sampled)
    per_token_logps      = logprobs[start:end]                 (the sampler's log-probs)
    loss_mask            = [0] * len(prompt) + loss_mask[start:end]

Where an episode was split into several samples (a chat template that rewrites history, or a
compaction: see docs/multi-turn.md) the prompt is the context of the turn's own sample. The
turn's reward, verdict and flags go to ``metadata`` (OpenEnv takes task rewards from its own
``verify()``, not from the trace); the action text to ``response``.
"""

from __future__ import annotations

from typing import Any

from veriloop.agents.trajectory import Trajectory
from veriloop.interop._extras import require


def to_training_trace(trajectory: Trajectory) -> Any:
    """One ``TrainingTurn`` per turn of ``trajectory`` (see the module docstring); node ids
    ``"turn-<k>"``. OpenEnv validates every turn (ids non-negative, log-probs finite and <= 0,
    no trainable prompt token) and raises ``ValueError`` on a malformed one."""
    harness = require("openenv.core.harness", "openenv", "exporting episodes as OpenEnv TrainingTraces")
    turns = []
    for turn in trajectory.turns:
        first = trajectory.sample_start(turn.start)
        prompt = trajectory.token_ids[first : turn.start]
        turns.append(
            harness.TrainingTurn(
                node_id=f"turn-{turn.index}",
                prompt_token_ids=[int(t) for t in prompt],
                completion_token_ids=[int(t) for t in trajectory.token_ids[turn.start : turn.end]],
                per_token_logps=[float(x) for x in trajectory.logprobs[turn.start : turn.end]],
                loss_mask=[0] * len(prompt) + [int(m) for m in trajectory.loss_mask[turn.start : turn.end]],
                response={"text": turn.text},
                metadata={
                    "turn": turn.index,
                    "reward": float(turn.reward),
                    "verdict": turn.verdict.to_dict() if turn.verdict is not None else None,
                    "terminated": turn.terminated,
                    "truncated": turn.truncated,
                    "hit_token_limit": turn.hit_token_limit,
                    "env_id": trajectory.env_id,
                    "seed": trajectory.seed,
                },
            )
        )
    return harness.TrainingTrace(turns=turns)
