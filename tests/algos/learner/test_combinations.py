"""The six "results our combinations get wrong" of the first algorithm audit, each pinned by a test that failed on
the code before its fix (checked by running this file against that commit).

1. S2R outcome reward when the rollout cuts the episode.
2. Data-parallel gradient weighting with a critic (tests/algos/run/test_distributed.py).
3. REINFORCE++ whitening independent of ``kl_coef``.
4. Summed per-turn positive rewards must not pay for extra attempts.
5. ``critic: separate`` starts from the policy's pretrained weights plus a fresh head.
6. Dynamic sampling judges a group on the estimator's signal, not on ``total_reward``.
"""

from __future__ import annotations

from dataclasses import replace

import gymnasium
import pytest
import torch

import veriloop.algos.loop.source as source_module
import veriloop.algos.run.setup as S
import veriloop.envs  # noqa: F401  (registers the environments)
from veriloop.agents.trajectory import TurnRecord
from veriloop.algos.learner.algorithm import resolve
from veriloop.algos.learner.credit import compute_advantages
from veriloop.algos.loop.parts import TrainerState
from veriloop.algos.loop.source import collect
from veriloop.configs.algo import AlgoConfig
from veriloop.configs.loader import load_config
from veriloop.envs.base import SIGNAL_KEY, LearnerSignal
from veriloop.envs.json_safe import jsonable

WRONG, VERIFY_NO, VERIFY_YES = (
    "The answer is \\boxed{-98765}.",
    "<verify>incorrect</verify>",
    "<verify>correct</verify>",
)


def _s2r(make_traj, actions, *, mode, group_id=0):  # type: ignore[no-untyped-def]
    """Play ``actions`` on the real SolveVerify env; a trajectory whose turns carry its infos."""
    env = gymnasium.make("veriloop/SolveVerify-v0", task="math", level=1, max_attempts=2, reward_mode=mode)
    env.reset(seed=0)
    steps = []
    for a in actions:
        _, reward, term, trunc, info = env.step(a)
        signal = info.pop(SIGNAL_KEY)
        verdict = info.pop("verdict", None)
        steps.append((reward, verdict, jsonable(info), term, trunc, signal))
    traj = make_traj([([10 + k], [30], r) for k, (r, *_) in enumerate(steps)], group_id=group_id)
    turns = tuple(
        TurnRecord(
            t.index,
            t.start,
            t.end,
            actions[k],
            steps[k][0],
            steps[k][1],
            steps[k][2],
            terminated=steps[k][3],
            truncated=steps[k][4],
            signal=steps[k][5],
        )
        for k, t in enumerate(traj.turns)
    )
    return replace(traj, turns=turns, terminated=steps[-1][3], truncated=steps[-1][4])


@pytest.mark.parametrize("mode", ["process", "outcome"])
def test_1_cut_s2r_episode_scores_its_outcome_not_its_last_step(make_traj, mode):
    cut = _s2r(make_traj, [WRONG, VERIFY_NO], mode=mode)  # wrong solve, right verify, then cut
    assert cut.turns[-1].info["outcome_reward"] is None and not cut.truncated and not cut.terminated
    finished = _s2r(make_traj, [WRONG, VERIFY_NO, WRONG, VERIFY_NO], mode=mode)  # attempts used up
    assert finished.turns[-1].info["outcome_reward"] == -1.0
    assert cut.turns[-1].signal.outcome_reward == -1.0  # the outcome the env gives it if stopped here
    lucky = replace(
        finished,
        turns=(
            *finished.turns[:-1],
            replace(finished.turns[-1], signal=replace(finished.turns[-1].signal, outcome_reward=1.0)),
        ),
    )
    cfg = AlgoConfig(advantage="rloo", reward_level="outcome")
    adv = compute_advantages([cut, finished, finished, lucky], resolve(cfg)).advantages
    # rewards [-1, -1, -1, +1]: the cut wrong episode is as wrong as the finished ones (was +0.33)
    first = [float(adv[i][cut.loss_mask.index(1)]) for i in range(2)]
    assert first[0] == pytest.approx(-1 - (-1 - 1 + 1) / 3) == pytest.approx(first[1])


def test_3_reinforce_pp_whitening_does_not_depend_on_kl_coef(make_traj):
    trajs = [
        make_traj([([10, 11, 12, 13], [], 1.0)]),
        make_traj([([14], [], 0.0)]),
        make_traj([([15], [], 0.0)]),
    ]
    ref = torch.tensor([t.logprobs + [0.0] * (7 - len(t.logprobs)) for t in trajs])  # KL exactly 0

    def adv(estimator: str, coef: float) -> torch.Tensor:
        cfg = AlgoConfig(advantage=estimator, kl_mode="reward", kl_coef=coef)
        return compute_advantages(trajs, resolve(cfg), ref_logprobs=ref).advantages

    a = adv("batch_norm", 0.0)
    torch.testing.assert_close(a, adv("batch_norm", 1e-12))  # was 2x apart
    torch.testing.assert_close(adv("group_mean_batch_norm", 0.0), adv("group_mean_batch_norm", 1e-12))
    # whitened over the 6 tokens (4 with return 1, 2 with 0): mean 2/3, std sqrt(2)/3
    assert float(a[0, 3]) == pytest.approx((1 - 2 / 3) / (2**0.5 / 3), rel=1e-4)
    assert float(a[1, 3]) == pytest.approx((0 - 2 / 3) / (2**0.5 / 3), rel=1e-4)


