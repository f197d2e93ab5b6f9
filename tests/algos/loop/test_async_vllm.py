"""Asynchronous training through the in-process vLLM engine (``make test-vllm``; skipped where
vLLM is not installed unless ``VERILOOP_REQUIRE_VLLM=1``): the quickstart's model and task with
``train.max_staleness=1``, the worker sampling with vLLM while the trainer updates, the weights
pushed (and the prefix cache reset) between two turns."""

from __future__ import annotations

import importlib.util
import json
import os
import time
from pathlib import Path

import pytest

from veriloop.cli.serve import running_server

requires_vllm = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None and os.environ.get("VERILOOP_REQUIRE_VLLM") != "1",
    reason="needs vLLM: `make setup-vllm`, then `make test-vllm`",
)

SHORT = ["policy.precision=fp32", "rollout.prompts_per_step=2", "rollout.group_size=2", "rollout.max_new_tokens=16", "train.steps=3",
         "train.micro_batch_size=4", "sft.steps=0", "eval.num_problems=2", "eval.n_samples=1", "eval.k_list=[1]",
         "eval.every=0", "eval.at_start=false", "run.checkpoint_every=0", "rollout.backend=vllm",
         "train.max_staleness=1", "algo.rollout_is=truncate"]  # fmt: skip


@requires_vllm
def test_quickstart_trains_asynchronously_with_vllm(tmp_path: Path) -> None:
    from veriloop.algos.loop.async_loop import read_ledger
    from veriloop.algos.loop.train import train
    from veriloop.configs.loader import load_config

    run = train(load_config("quickstart", [*SHORT, f"run.out_dir={tmp_path}", "run.name=a"]), quiet=True)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "async/staleness_max" in r]
    assert [r["step"] for r in steps] == [1, 2, 3]
    assert all(r["async/staleness_max"] <= 1 and r["updates"] >= 1 for r in steps)
    assert steps[-1]["async/version"] == 3.0
    # pi_prox recomputed by the trainer, mu recorded by vLLM: the decoupled ratio's IS weights are logged
    assert all(r["mismatch/tokens"] > 0 for r in steps)
    trained = [r["seed"] for r in read_ledger(run) if r["event"] == "trained"]
    assert len(trained) == len(set(trained)) == 3 * 2
    assert (run / "final").is_dir()


def _check_run(run: Path) -> None:
    from veriloop.algos.loop.async_loop import read_ledger

    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "async/staleness_max" in r]
    assert [r["step"] for r in steps] == [1, 2, 3]
    assert all(
        r["async/staleness_max"] <= 1 and r["updates"] >= 1 and r["mismatch/tokens"] > 0 for r in steps
    )
    trained = [r["seed"] for r in read_ledger(run) if r["event"] == "trained"]
    assert len(trained) == len(set(trained)) == 3 * 2


@requires_vllm
def test_quickstart_trains_asynchronously_against_a_vllm_server(tmp_path: Path) -> None:
    """One ``veriloop serve-vllm`` process beside the trainer: the worker sends each turn over HTTP;
    between two turns the trainer pushes its (LoRA merged) weights to the server and resumes it."""
    from veriloop.algos.loop.train import train
    from veriloop.configs.loader import load_config

    with running_server(log=tmp_path / "server.log") as server:
        url = server.url
        over = [
            *SHORT[:-3],
            "rollout.backend=vllm_server",
            f"rollout.server.urls=[{url}]",
            "rollout.server.lora_sync=merge",
            "train.max_staleness=1",
            "algo.rollout_is=truncate",
        ]
        run = train(load_config("quickstart", [*over, f"run.out_dir={tmp_path}", "run.name=s"]), quiet=True)
    _check_run(run)


