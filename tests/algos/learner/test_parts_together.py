"""The second algorithm audit: how the parts combine (metrics, top-p, micro-batches, turns,
aggregation, IS weights, REINFORCE++-baseline corners, extreme ratios), each pinned by a test."""

from __future__ import annotations

import copy
import itertools
import json
import math
from pathlib import Path

import pytest
import torch

from veriloop.agents.forward import token_logprobs
from veriloop.algos.learner.algorithm import ObjectiveExtras, resolve
from veriloop.algos.learner.batch import TokenBatch, collate
from veriloop.algos.learner.credit import compute_advantages
from veriloop.algos.learner.prepare import prepare_batch
from veriloop.algos.learner.step_settings import UpdateSettings
from veriloop.algos.learner.update import policy_loss, update_step
from veriloop.algos.maths import advantages as A
from veriloop.algos.maths import losses as L
from veriloop.algos.maths.mismatch import mismatch_stats
from veriloop.configs.algo import AlgoConfig
from veriloop.configs.loader import load_config
from veriloop.configs.schema import ConfigError

PACKAGE = Path(__file__).resolve().parents[3]  # the repository root: envs/ agents/ algos/ ...


def _recorded(model, make_traj, with_logprobs, shift=lambda i, lp: lp):
    """Two groups of two episodes (rewards +1 / -1), sampling log-probs from ``model`` itself,
    then moved by ``shift(row, logprobs)``: the sampler mu against the trainer's pi_old."""
    trajs = [
        make_traj([(toks, [], r)], group_id=g)
        for g, pair in enumerate((((10, 11, 12), (20, 21, 22, 23)), ((40, 41), (50, 51, 52))))
        for toks, r in zip(pair, (1.0, -1.0))
    ]
    batch = collate(trajs, [[0.0] * len(t.token_ids) for t in trajs])
    with torch.no_grad():
        lp, _ = token_logprobs(model, batch.input_ids, batch.attention_mask)
    return [with_logprobs(t, shift(i, lp[i, : len(t.token_ids)])) for i, t in enumerate(trajs)]


# ------------------------------------------------------------------ 1. one source per mismatch key


def test_mismatch_and_correction_keys_are_written_in_one_module_each():
    """Each logged ``mismatch/*`` key is spelled (computed) in one module, and so is each
    ``rollout_corr/*`` key: no second formula can overwrite the first."""
    from veriloop.algos.maths.mismatch import NAMES

    sources = [
        p
        for d in ("agents", "algos", "configs", "cli", "envs", "interop")
        for p in (PACKAGE / d).rglob("*.py")
    ]
    corr = ("rollout_corr/token_frac", "rollout_corr/seq_frac", "rollout_corr/seq_masked_frac")
    for key in (*NAMES, *corr):
        where = sorted(p.name for p in sources if f'"{key}"' in p.read_text())
        assert len(where) == 1, (key, where)


def test_k3_kl_is_the_kl_of_the_sampler_against_the_trainer():
    """mu = [.5, .5], pi_old = [.9, .1], 50 draws of each token: KL(mu || pi_old) = 0.511."""
    mu = torch.log(torch.tensor([0.5] * 100, dtype=torch.float64)).unsqueeze(0)
    pi = torch.log(torch.tensor([0.9] * 50 + [0.1] * 50, dtype=torch.float64)).unsqueeze(0)
    kl = 0.5 * math.log(0.5 / 0.9) + 0.5 * math.log(0.5 / 0.1)
    assert mismatch_stats(pi, mu, torch.ones(1, 100)).metrics()["mismatch/k3_kl"] == pytest.approx(
        kl, rel=1e-9
    )
    assert kl == pytest.approx(0.5108, abs=1e-4)


