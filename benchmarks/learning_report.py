"""The learning benchmark's report: tables and plots made from the collected runs.

``bench_learning.py`` runs the arms and collects each run's evaluations and training curves into
``runs[label][seed]``; this module turns them into the summary tables of
``benchmarks/results/learning_<suite>.json`` and its plots. Nothing here trains or reads a run folder.
"""

from __future__ import annotations

import statistics
from pathlib import Path

from veriloop.algos.eval.metrics import paired_difference

#: The ablation's rows, in order: each adds one of DAPO's parts to the row above.
ABLATION = ["grpo", "clip_higher", "token_level", "overlong", "dapo"]
#: The losses suite's arms, in table order.
LOSS_ARMS = ["grpo_hf", "grpo", "grpo_tis", "dapo", "gspo", "cispo"]


#: math_gain's arms at grpo_p16_v2's setting and warm-up (the same start, held-out set and steps).
PER_SAMPLE_ARMS = ("grpo_p16_v2", "grpo_p16_gate", "opsd_p16", "opsd_gate_p16", "semi_opd_p16", "opsd_p16_v2")


def arm_differences(
    runs: dict[str, dict[int, dict]], reference: str = "grpo", split: str = "id"
) -> list[dict]:
    """Each arm against ``reference`` at the end: per seed, the difference in held-out avg@n paired by
    problem (its SE is the evaluation's noise only); over seeds, the mean difference, its sd (which
    also holds the training's own noise: two seeds of one arm differ by more than their evaluations'
    SE) and ``se_over_seeds = sd / sqrt(seeds)``, the SE a ranking has to beat."""
    rows = []
    ref = runs.get(reference, {})
    for label, by_seed in runs.items():
        if label == reference:
            continue
        per_seed = {}
        for seed, r in sorted(by_seed.items()):
            mine = r.get("end_per_problem", {}).get(split)
            theirs = ref.get(seed, {}).get("end_per_problem", {}).get(split)
            if mine and theirs and len(mine) == len(theirs):
                per_seed[seed] = paired_difference(theirs, mine)
        if not per_seed:
            continue
        diffs = [d["diff"] for d in per_seed.values()]
        sd = statistics.stdev(diffs) if len(diffs) > 1 else None
        rows.append(
            {
                "arm": label,
                "reference": reference,
                "seeds": sorted(per_seed),
                "diff (per seed)": diffs,
                "se_eval (per seed)": [d["se"] for d in per_seed.values()],
                "z_eval (per seed)": [d["z"] for d in per_seed.values()],
                "diff mean": statistics.fmean(diffs),
                "diff sd over seeds": sd,
                "se_over_seeds": sd / len(diffs) ** 0.5 if sd is not None else None,
            }
        )
    return rows


def part_effects(runs: dict[str, dict[int, dict]], rows: list[str] = ABLATION) -> list[dict]:
    """Each ablation row against the row above it (the effect of the one part it adds: clip-higher is
    ``clip_higher - grpo``, the token-level loss ``token_level - clip_higher``), paired as in
    :func:`arm_differences`; rows without runs are skipped (the comparison is then with the nearest
    row above that has some)."""
    present = [label for label in rows if label in runs]
    out = []
    for before, after in zip(present, present[1:]):
        out += arm_differences({before: runs[before], after: runs[after]}, reference=before)
    return out


def matched_table(runs: dict[str, dict[int, dict]], start_arm: str, splits: list[str]) -> dict[str, dict]:
    """SFT only against SFT then RL from one warm-up (the paper's design: "SFT memorizes, RL
    generalizes"). Per split, every arm's end against the start (``start_arm``'s step 0, the
    warm-up all arms of a seed start from), and each RL arm's end against ``sft_only``'s, paired by
    problem as in :func:`arm_differences` (per seed, then mean, sd and SE over seeds); and each other
    RL arm's end against ``start_arm``'s (``vs_start_arm``: VIter 1 and 5 against VIter 3)."""
    start = {
        seed: {"end_per_problem": r.get("start_per_problem", {})}
        for seed, r in runs.get(start_arm, {}).items()
    }
    with_start = {"start": start, **runs}
    rl = {label: by_seed for label, by_seed in runs.items() if label != "sft_only"}
    return {
        split: {
            "vs_start": arm_differences(with_start, "start", split),
            "vs_sft_only": arm_differences(runs, "sft_only", split),
            "vs_start_arm": arm_differences(rl, start_arm, split),
        }
        for split in splits
    }


