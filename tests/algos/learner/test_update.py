"""compute_advantages, policy_loss and update_step: hand cases, invariants, one step per preset."""

from __future__ import annotations

import contextlib
import copy
import math
from dataclasses import replace

import pytest
import torch

from veriloop.agents.forward import token_logprobs
from veriloop.algos.learner.algorithm import resolve
from veriloop.algos.learner.batch import collate
from veriloop.algos.learner.credit import compute_advantages
from veriloop.algos.learner.critic import ValueModel
from veriloop.algos.learner.prepare import prepare_batch
from veriloop.algos.learner.step_settings import UpdateSettings
from veriloop.algos.learner.update import METRIC_NAMES, policy_loss, update_step
from veriloop.configs.algo import AlgoConfig
from veriloop.configs.presets import list_presets, load_preset

S = 1 / math.sqrt(2)


def test_grpo_advantages_on_tokens_and_verifier_failure(make_traj):
    a = make_traj([([10, 11], [30], 1.0)])
    b = make_traj([([12], [30], 0.0)])
    c = make_traj([([13], [], 5.0)], error="timeout")  # unknown reward: out of the baseline
    out = compute_advantages([a, b, c], resolve(AlgoConfig(advantage="group_norm")))
    assert torch.allclose(out.advantages[0], torch.tensor([0, 0, 0, S, S, 0]), atol=1e-5)
    assert torch.allclose(out.advantages[1], torch.tensor([0, 0, 0, -S, 0, 0]), atol=1e-5)
    assert torch.all(out.advantages[2] == 0) and out.sample_mask.tolist() == [1, 1, 0]
    assert out.metrics["samples/verifier_failed"] == 1


def test_overlong_filter_and_penalty(make_traj):
    a = make_traj([([10, 11, 12], [], 1.0)], hit_limit=[True])
    b = make_traj([([12], [], 0.0)])
    filt = compute_advantages([a, b], resolve(AlgoConfig(advantage="rloo", overlong_filter=True)))
    assert filt.sample_mask.tolist() == [0, 1] and torch.all(filt.advantages[0] == 0)
    assert torch.allclose(filt.advantages[1, 3], torch.tensor(-1.0))  # a's reward still is b's baseline
    # soft punishment, L_max 4, L_cache 2: |y| = 3 -> (2 - 3) / 2 = -0.5, so rewards 0.5 and 0
    cfg = AlgoConfig(advantage="rloo", overlong_penalty=True, overlong_max_len=4, overlong_cache_len=2)
    pen = compute_advantages([a, b], resolve(cfg))
    assert torch.allclose(pen.advantages[:, 3], torch.tensor([0.5, -0.5]))


def test_turn_level_and_outcome_levels(make_traj):
    a = make_traj([([10], [30], 0.0), ([11], [], 1.0)])
    b = make_traj([([12], [30], 1.0), ([13], [], -1.0)])
    out = compute_advantages([a, b], resolve(AlgoConfig(advantage="rloo", reward_level="outcome")))
    assert out.advantages[0, [3, 5]].tolist() == [2.0, 2.0]  # outcome 1 vs -1
    turn = compute_advantages([a, b], resolve(AlgoConfig(advantage="rloo", reward_level="turn")))
    # returns-to-go: a [1, 1], b [0, -1]; leave-one-out by turn index
    assert turn.advantages[0, [3, 5]].tolist() == [1.0, 2.0]
    assert turn.advantages[1, [3, 5]].tolist() == [-1.0, -2.0]


