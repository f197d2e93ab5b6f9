"""The SFT warm-up loop (``veriloop sft``): chat examples in, a fine-tuned policy out.

    tokenise every example once (build_sft_example: chat template, loss only on trainable turns)
    for step in start .. steps-1:                                       (steps.StepLoop, as RL's loop)
        batch = B examples from a seeded per-epoch permutation          (resumable from `step` alone)
        collate them once (batch.collate_tokens, RL's padding); for each micro-batch m of its rows:
            (L_m · n_m / n).backward()                                  n = loss tokens in the batch
        clip grad norm; skip the update if loss or norm is non-finite
        AdamW step, linear warm-up of the learning rate
        guard: `max_consecutive_nonfinite` skipped steps in a row stop the run (RL's limit)
        log; checkpoint every `checkpoint_every` steps and after the last (atomic, resumable)
    save_policy(policy, run_dir / "final")

The loss is the token mean over the whole batch, L = -Σ m·log p / Σ m, whatever the micro-batch
split (each micro-batch's mean is re-weighted by its share of the loss tokens). Vision examples
(images on the example, a policy with a processor) are tokenised through the processor
(:mod:`veriloop.algos.sft.vision`); their image inputs ride with their rows (``TokenBatch.extras``
with per-row counts), so a micro-batch takes its rows' images and the model's forward gets them.
Nothing is silent:
examples cut at ``max_len`` are counted (``truncated``), and those left with no trainable token are
dropped and counted (``dropped_empty``).
"""

from __future__ import annotations

import hashlib
import json
import math
import time
import warnings
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from veriloop.algos.learner.batch import collate_tokens, minibatches, with_row_extras
from veriloop.algos.run.log import RunLog
from veriloop.algos.run.nonfinite import NonFiniteGuard
from veriloop.algos.run.phase import StepLoop
from veriloop.algos.sft.data import SFTExample
from veriloop.algos.sft.loss import build_sft_example, sft_loss
from veriloop.configs.schema import ExperimentConfig, RunConfig, SFTConfig, TrainConfig

TRAINABLE_FILE = "trainable.pt"
#: Warm-up constants the typed config does not (yet) expose.
SFT_BATCH_SIZE = 8
SFT_WARMUP_FRACTION = 0.05