def gain_table(runs: dict[str, dict[int, dict]], split: str = "id") -> list[dict]:
    """One row per arm and seed: held-out avg@n at the SFT start and at the last step, the paired
    gain with its SE and z (is it > 3 SE?), and the run's CPU-hours."""
    rows = []
    for label, by_seed in runs.items():
        for seed, r in sorted(by_seed.items()):
            gains = r.get("gains", {}).get(split, {})
            if not gains:
                continue
            last = max(gains, key=int)
            g = gains[last]
            ev = r["evals"].get(split, {})
            rows.append(
                {
                    "arm": label,
                    "seed": seed,
                    "step": int(last),
                    "start": ev.get("0", {}).get("avg@n"),
                    "end": ev.get(last, {}).get("avg@n"),
                    "gain": g["diff"],
                    "se_gain": g["se"],
                    "z": g["z"],
                    "above_3se": bool(g["z"] > 3),
                    "se_start": g["se_start"],
                    "se_end": g["se_step"],
                    "num_problems": int(g["num_problems"]),
                    "cpu_hours": r.get("cpu_hours"),
                }
            )
    return rows


def _spent(run: dict) -> dict[int, tuple[float, float]]:
    """Per logged step, the episodes drawn (kept or not) and the rollout + update seconds spent so far
    (step 0, before any RL: nothing). Runs logged before ``samples/episodes`` existed give {}."""
    train = run.get("train", {})
    steps, eps = train.get("step", []), train.get("samples/episodes", [])
    if not steps or any(e is None for e in eps) or len(eps) != len(steps):
        return {}
    out, n, sec = {0: (0.0, 0.0)}, 0.0, 0.0
    for i, step in enumerate(steps):
        n += eps[i]
        sec += (train["time/rollout_s"][i] or 0.0) + (train["time/train_s"][i] or 0.0)
        out[int(step)] = (n, sec)
    return out


def _gain_within(
    run: dict, spent: dict[int, tuple[float, float]], which: int, budget: float, split: str
) -> dict:
    """The gain at the last evaluation whose cost (``which``: 0 episodes, 1 seconds) is within ``budget``."""
    gains = run.get("gains", {}).get(split, {})
    steps = [s for s in sorted(map(int, gains)) if s in spent and spent[s][which] <= budget * (1 + 1e-9)]
    if not steps:
        return {"step": 0, "gain": 0.0}
    return {"step": steps[-1], "gain": gains[str(steps[-1])]["diff"]}


def efficiency_table(runs: dict[str, dict[int, dict]], split: str = "id") -> list[dict]:
    """Per arm and seed: the whole run's gain per 1,000 episodes drawn and per CPU-hour, and the gain
    at equal samples and at equal compute. Equal means the seed's smallest budget over its arms: the
    episodes drawn (rejected ones included) and the rollout + update seconds of the arm that spent
    least; each arm is read at its last evaluation within that budget (a gate that pays for refills
    reaches fewer steps)."""
    spent = {(label, seed): _spent(r) for label, by_seed in runs.items() for seed, r in by_seed.items()}
    rows = []
    for seed in sorted({seed for by_seed in runs.values() for seed in by_seed}):
        arms = {
            label: by_seed[seed]
            for label, by_seed in runs.items()
            if seed in by_seed and spent[label, seed] and by_seed[seed].get("gains", {}).get(split)
        }
        if not arms:
            continue
        totals = {label: max(spent[label, seed].values()) for label in arms}
        budget_n = min(t[0] for t in totals.values())
        budget_s = min(t[1] for t in totals.values())
        for label, r in arms.items():
            gains = r["gains"][split]
            last = str(max(map(int, gains)))
            gain, (n, _) = gains[last]["diff"], totals[label]
            cpu = r.get("cpu_hours")
            rows.append(
                {
                    "arm": label,
                    "seed": seed,
                    "gain": gain,
                    "episodes": n,
                    "cpu_hours": cpu,
                    "gain_per_1k_episodes": 1000 * gain / n if n else None,
                    "gain_per_cpu_hour": gain / cpu if cpu else None,
                    "equal_samples": {
                        "episodes": budget_n,
                        **_gain_within(r, spent[label, seed], 0, budget_n, split),
                    },
                    "equal_compute": {
                        "seconds": budget_s,
                        **_gain_within(r, spent[label, seed], 1, budget_s, split),
                    },
                }
            )
    return rows


