"""Data parallelism for the training loop: several processes, one model copy each, same weights.

(``train.parallel: fsdp`` runs the same split with the weights sharded instead of copied:
:mod:`veriloop.algos.run.fsdp`.)

Launch with ``accelerate launch --num_processes N -m veriloop.cli.main train ...`` or ``torchrun``;
both set ``RANK`` / ``WORLD_SIZE`` / ``MASTER_ADDR`` / ``MASTER_PORT``, which is all we read. A
plain ``python`` run is one process and nothing here communicates.

How a step is split (see ``algos/loop/train.py``)::

    groups of the step       g0 g1 g2 g3          (env seeds next_seed .. next_seed + 3)
    rank r rolls out         g_r, g_{r+W}, ...    (its own seeds; its own sampling generator)
    all_gather               every rank holds g0 g1 g2 g3 in seed order
    advantages, mini-batch order: computed identically on every rank (same data, same generator)
    each mini-batch          rank r trains rows r, r+W, ...; gradients summed with all_reduce,
                             each rank's share weighted by its fraction of the mini-batch's tokens
                             (token-mean loss) or sequences (sequence-mean losses)

The summed gradient equals the single-process gradient of the whole mini-batch, so clipping, the
non-finite check and AdamW see the same numbers on every rank and the weights stay identical.
Only rank 0 writes logs, evaluates and saves checkpoints.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from veriloop.algos.learner.batch import TokenBatch
from veriloop.algos.maths.mismatch import MismatchStats

T = TypeVar("T")

#: Update metrics only some objectives compute (``update.policy_loss``'s optional keys): every rank
#: reduces them, so a rank without training tokens, which computed none, still joins the collective.
OPTIONAL_METRICS = (
    "cov_frac",
    "distill/reverse_kl",
    "distill/teacher_better_frac",
    "distill/trust_masked_frac",
    "distill/ratio_capped_frac",
)


@dataclass(frozen=True)
class DistContext:
    """Who this process is among the data-parallel workers.

    Attributes:
        rank: This process's index, 0 .. world_size - 1.
        world_size: Number of processes (1 = not distributed).
        sharded: ``train.parallel: fsdp``: the weights, gradients and optimizer state are sharded
            over the ranks (:mod:`veriloop.algos.run.fsdp`) instead of copied on each.
    """

    rank: int = 0
    world_size: int = 1
    sharded: bool = False

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        """Rank 0 logs, evaluates and checkpoints."""
        return self.rank == 0

    def shard(self, items: Sequence[T]) -> list[T]:
        """This rank's items: ``items[rank::world_size]``."""
        return list(items[self.rank :: self.world_size])

    def gather_shards(self, mine: Sequence[T]) -> list[T]:
        """Inverse of :meth:`shard` across ranks: every rank gets all items in the original order."""
        if not self.enabled:
            return list(mine)
        parts: list[Any] = [None] * self.world_size
        torch.distributed.all_gather_object(parts, list(mine))
        out: list[T] = []
        for i in range(max(len(p) for p in parts)):
            out += [p[i] for p in parts if i < len(p)]
        return out

    def barrier(self) -> None:
        if self.enabled:
            torch.distributed.barrier()

    def broadcast_object(self, obj: T) -> T:
        """Rank 0's ``obj`` on every rank."""
        if not self.enabled:
            return obj
        box = [obj]
        torch.distributed.broadcast_object_list(box, src=0)
        return box[0]

    def broadcast_params(self, params: Sequence[torch.Tensor]) -> None:
        """Copy rank 0's values into ``params`` on every rank (start from identical weights)."""
        if not self.enabled:
            return
        with torch.no_grad():
            for p in params:
                torch.distributed.broadcast(p.data, src=0)

    def update_kwargs(self, mini_batch: Any) -> dict[str, Any]:
        """``update_step`` arguments for this rank's part of ``mini_batch`` (a ``TokenBatch``).

        One process: none. Several: the summing of the ranks' gradients, an all-reduce (data
        parallel) or, sharded, the backward's own reduce-scatter plus micro-batches in lockstep
        (``fsdp``). The caller adds the whole mini-batch's loss normalisers
        (``step_settings.loss_normalisers``), so the ranks' gradients just add up.
        """
        if not self.enabled:
            return {}
        if self.sharded:
            sync = {
                "on_before_step": agree_finite(self.world_size),
                "pad_micro_batches": lockstep(self.world_size, mini_batch),
            }
        else:
            sync = {"on_before_step": self.grad_sync(1.0)}
        return {**sync, "merge_metrics": self.merge_step_metrics}

    def merge_step_metrics(
        self, sums: dict[str, float], mismatch: MismatchStats | None
    ) -> tuple[dict[str, float], MismatchStats | None]:
        """One optimizer step's metrics over every rank: each rank's ``sums`` are its part of the
        mini-batch's (losses in the mini-batch's units, rates weighted by its share of the tokens),
        so they add up; the sampler-vs-trainer mismatch adds its counts and keeps the extremes.
        A metric some rank did not compute (no training tokens there) counts as 0 on it; one no
        rank computed stays out. Every rank calls this once per step (two all-reduces)."""
        if not self.enabled:
            return sums, mismatch
        names = sorted(sums.keys() | set(OPTIONAL_METRICS))
        flat = torch.tensor(
            [[sums.get(k, 0.0) for k in names], [float(k in sums) for k in names]], dtype=torch.float64
        )
        torch.distributed.all_reduce(flat)
        merged = {k: float(flat[0, i]) for i, k in enumerate(names) if flat[1, i] > 0}
        if mismatch is None:
            return merged, None
        m = mismatch
        counts = torch.tensor([m.tokens, m.k3_sum, m.abs_log_sum, m.outside], dtype=torch.float64)
        extremes = torch.tensor([m.log_ratio_max, -m.log_ratio_min], dtype=torch.float64)
        torch.distributed.all_reduce(counts)
        torch.distributed.all_reduce(extremes, op=torch.distributed.ReduceOp.MAX)
        c, e = counts.tolist(), extremes.tolist()
        return merged, MismatchStats(c[0], c[1], c[2], c[3], e[0], -e[1])

    def grad_sync(self, weight: float) -> Callable[[list[torch.nn.Parameter], bool], bool]:
        """A ``update_step(on_before_step=...)`` hook: sum ``weight * grad`` over ranks.

        ``weight`` is this rank's share of the mini-batch's loss normaliser (its tokens / all
        tokens, or its sequences / all sequences), so the sum is the whole mini-batch's gradient.
        Parameters without a gradient on this rank (it had no training tokens) take part as zeros,
        so every rank makes the same collective calls. Returns whether every rank's loss was finite:
        one rank's NaN makes all ranks skip the step together.
        """

        def sync(params: list[torch.nn.Parameter], finite: bool) -> bool:
            if not self.enabled:
                return finite
            grads = []
            for p in params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                grads.append(p.grad.mul_(weight))
            flat = torch.cat([g.reshape(-1) for g in grads])  # one collective, not one per tensor
            torch.distributed.all_reduce(flat)
            offset = 0
            for g in grads:
                g.copy_(flat[offset : offset + g.numel()].view_as(g))
                offset += g.numel()
            ok = torch.tensor([0.0 if finite else 1.0])
            torch.distributed.all_reduce(ok)
            return bool(ok.item() == 0.0)

        return sync