@dataclass(frozen=True)
class SFTSettings:
    """Hyper-parameters of the warm-up loop.

    Attributes:
        steps: Optimizer steps to run (the loop may stop earlier, see ``epochs``).
        lr: Peak AdamW learning rate (reached after ``warmup`` steps, then constant).
        batch_size: Examples per optimizer step.
        micro_batch_size: Examples per forward/backward pass (``None`` = ``batch_size``); only
            memory changes, not the loss.
        max_len: Longest token sequence; longer examples are cut (and counted).
        warmup: Steps of linear learning-rate warm-up from ``lr / warmup`` to ``lr``.
        max_grad_norm: Global gradient-norm clip; 0 = no clipping (the norm is still logged).
        weight_decay: AdamW weight decay.
        epochs: Most passes over the examples (``None`` = no limit, ``steps`` decides).
        seed: Seeds the data order.
        log_every: Log metrics every this many steps (the last step is always logged).
        checkpoint_every: Checkpoint every this many steps; 0 = only at the end (with ``run_dir``).
        keep_last: Complete checkpoints kept.
        tensorboard: Also write TensorBoard scalars into ``run_dir/tb``.
        max_consecutive_nonfinite: Stop after this many steps in a row with a NaN/inf loss or
            gradient (each is skipped); the RL loop's limit, ``train.max_consecutive_nonfinite``.
    """

    steps: int
    lr: float = SFTConfig.lr
    batch_size: int = 8
    micro_batch_size: int | None = None
    max_len: int = 1024
    warmup: int = 0
    max_grad_norm: float = TrainConfig.max_grad_norm
    weight_decay: float = TrainConfig.weight_decay
    epochs: int | None = SFTConfig.epochs
    seed: int = 0
    log_every: int = 10
    checkpoint_every: int = 0
    keep_last: int = RunConfig.keep_last
    tensorboard: bool = RunConfig.tensorboard
    max_consecutive_nonfinite: int = TrainConfig.max_consecutive_nonfinite

    @classmethod
    def from_config(cls, cfg: ExperimentConfig, num_examples: int) -> SFTSettings:
        """The warm-up an ``ExperimentConfig`` describes, over ``num_examples`` demonstrations: the one
        place the config's ``sft``, ``train``, ``rollout`` and ``run`` settings become these.

        Batch size :data:`SFT_BATCH_SIZE` (fewer with fewer examples), micro-batches of
        ``train.micro_batch_size``, sequences cut at ``rollout.max_context``, warm-up over
        :data:`SFT_WARMUP_FRACTION` of ``sft.steps``; clipping, weight decay, the non-finite limit,
        logging and checkpointing follow ``train`` and ``run``."""
        sft, train, run, batch = cfg.sft, cfg.train, cfg.run, min(SFT_BATCH_SIZE, num_examples)
        return cls(
            steps=sft.steps,
            lr=sft.lr,
            batch_size=batch,
            micro_batch_size=min(train.micro_batch_size, batch),
            max_len=cfg.rollout.max_context,
            warmup=int(SFT_WARMUP_FRACTION * sft.steps),
            max_grad_norm=train.max_grad_norm,
            weight_decay=train.weight_decay,
            epochs=sft.epochs,
            seed=cfg.rollout.seed,
            log_every=train.log_every,
            checkpoint_every=run.checkpoint_every,
            keep_last=run.keep_last,
            tensorboard=run.tensorboard,
            max_consecutive_nonfinite=train.max_consecutive_nonfinite,
        )

    def __post_init__(self) -> None:
        ints = {
            "steps": 0,
            "batch_size": 1,
            "max_len": 2,
            "warmup": 0,
            "log_every": 1,
            "checkpoint_every": 0,
            "keep_last": 1,
            "max_consecutive_nonfinite": 1,
        }
        bad = [f"{k}={getattr(self, k)} (need >= {lo})" for k, lo in ints.items() if getattr(self, k) < lo]
        if self.micro_batch_size is not None and not 1 <= self.micro_batch_size <= self.batch_size:
            bad.append(f"micro_batch_size={self.micro_batch_size} (need 1..batch_size)")
        if self.epochs is not None and self.epochs < 1:
            bad.append(f"epochs={self.epochs} (need >= 1 or None)")
        if not self.lr > 0:
            bad.append(f"lr={self.lr} (need > 0)")
        if not self.max_grad_norm >= 0:
            bad.append(f"max_grad_norm={self.max_grad_norm} (need >= 0)")
        if bad:
            raise ValueError("invalid SFT settings: " + "; ".join(bad))

    @property
    def micro(self) -> int:
        return self.micro_batch_size or self.batch_size


# ---------------------------------------------------------------------------------- data
@dataclass(frozen=True)
class Tokenised:
    """Examples as token lists, ready to batch; ``truncated`` / ``dropped_empty`` counts.

    ``vision``: per example, its image inputs (``pixel_values`` [N_images, C, H, W] ...; ``{}`` for
    a text example); empty when no example has images.
    """

    ids: list[list[int]]
    masks: list[list[int]]
    truncated: int
    dropped_empty: int
    vision: list[dict[str, torch.Tensor]] = field(default_factory=list)

    def fingerprint(self) -> str:
        """Hash of every token and mask (and image input): a resumed run must train on the same data."""
        h = hashlib.sha256()
        for ids, mask in zip(self.ids, self.masks):
            h.update(json.dumps([ids, mask]).encode())
        for inputs in self.vision:
            for k in sorted(inputs):
                h.update(k.encode() + inputs[k].detach().cpu().contiguous().numpy().tobytes())
        return h.hexdigest()[:16]