def test_rollout_correction_logs_the_same_k3_formula_over_every_sampled_token(
    tiny_llama, make_traj, with_logprobs
):
    """With the correction on, ``mismatch/k3_kl`` is the mean of r - 1 - log r, r = pi_old / mu,
    over every sampled token (those the mask then drops included), not exp(-d) - 1 + d."""
    offsets = torch.tensor([0.7, -0.7, 0.3, -1.2])
    trajs = _recorded(tiny_llama, make_traj, with_logprobs, shift=lambda i, lp: lp + offsets[i])
    cfg = AlgoConfig(advantage="rloo", rollout_is="mask", rollout_is_low=0.6, rollout_is_high=1.6)
    batch, metrics = prepare_batch(trajs, resolve(cfg), model=tiny_llama)
    lengths = torch.tensor([3.0, 4.0, 2.0, 3.0])
    d = -offsets.double()  # log pi_old - log mu on every token of the row
    want = float(((d.exp() - 1 - d) * lengths).sum() / lengths.sum())
    assert metrics["mismatch/k3_kl"] == pytest.approx(want, rel=1e-5)
    assert metrics["mismatch/tokens"] == 12.0  # dropped tokens included
    assert batch.loss_mask.sum() < 12  # ... while the mask did drop some


def test_metric_parts_that_share_a_key_are_an_error():
    from veriloop.algos.learner.train_batch import merge_metrics

    assert merge_metrics({"a": 1.0}, {"b": None}) == {"a": 1.0, "b": None}
    with pytest.raises(ValueError, match="mismatch/k3_kl"):
        merge_metrics({"mismatch/k3_kl": 0.5}, {"mismatch/k3_kl": 1.3})


# ------------------------------------------------------------------------------- 2. top-p / top-k

TINY = ["policy.model=tiny", "rollout.prompts_per_step=2", "rollout.group_size=2", "rollout.max_new_tokens=6",
        "rollout.max_context=512", "train.steps=1", "train.micro_batch_size=2", "eval.num_problems=1",
        "eval.n_samples=1", "eval.k_list=[1]", "eval.greedy=false", "eval.every=0", "eval.before_sft=false",
        "eval.at_start=false", "run.tensorboard=false", "sft.steps=0", "algo.preset=grpo"]  # fmt: skip


@pytest.mark.parametrize("sampling", ["rollout.top_p=0.9", "rollout.top_k=20"])
@pytest.mark.parametrize(
    "uses_mu", ["algo.rollout_is=truncate", "algo.rollout_seq_mask=true", "algo.preset=dppo"]
)
def test_truncated_sampling_with_a_comparison_to_mu_is_refused(sampling, uses_mu):
    with pytest.raises(ConfigError, match="top_p=1.0 rollout.top_k=0"):
        load_config("quickstart", [*TINY, sampling, uses_mu])
    load_config("quickstart", [*TINY, sampling])  # without the correction: fine


def test_prepare_batch_refuses_filtered_log_probs_as_mu(tiny_llama, make_traj, with_logprobs):
    trajs = _recorded(tiny_llama, make_traj, with_logprobs)
    with pytest.raises(ValueError, match="filtered"):
        prepare_batch(
            trajs,
            resolve(AlgoConfig(advantage="rloo", rollout_is="truncate")),
            model=tiny_llama,
            recompute_old_logprobs=True,
        )


def test_under_top_p_the_mismatch_is_logged_as_not_measured(tmp_path):
    """The trainer cannot reproduce the filtered distribution: a number would be the trainer
    against itself (0 whatever the sampler does). Logged as null instead."""
    import veriloop.algos.loop.train as T

    run = T.train(
        load_config("quickstart", [*TINY, "rollout.top_p=0.8", f"run.out_dir={tmp_path}", "run.name=p"]),
        quiet=True,
    )
    row = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()][-1]
    assert (
        row["mismatch/k3_kl"] is None and row["mismatch/ratio_max"] is None and row["mismatch/tokens"] is None
    )


# ------------------------------------------------------- 4. Clip-Cov / KL-Cov and micro-batching


