"""Bounded staleness: which groups may start, which the trainer takes, and what is measured.

Asynchronous training runs generation beside the update. Versions count optimizer steps applied
to the policy: ``v = 0`` before the first update, ``v = t + 1`` after step ``t``. Every group of
episodes (one problem x ``group_size`` samples) records

    v_start  the version when it was admitted (its first token is sampled under v_start or later)
    v_end    the version when its last token was sampled (an episode may continue across a sync)

and when step ``t`` trains on it, its staleness is ``t - v_start``, in optimizer steps.

The bound K (``train.max_staleness``) is enforced at admission, never by dropping (dropping stale
work starves the long, hard episodes and biases what is learned):

    a group may start only while   accepted + running < (K + v + 1) * n          (AReaL's rule)

with ``n`` groups per step, ``accepted`` every group finished and kept so far (trained ones
included) and ``running`` every group admitted and not finished. Admission alone bounds how far
generation runs ahead, not which group a step takes: a slow group admitted early can be
overtaken by later, shorter ones and wait past K (AReaL's rule has this gap). So the trainer

* takes finished groups oldest first, and at step ``t`` waits for every group with
  ``v_start <= t - K`` (due now: its deadline is ``v_start + K``);
* takes a batch only if what it leaves behind can still meet every deadline: for each
  ``u`` in ``t + 1 - K .. t - 1``, at most ``(u + K - t) * n`` untrained groups have
  ``v_start <= u`` (steps ``t + 1 .. u + K`` must train them all, n per step).

Groups admitted from version ``t`` on need no check: by the admission rule at most
``(K + u + 1) * n`` kept groups ever have ``v_start <= u``, and ``(t + 1) * n`` of them are trained
by the end of step ``t``. Together the two rules keep every deadline: no trained group has
staleness above K, whatever the episode lengths (tests/algos/loop/test_staleness.py drives a long
tail through them). With K = 0 every admitted group is due at once: the synchronous loop.

:class:`Scheduler` is that bookkeeping alone (no threads, no clock): the training loop
(``algos.loop.async_loop``) and the simulated scheduler (``benchmarks/staleness_sim.py``) both drive it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field


def admission_capacity(
    version: int, max_staleness: int, groups_per_step: int, accepted: int, running: int
) -> int:
    """How many more groups may start now: ``max(0, (K + v + 1) n - (accepted + running))``.

    Args:
        version: v, optimizer steps applied so far.
        max_staleness: K >= 0.
        groups_per_step: n, the groups one step trains on.
        accepted: groups finished and kept so far (trained or waiting to be).
        running: groups admitted and not finished.
    """
    if max_staleness < 0 or groups_per_step < 1 or version < 0:
        raise ValueError(
            f"need K >= 0, n >= 1 and v >= 0, got K={max_staleness}, n={groups_per_step}, v={version}"
        )
    return max(0, (max_staleness + version + 1) * groups_per_step - (accepted + running))


def staleness(step: int, v_start: int) -> int:
    """Staleness of a group trained at step ``t`` that was admitted at version ``v_start``: ``t - v_start``."""
    if v_start > step:
        raise ValueError(f"a group admitted at version {v_start} cannot train at an earlier step {step}")
    return step - v_start


@dataclass
class Group:
    """One admitted problem (``group_size`` episodes) and its life in the scheduler.

    Attributes:
        gid: admission order, 0, 1, ... (oldest first).
        seed: the problem's env seed (the data cursor value it took).
        v_start: version at admission.
        v_end: version when its last token was sampled; None while running.
        kept: finished and kept for training (False while running or once dropped).
        dropped: why it will never train (``"uninformative"``: dynamic sampling; ``"run_end"``:
            still unused when the run ended), else None.
        trained_at: the step that trained on it, else None.
        payload: what the generator produced (the episodes); the scheduler never reads it.
    """

    gid: int
    seed: int
    v_start: int
    v_end: int | None = None
    kept: bool = False
    dropped: str | None = None
    trained_at: int | None = None
    payload: object = None

    @property
    def span(self) -> int:
        """``v_end - v_start``: weight updates its episodes lived through (0 if none)."""
        return 0 if self.v_end is None else self.v_end - self.v_start


@dataclass
class Scheduler:
    """Admission and consumption of groups under the bound K (see the module docstring).

    Not thread-safe: the caller holds one lock around every call.

    Attributes:
        max_staleness: K.
        groups_per_step: n.
        budget: most groups ever admitted (the problems the run may use); None = no limit.
        version: v, bumped by :meth:`trained`.
    """

    max_staleness: int
    groups_per_step: int
    budget: int | None = None
    version: int = 0
    groups: dict[int, Group] = field(default_factory=dict)  # not yet trained or dropped, by gid
    admitted: int = 0
    accepted: int = 0
    dropped: int = 0

    @property
    def running(self) -> int:
        return sum(1 for g in self.groups.values() if g.v_end is None)

    @property
    def queued(self) -> int:
        """Finished, kept and not yet trained."""
        return sum(1 for g in self.groups.values() if g.kept)

    def capacity(self) -> int:
        """Groups that may start now (the bound, and the budget)."""
        room = admission_capacity(
            self.version, self.max_staleness, self.groups_per_step, self.accepted, self.running
        )
        return room if self.budget is None else min(room, self.budget - self.admitted)

    def admit(self, seed: int) -> Group:
        """Start a group at the current version; refused (ValueError) without capacity."""
        if self.capacity() <= 0:
            raise ValueError(
                f"no capacity at version {self.version}: admission would break the staleness bound"
            )
        group = Group(self.admitted, seed, self.version)
        self.groups[group.gid] = group
        self.admitted += 1
        return group

    def finish(
        self,
        gid: int,
        *,
        keep: bool = True,
        reason: str | None = None,
        payload: object = None,
        v_end: int | None = None,
    ) -> Group:
        """Its last token was sampled now: kept, or dropped with ``reason``. ``v_end``: the version
        that sampled it (an engine may lag the scheduler by a sync); default the current one."""
        group = self.groups[gid]
        if group.v_end is not None:
            raise ValueError(f"group {gid} finished twice")
        group.v_end, group.payload = self.version if v_end is None else v_end, payload
        if keep:
            group.kept = True
            self.accepted += 1
        else:
            self._drop(group, reason or "dropped")
        return group

    def _drop(self, group: Group, reason: str) -> None:
        group.dropped = reason
        self.dropped += 1
        del self.groups[group.gid]

    def due(self, step: int) -> list[Group]:
        """Groups step ``step`` must train on: not dropped, admitted at ``v_start <= step - K``."""
        return [g for g in self.groups.values() if g.v_start + self.max_staleness <= step]

    def more_can_come(self) -> bool:
        """A group is running, or one may still be admitted (by the budget)."""
        return self.running > 0 or self.budget is None or self.admitted < self.budget

    def take(self, step: int) -> list[Group] | None:
        """Step ``step``'s batch, oldest admitted first, or None while it must wait.

        It waits while a due group is unfinished, while fewer than n groups are kept and more can
        come, or while taking the n oldest kept groups would leave a deadline unmeetable (see the
        module docstring). A batch shorter than n (possibly empty) comes only when nothing more can.
        """
        due = self.due(step)
        if any(g.v_end is None for g in due):
            return None
        ready = sorted((g for g in self.groups.values() if g.kept), key=lambda g: g.gid)
        n = self.groups_per_step
        if len(ready) < n and self.more_can_come():
            return None
        batch = ready[:n]
        left = [g for g in self.groups.values() if g not in batch]
        if not self.meets_deadlines(left, step) and self.running > 0:
            return None
        if any(g not in batch for g in due):
            raise AssertionError(
                f"staleness bound broken at step {step}: {len(due)} due groups, batch of {n}"
            )
        for g in batch:
            g.trained_at = step
            del self.groups[g.gid]
        return batch

    def meets_deadlines(self, left: Sequence[Group], step: int) -> bool:
        """Whether ``left`` (untrained after step ``step``) can still all train within K steps of
        their admission: for u in ``step + 1 - K .. step - 1``, at most ``(u + K - step) * n`` of them
        have ``v_start <= u``."""
        k, n = self.max_staleness, self.groups_per_step
        starts = sorted(g.v_start for g in left)
        for u in range(step + 1 - k, step):
            if sum(1 for v in starts if v <= u) > (u + k - step) * n:
                return False
        return True

    def trained(self) -> None:
        """An optimizer step was applied and its weights synced: v <- v + 1."""
        self.version += 1

    def close(self) -> list[Group]:
        """The run ended: every group not trained is dropped with reason ``run_end``; returned."""
        left = sorted(self.groups.values(), key=lambda g: g.gid)
        for g in left:
            self._drop(g, "run_end")
        return left

    def pending_seeds(self) -> list[int]:
        """Seeds admitted and neither trained nor dropped, oldest first (a checkpoint keeps them:
        a resumed run plays them again before it takes new problems)."""
        return [g.seed for g in sorted(self.groups.values(), key=lambda g: g.gid)]


def staleness_metrics(step: int, batch: Sequence[Group]) -> dict[str, float | None]:
    """Per-step metrics of the groups step ``step`` trained on.

    ``async/staleness_mean`` / ``_max``: mean and max of ``step - v_start``; ``async/span_mean``
    / ``_max``: of ``v_end - v_start``. None for an empty batch (nothing was trained).
    """
    if not batch:
        return dict.fromkeys(
            ("async/staleness_mean", "async/staleness_max", "async/span_mean", "async/span_max")
        )
    st = [staleness(step, g.v_start) for g in batch]
    spans = [g.span for g in batch]
    return {
        "async/staleness_mean": sum(st) / len(st),
        "async/staleness_max": float(max(st)),
        "async/span_mean": sum(spans) / len(spans),
        "async/span_max": float(max(spans)),
    }


def count_metrics(s: Scheduler) -> dict[str, float]:
    """The scheduler's counts: admitted and dropped (totals), running and queued (now), capacity (now)."""
    return {
        "async/admitted": float(s.admitted),
        "async/running": float(s.running),
        "async/queued": float(s.queued),
        "async/dropped": float(s.dropped),
        "async/capacity": float(s.capacity()),
        "async/version": float(s.version),
    }


def idle_shares(trainer_wait_s: float, generator_wait_s: float, wall_s: float) -> dict[str, float]:
    """Shares of a step's wall time the trainer waited for data and the generator waited for weights
    (a sync, or no capacity to admit and nothing running): ``wait / wall``, 0 for a zero-length step."""
    if min(trainer_wait_s, generator_wait_s, wall_s) < 0:
        raise ValueError("wait and wall times must be >= 0")
    wall = max(wall_s, 1e-12)
    return {
        "async/trainer_wait_fraction": min(trainer_wait_s / wall, 1.0),
        "async/generator_wait_fraction": min(generator_wait_s / wall, 1.0),
    }


def histogram(values: Sequence[int], top: int) -> list[int]:
    """Counts of 0, 1, ..., ``top`` in ``values`` (a value above ``top`` is an error: the bound broke)."""
    counts = [0] * (top + 1)
    for v in values:
        if not 0 <= v <= top:
            raise ValueError(f"value {v} outside 0..{top}")
        counts[v] += 1
    return counts
