"""The SFT warm-up loop: it learns, micro-batching keeps the loss, resume is exact, nothing is silent."""

from __future__ import annotations

import json

import pytest
import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from veriloop.algos.sft.data import SFTExample, demonstration_examples
from veriloop.algos.sft.train import (
    SFTSettings,
    batch_indices,
    tokenise,
    train_sft,
    warmup_from_config,
)


def _short(n: int) -> list[SFTExample]:
    """Short chats (a few dozen tokens) so loop-mechanics tests stay fast."""
    return [
        SFTExample(
            ({"role": "user", "content": f"Add {i} and 3."}, {"role": "assistant", "content": f"{i + 3}"}),
            (True,),
            {"seed": i},
        )
        for i in range(n)
    ]


def _weights(policy) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in policy.model.named_parameters() if p.requires_grad}


def test_sft_on_points24_solver_examples_lowers_the_loss(tiny_text_policy):
    examples = demonstration_examples("veriloop/Points24-text-v0", {}, range(2))
    out = train_sft(tiny_text_policy, examples, steps=10, lr=1e-2, batch_size=1, log_every=100)
    assert out["skipped_nonfinite"] == 0 and out["truncated"] == 0
    # a random model starts near log(vocab) ~ 10.8 nats per token
    assert out["loss_first"] > 9.0
    assert max(out["losses"][-2:]) < 0.5 * out["loss_first"], out["losses"]
    assert not tiny_text_policy.model.training  # the caller's train/eval mode is restored


def test_batch_indices_cover_each_epoch_once():
    n, b = 7, 3
    stream = [i for s in range(7) for i in batch_indices(n, b, s, seed=5)]  # 21 = 3 epochs
    for e in range(3):
        assert sorted(stream[e * n : (e + 1) * n]) == list(range(n))
    assert batch_indices(n, b, 4, seed=5) == batch_indices(n, b, 4, seed=5)
    assert stream[:n] != [i for s in range(3) for i in batch_indices(n, b, s, seed=6)][:n]


def _grads_after_one_step(micro):
    from veriloop.agents.testing import tiny_policy

    policy = tiny_policy(seed=3)
    captured = {}
    examples = _short(3) + [
        SFTExample(
            (
                {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "A much longer answer here."},
            ),
            (True,),
        )
    ]

    def grab(_opt, _args, _kwargs):
        captured.update({n: p.grad.clone() for n, p in policy.model.named_parameters() if p.grad is not None})

    # lr tiny: we compare gradients, captured just before the (first) optimizer step
    handle = register_optimizer_step_pre_hook(grab)
    try:
        out = train_sft(policy, examples, steps=1, lr=1e-9, batch_size=4, micro_batch_size=micro)
    finally:
        handle.remove()
    return out["losses"][0], captured


def test_micro_batches_give_the_same_token_mean_loss_and_gradient():
    loss_full, g_full = _grads_after_one_step(None)
    loss_micro, g_micro = _grads_after_one_step(1)
    assert loss_micro == pytest.approx(loss_full, rel=1e-5)
    for name, g in g_full.items():
        torch.testing.assert_close(g_micro[name], g, rtol=1e-4, atol=1e-6)


def test_each_sft_batch_is_collated_once(monkeypatch):
    """One ``collate_tokens`` per step (RL's padding); micro-batches are row slices of it."""
    import veriloop.algos.sft.train as sft_train
    from veriloop.agents.testing import tiny_policy

    calls = []
    real = sft_train.collate_tokens
    monkeypatch.setattr(
        sft_train, "collate_tokens", lambda *a, **kw: calls.append(len(a[0])) or real(*a, **kw)
    )
    train_sft(tiny_policy(seed=3), _short(4), steps=2, lr=1e-3, batch_size=4, micro_batch_size=1)
    assert calls == [4, 4]  # two steps, each its four examples at once


