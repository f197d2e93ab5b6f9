"""The sampler serves what was just trained: a fixed probe after every weight sync.

A backend with its own copy of the weights (vLLM in-process or on servers, any
:class:`~veriloop.agents.backends.base.ServingBackend`) is handed the trained weights after every update,
by the synchronous and the asynchronous batch source alike (``algos/loop/source.py``). A
sync that silently failed (an adapter not loaded, a stale copy, a push to the wrong engine) leaves
a run that samples from old weights and trains on the wrong policy's log-probs without any error.
After every sync the backend samples a few tokens from a fixed probe prompt at temperature 1
(the recorded log-probs are then the model's own), the trainer scores the same tokens, and the mean
``|log p_sampler - log p_trainer|`` over them (``sync/probe_gap``) must be within a tolerance that
depends on the precision (:data:`TOLERANCE`); else :class:`SamplerMismatchError` stops the run,
naming the backend and the weight version.

A frozen sampler (``algo.sampler_weights=initial``, preset ``semi_opd``) is the stated exception: it
is meant to serve the initial student, not the trained weights, so it is never synced after an
update, and each load of the initial weights into it (a resumed run, after an evaluation on the
engine) is probed against the initial weights instead (``frozen_sampler.InitialSampler``): the same
check, of the weights it must serve.
"""

from __future__ import annotations

from typing import Any

import torch

from veriloop.agents.backends.base import GenRequest
from veriloop.agents.forward import token_logprobs
from veriloop.agents.sampling_params import SamplingParams
from veriloop.algos.run.guards import RunStoppedError

#: The probe's text (no chat template: it checks the weights, not the prompt).
PROBE_TEXT = "Question: what is 17 + 25? Think step by step, then give the answer. Answer:"
#: Tokens the sampler draws from the probe.
PROBE_TOKENS = 8
#: Mean |log-prob difference| allowed per precision of the trainer or the sampler, whichever is
#: coarser (:func:`loosest_precision`). Measured on the default model
#: (HF engine against the trainer, 8 probes of 1-8 tokens): fp32 ~1e-5 (vLLM in fp32: k3 7e-11, the
#: same order), so 1e-3 leaves a 100x margin; bf16 0.02-0.10 (sampler and trainer round independently;
#: one token's log ratio reaches ~0.4, docs/precision.md), so 0.5: in bf16 the probe catches a sampler
#: on other weights (a stale adapter after many steps, another model), not one step's change.
TOLERANCE = {"fp32": 1e-3, "bf16": 0.5}


class SamplerMismatchError(RunStoppedError):
    """The sampler's log-probs of the probe are not the trainer's: it does not serve the trained weights."""


def probe_gap(policy: Any, backend: Any, seed: int = 0) -> tuple[float, int]:
    """Mean ``|log p_sampler - log p_trainer|`` over the probe's sampled tokens, and their number."""
    ids = list(policy.tokenizer(PROBE_TEXT, add_special_tokens=False)["input_ids"])
    key = ("veriloop-sync-probe", seed)
    sampling = SamplingParams(temperature=1.0, max_new_tokens=PROBE_TOKENS, seed=seed)
    try:
        res = backend.generate(
            [GenRequest(key, ids, PROBE_TOKENS)], sampling, torch.Generator().manual_seed(seed)
        )[0]
    finally:
        backend.release(key)
    if not res.token_ids:
        return 0.0, 0
    full = torch.tensor([ids + list(res.token_ids)])
    was_training = policy.model.training
    policy.model.eval()
    try:
        with torch.no_grad():
            lp, _ = token_logprobs(policy.model, full, torch.ones_like(full), first_position=len(ids))
    finally:
        policy.model.train(was_training)
    trainer = lp[0, len(ids) :].double()
    sampler = torch.tensor(res.logprobs, dtype=torch.float64)
    return float((trainer - sampler).abs().mean()), len(res.token_ids)


def loosest_precision(policy: Any, backend: Any) -> str:
    """``bf16`` when the trainer (``policy.precision``) or the sampler (``backend.precision``: vLLM
    serving bf16 weights to an fp32 trainer) rounds in bf16, else ``fp32``: the probe can only be as
    tight as the coarser of the two."""
    sides = (getattr(policy, "precision", "fp32"), getattr(backend, "precision", None) or "fp32")
    return "fp32" if all(p == "fp32" for p in sides) else "bf16"


def check_sampler(
    policy: Any,
    backend: Any,
    *,
    version: int,
    tolerance: float | None = None,
    serves: str = "the weights just trained",
) -> float:
    """:func:`probe_gap` within the tolerance (None: :data:`TOLERANCE` of :func:`loosest_precision`),
    else :class:`SamplerMismatchError`; returns the gap. ``policy`` holds the weights the sampler
    must serve (``serves`` says which, in the error)."""
    precision = loosest_precision(policy, backend)
    tol = TOLERANCE[precision] if tolerance is None else tolerance
    gap, n = probe_gap(policy, backend, seed=version)
    if gap > tol:
        name = getattr(backend, "name", None) or type(backend).__name__
        raise SamplerMismatchError(
            f"the sampler ({name}) does not serve {serves}: after the weight sync to version "
            f"{version} its log-probs of a fixed probe ({n} tokens) differ from the trainer's by {gap:.3g} on "
            f"average (tolerance {tol:g} for {precision}). The sync failed or loaded other weights (a stale "
            "adapter, another engine); resume from the last checkpoint, or raise train.sync_probe_tolerance "
            "if this precision needs more room"
        )
    return gap
