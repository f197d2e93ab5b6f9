"""A simulated trainer and generator on the bounded-staleness :class:`~veriloop.algos.loop.staleness.Scheduler`.

No model, no threads: a discrete-event clock. The generator runs every admitted group at once
(a group takes its own generation time, as on a separate device with room for all of them); the
trainer takes a step's batch from the scheduler, trains for ``train_s``, then syncs the weights
for ``sync_s``, during which generation pauses (full weights: pause, sync, resume). It shows
what K buys where generation and training run on separate devices: the wall time per step, how
long each side waits for the other, how many groups are in flight and how stale the trained
groups are. ``benchmarks/bench_async.py`` projects a GPU setting with it.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field

from veriloop.algos.loop.staleness import Scheduler, histogram, staleness

EPS = 1e-9


def long_tail_lengths(seed: int, *, base_s: float = 1.0, sigma: float = 1.0) -> Callable[[int], float]:
    """Generation seconds of group ``gid``: ``base_s * lognormal(0, sigma)``, drawn from one seeded
    stream in admission order (a long right tail: with sigma = 1 the slowest 1% take ~10x the median)."""
    rng = random.Random(seed)
    drawn: list[float] = []

    def length(gid: int) -> float:
        while len(drawn) <= gid:
            drawn.append(base_s * rng.lognormvariate(0.0, sigma))
        return drawn[gid]

    return length


@dataclass
class SimResult:
    """What one simulated run measured.

    Attributes:
        wall_s: simulated seconds for all steps.
        trainer_wait_s: time the trainer had no batch to train on.
        generator_wait_s: time no group was generating (paused for a sync, or nothing admitted).
        staleness: per trained group, ``t - v_start``.
        spans: per trained group, ``v_end - v_start``.
        in_flight: groups admitted and not yet trained (running + queued), sampled at each step start.
    """

    wall_s: float = 0.0
    trainer_wait_s: float = 0.0
    generator_wait_s: float = 0.0
    staleness: list[int] = field(default_factory=list)
    spans: list[int] = field(default_factory=list)
    in_flight: list[int] = field(default_factory=list)

    def summary(self, steps: int, max_staleness: int) -> dict[str, object]:
        """JSON-ready numbers: per-step wall time, idle shares, staleness histogram over 0..K."""
        wall = max(self.wall_s, EPS)
        return {
            "max_staleness": max_staleness,
            "wall_s_per_step": self.wall_s / max(steps, 1),
            "trainer_wait_fraction": self.trainer_wait_s / wall,
            "generator_wait_fraction": self.generator_wait_s / wall,
            "staleness_hist": histogram(self.staleness, max_staleness),
            "staleness_mean": sum(self.staleness) / max(len(self.staleness), 1),
            "span_max": max(self.spans, default=0),
            "in_flight_max": max(self.in_flight, default=0),
            "in_flight_mean": sum(self.in_flight) / max(len(self.in_flight), 1),
        }


def simulate(
    max_staleness: int,
    *,
    steps: int,
    groups_per_step: int,
    length: Callable[[int], float],
    train_s: float,
    sync_s: float,
) -> SimResult:
    """Run ``steps`` steps of the scheduler with generation time ``length(gid)`` per group and fixed
    ``train_s`` / ``sync_s`` per step. Returns what was measured (see :class:`SimResult`)."""
    sched = Scheduler(max_staleness, groups_per_step, budget=(steps + max_staleness) * groups_per_step)
    out = SimResult()
    clock, step = 0.0, 0
    remaining: dict[int, float] = {}  # running group -> generation seconds left
    phase, phase_end = "idle", 0.0  # trainer: idle | train | sync (generation pauses while syncing)
    while step < steps:
        while sched.capacity() > 0:
            g = sched.admit(seed=sched.admitted)
            remaining[g.gid] = length(g.gid)
        if phase == "idle":
            batch = sched.take(step)
            if batch is not None:
                out.in_flight.append(len(sched.groups) + len(batch))
                out.staleness += [staleness(step, g.v_start) for g in batch]
                out.spans += [g.span for g in batch]
                phase, phase_end = "train", clock + train_s
        paused = phase == "sync"
        ends = [phase_end] if phase != "idle" else []
        if remaining and not paused:
            ends.append(clock + min(remaining.values()))
        if not ends:
            raise RuntimeError(f"simulation stalled at step {step}: nothing running and no batch")
        dt = max(min(ends) - clock, 0.0)
        out.trainer_wait_s += dt if phase == "idle" else 0.0
        out.generator_wait_s += dt if paused or not remaining else 0.0
        clock += dt
        if not paused:
            for gid in list(remaining):
                remaining[gid] -= dt
                if remaining[gid] <= EPS:
                    del remaining[gid]
                    sched.finish(gid)
        if phase != "idle" and clock >= phase_end - EPS:
            if phase == "train":
                phase, phase_end = "sync", clock + sync_s
            else:
                sched.trained()
                step += 1
                phase = "idle"
    out.wall_s = clock
    return out
