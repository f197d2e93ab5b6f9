"""Asynchronous training on the tiny model: the invariants of ``train.max_staleness``.

A scripted environment with a long tail of slow episodes (``long_tail_env``: every third problem
takes four turns and sleeps at each) runs through the real loop with the HF engine's generation
worker. Checked: K = 0 is the synchronous loop bit for bit; no trained group is more than K
steps stale; every admitted problem is trained exactly once or recorded dropped with a reason;
LoRA episodes never mix adapter versions; the KV cache never serves an older version's entry;
``kill -9`` with work in flight, then ``--resume``, loses no problem and trains none twice."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

HERE = Path(__file__).parent
ENV = "env.id=long_tail_env:test/LongTail-v0"
BASE = ["policy.model=tiny", "run.algo_preset=grpo", "rollout.prompts_per_step=2", "rollout.group_size=2",
        "rollout.max_new_tokens=6", "rollout.max_context=256", "rollout.max_turns=4", "train.micro_batch_size=2",
        "train.lr=1e-2", "eval.every=0", "eval.num_problems=1", "eval.n_samples=1", "eval.k_list=[1]",
        "eval.greedy=false", "eval.seed_offset=100000", "run.tensorboard=false", "run.checkpoint_every=0"]  # fmt: skip
ASYNC = ["algo.rollout_is=truncate"]
TIMING = ("time", "time/", "throughput/", "async/")


@pytest.fixture(autouse=True)
def _env_module(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(HERE))


def _cfg(tmp: Path, name: str, *extra: str) -> Any:
    from veriloop.configs.loader import load_config

    return load_config(None, [*BASE, ENV, *extra, f"run.out_dir={tmp}", f"run.name={name}"])


def _rows(run: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _ledger(run: Path) -> list[dict[str, Any]]:
    from veriloop.algos.loop.async_loop import read_ledger

    return read_ledger(run)


def _check_accounting(run: Path, k: int, first_seed: int, cursor: int) -> None:
    """Every problem taken from the cursor is trained once or dropped once, never both; none stale > K."""
    rows = _ledger(run)
    trained = [r["seed"] for r in rows if r["event"] == "trained"]
    dropped = [r["seed"] for r in rows if r["event"] == "dropped"]
    assert len(trained) == len(set(trained)), "a problem was trained twice"
    assert not set(trained) & set(dropped)
    assert sorted(trained + dropped) == list(range(first_seed, cursor)), "a problem was lost"
    assert all(r["reason"] for r in rows if r["event"] == "dropped")
    assert all(r["version"] - r["v_start"] <= k for r in rows if r["event"] == "trained")


def test_k0_is_the_synchronous_loop_bit_for_bit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """train.max_staleness=0 runs the synchronous loop itself: the same metrics and weights as a
    config without the field, and the asynchronous loop is never entered."""
    import veriloop.algos.loop.async_loop as A
    from veriloop.algos.loop.train import train

    monkeypatch.setattr(A, "AsyncSource", lambda run: pytest.fail("K = 0 must not start the async source"))
    a = train(_cfg(tmp_path, "a", "train.steps=2"), quiet=True)
    b = train(_cfg(tmp_path, "b", "train.steps=2", "train.max_staleness=0"), quiet=True)
    strip = [{k: v for k, v in r.items() if not k.startswith(TIMING)} for r in _rows(a)]
    assert strip == [{k: v for k, v in r.items() if not k.startswith(TIMING)} for r in _rows(b)]
    wa, wb = (
        torch.load(r / "final" / "model.pt", weights_only=True)
        if (r / "final" / "model.pt").is_file()
        else None
        for r in (a, b)
    )
    if wa is None:  # the final folder's format: compare every file byte for byte
        files = sorted(p.relative_to(a / "final") for p in (a / "final").rglob("*") if p.is_file())
        assert files and all(
            (a / "final" / f).read_bytes() == (b / "final" / f).read_bytes()
            for f in files
            if f.suffix != ".md"
        )
    else:
        assert all(torch.equal(wa[n], wb[n]) for n in wa)


@pytest.mark.parametrize("k", [1, 2])
def test_no_trained_group_is_staler_than_k(tmp_path: Path, k: int) -> None:
    """The long tail (four-turn episodes that sleep) through the real loop: staleness <= K at every
    step, and some group did live through a weight update (the test exercises the bound)."""
    from veriloop.algos.loop.train import train

    cfg = _cfg(
        tmp_path,
        f"k{k}",
        "policy.lora=false",
        "train.steps=5",
        f"train.max_staleness={k}",
        *ASYNC,
        "env.kwargs={slow_every: 3, slow_turns: 4, delay_s: 0.3}",
    )
    run = train(cfg, quiet=True)
    rows = _rows(run)
    assert [r["step"] for r in rows if "async/staleness_max" in r] == [1, 2, 3, 4, 5]
    assert all(r["async/staleness_max"] <= k for r in rows if "async/staleness_max" in r)
    assert all(0.0 <= r["async/trainer_wait_fraction"] <= 1.0 for r in rows if "async/staleness_max" in r)
    assert any(r["async/span_max"] >= 1 for r in rows if "async/span_max" in r)  # partial rollouts happened
    assert all(r["updates"] >= 1 for r in rows if "async/staleness_max" in r)
    ledger = _ledger(run)
    cursor = max(r["seed"] for r in ledger) + 1
    _check_accounting(run, k, cfg.rollout.seed, cursor)
    assert sum(r["event"] == "trained" for r in ledger) == 5 * 2
    assert {r["reason"] for r in ledger if r["event"] == "dropped"} <= {"run_end"}
    if k == 1:  # `veriloop plot` draws the staleness and idle shares
        from veriloop.algos.run.plots import plot_run

        names = {p.name for p in plot_run(run)}
        assert {"staleness.png", "idle.png"} <= names


def test_lora_episodes_keep_their_adapter_version(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """LoRA on the HF engine: every turn of an episode is sampled with the adapter version its group
    started with, even after the trainer moved on; the engine held at most K + 2 versions."""
    import veriloop.algos.loop.async_worker as W
    from veriloop.algos.loop.train import train

    seen: dict[Any, set[int]] = {}
    later: list[bool] = []
    play = W.GenerationWorker._play

    def spy(self: W.GenerationWorker, eps: list[Any], version: int) -> None:
        assert self.weights.loaded == version  # the adapter loaded is the episodes' own
        for ep in eps:
            seen.setdefault(ep.key, set()).add(version)
        later.append(self.sched.version > version)
        play(self, eps, version)

    monkeypatch.setattr(W.GenerationWorker, "_play", spy)
    k = 2
    cfg = _cfg(
        tmp_path,
        "lora",
        "policy.lora=true",
        "train.steps=4",
        f"train.max_staleness={k}",
        *ASYNC,
        "train.lr=5e-2",
        "env.kwargs={slow_every: 2, slow_turns: 4, delay_s: 0.3}",
    )
    run = train(cfg, quiet=True)
    assert seen and all(len(v) == 1 for v in seen.values()), "an episode mixed adapter versions"
    assert any(later), "no episode outlived an update: the test did not exercise version keeping"
    held = [r["async/weight_versions_held"] for r in _rows(run) if "async/weight_versions_held" in r]
    assert max(held) <= k + 2


def test_kv_cache_never_serves_an_older_version(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Full weights on the HF engine: every cached K/V the engine reuses was computed under the
    version it now samples with, and a load releases every older entry."""
    import veriloop.algos.loop.async_worker as W
    from veriloop.agents.backends.hf import HFBackend
    from veriloop.algos.loop.train import train

    current: list[int] = []
    reused: list[tuple[int, int]] = []
    cached = HFBackend._cached_length

    def spy_cached(self: HFBackend, req: Any) -> int:
        n = cached(self, req)
        if n > 0 and isinstance(req.key, tuple):  # the worker's keys (evaluation's are plain ints)
            reused.append((req.key[1], current[-1]))
        return n

    play = W.GenerationWorker._play

    def spy_play(self: W.GenerationWorker, eps: list[Any], version: int) -> None:
        current.append(version)
        slots = self.weights.backend._slots  # type: ignore[union-attr]
        assert all(key[1] == version for key in slots), "a slot of an older version survived a load"
        play(self, eps, version)

    monkeypatch.setattr(HFBackend, "_cached_length", spy_cached)
    monkeypatch.setattr(W.GenerationWorker, "_play", spy_play)
    cfg = _cfg(
        tmp_path,
        "kv",
        "policy.lora=false",
        "train.steps=4",
        "train.max_staleness=2",
        *ASYNC,
        "env.kwargs={slow_every: 2, slow_turns: 4, delay_s: 0.3}",
    )
    train(cfg, quiet=True)
    assert reused, "no K/V was reused at all: the test did not exercise the cache"
    assert all(a == b for a, b in reused)
    assert len(set(current)) > 1  # the engine did load newer versions while episodes ran


