"""The update of one batch: advantages once per rollout, then ``algo.epochs`` passes of mini-batch
updates (``train_on_batch``), and the metrics it returns. The loop hands it a step's episodes,
whichever source played them; it never asks where they came from.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from veriloop.agents.policy import Policy
from veriloop.agents.teacher import score_with_teacher
from veriloop.agents.trajectory import Trajectory
from veriloop.algos.learner.algorithm import Algorithm, resolve
from veriloop.algos.learner.batch import TokenBatch, minibatches, rank_rows, with_teacher
from veriloop.algos.learner.critic import ValueModel
from veriloop.algos.learner.prepare import prepare_batch
from veriloop.algos.learner.step_settings import NO_SYNC, RankSync, UpdateSettings, loss_normalisers
from veriloop.algos.learner.update import METRIC_NAMES, select_tokens, update_step
from veriloop.algos.maths.mismatch import NAMES as MISMATCH_NAMES
from veriloop.algos.maths.mismatch import MismatchStats
from veriloop.algos.run.distributed import DistContext
from veriloop.configs.schema import ExperimentConfig

#: One process, no data parallelism (``train_on_batch``'s default).
SINGLE_PROCESS = DistContext()


def kl_to_reference(batch: TokenBatch) -> float | None:
    """Approximate KL(pi_old || pi_ref) over the sampled tokens (k3 estimator, Schulman 2020):
    mean over loss-mask tokens of exp(d) - d - 1 with d = log pi_ref - log pi_old. None without a
    reference (the metric is then written as null, never as a made-up 0)."""
    if batch.ref_logprobs is None:
        return None
    m = batch.loss_mask.bool()  # [B, T]
    d = (batch.ref_logprobs - batch.old_logprobs).double()[m]
    return float((d.exp() - d - 1).mean()) if d.numel() else 0.0


def train_on_batch(
    cfg: ExperimentConfig,
    policy: Policy,
    critic: ValueModel | None,
    optimizer: torch.optim.Optimizer,
    trajs: list[Trajectory],
    generator: torch.Generator,
    dist: DistContext = SINGLE_PROCESS,
    algo: Algorithm | None = None,
) -> dict[str, float | None]:
    """Advantages once per rollout, then ``algo.epochs`` passes of mini-batch updates.

    Every rank holds the whole batch (same advantages, same mini-batch order); with several
    ranks each trains rows ``rank::world`` of a mini-batch and the gradients are summed.
    ``algo``: ``cfg.algo`` already resolved (``train`` does it once); None = resolve it here.
    """
    algo = resolve(cfg.algo) if algo is None else algo
    pad = policy.tokenizer.pad_token_id or 0
    # the one reference path: Policy.reference (frozen copy, or LoRA with the adapter disabled)
    ref_ctx = policy.reference if cfg.algo.needs_reference else None
    policy.model.eval()  # reference / old values without dropout
    r = cfg.rollout
    # top-k / top-p: the recorded log-probs are of the filtered distribution; take the model's own
    truncated = r.top_k > 0 or r.top_p < 1.0
    # collated once: every tensor of the batch is [N, T] (N episodes, T the longest), see TokenBatch
    batch, adv_metrics = prepare_batch(
        trajs,
        algo,
        model=policy.model,
        critic=critic,
        pad_id=pad,
        ref_model_ctx=ref_ctx,
        temperature=r.temperature,
        recompute_old_logprobs=truncated,
    )
    t_teacher = None
    if cfg.algo.distill_coef > 0:  # on-policy distillation: a teacher scores the student's own tokens
        t0 = time.perf_counter()
        batch = with_teacher(
            batch,
            score_with_teacher(
                policy,
                trajs,
                teacher=cfg.algo.distill_teacher,
                teacher_model=cfg.algo.distill_teacher_model,
                temperature=r.temperature,
                micro_batch=cfg.train.micro_batch_size,
            ),
        )
        t_teacher = time.perf_counter() - t0
    policy.model.train()
    sums: dict[str, float] = {}
    updates = 0
    # sampler vs trainer, measured in the first update's forward passes, unless prepare_batch did
    # (pi_old recomputed for the rollout correction) or it cannot be measured (top-k / top-p)
    measure = not truncated and not cfg.algo.needs_old_recompute
    mismatch: list[MismatchStats] = []
    settings = UpdateSettings.from_config(cfg)
    per_mb = -(-cfg.mini_batch_size * batch.size // len(trajs))  # rows: a split episode is several
    for _ in range(cfg.algo.epochs):
        for mb in minibatches(batch, per_mb, shuffle=generator):
            mb = select_tokens(mb, algo)  # Clip-Cov / KL-Cov: chosen over the mini-batch, all ranks alike
            part = rank_rows(mb, dist.rank, dist.world_size) if dist.enabled else mb  # whole episodes
            sync = NO_SYNC
            if dist.enabled:  # every rank's loss in the whole mini-batch's units: gradients just add up
                norm = loss_normalisers(mb, algo)
                sync = RankSync(
                    **dist.update_kwargs(mb),
                    global_tokens=norm["global_tokens"],
                    global_seqs=norm["global_seqs"],
                )
            m = update_step(
                policy.model,
                optimizer,
                part,
                algo,
                settings,
                ref_model_ctx=ref_ctx,
                critic=critic,
                sync=sync,
                mismatch=mismatch if updates == 0 and measure else None,
            )
            for k, v in m.items():
                sums[k] = sums.get(k, 0.0) + v
            updates += 1
    policy.model.eval()
    out: dict[str, float | None] = {k: v / max(updates, 1) for k, v in sums.items()}  # means over updates
    out["skipped"] = sums.get("skipped", 0.0)  # count, not mean
    out["updates"] = float(updates)
    out["train_tokens"] = float(batch.loss_mask.sum())
    out["kl_ref"] = kl_to_reference(batch)  # None without a reference: logged as null
    if t_teacher is not None:  # part of time/train_s: the teacher's forward passes
        out["time/teacher_s"] = t_teacher
    drift = cfg.algo.frozen_sampler
    return merge_metrics(out, adv_metrics, _mismatch_metrics(mismatch, measure, truncated, drift))


#: Under ``algo.sampler_weights=initial``: the statistics of ``mismatch/*`` (same formulas), of the
#: trainer against the frozen initial sampler's mu.
FROZEN_NAMES = tuple(name.replace("mismatch/", "frozen_sampler/") for name in MISMATCH_NAMES)


def _mismatch_metrics(
    parts: list[MismatchStats], measured: bool, truncated: bool, frozen: bool = False
) -> dict[str, float | None]:
    """``mismatch/*`` from the update's forward passes when it measured them; null under top-k /
    top-p (the sampler recorded the filtered distribution's log-probs, which the trainer's
    unfiltered pass cannot be compared with: a number there would be the nucleus mass, or the
    trainer against itself); none here when ``prepare_batch`` measured them (rollout correction).

    ``frozen`` (``algo.sampler_weights=initial``): mu is the initial student's, by design, so the
    same statistics measure how far the student has moved from it (plus the engines' own mismatch,
    alone before the first update): logged as ``frozen_sampler/*``, and ``mismatch/*`` null. The sampler's
    own weights are checked where they are loaded (``frozen_sampler``, the sync probe)."""
    if truncated:
        return dict.fromkeys(MISMATCH_NAMES, None)
    if not measured:
        return {}
    stats = sum(parts, MismatchStats()).metrics()
    if frozen:
        return {
            **dict.fromkeys(MISMATCH_NAMES, None),
            **{FROZEN_NAMES[MISMATCH_NAMES.index(k)]: v for k, v in stats.items()},
        }
    return {**stats}


def merge_metrics(*parts: dict[str, Any]) -> dict[str, Any]:
    """One dict from metric dicts that must not share a key: each logged key has one source, so
    a key computed twice (two formulas, or two token sets) is an error, never a silent overwrite."""
    out: dict[str, Any] = {}
    for part in parts:
        twice = sorted(out.keys() & part.keys())
        if twice:
            raise ValueError(f"metric keys computed in two places: {twice}")
        out.update(part)
    return out


def no_update() -> dict[str, float | None]:
    """Update metrics of a step without a batch: the same keys, null values, zero updates."""
    return {
        **dict.fromkeys(METRIC_NAMES),
        "kl_ref": None,
        "skipped": 0.0,
        "updates": 0.0,
        "train_tokens": 0.0,
    }
