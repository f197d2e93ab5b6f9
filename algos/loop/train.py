"""Training a policy, top to bottom: ``train`` checks the config, claims the run folder, builds the
run (:class:`~veriloop.algos.loop.parts.RunParts`), restores a checkpoint, runs the SFT warm-up,
then the RL steps, and saves the final policy.

The RL steps are the one step body, :func:`~veriloop.algos.loop.run_steps.run_steps`, over a
batch source: :class:`~veriloop.algos.loop.source.SyncSource` for ``train.max_staleness`` 0 (each
step plays its groups, then trains on them), :class:`~veriloop.algos.loop.async_loop.AsyncSource`
above it (a worker plays groups beside the update). Every algorithm runs through this one loop;
which parts it uses was decided by ``cfg.algo`` before the loop starts (``algorithm.resolve``
builds the ``Algorithm`` record once, in ``_build_run``).
"""

from __future__ import annotations

import shutil
import sys
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any

import torch

import veriloop.algos.eval.in_training as in_training
import veriloop.envs  # noqa: F401  (registers the environments)
from veriloop.agents.backends import serving_backend
from veriloop.agents.backends.base import ServingBackend
from veriloop.agents.loading import save_policy
from veriloop.agents.policy import Policy
from veriloop.algos.eval.report import run_summary
from veriloop.algos.learner.algorithm import resolve
from veriloop.algos.loop.metrics import modes_line, say_modes_tally
from veriloop.algos.loop.parts import RunParts, TrainerState, checkpoint_run, eval_backend, whole_weights
from veriloop.algos.loop.run_steps import run_steps
from veriloop.algos.loop.source import SyncSource
from veriloop.algos.run.checkpoint import (
    complete_checkpoints,
    load_checkpoint,
    resume_latest,
)
from veriloop.algos.run.distributed import DistContext, init_distributed, shutdown_distributed
from veriloop.algos.run.guards import stop_if_nothing_trained
from veriloop.algos.run.lock import acquire, release
from veriloop.algos.run.log import RunLog
from veriloop.algos.run.progress import say
from veriloop.algos.run.samples import SampleLog
from veriloop.algos.run.setup import (
    build_critic,
    build_optimizer,
    build_policy,
    check_backend_family,
    check_chat_template_files,
    check_claim,
    check_device,
    check_model,
    check_policy_family,
    claim_run_dir,
    load_trainable_state,
    lr_lambda,
    trainable_parameters,
    trainable_state,
)
from veriloop.configs.schema import ConfigError, ExperimentConfig


def train(
    cfg: ExperimentConfig, *, resume: bool = False, overwrite: bool = False, quiet: bool = False
) -> Path:
    """Run ``cfg`` and return the run folder (metrics.jsonl, config.yaml, checkpoints/, final/).

    An existing run folder is never written into unless asked: ``resume`` continues it (the
    config must match the saved one but for the settings in :data:`RESUMABLE_CHANGES`),
    ``overwrite`` deletes it first; otherwise :class:`ConfigError` names both, before any model
    loads (see :func:`claim_run_dir`).

    Under ``accelerate launch`` / ``torchrun`` with several processes this is data-parallel (see
    :mod:`veriloop.algos.run.distributed`); only rank 0 writes anything.
    """
    _check_before_loading(cfg)
    dist = init_distributed()
    dist = replace(dist, sharded=dist.enabled and cfg.train.parallel == "fsdp")
    if cfg.train.max_staleness > 0:
        from veriloop.algos.loop.async_loop import check_async

        check_async(cfg, dist)  # before the run folder is claimed or any model loads
    if cfg.algo.frozen_sampler and dist.enabled:
        raise ConfigError(
            f"algo.sampler_weights=initial runs in one process for now (got {dist.world_size}): its engine is "
            "loaded with the trained weights for an evaluation on rank 0 alone; run it without torchrun"
        )
    run_dir = Path(cfg.run.out_dir) / cfg.run_name
    if dist.is_main:  # every refusal before the lock file (or the folder) is made
        check_claim(run_dir, cfg, resume=resume, overwrite=overwrite)
    check_policy_family(cfg)  # a family outside the matrix: loaded and checked before the folder exists
    lock = acquire(run_dir) if dist.is_main else None  # one writer per run folder (run_lock.py)
    try:
        if dist.is_main:
            claim_run_dir(run_dir, cfg, resume=resume, overwrite=overwrite)
        return _train_claimed(cfg, run_dir, dist, resume=resume, quiet=quiet)
    finally:
        if lock is not None:
            release(lock)


