"""Evaluation over named splits: pass@k, avg@n, maj@k, greedy accuracy and task metrics.

For every split (the in-distribution split ``id`` and each OOD split) the same problems are
played: problem ``j`` is the env seed ``seeds[j]``, and its ``n`` samples all reset with that seed,
so they face the same problem. Each episode is judged by its *last judged response* (the last turn
whose verdict is set): for single-turn and retry envs that is the final answer, for
``SolveVerify`` the last solve (S2R's outcome). A verdict with ``error`` set (verifier timeout /
crash) was not judged, and an unjudged answer is not a success: it counts as unsolved in every
rate (``greedy_acc`` included) and is reported under ``verifier_errors`` and ``error_rate``.

Per split, next to :func:`summarize_split`'s ``pass@k``, ``avg@n``, ``maj@k``:

* ``greedy_acc`` -- accuracy of one greedy (temperature 0) episode per problem (when asked);
* ``response_length/mean`` (generated tokens per episode), ``truncation_rate`` (episodes with a turn
  cut at ``max_new_tokens``), ``limit_stop_rate`` (episodes the rollout stopped at ``max_turns`` /
  ``max_context``), ``turns/mean``;
* ``format_rate`` -- the share of episodes whose last response has DeepSeek-R1-Zero's shape
  (:func:`format_rate`; training logs the same number for its rollouts);
* ``attempts/mean`` and ``attempts/level_<L>`` (by the task's difficulty ``level`` when it has one):
  model turns, or the environment's ``attempts`` episode metric when it reports one;
* ``reason/<reason>``: the share of judged responses (every turn, not only the last) with each
  verdict reason, e.g. Points24's ``reason/illegal_numbers`` (numbers that break the split's rule
  for J/Q/K: what a policy that memorised J = 10 shows on the rule-OOD split);
* the environment's own metrics, from its learner contract (``LearnerSignal.step_metrics``, averaged
  over the steps that have a value, ``episode_metrics``, averaged over episodes, and whatever its
  ``summarize`` function computes from the whole split), e.g. Points24's ``recognition_acc`` (Chu et
  al. 2025) and SolveVerify's ``verify_acc``, balanced accuracy and F1 of its verifies, and the
  ``wrong_to_right`` rate with its 95% interval (Ma et al. 2025).

Rates with no data are ``nan``. The report is plain data: ``{"splits": {name: metrics}, "gap":
{split: {metric: id - split}}, "meta": {...}}``, with ``per_problem`` and, with ``log_samples`` (a
run's ``run.log_samples``), ``samples``: per split the first problems' first episodes as text for the user
(``veriloop.algos.run.samples``); ``write_report`` (``veriloop.algos.eval.report``) saves it as JSON
(``nan`` as ``null``) and Markdown.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import veriloop.envs  # noqa: F401  (registers the environments the splits name)
from veriloop.agents.compaction import Compactor, make_compactor
from veriloop.agents.engine import EpisodeSpec, RolloutLimits, rollout
from veriloop.agents.sampling_params import SamplingParams
from veriloop.agents.trajectory import Trajectory
from veriloop.algos.eval.metrics import (
    Sample,
    avg_at_k,
    generalization_gap,
    reference_of,
    standard_error,
    summarize_split,
)
from veriloop.algos.run.samples import sample_records
from veriloop.configs.schema import ExperimentConfig
from veriloop.envs.base import split_source
from veriloop.envs.verifiers import r1_format_ok

REFERENCE_SPLIT = "id"


# ------------------------------------------------------------------------------- per episode


def final_sample(traj: Trajectory) -> Sample:
    """The episode's outcome from its last judged response (see the module docstring).

    An episode without any judged response (stopped before answering) is wrong, with no answer.
    """
    for turn in reversed(traj.turns):
        if turn.verdict is not None:  # a turn that judged no answer (an S2R verify) carries None
            return Sample.from_verdict(turn.verdict)
    return Sample(False)


def format_rate(trajs: Sequence[Trajectory]) -> float:
    """The share of episodes whose last response is shaped ``<think>...</think><answer>...</answer>``
    with nothing around it but whitespace (:func:`~veriloop.envs.verifiers.r1_format_ok`, the rule
    behind MathVerify's ``reward="r1"`` bonus and ``algo.format_reward``); 0 for no episodes. An
    episode without a response counts as unshaped."""
    shaped = sum(bool(t.turns) and r1_format_ok(t.turns[-1].text) for t in trajs)
    return shaped / max(len(trajs), 1)


def _nanmean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else math.nan


def env_metrics(trajs: Sequence[Trajectory]) -> tuple[dict[str, float], list[dict[str, float]]]:
    """The environments' own evaluation metrics (``LearnerSignal``): each step metric averaged over
    the steps with a value (``nan`` = none there), and each episode's last-step episode metrics."""
    steps: dict[str, list[float]] = {}
    for t in trajs:
        for tr in t.turns:
            for name, value in tr.signal.step_metrics.items():
                steps.setdefault(name, [])
                if not math.isnan(value):
                    steps[name].append(float(value))
    per_step = {name: _nanmean(values) for name, values in steps.items()}
    return per_step, [dict(t.turns[-1].signal.episode_metrics) if t.turns else {} for t in trajs]


def env_summary(trajs: Sequence[Trajectory]) -> dict[str, float]:
    """The split metrics an environment computes itself (``LearnerSignal.summarize``, e.g. balanced
    accuracy), from every episode's signals and problem (``group_id``); empty when no step names
    such a function."""
    for t in trajs:
        for tr in t.turns:
            if tr.signal.summarize is not None:
                episodes = [[turn.signal for turn in u.turns] for u in trajs]
                return dict(tr.signal.summarize(episodes, [u.group_id for u in trajs]))
    return {}


def task_metrics(trajs: Sequence[Trajectory]) -> dict[str, float]:
    """Length, truncation, attempts (by level) and the environments' own metrics of one split."""
    n = max(len(trajs), 1)
    out: dict[str, float] = {
        "response_length/mean": sum(t.num_generated_tokens for t in trajs) / n,
        "response_length/max": float(max((t.num_generated_tokens for t in trajs), default=0)),
        "truncation_rate": sum(any(tr.hit_token_limit for tr in t.turns) for t in trajs) / n,
        "limit_stop_rate": sum(t.stop_reason is not None for t in trajs) / n,
        "turns/mean": sum(t.num_turns for t in trajs) / n,
        "format_rate": format_rate(trajs),
    }
    per_step, episodes = env_metrics(trajs)
    out.update(per_step)
    reasons = [
        tr.verdict.reason for t in trajs for tr in t.turns if tr.verdict is not None and tr.verdict.reason
    ]
    for reason in sorted(set(reasons)):
        out[f"reason/{reason}"] = reasons.count(reason) / len(reasons)
    # an environment may count attempts its own way (e.g. solve actions only); else one per turn
    attempts = [float(e.get("attempts", t.num_turns)) for e, t in zip(episodes, trajs)]
    out["attempts/mean"] = _nanmean(attempts)
    by_level: dict[str, list[float]] = {}
    for t, a in zip(trajs, attempts):
        if t.task.get("level") is not None:
            by_level.setdefault(str(t.task["level"]), []).append(a)
    for level in sorted(by_level):
        out[f"attempts/level_{level}"] = _nanmean(by_level[level])
    names = dict.fromkeys(name for e in episodes for name in e if name != "attempts")
    for name in names:
        out[name] = _nanmean([e[name] for e in episodes if name in e])
    out.update(env_summary(trajs))
    return out


# ----------------------------------------------------------------------------------- a split


def _chunks(specs: Sequence[EpisodeSpec], size: int) -> Iterator[Sequence[EpisodeSpec]]:
    for i in range(0, len(specs), size):
        yield specs[i : i + size]


def _play(
    policy: Any,
    specs: Sequence[EpisodeSpec],
    sampling: SamplingParams,
    batch: int,
    desc: str = "eval",
    **kw: Any,
) -> list[Trajectory]:
    """Roll out ``specs`` in batches of ``batch`` episodes; batch ``b`` samples with seed ``seed + b``."""
    from veriloop.algos.run.progress import Progress

    out: list[Trajectory] = []
    bar = Progress(len(specs), desc, "episodes")  # a bar at a terminal, timed lines in a log file
    try:
        for b, chunk in enumerate(_chunks(specs, batch)):
            out += rollout(policy, chunk, sampling=sampling.with_seed(sampling.seed + b), **kw)
            bar.update(len(chunk))
    finally:
        bar.close()
    return out


def problem_ids(trajs: Sequence[Trajectory], num_problems: int) -> list[str | None]:
    """Each problem's identity from its task metadata: an ``id`` (the task's or its row's ``meta``),
    else its question (first 200 characters); None when the task says neither."""
    out: list[str | None] = [None] * num_problems
    for t in trajs:
        task: Mapping[str, Any] = t.task if isinstance(t.task, Mapping) else {}
        raw = task.get("meta")
        meta: Mapping[str, Any] = raw if isinstance(raw, Mapping) else {}
        found = task.get("id", meta.get("id", task.get("question")))
        if out[t.group_id] is None and found is not None:
            out[t.group_id] = str(found)[:200]
    return out


def _by_problem(trajs: Sequence[Trajectory], num_problems: int) -> list[list[Sample]]:
    problems: list[list[Sample]] = [[] for _ in range(num_problems)]
    for t in trajs:
        problems[t.group_id].append(final_sample(t))
    return problems


@contextmanager
def _eval_mode(policy: Any) -> Iterator[None]:
    """Dropout off while evaluating (LoRA dropout would make greedy decoding random); restored after."""
    model = getattr(policy, "model", None)
    was_training = bool(getattr(model, "training", False))
    if model is not None and was_training:
        model.eval()
    try:
        yield
    finally:
        if model is not None and was_training:
            model.train()


def evaluate_policy(
    policy: Any,
    splits: Mapping[str, Any],
    *,
    seeds: Sequence[int],
    n_samples: int,
    k_list: Sequence[int],
    temperature: float,
    greedy: bool,
    limits: RolloutLimits,
    max_new_tokens: int,
    system_prompt: str | None = None,
    assistant_prefix: str | None = None,
    batch_episodes: int = 64,
    sampling_seed: int = 0,
    reference_split: str = REFERENCE_SPLIT,
    backend: Any = None,
    compactor: Compactor | None = None,
    log_samples: int = 0,
) -> dict[str, Any]:
    """Evaluate ``policy`` on every split; see the module docstring for the metrics.

    The report's ``per_problem[split]``: each problem's ``avg@n`` (and greedy result), ``seed`` and
    ``problem`` (:func:`problem_ids`), in problem order, so two evaluations of the same problems compare pairwise (:func:`~veriloop.algos.eval.metrics.paired_difference`).

    Args:
        policy: A :class:`~veriloop.agents.policy.Policy` or a scripted policy.
        splits: ``{name: split}``, each with ``.id`` and ``.kwargs`` (``EnvConfig.resolved_eval_splits``).
        seeds: Env seeds of the problems (the same problems on every split).
        n_samples: Samples per problem (``n`` of pass@k); every k in ``k_list`` must be <= n.
        temperature: Sampling temperature of the ``n`` samples (> 0).
        greedy: Also play each problem once greedily and report ``greedy_acc``.
        limits, max_new_tokens, system_prompt, assistant_prefix, compactor: As for :func:`~veriloop.agents.engine.rollout`
            (a run evaluates with its ``rollout.compaction``, as it trains; None: a long episode is cut).
        batch_episodes: Episodes per rollout call (memory vs speed).
        sampling_seed: Seed of the first rollout batch (batch ``b`` uses ``sampling_seed + b``).
        reference_split: Split the generalization gap is measured against.
        backend: The generation backend (default: the HF engine on ``policy``); a live vLLM backend
            must already hold the policy's weights.
        log_samples: Keep this many episodes per split as text, under the report's ``samples[split]``
            (the first sample of each of the first ``log_samples`` problems;
            :func:`~veriloop.algos.run.samples.episode_record`, texts capped); 0 = no ``samples`` key.
    """
    _check_eval_args(seeds, n_samples, k_list, batch_episodes)
    sampling = SamplingParams(temperature=temperature, max_new_tokens=max_new_tokens, seed=sampling_seed)
    kw = {
        "limits": limits,
        "system_prompt": system_prompt,
        "assistant_prefix": assistant_prefix,
        "backend": backend,
        "compactor": compactor,
    }
    samples: dict[str, list[dict[str, Any]]] = {}
    t0 = time.perf_counter()
    results: dict[str, dict[str, float]] = {}
    per_problem: dict[str, dict[str, list[Any]]] = {}
    with _eval_mode(policy):
        for name, split in splits.items():
            greedy_params = SamplingParams.greedy(max_new_tokens) if greedy else None
            results[name], per_problem[name], samples[name] = _evaluate_split(
                policy,
                name,
                split,
                seeds,
                n_samples,
                list(k_list),
                sampling,
                greedy_params,
                batch_episodes,
                kw,
                log_samples,
            )
    meta = {
        "splits": _splits_meta(splits, seeds),
        "num_problems": len(seeds),
        "first_seed": int(seeds[0]),
        "last_seed": int(seeds[-1]),
        "n_samples": n_samples,
        "k_list": list(k_list),
        "temperature": temperature,
        "greedy": greedy,
        "max_new_tokens": max_new_tokens,
        "max_turns": limits.max_turns,
        "max_context": limits.max_context,
        "compactor": repr(compactor) if compactor is not None else None,
        "sampling_seed": sampling_seed,
        "reference_split": reference_split,
        "policy": getattr(policy, "name", type(policy).__name__),
        "time_s": time.perf_counter() - t0,
    }
    report = {"splits": results, "gap": report_gap(results, reference_split), "meta": meta}
    if log_samples > 0:  # for the user to read; nothing of it goes back to the policy
        report["samples"] = samples
    return {**report, "per_problem": per_problem}


def _splits_meta(splits: Mapping[str, Any], seeds: Sequence[int]) -> dict[str, dict[str, Any]]:
    """Each split's env id, kwargs and where its problems come from (a report's ``meta.splits``)."""
    return {
        name: {"id": s.id, "kwargs": dict(s.kwargs), "source": split_source(str(s.id), s.kwargs, seeds)}
        for name, s in splits.items()
    }


def _check_eval_args(
    seeds: Sequence[int], n_samples: int, k_list: Sequence[int], batch_episodes: int
) -> None:
    if not seeds or n_samples < 1 or batch_episodes < 1:
        raise ValueError(
            f"need seeds, n_samples >= 1 and batch_episodes >= 1; got {len(seeds)} seeds, "
            f"n_samples={n_samples}, batch_episodes={batch_episodes}"
        )
    bad = [k for k in k_list if not 1 <= k <= n_samples]
    if bad:
        raise ValueError(
            f"k_list values {bad} are not in [1, n_samples={n_samples}]: raise n_samples or drop them"
        )


def _evaluate_split(
    policy: Any,
    name: str,
    split: Any,
    seeds: Sequence[int],
    n_samples: int,
    k_list: list[int],
    sampling: SamplingParams,
    greedy: SamplingParams | None,
    batch_episodes: int,
    kw: dict[str, Any],
    log_samples: int,
) -> tuple[dict[str, float], dict[str, list[Any]], list[dict[str, Any]]]:
    """One split's metrics: ``n_samples`` per problem (pass@k, avg@n...), then, with ``greedy``
    (its sampling parameters), each problem once greedily (``greedy_acc``), then the task's own;
    and the per-problem accuracies (``avg@n``, ``greedy``) in problem order; and the first
    ``log_samples`` problems' first sampled episodes as records (``run.samples.sample_records``)."""
    specs = [
        EpisodeSpec(split.id, dict(split.kwargs), int(s), j)
        for j, s in enumerate(seeds)
        for _ in range(n_samples)
    ]
    trajs = _play(policy, specs, sampling, batch_episodes, f"eval {name}", **kw)
    problems = _by_problem(trajs, len(seeds))
    metrics = dict(summarize_split(problems, k_list))
    per_problem: dict[str, list[Any]] = {
        "avg@n": [avg_at_k([s.correct and s.error is None for s in p]) for p in problems],
        "seed": [int(s) for s in seeds],  # which problem: its env seed and what the task says it is
        "problem": problem_ids(trajs, len(seeds)),
    }
    if greedy is not None:
        one = [EpisodeSpec(split.id, dict(split.kwargs), int(s), j) for j, s in enumerate(seeds)]
        played = _play(policy, one, greedy, batch_episodes, f"eval {name} greedy", **kw)
        per_problem["greedy"] = [float(s.correct and s.error is None) for s in map(final_sample, played)]
        metrics["greedy_acc"] = _nanmean(per_problem["greedy"])
        metrics["se/greedy_acc"] = standard_error(per_problem["greedy"])
    metrics.update(task_metrics(trajs))
    first: dict[
        int, Trajectory
    ] = {}  # each problem's first sample, problems in order: the user sees k problems, not one
    for t in trajs:
        first.setdefault(t.group_id, t)
    return metrics, per_problem, sample_records([first[j] for j in sorted(first)], log_samples)


def report_gap(results: Mapping[str, Mapping[str, float]], reference_split: str = REFERENCE_SPLIT) -> dict:
    """:func:`generalization_gap` (rate metrics) plus ``greedy_acc``; empty without the reference split."""
    if not any(reference_of(s, results, reference_split) for s in results):
        return {}
    gap = generalization_gap(results, reference_split)
    for split, metrics in results.items():
        ref = results[r].get("greedy_acc") if (r := reference_of(split, results, reference_split)) else None
        if ref is not None and "greedy_acc" in metrics:
            gap[split]["greedy_acc"] = ref - metrics["greedy_acc"]
    return gap


def evaluate_config(
    cfg: ExperimentConfig, policy: Any, *, step: int | None = None, backend: Any = None
) -> dict[str, Any]:
    """:func:`evaluate_policy` as ``cfg`` (an ``ExperimentConfig``) describes it; ``step`` goes into meta."""
    r, e = cfg.rollout, cfg.eval
    report = evaluate_policy(
        policy,
        cfg.env.resolved_eval_splits,
        seeds=list(cfg.eval_seed_range),
        n_samples=e.n_samples,
        k_list=e.k_list,
        temperature=e.temperature,
        greedy=e.greedy,
        limits=RolloutLimits.from_rollout(r),
        max_new_tokens=r.max_new_tokens,
        system_prompt=cfg.env.system_prompt,
        assistant_prefix=cfg.env.assistant_prefix,
        batch_episodes=e.batch_episodes,
        sampling_seed=e.seed_offset,
        backend=backend,
        compactor=make_compactor(r.compaction, r.compaction_keep),
        log_samples=cfg.run.log_samples,
    )
    report["meta"]["step"] = step
    return report