def _encode(
    tokenizer: Any, processor: Any, ex: SFTExample, max_len: int
) -> tuple[list[int], list[int], dict]:
    """One example's ids, loss mask and image inputs, uncut; a vision example needs ``processor``,
    and its images must end before ``max_len`` (an image cut in half has no valid input)."""
    if not ex.images:
        ids, mask = build_sft_example(tokenizer, list(ex.messages), list(ex.trainable))
        return ids, mask, {}
    from veriloop.algos.sft.vision import build_vision_sft_example, image_token_count

    if processor is None:
        raise ValueError(
            f"an SFT example has {len(ex.images)} image(s) but the policy has no processor; load a "
            "vision-language policy (e.g. default-vision) or build text examples (images=False)"
        )
    ids, mask, vision = build_vision_sft_example(
        processor, list(ex.messages), list(ex.trainable), ex.images, ex.image_messages
    )
    if image_token_count(processor, ids[:max_len]) != image_token_count(processor, ids):
        raise ValueError(
            f"max_len={max_len} cuts an image of an SFT example ({len(ids)} tokens); raise max_len "
            "(rollout.max_context) so every image fits"
        )
    return ids, mask, vision


def tokenise(
    tokenizer: Any, examples: Sequence[SFTExample], max_len: int, processor: Any = None
) -> Tokenised:
    """``build_sft_example`` on each example (vision examples through ``processor``), cut to
    ``max_len`` tokens (counted, never silent)."""
    ids_all, masks_all, vision_all, truncated, dropped = [], [], [], 0, 0
    for ex in examples:
        ids, mask, vision = _encode(tokenizer, processor, ex, max_len)
        if len(ids) > max_len:
            truncated += 1
            ids, mask = ids[:max_len], mask[:max_len]
        if not any(mask):
            dropped += 1  # every trainable token was past max_len
            continue
        ids_all.append(ids)
        masks_all.append(mask)
        vision_all.append(vision)
    if not ids_all:
        raise ValueError(
            f"no SFT example has a trainable token within max_len={max_len} ({len(examples)} given, "
            f"{dropped} dropped); raise max_len or check the examples' trainable flags"
        )
    has_images = any(vision_all)
    return Tokenised(ids_all, masks_all, truncated, dropped, vision_all if has_images else [])


def batch_indices(n: int, batch_size: int, step: int, seed: int) -> list[int]:
    """Example indices of optimizer step ``step``: consecutive slices of per-epoch permutations.

    Epoch ``e`` is ``permutation(n)`` drawn from ``default_rng([seed, e])``; step ``s`` takes
    positions ``[s·B, (s+1)·B)`` of their concatenation. A pure function of ``step``, so resuming
    needs no data-loader state.
    """
    out = []
    for pos in range(step * batch_size, (step + 1) * batch_size):
        epoch, i = divmod(pos, n)
        out.append(int(np.random.default_rng([seed, epoch]).permutation(n)[i]))
    return out


# ---------------------------------------------------------------------------------- checkpoints
def _save_trainable(model: torch.nn.Module, folder: Path) -> None:
    """Only the trained weights (a LoRA adapter's, or all of them): enough to resume exactly."""
    state = {n: p.detach().cpu() for n, p in model.named_parameters() if p.requires_grad}
    torch.save(state, folder / TRAINABLE_FILE)


#: Settings a resumed warm-up may change (how long, how often it logs and saves, memory use);
#: the others shape the trajectory, and a checkpoint refuses them changed.
RESUMABLE_SETTINGS = ("steps", "epochs", "micro_batch_size", "log_every", "checkpoint_every", "keep_last",
                      "tensorboard", "max_consecutive_nonfinite")  # fmt: skip