def _train_claimed(
    cfg: ExperimentConfig, run_dir: Path, dist: DistContext, *, resume: bool, quiet: bool
) -> Path:
    """``train`` once the run folder is this process's: build, restore, warm up, loop, save."""
    run = _build_run(cfg, run_dir, dist, quiet=quiet or not dist.is_main)
    ckpt = _restore(run, resume)
    with whole_weights(run):  # sharded: the engine is handed the whole (restored) weights
        run.backend = _rollout_backend(cfg, run.policy, dist)  # holds the (restored) weights from here on
    if cfg.sft.steps > 0 and not run.state.sft_done:
        _sft_warmup(run)
    if not dist.sharded:  # sharded: broadcast before sharding (_build_run)
        dist.broadcast_params(list(trainable_state(run.policy, run.critic).values()))  # rank 0's weights
    if run.backend is not None and run.state.step == 0 and cfg.sft.steps > 0:
        run.backend.sync()  # the warm-up's weights (and on every rank rank 0's, just broadcast)
    _open_logs(run, ckpt)
    try:
        at_start = run.state.step == 0 and (cfg.eval.at_start or cfg.train.steps == 0)
        with whole_weights(run, at_start):  # sharded: all ranks gather, rank 0 evaluates
            start = (  # resumed from the step-0 checkpoint: these weights may be evaluated already
                in_training.evaluate_step(
                    cfg, run.policy, 0, run.quiet, backend=eval_backend(run), reuse=ckpt is not None
                )
                if at_start and run.log is not None
                else {}
            )
        if run.state.step == 0 and run.log is not None:  # the base policy's numbers, for comparison
            base = {**run.state.history.get("eval_base", {}), **start}
            if base:
                run.log.log(0, base)
        _loop(run)
        stop_if_nothing_trained(cfg, run.state)  # no step had an informative group: exit 4, no final/
        if dist.is_main:
            _after_loop(run)
        card = _model_card(cfg, run_dir, run.state) if dist.is_main else ""
        if dist.sharded:  # all ranks gather the weights; rank 0 saves them in the ordinary format
            from veriloop.algos.run.fsdp import save_final

            save_final(
                run.policy,
                run.critic,
                run_dir / "final",
                dist=dist,
                card=card,
                rebuild=partial(build_policy, cfg),
            )
        elif dist.is_main:
            save_policy(run.policy, run_dir / "final", card=card)
    finally:
        if run.log is not None:
            run.log.close()
        if run.backend is not None:
            run.backend.close()
        dist.barrier()
        shutdown_distributed(dist)
    return run_dir


def _open_logs(run: RunParts, ckpt: Path | None) -> None:
    """Rank 0: the metrics log and the samples log (``samples.jsonl``). A resumed run keeps their rows
    up to its checkpoint's step; a fresh run, or one resumed from the warm-up's step-0 checkpoint
    (which evaluates step 0 again), starts empty files."""
    if not run.dist.is_main:
        return
    cfg, keep_before = run.cfg, run.state.step + 1 if ckpt and run.state.step > 0 else 0
    run.log = RunLog(
        run.run_dir,
        tensorboard=cfg.run.tensorboard,
        resume_from_step=keep_before,
        wandb_project="veriloop" if cfg.run.wandb else None,
    )
    run.samples = SampleLog(run.run_dir, cfg.run.log_samples, resume_from_step=keep_before)


def _after_loop(run: RunParts) -> None:
    """Rank 0, once the steps are done: what the modes did, and the run's evaluation table."""
    say_modes_tally(run.cfg, run.run_dir, run.quiet)
    if any((run.run_dir / "eval").glob("*.json")):
        (run.run_dir / "summary.md").write_text(run_summary(run.run_dir / "eval"))


def _check_before_loading(cfg: ExperimentConfig) -> None:
    """Everything that can be wrong with ``cfg`` fails here, before any model loads."""
    cfg.validate()
    cfg.env.resolve()  # the environments exist (users' modules imported) before anything slow
    check_model(cfg.policy.model)
    check_backend_family(cfg.policy.model, cfg.rollout.backend)  # a VLM on vLLM, before anything loads
    check_chat_template_files(cfg)  # a template that drops the prompt, before the run folder is made
    check_device(cfg.policy.device)
    if cfg.rollout.backend == "vllm_server":  # an unreachable server fails now, not after loading
        _check_servers(cfg)
    if cfg.sft.steps > 0:
        from veriloop.algos.sft.data import check_source

        check_source(cfg.sft.source, cfg.env.id, cfg.env.kwargs)


