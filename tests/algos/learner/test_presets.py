"""Algorithm presets: every file loads, follows its paper, and bad names teach."""

from __future__ import annotations

import importlib.resources
import math

import pytest
import torch

from veriloop.configs.presets import config_from_mapping, list_presets, load_preset

EXPECTED = {"ppo", "grpo", "rloo", "dapo", "dr_grpo", "reinforce_pp", "s2r_outcome_rloo", "s2r_process_grpo",
            "gspo", "cispo", "sapo", "gmpo", "clip_cov", "kl_cov", "reinforce_pp_baseline", "dppo",
            "semi_opd", "s2r_process_grpo_balanced"}  # fmt: skip


def test_all_presets_ship_load_and_start_with_a_paper_comment():
    assert EXPECTED <= set(list_presets())
    folder = importlib.resources.files("veriloop.configs") / "algos"
    for name in EXPECTED:
        assert (folder / f"{name}.yaml").read_text().startswith("# ")
        assert load_preset(name).name == name


# Each preset's settings as the papers give them.
PAPER_SETTINGS = {
    # 1. PPO: GAE, critic, clip 0.2, value loss (clipped), KL to the reference in the reward
    "ppo": dict(
        advantage="gae",
        critic="value_head",
        clip_low=0.2,
        clip_high=0.2,
        kl_mode="reward",
        kl_estimator="k1",
        gamma=1.0,
        lam=0.95,
        value_clip=0.2,
        whiten_advantages=True,
    ),
    # 2. GRPO: (R - mean) / std, sample-level mean, k3 KL in the loss with beta 0.04, clip 0.2
    "grpo": dict(
        advantage="group_norm",
        loss_agg="seq_mean_token_mean",
        kl_coef=0.04,
        kl_estimator="k3",
        kl_mode="loss",
        clip_low=0.2,
        clip_high=0.2,
        critic="none",
    ),
    # 3. DAPO: clip-higher 0.2 / 0.28, dynamic sampling, token-level loss, soft overlong punishment
    #    (L_max 20480 = 16384 expected + 4096 cache), no KL
    "dapo": dict(
        advantage="group_norm",
        clip_low=0.2,
        clip_high=0.28,
        loss_agg="token_mean",
        kl_coef=0.0,
        dynamic_sampling=True,
        overlong_penalty=True,
        overlong_max_len=20480,
        overlong_cache_len=4096,
    ),
    # 4. Dr. GRPO: R - mean (no std), per-sequence token sum over a constant, no KL
    "dr_grpo": dict(
        advantage="group_mean", loss_agg="seq_sum_constant", kl_coef=0.0, clip_low=0.2, clip_high=0.2
    ),
    # 5. RLOO: leave-one-out baseline, no critic
    "rloo": dict(advantage="rloo", critic="none", kl_coef=0.0),
    # 6. REINFORCE++: batch-normalised advantage, per-token KL penalty in the reward, no critic
    "reinforce_pp": dict(
        advantage="batch_norm", kl_mode="reward", kl_estimator="k1", kl_coef=0.01, critic="none"
    ),
    # 7. S2R outcome-level RLOO on the final answer; process-level GRPO over comparable actions
    "s2r_outcome_rloo": dict(advantage="rloo", reward_level="outcome", critic="none"),
    "s2r_process_grpo": dict(
        advantage="process", process_baseline="position_kind", critic="none", loss_agg="seq_mean_token_mean"
    ),
    # 11. since DAPO: GSPO's narrow sequence clip, per sequence (the episode)
    "gspo": dict(
        policy_loss="gspo",
        advantage="group_norm",
        clip_low=3e-4,
        clip_high=4e-4,
        loss_agg="seq_mean_token_mean",
        sequence_unit="episode",
        kl_coef=0.0,
    ),
    # CISPO: no lower bound on the IS weight, clip-higher above, token-level loss
    "cispo": dict(policy_loss="cispo", clip_low=1.0, clip_high=0.28, loss_agg="token_mean", kl_coef=0.0),
    # SAPO: tau 1.0 for positive, 1.05 for negative advantages
    "sapo": dict(policy_loss="sapo", sapo_tau_pos=1.0, sapo_tau_neg=1.05, advantage="group_norm"),
    # GMPO: geometric mean, log-space clip (e^-0.4, e^0.4)
    "gmpo": dict(policy_loss="gmpo", clip_low=0.4, clip_high=0.4, loss_agg="seq_mean_token_mean"),
    # Clip-Cov r = 2e-4 in [1, 5], clip low = high = 1 and dynamic sampling as the authors' recipes;
    # KL-Cov k = 0.2%, beta 1
    "clip_cov": dict(
        policy_loss="clip_cov",
        cov_ratio=2e-4,
        cov_lb=1.0,
        cov_ub=5.0,
        clip_low=1.0,
        clip_high=1.0,
        dynamic_sampling=True,
    ),
    "kl_cov": dict(policy_loss="kl_cov", cov_ratio=2e-3, cov_kl_coef=1.0),
    # REINFORCE++-baseline: group mean subtracted, then whitened over the batch's tokens
    "reinforce_pp_baseline": dict(
        advantage="group_mean_batch_norm", kl_mode="reward", kl_coef=0.01, kl_estimator="k1", critic="none"
    ),
    # DPPO: ratio against mu, binary TV mask 0.2 / 0.2, tau 1e-3 (prime-rl's defaults), token mean
    "dppo": dict(
        policy_loss="dppo",
        dppo_divergence="tv",
        dppo_low=0.2,
        dppo_high=0.2,
        dppo_tau=1e-3,
        loss_agg="token_mean",
        kl_coef=0.0,
        rollout_is="none",
        rollout_seq_mask=False,
    ),
    # Semi-OPD: opsd's self-distillation alone, sampled by the frozen initial student, the weight bounded
    "semi_opd": dict(
        distill_coef=1.0,
        distill_teacher="privileged",
        rl_coef=0.0,
        sampler_weights="initial",
        distill_ratio_cap=2.0,
        distill_trust_low=0.2,
        distill_tau=1e-3,
        kl_coef=0.0,
        epochs=1,
    ),
}