def efficiency_over_seeds(rows: list[dict]) -> list[dict]:
    """:func:`efficiency_table`'s rows per arm over its seeds: the mean of each figure, and for the
    whole run's gain its sd and ``se_over_seeds = sd / sqrt(seeds)`` (None with one seed). A figure
    some seed lacks (no CPU time recorded) is averaged over the seeds that have it."""
    out = []
    for arm in dict.fromkeys(r["arm"] for r in rows):
        mine = [r for r in rows if r["arm"] == arm]
        gains = [r["gain"] for r in mine]
        sd = statistics.stdev(gains) if len(gains) > 1 else None
        out.append(
            {
                "arm": arm,
                "seeds": [r["seed"] for r in mine],
                "gain mean": statistics.fmean(gains),
                "gain sd over seeds": sd,
                "se_over_seeds": sd / len(gains) ** 0.5 if sd is not None else None,
                "episodes mean": statistics.fmean(r["episodes"] for r in mine),
                "cpu_hours mean": _mean([r["cpu_hours"] for r in mine]),
                "gain_per_1k_episodes mean": _mean([r["gain_per_1k_episodes"] for r in mine]),
                "gain_per_cpu_hour mean": _mean([r["gain_per_cpu_hour"] for r in mine]),
                "equal_samples gain mean": statistics.fmean(r["equal_samples"]["gain"] for r in mine),
                "equal_compute gain mean": statistics.fmean(r["equal_compute"]["gain"] for r in mine),
            }
        )
    return out


def _mean(values: list) -> float | None:
    """Mean of the measured values (older runs lack newer metrics: None)."""
    known = [v for v in values if v is not None]
    return statistics.fmean(known) if known else None


def summarize(runs: dict[str, dict[int, dict]], metric: str = "avg@n") -> dict:
    """Per arm and split: metric at the first and last evaluation, mean and spread over seeds."""
    out: dict[str, dict] = {}
    for label, by_seed in runs.items():
        splits = sorted({s for r in by_seed.values() for s in r["evals"]})
        out[label] = {}
        for split in splits:
            firsts, lasts, bases = [], [], []
            for r in by_seed.values():
                if split in r.get("base", {}):
                    bases.append(r["base"][split].get(metric))
                ev = r["evals"].get(split, {})
                if ev:
                    steps = sorted(ev, key=int)
                    firsts.append(ev[steps[0]].get(metric))
                    lasts.append(ev[steps[-1]].get(metric))
            out[label][split] = {
                f"{metric} base model, before SFT (per seed)": bases,
                f"{metric} start (per seed)": firsts,
                f"{metric} end (per seed)": lasts,
                "start mean": _mean(firsts),
                "end mean": _mean(lasts),
                "end stdev": statistics.stdev(v for v in lasts if v is not None)
                if sum(v is not None for v in lasts) > 1
                else None,
            }
    return out


