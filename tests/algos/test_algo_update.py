"""compute_advantages, policy_loss and update_step: hand cases, invariants, one step per preset."""

from __future__ import annotations

import contextlib
import copy
import math
from dataclasses import replace

import pytest
import torch

from veriloop.agents.forward import token_logprobs
from veriloop.algos.batch import collate
from veriloop.algos.config import AlgoConfig
from veriloop.algos.critic import ValueModel
from veriloop.algos.presets import list_presets, load_preset
from veriloop.algos.update import METRIC_NAMES, compute_advantages, policy_loss, prepare_batch, update_step

S = 1 / math.sqrt(2)


def test_grpo_advantages_on_tokens_and_verifier_failure(make_traj):
    a = make_traj([([10, 11], [30], 1.0)])
    b = make_traj([([12], [30], 0.0)])
    c = make_traj([([13], [], 5.0)], error="timeout")  # unknown reward: out of the baseline
    out = compute_advantages([a, b, c], AlgoConfig(advantage="group_norm"))
    assert torch.allclose(out.advantages[0], torch.tensor([0, 0, 0, S, S, 0]), atol=1e-5)
    assert torch.allclose(out.advantages[1], torch.tensor([0, 0, 0, -S, 0, 0]), atol=1e-5)
    assert torch.all(out.advantages[2] == 0) and out.sample_mask.tolist() == [1, 1, 0]
    assert out.metrics["samples/verifier_failed"] == 1


def test_overlong_filter_and_penalty(make_traj):
    a = make_traj([([10, 11, 12], [], 1.0)], hit_limit=[True])
    b = make_traj([([12], [], 0.0)])
    filt = compute_advantages([a, b], AlgoConfig(advantage="rloo", overlong_filter=True))
    assert filt.sample_mask.tolist() == [0, 1] and torch.all(filt.advantages[0] == 0)
    assert torch.allclose(filt.advantages[1, 3], torch.tensor(-1.0))  # a's reward still is b's baseline
    # soft punishment, L_max 4, L_cache 2: |y| = 3 -> (2 - 3) / 2 = -0.5, so rewards 0.5 and 0
    cfg = AlgoConfig(advantage="rloo", overlong_penalty=True, overlong_max_len=4, overlong_cache_len=2)
    pen = compute_advantages([a, b], cfg)
    assert torch.allclose(pen.advantages[:, 3], torch.tensor([0.5, -0.5]))


def test_turn_level_and_outcome_levels(make_traj):
    a = make_traj([([10], [30], 0.0), ([11], [], 1.0)])
    b = make_traj([([12], [30], 1.0), ([13], [], -1.0)])
    out = compute_advantages([a, b], AlgoConfig(advantage="rloo", reward_level="outcome"))
    assert out.advantages[0, [3, 5]].tolist() == [2.0, 2.0]  # outcome 1 vs -1
    turn = compute_advantages([a, b], AlgoConfig(advantage="rloo", reward_level="turn"))
    # returns-to-go: a [1, 1], b [0, -1]; leave-one-out by turn index
    assert turn.advantages[0, [3, 5]].tolist() == [1.0, 2.0]
    assert turn.advantages[1, [3, 5]].tolist() == [-1.0, -2.0]


def test_gae_through_compute_advantages_is_return_minus_value(make_traj):
    a = make_traj([([10, 11], [30, 31], 0.5), ([12], [], 1.0)])
    cfg = AlgoConfig(advantage="gae", critic="value_head", gamma=1.0, lam=1.0, reward_level="turn")
    v = torch.tensor([[0, 0, 0, 0.1, 0.2, 9, 9, 0.3]])
    out = compute_advantages([a], cfg, values=v)
    # rewards on each turn's last token: 0.5 at index 4, 1.0 at 7; returns-to-go 1.5, 1.5, 1.0
    assert torch.allclose(out.advantages, torch.tensor([[0, 0, 0, 1.4, 1.3, 0, 0, 0.7]]), atol=1e-6)
    assert torch.allclose(out.returns, torch.tensor([[0, 0, 0, 1.5, 1.5, 0, 0, 1.0]]), atol=1e-6)
    with pytest.raises(ValueError, match="needs values"):
        compute_advantages([a], cfg)


def test_process_needs_action_kinds(make_traj):
    a = make_traj([([10], [30], 1.0)])
    with pytest.raises(ValueError, match="action_kind"):
        compute_advantages([a, a], AlgoConfig(advantage="process"))


# ----------------------------------------------------------------------------- one update step


def _episodes(model, make_traj, with_logprobs):
    """Two problems x two episodes of two turns (solve, verify); one right (+1) and one wrong (-1)."""
    trajs = []
    for g, (good, bad) in enumerate(
        [((10, 11, 12, 13, 14), (20, 21, 22, 23, 24)), ((40, 41, 42, 43, 44), (50, 51, 52, 53, 54))]
    ):
        for toks, r in ((good, 1.0), (bad, -1.0)):
            trajs.append(
                make_traj([(toks[:3], [30, 31], r), (toks[3:], [], r)], group_id=g, kinds=["solve", "verify"])
            )
    batch = collate(trajs, [[0.0] * len(t.token_ids) for t in trajs])
    with torch.no_grad():
        lp, _ = token_logprobs(model, batch.input_ids, batch.attention_mask)
    return [with_logprobs(t, lp[i, : len(t.token_ids)]) for i, t in enumerate(trajs)]


