"""Value head on the policy backbone (plain and LoRA) and a separate value model."""

from __future__ import annotations

import torch

from veriloop.algos.learner.algorithm import resolve
from veriloop.algos.learner.batch import collate
from veriloop.algos.learner.critic import ValueHead, ValueModel, values
from veriloop.algos.learner.step_settings import UpdateSettings


def _batch(make_traj):
    trajs = [make_traj([([10, 11], [20], 1.0), ([12], [], 0.0)]), make_traj([([13], [], -1.0)])]
    return collate(trajs, [[0.0] * len(t.token_ids) for t in trajs])


def test_value_head_aligned_with_logprob_positions(tiny_llama, make_traj):
    vm = ValueModel(tiny_llama)
    batch = _batch(make_traj)
    v = vm(batch.input_ids, batch.attention_mask)  # [B, T]
    assert v.shape == batch.input_ids.shape and torch.all(v[:, 0] == 0)
    hidden = tiny_llama(
        input_ids=batch.input_ids, attention_mask=batch.attention_mask, output_hidden_states=True
    )
    want = vm.head(hidden.hidden_states[-1])[:, :-1]  # value of the state x_<t sits at t
    assert torch.allclose(v[:, 1:], want, atol=1e-6)
    masked = values(vm, batch)
    assert torch.all(masked[batch.loss_mask == 0] == 0)
    v.sum().backward()
    assert vm.head.proj.weight.grad is not None


def test_value_head_on_lora_model(tiny_llama, make_traj):
    from peft import LoraConfig, get_peft_model

    lora = get_peft_model(tiny_llama, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    vm = ValueModel(lora, ValueHead(32))
    out = values(vm, _batch(make_traj))
    assert out.shape == (2, 7) and torch.isfinite(out).all()


def test_separate_value_model_from_config(make_traj):
    from transformers import LlamaConfig

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32
    )
    vm = ValueModel.separate(cfg)
    assert values(vm, _batch(make_traj)).shape == (2, 7)


def test_ppo_step_with_value_head_on_a_lora_policy(tiny_llama, make_traj, with_logprobs):
    """critic="value_head" on a LoRA policy: the value loss trains the head and the adapters (the
    shared backbone's only trainable weights) and never the frozen base weights."""
    from peft import LoraConfig, get_peft_model

    from veriloop.agents.forward import token_logprobs
    from veriloop.algos.learner.prepare import prepare_batch
    from veriloop.algos.learner.update import update_step
    from veriloop.configs.presets import load_preset

    lora = get_peft_model(tiny_llama, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    critic = ValueModel(lora)
    trajs = [
        make_traj([([10, 11], [20], 1.0), ([12], [], 0.0)]),
        make_traj([([13, 14], [20], 0.0), ([15], [], 0.0)]),
    ]
    base = collate(trajs, [[0.0] * len(t.token_ids) for t in trajs])
    with torch.no_grad():
        lp, _ = token_logprobs(lora, base.input_ids, base.attention_mask)
    trajs = [with_logprobs(t, lp[i, : len(t.token_ids)]) for i, t in enumerate(trajs)]
    cfg = load_preset("ppo", kl_coef=0.0)
    batch, _ = prepare_batch(trajs, resolve(cfg), model=lora, critic=critic)
    assert batch.returns is not None and batch.old_values is not None
    params = {id(p): p for p in critic.parameters() if p.requires_grad}  # adapters + head
    named = dict(lora.named_parameters())
    frozen = {n: p.detach().clone() for n, p in named.items() if not p.requires_grad}
    adapters = {n: p.detach().clone() for n, p in named.items() if p.requires_grad}
    head = critic.head.proj.weight.detach().clone()
    opt = torch.optim.SGD(list(params.values()), lr=0.1)
    m = update_step(
        lora, opt, batch, resolve(cfg), UpdateSettings(micro_batch_size=2, max_grad_norm=1e9), critic=critic
    )
    assert m["skipped"] == 0 and m["loss/value"] > 0
    assert not torch.equal(head, critic.head.proj.weight)
    assert any(not torch.equal(v, named[n]) for n, v in adapters.items())
    assert all(torch.equal(v, named[n]) for n, v in frozen.items())