def _check_settings(path: Path, saved: dict[str, Any] | None, s: SFTSettings) -> None:
    """Stop a resume whose trajectory-shaping settings differ from the checkpoint's (older
    checkpoints, which saved none, pass)."""
    saved, now = saved or {}, asdict(s)
    changed = sorted(k for k in saved if k not in RESUMABLE_SETTINGS and saved[k] != now.get(k))
    if changed:
        diff = "; ".join(f"{k}: {saved[k]!r} -> {now.get(k)!r}" for k in changed)
        raise ValueError(
            f"{path} was trained with other SFT settings ({diff}); resume with the settings it was "
            "trained with, or use a new run_dir (run.name=...)"
        )


class ResumeMismatchError(ValueError):
    """The checkpoint belongs to another SFT run (other data or settings): not damage, no fallback."""


def _resume(
    run_dir: Path, policy: Any, optimizer: Any, scheduler: Any, fingerprint: str, settings: SFTSettings
) -> dict[str, Any]:
    """Load the newest checkpoint that verifies into policy/optimizer/scheduler; its trainer state.
    A damaged newest checkpoint is reported and the previous one used (``checkpoint.resume_latest``)."""
    import sys

    from veriloop.algos.run.checkpoint import resume_latest

    def apply(ckpt: dict[str, Any]) -> None:
        path, state = ckpt["model_dir"].parent, ckpt["trainer_state"]
        if state.get("data_fingerprint") != fingerprint:
            raise ResumeMismatchError(
                f"{path} was trained on different SFT data (fingerprint {state.get('data_fingerprint')} vs "
                f"{fingerprint} now); resume with the same examples and max_len, or use a new run_dir"
            )
        try:
            _check_settings(path, state.get("settings"), settings)
        except ValueError as e:
            raise ResumeMismatchError(str(e)) from None
        _load_weights(ckpt, policy)
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])

    found = resume_latest(
        run_dir, apply, warn=lambda m: print(f"veriloop: {m}", file=sys.stderr), fatal=(ResumeMismatchError,)
    )
    return dict(found[1]["trainer_state"]) if found else {}


def _load_weights(ckpt: dict[str, Any], policy: Any) -> None:
    weights = torch.load(ckpt["model_dir"] / TRAINABLE_FILE, map_location="cpu", weights_only=True)
    params = dict(policy.model.named_parameters())
    missing = [n for n in weights if n not in params]
    if missing:
        raise ValueError(
            f"{ckpt['model_dir'].parent}: checkpoint has weights the policy lacks (e.g. {missing[0]}); load the same model"
        )
    with torch.no_grad():
        for name, value in weights.items():
            params[name].copy_(value.to(params[name].device))


def _save(sft: _SFTRun, guard: NonFiniteGuard, run: Path, step: int, fingerprint: str) -> None:
    """A resumable checkpoint after ``step`` steps: the trained weights, optimizer, schedule, and
    the guard's counts (a resumed run keeps them, as RL's does)."""
    from veriloop.algos.run.checkpoint import save_checkpoint

    state = {
        "step": step,
        "skipped_nonfinite": guard.total,
        "consecutive_nonfinite": guard.in_a_row,
        "data_fingerprint": fingerprint,
        "settings": asdict(sft.settings),
    }
    model = sft.policy.model
    save_checkpoint(
        run,
        step,
        model=model,
        save_model=lambda d: _save_trainable(model, d),
        optimizer=sft.optimizer,
        scheduler=sft.scheduler,
        trainer_state=state,
        keep_last=sft.settings.keep_last,
    )


# ---------------------------------------------------------------------------------- the loop
def train_sft(
    policy: Any, examples: Sequence[SFTExample], *, run_dir: str | Path | None = None, **settings: Any
) -> dict[str, Any]:
    """Supervised warm-up of ``policy`` on ``examples``: ``settings`` are :class:`SFTSettings`'
    fields by name (``steps`` required), checked there; :func:`run_sft` with them."""
    return run_sft(policy, examples, SFTSettings(**settings), run_dir=run_dir)