def test_semi_opd_is_opsd_but_for_the_sampler_and_the_bounded_weight():
    """The two presets differ in the sampler and in the three bounds on pi_theta / mu, which on-policy
    (one update per batch: the weight ~1) never act; the knob refuses what needs on-policy samples."""
    import dataclasses

    semi, opsd = dataclasses.asdict(load_preset("semi_opd")), dataclasses.asdict(load_preset("opsd"))
    differ = {k for k in semi if semi[k] != opsd[k]}
    assert differ == {"name", "sampler_weights", "distill_ratio_cap", "distill_trust_low", "distill_tau"}
    assert load_preset("semi_opd").frozen_sampler and not load_preset("opsd").frozen_sampler
    with pytest.raises(ValueError, match="rl_coef=0"):
        load_preset("semi_opd", rl_coef=0.5)
    with pytest.raises(ValueError, match="rl_coef=0"):
        load_preset("grpo", sampler_weights="initial")  # no distillation term: nothing but stale RL
    with pytest.raises(ValueError, match="rollout_is=none"):
        load_preset("semi_opd", rollout_is="mask")
    with pytest.raises(ValueError, match="sampler_weights must be"):
        load_preset("semi_opd", sampler_weights="frozen")
    with pytest.raises(ValueError, match="distill_ratio_cap"):
        load_preset("semi_opd", distill_ratio_cap=0.0)


def test_the_balanced_s2r_preset_is_process_grpo_but_for_the_verify_reward():
    import dataclasses

    bal, plain = (
        dataclasses.asdict(load_preset("s2r_process_grpo_balanced")),
        dataclasses.asdict(load_preset("s2r_process_grpo")),
    )
    assert {k for k in bal if bal[k] != plain[k]} == {"name", "balance_reward_classes"}
    assert bal["balance_reward_classes"] and not plain["balance_reward_classes"]
    with pytest.raises(ValueError, match="use advantage=process"):
        load_preset("s2r_outcome_rloo", balance_reward_classes=True)  # episode rewards: nothing to weigh


@pytest.mark.parametrize("name", sorted(PAPER_SETTINGS))
def test_presets_follow_the_papers(name):
    cfg = load_preset(name)
    got = {k: getattr(cfg, k) for k in PAPER_SETTINGS[name]}
    assert got == PAPER_SETTINGS[name]
    assert cfg.needs_critic == (name == "ppo")  # only PPO learns a value function
    assert cfg.needs_reference == (name in ("ppo", "grpo", "reinforce_pp", "reinforce_pp_baseline"))
    assert cfg.dual_clip is None and cfg.entropy_coef == 0.0  # opt-in extras, off in every paper preset