def test_truncation_and_empty_examples_are_counted(tiny_text_policy):
    tok = tiny_text_policy.tokenizer
    examples = _short(2) + demonstration_examples("veriloop/Points24-text-v0", {}, range(1))
    short_len = max(len(tokenise(tok, [ex], 10_000).ids[0]) for ex in examples[:2])
    data = tokenise(tok, examples, short_len)
    assert (data.truncated, data.dropped_empty, len(data.ids)) == (1, 1, 2)  # the long prompt left no target
    with pytest.raises(ValueError, match="no SFT example has a trainable token"):
        tokenise(tok, examples, 5)


def test_nonfinite_step_is_skipped_and_counted():
    from veriloop.agents.testing import tiny_policy

    policy = tiny_policy(seed=1)
    calls = {"n": 0}

    def poison_first(_module, _inputs, output):
        calls["n"] += 1
        if calls["n"] == 1:
            output.logits = output.logits * float("nan")
        return output

    before = _weights(policy)
    handle = policy.model.register_forward_hook(poison_first)
    out = train_sft(policy, _short(2), steps=1, lr=1e-2, batch_size=2)
    assert out["skipped_nonfinite"] == 1 and out["loss_first"] is None
    for name, w in _weights(policy).items():
        assert torch.equal(w, before[name])  # the poisoned step changed nothing
    out = train_sft(policy, _short(2), steps=2, lr=1e-2, batch_size=2)
    handle.remove()
    assert out["skipped_nonfinite"] == 0
    assert any(not torch.equal(w, before[n]) for n, w in _weights(policy).items())


def _poison_from(policy, first_call: int):  # type: ignore[no-untyped-def]
    """Make every forward pass from the ``first_call``-th on return NaN logits; returns the handle."""
    calls = {"n": 0}

    def poison(_module, _inputs, output):  # type: ignore[no-untyped-def]
        calls["n"] += 1
        if calls["n"] >= first_call:
            output.logits = output.logits * float("nan")
        return output

    return policy.model.register_forward_hook(poison)


def test_sft_stops_after_max_consecutive_nonfinite_steps_like_rl(tmp_path):
    """The RL loop's guard and limit: the 2nd bad step in a row stops SFT, nothing non-finite is saved."""
    from veriloop.agents.testing import tiny_policy
    from veriloop.algos.run.checkpoint import latest_checkpoint
    from veriloop.algos.run.log import read_metrics
    from veriloop.algos.run.nonfinite import NonFiniteTrainingError

    policy = tiny_policy(seed=1)
    handle = _poison_from(policy, first_call=2)  # step 0 is finite, steps 1.. are NaN (one forward each)
    kw = {"lr": 1e-2, "batch_size": 2, "log_every": 1, "tensorboard": False, "checkpoint_every": 1}
    with pytest.raises(NonFiniteTrainingError, match="sft warm-up: 2 consecutive steps.*lower lr"):
        train_sft(policy, _short(2), steps=10, run_dir=tmp_path, max_consecutive_nonfinite=2, **kw)
    handle.remove()
    rows = read_metrics(tmp_path)
    assert [r["sft/skipped_nonfinite"] for r in rows] == [0, 1]  # the 2nd bad step raised before its row
    assert latest_checkpoint(tmp_path).name == "step-000002"  # after one good and one skipped step

    lenient = tiny_policy(seed=1)  # the same bad steps under a larger limit: skipped, counted, not fatal
    handle = _poison_from(lenient, first_call=2)
    out = train_sft(lenient, _short(2), steps=3, max_consecutive_nonfinite=3, lr=1e-2, batch_size=2)
    handle.remove()
    assert out["skipped_nonfinite"] == 2 and out["loss_first"] is not None


def test_sft_limit_is_train_max_consecutive_nonfinite(tmp_path):
    """``warmup_from_config`` takes the limit from ``train.max_consecutive_nonfinite`` (one setting)."""
    from veriloop.agents.testing import tiny_policy
    from veriloop.algos.run.nonfinite import NonFiniteTrainingError
    from veriloop.configs.env import EnvConfig
    from veriloop.configs.schema import ExperimentConfig, RunConfig, SFTConfig, TrainConfig

    assert SFTSettings(steps=1).max_consecutive_nonfinite == TrainConfig().max_consecutive_nonfinite
    cfg = ExperimentConfig(
        env=EnvConfig(id="veriloop/Points24-text-v0"),
        sft=SFTConfig(source="solver", steps=5, lr=1e-2, examples=2),
        train=TrainConfig(max_consecutive_nonfinite=1),
        run=RunConfig(tensorboard=False, checkpoint_every=0),
    )
    policy = tiny_policy(seed=1)
    handle = _poison_from(policy, first_call=1)
    with pytest.raises(NonFiniteTrainingError, match="1 consecutive steps"):  # the first bad step
        warmup_from_config(cfg, policy, run_dir=None)
    handle.remove()