@dataclass
class _SFTRun:
    """What one SFT step reads and updates (built once by ``run_sft``)."""

    policy: Any
    data: Tokenised
    settings: SFTSettings
    params: list[torch.nn.Parameter]
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    pad_id: int


def sft_total_steps(steps: int, epochs: int | None, examples: int, batch_size: int) -> int:
    """Steps the warm-up runs: ``steps``, or fewer when ``epochs`` passes over ``examples`` (batches
    of ``batch_size``) end first -- the smaller wins, and a cap is announced on stderr."""
    if epochs is None:
        return steps
    allowed = math.ceil(epochs * examples / batch_size)
    if allowed < steps:
        import sys

        print(
            f"sft: running {allowed} of sft.steps={steps} steps: sft.epochs={epochs} over {examples} examples "
            f"(batches of {batch_size}) ends first; set sft.epochs=null to run every step",
            file=sys.stderr,
        )
    return min(steps, allowed)


def run_sft(
    policy: Any, examples: Sequence[SFTExample], settings: SFTSettings, *, run_dir: str | Path | None = None
) -> dict[str, Any]:
    """The loop (see the module docstring). With ``run_dir``: metrics, checkpoints, resume, final save.

    Returns:
        ``steps_done``, ``start_step`` (> 0 when resumed), ``loss_first`` / ``loss_last`` (this
        call's first and last finite batch loss), ``losses`` (per step), ``skipped_nonfinite``,
        ``truncated``, ``dropped_empty``, ``examples``, ``tokens_per_s``, ``final_dir``.
    """
    s = settings
    data = tokenise(policy.tokenizer, examples, s.max_len, getattr(policy, "processor", None))
    total = sft_total_steps(s.steps, s.epochs, len(data.ids), s.batch_size)
    sft = _build(policy, data, s)
    fingerprint = data.fingerprint()
    run = Path(run_dir) if run_dir is not None else None
    state = _resume(run, policy, sft.optimizer, sft.scheduler, fingerprint, s) if run is not None else {}
    start = int(state.get("step", 0))
    if start:
        from veriloop.algos.run.progress import say

        say(f"sft warm-up: continuing from its checkpoint at step {start} of {total}")
    loop = _step_loop(s, total, state, _open_log(run, s, start))
    losses: list[float] = []
    tok_total, time_total = 0.0, 0.0
    was_training = policy.model.training
    policy.model.train()
    try:
        for step in loop.steps(start):
            t0 = time.perf_counter()
            out = _sft_step(sft, step)
            loop.observe(skipped=not out.finite)  # NonFiniteTrainingError after too many in a row
            dt = time.perf_counter() - t0
            tok_total, time_total = tok_total + out.seen, time_total + dt
            losses.append(out.loss)
            done = step + 1
            loop.log_metrics(
                done,
                {
                    "loss/sft": out.loss,
                    "sft/grad_norm": out.grad_norm,
                    "sft/lr": out.lr,
                    "sft/loss_tokens": out.n_loss,
                    "perf/tokens_per_s": out.seen / dt,
                    "sft/skipped_nonfinite": loop.guard.total,
                    "sft/truncated": data.truncated,
                    "sft/dropped_empty": data.dropped_empty,
                },
            )
            if run is not None and loop.checkpoint_due(done):  # the last step's too: resumable to the end
                _save(sft, loop.guard, run, done, fingerprint)
    finally:
        policy.model.train(was_training)
        if loop.log is not None:
            loop.log.close()
    final_dir = _save_final(policy, run) if run is not None else None
    finite_losses = [x for x in losses if math.isfinite(x)]
    return {
        "steps_done": total,
        "start_step": start,
        "losses": losses,
        "loss_first": finite_losses[0] if finite_losses else None,
        "loss_last": finite_losses[-1] if finite_losses else None,
        "skipped_nonfinite": loop.guard.total,
        "truncated": data.truncated,
        "dropped_empty": data.dropped_empty,
        "examples": len(data.ids),
        "tokens_per_s": tok_total / time_total if time_total else None,
        "final_dir": final_dir,
    }


