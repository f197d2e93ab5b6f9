"""Hand cases for the training loop's small pure helpers: the LR schedule and the rollout metrics."""

from __future__ import annotations

import math

import pytest

import veriloop.algos.loop.metrics as step_module
import veriloop.algos.run.setup as S
from veriloop.configs.loader import load_config


def _factor(schedule: str, steps: int = 10, warmup: int = 2):  # type: ignore[no-untyped-def]
    cfg = load_config(
        None,
        [
            "policy.model=tiny",
            f"train.steps={steps}",
            f"train.warmup_steps={warmup}",
            f"train.schedule={schedule}",
        ],
    )
    return S.lr_lambda(cfg)


def test_lr_lambda_hand_cases():
    # warm-up: (step + 1) / warmup, then progress = (step - warmup) / (steps - warmup)
    lin = _factor("linear")
    assert [lin(s) for s in (0, 1, 2, 6, 10, 12)] == [0.5, 1.0, 1.0, 0.5, 0.0, 0.0]
    cos = _factor("cosine")
    assert cos(0) == 0.5 and cos(2) == 1.0 and cos(10) == pytest.approx(0.0, abs=1e-12)
    assert cos(6) == pytest.approx(0.5 * (1 + math.cos(math.pi * 0.5)))
    const = _factor("constant")
    assert [const(s) for s in (0, 1, 2, 9, 50)] == [0.5, 1.0, 1.0, 1.0, 1.0]
    assert _factor("linear", warmup=0)(0) == 1.0  # no warm-up: starts at the full rate


@pytest.mark.parametrize("schedule", ["constant", "linear", "cosine"])
def test_lr_lambda_stays_in_0_1_and_never_rises_after_warmup(schedule):
    f = _factor(schedule, steps=20, warmup=3)
    values = [f(s) for s in range(30)]
    assert all(0.0 <= v <= 1.0 for v in values)
    after = values[3:]
    assert all(b <= a + 1e-12 for a, b in zip(after, after[1:]))


def test_rollout_metrics_hand_case(make_traj, monkeypatch):
    monkeypatch.setattr(step_module, "drift_rate", lambda tokenizer, t: float(t.num_turns))
    right = make_traj([([10, 11], [30], 1.0)])
    cut = make_traj([([12], [], -1.0)], hit_limit=[True])
    failed = make_traj([([13], [31], 0.0), ([14], [], 0.0)], error="timeout")
    m = step_module.rollout_metrics([right, cut, failed], tokenizer=None)
    assert m["reward/mean"] == 0.0 and m["reward/std"] == 1.0  # [1, -1, 0], Bessel-corrected
    assert m["success_rate"] == pytest.approx(1 / 3)  # only the first ends on a correct verdict
    assert m["response_length/mean"] == pytest.approx(5 / 3) and m["response_length/max"] == 2.0
    assert m["truncation_rate"] == pytest.approx(1 / 3) and m["turns/mean"] == pytest.approx(4 / 3)
    assert m["verifier/errors"] == 1.0 and m["verifier/timeouts"] == 1.0
    assert m["drift_rate"] == pytest.approx(4 / 3)  # mean over the first (up to 8) episodes


def test_rollout_metrics_single_episode_and_drift_sample(make_traj, monkeypatch):
    seen = []
    monkeypatch.setattr(step_module, "drift_rate", lambda tokenizer, t: seen.append(t) or 0.0)
    trajs = [make_traj([([10], [], 1.0)], group_id=i) for i in range(10)]
    assert (
        step_module.rollout_metrics(trajs[:1], tokenizer=None)["reward/std"] == 0.0
    )  # one episode: no spread
    seen.clear()
    step_module.rollout_metrics(trajs, tokenizer=None)
    assert len(seen) == 8  # drift is measured on the first 8 episodes only (it re-tokenizes)


def test_rollout_format_rate_counts_each_episodes_last_response(make_traj, monkeypatch):
    from dataclasses import replace

    monkeypatch.setattr(step_module, "drift_rate", lambda tokenizer, t: 0.0)

    def said(*texts: str):  # an episode whose turns wrote these texts
        t = make_traj([([10], [], 0.0)] * len(texts))
        return replace(t, turns=tuple(replace(tr, text=x) for tr, x in zip(t.turns, texts)))

    shaped = " <think>6 * 7</think>\n<answer>42</answer>\n"
    trajs = [
        said(shaped),  # shaped
        said("<think>6 * 7</think><answer>42</answer> so 42"),  # text after the answer: unshaped
        said("<answer>42</answer>"),  # no thinking block: unshaped
        said(shaped, "no idea"),  # shaped once, but the last response is not
        said("no idea", shaped),  # the last response is shaped
    ]
    # by hand: episodes 1 and 5 of 5
    assert step_module.rollout_metrics(trajs, tokenizer=None)["format_rate"] == pytest.approx(2 / 5)


def test_rollout_metrics_judge_a_solve_verify_batch_as_the_evaluation_does(make_traj, monkeypatch):
    """A verifier that says "incorrect" to every solve, right ones included, shows in the training
    row: recall 0 on right solves, 1 on wrong ones, balanced accuracy exactly 0.5."""
    import json
    from dataclasses import replace

    import gymnasium

    import veriloop.envs  # noqa: F401  (registers the environments)

    monkeypatch.setattr(step_module, "drift_rate", lambda tokenizer, t: 0.0)
    env = gymnasium.make("veriloop/SolveVerify-v0", task="points24", max_attempts=2)
    no = "<verify>incorrect</verify>"

    def solve(task, right: bool) -> str:
        formula = task["solution"] if right else "-".join(map(str, task["values"]))
        return json.dumps({"cards": [c[:-1] for c in task["cards"]], "formula": formula})

    trajs = []
    for plan in ([True, False], [False, False], [False, True]):  # each episode's two solves
        _, info = env.reset(seed=0)
        signals = []
        for right in plan:
            for text in (solve(info["task"], right), no):
                *_, step_info = env.step(text)
                signals.append(step_info["signal"])
        t = make_traj([([10], [], 0.0)] * len(signals))
        trajs.append(replace(t, turns=tuple(replace(tr, signal=s) for tr, s in zip(t.turns, signals))))
    m = step_module.rollout_metrics(trajs, tokenizer=None)
    # by hand: 6 verdicts, all "incorrect"; 2 of them on right solves, 4 on wrong ones
    assert m["rollout/verify_count"] == 6.0 and m["rollout/verify_wrong_share"] == pytest.approx(4 / 6)
    assert m["rollout/verify_recall_right"] == 0.0 and m["rollout/verify_recall_wrong"] == 1.0
    assert m["rollout/verify_acc"] == pytest.approx(4 / 6)
    assert m["rollout/verify_balanced_acc"] == 0.5
    assert "vbal=0.5" in step_module.step_summary(m)
    # an environment without its own metrics adds none
    plain = step_module.rollout_metrics([make_traj([([10], [], 1.0)])], tokenizer=None)
    assert not any(k.startswith("rollout/") for k in plain)