def test_4_summed_turn_rewards_do_not_pay_for_extra_attempts(make_traj):
    ok = "<think>t</think><answer>4</answer>"
    first = make_traj([([10], [], 1.0)])
    first = replace(first, turns=(replace(first.turns[0], text=ok),))
    third = make_traj([([10], [30], 0.0), ([11], [30], 0.0), ([12], [], 1.0)])
    third = replace(third, turns=tuple(replace(t, text=ok) for t in third.turns))
    cfg = AlgoConfig(advantage="group_mean", reward_level="sum", format_reward=0.1)
    adv = compute_advantages([first, third], resolve(cfg)).advantages
    assert float(adv[0, 3]) == 0.0 and float(adv[1, 3]) == 0.0  # both 1.1: a tie (was 1.1 vs 1.3)
    # an environment that pays a positive reward on a non-final turn (MathVerify's r1 format
    # bonus on every attempt) cannot be summed: a clear error, not a silent bonus per attempt
    r1 = make_traj([([10], [30], 0.1), ([11], [30], 0.1), ([12], [], 1.1)])
    with pytest.raises(ValueError, match="reward_level=outcome"):
        compute_advantages([first, r1], resolve(AlgoConfig(advantage="group_mean", reward_level="sum")))
    out = compute_advantages([first, r1], resolve(AlgoConfig(advantage="group_mean", reward_level="outcome")))
    assert float(out.advantages[1, 3]) == pytest.approx(0.05)  # last-turn rewards 1.1 vs 1.0


@pytest.mark.parametrize("lora", [False, True])
def test_5_separate_critic_starts_from_the_policys_pretrained_weights(lora):
    cfg = load_config(
        None,
        [
            "policy.model=tiny",
            f"policy.lora={str(lora).lower()}",
            "run.algo_preset=ppo",
            "algo.critic=separate",
        ],
    )
    policy = S.build_policy(cfg)
    critic = S.build_critic(cfg, policy)
    assert critic is not None and critic.backbone is not policy.model
    base = policy.model.get_base_model() if lora else policy.model
    want = {k: v for k, v in base.state_dict().items() if "lora_" not in k}
    got = critic.backbone.state_dict()
    emb = [k for k in got if "embed_tokens" in k]
    assert emb and all(torch.equal(got[k], want[k]) for k in emb)
    q = [k for k in got if k.endswith("q_proj.weight")]
    for k in q:  # peft keeps the pretrained weight under base_layer
        src = want.get(k, want.get(k.replace("q_proj.weight", "q_proj.base_layer.weight")))
        assert torch.equal(got[k], src), k
    assert all(p.requires_grad for p in critic.parameters())  # the critic trains in full
    assert float(critic.head.proj.bias.abs().sum()) == 0.0  # a fresh head
    got["model.embed_tokens.weight"].add_(1.0)  # its own copy: training it leaves the policy alone
    assert not torch.equal(got["model.embed_tokens.weight"], want["model.embed_tokens.weight"])


def test_6_dynamic_sampling_judges_the_estimators_signal(make_traj, monkeypatch):
    """Outcome level: equal ``total_reward`` (process rewards sum to 0 in both) but outcomes +1
    and -1: the group carries a learning signal and must be kept."""

    def traj(outcome: float, group_id: int):  # type: ignore[no-untyped-def]
        t = make_traj([([10], [30], 1.0), ([11], [], -1.0)], group_id=group_id)
        last = replace(t.turns[-1], signal=LearnerSignal(outcome_reward=outcome))
        return replace(t, turns=(t.turns[0], last))

    def fake_rollout(policy, specs, **kw):  # type: ignore[no-untyped-def]
        return [traj(1.0 if i % 2 == 0 else -1.0, s.group_id) for i, s in enumerate(specs)]

    monkeypatch.setattr(source_module, "rollout", fake_rollout)
    cfg = load_config(
        None,
        [
            "policy.model=tiny",
            "run.algo_preset=dapo",
            "algo.reward_level=outcome",
            "algo.overlong_penalty=false",
            "rollout.prompts_per_step=2",
            "rollout.group_size=2",
            "algo.max_sampling_rounds=1",
        ],
    )
    trajs, _, metrics = collect(cfg, None, TrainerState())
    assert len(trajs) == 4 and metrics["sampling/kept_fraction"] == 1.0
    assert metrics["sampling/informative_fraction"] == 1.0