# ------------------------------------------------------------------ the sharded update's collectives


def lockstep(world_size: int, mini_batch: TokenBatch) -> Callable[[list[TokenBatch]], list[TokenBatch]]:
    """``update_step(pad_micro_batches=...)``: this rank's micro-batches, padded to every rank's count.

    The padding micro-batches are row 0 of ``mini_batch`` with an empty loss mask: their loss is
    0, they add nothing to the gradient, and they run the forward/backward collectives that the
    rank with the most micro-batches runs. Collective (one all-reduce) when ``world_size > 1``.
    """

    def pad(micro: list[TokenBatch]) -> list[TokenBatch]:
        count = torch.tensor([len(micro)])
        if world_size > 1:
            torch.distributed.all_reduce(count, op=torch.distributed.ReduceOp.MAX)
        missing = int(count.item()) - len(micro)
        return micro + [empty_like_row(mini_batch)] * missing

    return pad


def empty_like_row(batch: TokenBatch) -> TokenBatch:
    """Row 0 of ``batch`` with nothing to learn: loss mask and advantages zero."""
    row = batch.select(slice(0, 1))
    return dataclasses.replace(
        row, loss_mask=torch.zeros_like(row.loss_mask), advantages=torch.zeros_like(row.advantages)
    )


def agree_finite(world_size: int) -> Callable[[list[torch.nn.Parameter], bool], bool]:
    """``update_step(on_before_step=...)`` under FSDP: the gradients are already summed (by the
    backward's reduce-scatter), so only the ranks' "my loss was finite" flags are combined: one
    rank's NaN makes every rank skip the step together."""

    def hook(params: list[torch.nn.Parameter], finite: bool) -> bool:
        if world_size <= 1:
            return finite
        bad = torch.tensor([0.0 if finite else 1.0])
        torch.distributed.all_reduce(bad)
        return bool(bad.item() == 0.0)

    return hook


def init_distributed(backend: str | None = None, timeout_s: float = 1800.0) -> DistContext:
    """Join the process group that ``accelerate launch`` / ``torchrun`` describe in the environment.

    Returns ``DistContext()`` (rank 0 of 1) when ``WORLD_SIZE`` is unset or 1. The backend is
    ``gloo`` unless given (or named by ``VERILOOP_DIST_BACKEND``, e.g. ``nccl`` with
    ``policy.device`` on GPUs): gloo sends CPU tensors, and CUDA ones through host memory.
    """
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return DistContext()
    rank = int(os.environ.get("RANK", "0"))
    missing = [k for k in ("MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if missing:
        raise RuntimeError(
            f"WORLD_SIZE={world} but {', '.join(missing)} is not set: start the run with "
            "`accelerate launch --num_processes N ...` or `torchrun --nproc_per_node N ...`"
        )
    if not torch.distributed.is_initialized():
        chosen = backend or os.environ.get("VERILOOP_DIST_BACKEND", "gloo")
        torch.distributed.init_process_group(
            chosen, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=timeout_s)
        )
    return DistContext(rank=torch.distributed.get_rank(), world_size=torch.distributed.get_world_size())


def shutdown_distributed(ctx: DistContext) -> None:
    """Leave the process group (call once, at the end of training)."""
    if ctx.enabled and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def check_params_equal(ctx: DistContext, params: Sequence[torch.Tensor]) -> bool:
    """True when every rank holds bitwise the same ``params`` (compares a checksum; for tests/debug)."""
    if not ctx.enabled:
        return True
    flat = torch.cat([p.detach().reshape(-1).double() for p in params])
    mine = torch.stack([flat.sum(), (flat * torch.arange(1, flat.numel() + 1, dtype=flat.dtype)).sum()])
    lo, hi = mine.clone(), mine.clone()
    torch.distributed.all_reduce(lo, op=torch.distributed.ReduceOp.MIN)
    torch.distributed.all_reduce(hi, op=torch.distributed.ReduceOp.MAX)
    return bool(torch.equal(lo, hi))
