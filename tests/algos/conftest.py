"""Fixtures for the algorithm tests: hand-made trajectories and a tiny seeded Llama.

The project runs pytest with ``--import-mode=importlib``, so helpers are shared as fixtures."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import pytest
import torch

from veriloop.agents.trajectory import Trajectory, TurnRecord
from veriloop.envs.base import LearnerSignal
from veriloop.envs.verifiers import Verdict


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
    has turn index -1; ``error`` sets the last turn's verdict error; ``kinds`` sets each turn's
    ``signal.action_kind`` as an S2R env reports it (``"invalid"`` becomes the kind expected then:
    a verify right after a solve, else a solve).
    """
    ids, mask, lps, tix = list(prompt), [0] * len(prompt), [0.0] * len(prompt), [-1] * len(prompt)
    records = []
    awaiting_verify = False
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
        verdict = Verdict(correct=reward > 0, error=error if k == len(turns) - 1 else None)  # type: ignore[arg-type]
        kind = None
        if kinds:
            kind = kinds[k] if kinds[k] != "invalid" else ("verify" if awaiting_verify else "solve")
            awaiting_verify = kind == "solve" if kinds[k] != "invalid" else awaiting_verify
        signal = LearnerSignal(action_kind=kind, solved=reward > 0, imitate=reward > 0)
        hit = bool(hit_limit[k]) if hit_limit else False
        records.append(
            TurnRecord(k, start, end, "", float(reward), verdict, {}, hit_token_limit=hit, signal=signal)
        )
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