#: Besides avg@n, the evaluation metrics each suite's summary reports.
EXTRA_METRICS = {
    "s2r": [
        "verify_acc",
        "verify_balanced_acc",
        "verify_balanced_acc/ci95_low",
        "verify_balanced_acc/ci95_high",
        "verify_macro_f1",
        "verify_wrong_share",
        "wrong_to_right",
        "wrong_to_right/ci95_low",
        "wrong_to_right/ci95_high",
        "verify_balanced_acc/cluster_ci95_low",
        "verify_balanced_acc/cluster_ci95_high",
        "wrong_to_right/cluster_ci95_low",
        "wrong_to_right/cluster_ci95_high",
        "right_to_wrong",
        "attempts/mean",
    ],
    # answers that break the split's rule for J/Q/K vs legal answers of the wrong value (see evaluate.py)
    "points24": ["reason/illegal_numbers", "reason/wrong_value", "reason/unparseable", "truncation_rate"],
    "vision": ["recognition_acc", "reason/illegal_numbers", "reason/wrong_value", "reason/unparseable"],
}
#: R1-Zero: does the base model take up the format, and what happens to its length?
R1_ZERO_METRICS = ["format_rate", "response_length/mean", "truncation_rate"]
EXTRA_METRICS["r1_zero"] = R1_ZERO_METRICS
EXTRA_METRICS["points24_easy"] = EXTRA_METRICS["points24"]
EXTRA_METRICS["s2r_easy"] = EXTRA_METRICS["s2r"]


def summarize_all(suite: str, runs: dict[str, dict[int, dict]], start_arm: str | None = None) -> dict:
    out = {"avg@n": summarize(runs)}
    for metric in EXTRA_METRICS.get(suite, []):
        out[metric] = summarize(runs, metric)
    if suite in ("math", "dapo_parts"):
        out["dapo_ablation"] = ablation(runs)
    if suite == "dapo_parts":
        out["vs_grpo"] = arm_differences(runs)
        out["part_effects"] = part_effects(runs)
    if suite == "losses":
        out["losses_table"] = losses_table(runs)
    if suite == "vision":
        out["vision_table"] = vision_table(runs)
    if suite in ("math_gain", "dapo_parts"):
        out["gain_table"] = gain_table(runs)
    if suite == "dapo_parts":
        out["efficiency_table"] = efficiency_table(runs)
    if suite == "math_gain":  # the learning-per-sample arms, against each other at one setting
        same_setting = {label: r for label, r in runs.items() if label in PER_SAMPLE_ARMS}
        out["efficiency_table"] = efficiency_table(same_setting)
        out["efficiency_over_seeds"] = efficiency_over_seeds(out["efficiency_table"])
        out["vs_grpo_p16_v2"] = arm_differences(same_setting, reference="grpo_p16_v2")
        # distillation on the initial student's rollouts against on-policy distillation of the same code
        distill = {label: r for label, r in runs.items() if label in ("semi_opd_p16", "opsd_p16_v2")}
        out["semi_opd_vs_opsd"] = arm_differences(distill, reference="opsd_p16_v2")
        # the same arm in bf16 mixed precision against fp32, paired by problem (the bf16 arms measured
        # before the LoRA layers summed the adapter in fp32 are kept under their own label)
        precisions = {label: r for label, r in runs.items() if label.startswith("grpo_p16_v2")}
        out["bf16_vs_fp32"] = arm_differences(precisions, reference="grpo_p16_v2")
        # and the two re-run after the packed prompt and joined siblings, bf16 against fp32 of the same code
        # (and the bf16 arm with the sampler's dithered merge, against the same fp32 runs)
        reruns = {
            label: r
            for label, r in runs.items()
            if label in ("grpo_p16_v2_rerun", "grpo_p16_v2_bf16_rerun", "grpo_p16_v2_bf16_dither")
        }
        out["bf16_vs_fp32_rerun"] = arm_differences(reruns, reference="grpo_p16_v2_rerun")
    if suite == "points24_easy" and start_arm:
        out["matched"] = matched_table(runs, start_arm, ["id", "rule_ood"])
    if suite == "r1_zero":
        out["r1_zero_table"] = r1_zero_table(runs)
    if suite in ("s2r", "s2r_easy"):  # each policy over seeds; process GRPO's end against outcome RLOO's
        out["s2r_table"] = policy_table(runs, S2R_TABLE_METRICS)
        out["process_vs_outcome"] = arm_differences(runs, reference="outcome_rloo")
    return out


#: The R1-Zero table's training curves, each averaged over the RL steps since the previous evaluation.
#: ``sampling/informative_fraction``: the share of groups whose rewards were not all equal (the rest
#: teach nothing).
R1_ZERO_TRAIN = ("format_rate", "success_rate", "response_length/mean", "sampling/informative_fraction")


