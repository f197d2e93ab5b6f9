"""The quickstart itself, over seeds: held-out accuracy of the base model, after the SFT warm-up and
after RL, the RL phase's change paired by problem (with its SE and z), wall time, CPU time, peak
memory and the machine's load while it ran.

Each seed is ``veriloop quickstart [OVERRIDES] rollout.seed=1000*SEED`` in its own process, in
``runs/bench_quickstart/<tag>/s<SEED>``. Rerunning the same command continues: a finished seed is only
collected, an interrupted one continues where it stopped (the quickstart resumes by itself), and every
attempt's wall time, CPU time, peak resident memory and load are kept in ``s<SEED>.attempts.json``.
Results go to ``benchmarks/results/quickstart_<tag>.json``.

Usage (from the repository root, in the venv):
  OMP_PROC_BIND=true OMP_PLACES=cores nice -n 5 python benchmarks/bench_quickstart.py --tag default --seeds 0 1 2
  ... bench_quickstart.py --tag gemma --seeds 0 1 -- policy.model=gemma3-270m
  ... bench_quickstart.py --tag default --report-only
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

from veriloop.algos.eval.metrics import paired_difference, standard_error

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
RUNS = ROOT / "runs" / "bench_quickstart"


class LoadSampler:
    """The 1-minute load average every ``every`` seconds while a run goes (the cores are shared)."""

    def __init__(self, every: float = 30.0) -> None:
        self.every, self.samples = every, [os.getloadavg()[0]]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        while not self._stop.wait(self.every):
            self.samples.append(os.getloadavg()[0])

    def __enter__(self) -> LoadSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self.samples.append(os.getloadavg()[0])


def veriloop_cmd() -> list[str]:
    exe = shutil.which("veriloop")
    return [exe] if exe else [sys.executable, "-m", "veriloop.cli"]


def run_seed(tag: str, seed: int, overrides: list[str]) -> Path:
    """Run (or continue) one seed's quickstart; return its run folder. Every attempt is recorded
    before it starts and closed when it ends (a killed one keeps its start: see :func:`attempts`)."""
    out = RUNS / tag
    out.mkdir(parents=True, exist_ok=True)
    run_dir, record = out / f"s{seed}", out / f"s{seed}.attempts.json"
    if (run_dir / "final").is_dir():
        return run_dir
    args = [
        *veriloop_cmd(),
        "quickstart",
        *overrides,
        f"rollout.seed={1000 * seed}",
        f"run.out_dir={out}",
        f"run.name=s{seed}",
    ]
    done = attempts(record)
    opened = {"started": time.time(), "command": " ".join(args[1:]), "cpus": os.cpu_count(), "exit": None}
    record.write_text(json.dumps([*done, opened], indent=1))
    print(f"[{tag} s{seed}] {' '.join(args[1:])}", flush=True)
    t0 = time.time()
    with (out / f"s{seed}.log").open("a") as log, LoadSampler() as load:
        proc = subprocess.Popen(args, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(proc.pid, 0)
    rc = os.waitstatus_to_exitcode(status)
    closed = {
        **opened,
        "exit": rc,
        "seconds": time.time() - t0,
        "cpu_seconds": usage.ru_utime + usage.ru_stime,
        "maxrss_gb": usage.ru_maxrss / 1e6,
        "load_1min": _spread(load.samples),
    }
    record.write_text(json.dumps([*done, closed], indent=1))
    print(f"[{tag} s{seed}] exit {rc} after {closed['seconds']:.0f} s", flush=True)
    if rc != 0:
        raise SystemExit(f"{tag} s{seed} failed (exit {rc}); see {out / f's{seed}.log'}")
    return run_dir


def attempts(record: Path) -> list[dict]:
    """The recorded attempts; one left open (its process was killed) ends at its log's last write."""
    rows = json.loads(record.read_text()) if record.exists() else []
    log = record.with_name(record.name.replace(".attempts.json", ".log"))
    end = log.stat().st_mtime if log.exists() else None
    return [
        r
        if "seconds" in r
        else {
            **r,
            "seconds": max(0.0, (end or r["started"]) - r["started"]),
            "exit": "killed",
            "estimated": True,
        }
        for r in rows
    ]


def _spread(values: list[float]) -> dict[str, float]:
    return {"min": min(values), "mean": sum(values) / len(values), "max": max(values), "samples": len(values)}


def evaluations(run_dir: Path) -> dict[str, dict]:
    """``{"base": report, "0": report, "4": report, ...}`` from the run's ``eval/*.json``."""
    out = {}
    for path in sorted((run_dir / "eval").glob("*.json")):
        report = json.loads(path.read_text())
        out["base" if path.stem == "base" else str(int(report["meta"].get("step") or 0))] = report
    return out


