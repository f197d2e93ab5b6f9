"""Fully sharded data parallelism (``train.parallel: fsdp``): PyTorch FSDP2's ``fully_shard``.

Data parallelism (:mod:`veriloop.algos.run.distributed`) keeps a whole copy of the model, its
gradients and AdamW's two moments on every rank. Here each of W ranks keeps 1/W of them::

    rank r holds           rows r/W of every parameter (a DTensor sharded on dim 0), of its
                           gradient, and of AdamW's exp_avg / exp_avg_sq
    forward / backward     each decoder layer all-gathers its weights just before it runs and
                           frees them after; gradients are reduce-scattered (summed) to the owners
    optimizer step         every rank updates only its own rows

Everything else is the data-parallel code, unchanged: rank r rolls out its own groups, all ranks
gather the batch, compute the advantages identically and train rows r, r+W, ... of each
mini-batch; each rank's loss is already in the whole mini-batch's units (``loss_normalisers``), so
the *summed* gradient is the single-process one (the gradient divide factor is set to 1).

Two rules that sharding adds, both kept here:

* **Lockstep.** A forward or backward pass is a collective: every rank must run the same number
  of them. :func:`~veriloop.algos.run.distributed.lockstep` pads a rank's micro-batches with zero-weight copies up to the largest
  count of any rank, and ``update_step(pad_micro_batches=...)`` runs every one of them, even after
  a non-finite loss (the ranks then agree to skip the step, :func:`~veriloop.algos.run.distributed.agree_finite`).
* **Generation needs whole weights.** HF ``generate`` on sharded weights would all-gather at every
  decoded token, and ranks stop decoding at different times. :meth:`Sharded.gathered` all-gathers
  every layer once (all ranks), holds the whole weights while a rank generates, evaluates, or
  sends weights to vLLM, and frees them after. With ``rollout.backend: vllm_server`` the trainer
  never generates, which is the layout for models that do not fit one device (docs/scaling.md).

Checkpoints are sharded too (:mod:`veriloop.algos.run.sharded_checkpoint`); the final model is
gathered to rank 0 and saved in the ordinary ``save_policy`` format.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from veriloop.agents.policy import Policy
from veriloop.algos.learner.critic import ValueModel
from veriloop.algos.run.checkpoint import missing_trained
from veriloop.algos.run.distributed import DistContext

#: Names of the module lists that hold a model's repeated blocks (HF decoders, ViTs, GPT-2's ``h``).
BLOCK_LISTS = ("layers", "layer", "h", "blocks")


def is_sharded(model: Any) -> bool:
    """Whether ``model`` was sharded by :func:`shard`. Its forward passes must then each be
    followed by their own backward: running a group's shared prompt once and the rows from its
    KV cache would free the gathered weights the prompt's backward still needs, so the update
    shares a sharded model's prompts only packed with the rows into one forward pass
    (``token_logprobs(shared_prefix=..., packed_only=True)``)."""
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def decoder_blocks(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks of ``model`` (every entry of an ``nn.ModuleList`` named in
    :data:`BLOCK_LISTS`, e.g. ``model.layers`` of a Llama and, in a VLM, the vision tower's
    layers too). Each becomes its own FSDP unit: its weights are gathered only while it runs."""
    blocks: list[nn.Module] = []
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and name.rsplit(".", 1)[-1] in BLOCK_LISTS:
            blocks += [m for m in module if any(True for _ in m.parameters())]
    return blocks


def _shard_model(model: nn.Module, mesh: Any) -> list[Any]:
    """``fully_shard`` each block, then the model (embeddings, norms, a tied head: one unit)."""
    from torch.distributed.fsdp import fully_shard

    units: list[Any] = []
    for block in decoder_blocks(model):
        units.append(fully_shard(block, mesh=mesh, reshard_after_forward=True))
    units.append(fully_shard(model, mesh=mesh, reshard_after_forward=True))
    return units


@dataclass
class Sharded:
    """The FSDP units of one run (policy, frozen reference, critic), in the order sharded.

    Attributes:
        units: Every module ``fully_shard`` was applied to (blocks first, each model's root last).
        policy_units: Those of the policy model (what :meth:`gathered` gathers).
    """

    units: list[Any]
    policy_units: list[Any]

    @contextlib.contextmanager
    def gathered(self) -> Iterator[None]:
        """Hold the whole weights on every rank while the block runs (collective: all ranks enter).

        Inside, forward passes communicate nothing, so ranks may run different numbers of them
        (sampling, evaluation on rank 0, sending weights to vLLM), and ``named_parameters()``
        yields plain whole tensors. On exit each rank keeps its shard only, as before.
        """
        for unit in self.policy_units:
            unit.set_reshard_after_forward(False, recurse=False)
        for unit in self.policy_units:
            unit.unshard()
        try:
            yield
        finally:
            for unit in self.policy_units:
                unit.reshard()
                unit.set_reshard_after_forward(True, recurse=False)


