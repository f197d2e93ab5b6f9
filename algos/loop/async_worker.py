"""The generation worker of asynchronous training: a thread beside the trainer that keeps sampling.

It plays episodes turn by turn with continuous batching: every loop it admits new groups while
the :class:`~veriloop.algos.loop.staleness.Scheduler` has capacity, samples one turn for every running
episode (one batched call per weight version), steps the environments, and hands each group to
the scheduler as soon as its last episode ends. Episodes are started and their turns played by
``veriloop.agents.engine.Player``, as the synchronous ``rollout`` plays them: the same prompt,
token and limit handling, per-turn reserve and ``rollout.compaction``.

Weights, by engine:

* HF engine (:class:`HFWeights`): the worker samples with its own copy of the model. After each
  optimizer step the trainer publishes a snapshot of the trained weights (version v + 1). Full
  weights: the worker loads the newest snapshot between two turns (pause, sync, resume), running
  episodes continue under it and record ``v_end``. LoRA: each episode keeps the adapter version
  it started with; the worker holds every version a running episode uses plus the newest (at
  most K + 2) and loads the right adapter before each version's batch.
* vLLM in-process and vLLM servers (:class:`LiveWeights`): the engine holds one version. The
  trainer pauses the worker between two turns, pushes its weights with the backend's ``sync``
  (which also resets vLLM's prefix cache) and resumes it; running episodes continue under the new
  weights (LoRA included) and record ``v_end``.

Caches are keyed by version: the HF engine's per-episode KV cache key is ``(episode, version)``,
so a new version never reuses keys/values computed under an old one (full weights: the old
entries are released at the load); vLLM resets its prefix cache at every sync.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field, replace

import torch

from veriloop.agents.backends import Backend, GenRequest, GenResult
from veriloop.agents.backends.base import ServingBackend
from veriloop.agents.chat import ChatFormat
from veriloop.agents.compaction import Compactor
from veriloop.agents.engine import EpisodeSpec, Player, RolloutLimits, _Episode
from veriloop.agents.policy import Policy
from veriloop.agents.sampling_params import SamplingParams
from veriloop.agents.trajectory import Trajectory
from veriloop.algos.loop.staleness import Group, Scheduler

#: ``group trajectories -> whether the group teaches something`` (``signal.group_informative`` of
#: the learning signals): asked once per group, when it finishes.
Judge = Callable[[list[Trajectory]], bool]


@dataclass
class Finished:
    """A group that finished playing, kept or dropped: its episodes and whether it is informative."""

    trajs: list[Trajectory]
    informative: bool

    def drop_reason(self, drop_uninformative: bool) -> str | None:
        """Why the group is not trained (``uninformative`` under dynamic sampling), or None: kept."""
        return "uninformative" if drop_uninformative and not self.informative else None


class HFWeights:
    """The HF engine's own copy of the policy and the weight versions it may sample with.

    Args:
        policy: the trainer's policy (copied once here; the copy never trains).
        version: the version its weights are (a resumed run's step).
    """

    def __init__(self, policy: Policy, version: int = 0) -> None:
        from veriloop.agents.backends.hf import HFBackend

        self.lora = policy.is_lora
        names = [n for n, p in policy.model.named_parameters() if p.requires_grad]
        self.policy = policy.frozen_copy()
        params = dict(self.policy.model.named_parameters())
        self.params = {n: params[n] for n in names}  # the trained tensors, in the copy
        self.backend: Backend = HFBackend(self.policy)
        self.snapshots = {version: {n: p.detach().clone() for n, p in self.params.items()}}
        self.loaded = version
        self.most_held = 1
        self._lock = threading.Lock()

    def publish(self, version: int, policy: Policy) -> None:
        """Trainer thread, after an optimizer step: keep a copy of the trained weights as ``version``."""
        snap = {n: p.detach().clone() for n, p in policy.model.named_parameters() if p.requires_grad}
        with self._lock:
            self.snapshots[version] = snap
            self.most_held = max(self.most_held, len(self.snapshots))

    def newest(self) -> int:
        with self._lock:
            return max(self.snapshots)

    def load(self, version: int) -> None:
        """Worker thread: put ``version``'s weights into the copy (between two generation calls)."""
        if version == self.loaded:
            return
        with self._lock:
            snap = self.snapshots[version]
        with torch.no_grad():
            for name, tensor in snap.items():
                self.params[name].copy_(tensor)
        self.loaded = version

    def keep_only(self, versions: set[int]) -> None:
        """Forget every snapshot but ``versions`` and the newest (one sync past its last use)."""
        with self._lock:
            newest = max(self.snapshots)
            for v in [v for v in self.snapshots if v not in versions and v != newest]:
                del self.snapshots[v]


class LiveWeights:
    """An engine with its own weights (vLLM in-process or servers).

    Full weights (and LoRA merged into them): the engine holds one version; the trainer pauses the
    worker and calls ``backend.sync()``. LoRA served as adapters (``lora``: vLLM servers, or
    in-process with ``lora_sync: adapter``): every sync adds a new adapter and the engine keeps the
    last K + 2; each request names its episode's version (``backend.pin``), so nothing pauses and
    episodes never mix adapter versions.
    """

    def __init__(self, backend: ServingBackend, version: int = 0, max_staleness: int = 0) -> None:
        self.backend = backend
        self.loaded = version
        self.lora = backend.serves_adapter
        self.keep = max_staleness + 2
        self.names: dict[int, str] = {version: backend.model_name} if self.lora else {}
        if self.lora:
            backend.keep_adapters = self.keep
        self.most_held = 1

    def load(self, version: int) -> None:
        """Nothing to load: each request names its adapter version (``backend.pin``)."""

    def served(self, version: int) -> None:
        """Trainer thread, after ``backend.sync()``: the adapter just loaded is ``version``."""
        self.names[version] = self.backend.model_name
        for old in [v for v in self.names if v <= version - self.keep]:
            del self.names[old]  # unloaded by the servers
        self.most_held = max(self.most_held, len(self.names))

    def keep_only(self, versions: set[int]) -> None:
        """The servers unload old adapters themselves (``keep_adapters``)."""


@dataclass
class Running:
    """One admitted group's episodes while they play."""

    gid: int
    version: int  # LoRA on the HF engine: the adapter version all its episodes sample with
    episodes: list[_Episode]
    last_version: int = 0  # the version its latest turn was sampled with


@dataclass
class WorkerClock:
    """Seconds the worker waited (nothing to play, or paused for a sync), since the trainer last read it."""

    waited_s: float = 0.0
    turns: int = 0


@dataclass
class GenerationWorker:
    """Admits, plays and hands over groups on its own thread (see the module docstring).

    Every scheduler access holds ``cond`` (a ``threading.Condition``), which the trainer shares.
    ``pending`` seeds (a resumed run's unfinished groups) are admitted before the cursor moves on.
    """

    sched: Scheduler
    cond: threading.Condition
    weights: HFWeights | LiveWeights
    specs: Callable[[int], list[EpisodeSpec]]  # seed -> the group's episodes
    judge: Judge
    fmt: ChatFormat
    eos: Sequence[int]
    sampling: SamplingParams
    limits: RolloutLimits
    cursor: int  # the next new problem's seed
    drop_uninformative: bool = False  # dynamic sampling: an uninformative group is dropped, not trained
    compactor: Compactor | None = None  # ``rollout.compaction``, as the synchronous rollout applies it
    pending: list[int] = field(default_factory=list)
    on_drop: Callable[[Group], None] = lambda group: None  # called under ``cond``
    clock: WorkerClock = field(default_factory=WorkerClock)
    error: BaseException | None = None
    finished: list[Finished] = field(default_factory=list)  # every group finished since the trainer last read
    _running: dict[int, Running] = field(default_factory=dict)
    _keys: int = 0
    _stop: bool = False
    _pause: bool = False
    _paused: bool = False
    _thread: threading.Thread | None = None

    def start(self) -> None:
        self._route = _Versioned(self.weights)
        self._player = Player(
            self._route,
            self.fmt,
            self.eos,
            self.sampling,
            self.limits,
            torch.Generator().manual_seed(self.sampling.seed),
            self.compactor,
        )
        self._thread = threading.Thread(target=self._main, name="veriloop-generation", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Finish the current turn, then end the thread; close every running episode's environment."""
        with self.cond:
            self._stop = True
            self.cond.notify_all()
        if self._thread is not None:
            self._thread.join()
        for group in self._running.values():
            for ep in group.episodes:
                ep.env.close()

    # ---- trainer side ----------------------------------------------------------------------

    def pause(self) -> None:
        """Block until the worker is between two turns and holds there (trainer: before a live sync)."""
        with self.cond:
            self._pause = True
            self.cond.notify_all()
            while (
                not self._paused
                and self.error is None
                and self._thread is not None
                and self._thread.is_alive()
            ):
                self.cond.wait(0.5)
            self._raise()

    def resume(self) -> None:
        with self.cond:
            self._pause = False
            self.cond.notify_all()

    def wait_batch(self, step: int) -> tuple[list[Group], float]:
        """Step ``step``'s groups from the scheduler (waiting as it says); returns them and the wait."""
        t0 = time.perf_counter()
        with self.cond:
            while True:
                self._raise()
                batch = self.sched.take(step)
                if batch is not None:
                    self.cond.notify_all()
                    return batch, time.perf_counter() - t0
                self.cond.wait(0.5)

    def _raise(self) -> None:
        if self.error is not None:
            raise RuntimeError(f"the generation worker failed: {self.error!r}") from self.error

    # ---- worker side -----------------------------------------------------------------------

    def _main(self) -> None:
        try:
            while True:
                with self.cond:
                    if not self._hold():
                        return
                    admitted = self._admit()
                self._start_groups(admitted)
                if self._running:
                    self._turn()
        except BaseException as err:  # handed to the trainer, which raises it
            with self.cond:
                self.error = err
                self.cond.notify_all()

    def _hold(self) -> bool:
        """Under ``cond``: wait while paused or with nothing to play and no capacity; False = stop."""
        t0 = time.perf_counter()
        while not self._stop:
            if self._pause:
                self._paused = True
                self.cond.notify_all()
            elif self._running or self.sched.capacity() > 0 and self._more():
                break
            self.cond.wait(0.5)
        self._paused = False
        self.clock.waited_s += time.perf_counter() - t0
        return not self._stop

    def _more(self) -> bool:
        return bool(self.pending) or self.sched.budget is None or self.sched.admitted < self.sched.budget

    def _admit(self) -> list[tuple[int, int, int]]:
        """Under ``cond``: admit groups while there is capacity; (gid, seed, version) of each."""
        out = []
        while self.sched.capacity() > 0:
            if self.pending:
                seed = self.pending.pop(0)
            else:
                seed, self.cursor = self.cursor, self.cursor + 1
            g = self.sched.admit(seed)
            out.append((g.gid, seed, g.v_start))
        return out

    def _start_groups(self, admitted: list[tuple[int, int, int]]) -> None:
        """Reset the environments of newly admitted groups (outside the lock: envs may be slow)."""
        if isinstance(self.weights, HFWeights) and not self.weights.lora and admitted:
            self._load_newest()
        for gid, seed, version in admitted:
            eps = []
            for spec in self.specs(seed):
                eps.append(self._player.start(self._keys, spec))
                self._keys += 1
            self._running[gid] = Running(gid, version, eps, last_version=version)

    def _load_newest(self) -> None:
        """HF, full weights: the newest published version, between two turns; old KV entries go."""
        w = self.weights
        assert isinstance(w, HFWeights)
        newest = w.newest()
        if newest != w.loaded:
            old = w.loaded
            for group in self._running.values():
                for ep in group.episodes:
                    w.backend.release((ep.key, old))
            w.load(newest)
            w.keep_only({newest})

    def _turn(self) -> None:
        """One turn of every running episode: one batched call per weight version."""
        w = self.weights
        if isinstance(w, HFWeights) and not w.lora:
            self._load_newest()
        by_version: dict[int, list[_Episode]] = {}
        for group in self._running.values():
            version = group.version if w.lora else w.loaded
            group.last_version = version
            by_version.setdefault(version, []).extend(ep for ep in group.episodes if not ep.done)
        for version, eps in sorted(by_version.items()):
            if w.lora:
                w.load(version)  # the adapter this group started with (servers: named per request)
            self._play(eps, version)
        self.clock.turns += 1
        self._hand_over()
        if w.lora:
            w.keep_only({g.version for g in self._running.values()})

    def _play(self, eps: list[_Episode], version: int) -> None:
        """One turn of ``eps`` under weight ``version``: the engine's own turn (``Player.turn``),
        every request (compaction replies included) keyed, and pinned, to that version."""
        self._route.version = version
        self._player.turn(eps)

    def _hand_over(self) -> None:
        """Every group whose episodes all ended goes to the scheduler, judged once (``judge``): kept, or
        dropped as ``uninformative`` under dynamic sampling."""
        done = [g for g in self._running.values() if all(ep.done for ep in g.episodes)]
        finished = []
        for group in done:
            trajs = [ep.trajectory() for ep in group.episodes]
            for ep in group.episodes:
                ep.env.close()
            del self._running[group.gid]
            finished.append((group.gid, Finished(trajs, self.judge(trajs)), group.last_version))
        if not finished:
            return
        with self.cond:
            for gid, fin, v_end in finished:
                reason = fin.drop_reason(self.drop_uninformative)
                g = self.sched.finish(gid, keep=reason is None, reason=reason, payload=fin.trajs, v_end=v_end)
                if reason is not None:
                    self.on_drop(g)
                self.finished.append(fin)
            self.cond.notify_all()

    @property
    def running_versions(self) -> list[int]:
        return sorted({g.version for g in self._running.values()})


class _Versioned:
    """The engine as one weight version's episodes see it: every request's cache key carries the
    version (``_cache_key``), and on an engine serving adapters it is pinned to that version's
    adapter (``backend.pin``); ``version`` is set before each version's turn."""

    def __init__(self, weights: HFWeights | LiveWeights) -> None:
        self.weights, self.version = weights, weights.loaded

    def generate(
        self, requests: Sequence[GenRequest], sampling: SamplingParams, generator: torch.Generator
    ) -> list[GenResult]:
        w = self.weights
        keyed = [replace(r, key=_cache_key(r.key, self.version)) for r in requests]
        if isinstance(w, LiveWeights) and w.lora:
            for r in keyed:
                w.backend.pin(r.key, w.names[self.version])
        return w.backend.generate(keyed, sampling, generator)

    def release(self, key: Hashable) -> None:
        self.weights.backend.release(_cache_key(key, self.version))


def _cache_key(key: Hashable, version: int) -> tuple[Hashable, int]:
    """An episode's KV-cache key under one weight version: a new version never reuses the old entry."""
    return (key, version)
