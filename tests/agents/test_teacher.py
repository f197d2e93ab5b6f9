"""The distillation teacher: privileged context from the env, the teacher's view, aligned log-probs."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

import veriloop.envs  # noqa: F401  (registers veriloop/...)
from veriloop.agents.chat import ChatFormat
from veriloop.agents.engine import EpisodeSpec, rollout
from veriloop.agents.forward import token_logprobs
from veriloop.agents.sampling_params import SamplingParams
from veriloop.agents.scripted import ScriptedPolicy
from veriloop.agents.teacher import PRIVILEGED_HEADER, privileged_text, teacher_episode, teacher_logprobs

SYSTEM = "You are a careful solver."


@pytest.fixture(scope="module")
def tokenizer():
    from veriloop.agents.testing import tiny_tokenizer

    return tiny_tokenizer()


def _episodes(tokenizer, env_id="veriloop/MathVerify-v0", kwargs=None, seeds=(0, 1)):
    script = ScriptedPolicy(lambda turn, obs, task: f"\\boxed{{{7 + turn}}}", tokenizer)
    specs = [EpisodeSpec(env_id, kwargs or {}, s) for s in seeds]
    return rollout(script, specs, sampling=SamplingParams(), system_prompt=SYSTEM)


def test_privileged_text_is_the_gold_and_never_in_the_student_context(tokenizer):
    for tr in _episodes(tokenizer):
        hint = privileged_text(tr)
        assert str(tr.task["answer"]) in hint
        student = tokenizer.decode(tr.token_ids)
        assert hint not in student and PRIVILEGED_HEADER.strip() not in student
    (p24,) = _episodes(tokenizer, "veriloop/Points24-text-v0", {"solvable_only": True}, seeds=(3,))
    assert p24.task["solution"] and p24.task["solution"] in privileged_text(p24)


def test_teacher_episode_swaps_only_the_prompt(tokenizer):
    fmt = ChatFormat(tokenizer, system_prompt=SYSTEM)
    (tr,) = _episodes(tokenizer, seeds=(0,))
    view, shift = teacher_episode(tr, fmt, "The answer is 5.")
    p = tr.turn_index.index(0)
    assert shift > 0 and view.token_ids[p + shift :] == tr.token_ids[p:]
    assert view.loss_mask[p + shift :] == tr.loss_mask[p:] and sum(view.loss_mask) == sum(tr.loss_mask)
    text = tokenizer.decode(view.token_ids[: p + shift])
    assert "The answer is 5." in text and SYSTEM in text and tr.messages[1]["content"] in text
    assert teacher_episode(tr, fmt, None) == (tr, 0)
    # the episode's own messages (system prompt included) are re-rendered, whatever fmt's system prompt
    assert teacher_episode(tr, ChatFormat(tokenizer), "The answer is 5.") == (view, shift)
    with pytest.raises(ValueError, match="re-render"):
        teacher_episode(replace(tr, messages=[{"role": "user", "content": "another task"}]), fmt, "x")


def test_teacher_logprobs_line_up_with_the_student_tokens(tiny_text_policy):
    tok, model = tiny_text_policy.tokenizer, tiny_text_policy.model
    fmt = ChatFormat(tok, system_prompt=SYSTEM)
    trajs = _episodes(tok)
    # the same context: the teacher's numbers are the model's own on the student's sequence
    same = teacher_logprobs(model, trajs, fmt, privileged=False)
    for tr, lp in zip(trajs, same):
        ids = torch.tensor([tr.token_ids])
        with torch.no_grad():
            own, _ = token_logprobs(model, ids, torch.ones_like(ids))
        want = [float(own[0, i]) if m else 0.0 for i, m in enumerate(tr.loss_mask)]
        assert lp == pytest.approx(want, abs=1e-5)
    # privileged: each sampled token scored after the privileged prompt, moved back to its position
    priv = teacher_logprobs(model, trajs, fmt, privileged=True)
    for tr, lp in zip(trajs, priv):
        view, shift = teacher_episode(tr, fmt, privileged_text(tr))
        ids = torch.tensor([view.token_ids])
        with torch.no_grad():
            own, _ = token_logprobs(model, ids, torch.ones_like(ids))
        sampled = [i for i, m in enumerate(tr.loss_mask) if m]
        assert [lp[i] for i in sampled] == pytest.approx(
            [float(own[0, i + shift]) for i in sampled], abs=1e-5
        )
        assert lp != same[trajs.index(tr)]  # the context changed the numbers
    # in passes of any size (rows by length, each pass padded to its own longest): the same numbers
    for size in (1, 2, len(trajs)):
        for got, want in zip(teacher_logprobs(model, trajs, fmt, privileged=True, micro_batch=size), priv):
            assert got == pytest.approx(want, abs=1e-5)
    with pytest.raises(ValueError, match="micro_batch"):
        teacher_logprobs(model, trajs, fmt, privileged=True, micro_batch=0)


def test_a_groups_shared_teacher_prompt_is_run_once_per_pass(tiny_text_policy, monkeypatch):
    import veriloop.agents.teacher as teacher

    tok, model = tiny_text_policy.tokenizer, tiny_text_policy.model
    fmt = ChatFormat(tok, system_prompt=SYSTEM)
    trajs = _episodes(tok, seeds=(1, 0, 1, 0))  # two groups of two, interleaved
    alone = teacher_logprobs(model, trajs, fmt, privileged=True, micro_batch=1)
    shared: list[int] = []
    real = teacher.token_logprobs

    def spy(*args, **kwargs):
        shared.append(kwargs["shared_prefix"])
        return real(*args, **kwargs)

    monkeypatch.setattr(teacher, "token_logprobs", spy)
    paired = teacher_logprobs(model, trajs, fmt, privileged=True, micro_batch=2)
    # each pass holds one group (by prompt first), whose privileged prompt runs once: the same numbers
    prompt = teacher_episode(trajs[1], fmt, privileged_text(trajs[1]))[0].loss_mask.index(1)
    assert len(shared) == 2 and all(8 <= n <= prompt for n in shared)
    for got, want in zip(paired, alone):
        assert got == pytest.approx(want, abs=1e-5)


def test_an_env_without_privileged_context_is_refused(tokenizer):
    (tr,) = _episodes(tokenizer, "veriloop/ReasoningGym-v0", {}, seeds=(0,))
    with pytest.raises(ValueError, match="privileged_context"):
        privileged_text(tr)


def test_a_separate_teacher_model_scores_the_student_context(tiny_text_policy, tmp_path):
    from veriloop.agents.loading import save_policy
    from veriloop.agents.teacher import score_with_teacher
    from veriloop.agents.testing import tiny_policy

    teacher = tiny_policy(seed=1)  # other weights, the same vocabulary
    save_policy(teacher, tmp_path / "teacher")
    trajs = _episodes(tiny_text_policy.tokenizer)
    got = score_with_teacher(
        tiny_text_policy, trajs, teacher="model", teacher_model=str(tmp_path / "teacher"), temperature=1.0
    )
    want = teacher_logprobs(teacher.model, trajs, ChatFormat(teacher.tokenizer), privileged=False)
    for g, w in zip(got, want):
        assert g == pytest.approx(w, abs=1e-5)
    own = score_with_teacher(
        tiny_text_policy, trajs, teacher="privileged", teacher_model=None, temperature=1.0
    )
    assert own != got  # the policy with privileged context is another teacher
