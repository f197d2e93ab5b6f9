"""Benchmark the public verifiers; writes benchmarks/results/verifiers.json.

Run: ``python benchmarks/bench_verifiers.py``

1. Points24 throughput on one core over 20,000 distinct, realistic responses (JSON answers with and
   without thinking, boxed / tagged / bare-line answers; correct, wrong-value, illegal-number,
   unparseable, hedged and missing answers). Reported per wall second and per CPU second (the CPU
   figure is robust to other processes sharing the machine), with the formula cache on (each response
   seen once) and cleared before every check (worst case).
2. Math check latency (deadline 5 s) over 200 realistic responses through the warm worker pool:
   p50 / p95 / p99 / max, plus the cold first call (pool start-up).
3. A batch of 40 ordinary items with and without one pathological item (a legitimate binomial
   coefficient with 300 million digits, which sympy needs minutes for): completion time of the
   ordinary items in each batch.
4. Cold start: the first check in a fresh process, for a plain integer (decided in-process), for an
   answer that needs a worker with the pool started on demand, and with the pool started when the
   environment is made (as ``MathVerify-v0`` does) followed by 3 s of other work (model loading).
5. Queueing: 16 threads x 25 checks each (4 of the 400 are pathological and run to the 5 s deadline)
   on the shared pool: latency of every check, queue wait included, with the FIFO slots and, for
   comparison, with the ``threading.BoundedSemaphore`` they replaced; and the documented bound.
6. Hostile sizes: a 47,614-character response ending in ``\\boxed{42}``; extraction over a
   brace-dense 1,000,000-character response whose last box never closes (the scan's worst case); the give-up check on a 10 MB response (time and peak
   traced memory); 16 answers of 15 nested bare braces in one batch (math-verify's time doubles per
   level: they used to hold both workers to the deadline).
7. Third-party scorers (``veriloop/ReasoningGym-v0``, needs the ``[reasoning-gym]`` extra): per-step
   latency of ``simple_integration`` (reasoning-gym's scorer, a fresh jail per call) and ``puzzle24``
   (our formula check, in-process), cold first step included, and which isolation steps the jail
   gets on this machine.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import random
import statistics
import sys
import threading
import time
import tracemalloc
from pathlib import Path
from typing import Any

from veriloop.envs.base import gave_up
from veriloop.envs.verifiers import (
    check_math,
    check_math_batch,
    check_points24,
    shutdown_pool,
    verifier_stats,
)
from veriloop.envs.verifiers import pool as pool_module
from veriloop.envs.verifiers.extract import MAX_RESPONSE_CHARS, extract
from veriloop.envs.verifiers.formula import _evaluate_cached

OUT = Path(__file__).resolve().parent / "results" / "verifiers.json"
THOUGHT = "Let me try combining the cards. First multiply, then check the remainder. " * 4


def _random_formula(rng: random.Random, numbers: list[int]) -> str:
    """A random fully parenthesised formula over ``numbers`` (each used once)."""
    terms = [str(n) for n in rng.sample(numbers, len(numbers))]
    while len(terms) > 1:
        i = rng.randrange(len(terms) - 1)
        op = rng.choice("+-*/")
        terms[i : i + 2] = [f"({terms[i]} {op} {terms[i + 1]})"]
    return terms[0][1:-1]


def points24_mix(n: int, seed: int = 0) -> list[tuple[str, list[int]]]:
    rng = random.Random(seed)
    solved = [
        ([3, 3, 8, 8], "8 / (3 - 8 / 3)"),
        ([1, 2, 3, 4], "1 * 2 * 3 * 4"),
        ([4, 7, 8, 8], "(7 - 8 / 8) * 4"),
    ]
    out = []
    for k in range(n):
        cards = [rng.randint(1, 13) for _ in range(4)]
        formula = _random_formula(rng, cards)
        kind = k % 10
        if kind == 0:
            cards, formula = rng.choice(solved)
            formula = formula.replace(" ", rng.choice(["", " "]))
        elif kind == 1:
            formula = _random_formula(rng, cards[:3] + [rng.randint(1, 13)])  # illegal numbers
        elif kind == 2:
            formula = formula.replace("*", "**", 1) if "*" in formula else "-" + formula  # unparseable
        labels = [str(c) for c in cards]
        if kind == 3:
            response = f"<think>{THOUGHT}</think>\n\\boxed{{{formula}}}"
        elif kind == 4:
            response = f"<answer>{formula} = 24</answer>"
        elif kind == 5:
            response = f"{THOUGHT}\n{formula} = 24"
        elif kind == 6:
            response = f"I think {formula} or {formula}+0 works."  # hedged or no answer
        else:
            obj = json.dumps({"cards": labels, "formula": formula})
            response = f"<think>{THOUGHT}</think>{obj}" if kind % 2 else obj
        out.append((response, cards))
    return out


def bench_points24(n: int = 20_000) -> dict[str, Any]:
    mix = points24_mix(n)
    for response, cards in mix[:200]:  # warm-up
        check_points24(response, cards)
    _evaluate_cached.cache_clear()
    reasons: dict[str, int] = {}
    wall, cpu = time.perf_counter(), time.process_time()
    for response, cards in mix:
        v = check_points24(response, cards)
        reasons[v.reason] = reasons.get(v.reason, 0) + 1
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    wall_u, cpu_u = time.perf_counter(), time.process_time()
    for response, cards in mix:
        _evaluate_cached.cache_clear()
        check_points24(response, cards)
    wall_u, cpu_u = time.perf_counter() - wall_u, time.process_time() - cpu_u
    return {
        "n_responses": n,
        "mean_response_chars": round(statistics.mean(len(r) for r, _ in mix), 1),
        "reasons": reasons,
        "checks_per_wall_s": round(n / wall),
        "checks_per_cpu_s": round(n / cpu),
        "uncached_checks_per_wall_s": round(n / wall_u),
        "uncached_checks_per_cpu_s": round(n / cpu_u),
    }


GOLDS = [
    ("7", ["7", "7.0", "x = 7", "8", "-7"]),
    ("\\frac{1}{2}", ["\\frac12", "0.5", "1/2", "\\frac{2}{4}", "\\frac{1}{3}"]),
    ("-\\frac{3}{4}", ["\\frac{-3}{4}", "-0.75", "\\frac{3}{4}"]),
    ("2\\sqrt{3}", ["2\\sqrt3", "\\sqrt{12}", "3\\sqrt{2}"]),
    ("\\frac{\\pi}{3}", ["\\pi/3", "60^\\circ", "\\frac{\\pi}{6}"]),
    ("(1, 2]", ["(1,2]", "(1,2)", "1 < x \\le 2"]),
    ("\\{1, 2, 3\\}", ["\\{3, 2, 1\\}", "1, 2, 3", "\\{1, 2\\}"]),
    ("1000", ["1,000", "1{,}000", "10^3", "100"]),
    ("x^2 + 2x + 1", ["(x+1)^2", "x^2+2x+1", "x^2+1"]),
    ("\\text{(B)}", ["B", "\\text{(B)}", "C"]),
]


def math_mix(n: int = 200, seed: int = 1) -> list[tuple[str, str]]:
    rng = random.Random(seed)
    out = []
    for k in range(n):
        gold, answers = rng.choice(GOLDS)
        answer = rng.choice(answers)
        thought = "We compute step by step. " * rng.randint(5, 60)
        shape = k % 10
        if shape == 0:
            response = thought + "The answer is " + answer  # no anchor
        elif shape == 1:
            response = f"<think>{thought}</think> \\boxed{{{answer} \\text{{ or }} 5}}"  # hedged
        elif shape in (2, 3):
            response = f"<think>{thought}</think>\n<answer>{answer}</answer>"
        else:
            response = f"<think>{thought}</think>\nSo the final answer is $\\boxed{{{answer}}}$."
        out.append((response, gold))
    return out


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def bench_math_latency() -> dict[str, Any]:
    shutdown_pool()
    start = time.perf_counter()
    check_math("\\boxed{\\frac{1}{2}}", "0.5")  # needs a worker (a plain integer would not)
    cold = time.perf_counter() - start
    mix = math_mix()
    latencies, reasons = [], {}
    for response, gold in mix:
        start = time.perf_counter()
        v = check_math(response, gold, timeout=5.0)
        latencies.append(time.perf_counter() - start)
        reasons[v.error or v.reason] = reasons.get(v.error or v.reason, 0) + 1
    ms = [1000 * x for x in latencies]
    return {
        "n_responses": len(mix),
        "deadline_s": 5.0,
        "cold_first_call_ms": round(1000 * cold, 1),
        "p50_ms": round(_pct(ms, 0.50), 2),
        "p95_ms": round(_pct(ms, 0.95), 2),
        "p99_ms": round(_pct(ms, 0.99), 2),
        "max_ms": round(max(ms), 2),
        "mean_ms": round(statistics.mean(ms), 2),
        "outcomes": reasons,
    }


def _timed_batch(pairs: list[tuple[str, str]], timeout: float) -> tuple[dict[int, float], float, list[Any]]:
    done: dict[int, float] = {}
    start = time.perf_counter()
    verdicts = check_math_batch(
        pairs, timeout=timeout, on_result=lambda i, v: done.setdefault(i, time.perf_counter() - start)
    )
    return done, time.perf_counter() - start, verdicts


def bench_batch() -> dict[str, Any]:
    normal = math_mix(40, seed=2)
    slow = BOMB
    check_math("\\boxed{1}", "1")  # warm
    base_done, base_total, _ = _timed_batch(normal, 5.0)
    with_slow = normal[:10] + [slow] + normal[10:]
    done, total, verdicts = _timed_batch(with_slow, 5.0)
    others = [t for i, t in done.items() if i != 10]
    return {
        "n_items": len(normal),
        "deadline_s": 5.0,
        "pool_workers": max(2, os.cpu_count() or 1),
        "without_pathological": {
            "total_s": round(base_total, 3),
            "item_done_max_s": round(max(base_done.values()), 3),
            "item_done_mean_s": round(statistics.mean(base_done.values()), 3),
        },
        "with_pathological": {
            "total_s": round(total, 3),
            "pathological_done_s": round(done[10], 3),
            "pathological_error": verdicts[10].error,
            "others_done_max_s": round(max(others), 3),
            "others_done_mean_s": round(statistics.mean(others), 3),
        },
    }


BOMB = ("<think>hmm</think>\\boxed{\\binom{10^{9}}{5 \\cdot 10^{8}}}", "3")


def bench_cold_start() -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, pair, prestart in (
        ("plain_integer_ms", ("\\boxed{42}", "42"), False),
        ("needs_worker_on_demand_ms", ("\\boxed{\\frac{1}{2}}", "0.5"), False),
        ("needs_worker_pool_started_at_env_creation_then_3s_ms", ("\\boxed{\\frac{1}{2}}", "0.5"), True),
    ):
        shutdown_pool()
        if prestart:
            pool_module.get_pool().start()
            time.sleep(3.0)  # the model loads meanwhile
        start = time.perf_counter()
        verdict = check_math(*pair)
        out[name] = round(1000 * (time.perf_counter() - start), 1)
        assert verdict.correct, verdict
    return out


def _queue_run(n_threads: int, per_thread: int, bombs: set[int]) -> dict[str, Any]:
    mix = math_mix(n_threads * per_thread, seed=3)
    latencies: list[tuple[bool, float, str | None]] = []
    lock = threading.Lock()

    def worker(t: int) -> None:
        for k in range(per_thread):
            index = t * per_thread + k
            pair = BOMB if index in bombs else mix[index]
            start = time.perf_counter()
            verdict = check_math(*pair, timeout=5.0)
            with lock:
                latencies.append((index in bombs, time.perf_counter() - start, verdict.error))

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(n_threads)]
    start = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    total = time.perf_counter() - start
    ordinary = [x for bomb, x, _ in latencies if not bomb]
    return {
        "total_s": round(total, 2),
        "ordinary_p50_ms": round(1000 * _pct(ordinary, 0.5), 1),
        "ordinary_p99_ms": round(1000 * _pct(ordinary, 0.99), 1),
        "ordinary_max_s": round(max(ordinary), 2),
        "any_max_s": round(max(x for _, x, _ in latencies), 2),
        "timeouts": sum(err == "timeout" for _, _, err in latencies),
    }


def bench_queue(n_threads: int = 16, per_thread: int = 25) -> dict[str, Any]:
    """FIFO slots vs the BoundedSemaphore they replaced, same load, same pool size."""
    bombs = {3, 110, 220, 330}
    out: dict[str, Any] = {"threads": n_threads, "checks": n_threads * per_thread, "pathological": len(bombs)}
    for label in ("fifo", "bounded_semaphore_before"):
        shutdown_pool()
        pool = pool_module.get_pool()
        if label != "fifo":
            pool._slots = threading.BoundedSemaphore(pool.size)  # type: ignore[assignment]
        check_math("\\boxed{\\frac{1}{2}}", "0.5")  # warm: every worker ready
        for _ in range(pool.size):
            check_math("\\boxed{\\frac{1}{3}}", "\\frac{1}{3}")
        out[label] = _queue_run(n_threads, per_thread, bombs)
    size = pool_module.get_pool().size
    turns = -(-n_threads // size)  # ceil((q + 1) / size), q = n_threads - 1 requests queued ahead
    out["pool_workers"] = size
    out["documented_bound_s"] = f"ceil(16 / {size}) * (W + 5 s) = {turns} * (W + 5 s), W = worker start-up"
    shutdown_pool()
    return out


def bench_hostile_sizes() -> dict[str, Any]:
    long_reasoning = "Let me think about this carefully. " * 1360 + "So \\boxed{42}."
    start = time.perf_counter()
    verdict = check_math(long_reasoning, "42")
    long_ms = 1000 * (time.perf_counter() - start)
    # worst case: the last box never closes, so its brace scan runs to the end before the first box wins
    dense = "\\boxed{5} \\boxed{" + "{}" * ((MAX_RESPONSE_CHARS - 20) // 2)
    huge = "blah\n" * 2_000_000
    start = time.perf_counter()
    found = extract(dense)
    dense_ms = 1000 * (time.perf_counter() - start)
    start = time.perf_counter()
    given_up = gave_up(huge)
    give_up_ms = 1000 * (time.perf_counter() - start)
    tracemalloc.start()  # memory in a second pass: tracing slows every allocation down
    extract(dense)
    dense_peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.reset_peak()
    gave_up(huge)
    give_up_peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return {
        "long_reasoning_chars": len(long_reasoning),
        "long_reasoning_verdict": verdict.reason,
        "long_reasoning_ms": round(long_ms, 2),
        "brace_dense_chars": len(dense),
        "brace_dense_answer": found.answer,
        "brace_dense_extract_ms": round(dense_ms, 1),
        "brace_dense_peak_traced_kb": round(dense_peak / 1024, 1),
        "give_up_10mb_result": given_up,
        "give_up_10mb_ms": round(give_up_ms, 2),
        "give_up_10mb_peak_traced_kb": round(give_up_peak / 1024, 1),
        **_deep_braces(),
    }


def _deep_braces() -> dict[str, Any]:
    hostile = "\\boxed{" + "{" * 15 + "1" + "}" * 15 + "}"
    start = time.perf_counter()
    verdicts = check_math_batch([(hostile, "1")] * 16)
    return {
        "deep_braces_16_answers_ms": round(1000 * (time.perf_counter() - start), 2),
        "deep_braces_verdicts": sorted({v.reason for v in verdicts}),
    }


def bench_scorers(steps: int = 40) -> dict[str, Any]:
    """Section 7 of the module docstring (skipped without reasoning-gym)."""
    try:
        import gymnasium

        import veriloop.envs  # noqa: F401  (registers the ids)
        from veriloop.envs.verifiers.sandbox import isolation
        from veriloop.interop.reasoning_gym_env import ENV_ID
    except ImportError as exc:
        return {"skipped": str(exc)}
    out: dict[str, Any] = {"isolation": isolation(), "steps": steps}
    for dataset, scored_by in (("simple_integration", "jail"), ("puzzle24", "ours, in-process")):
        env = gymnasium.make(ENV_ID, dataset=dataset)
        latencies, rewards = [], []
        for i in range(steps + 1):
            _, info = env.reset(seed=i)
            answer = info["task"]["answer"] if i % 2 == 0 else "1"
            start = time.perf_counter()
            rewards.append(env.step(f"<answer>{answer}</answer>")[1])
            latencies.append(1000 * (time.perf_counter() - start))
        warm = latencies[1:]
        out[dataset] = {
            "scored_by": scored_by,
            "cold_first_step_ms": round(latencies[0], 1),
            "p50_ms": round(_pct(warm, 0.5), 2),
            "p95_ms": round(_pct(warm, 0.95), 2),
            "max_ms": round(max(warm), 2),
            "right_answers_scored_1": sum(r == 1.0 for r in rewards[::2]) / len(rewards[::2]),
        }
    return out


def targets(results: dict[str, Any]) -> dict[str, Any]:
    """The issue's targets, each with the measured figure and whether it is met.

    One core: the Points24 loop is single-threaded, so checks per CPU second is the rate of one core
    even when other processes share the machine; the wall-clock rate is reported next to it.
    "Never delays the others": no ordinary item of the batch finishes after the pathological one (none
    waits for it); the slowdown from having one worker fewer for the deadline is reported as a ratio.
    """
    p24, lat, batch = results["points24"], results["math_latency"], results["math_batch_pathological"]
    base, slow = batch["without_pathological"], batch["with_pathological"]
    return {
        "points24_checks_per_s_one_core_ge_20000": {
            "cpu_s": p24["checks_per_cpu_s"],
            "wall_s": p24["checks_per_wall_s"],
            "uncached_cpu_s": p24["uncached_checks_per_cpu_s"],
            "met": p24["checks_per_cpu_s"] >= 20_000 and p24["uncached_checks_per_cpu_s"] >= 20_000,
        },
        "math_p99_below_1s_at_deadline_5s": {"p99_ms": lat["p99_ms"], "met": lat["p99_ms"] < 1000.0},
        "pathological_item_blocks_no_other": {
            "others_done_max_s": slow["others_done_max_s"],
            "pathological_done_s": slow["pathological_done_s"],
            "slowdown_vs_clean_batch": round(slow["others_done_max_s"] / base["item_done_max_s"], 2),
            "met": slow["pathological_error"] == "timeout"
            and slow["others_done_max_s"] < slow["pathological_done_s"] - 1.0,
        },
    }


def main() -> None:
    import argparse

    argparse.ArgumentParser(
        description="Verifier throughput, latency, queueing and hostile-input costs; writes "
        "benchmarks/results/verifiers.json (takes a few minutes, no arguments)."
    ).parse_args()
    results = {
        "machine": {
            "cpu_count": os.cpu_count(),
            "python": sys.version.split()[0],
            "platform": platform.platform(),
            "load_avg_at_start": os.getloadavg(),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        },
        "points24": bench_points24(),
        "math_latency": bench_math_latency(),
        "math_batch_pathological": bench_batch(),
        "cold_start": bench_cold_start(),
        "queue": bench_queue(),
        "hostile_sizes": bench_hostile_sizes(),
        "third_party_scorers": bench_scorers(),
    }
    results["verifier_stats"] = verifier_stats()
    results["targets"] = targets(results)
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