@pytest.mark.parametrize("loss", ["clip_cov", "kl_cov"])
def test_cov_tokens_are_chosen_once_per_mini_batch(loss, tiny_llama, make_traj, with_logprobs):
    """The accumulated gradient with micro-batches of 1 equals the whole batch's (before: the
    covariance was centred and the share taken per micro-batch, 4x the tokens here)."""
    trajs = _recorded(tiny_llama, make_traj, with_logprobs)
    cfg = AlgoConfig(
        advantage="group_norm",
        policy_loss=loss,
        cov_ratio=0.25,
        cov_lb=0.0,
        cov_ub=100.0,
        loss_agg="token_mean",
    )
    batch, _ = prepare_batch(trajs, resolve(cfg))
    grads, fracs = [], []
    for mbs in (4, 1):
        model = copy.deepcopy(tiny_llama)
        opt = torch.optim.SGD(model.parameters(), lr=1.0)
        before = [p.detach().clone() for p in model.parameters()]
        torch.manual_seed(0)  # Clip-Cov draws its tokens at random
        m = update_step(
            model, opt, batch, resolve(cfg), UpdateSettings(micro_batch_size=mbs, max_grad_norm=1e9)
        )
        grads.append(torch.cat([(b - p.detach()).flatten() for b, p in zip(before, model.parameters())]))
        fracs.append(m["cov_frac"])
    assert fracs[0] == pytest.approx(fracs[1]) and 0 < fracs[0] <= 0.25
    assert torch.allclose(grads[0], grads[1], atol=1e-7), float((grads[0] - grads[1]).abs().max())


def test_cov_selection_functions_by_hand():
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0]])
    lp = torch.tensor([[-1.0, -3.0, -1.0, -3.0]])  # Cov = (A - 0)(lp + 2) = [1, -1, -1, 1]
    mask = torch.ones(1, 4)
    assert L.token_covariance(adv, lp, mask).tolist() == [[1.0, -1.0, -1.0, 1.0]]
    top = L.kl_cov_select(adv, lp, mask, cov_ratio=0.5)
    assert top.tolist() == [[True, False, False, True]]
    pick = L.clip_cov_select(adv, lp, mask, cov_ratio=0.25, cov_lb=0.5, cov_ub=2.0)
    assert int(pick.sum()) == 1 and bool((pick & top).any())  # one token, from the window


# ----------------------------------------------------- 5. / 6. sequence units and aggregation


def _two_turns(model):
    """One episode, turn 0 one sampled token (advantage 1), turn 1 nine (advantage 0), an
    environment token between; old log-probs are the model's own (every ratio is 1)."""
    ids = torch.tensor([[1, 2, 3, 10, 30, 11, 12, 13, 14, 15, 16, 17, 18, 19]])
    mask = torch.tensor([[0.0, 0, 0, 1, 0] + [1.0] * 9])
    turn = torch.tensor([[-1, -1, -1, 0, 0] + [1] * 9])
    with torch.no_grad():
        lp, _ = token_logprobs(model, ids, torch.ones_like(ids))
    adv = torch.tensor([[0.0, 0, 0, 1, 0] + [0.0] * 9])
    return TokenBatch(ids, torch.ones_like(ids), mask, (lp * mask).float(), turn, adv)


@pytest.mark.parametrize("loss", ["gspo", "gspo_token", "gmpo"])
def test_turn_sequences_weigh_the_same_whatever_their_length(loss, tiny_llama):
    """Losses [-1, 0] for turns of 1 and 9 tokens: the mean over the two sequences is -0.5 (the
    per-row token mean gave -0.1)."""
    cfg = AlgoConfig(policy_loss=loss, sequence_unit="turn", reward_level="turn")
    loss_value, _ = policy_loss(tiny_llama, _two_turns(tiny_llama), resolve(cfg))
    assert float(loss_value) == pytest.approx(-0.5, abs=1e-5)


def test_aggregate_with_segments_by_hand():
    per_token = torch.tensor([[1.0, 0.0, 0.0, 3.0, 3.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0, 1.0, 1.0]])
    seg = torch.tensor([[0, 0, 0, 1, 1]])
    assert float(L.aggregate(per_token, mask, "seq_mean_token_mean", segments=seg)) == pytest.approx(
        (0.5 + 3) / 2
    )
    assert float(L.aggregate(per_token, mask, "seq_sum_constant", 4.0, segments=seg)) == pytest.approx(
        7 / 4 / 2
    )
    assert float(L.aggregate(per_token, mask, "seq_mean_token_mean")) == pytest.approx(7 / 4)  # one row
    assert L.sequence_count(mask, seg) == 2 and L.sequence_count(mask) == 1


@pytest.mark.parametrize("loss", ["gspo", "gspo_token", "gmpo"])
@pytest.mark.parametrize("agg", ["token_mean", "seq_sum_constant"])
def test_sequence_level_objectives_refuse_length_weighted_aggregation(loss, agg):
    with pytest.raises(ValueError, match="loss_agg=seq_mean_token_mean"):
        AlgoConfig(policy_loss=loss, loss_agg=agg).validate()