def r1_zero_table(runs: dict[str, dict[int, dict]], split: str = "id") -> list[dict]:
    """One row per arm, seed and evaluated step: the held-out format rate, avg@n (with its SE),
    response length and truncation rate at that step, and the training episodes' format rate,
    success rate, length and share of informative groups averaged over the RL steps since the previous
    evaluation (``train steps``: the logged rows ``(previous, step]``; none at step 0, the starting
    policy)."""
    rows = []
    for label, by_seed in runs.items():
        for seed, r in sorted(by_seed.items()):
            ev = r["evals"].get(split, {})
            train = r.get("train", {})
            logged = train.get("step", [])
            previous = None
            for step in sorted(ev, key=int):
                held = ev[step]
                window = [
                    i for i, s in enumerate(logged) if (previous is None or s > previous) and s <= int(step)
                ]
                row: dict = {"arm": label, "seed": seed, "step": int(step)}
                row.update({f"heldout {m}": held.get(m) for m in ("format_rate", "avg@n", "se/avg@n")})
                row.update({f"heldout {m}": held.get(m) for m in R1_ZERO_METRICS[1:]})
                row["train steps"] = [logged[i] for i in window]
                for key in R1_ZERO_TRAIN:
                    values = [train.get(key, [None] * len(logged))[i] for i in window]
                    row[f"train {key}"] = _mean(values)
                rows.append(row)
                previous = int(step)
    return rows


def plot_r1_zero(runs: dict[str, dict[int, dict]], path: Path, split: str = "id") -> None:
    """R1-Zero's three curves by RL step, one panel each: format rate, accuracy (the training
    episodes' success rate; held-out avg@n) and response length. Thin lines: every RL step's
    episodes, one per seed; dots joined: the held-out evaluations (step 0 = the base model)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [
        ("format rate", "format_rate", "format_rate"),
        ("accuracy", "success_rate", "avg@n"),
        ("response length (tokens)", "response_length/mean", "response_length/mean"),
    ]
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 3.6))
    for i, (label, by_seed) in enumerate(runs.items()):
        for j, (seed, r) in enumerate(sorted(by_seed.items())):
            color, train = f"C{(4 * i + j) % 10}", r.get("train", {})
            ev = r["evals"].get(split, {})
            steps = sorted(ev, key=int)
            for ax, (title, train_key, eval_key) in zip(axes, panels):
                ys = train.get(train_key, [])
                if ys and any(y is not None for y in ys):
                    ax.plot(
                        train["step"], ys, color=color, lw=0.8, alpha=0.6, label=f"{label} s{seed}: training"
                    )
                ax.plot(
                    [int(s) for s in steps],
                    [ev[s].get(eval_key) for s in steps],
                    marker="o",
                    color=color,
                    label=f"{label} s{seed}: held-out",
                )
                ax.set_title(title)
                ax.set_xlabel("RL step (0 = the base model)")
                ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


#: The vision table's metrics: success, the env's recognition and the answers by verdict reason.
VISION_METRICS = ["avg@n", "recognition_acc", "reason/illegal_numbers", "reason/wrong_value",
                  "reason/wrong_cards", "reason/unparseable", "reason/no_answer"]  # fmt: skip


def _metric(metrics: dict, name: str) -> float | None:
    """``metrics[name]``; a verdict reason no answer gave is logged by omission: 0 when others are."""
    if name.startswith("reason/") and name not in metrics and any(k.startswith("reason/") for k in metrics):
        return 0.0
    return metrics.get(name)


def vision_table(runs: dict[str, dict[int, dict]]) -> list[dict]:
    """:func:`policy_table` over :data:`VISION_METRICS`."""
    return policy_table(runs, VISION_METRICS)


#: S2R's table: does the policy solve, does it check (balanced over both verdicts), does it correct.
S2R_TABLE_METRICS = [
    "avg@n",
    "verify_balanced_acc",
    "verify_macro_f1",
    "wrong_to_right",
    "right_to_wrong",
    "attempts/mean",
]


def policy_table(runs: dict[str, dict[int, dict]], metrics: list[str]) -> list[dict]:
    """One row per policy (the base model, and each arm at each evaluated step) and split: each of
    ``metrics`` per seed, with its mean, sd over seeds and ``se = sd / sqrt(seeds)`` (None where a
    seed lacks it, e.g. ``recognition_acc`` when no answer listed cards)."""
    rows = []
    cells: dict[tuple[str, str], dict[int, dict]] = {}
    for label, by_seed in runs.items():
        for seed, r in by_seed.items():
            for split, logged in r.get("base", {}).items():
                cells.setdefault(("base model", split), {})[seed] = logged
            for split, by_step in r["evals"].items():
                for step, logged in by_step.items():
                    cells.setdefault((f"{label} @ step {step}", split), {})[seed] = logged
    for (policy, split), by_seed in cells.items():
        row: dict = {"policy": policy, "split": split, "seeds": sorted(by_seed)}
        for metric in metrics:
            values = [_metric(by_seed[s], metric) for s in sorted(by_seed)]
            known = [v for v in values if v is not None]
            sd = statistics.stdev(known) if len(known) > 1 else None
            row[metric] = {
                "per_seed": values,
                "mean": _mean(values),
                "sd": sd,
                "se": sd / len(known) ** 0.5 if sd is not None else None,
            }
        rows.append(row)
    return rows


def _last_eval(run: dict) -> dict | None:
    """A run's last held-out evaluation of the ``id`` split (else of its first split); None if none."""
    ev = run["evals"].get("id", next(iter(run["evals"].values()), {}))
    return ev[max(ev, key=int)] if ev else None


