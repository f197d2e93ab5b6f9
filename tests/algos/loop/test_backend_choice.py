"""Which engine samples: ``rollout.backend: auto`` and ``eval.backend``.

``auto`` picks vLLM only where it is importable and the policy is a text model in a folder; the
trainer builds the chosen engine once, pushes the SFT warm-up's weights into it, evaluates with it
(``eval.backend: rollout``) or with the HF engine (``eval.backend: hf``), and closes it at the end.
A recording stand-in for the live engine (the HF backend plus sync/close counters) shows each step.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

import veriloop.algos.eval.in_training as in_training
import veriloop.algos.loop.train as T
from veriloop.agents.backends import resolve_backend
from veriloop.agents.backends.hf import HFBackend
from veriloop.configs.loader import load_config
from veriloop.configs.schema import ConfigError

TINY = ["policy.model=tiny", "rollout.prompts_per_step=2", "rollout.group_size=2", "rollout.max_new_tokens=8",
        "rollout.max_context=512", "train.steps=2", "train.micro_batch_size=2", "eval.num_problems=1",
        "eval.n_samples=1", "eval.k_list=[1]", "eval.greedy=false", "eval.every=1", "eval.before_sft=true",
        "run.tensorboard=false", "sft.steps=1", "sft.examples=2", "algo.preset=grpo"]  # fmt: skip


def _folder_policy(tmp_path: Path, vision: bool = False) -> Any:
    (tmp_path / "config.json").write_text("{}")
    return SimpleNamespace(name=str(tmp_path), meta={}, is_vision=vision)


def test_auto_picks_vllm_only_when_installed_and_loadable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    text = _folder_policy(tmp_path)
    for name in ("hf", "vllm", "vllm_server"):
        assert resolve_backend(name, text) == name  # an explicit choice is kept
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "vllm" else real(n, *a))
    assert resolve_backend("auto", text) == "hf"  # no vLLM here
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: object() if n == "vllm" else real(n, *a))
    assert resolve_backend("auto", text) == "vllm"
    assert resolve_backend("auto", _folder_policy(tmp_path, vision=True)) == "hf"  # vLLM serves text only
    assert resolve_backend("auto", SimpleNamespace(name="tiny-llama", meta={}, is_vision=False)) == "hf"


def test_backend_settings_are_checked() -> None:
    assert load_config(None, []).rollout.backend == "auto" and load_config(None, []).eval.backend == "rollout"
    with pytest.raises(ConfigError, match="eval.backend"):
        load_config(None, ["eval.backend=vllm"])


class Recording(HFBackend):
    """The HF engine posing as a live one: counts syncs, closes and generate calls by phase."""

    def __init__(self, policy: Any) -> None:
        super().__init__(policy)
        self.syncs, self.closed, self.calls = 0, 0, 0

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        return super().generate(*args, **kwargs)

    def sync(self) -> None:
        self.syncs += 1

    def close(self) -> None:
        self.closed += 1


@pytest.mark.parametrize("eval_backend", ["rollout", "hf"])
def test_the_live_engine_gets_the_warmup_and_does_the_evaluations(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, eval_backend: str
) -> None:
    torch.set_num_threads(1)
    made: list[Recording] = []
    evals: list[Any] = []
    monkeypatch.setattr(
        T, "_rollout_backend", lambda cfg, policy, dist: made.append(Recording(policy)) or made[-1]
    )
    inner = in_training.evaluate_step
    monkeypatch.setattr(
        in_training, "evaluate_step", lambda *a, **k: evals.append(k.get("backend")) or inner(*a, **k)
    )
    cfg = load_config(
        "quickstart",  # the sync probe's own generate calls are counted in test_sync_probe.py
        [
            *TINY,
            f"eval.backend={eval_backend}",
            f"run.out_dir={tmp_path}",
            "run.name=b",
            "train.sync_probe=false",
        ],
    )
    run = T.train(cfg, quiet=True)
    (engine,) = made
    # pushed once after the SFT warm-up and once after each of the 2 updates; closed at the end
    assert engine.syncs == 3 and engine.closed == 1
    # base model, start (after SFT), step 1, step 2
    assert len(evals) == 4
    assert all(b is engine for b in evals) if eval_backend == "rollout" else all(b is None for b in evals)
    # one generate call per single-turn rollout step, plus one per evaluation when it evaluates
    assert engine.calls == 2 + (4 if eval_backend == "rollout" else 0)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert any("eval/id/avg@n" in r for r in rows) and rows[-1]["step"] == 2