def _build(policy: Any, data: Tokenised, s: SFTSettings) -> _SFTRun:
    """Optimizer over the trainable parameters and the linear warm-up schedule."""
    params = policy.trainable_parameters()
    if not params:
        raise ValueError(
            "the policy has no trainable parameters; load it with lora=LoraSettings() or for full fine-tuning"
        )
    optimizer = torch.optim.AdamW(params, lr=s.lr, weight_decay=s.weight_decay)
    # linear warm-up: lr·(k+1)/warmup for the first `warmup` steps, then lr
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda k: min(1.0, (k + 1) / s.warmup) if s.warmup else 1.0
    )
    pad_id = policy.tokenizer.pad_token_id if policy.tokenizer.pad_token_id is not None else 0
    return _SFTRun(policy, data, s, params, optimizer, scheduler, pad_id)


def _step_loop(s: SFTSettings, total: int, state: dict[str, Any], log: RunLog | None) -> StepLoop:
    """The SFT phase's ``StepLoop`` (the machinery RL's loop runs on): ``total`` steps, the guard
    with ``s.max_consecutive_nonfinite`` and the checkpoint's counts, ``log_every``, ``checkpoint_every``."""
    guard = NonFiniteGuard(
        s.max_consecutive_nonfinite,
        int(state.get("consecutive_nonfinite", 0)),
        int(state.get("skipped_nonfinite", 0)),
    )
    advice = f"lower lr (now {s.lr}) or max_grad_norm, or check the data"
    return StepLoop(
        total,
        "sft warm-up",
        guard,
        log_every=s.log_every,
        checkpoint_every=s.checkpoint_every,
        log=log,
        advice=advice,
    )


def _save_final(policy: Any, run: Path) -> str:
    """``run/final``: the warmed-up policy, loadable with ``load_policy``; returns its path."""
    from veriloop.agents.loading import save_policy

    return str(save_policy(policy, run / "final"))


def _open_log(run: Path | None, s: SFTSettings, start: int) -> RunLog | None:
    """The metrics log of a run folder (None without one); writes ``sft_settings.json``."""
    if run is None:
        return None
    # rows are logged under the number of completed steps; keep those up to the checkpoint's (none
    # when starting at 0: rows left by an attempt cut before its first checkpoint are not kept)
    log = RunLog(run, tensorboard=s.tensorboard, resume_from_step=start + 1)
    (run / "sft_settings.json").write_text(json.dumps(asdict(s), indent=1) + "\n")
    return log


@dataclass(frozen=True)
class SFTStep:
    """What one SFT step reports.

    Attributes:
        loss: Token-mean loss of the batch (NaN/inf when the step was skipped).
        seen: Tokens the forward passes read (padding excluded).
        n_loss: Tokens the loss was taken over.
        grad_norm: Global gradient norm before clipping.
        lr: The learning rate the step used.
        finite: Loss and gradient norm were finite, and the optimizer stepped.
    """

    loss: float
    seen: float
    n_loss: int
    grad_norm: float
    lr: float | torch.Tensor
    finite: bool


def _sft_step(sft: _SFTRun, step: int) -> SFTStep:
    """One SFT step: forward/backward, clip, optimizer step unless non-finite, schedule step."""
    s, optimizer = sft.settings, sft.optimizer
    optimizer.zero_grad(set_to_none=True)
    idx = batch_indices(len(sft.data.ids), s.batch_size, step, s.seed)
    loss, seen, n_loss = _forward_backward(sft, idx)
    grad_norm = float(torch.nn.utils.clip_grad_norm_(sft.params, s.max_grad_norm or math.inf))
    finite = math.isfinite(loss) and math.isfinite(grad_norm)
    if finite:
        optimizer.step()
    else:  # skip the update, keep the weights; the schedule still advances with the step
        optimizer.zero_grad(set_to_none=True)
    lr_now = sft.scheduler.get_last_lr()[0]
    with warnings.catch_warnings():  # a skipped update still advances the schedule, on purpose
        warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step")
        sft.scheduler.step()
    return SFTStep(loss, seen, n_loss, grad_norm, lr_now, finite)