# --------------------------------------------------------- 7. IS weights on sequence-level losses


@pytest.mark.parametrize("loss", ["gspo", "gspo_token"])
def test_gspo_is_weights_reach_each_token_as_in_verl(loss):
    """w = [2, 0], A = 1, ratio 1, one sequence of 2 tokens: gradients [-1, 0] (each token by its
    own weight), not the mean weight's [-0.5, -0.5]."""
    lp = torch.zeros(1, 2, requires_grad=True)
    mask, adv = torch.ones(1, 2), torch.ones(1, 2)
    obj = resolve(AlgoConfig(policy_loss=loss)).objective
    per_token, _ = obj(
        lp, torch.zeros(1, 2), adv, mask, None, ObjectiveExtras(is_weights=torch.tensor([[2.0, 0.0]]))
    )
    value = L.aggregate(per_token, mask, "seq_mean_token_mean")
    value.backward()
    assert float(value) == pytest.approx(-1.0)  # (2 * -1 + 0 * -1) / 2
    assert lp.grad.tolist() == [[pytest.approx(-1.0), pytest.approx(0.0)]]


def test_gmpo_weighs_a_sequence_by_the_geometric_mean_of_its_weights():
    """w = [4, 1]: W = sqrt(4 * 1) = 2 (the arithmetic mean would be 2.5); A = 1, ratios 1."""
    lp = torch.zeros(1, 2, requires_grad=True)
    mask, adv = torch.ones(1, 2), torch.ones(1, 2)
    obj = resolve(AlgoConfig(policy_loss="gmpo")).objective
    per_token, _ = obj(
        lp, torch.zeros(1, 2), adv, mask, None, ObjectiveExtras(is_weights=torch.tensor([[4.0, 1.0]]))
    )
    value = L.aggregate(per_token, mask, "seq_mean_token_mean")
    value.backward()
    assert float(value) == pytest.approx(-2.0)
    assert lp.grad.tolist() == [[pytest.approx(-1.0), pytest.approx(-1.0)]]  # -A W / |y| each


# -------------------------------------------------------------- 8. REINFORCE++-baseline corners


def test_reinforce_pp_baseline_a_lone_episode_starts_from_zero(make_traj):
    """Stated choice: an episode alone in its group has raw return 0 before whitening (verl keeps
    its raw score, 5 here, which would make it the batch's best by far)."""
    trajs = [
        make_traj([([10, 11], [], 1.0)], group_id=0),
        make_traj([([12, 13], [], 0.0)], group_id=0),
        make_traj([([14, 15], [], 5.0)], group_id=1),
    ]
    adv = compute_advantages(trajs, resolve(AlgoConfig(advantage="group_mean_batch_norm"))).advantages
    raw = torch.tensor([0.5, 0.5, -0.5, -0.5, 0.0, 0.0], dtype=torch.float64)
    std = float(raw.pow(2).mean().sqrt())  # mean 0, population std over the 6 tokens
    got = adv[adv != 0].tolist()
    assert got == pytest.approx((raw[:4] / (std + 1e-6)).tolist(), rel=1e-5)
    assert adv[2].abs().sum() == 0  # the lone episode's tokens


def test_reinforce_pp_baseline_adds_the_kl_to_go_after_the_group_mean(make_traj):
    """Stated choice: equal rewards centre to 0 and each token keeps its own KL to go, -beta
    sum_{s >= t} (log pi_old - log pi_ref); verl folds the KL into the score before centring."""
    trajs = [make_traj([([10, 11], [], 1.0)], group_id=0), make_traj([([12, 13], [], 1.0)], group_id=0)]
    ref = torch.tensor([[0, 0, 0, -1.5, -1.0], [0, 0, 0, -1.0, -3.0]])  # old log-probs are -1 (fixture)
    mask = torch.tensor([[0, 0, 0, 1.0, 1.0]] * 2)
    cfg = AlgoConfig(advantage="group_mean_batch_norm", kl_mode="reward", kl_coef=0.1, kl_estimator="k1")
    adv = compute_advantages(trajs, resolve(cfg), ref_logprobs=ref * mask).advantages
    # k1 = -1 - ref: [0.5, 0.0] and [0.0, 2.0]; to go: [0.5, 0.0], [2.0, 2.0]; times -0.1
    raw = torch.tensor([-0.05, 0.0, -0.2, -0.2], dtype=torch.float64)
    want = (raw - raw.mean()) / (raw.std(unbiased=False) + 1e-6)
    assert adv[mask.bool()].tolist() == pytest.approx(want.tolist(), rel=1e-5)


