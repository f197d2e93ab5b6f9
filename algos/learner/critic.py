"""Critics for PPO: a value head on the policy's backbone, or a separate value model.

Both give V(t) for every token position t *aligned like the log-probs*: values[:, t] is the value
of the state x_<t in which token x_t was chosen, i.e. the head applied to the hidden state at
position t - 1 (position 0 gets 0). GAE then pairs values[:, t] with the action at position t.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

import torch
from torch import nn

from veriloop.agents.forward import on_model_device
from veriloop.algos.learner.batch import TokenBatch


class ValueHead(nn.Module):
    """Scalar head: V = w^T h + b on hidden states h [B, T, H] -> [B, T].

    Initialised near zero (small weights, zero bias) so the first advantages are close to the
    rewards rather than dominated by random values.
    """

    def __init__(self, hidden_size: int):
        super().__init__()
        self.proj = nn.Linear(hidden_size, 1)
        nn.init.normal_(self.proj.weight, std=1.0 / (hidden_size + 1))
        nn.init.zeros_(self.proj.bias)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if hidden.dim() != 3:
            raise ValueError(f"ValueHead expects hidden states [B, T, H], got {tuple(hidden.shape)}")
        return self.proj(hidden.to(self.proj.weight.dtype)).squeeze(-1)  # [B, T]


def _hidden_size(model: Any) -> int:
    cfg = getattr(model, "config", None)
    text_cfg = getattr(cfg, "text_config", None) or cfg  # VLMs keep the LM size in text_config
    size = getattr(text_cfg, "hidden_size", None)
    if size is None:
        raise ValueError(
            f"cannot find hidden_size on {type(model).__name__}.config; pass hidden_size explicitly"
        )
    return int(size)


class ValueModel(nn.Module):
    """A backbone that returns hidden states plus a ``ValueHead``.

    ``critic="value_head"``: ``ValueModel(policy_model)``, the backbone IS the policy (shared
    weights, also a peft LoRA model: the last entry of ``hidden_states`` is used). Only the head is
    new; put its parameters in the optimizer.
    ``critic="separate"``: ``ValueModel.separate(policy_model)``, its own copy of the policy's pretrained weights.
    """

    def __init__(self, backbone: nn.Module, head: ValueHead | None = None, *, hidden_size: int | None = None):
        super().__init__()
        self.backbone = backbone
        self.head = head if head is not None else ValueHead(hidden_size or _hidden_size(backbone))
        first = next(iter(backbone.parameters()), None)
        if first is not None:
            self.head.to(first.device)  # beside its backbone (a GPU policy's)

    @classmethod
    def separate(cls, source: str | Path | nn.Module | Any) -> ValueModel:
        """A separate value model: the policy's *pretrained* weights plus a fresh value head, as
        LLM PPO initialises its critic (InstructGPT; OpenRLHF and verl load the critic from the
        actor's checkpoint). ``source``:

        * the policy model (``nn.Module``; a peft model contributes its base weights, the LoRA
          adapter is left out): an independent, fully trainable copy;
        * a local path: ``AutoModelForCausalLM.from_pretrained``;
        * a transformers config: randomly initialised (for tests of the plumbing only).
        """
        from transformers import AutoModelForCausalLM

        if isinstance(source, nn.Module):
            backbone = _pretrained_copy(source)
        elif isinstance(source, str | Path):
            backbone = AutoModelForCausalLM.from_pretrained(str(source))
        else:
            backbone = AutoModelForCausalLM.from_config(source)
        return cls(backbone)

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, **model_inputs: Any
    ) -> torch.Tensor:
        """Values [B, T] aligned with token log-probs (see the module docstring), on the inputs' device."""
        home = input_ids.device
        input_ids, attention_mask, model_inputs = on_model_device(
            self.backbone, input_ids, attention_mask, model_inputs
        )
        out = self.backbone(
            input_ids=input_ids,
            attention_mask=attention_mask,
            output_hidden_states=True,
            logits_to_keep=1,
            **model_inputs,
        )  # the values come from the hidden states: skip the vocabulary projection
        hidden = out.hidden_states[-1]  # [B, T, H]
        v = self.head(hidden)  # [B, T], value of the state ending at position t
        return torch.cat([v.new_zeros(v.shape[0], 1), v[:, :-1]], dim=1).to(home)  # state before token t


def _pretrained_copy(model: nn.Module) -> nn.Module:
    """An independent copy of ``model``'s pretrained weights, every parameter trainable. A peft
    model is copied, merged and unwrapped: while its adapter is still at the zero initialisation
    (the critic is built before any update) this is exactly the base model."""
    import copy

    clone = copy.deepcopy(model)
    if hasattr(clone, "merge_and_unload"):  # peft: base weights (+ the adapter's delta, 0 at init)
        clone = cast(Any, clone).merge_and_unload()
    for p in clone.parameters():
        p.requires_grad_(True)
    return clone


def values(critic: ValueModel, batch: TokenBatch) -> torch.Tensor:
    """V(t) for every position of ``batch`` [B, T], 0 off the loss mask (where no action is taken)."""
    if not isinstance(critic, ValueModel):
        raise TypeError(
            f"values() needs a ValueModel (ValueModel(policy) or ValueModel.separate(...)), got {type(critic)}"
        )
    v = critic(batch.input_ids, batch.attention_mask, **batch.extras)
    return v * batch.loss_mask.to(v.dtype)