def test_gae_through_compute_advantages_is_return_minus_value(make_traj):
    a = make_traj([([10, 11], [30, 31], 0.5), ([12], [], 1.0)])
    cfg = AlgoConfig(advantage="gae", critic="value_head", gamma=1.0, lam=1.0, reward_level="turn")
    v = torch.tensor([[0, 0, 0, 0.1, 0.2, 9, 9, 0.3]])
    out = compute_advantages([a], resolve(cfg), values=v)
    # rewards on each turn's last token: 0.5 at index 4, 1.0 at 7; returns-to-go 1.5, 1.5, 1.0
    assert torch.allclose(out.advantages, torch.tensor([[0, 0, 0, 1.4, 1.3, 0, 0, 0.7]]), atol=1e-6)
    assert torch.allclose(out.returns, torch.tensor([[0, 0, 0, 1.5, 1.5, 0, 0, 1.0]]), atol=1e-6)
    with pytest.raises(ValueError, match="needs values"):
        compute_advantages([a], resolve(cfg))
    # KL as a reward penalty (PPO): log pi_old = -1 (fixture), log ref = -1.5 -> k1 = 0.5 per token,
    # beta 0.1: every sampled token's reward drops by 0.05, and GAE carries it like any reward
    ref = torch.tensor([[0, 0, 0, -1.5, -1.5, 0, 0, -1.5]])
    kl_cfg = replace(cfg, kl_coef=0.1, kl_estimator="k1", kl_mode="reward")
    out = compute_advantages([a], resolve(kl_cfg), values=v, ref_logprobs=ref)
    # token rewards [-0.05, 0.45 | -0.05 + 1.0 -> 0.95]: returns-to-go 1.35, 1.40, 0.95
    assert torch.allclose(out.returns, torch.tensor([[0, 0, 0, 1.35, 1.4, 0, 0, 0.95]]), atol=1e-6)
    assert torch.allclose(out.advantages, torch.tensor([[0, 0, 0, 1.25, 1.2, 0, 0, 0.65]]), atol=1e-6)


def test_process_needs_action_kinds(make_traj):
    a = make_traj([([10], [30], 1.0)])
    with pytest.raises(ValueError, match="action_kind"):
        compute_advantages([a, a], resolve(AlgoConfig(advantage="process")))


# ----------------------------------------------------------------------------- one update step


def _episodes(model, make_traj, with_logprobs, early=lambda r: r - 1):
    """Two problems x two episodes of two turns (solve, verify); one right and one wrong: turn
    rewards (0, +1) and (-2, -1), never positive before the last turn (``reward_level="sum"``
    refuses that: it would pay for extra attempts)."""
    trajs = []
    for g, (good, bad) in enumerate(
        [((10, 11, 12, 13, 14), (20, 21, 22, 23, 24)), ((40, 41, 42, 43, 44), (50, 51, 52, 53, 54))]
    ):
        for toks, r in ((good, 1.0), (bad, -1.0)):
            trajs.append(
                make_traj(
                    [(toks[:3], [30, 31], early(r)), (toks[3:], [], r)], group_id=g, kinds=["solve", "verify"]
                )
            )
    batch = collate(trajs, [[0.0] * len(t.token_ids) for t in trajs])
    with torch.no_grad():
        lp, _ = token_logprobs(model, batch.input_ids, batch.attention_mask)
    return [with_logprobs(t, lp[i, : len(t.token_ids)]) for i, t in enumerate(trajs)]