@pytest.mark.parametrize("preset", list_presets())
def test_one_step_moves_logprobs_with_advantage_sign(preset, tiny_llama, make_traj, with_logprobs):
    cfg = load_preset(preset)
    model = tiny_llama.train()
    trajs = _episodes(model, make_traj, with_logprobs)
    critic = ValueModel(model) if cfg.needs_critic else None
    ref = copy.deepcopy(model) if cfg.needs_reference else None
    batch, _ = prepare_batch(trajs, cfg, model=model, critic=critic, ref_model=ref)
    params = list(model.parameters()) + (list(critic.head.parameters()) if critic else [])
    opt = torch.optim.SGD(params, lr=0.05)
    m = update_step(
        model, opt, batch, cfg, micro_batch_size=2, max_grad_norm=1.0, critic=critic, max_new_tokens=8
    )
    assert set(METRIC_NAMES) <= set(m) and m["skipped"] == 0 and m["grad_norm"] > 0
    with torch.no_grad():
        new, _ = token_logprobs(model, batch.input_ids, batch.attention_mask)
    delta = (new - batch.old_logprobs)[batch.loss_mask.bool()]
    adv = batch.advantages[batch.loss_mask.bool()]
    assert (adv > 0).any() and (adv < 0).any()
    assert delta[adv > 0].mean() > 0 and delta[adv < 0].mean() < 0


def test_micro_batching_gives_the_full_batch_gradient(tiny_llama, make_traj, with_logprobs):
    trajs = _episodes(tiny_llama, make_traj, with_logprobs)
    trajs[0] = make_traj(
        [([10], [30], 1.0), ([11, 12, 13], [], 1.0)], kinds=["solve", "verify"]
    )  # uneven lengths
    for agg in ("token_mean", "seq_mean_token_mean", "seq_sum_constant"):
        cfg = AlgoConfig(advantage="group_mean", loss_agg=agg, loss_agg_constant=8)
        batch, _ = prepare_batch(trajs, cfg)
        grads = []
        for mbs in (4, 1):
            model = copy.deepcopy(tiny_llama)
            opt = torch.optim.SGD(model.parameters(), lr=1.0)
            before = [p.detach().clone() for p in model.parameters()]
            update_step(model, opt, batch, cfg, micro_batch_size=mbs, max_grad_norm=1e9)
            grads.append(torch.cat([(b - p.detach()).flatten() for b, p in zip(before, model.parameters())]))
        assert torch.allclose(grads[0], grads[1], atol=1e-6), agg


def test_masked_positions_never_receive_gradient(tiny_llama, make_traj, with_logprobs):
    cfg = AlgoConfig(advantage="rloo")
    batch, _ = prepare_batch(_episodes(tiny_llama, make_traj, with_logprobs), cfg)
    off = batch.loss_mask == 0
    noisy = replace(batch, advantages=torch.where(off, torch.randn_like(batch.advantages) * 100, batch.advantages),
                    old_logprobs=torch.where(off, torch.randn_like(batch.old_logprobs), batch.old_logprobs))  # fmt: skip
    grads = []
    for b in (batch, noisy):
        tiny_llama.zero_grad()
        loss, _ = policy_loss(tiny_llama, b, cfg)
        loss.backward()
        grads.append(torch.cat([p.grad.flatten() for p in tiny_llama.parameters()]))
    assert torch.equal(grads[0], grads[1])


def test_non_finite_guard_skips_the_step(tiny_llama, make_traj, with_logprobs):
    cfg = AlgoConfig(advantage="rloo")
    batch, _ = prepare_batch(_episodes(tiny_llama, make_traj, with_logprobs), cfg)
    bad = replace(batch, advantages=batch.advantages * float("nan"))
    before = [p.detach().clone() for p in tiny_llama.parameters()]
    opt = torch.optim.SGD(tiny_llama.parameters(), lr=1.0)
    m = update_step(tiny_llama, opt, bad, cfg, micro_batch_size=2, max_grad_norm=1.0)
    assert m["skipped"] == 1
    assert all(torch.equal(b, p) for b, p in zip(before, tiny_llama.parameters()))


def test_reference_from_context_manager_when_not_precomputed(tiny_llama, make_traj, with_logprobs):
    cfg = AlgoConfig(advantage="group_norm", kl_coef=0.04)
    batch, _ = prepare_batch(
        _episodes(tiny_llama, make_traj, with_logprobs), AlgoConfig(advantage="group_norm")
    )
    entered = []

    @contextlib.contextmanager
    def as_reference():
        entered.append(1)
        yield

    loss, m = policy_loss(tiny_llama, batch, cfg, ref_model_ctx=as_reference)
    assert entered == [1] and m["loss/kl"] == pytest.approx(0.0, abs=1e-7)  # ref == policy here
    with pytest.raises(ValueError, match="reference"):
        policy_loss(tiny_llama, batch, cfg)