def _tail_mean(run: dict, key: str, last: int) -> float | None:
    """Mean of a training curve's last ``last`` logged values (None: never logged)."""
    tail = [x for x in run["train"].get(key, []) if x is not None][-last:]
    return statistics.fmean(tail) if tail else None


def losses_table(runs: dict[str, dict[int, dict]], last: int = 4) -> list[dict]:
    """One row per objective: held-out accuracy at the end (per seed, mean, sd) and, averaged over
    the last ``last`` training steps, clip fractions, approximate KL, entropy and response length
    (and, for the TIS arm, the sampler-trainer mismatch and the share of tokens it capped)."""
    rows = []
    for label in LOSS_ARMS:
        by_seed = runs.get(label)
        if not by_seed:
            continue
        ends = []
        tails: dict[str, list] = {}
        for r in by_seed.values():
            ev = _last_eval(r)
            ends.append(ev.get("avg@n") if ev is not None else None)
            for key in (
                "clip_frac_low",
                "clip_frac_high",
                "approx_kl",
                "entropy",
                "response_length/mean",
                "mismatch/k3_kl",
                "mismatch/outside_frac",
                "rollout_corr/token_frac",
                "time/rollout_s",
                "time/train_s",
            ):
                tails.setdefault(key, []).append(_tail_mean(r, key, last))
        known = [e for e in ends if e is not None]
        rows.append(
            {
                "arm": label,
                "seeds": sorted(by_seed),
                "avg@n end (per seed)": ends,
                "avg@n end mean": _mean(ends),
                "avg@n end stdev": statistics.stdev(known) if len(known) > 1 else None,
                **{f"{k}, last {last} steps (per seed)": v for k, v in tails.items()},
            }
        )
    return rows


def ablation(runs: dict[str, dict[int, dict]], last: int = 4) -> list[dict]:
    """DAPO's Table 1 in spirit: one row per added part; accuracy at the end, and the policy's
    entropy and response length averaged over the last ``last`` training steps (seed 0 and others)."""
    rows = []
    for label in ABLATION:
        by_seed = runs.get(label)
        if not by_seed:
            continue
        ends = []
        tails: dict[str, list] = {key: [] for key in ABLATION_CURVES}
        for r in by_seed.values():
            ev = _last_eval(r)
            if ev is not None:
                ends.append(ev.get("avg@n"))
            for key, values in tails.items():
                values.append(_tail_mean(r, key, last))
        rows.append(
            {
                "arm": label,
                "seeds": sorted(by_seed),
                "avg@n end (per seed)": ends,
                **{f"{ABLATION_CURVES[k]}, last {last} steps (per seed)": v for k, v in tails.items()},
            }
        )
    return rows