def test_dapo_soft_punishment_starts_at_the_expected_length():
    from veriloop.algos.maths.shaping import overlong_penalty

    dapo = load_preset("dapo")
    lengths = torch.tensor([16384, 18432, 20480, 20481])  # expected max, mid-cache, L_max, beyond
    pen = overlong_penalty(lengths, max_len=dapo.overlong_max_len, cache_len=dapo.overlong_cache_len)
    assert pen.tolist() == [0.0, -0.5, -1.0, -1.0]


def test_unknown_names_and_keys_suggest_the_closest():
    with pytest.raises(ValueError, match="Did you mean .dapo."):
        load_preset("dapoo")
    with pytest.raises(ValueError, match="Did you mean 'clip_high'"):
        config_from_mapping({"clip_hihg": 0.3})
    assert load_preset("dapo", overlong_max_len=512, overlong_cache_len=128).overlong_max_len == 512
    with pytest.raises(ValueError, match="overlong_cache_len"):
        load_preset("dapo", overlong_max_len=64, overlong_cache_len=128)


# ------------------------------------------------------------- the new presets train 2 steps
NEW = ["gspo", "cispo", "sapo", "gmpo", "clip_cov", "kl_cov", "reinforce_pp_baseline", "grpo+tis", "dppo"]
FAST = [
    "policy.model=tiny",
    "env.id=veriloop/MathVerify-v0",
    "env.kwargs={level: 1}",
    "rollout.prompts_per_step=2",
    "rollout.group_size=2",
    "rollout.max_new_tokens=8",
    "rollout.max_context=256",
    "train.steps=2",
    "train.micro_batch_size=2",
    "train.lr=1e-2",
    "eval.num_problems=1",
    "eval.n_samples=1",
    "eval.k_list=[1]",
    "eval.greedy=false",
    "eval.every=0",
    "run.tensorboard=false",
    "run.checkpoint_every=1",
    "algo.epochs=2",
]


@pytest.mark.parametrize("preset", NEW)
def test_new_presets_train_two_steps(tmp_path, preset, monkeypatch) -> None:
    """As tests/algos/loop/test_train.py does for the older presets (a deterministic coin as the
    verifier so that advantages are non-zero); two epochs so that ratios move off 1."""
    import veriloop.algos.eval.in_training as in_training
    import veriloop.algos.loop.train as T
    import veriloop.algos.run.setup as S
    from veriloop.algos.run.log import read_metrics
    from veriloop.configs.loader import load_config
    from veriloop.envs.math_env import MathVerifyEnv
    from veriloop.envs.verifiers import Verdict

    monkeypatch.setattr(
        MathVerifyEnv, "check", lambda self, r, task: Verdict(correct=len(r) % 2 == 0, reason="coin")
    )
    monkeypatch.setattr(in_training, "evaluate_step", lambda *a, **kw: {})
    torch.set_num_threads(1)
    name, _, tis = preset.partition("+")
    extra = ["algo.rollout_is=truncate", "algo.rollout_seq_mask=true"] if tis else []
    cfg = load_config(
        None, [*FAST, f"run.algo_preset={name}", f"run.out_dir={tmp_path}", f"run.name={name}", *extra]
    )
    run_dir = T.train(cfg, quiet=True)
    rows = [r for r in read_metrics(run_dir) if r["step"] > 0]
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["updates"] == 2 and math.isfinite(r["grad_norm"]) and r["skipped"] == 0 for r in rows)
    if tis:  # the correction's share of tokens and sequences, and the mismatch, are logged
        assert all(
            {"rollout_corr/token_frac", "rollout_corr/seq_frac", "mismatch/k3_kl"} <= set(r) for r in rows
        )
    if name == "dppo":  # its ratio is against the recorded mu; the mismatch is measured in the update
        assert all(r["mismatch/tokens"] > 0 and 0 <= r["clip_frac_high"] <= 1 for r in rows)
    if name in ("clip_cov", "kl_cov"):  # KL-Cov always acts on >= 1 token; Clip-Cov only in its window
        assert all(r["cov_frac"] > 0 if name == "kl_cov" else r["cov_frac"] >= 0 for r in rows)
    step = max((run_dir / "checkpoints").glob("step-*"))
    after = torch.load(step / "model" / "model.pt", weights_only=True)
    torch.manual_seed(cfg.rollout.seed)
    policy = S.build_policy(cfg)
    before = S.trainable_state(policy, None)
    assert any(not torch.equal(before[k], after[k]) for k in before), preset
