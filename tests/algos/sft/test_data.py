"""SFT data builders: every demonstration verifies in its env; S2R masks exactly the wrong solves."""

from __future__ import annotations

import json

import gymnasium as gym
import numpy as np
import pytest

from veriloop.algos.sft.data import (
    SFTDataError,
    SFTExample,
    demonstration_examples,
    load_examples,
    rejection_examples,
    save_examples,
)


def s2r_traces(task, seeds, *, rng, p_wrong_first, env_kwargs=None):  # type: ignore[no-untyped-def]
    """SolveVerify's own S2R traces (its ``demonstration_episode``) through the generic builder."""
    kwargs = {"task": task, **(env_kwargs or {})}
    return demonstration_examples(
        "veriloop/SolveVerify-v0", kwargs, seeds, rng=rng, p_wrong_first=p_wrong_first
    )


def _replay(env_id, kwargs, example):
    """Step the env with the example's assistant turns; check every user turn is the env's text."""
    env = gym.make(env_id, **kwargs)
    obs, _ = env.reset(seed=example.meta["seed"])
    msgs = list(example.messages)
    assert msgs[0] == {"role": "user", "content": obs}
    infos = []
    for m in msgs[1:]:
        if m["role"] == "assistant":
            obs, _, term, trunc, info = env.step(m["content"])
            infos.append(info)
        else:
            assert m["content"] == obs and not (term or trunc)
    return infos, term


@pytest.mark.parametrize("env_id", ["veriloop/Points24-text-v0", "veriloop/Points24-text-ruleood-v0"])
def test_points24_solver_examples_all_verify(env_id):
    examples = demonstration_examples(env_id, {}, range(25))
    assert len(examples) == 25
    for ex in examples:
        infos, terminated = _replay(env_id, {}, ex)
        assert infos[0]["verdict"].correct and terminated
        assert infos[0]["recognition"] == 1.0  # the JSON "cards" names the dealt ranks
        answer = json.loads(ex.messages[1]["content"])
        assert set(answer) == {"cards", "formula"} and ex.trainable == (True,)


@pytest.mark.parametrize("reward", ["dapo", "r1"])
def test_math_generator_examples_verify(reward):
    examples = demonstration_examples("veriloop/MathVerify-v0", {"reward": reward}, range(20))
    for ex in examples:
        infos, _ = _replay("veriloop/MathVerify-v0", {"reward": reward}, ex)
        assert infos[0]["verdict"].correct
        if reward == "r1":
            assert infos[0]["reward_components"]["format"] > 0  # the <think>/<answer> shape is kept
        assert "\\boxed{" in ex.messages[1]["content"]


@pytest.mark.parametrize("task", ["math", "points24"])
def test_s2r_traces_replay_and_flags(task):
    traces = s2r_traces(task, range(12), rng=np.random.default_rng(0), p_wrong_first=0.6)
    wrong_counts = [t.meta["wrong_attempts"] for t in traces]
    assert min(wrong_counts) == 0 and max(wrong_counts) >= 1  # both easy and hard traces
    for ex in traces:
        infos, terminated = _replay("veriloop/SolveVerify-v0", {"task": task}, ex)
        assert terminated and infos[-1]["stats"]["final_correct"]
        kinds = [i["action_kind"] for i in infos]
        k = ex.meta["wrong_attempts"]
        assert kinds == ["solve", "verify"] * (k + 1)
        solves = [i["solve_correct"] for i in infos if i["action_kind"] == "solve"]
        assert solves == [False] * k + [True]
        # trainable: every verify, and only the right solve
        expected = [kind == "verify" or bool(i["solve_correct"]) for kind, i in zip(kinds, infos)]
        assert list(ex.trainable) == expected
        assert all(i["verify_matches_truth"] for i in infos if i["action_kind"] == "verify")