#: The training curves the ablation table averages: does clip-higher act (its share of tokens clipped
#: above), and what does each part do to entropy and length?
ABLATION_CURVES = {"entropy": "entropy", "response_length/mean": "response length",
                   "clip_frac_high": "clip_frac_high", "clip_frac_low": "clip_frac_low",
                   "approx_kl": "approx_kl"}  # fmt: skip


def plot_training(
    runs: dict[str, dict[int, dict]],
    labels: list[str],
    path: Path,
    keys: tuple[str, ...] = ("reward/mean", "entropy", "response_length/mean"),
) -> None:
    """Training curves (reward, entropy, response length, ...) by RL step, one line per arm (its first seed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(keys), figsize=(5 * len(keys), 3.6))
    for i, label in enumerate(lb for lb in labels if lb in runs):
        r = runs[label][min(runs[label])]
        for ax, key in zip(axes, keys):
            ax.plot(r["train"]["step"], r["train"][key], marker=".", color=f"C{i}", label=label)
            ax.set_title(key)
            ax.set_xlabel("RL step")
            ax.grid(alpha=0.3)
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def sft_only(overrides: list[str]) -> bool:
    """An SFT-only arm (no RL steps): its own, longer warm-up, or more SFT after a shared one."""
    return "train.steps=0" in overrides


def setting(overrides: list[str], key: str, default: int) -> int:
    """The last ``key=value`` among an arm's overrides, as an int."""
    values = [o.split("=", 1)[1] for o in overrides if o.startswith(key + "=")]
    return int(values[-1]) if values else default


