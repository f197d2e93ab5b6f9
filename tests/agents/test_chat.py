"""Chat-template deltas, scripted policies and re-tokenization drift (SmolLM2 ChatML template)."""

from __future__ import annotations

import pytest
import torch

import veriloop.envs  # noqa: F401  (registers veriloop/...)
from veriloop.agents.chat import ChatFormat, observation_message
from veriloop.agents.drift import drift_rate, mismatch_rate
from veriloop.agents.engine import EpisodeSpec, grouped_specs, rollout
from veriloop.agents.sampling_params import SamplingParams
from veriloop.agents.scripted import ScriptedPolicy


@pytest.fixture(scope="module")
def tokenizer():
    from veriloop.agents.testing import tiny_tokenizer

    return tiny_tokenizer()


def test_delta_closes_the_assistant_turn_only_where_the_sample_did_not(tokenizer):
    fmt = ChatFormat(tokenizer)
    conv = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    new = {"role": "user", "content": "again"}
    tail = "<|im_start|>user\nagain<|im_end|>\n<|im_start|>assistant\n"
    assert fmt.assistant_close == "<|im_end|>\n"
    assert fmt.delta_text(conv, new, ended_with_eos=True) == "\n" + tail
    assert fmt.delta_text(conv, new, ended_with_eos=False) == "<|im_end|>\n" + tail  # hit the token limit
    # prompt + sampled ids + delta == the template's own tokenization of the whole conversation
    prompt = fmt.prompt_ids(conv[:1])
    sampled = fmt.encode("yo") + [tokenizer.eos_token_id]
    full = fmt.encode(fmt.render([*conv, new], add_generation_prompt=True))
    assert prompt + sampled + fmt.delta_ids(conv, new, True) == full


def test_system_prompt_and_observation_messages(tokenizer):
    fmt = ChatFormat(tokenizer, system_prompt="Be brief.")
    msgs = fmt.first_messages(observation_message("Q?")[0])
    assert (
        fmt.prompt_text(msgs)
        == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nQ?<|im_end|>\n<|im_start|>assistant\n"
    )
    msg, image = observation_message({"text": "look", "image": torch.zeros(2, 2, 3)})
    assert msg["content"][0] == {"type": "image"} and image is not None
    with pytest.raises(TypeError, match="str or a dict"):
        observation_message(3)


REPLIES = {
    0: "Let me think.\n\nThe cards are A, 8, 5 and 4 ♠♣.",
    1: ' {"cards": ["A", "8"], "formula": "(1+5)*(8-4)"}',
    2: "\\boxed{42}  trailing spaces   ",
    3: "done",
}


@pytest.mark.parametrize(
    ("env_id", "kwargs"),
    [("veriloop/Points24-text-v0", {"max_attempts": 4}), ("veriloop/MathVerifyRetry-v0", {})],
)
def test_drift_is_zero_for_scripted_text(tokenizer, env_id, kwargs):
    script = ScriptedPolicy(REPLIES, tokenizer)
    specs = [EpisodeSpec(env_id, kwargs, seed) for seed in range(3)]
    for system in (None, "You are a careful solver."):
        trajs = rollout(script, specs, sampling=SamplingParams(), system_prompt=system)
        assert all(t.num_turns >= 2 for t in trajs)
        assert [drift_rate(tokenizer, t) for t in trajs] == [0.0] * len(trajs)


def test_scripted_policy_tokens_masks_and_calls(tokenizer):
    script = ScriptedPolicy(lambda turn, obs, task: f"try {turn}", tokenizer)
    specs = grouped_specs("veriloop/Points24-text-v0", {"max_attempts": 3}, [0, 1], 2)
    trajs = rollout(script, specs, sampling=SamplingParams())
    assert script.calls == [4, 4, 4]
    for tr in trajs:
        for t in tr.turns:
            assert tr.token_ids[t.start : t.end] == tokenizer("try " + str(t.index))["input_ids"] + [
                tokenizer.eos_token_id
            ]
            assert set(tr.loss_mask[t.start : t.end]) == {1} and set(tr.logprobs[t.start : t.end]) == {0.0}
        assert sum(tr.loss_mask) == sum(t.end - t.start for t in tr.turns)
    with pytest.raises(KeyError, match="covers turns"):
        ScriptedPolicy({0: "a"}, tokenizer).reply(1, "obs", {})


def test_drift_detects_a_non_canonical_tokenization(tokenizer):
    script = ScriptedPolicy({0: "Hello world"}, tokenizer)
    (tr,) = rollout(script, [EpisodeSpec("veriloop/MathVerify-v0", {}, 0)], sampling=SamplingParams())
    turn = tr.turns[0]
    split = [tokenizer.convert_tokens_to_ids(c) for c in ["H", "e", "l", "l", "o"]]
    assert None not in split and tokenizer.unk_token_id not in split
    ids = (
        tr.token_ids[: turn.start] + split + tr.token_ids[turn.start + 1 :]
    )  # "Hello" spelled letter by letter
    from dataclasses import replace

    drifted = replace(tr, token_ids=ids)
    assert tokenizer.decode(ids) == tokenizer.decode(tr.token_ids)  # same text ...
    assert drift_rate(tokenizer, drifted) > 0  # ... different tokens
    assert mismatch_rate([1, 2, 3], [1, 5, 3, 4]) == pytest.approx(2 / 4)


def _default_model_tokenizer():
    """The tokenizer ``load_policy("default")`` uses: the converted checkpoint's, else the same
    conversion's tokenizer-only cache entry (CI machines may not have converted the weights)."""
    from transformers import AutoTokenizer

    from veriloop.agents.models.text import (
        DEFAULT_MODEL_NAME,
        cache_root,
        is_complete,
        load_default_tokenizer,
        normalize_tokenizer,
    )

    folder = cache_root() / "models" / DEFAULT_MODEL_NAME
    if is_complete(folder):
        return normalize_tokenizer(AutoTokenizer.from_pretrained(folder))
    return load_default_tokenizer()


TEXT_ENVS = [
    ("veriloop/MathVerify-v0", {}),
    ("veriloop/MathVerifyRetry-v0", {"max_attempts": 3}),
    ("veriloop/Points24-text-v0", {"max_attempts": 3}),
    ("veriloop/Points24-text-ruleood-v0", {"max_attempts": 3}),
    ("veriloop/SolveVerify-v0", {"max_attempts": 2}),
    ("veriloop/SolveVerify-v0", {"task": "points24", "max_attempts": 2}),
]


def test_drift_is_zero_for_the_default_models_template_on_every_text_env():
    tokenizer = _default_model_tokenizer()
    replies = [REPLIES[0], REPLIES[1], REPLIES[2], "Verdict: the answer is wrong.\n", "I give up"]
    script = ScriptedPolicy(lambda turn, obs, task: replies[turn % len(replies)], tokenizer)
    for env_id, kwargs in TEXT_ENVS:
        trajs = rollout(
            script, [EpisodeSpec(env_id, kwargs, seed) for seed in range(2)], sampling=SamplingParams()
        )
        assert max(t.num_turns for t in trajs) >= (1 if env_id.endswith("MathVerify-v0") else 2), env_id
        assert [drift_rate(tokenizer, t) for t in trajs] == [0.0, 0.0], env_id