# ------------------------------------------------------------------------ 9. extreme log-ratios


@pytest.mark.parametrize(
    "loss", ["ppo_clip", "gspo", "gspo_token", "sapo", "gmpo", "cispo", "kl_cov", "dppo"]
)
def test_a_log_ratio_past_float32_exp_range_stays_finite(loss):
    """log pi_theta - log pi_old = 100 on every token (float32's exp overflows past 88): before the
    clamp, PPO, GSPO, GMPO and KL-Cov gave an inf loss and SAPO a NaN gradient."""
    lp = torch.full((1, 3), 100.0, requires_grad=True)
    adv = torch.tensor([[-1.0, -1.0, -1.0]])
    obj = resolve(AlgoConfig(policy_loss=loss)).objective
    extras = ObjectiveExtras(sampler_logprobs=torch.zeros(1, 3))
    per_token, _ = obj(lp, torch.zeros(1, 3), adv, torch.ones(1, 3), None, extras)
    L.aggregate(per_token, torch.ones(1, 3), "seq_mean_token_mean").backward()
    assert torch.isfinite(per_token).all() and torch.isfinite(lp.grad).all()
    assert L.MAX_LOG_RATIO == 20.0  # verl's clamp


# ------------------------------------------------- the per-turn baseline when episodes end apart


def test_turn_level_baseline_is_unbiased_when_episodes_end_at_different_turns():
    """Exact expectation over every outcome of a group of 3 two-turn episodes: turn 0 succeeds
    (reward 1, the episode ends) with p = sigmoid(a); else turn 1 succeeds with q = sigmoid(b).
    J = p + (1 - p) q. The estimator (1/G) sum_i sum_k A_{i,k} grad log pi(a_{i,k}) with
    ``turn_level``'s leave-one-out baseline (only episodes that reached turn k) must average to
    grad J exactly; the per-turn group mean with the episode itself in it does not (it scales each
    turn's term by 1 - E[1 / #episodes that reached the turn], which differs between turns)."""
    p, q = 0.3, 0.6
    grad_j = torch.tensor([p * (1 - p) * (1 - q), (1 - p) * q * (1 - q)], dtype=torch.float64)
    # outcome -> (turn rewards, turn mask, probability, per-turn score vectors d log pi / d(a, b))
    outcomes = {
        "S": ([1.0, 0.0], [1.0, 0.0], p, [[1 - p, 0.0], [0.0, 0.0]]),
        "FS": ([0.0, 1.0], [1.0, 1.0], (1 - p) * q, [[-p, 0.0], [0.0, 1 - q]]),
        "FF": ([0.0, 0.0], [1.0, 1.0], (1 - p) * (1 - q), [[-p, 0.0], [0.0, -q]]),
    }

    def expected(with_self: bool) -> torch.Tensor:
        total = torch.zeros(2, dtype=torch.float64)
        for combo in itertools.product(outcomes, repeat=3):
            r = torch.tensor([outcomes[c][0] for c in combo], dtype=torch.float64)
            m = torch.tensor([outcomes[c][1] for c in combo], dtype=torch.float64)
            adv = A.turn_level(r, m, torch.zeros(3, dtype=torch.long), gamma=1.0)
            if with_self:
                g = A.turn_returns(r, m, gamma=1.0)
                adv = (g - (g * m).sum(0) / m.sum(0).clamp(min=1)) * m
            prob = math.prod(outcomes[c][2] for c in combo)
            score = torch.tensor([outcomes[c][3] for c in combo], dtype=torch.float64)  # [G, K, 2]
            total += prob * (adv.unsqueeze(-1) * score).sum((0, 1)) / 3
        return total

    assert torch.allclose(expected(False), grad_j, atol=1e-12)
    biased = expected(True)
    assert not torch.allclose(
        biased / biased.norm(), grad_j / grad_j.norm(), atol=1e-3
    )  # not even its direction