def plot_by_examples(
    suite: str,
    runs: dict[str, dict[int, dict]],
    arms: dict[str, list[str]],
    path: Path,
    metric: str = "avg@n",
    warmup_examples: int = 0,
    start_arm: str | None = None,
) -> None:
    """Held-out success against training examples seen (SFT demonstrations + RL episodes), one panel
    per split: SFT-only and SFT-then-RL arms on one axis, at matched data. ``arms`` holds each arm's
    overrides (the suite's common ones first), from which its SFT examples and batch are read.
    With a shared warm-up of ``warmup_examples`` (every arm starting from it), an SFT-only arm's own
    examples come after it, and its line starts at ``start_arm``'s step 0 of the same seed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    splits = sorted({s for by_seed in runs.values() for r in by_seed.values() for s in r["evals"]})
    fig, axes = plt.subplots(1, len(splits), figsize=(5.5 * len(splits), 3.8), squeeze=False)
    for ax, split in zip(axes[0], splits):
        bases = [
            _metric(r["base"][split], metric)
            for bs in runs.values()
            for r in bs.values()
            if split in r["base"]
        ]
        bases = [b for b in bases if b is not None and b == b]  # nan: not measurable (no card list)
        if bases:
            ax.plot([0], [statistics.fmean(bases)], "ks", label="base model")
        for i, (label, by_seed) in enumerate(runs.items()):
            ov = arms.get(label, [])
            sft = setting(ov, "sft.examples", 0) if setting(ov, "sft.steps", 0) else 0
            per_step = setting(ov, "rollout.prompts_per_step", 8) * setting(ov, "rollout.group_size", 8)
            continues = bool(warmup_examples) and sft_only(ov)  # more SFT after the shared warm-up
            for j, (seed, r) in enumerate(sorted(by_seed.items())):
                ev = r["evals"].get(split, {})
                steps = sorted(ev, key=int)
                from_base = bool(bases) and "eval.at_start=false" not in ov and not continues
                xs = [0] * from_base + [sft + per_step * int(s) for s in steps]
                ys = [statistics.fmean(bases) if bases else None] * from_base + [
                    _metric(ev[s], metric) for s in steps
                ]
                if continues:
                    xs = [warmup_examples + x for x in xs]
                    start = (
                        runs.get(start_arm or "", {}).get(seed, {}).get("evals", {}).get(split, {}).get("0")
                    )
                    if start is not None:
                        xs, ys = [warmup_examples, *xs], [_metric(start, metric), *ys]
                ax.plot(
                    xs,
                    ys,
                    marker="o",
                    color=f"C{i}",
                    ls="--" if "sft_only" in label else "-",
                    alpha=0.9 if j == 0 else 0.5,
                    label=label if j == 0 else None,
                )
        ax.set_title(f"{suite}: {split} ({metric}, held-out)")
        ax.set_xlabel("training examples (SFT demonstrations + RL episodes)")
        ax.set_ylabel(metric)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot(suite: str, runs: dict[str, dict[int, dict]], path: Path, metric: str = "avg@n") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    splits = sorted({s for by_seed in runs.values() for r in by_seed.values() for s in r["evals"]})
    fig, axes = plt.subplots(1, len(splits), figsize=(5 * len(splits), 3.6), squeeze=False)
    for ax, split in zip(axes[0], splits):
        for i, (label, by_seed) in enumerate(runs.items()):
            for j, (seed, r) in enumerate(sorted(by_seed.items())):
                ev = r["evals"].get(split, {})
                steps = sorted(ev, key=int)
                ys = [ev[s].get(metric) for s in steps]
                ax.plot(
                    [int(s) for s in steps],
                    ys,
                    marker="osD^v"[j % 5],
                    color=f"C{i}",
                    alpha=0.9 if j == 0 else 0.5,
                    label=f"{label} (seed {seed})" if len(by_seed) > 1 else label,
                )
        for i, by_seed in enumerate(runs.values()):
            bases = [r["base"][split].get(metric) for r in by_seed.values() if split in r.get("base", {})]
            if bases:
                ax.axhline(statistics.fmean(bases), color=f"C{i}", ls=":", lw=1)
        ax.set_title(f"{suite}: {split} ({metric}, held-out)")
        ax.set_xlabel("RL step (0 = after the SFT warm-up; dotted = base model)")
        ax.set_ylabel(metric)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_plots(
    suite: str,
    runs: dict[str, dict[int, dict]],
    arms: dict[str, list[str]],
    results: Path,
    warmup_examples: int = 0,
    start_arm: str | None = None,
) -> None:
    """Every plot of ``suite`` into ``results``: held-out metric by step, and the suite's own
    (``warmup_examples`` and ``start_arm``: see :func:`plot_by_examples`)."""
    plot(suite, runs, results / f"learning_{suite}.png")
    if suite in ("points24", "points24_easy", "vision"):
        plot_by_examples(
            suite,
            runs,
            arms,
            results / f"learning_{suite}_by_examples.png",
            warmup_examples=warmup_examples,
            start_arm=start_arm,
        )
    if suite == "points24_easy":  # the rule claim in answers: J/Q/K read as 10 on rule OOD
        plot_by_examples(
            suite,
            runs,
            arms,
            results / "learning_points24_easy_illegal_numbers.png",
            "reason/illegal_numbers",
            warmup_examples,
            start_arm,
        )
    if suite == "vision":  # success is near 0 here: recognition and rule-breaking tell more
        for metric, name in (
            ("recognition_acc", "recognition"),
            ("reason/illegal_numbers", "illegal_numbers"),
        ):
            plot_by_examples(suite, runs, arms, results / f"learning_vision_{name}.png", metric)
    if suite in ("s2r", "s2r_easy"):  # does it check: balanced verification accuracy, wrong -> right
        for metric, name in (("verify_balanced_acc", "balanced_acc"), ("wrong_to_right", "wrong_to_right")):
            plot(suite, runs, results / f"learning_{suite}_{name}.png", metric)
    if suite == "math":
        plot_training(runs, ABLATION, results / "learning_math_dapo_ablation.png")
    if suite == "dapo_parts":  # does clip-higher act: the share of tokens clipped above, by step
        keys = ("reward/mean", "entropy", "response_length/mean", "clip_frac_high")
        plot_training(runs, ABLATION, results / "learning_dapo_parts_training.png", keys)
    if suite == "losses":
        plot_training(runs, LOSS_ARMS, results / "learning_losses_training.png")
    if suite == "r1_zero":  # format rate, accuracy and length by step, training and held-out
        plot_r1_zero(runs, results / "learning_r1_zero_curves.png")
