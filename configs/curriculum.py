"""Difficulty-aware sampling settings (``curriculum``): which problems are drawn, which groups kept.

The mechanism is :mod:`veriloop.algos.loop.curriculum`; this section only holds its settings.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Pool:
    """A difficulty pool: buckets whose success rate ``r`` satisfies ``low <= r <= high``.

    Attributes:
        name: For metrics (``curriculum/pool/<name>/...``).
        low, high: The success-rate range (pools are checked in order; the first match wins).
        weight: Relative chance that a problem of this pool is taken when offered (>= 0).
    """

    name: str
    low: float
    high: float
    weight: float


def check_pools(pools: Sequence[Pool]) -> None:
    """Pools must cover [0, 1] (every rate falls in one) and have a positive weight somewhere."""
    if not pools:
        raise ValueError(
            "curriculum.pools is empty: give at least one pool, e.g. {all: {low: 0, high: 1, weight: 1}}"
        )
    for p in pools:
        if not (0.0 <= p.low <= p.high <= 1.0) or not (p.weight >= 0 and math.isfinite(p.weight)):
            raise ValueError(
                f"curriculum pool {p.name!r} needs 0 <= low <= high <= 1 and a finite weight >= 0, "
                f"got low={p.low}, high={p.high}, weight={p.weight}"
            )
    if max(p.weight for p in pools) <= 0:
        raise ValueError("every curriculum pool has weight 0: no problem could ever be drawn")
    reach = 0.0  # the ranges, sorted by low end, must leave no gap from 0 to 1
    for p in sorted(pools, key=lambda p: p.low):
        if p.low > reach:
            break
        reach = max(reach, p.high)
    if reach < 1.0:
        raise ValueError(
            f"curriculum pools leave success rates just above {reach} in no pool: make their ranges cover [0, 1]"
        )


@dataclass
class PoolEntry:
    """One difficulty pool (``curriculum.pools``), by the running success rate of a bucket.

    Attributes:
        low, high: The success-rate range ``low <= r <= high`` of the pool (pools are checked in
            the config's order, the first match wins; together they must cover [0, 1]).
        weight: Relative chance that an offered problem of this pool is taken (0 = never).
    """

    low: float = 0.0
    high: float = 1.0
    weight: float = 1.0


def default_pools() -> dict[str, PoolEntry]:
    """Hard (solved <= 10% of the time), medium, easy (>= 90%): easy ones drawn a fifth as often."""
    return {
        "hard": PoolEntry(0.0, 0.1, 1.0),
        "medium": PoolEntry(0.1, 0.9, 1.0),
        "easy": PoolEntry(0.9, 1.0, 0.2),
    }


@dataclass
class CurriculumConfig:
    """Difficulty-aware sampling and the refilling group gate (``algos.loop.curriculum``).

    Attributes:
        pools_enabled: Draw problems by difficulty pool: a bucket's running success rate puts it
            in a pool, and an offered problem is taken with probability ``weight / max weight``
            of its pool (a skipped problem is never offered again).
        bucket_keys: Task fields (``info["task"]`` at reset) that name a problem's bucket, e.g.
            ``level`` (math) or ``target`` (Points24); the first one present is used, after the
            mixture entry's name (``math/3``). None present: the environment is one bucket.
        pools: ``{name: {low, high, weight}}``, by running success rate.
        alpha: Step of the running success rate (an exponential moving average per bucket).
        prior: Success rate assumed for a bucket never played.
        max_scan: At most this many seeds are offered per problem wanted; past that the batch is
            filled with the first skipped ones (``curriculum/forced``).
        gate: Reject a group whose learning signals are all equal (every advantage 0) or whose
            success rate is outside ``[gate_low, gate_high]``, and draw a replacement, until the
            batch is full or ``max_rounds`` rollout rounds ran (DAPO's dynamic sampling, with a
            range). What rejected groups cost is logged (``curriculum/paid_*``).
        gate_low, gate_high: The success-rate range the gate keeps.
        max_rounds: Rollout rounds per step under the gate (the first one included).
    """

    pools_enabled: bool = False
    bucket_keys: list[str] = field(default_factory=lambda: ["level", "target"])
    pools: dict[str, PoolEntry] = field(default_factory=default_pools)
    alpha: float = 0.2
    prior: float = 0.5
    max_scan: int = 4
    gate: bool = False
    gate_low: float = 0.0
    gate_high: float = 1.0
    max_rounds: int = 4

    @property
    def enabled(self) -> bool:
        return self.pools_enabled or self.gate

    @property
    def seeds_per_problem(self) -> int:
        """Env seeds one problem slot may use up: the scan bound (1 without pools)."""
        return self.max_scan if self.pools_enabled else 1

    @property
    def rounds(self) -> int:
        """Rollout rounds per step: ``max_rounds`` under the gate, else 1."""
        return self.max_rounds if self.gate else 1

    def validate(self) -> None:
        """Ranges, with the fix in each message (``ConfigError`` is raised by the caller)."""
        if not 0 < self.alpha <= 1 or not 0 <= self.prior <= 1:
            raise ValueError(
                f"curriculum.alpha must be in (0, 1] and prior in [0, 1], got {self.alpha}, {self.prior}"
            )
        if self.max_scan < 1 or self.max_rounds < 1:
            raise ValueError(
                f"curriculum.max_scan and max_rounds must be >= 1, got {self.max_scan}, {self.max_rounds}"
            )
        if not 0 <= self.gate_low <= self.gate_high <= 1:
            raise ValueError(
                f"curriculum.gate_low <= gate_high must be success rates in [0, 1], got {self.gate_low}, {self.gate_high}"
            )
        check_pools(self.pool_list())

    def pool_list(self) -> list[Pool]:
        """The pools as :class:`Pool` records, in the config's order."""
        return [Pool(n, p.low, p.high, p.weight) for n, p in self.pools.items()]