def test_s2r_loss_mask_covers_exactly_the_wrong_solves(tiny_text_policy):
    from veriloop.algos.sft.loss import build_sft_example

    tok = tiny_text_policy.tokenizer
    traces = s2r_traces("math", range(8), rng=np.random.default_rng(1), p_wrong_first=1.0)
    ex = max(traces, key=lambda t: t.meta["wrong_attempts"])
    ids, mask = build_sft_example(tok, list(ex.messages), list(ex.trainable))
    trained = tok.decode([i for i, m in zip(ids, mask) if m])
    masked = tok.decode([i for i, m in zip(ids, mask) if not m])
    answers = [m["content"] for m in ex.messages if m["role"] == "assistant"]
    wrong, right = answers[0:-2:2], answers[-2]
    assert len(wrong) == ex.meta["wrong_attempts"] >= 1
    for w in wrong:
        assert w not in trained and w in masked
    assert right in trained
    assert trained.count("<verify>incorrect</verify>") == len(wrong)
    assert trained.count("<verify>correct</verify>") == 1
    assert "Now verify" not in trained and "Solve again" not in trained  # env turns never trained


def test_s2r_rejects_bad_probability_and_single_attempt():
    with pytest.raises(ValueError, match="probability"):
        s2r_traces("math", [0], rng=np.random.default_rng(0), p_wrong_first=1.5)
    with pytest.raises(ValueError, match="max_attempts >= 2"):
        s2r_traces(
            "math", [0], rng=np.random.default_rng(0), p_wrong_first=0.5, env_kwargs={"max_attempts": 1}
        )


def test_rejection_keeps_only_verified_episodes(tiny_text_policy):
    from veriloop.agents.sampling_params import SamplingParams
    from veriloop.agents.scripted import ScriptedPolicy

    solver = gym.make("veriloop/Points24-text-v0").unwrapped

    def points24_response(task):  # type: ignore[no-untyped-def]
        return solver.demonstration(solver.task_from_options(task))

    def reply(turn, obs, task):
        if task["values"][0] % 2 == 0:  # odd hands: never right
            return '{"cards": [], "formula": "1+1"}'
        return points24_response(task) if turn >= 1 else '{"formula": "1+2"}'  # wrong, then right

    policy = ScriptedPolicy(reply, tiny_text_policy.tokenizer)
    env_kwargs = {"max_attempts": 2}
    out = rejection_examples(
        policy, "veriloop/Points24-text-v0", env_kwargs, range(10), samples=2, sampling=SamplingParams()
    )
    env = gym.make("veriloop/Points24-text-v0", **env_kwargs)
    odd = [s for s in range(10) if env.reset(seed=s)[1]["task"]["values"][0] % 2 == 1]
    assert 0 < len(odd) < 10
    assert sorted({ex.meta["seed"] for ex in out}) == odd and len(out) == 2 * len(odd)
    for ex in out:
        assert ex.trainable == (False, True) and ex.meta["sampled"] == 20
        infos, terminated = _replay("veriloop/Points24-text-v0", env_kwargs, ex)
        assert terminated and infos[-1]["verdict"].correct and not infos[0]["verdict"].correct


def test_jsonl_round_trip(tmp_path):
    examples = demonstration_examples("veriloop/Points24-text-v0", {}, range(3))
    examples += s2r_traces("points24", range(2), rng=np.random.default_rng(0), p_wrong_first=1.0)
    path = save_examples(tmp_path / "sft.jsonl", examples)
    assert load_examples(path) == examples


@pytest.mark.parametrize(
    ("line", "reason"),
    [
        ("{not json", "invalid JSON"),
        ('{"messages": []}', "'messages' and 'trainable'"),
        (
            '{"messages": [{"role": "user", "content": "q"}], "trainable": [true]}',
            "1 flags but 'messages' has 0",
        ),
        ('{"messages": [{"role": "bot", "content": "q"}], "trainable": []}', "role must be one of"),
        ('{"messages": [{"role": "assistant", "content": "a"}], "trainable": ["yes"]}', "list of booleans"),
        ('{"messages": [{"role": "assistant", "content": "a"}], "trainable": [false]}', "teach nothing"),
    ],
)
def test_jsonl_malformed_row_names_file_and_line(tmp_path, line, reason):
    good = json.dumps(
        {
            "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}],
            "trainable": [True],
        }
    )
    path = tmp_path / "bad.jsonl"
    path.write_text(f"{good}\n\n{line}\n")
    with pytest.raises(SFTDataError, match=f"bad.jsonl:3: .*{reason}"):
        load_examples(path)


def test_example_validation_in_memory():
    with pytest.raises(SFTDataError, match="2 flags"):
        SFTExample(({"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}), (True, True))
    with pytest.raises(SFTDataError, match="text observations"):
        demonstration_examples("veriloop/Points24-vision-v0", {}, [0])