def test_resumed_sft_keeps_the_guard_counts(tmp_path):
    """A checkpoint holds the skipped-step counts; the resumed run continues them, as RL's does."""
    from veriloop.agents.testing import tiny_policy
    from veriloop.algos.run.nonfinite import NonFiniteTrainingError

    kw = {
        "lr": 1e-2,
        "batch_size": 2,
        "tensorboard": False,
        "checkpoint_every": 1,
        "max_consecutive_nonfinite": 2,
    }
    torch.manual_seed(2)
    policy = tiny_policy(lora=True, seed=2)
    handle = _poison_from(policy, first_call=2)
    train_sft(policy, _short(2), steps=2, run_dir=tmp_path, **kw)  # step 1 skipped: 1 in a row
    handle.remove()
    handle = _poison_from(policy, first_call=1)
    with pytest.raises(
        NonFiniteTrainingError, match="2 consecutive steps"
    ):  # one more bad step makes 2 in a row
        train_sft(policy, _short(2), steps=3, run_dir=tmp_path, **kw)
    handle.remove()


def test_checkpoint_resume_matches_an_uninterrupted_run(tmp_path):
    from veriloop.agents.testing import tiny_policy
    from veriloop.algos.run.checkpoint import latest_checkpoint
    from veriloop.algos.run.log import read_metrics

    kw = {
        "lr": 1e-2,
        "batch_size": 2,
        "warmup": 2,
        "log_every": 1,
        "tensorboard": False,
        "checkpoint_every": 2,
    }

    def fresh():  # tiny_policy's seed covers the base weights, not the LoRA init: seed that too
        torch.manual_seed(2)
        return tiny_policy(lora=True, seed=2)

    straight = fresh()
    train_sft(straight, _short(3), steps=3, run_dir=tmp_path / "a", **kw)

    first = fresh()
    train_sft(first, _short(3), steps=2, run_dir=tmp_path / "b", **kw)
    assert latest_checkpoint(tmp_path / "b").name == "step-000002"
    torch.manual_seed(99)  # other LoRA weights: everything must come from the checkpoint
    resumed = tiny_policy(lora=True, seed=2)
    out = train_sft(resumed, _short(3), steps=3, run_dir=tmp_path / "b", **kw)
    assert out["start_step"] == 2 and len(out["losses"]) == 1
    for name, w in _weights(straight).items():
        torch.testing.assert_close(_weights(resumed)[name], w)
    rows = read_metrics(tmp_path / "b")
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert {"loss/sft", "sft/grad_norm", "perf/tokens_per_s", "sft/truncated"} <= set(rows[-1])
    final = tmp_path / "b" / "final"
    assert json.loads((final / "veriloop.json").read_text())["kind"] == "lora-adapter"
    with pytest.raises(ValueError, match="different SFT data"):
        train_sft(tiny_policy(lora=True, seed=2), _short(4), steps=5, run_dir=tmp_path / "b", **kw)
    # a setting that shapes the trajectory is refused changed (steps and logging may change)
    with pytest.raises(ValueError, match=r"other SFT settings \(lr: 0.01 -> 0.02; warmup: 2 -> 0\)"):
        train_sft(
            tiny_policy(lora=True, seed=2),
            _short(3),
            steps=5,
            run_dir=tmp_path / "b",
            **{**kw, "lr": 2e-2, "warmup": 0, "log_every": 5},
        )


def test_settings_validation_lists_every_problem():
    with pytest.raises(ValueError, match="batch_size=0.*micro_batch_size=5"):
        SFTSettings(steps=1, batch_size=0, micro_batch_size=5)
    with pytest.raises(ValueError, match=r"settings: lr=0.0 \(need > 0\)$"):  # only the bad one is named
        SFTSettings(steps=1, lr=0.0)