def test_dynamic_sampling_drops_with_a_reason(tmp_path: Path) -> None:
    """Dynamic sampling in the async loop: uninformative groups are dropped (recorded, with the
    reason), more are admitted, and each step still trains its groups."""
    from veriloop.algos.loop.train import train

    cfg = _cfg(
        tmp_path,
        "ds",
        "train.steps=3",
        "train.max_staleness=1",
        *ASYNC,
        "algo.dynamic_sampling=true",
        "rollout.group_size=2",
    )
    run = train(cfg, quiet=True)
    ledger = _ledger(run)
    cursor = max(r["seed"] for r in ledger) + 1
    _check_accounting(run, 1, cfg.rollout.seed, cursor)
    reasons = {r["reason"] for r in ledger if r["event"] == "dropped"}
    assert reasons <= {"uninformative", "run_end"}


# ------------------------------------------------------------------------- kill -9, then --resume

RUNNER = (
    "import sys; sys.path.insert(0, sys.argv[1]); from veriloop.configs.loader import load_config; "
    "from veriloop.algos.loop.train import train; train(load_config(None, sys.argv[2:]), resume=True, quiet=True)"
)


def _start(out: Path, steps: int) -> subprocess.Popen[bytes]:
    args = [
        *BASE,
        ENV,
        f"train.steps={steps}",
        "train.max_staleness=2",
        *ASYNC,
        "run.checkpoint_every=2",
        "run.keep_last=5",
        "env.kwargs={slow_every: 3, slow_turns: 4, delay_s: 0.1}",
        f"run.out_dir={out}",
        "run.name=r",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(
        [sys.executable, "-c", RUNNER, str(HERE), *args],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )


def test_kill9_then_resume_loses_nothing_and_trains_nothing_twice(tmp_path: Path) -> None:
    """Killed with groups in flight right after the step-2 checkpoint; the resumed run plays the
    checkpoint's pending problems again (in-flight episodes are redone), continues from its data
    cursor, and in the end every problem taken is trained exactly once or dropped with a reason."""
    proc = _start(tmp_path, 6)
    ckpt = tmp_path / "r" / "checkpoints" / "step-000002"
    end = time.monotonic() + 240
    while not (ckpt / "COMPLETE").is_file():
        assert proc.poll() is None, proc.stderr.read().decode()[-3000:]  # type: ignore[union-attr]
        assert time.monotonic() < end, "the run never reached its step-2 checkpoint"
        time.sleep(0.02)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    saved = json.loads((ckpt / "trainer_state.json").read_text())["state"]
    pending, cursor = saved["history"]["async"]["pending"], saved["next_seed"]
    assert pending, "nothing was in flight at the checkpoint"
    again = _start(tmp_path, 6)
    _, err = again.communicate(timeout=300)
    assert again.returncode == 0, err.decode()[-3000:]
    run = tmp_path / "r"
    ledger = _ledger(run)
    after = [r for r in ledger if r["version"] >= 2]
    taken = sorted(r["seed"] for r in after)
    final_cursor = max(r["seed"] for r in ledger) + 1
    assert taken == sorted(
        pending + list(range(cursor, final_cursor))
    )  # the pending ones, then the cursor on
    _check_accounting(run, 2, 0, final_cursor)
    assert [r["step"] for r in _rows(run)] == [0, 1, 2, 3, 4, 5, 6]  # one row per step, none twice


def _slow_eval_spy(
    monkeypatch: pytest.MonkeyPatch, hold: int, until_step: int
) -> tuple[list[int], list[bool], Any]:
    """Count the trainer's updates; hold the evaluation of version ``hold`` until the trainer has
    made ``until_step`` updates (60 s at most). Returns (updates, whether each hold was released by
    the trainer, the event that releases every hold)."""
    import threading

    import veriloop.algos.eval.in_training as E
    import veriloop.algos.loop.run_steps as R

    updates: list[int] = []
    released: list[bool] = []
    free = threading.Event()
    train_on_batch, evaluate = R.train_on_batch, E.evaluate_step

    def counted(*args: Any, **kwargs: Any) -> Any:
        out = train_on_batch(*args, **kwargs)
        updates.append(1)
        return out

    def slow(cfg: Any, policy: Any, step: int, *args: Any, **kwargs: Any) -> Any:
        if step == hold:
            t0 = time.monotonic()
            while len(updates) < until_step and not free.is_set() and time.monotonic() - t0 < 60:
                time.sleep(0.05)
            released.append(len(updates) >= until_step)
        return evaluate(cfg, policy, step, *args, **kwargs)

    monkeypatch.setattr(R, "train_on_batch", counted)
    monkeypatch.setattr(E, "evaluate_step", slow)
    return updates, released, free


def test_evaluation_runs_beside_generation_and_the_update(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``eval.every`` in the async loop: the evaluation of version 2 is held until the trainer has
    made its 4th update (it would never come if the update waited for the evaluation), the worker
    thread stays alive and unpaused meanwhile, and each evaluation is logged in its own row at the
    step it evaluated, tagged with that version; the last step's in its own row, last."""
    import veriloop.algos.eval.in_training as E
    import veriloop.algos.loop.async_worker as W
    from veriloop.algos.loop.train import train

    workers: list[W.GenerationWorker] = []
    start = W.GenerationWorker.start
    monkeypatch.setattr(W.GenerationWorker, "start", lambda self: workers.append(self) or start(self))
    updates, released, _ = _slow_eval_spy(monkeypatch, hold=2, until_step=4)
    during: list[bool] = []
    slow = E.evaluate_step

    def spy(*args: Any, **kwargs: Any) -> Any:
        if workers:  # the evaluations inside the RL loop (not the one at step 0)
            w = workers[0]
            during.append(w._thread is not None and w._thread.is_alive() and not w._pause)
        return slow(*args, **kwargs)

    monkeypatch.setattr(E, "evaluate_step", spy)
    cfg = _cfg(tmp_path, "ev", "train.steps=4", "train.max_staleness=1", *ASYNC, "eval.every=2")
    run = train(cfg, quiet=True)
    assert released == [True] and len(updates) == 4
    assert during[:1] == [True]
    rows = _rows(run)
    evals = [r for r in rows if "async/eval_version" in r]
    assert [(r["step"], r["async/eval_version"]) for r in evals] == [(2, 2.0), (4, 4.0)]
    assert all("eval/id/avg@n" in r for r in evals)
    steps = [r["step"] for r in rows if "grad_norm" in r]
    assert steps == [1, 2, 3, 4] and [
        r["step"] for r in rows if "grad_norm" in r and "eval/id/avg@n" in r
    ] == [4]
    # step 2's evaluation was logged after step 3's row: the update went on without it
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 2, 4]


def test_an_evaluation_cut_by_a_crash_is_redone_from_its_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The checkpoint at step 2 is written while version 2's evaluation runs; the run then crashes.
    Resumed from that checkpoint, the run evaluates version 2 first: its row is there, once."""
    import veriloop.algos.loop.run_steps as R
    from veriloop.algos.loop.train import train

    _, _, free = _slow_eval_spy(monkeypatch, hold=2, until_step=99)  # held until the crash
    train_on_batch = R.train_on_batch
    calls: list[int] = []

    def crash_at_3(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("killed")
        return train_on_batch(*args, **kwargs)

    monkeypatch.setattr(R, "train_on_batch", crash_at_3)
    over = ["train.steps=4", "train.max_staleness=1", *ASYNC, "eval.every=2", "run.checkpoint_every=2"]
    with pytest.raises(RuntimeError, match="killed"):
        train(_cfg(tmp_path, "cut", *over), quiet=True)
    free.set()  # the crashed run's evaluation thread ends (its result is never logged)
    monkeypatch.undo()
    monkeypatch.syspath_prepend(str(HERE))
    run = train(_cfg(tmp_path, "cut", *over), resume=True, quiet=True)
    evals = [(r["step"], r["async/eval_version"]) for r in _rows(run) if "async/eval_version" in r]
    assert evals == [(2, 2.0), (4, 4.0)]


def test_a_mixture_trains_asynchronously(tmp_path: Path) -> None:
    """env.mixture in the async loop: each group is one environment, drawn from its seed alone; both
    environments train and are logged per environment."""
    from veriloop.algos.loop.mixture import assign_envs
    from veriloop.algos.loop.train import train

    mix = (
        "env.mixture={fast: {id: test/LongTail-v0, kwargs: {slow_every: 1000}, weight: 1}, "
        "slow: {id: test/LongTail-v0, kwargs: {slow_every: 1, slow_turns: 2}, weight: 1}}"
    )
    cfg = _cfg(tmp_path, "mix", mix, "train.steps=3", "train.max_staleness=1", *ASYNC)
    run = train(cfg, quiet=True)
    trained = [r["seed"] for r in _ledger(run) if r["event"] == "trained"]
    names = assign_envs(cfg.env.mixture_weights, trained, cfg.rollout.seed)
    assert set(names) == {"fast", "slow"}
    steps = [r for r in _rows(run) if "async/staleness_max" in r]
    assert all("env/fast/episodes" in r and "env/slow/episodes" in r for r in steps)
    # every episode finished is counted in the step that followed it: at least the trained ones
    assert sum(r["env/fast/episodes"] + r["env/slow/episodes"] for r in steps) >= 3 * 2 * 2