def _forward_backward(sft: _SFTRun, idx: list[int]) -> tuple[float, float, int]:
    """Forward/backward over the micro-batches of one batch: (loss, tokens seen, loss tokens).

    The batch is collated once; its micro-batches are consecutive row slices of it, each trimmed
    to its own longest row. Each micro-batch's token-mean loss is weighted by its share of the
    batch's loss tokens, so the summed gradient is the whole batch's token mean whatever the split.
    """
    data, device = sft.data, sft.policy.device
    ids, masks = [data.ids[i] for i in idx], [data.masks[i] for i in idx]
    batch = collate_tokens(ids, masks, pad_id=sft.pad_id)  # [B, T], once per step
    if data.vision:  # each row's images, stacked [N_images, ...] with per-row counts
        batch = with_row_extras(batch, [data.vision[i] for i in idx])
    n_loss = int(batch.loss_mask.sum())  # position 0 is never a target (build_sft_example zeroes it)
    loss_sum, seen = 0.0, 0
    for part in minibatches(batch, sft.settings.micro):
        part = part.trimmed()  # [b, t]: t is this micro-batch's longest row
        n_part = float(part.loss_mask.sum())
        seen += int(part.attention_mask.sum())
        if n_part == 0:
            continue
        images = {k: v.to(device) for k, v in part.extras.items() if len(v)}  # this part's rows' images
        loss, _ = sft_loss(
            sft.policy.model,
            part.input_ids.to(device),
            part.attention_mask.to(device),
            part.loss_mask.to(device),
            **images,
        )
        (loss * (n_part / n_loss)).backward()  # token mean over the whole batch
        loss_sum += float(loss.detach()) * n_part
    return loss_sum / max(n_loss, 1), float(seen), n_loss


def warmup_from_config(
    cfg: ExperimentConfig, policy: Any, *, run_dir: str | Path | None = None
) -> dict[str, Any]:
    """``veriloop sft`` / the SFT stage of ``veriloop train`` from an ``ExperimentConfig``.

    Demonstrations come from ``cfg.sft.source`` on the training env, with env seeds
    ``rollout.seed .. rollout.seed + sft.examples - 1`` (RL problems start after them); a policy
    with a processor (a VLM) gets the observations' images in its examples; the loop's settings are
    :meth:`SFTSettings.from_config`. Returns
    :func:`run_sft`'s summary without the per-step losses (they are in ``run_dir/metrics.jsonl``).
    """
    from veriloop.algos.sft.data import build_examples

    sft, r = cfg.sft, cfg.rollout
    seeds = range(r.seed, r.seed + sft.examples)
    extra: dict[str, Any] = {}
    if sft.source == "rejection":
        from veriloop.agents.engine import RolloutLimits
        from veriloop.agents.sampling_params import SamplingParams

        extra = {
            "policy": policy,
            "samples": r.group_size,
            "sampling": SamplingParams.from_rollout(r, seed=r.seed),
            "limits": RolloutLimits.from_rollout(r),
        }
    examples = build_examples(
        sft.source,
        cfg.env.id,
        cfg.env.kwargs,
        seeds,
        seed=r.seed,
        system_prompt=cfg.env.system_prompt,
        assistant_prefix=cfg.env.assistant_prefix,
        images=getattr(policy, "processor", None) is not None,  # a VLM sees the observations' images
        **extra,
    )
    if not examples:
        raise ValueError(
            f"SFT source {sft.source!r} produced no example from {sft.examples} seeds (rejection sampling "
            "kept nothing?); warm up with 'solver'/'generator' first or sample more"
        )
    out = run_sft(policy, examples, SFTSettings.from_config(cfg, len(examples)), run_dir=run_dir)
    out.pop("losses")
    return out


