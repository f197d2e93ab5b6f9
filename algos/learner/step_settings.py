"""How one optimizer step runs: the settings read from the config once (:class:`UpdateSettings`), what
several ranks add to it (:class:`RankSync`; one process: :data:`NO_SYNC`), and each rank's loss
normalisers for a data-parallel mini-batch (:func:`loss_normalisers`). ``update.update_step`` takes them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from veriloop.algos.learner.algorithm import Algorithm
from veriloop.algos.learner.batch import TokenBatch
from veriloop.algos.maths.losses import sequence_count
from veriloop.algos.maths.mismatch import MismatchStats
from veriloop.configs.schema import ExperimentConfig


def loss_normalisers(batch: TokenBatch, algo: Algorithm | None = None) -> dict[str, float]:
    """``update_step(**loss_normalisers(mini_batch))`` on each data-parallel rank: the whole
    mini-batch's token and sequence counts, so every rank's loss (policy *and* value) is already
    in the mini-batch's units and the ranks' gradients are simply summed (``grad_sync(1.0)``).
    Weighting each rank by one share instead cannot be right for both the sequence-normalised
    policy loss and the token-normalised value loss at once. With ``algo``'s ``sequence_unit="turn"``
    a sequence is an (episode, turn) pair; with ``batch.episode_index`` the rows of one episode count
    once (``split_weight="episode"``)."""
    segments = batch.turn_index if algo is not None and algo.per_turn_segments else None
    return {
        "global_tokens": float(batch.loss_mask.sum()),
        "global_seqs": float(sequence_count(batch.loss_mask, segments, batch.episode_index)),
    }


@dataclass(frozen=True)
class UpdateSettings:
    """How one optimizer step runs, read from the config once (:meth:`from_config`).

    Attributes:
        micro_batch_size: rows per forward/backward pass (gradient accumulation over the rest).
        max_grad_norm: global gradient-norm clip (``inf`` = none; the norm is still reported).
        micro_batch_tokens: at most this many padded tokens per micro-batch (0 = no cap).
        max_new_tokens: ``seq_sum_constant``'s divisor when ``algo.loss_agg_constant`` is None.
        temperature: the rollout's sampling temperature (see ``policy_loss``).
    """

    micro_batch_size: int
    max_grad_norm: float
    micro_batch_tokens: int = 0
    max_new_tokens: int | None = None
    temperature: float = 1.0

    @classmethod
    def from_config(cls, cfg: ExperimentConfig) -> UpdateSettings:
        """``train``'s micro-batching and clipping, ``rollout``'s token limit and temperature."""
        return cls(
            micro_batch_size=cfg.train.micro_batch_size,
            max_grad_norm=cfg.train.max_grad_norm or float("inf"),
            micro_batch_tokens=cfg.train.micro_batch_tokens,
            max_new_tokens=cfg.rollout.max_new_tokens,
            temperature=cfg.rollout.temperature,
        )


@dataclass(frozen=True)
class RankSync:
    """What several ranks add to one optimizer step (one process: the defaults, nothing).

    Attributes:
        on_before_step: ``(params, finite) -> finite``, run after the last backward and before
            clipping (data parallelism: the gradient all-reduce, ``DistContext.grad_sync``).
        global_tokens, global_seqs: the loss normalisers when the batch is this rank's part of a
            larger mini-batch (``loss_normalisers``); None = the batch's own counts.
        pad_micro_batches: sharded training (``fsdp.lockstep``: every pass is a collective, so all
            ranks run as many, also without training tokens or after a non-finite loss).
        merge_metrics: ``(sums, mismatch) -> (sums, mismatch)`` over the ranks
            (``DistContext.merge_step_metrics``), so the logged losses, rates and mismatch are the
            whole mini-batch's, as one process logs them, not this rank's part.
    """

    on_before_step: Callable[[list[torch.nn.Parameter], bool], bool] | None = None
    global_tokens: float | None = None
    global_seqs: float | None = None
    pad_micro_batches: Callable[[list[TokenBatch]], list[TokenBatch]] | None = None
    merge_metrics: (
        Callable[[dict[str, float], MismatchStats | None], tuple[dict[str, float], MismatchStats | None]]
        | None
    ) = None


NO_SYNC = RankSync()