def _build_run(cfg: ExperimentConfig, run_dir: Path, dist: DistContext, *, quiet: bool) -> RunParts:
    """Seed, then policy, critic, optimizer, schedule, a fresh state and the algorithm's parts."""
    say(quiet=quiet, text=modes_line(cfg))
    torch.manual_seed(cfg.rollout.seed)  # before the model: a tiny/random init is reproducible
    policy = build_policy(cfg)
    critic = build_critic(cfg, policy)
    sharded = None
    if dist.sharded:  # every rank starts from rank 0's weights, then keeps its rows (before the optimizer)
        from veriloop.algos.run.fsdp import shard

        dist.broadcast_params(list(trainable_state(policy, critic).values()))
        sharded = shard(policy, critic)
    optimizer = build_optimizer(cfg, policy, critic)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg))
    # SFT demonstrations use env seeds seed .. seed + examples - 1; RL problems come after them
    sft_seeds = cfg.sft.examples if cfg.sft.steps > 0 else 0
    return RunParts(
        cfg=cfg,
        algo=resolve(cfg.algo),
        policy=policy,
        critic=critic,
        optimizer=optimizer,
        scheduler=scheduler,
        state=TrainerState(next_seed=cfg.rollout.seed + sft_seeds),
        generator=torch.Generator().manual_seed(cfg.rollout.seed),
        run_dir=run_dir,
        dist=dist,
        quiet=quiet,
        sharded=sharded,
    )


def _restore(run: RunParts, resume: bool) -> Path | None:
    """With ``resume``: load the newest checkpoint that verifies and fits into ``run`` (weights,
    optimizer, schedule, state, shuffling generator; the RNG states too); a damaged newest one is
    reported and the previous one used (``checkpoint.resume_latest``). Returns its folder, or None."""
    if run.dist.sharded:
        return _restore_sharded(run, resume)
    apply = partial(_apply_checkpoint, run)
    found = None
    if resume and run.dist.is_main:
        warn = partial(print, file=sys.stderr)
        found = resume_latest(run.run_dir, apply, warn=lambda m: warn(f"veriloop: {m}"))
    ckpt = run.dist.broadcast_object(found[0] if found else None)
    if ckpt is not None and not run.dist.is_main:  # every rank reads the same folder (shared file system)
        apply(load_checkpoint(ckpt))  # also restores the python/numpy/torch RNG states
    if resume:
        say(quiet=run.quiet, text=_resumed_what(run, ckpt))
    return ckpt


def _resumed_what(run: RunParts, ckpt: Path | None) -> str:
    """What a resumed run continues, in words: the RL step, or the warm-up's step, or nothing yet."""
    cfg, state = run.cfg, run.state
    if ckpt is not None and state.step > 0:
        return f"resumed from {ckpt} at step {state.step} of {cfg.train.steps} (RL; any warm-up is done)"
    if ckpt is not None:
        return f"resumed from {ckpt} at step 0: the warm-up is done, RL starts"
    sft = complete_checkpoints(run.run_dir / "sft") if cfg.sft.steps > 0 else []
    if sft:
        done = int(sft[-1].name.split("-")[1])
        return f"resuming {run.run_dir}: the warm-up from step {done} (no RL step done yet)"
    return f"resuming {run.run_dir}: nothing was saved there yet (no complete checkpoint), so it starts at the beginning"


def _apply_checkpoint(run: RunParts, loaded: dict[str, Any]) -> None:
    """Put a loaded checkpoint into ``run``; raises (KeyError, ValueError...) when it does not fit.
    A sharded one (written by several ``train.parallel: fsdp`` ranks) is read whole."""
    from veriloop.algos.run.sharded_checkpoint import is_sharded, load_into_whole

    if is_sharded(loaded["model_dir"].parent):
        from veriloop.algos.run.fsdp import state_modules

        load_into_whole(loaded["model_dir"].parent, state_modules(run.policy, run.critic), run.optimizer)
    else:
        load_trainable_state(run.policy, run.critic, loaded["model_state"])
        run.optimizer.load_state_dict(loaded["optimizer"])
    _apply_loop_state(run, loaded)


def _apply_loop_state(run: RunParts, loaded: dict[str, Any]) -> None:
    """The schedule, trainer state and shuffling generator of a loaded checkpoint."""
    run.scheduler.load_state_dict(loaded["scheduler"])
    run.state = TrainerState(**loaded["trainer_state"]["state"])
    run.generator.set_state(torch.tensor(loaded["trainer_state"]["generator"], dtype=torch.uint8))


def _restore_sharded(run: RunParts, resume: bool) -> Path | None:
    """``_restore`` of a sharded run: every rank reads its rows of the newest checkpoint that
    verifies (``sharded_checkpoint.load_sharded``)."""
    from veriloop.algos.run.fsdp import state_modules
    from veriloop.algos.run.sharded_checkpoint import load_sharded, written_by

    found = None
    if resume:
        found = load_sharded(
            run.run_dir,
            dist=run.dist,
            modules=state_modules(run.policy, run.critic),
            optimizer=run.optimizer,
            whole_keys=trainable_parameters(run.policy, run.critic),
        )
    if found is not None:
        _apply_loop_state(run, found[1])
    if resume:
        text = _resumed_what(run, found[0] if found else None)
        if found is not None:  # the rank count may differ from the one that wrote it
            text += f"; written by {written_by(found[0])} rank(s), resumed on {run.dist.world_size}"
        say(quiet=run.quiet, text=text)
    return found[0] if found else None