def _spy_adapters(monkeypatch: pytest.MonkeyPatch) -> tuple[dict[object, set[str]], list[bool], list[int]]:
    """Record every request's adapter name per episode, whether an older version was used while a
    newer one existed, and every pause of the worker."""
    import veriloop.algos.loop.async_worker as W

    named: dict[object, set[str]] = {}
    older: list[bool] = []
    pauses: list[int] = []
    play = W.GenerationWorker._play

    wait_batch = W.GenerationWorker.wait_batch
    taken: list[int] = []  # the steps whose batch the trainer took

    def spy(self: W.GenerationWorker, eps: list[object], version: int) -> None:
        names = self.weights.names  # type: ignore[union-attr]
        if not any(older) and any(ep.turns for ep in eps):  # type: ignore[attr-defined]
            _await_newer(self, names, version, taken)
        older.append(version < max(names))
        for ep in eps:
            named.setdefault(ep.key, set()).add(names[version])  # type: ignore[attr-defined]
        play(self, eps, version)  # type: ignore[arg-type]

    def took(self: W.GenerationWorker, step: int) -> tuple[list[object], float]:
        out = wait_batch(self, step)
        taken.append(step)
        return out

    monkeypatch.setattr(W.GenerationWorker, "_play", spy)
    monkeypatch.setattr(W.GenerationWorker, "wait_batch", took)
    monkeypatch.setattr(W.GenerationWorker, "pause", lambda self: pauses.append(1))
    return named, older, pauses


def _await_newer(
    worker: object, names: dict[int, str], version: int, taken: list[int], timeout_s: float = 120.0
) -> None:
    """Hold a later turn until the trainer serves a newer adapter, when the trainer is already
    updating on its batch (it needs nothing from this turn): otherwise whether any turn overlaps an
    update is left to timing, and then a fast machine may never overlap one."""
    cond = worker.cond  # type: ignore[attr-defined]
    with cond:
        if not taken or taken[-1] != worker.sched.version:  # type: ignore[attr-defined]
            return  # the trainer waits for groups: holding this turn could only stall the run
        t0 = time.monotonic()
        while max(names) <= version and time.monotonic() - t0 < timeout_s:
            cond.wait(0.2)


#: K = 1 with multi-turn episodes (up to 3 attempts at a level-1 problem), LoRA served as adapters.
ADAPTERS = [*SHORT[:-3], "rollout.max_turns=3", "env.kwargs={level: 1, max_attempts: 3}", "train.max_staleness=1",
            "algo.rollout_is=truncate"]  # fmt: skip


def _check_versions(named: dict[object, set[str]], older: list[bool], pauses: list[int]) -> None:
    assert named and all(len(v) == 1 for v in named.values()), "an episode mixed adapter versions"
    assert any(older), "no request used an older adapter: the test did not exercise version keeping"
    assert not pauses  # adapters: nothing waits for a sync


@requires_vllm
def test_lora_adapters_on_a_server_keep_each_episodes_version(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """LoRA served as adapters (``--lora-rank 16 -- --max-loras 3``): every request names its
    episode's adapter version, an older one while a newer exists, and no episode mixes versions."""
    from veriloop.algos.loop.train import train
    from veriloop.configs.loader import load_config

    named, older, pauses = _spy_adapters(monkeypatch)
    with running_server("--lora-rank", "16", "--", "--max-loras", "3", log=tmp_path / "server.log") as server:
        url = server.url
        over = [
            *ADAPTERS,
            "rollout.backend=vllm_server",
            f"rollout.server.urls=[{url}]",
            "rollout.server.lora_sync=adapter",
        ]
        run = train(load_config("quickstart", [*over, f"run.out_dir={tmp_path}", "run.name=l"]), quiet=True)
    _check_run(run)
    _check_versions(named, older, pauses)


@requires_vllm
def test_lora_adapters_in_process_keep_each_episodes_version(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The in-process engine with ``lora_sync: adapter`` and ``max_loras: 3``: the same guarantees.
    (With ``train.sync_probe`` on, the in-process engine pauses the worker while the probe samples,
    as it serves one caller at a time; the probe is off here so that nothing waits for a sync.)"""
    from veriloop.algos.loop.train import train
    from veriloop.configs.loader import load_config

    named, older, pauses = _spy_adapters(monkeypatch)
    over = [
        *ADAPTERS,
        "rollout.backend=vllm",
        "rollout.vllm_kwargs={lora_sync: adapter, max_loras: 3}",
        "train.sync_probe=false",
    ]
    run = train(load_config("quickstart", [*over, f"run.out_dir={tmp_path}", "run.name=i"]), quiet=True)
    _check_run(run)
    _check_versions(named, older, pauses)