def test_a_rollout_batch_is_collated_once(tiny_llama, make_traj, with_logprobs, monkeypatch):
    """Reference log-probs, critic values, advantages, rollout correction and every update step all
    read the one ``TokenBatch`` that ``prepare_batch`` collated (mini-batches are row selections)."""
    import veriloop.algos.learner.credit as credit
    import veriloop.algos.learner.prepare as prepare

    trajs = _episodes(tiny_llama, make_traj, with_logprobs)
    calls = []
    real = prepare.collate
    for module in (prepare, credit):  # compute_advantages collates when it is not handed the batch
        monkeypatch.setattr(module, "collate", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    cfg = AlgoConfig(advantage="gae", critic="value_head", kl_coef=0.04, rollout_is="truncate")
    critic = ValueModel(tiny_llama)
    batch, _ = prepare_batch(
        trajs, resolve(cfg), model=tiny_llama, critic=critic, ref_model=copy.deepcopy(tiny_llama)
    )
    opt = torch.optim.SGD(tiny_llama.parameters(), lr=1e-3)
    update_step(
        tiny_llama,
        opt,
        batch,
        resolve(cfg),
        UpdateSettings(micro_batch_size=1, max_grad_norm=1.0),
        critic=critic,
    )
    assert calls == [1]


# every preset that learns from advantages (opsd learns from a teacher alone: tests/algos/loop/test_distill_train.py)
@pytest.mark.parametrize("preset", [p for p in list_presets() if load_preset(p).rl_coef > 0])
def test_one_step_moves_logprobs_with_advantage_sign(preset, tiny_llama, make_traj, with_logprobs):
    cfg = load_preset(preset)
    model = tiny_llama.train()
    summed = cfg.reward_level == "sum" and cfg.advantage != "process"
    trajs = _episodes(model, make_traj, with_logprobs, early=(lambda r: r - 1) if summed else (lambda r: r))
    critic = ValueModel(model) if cfg.needs_critic else None
    ref = copy.deepcopy(model) if cfg.needs_reference else None
    batch, _ = prepare_batch(trajs, resolve(cfg), model=model, critic=critic, ref_model=ref)
    params = list(model.parameters()) + (list(critic.head.parameters()) if critic else [])
    opt = torch.optim.SGD(params, lr=0.05)
    m = update_step(
        model,
        opt,
        batch,
        resolve(cfg),
        UpdateSettings(micro_batch_size=2, max_grad_norm=1.0, max_new_tokens=8),
        critic=critic,
    )
    assert set(METRIC_NAMES) <= set(m) and m["skipped"] == 0 and m["grad_norm"] > 0
    with torch.no_grad():
        new, _ = token_logprobs(model, batch.input_ids, batch.attention_mask)
    delta = (new - batch.old_logprobs)[batch.loss_mask.bool()]
    adv = batch.advantages[batch.loss_mask.bool()]
    assert (adv > 0).sum() >= 8 and (adv < 0).sum() >= 8, preset  # both signs really present
    # every sampled token moves with the sign of its own advantage, not just on average
    assert torch.all(delta[adv > 0] > 0) and torch.all(delta[adv < 0] < 0), preset


def test_one_step_with_mixed_signs_inside_episodes(tiny_llama, make_traj, with_logprobs):
    """S2R process-level GRPO: a good solve followed by a bad verify (and the reverse) gives
    opposite advantages to the two turns of one episode; each turn's tokens follow their own sign."""
    trajs = []
    for g in range(2):
        base = 10 + 20 * g
        for k, (r_solve, r_verify) in enumerate(((1.0, -1.0), (-1.0, 1.0))):
            toks = [base + 5 * k + i for i in range(5)]
            trajs.append(
                make_traj(
                    [(toks[:3], [60, 61], r_solve), (toks[3:], [], r_verify)],
                    group_id=g,
                    kinds=["solve", "verify"],
                )
            )
    cfg = load_preset("s2r_process_grpo")
    model = tiny_llama.train()
    padded = collate(trajs, [[0.0] * len(t.token_ids) for t in trajs])
    with torch.no_grad():
        lp, _ = token_logprobs(model, padded.input_ids, padded.attention_mask)
    trajs = [with_logprobs(t, lp[i, : len(t.token_ids)]) for i, t in enumerate(trajs)]
    batch, _ = prepare_batch(trajs, resolve(cfg))
    # per action +-1 against the same action of the other episode: +-1/sqrt(2) per turn
    assert torch.allclose(batch.advantages[0, 3:6], torch.full((3,), S), atol=1e-5)
    assert torch.allclose(batch.advantages[0, 8:10], torch.full((2,), -S), atol=1e-5)
    update_step(
        model,
        torch.optim.SGD(model.parameters(), lr=0.05),
        batch,
        resolve(cfg),
        UpdateSettings(micro_batch_size=4, max_grad_norm=1.0),
    )
    with torch.no_grad():
        new, _ = token_logprobs(model, batch.input_ids, batch.attention_mask)
    m = batch.loss_mask.bool()
    delta, adv = (new - batch.old_logprobs)[m], batch.advantages[m]
    assert torch.all(delta[adv > 0] > 0) and torch.all(delta[adv < 0] < 0)


def test_micro_batching_gives_the_full_batch_gradient(tiny_llama, make_traj, with_logprobs):
    trajs = _episodes(tiny_llama, make_traj, with_logprobs)
    trajs[0] = make_traj(
        [([10], [30], 0.0), ([11, 12, 13], [], 2.0)], kinds=["solve", "verify"]
    )  # uneven lengths
    for agg in ("token_mean", "seq_mean_token_mean", "seq_sum_constant"):
        cfg = AlgoConfig(advantage="group_mean", loss_agg=agg, loss_agg_constant=8)
        batch, _ = prepare_batch(trajs, resolve(cfg))
        grads = []
        for mbs in (4, 1):
            model = copy.deepcopy(tiny_llama)
            opt = torch.optim.SGD(model.parameters(), lr=1.0)
            before = [p.detach().clone() for p in model.parameters()]
            update_step(
                model, opt, batch, resolve(cfg), UpdateSettings(micro_batch_size=mbs, max_grad_norm=1e9)
            )
            grads.append(torch.cat([(b - p.detach()).flatten() for b, p in zip(before, model.parameters())]))
        assert torch.allclose(grads[0], grads[1], atol=1e-6), agg


def test_masked_positions_never_receive_gradient(tiny_llama, make_traj, with_logprobs):
    """Whatever sits off the loss mask (prompt, environment, padding, filtered episodes) leaves the
    gradient unchanged, bit for bit, with every loss term on; even an old log-prob of -1e4
    (ratio e^1e4 = inf) there must not turn the gradient into NaN."""
    cfg = AlgoConfig(advantage="rloo", kl_coef=0.04, entropy_coef=0.01, dual_clip=3.0)
    batch, _ = prepare_batch(
        _episodes(tiny_llama, make_traj, with_logprobs), resolve(cfg), ref_model=copy.deepcopy(tiny_llama)
    )
    off = batch.loss_mask == 0
    for junk in (torch.randn_like(batch.old_logprobs), torch.full_like(batch.old_logprobs, -1e4)):
        noisy = replace(
            batch,
            advantages=torch.where(off, torch.randn_like(batch.advantages) * 100, batch.advantages),
            old_logprobs=torch.where(off, junk, batch.old_logprobs),
            ref_logprobs=torch.where(off, junk, batch.ref_logprobs),
        )
        grads = []
        for b in (batch, noisy):
            tiny_llama.zero_grad()
            loss, _ = policy_loss(tiny_llama, b, resolve(cfg))
            loss.backward()
            grads.append(torch.cat([p.grad.flatten() for p in tiny_llama.parameters()]))
        assert torch.isfinite(grads[1]).all() and torch.equal(grads[0], grads[1])


def test_non_finite_guard_skips_the_step(tiny_llama, make_traj, with_logprobs):
    cfg = AlgoConfig(advantage="rloo")
    batch, _ = prepare_batch(_episodes(tiny_llama, make_traj, with_logprobs), resolve(cfg))
    bad = replace(batch, advantages=batch.advantages * float("nan"))
    before = [p.detach().clone() for p in tiny_llama.parameters()]
    opt = torch.optim.SGD(tiny_llama.parameters(), lr=1.0)
    m = update_step(tiny_llama, opt, bad, resolve(cfg), UpdateSettings(micro_batch_size=2, max_grad_norm=1.0))
    assert m["skipped"] == 1
    assert all(torch.equal(b, p) for b, p in zip(before, tiny_llama.parameters()))


def test_reference_from_context_manager_when_not_precomputed(tiny_llama, make_traj, with_logprobs):
    cfg = AlgoConfig(advantage="group_norm", kl_coef=0.04)
    batch, _ = prepare_batch(
        _episodes(tiny_llama, make_traj, with_logprobs), resolve(AlgoConfig(advantage="group_norm"))
    )
    entered = []

    @contextlib.contextmanager
    def as_reference():
        entered.append(1)
        yield

    loss, m = policy_loss(tiny_llama, batch, resolve(cfg), ref_model_ctx=as_reference)
    assert entered == [1] and m["loss/kl"] == pytest.approx(0.0, abs=1e-7)  # ref == policy here
    with pytest.raises(ValueError, match="reference"):
        policy_loss(tiny_llama, batch, resolve(cfg))


def _with_info(traj, infos):
    """Copy of ``traj`` whose turns' learner ``signal`` fields are set from ``infos`` (one dict per turn)."""
    turns = tuple(replace(t, signal=replace(t.signal, **extra)) for t, extra in zip(traj.turns, infos))
    return replace(traj, turns=turns)


def test_reinforce_pp_normalises_reward_plus_kl_to_go(make_traj):
    """REINFORCE++ (Hu 2025): G_t = R + sum_{s >= t} -beta KL_s, then (G - mean) / std over the
    batch's tokens. Sampling log-probs are -1 (fixture), reference -1.5: k1 = 0.5 per token, so
    with beta 0.1 each token adds -0.05 to the reward."""
    a = make_traj([([10, 11], [], 1.0)])  # 2 tokens, reward 1
    b = make_traj([([12], [], 0.0)], group_id=1)  # 1 token, reward 0
    ref = torch.tensor([[0, 0, 0, -1.5, -1.5], [0, 0, 0, -1.5, 0]])
    cfg = load_preset("reinforce_pp", kl_coef=0.1)
    out = compute_advantages([a, b], resolve(cfg), ref_logprobs=ref)
    g = torch.tensor([1 - 0.1, 1 - 0.05, -0.05])  # returns-to-go of a's two tokens, then b's
    mean = (0.9 + 0.95 - 0.05) / 3  # 0.6
    std = math.sqrt((0.3**2 + 0.35**2 + 0.65**2) / 3)  # population std over the 3 tokens
    want = (g - mean) / std  # [0.652, 0.761, -1.413]
    got = torch.cat([out.advantages[0, 3:5], out.advantages[1, 3:4]])
    assert torch.allclose(got, want.float(), atol=1e-4)
    # (normalising the rewards first and adding the KL afterwards gives [0.680, 0.734, -1.414])
    assert abs(float(got.sum())) < 1e-5


def test_kl_in_the_loss_hand_computed(tiny_llama, make_traj, with_logprobs):
    """GRPO's KL term: beta * aggregate(k(log pi - log ref)); here log ref = log pi + log 2 on every
    sampled token, so d = -log 2 and k1 = -log 2, k2 = (log 2)^2 / 2, k3 = 2 - 1 - log 2."""
    batch, _ = prepare_batch(
        _episodes(tiny_llama, make_traj, with_logprobs), resolve(AlgoConfig(advantage="rloo"))
    )
    with torch.no_grad():
        lp, _ = token_logprobs(tiny_llama, batch.input_ids, batch.attention_mask)
    batch = replace(batch, ref_logprobs=(lp + math.log(2.0)) * batch.loss_mask)
    d = -math.log(2.0)
    for kind, per_token in (("k1", d), ("k2", d * d / 2), ("k3", math.exp(-d) - 1 + d)):
        for agg in ("token_mean", "seq_mean_token_mean"):
            cfg = AlgoConfig(advantage="rloo", kl_coef=0.04, kl_estimator=kind, loss_agg=agg)
            _, m = policy_loss(tiny_llama, batch, resolve(cfg))
            assert m["loss/kl"] == pytest.approx(0.04 * per_token, rel=1e-4), (kind, agg)
    # as a reward penalty instead, the loss has no KL term
    _, m = policy_loss(
        tiny_llama, batch, resolve(AlgoConfig(advantage="rloo", kl_coef=0.04, kl_mode="reward"))
    )
    assert m["loss/kl"] == 0.0


def test_entropy_bonus_in_the_loss(tiny_llama, make_traj, with_logprobs):
    batch, _ = prepare_batch(
        _episodes(tiny_llama, make_traj, with_logprobs), resolve(AlgoConfig(advantage="rloo"))
    )
    cfg = AlgoConfig(advantage="rloo", loss_agg="token_mean", entropy_coef=0.01)
    loss, m = policy_loss(tiny_llama, batch, resolve(cfg))
    assert m["entropy"] > 0 and m["loss/entropy"] == pytest.approx(-0.01 * m["entropy"], rel=1e-5)
    assert float(loss.detach()) == pytest.approx(m["loss/policy"] + m["loss/entropy"], rel=1e-5)
    # minimising the bonus alone raises the entropy of the sampled positions
    model = copy.deepcopy(tiny_llama)
    only_ent = replace(batch, advantages=torch.zeros_like(batch.advantages))
    update_step(
        model,
        torch.optim.SGD(model.parameters(), lr=1.0),
        only_ent,
        resolve(replace(cfg, entropy_coef=1.0)),
        UpdateSettings(micro_batch_size=4, max_grad_norm=1e9),
    )
    _, after = policy_loss(model, batch, resolve(cfg))
    assert after["entropy"] > m["entropy"]


def test_ratio_uses_the_sampling_temperature(tiny_llama, make_traj, with_logprobs):
    """Old log-probs recorded at T = 0.5 (softmax(logits / 0.5)); before any update the ratio must
    be exactly 1, which holds only when the new log-probs are taken at the same T."""
    trajs = _episodes(tiny_llama, make_traj, with_logprobs)
    base = collate(trajs, [[0.0] * len(t.token_ids) for t in trajs])
    with torch.no_grad():
        lp_t, _ = token_logprobs(tiny_llama, base.input_ids, base.attention_mask, temperature=0.5)
    trajs = [with_logprobs(t, lp_t[i, : len(t.token_ids)]) for i, t in enumerate(trajs)]
    cfg = AlgoConfig(advantage="rloo", clip_low=0.01, clip_high=0.01)
    batch, _ = prepare_batch(trajs, resolve(cfg))
    _, at_t = policy_loss(tiny_llama, batch, resolve(cfg), temperature=0.5)
    assert at_t["approx_kl"] == pytest.approx(0.0, abs=1e-6)
    assert at_t["clip_frac_low"] == 0.0 and at_t["clip_frac_high"] == 0.0
    _, at_one = policy_loss(tiny_llama, batch, resolve(cfg))  # T = 1: ratios far from 1, the clip fires
    assert at_one["approx_kl"] > 1e-3 and at_one["clip_frac_low"] + at_one["clip_frac_high"] > 0
    m = update_step(
        tiny_llama,
        torch.optim.SGD(tiny_llama.parameters(), lr=0.0),
        batch,
        resolve(cfg),
        UpdateSettings(micro_batch_size=2, max_grad_norm=1.0, temperature=0.5),
    )
    assert m["approx_kl"] == pytest.approx(0.0, abs=1e-6)


def test_process_advantage_counts_invalid_actions_as_the_expected_kind(make_traj):
    """SolveVerify reports "invalid" actions (e.g. a verify with no solve before it). Episode a:
    invalid first action (-1), then solve (+1), verify (+1); b: solve (+1), verify (+1), solve (-1).
    The invalid action stood where a solve was expected, so position 0's solves are [-1, +1]."""
    a = make_traj(
        [([10], [60], -1.0), ([11], [60], 1.0), ([12], [], 1.0)], kinds=["invalid", "solve", "verify"]
    )
    b = make_traj(
        [([13], [60], 1.0), ([14], [60], 1.0), ([15], [], -1.0)], kinds=["solve", "verify", "solve"]
    )
    out = compute_advantages([a, b], resolve(load_preset("s2r_process_grpo")))
    # position 0: solve[-1, +1] -> -S, +S; position 1: a solve vs b verify: different kinds, alone
    # -> 0; position 2: a verify vs b solve -> 0
    assert torch.allclose(out.advantages[0, [3, 5, 7]], torch.tensor([-S, 0.0, 0.0]), atol=1e-5)
    assert torch.allclose(out.advantages[1, [3, 5, 7]], torch.tensor([S, 0.0, 0.0]), atol=1e-5)
    # a malformed verify right after a solve is compared with the verifies at that position
    c = make_traj([([10], [60], 1.0), ([11], [], -1.0)], kinds=["solve", "invalid"])
    d = make_traj([([12], [60], 1.0), ([13], [], 1.0)], kinds=["solve", "verify"])
    out = compute_advantages([c, d], resolve(load_preset("s2r_process_grpo")))
    assert torch.allclose(out.advantages[:, 5], torch.tensor([-S, S]), atol=1e-5)


def test_balanced_process_rewards_weigh_each_verify_by_its_solve_class(make_traj):
    """Four episodes of one problem: solve, then verify. One solve right, three wrong; the verifier
    says "incorrect" to all (-1 on the right solve, +1 on the wrong ones). Balanced, the verify
    rewards are -2 and 2/3 x 3 (weights 4 / (2 * 1) and 4 / (2 * 3)), mean 0: the constant verdict
    earns chance; plain they are -1 and +1 x 3, mean 0.5. Each is then normalised as GRPO's."""
    from dataclasses import replace

    def episode(solve_right: bool, says_right: bool):
        solve = ([10], [60], 1.0 if solve_right else -1.0)
        verdict = ([11], [], 1.0 if says_right == solve_right else -1.0)
        t = make_traj([solve, verdict], kinds=["solve", "verify"])
        verify = replace(
            t.turns[1], signal=replace(t.turns[1].signal, reward_class="right" if solve_right else "wrong")
        )
        return replace(t, turns=(t.turns[0], verify))

    batch = [episode(True, False), episode(False, False), episode(False, False), episode(False, False)]
    plain = compute_advantages(batch, resolve(load_preset("s2r_process_grpo"))).advantages[:, 3 + 2]
    bal = compute_advantages(batch, resolve(load_preset("s2r_process_grpo_balanced"))).advantages[:, 3 + 2]
    r_plain = torch.tensor([-1.0, 1.0, 1.0, 1.0], dtype=torch.float64)
    r_bal = torch.tensor([-2.0, 2 / 3, 2 / 3, 2 / 3], dtype=torch.float64)
    for got, r in ((plain, r_plain), (bal, r_bal)):
        want = (r - r.mean()) / (r.std() + 1e-6)  # Bessel-corrected, as GRPO's
        assert torch.allclose(got.double(), want, atol=1e-5)
    # the solves (no class) are the same either way
    same = [
        compute_advantages(batch, resolve(load_preset(n))).advantages[:, 3]
        for n in ("s2r_process_grpo", "s2r_process_grpo_balanced")
    ]
    assert torch.equal(*same)
    # a verifier failure leaves its episode out of the class counts too
    failed = make_traj([([10], [60], 1.0), ([11], [], 1.0)], kinds=["solve", "verify"], error="timeout")
    failed = replace(
        failed,
        turns=(
            failed.turns[0],
            replace(failed.turns[1], signal=replace(failed.turns[1].signal, reward_class="right")),
        ),
    )
    with_failed = compute_advantages([*batch, failed], resolve(load_preset("s2r_process_grpo_balanced")))
    assert torch.allclose(with_failed.advantages[:4, 5], bal, atol=1e-6)


def test_s2r_presets_read_their_signal_from_the_contract(make_traj):
    """SolveVerify's signal has process_reward on every step and outcome_reward on the last, whichever
    one it returns as the step reward. Episode a: wrong solve, verify says "incorrect" (matches),
    truncated: process [-1, +1], outcome -1. Episode b: right solve, verify "correct": [+1, +1], +1."""
    kinds = ["solve", "verify"]
    a = make_traj([([10], [60], -1.0), ([11], [], 1.0)], kinds=kinds)  # env in process mode
    b = make_traj([([12], [60], 1.0), ([13], [], 1.0)], kinds=kinds)
    a = _with_info(
        a, [{"process_reward": -1.0, "outcome_reward": None}, {"process_reward": 1.0, "outcome_reward": -1.0}]
    )
    b = _with_info(
        b, [{"process_reward": 1.0, "outcome_reward": None}, {"process_reward": 1.0, "outcome_reward": 1.0}]
    )
    outcome = compute_advantages([a, b], resolve(load_preset("s2r_outcome_rloo")))
    # RLOO on outcomes -1 vs +1: -2 / +2 on every token (the last step reward +1 / +1 would give 0)
    assert outcome.advantages[:, [3, 5]].tolist() == [[-2.0, -2.0], [2.0, 2.0]]
    # the same episodes from an env in outcome mode (step rewards 0, then the outcome)
    a0 = replace(a, turns=tuple(replace(t, reward=r) for t, r in zip(a.turns, (0.0, -1.0))))
    b0 = replace(b, turns=tuple(replace(t, reward=r) for t, r in zip(b.turns, (0.0, 1.0))))
    process = compute_advantages([a0, b0], resolve(load_preset("s2r_process_grpo")))
    # solves -1 vs +1 at position 0 -> -S / +S; verifies +1 vs +1 -> 0 (step rewards would give +-S)
    assert torch.allclose(process.advantages[:, [3, 5]], torch.tensor([[-S, 0.0], [S, 0.0]]), atol=1e-5)


def test_recompute_old_logprobs_replaces_filtered_sampling_logprobs(tiny_llama, make_traj):
    """top-k / top-p sampling records filtered log-probs; the update needs the model's own at T."""
    a = make_traj([([10, 11], [30, 31], 0.0), ([12], [], 1.0)])
    b = make_traj([([13, 14, 15], [], 0.0)])
    cfg = AlgoConfig(advantage="rloo")
    kept, _ = prepare_batch([a, b], resolve(cfg), model=tiny_llama)
    assert torch.all(kept.old_logprobs[kept.loss_mask.bool()] == -1.0)  # the fixture's recorded values
    fresh, _ = prepare_batch(
        [a, b], resolve(cfg), model=tiny_llama, temperature=0.7, recompute_old_logprobs=True
    )
    want, _ = token_logprobs(tiny_llama, fresh.input_ids, fresh.attention_mask, temperature=0.7)
    m = fresh.loss_mask.bool()
    assert torch.allclose(fresh.old_logprobs[m], want[m], atol=1e-5)
    assert torch.all(fresh.old_logprobs[~m] == kept.old_logprobs[~m])  # off the mask: untouched
    with pytest.raises(ValueError, match="needs model="):
        prepare_batch([a, b], resolve(cfg), recompute_old_logprobs=True)


def test_token_capped_micro_batches_give_the_same_update(tiny_llama, make_traj, with_logprobs):
    """Micro-batches cut by ``micro_batch_tokens`` accumulate the same gradient as whole ones."""
    batch, _ = prepare_batch(
        _episodes(tiny_llama, make_traj, with_logprobs), resolve(AlgoConfig(advantage="rloo"))
    )
    cfg = AlgoConfig(advantage="rloo", loss_agg="token_mean")
    models = [copy.deepcopy(tiny_llama) for _ in range(2)]
    for model, cap in zip(models, (0, 1)):  # cap 1: every row alone
        update_step(
            model,
            torch.optim.SGD(model.parameters(), lr=0.5),
            batch,
            resolve(cfg),
            UpdateSettings(micro_batch_size=4, max_grad_norm=1e9, micro_batch_tokens=cap),
        )
    moved = False
    for (name, p0), p1, p in zip(
        models[0].named_parameters(), models[1].parameters(), tiny_llama.parameters()
    ):
        torch.testing.assert_close(p0, p1, atol=1e-6, rtol=1e-5, msg=name)
        moved |= not torch.equal(p0, p)
    assert moved