def _sft_warmup(run: RunParts) -> None:
    """The SFT warm-up (``cfg.sft``) before RL, once per run (a resumed run does not redo it), then
    the run's step-0 checkpoint, which holds it (``sft/final`` keeps the warmed-up policy)."""
    from veriloop.algos.sft.train import sft_summary, warmup_from_config

    cfg, state, main = run.cfg, run.state, run.dist.is_main
    if main and cfg.eval.before_sft:  # the base model, logged with step 0 as eval_base/...
        state.history["eval_base"] = in_training.evaluate_step(
            cfg,
            run.policy,
            0,
            run.quiet,
            tag="base",
            prefix="eval_base",
            backend=eval_backend(run),
            reuse=True,
        )
    # every rank runs the same warm-up; only rank 0 saves it, and its weights are broadcast after it
    sft_metrics = warmup_from_config(cfg, run.policy, run_dir=run.run_dir / "sft" if main else None)
    state.sft_done = True
    state.history["sft"] = sft_metrics
    say(quiet=run.quiet, text=f"SFT warm-up done: {sft_summary(sft_metrics)}")
    if main and cfg.run.checkpoint_every > 0:
        checkpoint_run(run)  # step 0: a run cut before its first RL checkpoint keeps its warm-up
        # which makes the warm-up's own checkpoints (adapter + optimizer state each) redundant
        shutil.rmtree(run.run_dir / "sft" / "checkpoints", ignore_errors=True)


def _loop(run: RunParts) -> None:
    """RL steps ``state.step .. train.steps - 1``: the one step body over the run's batch source,
    synchronous for ``train.max_staleness`` 0, asynchronous (generation beside the update) above."""
    if run.cfg.train.max_staleness > 0 and run.dist.enabled:  # rank 0 generates, every rank trains
        from veriloop.algos.loop.async_ranks import RankedAsyncSource

        return run_steps(run, RankedAsyncSource(run))
    if run.cfg.train.max_staleness > 0:
        from veriloop.algos.loop.async_loop import AsyncSource

        return run_steps(run, AsyncSource(run))
    return run_steps(run, SyncSource(run))


def _rollout_backend(cfg: ExperimentConfig, policy: Policy, dist: DistContext) -> ServingBackend | None:
    """The run's engine (``agents.backends.serving_backend``, as ``veriloop eval`` builds it): vLLM,
    updated in place after every optimizer step, or vLLM servers (rank 0 pushes, every rank waits);
    None: each rollout call uses ``engine.default_backend`` (the HF backend). Asynchronous training
    with several ranks: rank 0 alone generates, so it alone holds the engine (or the servers'
    connection, as one process) and the other ranks none (``async_ranks``)."""
    if cfg.train.max_staleness > 0 and dist.enabled:
        if not dist.is_main:
            return None
        dist = DistContext()  # one process: no other rank joins its pushes
    return serving_backend(cfg.rollout, policy, dist=dist)


def _check_servers(cfg: ExperimentConfig) -> None:
    from veriloop.agents.backends.http_client import RetryPolicy, check_servers

    server = cfg.rollout.server
    check_servers(server.urls, RetryPolicy(server.retries, server.backoff_s, server.timeout_s))


def _model_card(cfg: ExperimentConfig, run_dir: Path, state: TrainerState) -> str:
    """README.md of ``final/``: what trained this policy, and how it evaluated."""
    summary = (
        (run_dir / "summary.md").read_text() if (run_dir / "summary.md").is_file() else "(no evaluation)\n"
    )
    base = cfg.policy.model
    return (
        f"# {cfg.run_name}: a veriloop policy\n\n"
        f"Base model `{base}`{' with a LoRA adapter (r=' + str(cfg.policy.lora_r) + ')' if cfg.policy.lora else ''}, "
        f"trained by veriloop: {cfg.sft.steps} SFT steps ({cfg.sft.source}), then {state.step} RL steps of "
        f"`{cfg.algo.name}` on `{cfg.env.id}` ({cfg.rollout.prompts_per_step} problems x {cfg.rollout.group_size} "
        f"samples per step, lr {cfg.train.lr}). The full config is `../config.yaml`; load with "
        "`veriloop.agents.load_policy(<this folder>)`.\n\n## Evaluation (held-out problems: sources below the table)\n\n"
        + summary
    )