def sft_summary(metrics: dict[str, Any]) -> str:
    """:func:`run_sft`'s summary in words: steps, the loss's first and last value, examples, speed,
    where the policy went."""

    def num(key: str, fmt: str) -> str:
        value = metrics.get(key)
        return format(value, fmt) if isinstance(value, int | float) else "n/a"

    total, start = metrics.get("steps_done", "?"), metrics.get("start_step")
    steps = f"steps {start + 1}-{total} of {total} (resumed at step {start})" if start else f"{total} steps"
    parts = [
        steps,
        f"loss {num('loss_first', '.3f')} -> {num('loss_last', '.3f')}",
        f"{metrics.get('examples', '?')} examples",
        f"{num('tokens_per_s', '.0f')} tokens/s",
    ]
    for key, what in (
        ("skipped_nonfinite", "non-finite steps skipped"),
        ("truncated", "examples truncated"),
        ("dropped_empty", "examples dropped (empty)"),
    ):
        if metrics.get(key):
            parts.append(f"{metrics[key]} {what}")
    saved = f"; saved {metrics['final_dir']}" if metrics.get("final_dir") else ""
    return ", ".join(parts) + saved


def sft_from_config(
    cfg: ExperimentConfig, *, resume: bool = False, overwrite: bool = False, quiet: bool = False
) -> Path:
    """``veriloop sft``: the config's SFT warm-up on its own, in ``<run folder>/sft``; the saved
    policy's folder (``sft/final``).

    The examples' source, the model and its chat template are checked before anything loads, and a
    family outside the architecture matrix is loaded and checked (its log-probs against a plain
    forward) before the run folder exists: a refusal is a ``ConfigError`` with nothing written. The
    run folder is locked against another writer of the same run (a trainer included) and cleared of
    a killed process's half-written files. A folder that already holds an SFT run is continued with
    ``resume`` (a finished one is returned as it is) and replaced with ``overwrite``; otherwise it
    is refused.
    """
    from veriloop.agents.loading import save_policy
    from veriloop.algos.run.lock import run_lock
    from veriloop.algos.run.progress import say
    from veriloop.algos.run.setup import (
        build_policy,
        check_chat_template_files,
        check_device,
        check_folder,
        check_model,
        check_not_busy,
        check_policy_family,
        claim_folder,
        remove_stale_temporaries,
    )
    from veriloop.algos.sft.data import check_source
    from veriloop.configs.errors import ConfigError

    if cfg.sft.steps <= 0:
        raise ConfigError("sft.steps is 0: nothing to do (set sft.steps=N)")
    check_source(cfg.sft.source, cfg.env.id, cfg.env.kwargs)
    check_model(cfg.policy.model)
    check_chat_template_files(cfg)
    check_device(cfg.policy.device)
    sft_dir = Path(cfg.run.out_dir) / cfg.run_name / "sft"
    check_not_busy(sft_dir.parent)
    finished = resume and not overwrite and (sft_dir / "final").is_dir()
    if not finished:
        check_folder(sft_dir, resume=resume, overwrite=overwrite, what="an SFT run")  # before the lock file
        check_policy_family(cfg)  # a family outside the matrix: loaded and checked before the folder exists
    with run_lock(sft_dir.parent):  # one writer per run folder: not beside a trainer of the same run
        remove_stale_temporaries(sft_dir.parent)
        if resume and not overwrite and (sft_dir / "final").is_dir():
            say(f"{sft_dir} is already finished (final/ saved); nothing to resume", quiet)
            return sft_dir / "final"
        claim_folder(sft_dir, resume=resume, overwrite=overwrite, what="an SFT run")
        policy = build_policy(cfg)
        metrics = warmup_from_config(cfg, policy, run_dir=sft_dir)
        out = Path(save_policy(policy, sft_dir / "final"))
    metrics["final_dir"] = None
    say(f"SFT done: {sft_summary(metrics)}\nsaved policy: {out}", quiet)
    return out