def shard(policy: Policy, critic: ValueModel | None, mesh: Any = None) -> Sharded:
    """Shard the policy (full or LoRA), its frozen reference and the critic, in place.

    Call on every rank, after the process group is up and before the optimizer is built (the
    optimizer must see the sharded parameters). Every rank must hold the same weights on entry
    (each keeps its own rows of them). Gradients are *summed* over ranks (divide factor 1, plain
    ``SUM`` collectives, which gloo also runs): each rank's loss is already normalised by the
    whole mini-batch's counts.
    """
    if not torch.distributed.is_initialized():
        raise RuntimeError(
            "train.parallel=fsdp needs a process group: launch with `torchrun --nproc_per_node N` "
            "or `accelerate launch --num_processes N`"
        )
    models: list[nn.Module] = [policy.model]
    if policy.frozen_reference is not None:
        models.append(policy.frozen_reference)
    if critic is not None and critic.backbone is not policy.model:
        models.append(critic.backbone)  # critic="separate": its own model
    policy_units = _shard_model(policy.model, mesh)
    units: list[Any] = list(policy_units)
    for model in models[1:]:
        units += _shard_model(model, mesh)
    if critic is not None:  # the value head is its own unit: a mix of DTensors and tensors cannot be clipped
        from torch.distributed.fsdp import fully_shard

        units.append(fully_shard(critic.head, mesh=mesh, reshard_after_forward=True))
    for unit in units:
        unit.set_gradient_divide_factor(1.0)
        unit.set_force_sum_reduction_for_comms(True)
    return Sharded(units=units, policy_units=policy_units)


# ------------------------------------------------------------------------------------ memory


def local_bytes(tensors: Any) -> int:
    """Bytes this rank stores for ``tensors`` (a DTensor counts its local shard only)."""
    from torch.distributed.tensor import DTensor

    total = 0
    for t in tensors:
        if isinstance(t, torch.Tensor):
            local = t.to_local() if isinstance(t, DTensor) else t
            total += local.numel() * local.element_size()
    return total


def training_state_bytes(optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """This rank's bytes of the optimizer's parameters and of its state (AdamW: two moments + step).

    Frozen weights (a LoRA base model, a KL reference) are not in the optimizer and not counted.
    """
    params = [p for g in optimizer.param_groups for p in g["params"]]
    state = [v for s in optimizer.state.values() for v in s.values()]
    return {"params": local_bytes(params), "optimizer_state": local_bytes(state)}


# ------------------------------------------------------------------------------------ whole weights


def state_modules(policy: Policy, critic: ValueModel | None) -> nn.ModuleDict:
    """One module holding everything the optimizer trains, for state dicts: ``policy`` and, with a
    critic, ``critic`` (the value head alone when it sits on the policy's backbone)."""
    parts: dict[str, nn.Module] = {"policy": policy.model}
    if critic is not None:
        parts["critic"] = critic.head if critic.backbone is policy.model else critic
    return nn.ModuleDict(parts)


def full_trainable_state(policy: Policy, critic: ValueModel | None) -> dict[str, torch.Tensor]:
    """The trained weights, whole, on CPU, on rank 0 (other ranks get ``{}``); collective.

    Keys are ``policy.<name>`` / ``critic.<name>`` as in :func:`state_modules`. Frozen weights
    (a LoRA base model) are left out: they are the ones the run started from.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=True)
    state = get_model_state_dict(state_modules(policy, critic), options=options)
    return {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}


def load_trainable_state(policy: Policy, critic: ValueModel | None, state: dict[str, torch.Tensor]) -> None:
    """Copy :func:`full_trainable_state`'s output into an *unsharded* policy (and critic).

    Raises ``KeyError`` naming a key the model does not have, or a trainable weight missing from
    ``state`` (a state from another config).
    """
    target = state_modules(policy, critic)
    missing, unexpected = target.load_state_dict(state, strict=False)
    lost = missing_trained(target, missing)
    if unexpected or lost:
        raise KeyError(
            f"the gathered weights do not fit this model (unexpected {sorted(unexpected)[:3]}, missing "
            f"{lost[:3]}): was the run resumed or saved with another config?"
        )


def save_final(
    policy: Policy,
    critic: ValueModel | None,
    path: Path,
    *,
    dist: DistContext,
    card: str,
    rebuild: Callable[[], Policy],
) -> None:
    """Save the sharded policy as ``save_policy`` does (the format ``load_policy`` and vLLM read).

    Every rank takes part in gathering the trained weights; rank 0 loads them into a fresh
    unsharded copy (``rebuild()``: the policy as the config builds it, the base weights the run
    started from) and saves that. Rank 0 then holds one whole copy in CPU memory for a moment.
    """
    from veriloop.agents.loading import save_policy

    state = full_trainable_state(policy, critic)
    if dist.is_main:
        whole = rebuild()
        load_trainable_state(whole, None, {k: v for k, v in state.items() if k.startswith("policy.")})
        save_policy(whole, path, card=card)
    dist.barrier()
