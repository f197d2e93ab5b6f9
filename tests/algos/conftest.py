"""Fixtures for the algorithm tests: hand-made trajectories and a tiny seeded Llama.

The project runs pytest with ``--import-mode=importlib``, so helpers are shared as fixtures."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import pytest
import torch

from veriloop.agents.trajectory import Trajectory, TurnRecord


def _make_traj(
    turns: Sequence[tuple[Sequence[int], Sequence[int], float]],
    *,
    group_id: int = 0,
    prompt: Sequence[int] = (1, 2, 3),
    error: str | None = None,
    hit_limit: Sequence[bool] = (),
    kinds: Sequence[str] = (),
) -> Trajectory:
    """A trajectory from (sampled tokens, environment tokens, reward) per turn.

    Sampled tokens get loss_mask 1 and log-prob -1.0 (replace with real ones if needed); the prompt
    has turn index -1; ``error`` sets the last turn's verdict error; ``kinds`` sets
    ``info["action_kind"]`` per turn.
    """
    ids, mask, lps, tix = list(prompt), [0] * len(prompt), [0.0] * len(prompt), [-1] * len(prompt)
    records = []
    for k, (sampled, env, reward) in enumerate(turns):
        start = len(ids)
        ids += list(sampled)
        mask += [1] * len(sampled)
        lps += [-1.0] * len(sampled)
        tix += [k] * len(sampled)
        end = len(ids)
        ids += list(env)
        mask += [0] * len(env)
        lps += [0.0] * len(env)
        tix += [k] * len(env)
        verdict = {"correct": reward > 0, "error": error if k == len(turns) - 1 else None}
        info = {"action_kind": kinds[k]} if kinds else {}
        hit = bool(hit_limit[k]) if hit_limit else False
        records.append(TurnRecord(k, start, end, "", float(reward), verdict, info, hit_token_limit=hit))
    return Trajectory("test-v0", {}, 0, group_id, ids, mask, lps, tix, tuple(records), True, False)


def _with_logprobs(traj: Trajectory, logprobs: torch.Tensor) -> Trajectory:
    """Copy of ``traj`` whose sampled tokens carry ``logprobs`` ([T] tensor) as sampling log-probs."""
    lp = [float(x) if m else 0.0 for x, m in zip(logprobs.tolist(), traj.loss_mask)]
    return replace(traj, logprobs=lp)


@pytest.fixture
def make_traj():
    """``make_traj(turns, *, group_id, prompt, error, hit_limit, kinds) -> Trajectory``."""
    return _make_traj


@pytest.fixture
def with_logprobs():
    """``with_logprobs(traj, logprobs [T]) -> Trajectory`` with those sampling log-probs."""
    return _with_logprobs


@pytest.fixture
def tiny_llama():
    """A seeded 2-layer Llama with a 64-token vocabulary (fresh per test)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64
    )
    return LlamaForCausalLM(cfg).eval()