def collect(run_dir: Path, record: Path) -> dict:
    """One seed: avg@n ± SE at each evaluation, the SFT and RL phases' paired changes, its cost."""
    evals = evaluations(run_dir)
    acc = {
        k: {
            "avg@n": r["splits"]["id"]["avg@n"],
            "se": r["splits"]["id"].get("se/avg@n"),
            **{
                m: v
                for m, v in r["splits"]["id"].items()
                if m.startswith(("reason/", "response_length/mean"))
            },
        }
        for k, r in evals.items()
    }
    steps = sorted(int(k) for k in evals if k != "base")
    per = {k: r["per_problem"]["id"]["avg@n"] for k, r in evals.items()}
    row: dict = {"accuracy": acc, "steps": steps, "finished": (run_dir / "final").is_dir()}
    if "base" in per and steps:
        row["sft_phase"] = paired_difference(per["base"], per[str(steps[0])])
    if len(steps) > 1:
        row["rl_phase"] = paired_difference(per[str(steps[0])], per[str(steps[-1])])
        row["rl_phase"].update(
            se_start=standard_error(per[str(steps[0])]), se_end=standard_error(per[str(steps[-1])])
        )
    meta = evals[str(steps[-1])]["meta"] if steps else {}
    row["eval"] = {k: meta.get(k) for k in ("num_problems", "n_samples", "temperature", "max_new_tokens")}
    runs = attempts(record)
    row["attempts"] = runs
    row["wall_s"] = sum(a["seconds"] for a in runs)
    row["cpu_s"] = (
        sum(a.get("cpu_seconds", 0.0) for a in runs) if all("cpu_seconds" in a for a in runs) else None
    )
    row["maxrss_gb"] = max((a.get("maxrss_gb", 0.0) for a in runs), default=None)
    return row


def summarize(seeds: dict[int, dict]) -> dict:
    """Mean ± sd over seeds of each phase's accuracy and of the RL phase's paired change (None for a
    phase no seed evaluated)."""

    def ms(values: list[float]) -> dict[str, float | None] | None:
        if not values:  # e.g. no base-model evaluation (eval.before_sft=false)
            return None
        m = sum(values) / len(values)
        sd = (
            (sum((v - m) ** 2 for v in values) / (len(values) - 1)) ** 0.5
            if len(values) > 1
            else None  # undefined for one seed (JSON has no NaN)
        )
        return {"mean": m, "sd": sd, "n": len(values)}

    done = [r for r in seeds.values() if r.get("finished") and "rl_phase" in r]
    if not done:
        return {}
    first, last = str(done[0]["steps"][0]), str(done[0]["steps"][-1])
    return {
        "base": ms([r["accuracy"]["base"]["avg@n"] for r in done if "base" in r["accuracy"]]),
        "after_sft": ms([r["accuracy"][first]["avg@n"] for r in done]),
        "after_rl": ms([r["accuracy"][last]["avg@n"] for r in done]),
        "rl_gain": ms([r["rl_phase"]["diff"] for r in done]),
        "rl_z_min": min(r["rl_phase"]["z"] for r in done),
        "seeds_above_3se": sum(r["rl_phase"]["z"] > 3 for r in done),
        "wall_s": ms([r["wall_s"] for r in done]),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tag", required=True, help="names the runs' folder and the results file")
    ap.add_argument("--seeds", type=int, nargs="*", default=[0])
    ap.add_argument("--report-only", action="store_true", help="collect finished runs only")
    ap.add_argument("overrides", nargs="*", help="quickstart overrides (after --)")
    args = ap.parse_args()
    path = RESULTS / f"quickstart_{args.tag}.json"
    old = json.loads(path.read_text()) if path.exists() else {}
    overrides = args.overrides or old.get("overrides", [])
    for seed in [] if args.report_only else args.seeds:
        run_seed(args.tag, seed, overrides)
        write(path, args.tag, overrides)  # after every seed: a later crash keeps this one
    write(path, args.tag, overrides)
    print(json.dumps(json.loads(path.read_text())["summary"], indent=1))


def write(path: Path, tag: str, overrides: list[str]) -> None:
    seeds = {
        int(d.name[1:]): collect(d, RUNS / tag / f"{d.name}.attempts.json")
        for d in sorted((RUNS / tag).glob("s[0-9]*"))
        if d.is_dir() and (d / "eval").is_dir()
    }
    out = {
        "command": f"python benchmarks/bench_quickstart.py --tag {tag} --seeds ... -- {' '.join(overrides)}".rstrip(),
        "overrides": overrides,
        "seed_rule": "rollout.seed = 1000 * seed",
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
        "seeds": {str(k): v for k, v in sorted(seeds.items())},
        "summary": summarize(seeds),
    }
    path.write_text(json.dumps(out, indent=1, allow_nan=False) + "\n")


if __name__ == "__main__":
    main()