def test_warmup_from_config_trains_on_the_configured_source(tmp_path):
    from veriloop.agents.testing import tiny_policy
    from veriloop.configs.env import EnvConfig
    from veriloop.configs.schema import ExperimentConfig, RunConfig, SFTConfig

    cfg = ExperimentConfig(
        env=EnvConfig(id="veriloop/Points24-text-v0", system_prompt="Be exact."),
        sft=SFTConfig(source="solver", steps=3, lr=1e-2, examples=2, epochs=1),
        run=RunConfig(tensorboard=False, checkpoint_every=0),
    )
    out = warmup_from_config(cfg, tiny_policy(), run_dir=tmp_path / "sft")
    assert out["examples"] == 2 and out["steps_done"] == 1  # epochs=1: 2 examples, batch 2 -> 1 step
    assert "losses" not in out and (tmp_path / "sft" / "final" / "veriloop.json").is_file()


def test_build_examples_errors_point_to_the_right_source():
    from veriloop.algos.sft.data import build_examples

    with pytest.raises(ValueError, match="did you mean 'solver'"):
        build_examples("solvr", "veriloop/Points24-text-v0", {}, [0])
    with pytest.raises(ValueError, match="work for this env: 'generator', 'rejection'"):
        build_examples("solver", "veriloop/MathVerify-v0", {}, [0])
    with pytest.raises(ValueError, match="SolveVerify-v0"):
        build_examples("s2r", "veriloop/MathVerify-v0", {}, [0])
    chats = build_examples("s2r", "veriloop/SolveVerify-v0", {"task": "points24"}, [0, 1], system_prompt="S")
    assert all(ex.messages[0] == {"role": "system", "content": "S"} for ex in chats)


def test_sft_steps_run_as_asked_unless_an_epochs_cap_is_set_and_said(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from veriloop.algos.sft.train import sft_total_steps
    from veriloop.configs.schema import ConfigError, SFTConfig

    assert SFTConfig().epochs is None  # sft.steps alone decides by default
    assert sft_total_steps(20, None, 16, 8) == 20 and capsys.readouterr().err == ""
    assert sft_total_steps(20, 1, 16, 8) == 2  # one pass over 16 examples in batches of 8
    assert "running 2 of sft.steps=20 steps" in capsys.readouterr().err
    assert sft_total_steps(20, 3, 17, 8) == 7  # ceil(3 x 17 / 8)
    assert sft_total_steps(5, 3, 17, 8) == 5 and capsys.readouterr().err.count("running") == 1
    with pytest.raises(ConfigError, match="sft.epochs must be >= 1 or null"):
        SFTConfig(epochs=0).validate()


def test_the_warm_ups_settings_are_derived_from_the_experiment_config():
    """One mapping from ``ExperimentConfig`` to the loop's settings (``SFTSettings.from_config``);
    a standalone ``train_sft`` keeps its own defaults, the config's where they are the same setting."""
    from veriloop.algos.sft.train import SFT_BATCH_SIZE
    from veriloop.configs.loader import load_config

    cfg = load_config(
        None,
        [
            "sft.steps=40",
            "sft.lr=3e-5",
            "train.log_every=7",
            "train.micro_batch_size=2",
            "run.checkpoint_every=5",
            "rollout.max_context=512",
            "rollout.seed=11",
        ],
    )
    s = SFTSettings.from_config(cfg, num_examples=100)
    assert (s.steps, s.lr, s.log_every, s.micro_batch_size, s.checkpoint_every) == (40, 3e-5, 7, 2, 5)
    assert (s.batch_size, s.max_len, s.seed, s.warmup) == (SFT_BATCH_SIZE, 512, 11, 2)
    assert SFTSettings.from_config(cfg, num_examples=3).batch_size == 3  # fewer examples than a batch
    assert SFTSettings(steps=1).max_grad_norm == cfg.train.max_grad_norm and SFTSettings(steps=1).lr == 2e-5
    with pytest.raises(TypeError, match="stepz"):
        train_sft(None, [], stepz=1)
